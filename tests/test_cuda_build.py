"""The CUDA build and the ops' argument checks, without compiling or running CUDA code.

(a) the built library, when the extension was built with CUDA (cuobjdump, no GPU needed):
    its SASS has no MUFU.TANH (the --use_fast_math tanh, rel. error ~2^-11) in the NAC kernels;
    it has code for every arch the build targets (sm_80 and sm_90 by default); its bf16/fp16
    matrix kernels (the tensor-core kernels of csrc/nac_cuda_mma.cu) run HMMA/HGMMA; no
    bf16/fp16/fp32 NAC kernel uses local memory (spills) and none needs more than 48 KB of
    static shared memory;
(b) bench/cuda_resources.py's parsers (ptxas report, demangled names, SASS, resource usage) and
    its problem rules on canned samples;
(c) the argument checks of csrc/nac_checks.h, shared by the CPU and CUDA kernels, through the CPU
    kernel: every bad tensor argument of nac_fwd / nac_bwd / nac_noise is a RuntimeError naming
    it.  Device mismatches are checked with a 'meta' tensor and a redispatch to the CPU kernel
    (the dispatcher alone would route a meta argument to the fake implementation);
(d) the 'cuda' backend stays experimental until its tensor-core kernels have passed on a GPU
    (tests/test_cuda_mma_gpu.py): backend="auto" on CUDA tensors picks Triton, never it; the host
    refuses bf16/fp16 below compute capability 8.0 before any launch.

The tensor-core kernels' fragment and ldmatrix index math is emulated on the CPU in
tests/test_cuda_mma_layout.py.

Compiling csrc/*.cu with ptxas' report (registers, spills, shared memory, HMMA count per
kernel and arch) is bench/compile_check.py's job, once per CI run (tests/test_compile_check.py).
"""
import importlib.util
import os
import re

import pytest
import torch

from nac_fast.ops.dispatch import cuda_extension_built, extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_resources():
    spec = importlib.util.spec_from_file_location(
        "cuda_resources", os.path.join(ROOT, "bench", "cuda_resources.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


res = _load_resources()

needs_ext = pytest.mark.skipif(extension() is None, reason="no compiled extension")


# ---------------------------------------------------------------------------------------------
# (a) SASS of the built library
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not cuda_extension_built(), reason="extension built without CUDA kernels")
def test_built_sass_has_no_fast_math_tanh():
    tool = res.find_cuobjdump()
    if tool is None:
        pytest.fail("the extension has CUDA kernels but no cuobjdump was found to check their "
                    "SASS: install triton (its wheel ships triton/backends/nvidia/bin/cuobjdump) "
                    "or set CUDA_HOME to a toolkit with bin/cuobjdump")
    counts = res.sass_mufu_counts(extension().__file__, tool)
    archs = {arch for arch, _ in counts}
    assert archs, "no NAC kernel found in the SASS of " + extension().__file__
    for arch in archs:
        assert any("fwd_kernel" in f for a, f in counts if a == arch), f"no fwd_kernel for sm_{arch}"
    bad = sorted(f"sm_{a} {f}: {c['TANH']}" for (a, f), c in counts.items() if c.get("TANH"))
    assert not bad, "MUFU.TANH (fast-math tanhf) in: " + "; ".join(bad)


def _cuobjdump():
    tool = res.find_cuobjdump()
    if tool is None:
        pytest.fail("the extension has CUDA kernels but no cuobjdump was found to check them")
    return tool


def _built_archs() -> set:
    """The archs the build targeted: TORCH_CUDA_ARCH_LIST as setup.py reads it (default 8.0;9.0)."""
    bf = res._build_flags()
    spec = os.environ.get("TORCH_CUDA_ARCH_LIST", bf.DEFAULT_CUDA_ARCHS)
    found = (re.match(r"\s*(\d+)\.(\d+)", a) for a in re.split(r"[;, ]+", spec))
    return {10 * int(m.group(1)) + int(m.group(2)) for m in found if m}


@pytest.mark.skipif(not cuda_extension_built(), reason="extension built without CUDA kernels")
def test_built_library_runs_tensor_cores_on_the_16bit_paths():
    """Every bf16/fp16 matrix kernel (fwd/bwd_keys, 4 code widths) of every built arch has
    HMMA/HGMMA instructions, and every targeted arch (sm_80, sm_90 by default) is in the
    library."""
    counts = res.sass_op_counts(extension().__file__, _cuobjdump())
    names = res.demangle([f for _, f in counts])
    rows = {}
    for (arch, f), c in counts.items():
        kernel, dtype, D = res.describe(names[f])
        rows[(arch, kernel)] = dict(kernel=kernel, dtype=dtype, D=D, arch=arch,
                                    mma_count=sum(c.get(m, 0) for m in res.MMA_OPS))
    archs = {a for a, _ in rows}
    assert _built_archs() <= archs, (sorted(_built_archs()), sorted(archs))
    for arch in archs:
        mma = [r for (a, _), r in rows.items() if a == arch and res.is_matrix_kernel_16bit(r)]
        # fwd + bwd_keys, bf16 + fp16, D in 32/64/128/256
        assert len(mma) == 16, (arch, sorted(r["kernel"] for r in mma))
        assert {r["D"] for r in mma} == {"32", "64", "128", "256"}
        empty = [r["kernel"] for r in mma if not r["mma_count"]]
        assert not empty, f"sm_{arch}: no HMMA/HGMMA in " + ", ".join(empty)


@pytest.mark.skipif(not cuda_extension_built(), reason="extension built without CUDA kernels")
def test_built_library_has_no_spills_and_fits_static_shared_memory():
    """cuobjdump's resource usage of the built kernels: no local memory (where spills go) on the
    bf16/fp16/fp32 paths; static shared memory within 48 KB (the per-block limit without the
    dynamic opt-in; cuobjdump adds the 1 KB the arch reserves per block on sm_90)."""
    usage = res.library_resource_usage(extension().__file__, _cuobjdump())
    assert usage, "no NAC kernel in the resource usage of " + extension().__file__
    names = res.demangle([f for _, f in usage])
    spills, smem = [], []
    for (arch, f), u in usage.items():
        kernel, dtype, _ = res.describe(names[f])
        if dtype in res.NO_SPILL_DTYPES and (u["LOCAL"] or u["STACK"]):
            spills.append(f"sm_{arch} {kernel}: LOCAL {u['LOCAL']} STACK {u['STACK']}")
        if u["SHARED"] > 48 * 1024 + 1024:
            smem.append(f"sm_{arch} {kernel}: {u['SHARED']} B")
    assert not spills, "spills: " + "; ".join(spills)
    assert not smem, "static shared memory over 48 KB: " + "; ".join(smem)


# ---------------------------------------------------------------------------------------------
# (b) parsers, on canned samples
# ---------------------------------------------------------------------------------------------

FWD_BF16 = ("_ZN50_GLOBAL__N__c1c25ca0_11_nac_cuda_cu_009c5542_1149710fwd_kernelIN3c108BFloat16EfLi256"
            "EEEvPKT0_PKT_PS3_S9_S9_llilb")
BWD_HALF = ("_ZN50_GLOBAL__N__c1c25ca0_11_nac_cuda_cu_009c5542_1149715bwd_keys_kernelIN3c104HalfEfLi64"
            "EEEvPKT0_PKT_S5_S5_PS3_llil")
NOISE = "_ZN50_GLOBAL__N__c1c25ca0_11_nac_cuda_cu_009c5542_1149712noise_kernelEPfPKlfl"

PTXAS_SAMPLE = f"""\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{FWD_BF16}' for 'sm_80'
ptxas info    : Function properties for {FWD_BF16}
    16 bytes stack frame, 48 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 33536 bytes smem, 424 bytes cmem[0]
ptxas info    : Compile time = 512.250 ms
ptxas info    : Function properties for _Z6helperf
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '{BWD_HALF}' for 'sm_80'
ptxas info    : Function properties for {BWD_HALF}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 33536 bytes smem, 416 bytes cmem[0]
ptxas info    : Compile time = 301.000 ms
ptxas info    : Compiling entry function '{NOISE}' for 'sm_80'
ptxas info    : Function properties for {NOISE}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 17 registers, used 0 barriers, 380 bytes cmem[0]
"""


def test_parse_ptxas_sample():
    rows = res.parse_ptxas(PTXAS_SAMPLE)
    assert [r["mangled"] for r in rows] == [FWD_BF16, BWD_HALF, NOISE]  # entries only
    fwd, bwd, noise = rows
    assert (fwd["arch"], fwd["registers"], fwd["spill_store_bytes"], fwd["spill_load_bytes"],
            fwd["smem_bytes"], fwd["stack_bytes"]) == (80, 128, 48, 44, 33536, 16)
    assert (bwd["registers"], bwd["spill_store_bytes"], bwd["smem_bytes"]) == (80, 0, 33536)
    assert (noise["registers"], noise["smem_bytes"], noise["stack_bytes"]) == (17, 0, 0)


def test_parse_ptxas_rejects_a_truncated_report():
    with pytest.raises(ValueError, match="incomplete ptxas report"):
        res.parse_ptxas(PTXAS_SAMPLE.split("ptxas info    : Used 128")[0])


def test_demangle_and_describe():
    names = res.demangle([FWD_BF16, BWD_HALF, NOISE])
    assert names[FWD_BF16].startswith("void (anonymous namespace)::fwd_kernel<c10::BFloat16, float, 256>(")
    assert res.describe(names[FWD_BF16]) == ("fwd_kernel<c10::BFloat16, float, 256>", "bf16", "256")
    assert res.describe(names[BWD_HALF]) == ("bwd_keys_kernel<c10::Half, float, 64>", "fp16", "64")
    assert res.describe(names[NOISE]) == ("noise_kernel", "", "")
    # libstdc++'s demangler (the fallback) agrees with the tool path where the toolkit has one
    assert res._cxa_demangle(FWD_BF16) == names[FWD_BF16]
    assert res.describe("void (anonymous namespace)::fwd_kernel<double, double, 32>(double const*)") \
        == ("fwd_kernel<double, double, 32>", "fp64", "32")
    assert res.describe("void (anonymous namespace)::prologue_kernel<float, float>(float const*)") \
        == ("prologue_kernel<float, float>", "fp32", "")


def _row(kernel, dtype, arch=80, spill=0, smem=33536):
    return {"kernel": kernel, "arch": arch, "dtype": dtype, "D": "64", "registers": 96,
            "spill_store_bytes": spill, "spill_load_bytes": spill, "smem_bytes": smem,
            "stack_bytes": 0, "mma_instr": "HMMA", "mma_count": 64, "source": "nac_cuda.cu",
            "compile_s": 1.0}


def test_problems():
    rows = [_row("fwd_kernel<c10::BFloat16, float, 64>", "bf16", spill=24),
            _row("fwd_kernel<c10::Half, float, 64>", "fp16", arch=90, spill=8),
            _row("fwd_kernel<float, float, 64>", "fp32", spill=4),
            _row("fwd_kernel<double, double, 64>", "fp64", spill=64),     # fp64 may spill
            _row("bwd_keys_kernel<c10::Half, float, 64>", "fp16"),         # clean
            _row("big<float>", "fp32", smem=48 * 1024 + 4),
            _row("edge<float>", "fp32", smem=48 * 1024)]
    found = res.problems(rows)
    assert len(found) == 4, found
    assert "sm_80 fwd_kernel<c10::BFloat16, float, 64> (bf16) spills: 24 B" in found[0]
    assert found[1].startswith("sm_90 fwd_kernel<c10::Half, float, 64> (fp16) spills")
    assert "fwd_kernel<float, float, 64> (fp32) spills" in found[2]
    assert "big<float> uses 49156 B of static shared memory" in found[3]


def test_problems_flag_local_memory_in_the_hamming_kernels():
    """The Hamming kernels keep a query's words in registers: a spill or a stack frame (the words
    moved to local memory) is a problem whatever the dtype column says (it is empty for them)."""
    rows = [_row("retrieval_kernel<hamming_lanes::RankPass, 16, true>", ""),   # clean
            dict(_row("retrieval_kernel<hamming_lanes::HistPass, 2, false>", ""), stack_bytes=16),
            _row("filter_kernel<8>", "", arch=90, spill=8),
            _row("cdist_kernel<1>", "")]
    found = res.problems(rows)
    assert len(found) == 2, found
    assert found[0].startswith("sm_80 retrieval_kernel<hamming_lanes::HistPass, 2, false> "
                               "(Hamming) uses local memory")
    assert "16 B stack" in found[0]
    assert found[1].startswith("sm_90 filter_kernel<8> (Hamming) uses local memory: 8 B spill")
    assert [res.threads_per_block(k) for k in ("cdist_kernel<1>", "filter_kernel<2>",
                                                "retrieval_kernel<hamming_lanes::HistPass, 2, "
                                                "false>", "finish_kernel<float>",
                                                "fwd_kernel<float, float, 64>")] == [
        256, 128, 32, 128, 256]


def test_parse_sass_mufu_sample():
    sass = f"""
	code for sm_80
		Function : {FWD_BF16}
        /*0100*/                   MUFU.EX2 R5, R4 ;
        /*0110*/                   MUFU.EX2 R7, R6 ;
        /*0120*/                   MUFU.RCP R8, R9 ;
		Function : {NOISE}
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
	code for sm_90
		Function : {FWD_BF16}
        /*0100*/                   MUFU.TANH R5, R4 ;
"""
    counts = res.parse_sass_mufu(sass)
    assert counts == {(80, FWD_BF16): {"EX2": 2, "RCP": 1}, (80, NOISE): {},
                      (90, FWD_BF16): {"TANH": 1}}


MMA_BF16 = ("_ZN48_GLOBAL__N__0f8b71d6_15_nac_cuda_mma_cu_a3e11ec714fwd_mma_kernelI13__nv_bfloat16"
            "Li128EEEvN7nac_mma7OperandES3_PfS4_S4_ilb")
MMA_HALF = ("_ZN48_GLOBAL__N__0f8b71d6_15_nac_cuda_mma_cu_a3e11ec719bwd_keys_mma_kernelI6__half"
            "Li256EEEvN7nac_mma7OperandES3_PKfS5_Pfil")


def test_parse_sass_counts_sample():
    sass = f"""
	code for sm_90
		Function : {MMA_BF16}
        /*5010*/                   HMMA.16816.F32.BF16 R216, R32.reuse, R8, RZ ;
        /*5020*/                   HMMA.16816.F32.BF16 R8, R32, R10, RZ ;
        /*5030*/                   MUFU.EX2 R5, R4 ;
		Function : {MMA_HALF}
        /*0100*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0110*/                   HMMA.16816.F32 R8, R32, R10, RZ ;
		Function : {NOISE}
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
"""
    counts = res.parse_sass_counts(sass)
    assert counts == {(90, MMA_BF16): {"HMMA": 2, "MUFU.EX2": 1},
                      (90, MMA_HALF): {"HGMMA": 1, "HMMA": 1}, (90, NOISE): {}}
    assert res.parse_sass_mufu(sass)[(90, MMA_BF16)] == {"EX2": 1}
    # both .cu files' anonymous namespaces are NAC kernels; a library's other kernels are not
    assert res._NAC_CU.search(MMA_BF16) and res._NAC_CU.search(FWD_BF16)
    assert not res._NAC_CU.search("_ZN2at6native29vectorized_elementwise_kernelILi4EEEviT0_")


def test_describe_tensor_core_kernels():
    names = res.demangle([MMA_BF16, MMA_HALF])
    assert res.describe(names[MMA_BF16]) == ("fwd_mma_kernel<__nv_bfloat16, 128>", "bf16", "128")
    assert res.describe(names[MMA_HALF]) == ("bwd_keys_mma_kernel<__half, 256>", "fp16", "256")


def test_parse_resource_usage_sample():
    text = f"""
Fatbin elf code:
================
arch = sm_80
code version = [1,7]
host = linux
compile_size = 64bit

Resource usage:
 Common:
  GLOBAL:0
 Function {MMA_BF16}:
  REG:197 STACK:0 SHARED:34816 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function {MMA_HALF}:
  REG:255 STACK:8 SHARED:34304 LOCAL:4 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90
 Function {MMA_BF16}:
  REG:192 STACK:0 SHARED:35840 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    got = res.parse_resource_usage(text)
    assert got == {(80, MMA_BF16): dict(REG=197, STACK=0, SHARED=34816, LOCAL=0),
                   (80, MMA_HALF): dict(REG=255, STACK=8, SHARED=34304, LOCAL=4),
                   (90, MMA_BF16): dict(REG=192, STACK=0, SHARED=35840, LOCAL=0)}


def test_problems_flag_a_16bit_matrix_kernel_without_tensor_cores():
    def row(kernel, dtype, mma):
        return {**_row(kernel, dtype), "mma_instr": "HMMA" if mma else "", "mma_count": mma}
    rows = [row("fwd_mma_kernel<__nv_bfloat16, 128>", "bf16", 128),       # tensor cores: fine
            row("bwd_keys_mma_kernel<__half, 64>", "fp16", 0),            # problem
            row("fwd_kernel<c10::BFloat16, float, 64>", "bf16", 0),      # SIMT on 16-bit: problem
            row("fwd_kernel<float, float, 64>", "fp32", 0),              # fp32 SIMT: allowed
            row("prologue_mma_kernel<__half>", "fp16", 0),               # not a matrix kernel
            row("finish_kernel<c10::Half, float, true>", "fp16", 0)]
    found = res.problems(rows)
    assert found == [
        "sm_80 bwd_keys_mma_kernel<__half, 64> (fp16) has no tensor-core instruction (HMMA/HGMMA)"
        " in its SASS",
        "sm_80 fwd_kernel<c10::BFloat16, float, 64> (bf16) has no tensor-core instruction "
        "(HMMA/HGMMA) in its SASS"], found


def test_nvcc_command_uses_the_build_flags():
    """The resource report compiles with setup.py's flags (one definition: csrc/build_flags.py)
    and without --use_fast_math; building the command compiles nothing."""
    bf = res._build_flags()
    assert "--use_fast_math" not in bf.NVCC_FLAGS
    try:
        argv, _ = res.nvcc_command(80, "/tmp/x.cubin")
    except RuntimeError as exc:  # no toolkit on this machine
        pytest.skip(str(exc))
    for flag in bf.NVCC_FLAGS:
        assert flag in argv
    assert "-cubin" in argv and "-arch=sm_80" in argv and "--use_fast_math" not in argv
    assert "-I" + bf.csrc_dir() in argv
    # every CUDA source is compiled by the report: the SIMT kernels and the tensor-core ones
    assert {os.path.basename(p) for p in res.SOURCES} >= {"nac_cuda.cu", "nac_cuda_mma.cu"}
    assert res.nvcc_command(90, "/tmp/x.cubin", res.SOURCES[-1])[0][-3] == res.SOURCES[-1]


def test_cuda_resource_rows_without_toolkit_is_a_runtime_error(monkeypatch):
    """What bench/compile_check.py turns into a skip with the reason."""
    bf = res._build_flags()
    monkeypatch.setattr(bf, "find_cuda_home", lambda torch_guess=None: None)
    monkeypatch.setattr(res, "_build_flags", lambda: bf)
    with pytest.raises(RuntimeError, match="no CUDA toolkit"):
        res.cuda_resource_rows(archs=(80,), jobs=1)
    with pytest.raises(ValueError, match="jobs must be"):
        res.cuda_resource_rows(jobs=0)


# ---------------------------------------------------------------------------------------------
# (c) argument checks of the ops (CPU kernel; the CUDA kernel calls the same functions)
# ---------------------------------------------------------------------------------------------

CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
N_, D_ = 4, 3


def _fwd_args(**over):
    args = dict(a=torch.randn(N_, D_), r=torch.randn(N_, D_),
                noise=torch.where(torch.rand(N_, D_) < 0.2, -1.0, 1.0), keys=None)
    args.update(over)
    return args


def _fwd(args, grad_rows=True, cpu_kernel=False):
    op = torch.ops.nac_fast.nac_fwd.default
    call = (args["a"], args["r"], args["noise"], args["keys"], 1.1, 0.1, grad_rows)
    return op.redispatch(CPU_KEYS, *call) if cpu_kernel else op(*call)


def _bwd_args(**over):
    args = _fwd_args()
    _, lse, ga = _fwd(args)
    args.update(lse=lse, ga=ga, g=torch.rand(N_))
    args.update(over)
    return args


def _bwd(args, need_a=True, need_r=True, need_keys=False, cpu_kernel=False):
    op = torch.ops.nac_fast.nac_bwd.default
    call = (args["a"], args["r"], args["noise"], args["keys"], args["lse"], args["ga"], args["g"],
            1.1, need_a, need_r, need_keys)
    return op.redispatch(CPU_KEYS, *call) if cpu_kernel else op(*call)


META = dict(device="meta")
FWD_BAD = [
    ("a", dict(a=torch.randn(N_ * D_)), "a must be a non-empty \\(n, D\\) matrix"),
    ("a", dict(a=torch.randn(0, D_)), "a must be a non-empty \\(n, D\\) matrix"),
    ("a", dict(a=torch.randint(0, 3, (N_, D_))), "a must be float16, bfloat16, float32 or float64"),
    ("a", dict(a=torch.randn(N_, D_, dtype=torch.complex64)), "a must be float16, bfloat16"),
    ("r", dict(r=torch.randn(N_, D_ - 1)), "r must have a's shape"),
    ("r", dict(r=torch.randn(N_ + 1, D_)), "r must have a's shape"),
    ("r", dict(r=torch.randint(0, 3, (N_, D_))), "r must be float16, bfloat16, float32 or float64"),
    ("noise", dict(noise=torch.ones(2, 2)), "noise must have a's shape"),
    ("noise", dict(noise=torch.ones(N_, D_, dtype=torch.int8)), "noise must be float16, bfloat16"),
    ("keys", dict(keys=torch.randn(5, D_ + 1)), "keys must be a non-empty \\(N, D\\) matrix"),
    ("keys", dict(keys=torch.randn(0, D_)), "keys must be a non-empty \\(N, D\\) matrix"),
    ("keys", dict(keys=torch.randn(5)), "keys must be a non-empty \\(N, D\\) matrix"),
    ("keys", dict(keys=torch.ones(5, D_, dtype=torch.int32)), "keys must be float16, bfloat16"),
]


@needs_ext
@pytest.mark.parametrize("name,over,msg", FWD_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(FWD_BAD)])
def test_fwd_rejects_bad_argument(name, over, msg):
    with pytest.raises(RuntimeError, match="nac_fast: " + msg):
        _fwd(_fwd_args(**over))
    with pytest.raises(RuntimeError, match="nac_fast: " + msg):  # the backward checks them too
        _bwd(_bwd_args(**over))


@needs_ext
@pytest.mark.parametrize("name", ["r", "noise", "keys"])
def test_fwd_rejects_argument_on_another_device(name):
    ok = _fwd_args(keys=torch.randn(5, D_))
    bad = {name: torch.empty(ok[name].shape, **META)}
    with pytest.raises(RuntimeError, match=f"nac_fast: {name} must be on a's device \\(cpu\\), got meta"):
        _fwd({**ok, **bad}, cpu_kernel=True)
    full = _bwd_args(keys=ok["keys"])
    with pytest.raises(RuntimeError, match=f"nac_fast: {name} must be on a's device"):
        _bwd({**full, **bad}, cpu_kernel=True)


BWD_BAD = [
    ("lse", dict(lse=torch.zeros(N_ + 1)), True, "lse must be \\(n,\\) = \\(4,\\)"),
    ("lse", dict(lse=torch.zeros(N_, 1)), True, "lse must be \\(n,\\)"),
    ("lse", dict(lse=torch.zeros(N_, dtype=torch.float64)), True,
     "lse must have the accumulation dtype Float"),
    ("lse", dict(lse=torch.zeros(N_, dtype=torch.bfloat16)), True, "lse must have the accumulation"),
    ("lse", dict(lse=torch.zeros(N_, dtype=torch.int64)), True, "lse must have the accumulation"),
    ("ga", dict(ga=torch.zeros(N_, D_ - 1)), True, "ga must be the \\(n, D\\) = \\(4, 3\\) row"),
    ("ga", dict(ga=torch.zeros(0)), True, "ga must be the \\(n, D\\) = \\(4, 3\\) row"),
    ("ga", dict(ga=torch.zeros(N_ * D_)), True, "ga must be the \\(n, D\\)"),
    ("ga", dict(ga=torch.zeros(3)), False, "ga must be \\(n, D\\) = \\(4, 3\\) or empty"),
    ("ga", dict(ga=torch.zeros(N_, D_, dtype=torch.float64)), True, "ga must have the accumulation"),
    ("ga", dict(ga=torch.zeros(0, dtype=torch.float16)), False, "ga must have the accumulation"),
    ("g", dict(g=torch.ones(N_ - 1)), True, "g must be \\(n,\\) = \\(4,\\)"),
    ("g", dict(g=torch.ones(N_, 1)), True, "g must be \\(n,\\)"),
    ("g", dict(g=torch.ones(N_, dtype=torch.int64)), True, "g must be float16, bfloat16"),
]


@needs_ext
@pytest.mark.parametrize("name,over,need_a,msg", BWD_BAD,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BWD_BAD)])
def test_bwd_rejects_bad_argument(name, over, need_a, msg):
    with pytest.raises(RuntimeError, match="nac_fast: " + msg):
        _bwd(_bwd_args(**over), need_a=need_a)


@needs_ext
@pytest.mark.parametrize("name", ["lse", "ga", "g"])
def test_bwd_rejects_argument_on_another_device(name):
    ok = _bwd_args()
    bad = {name: torch.empty(ok[name].shape, dtype=ok[name].dtype, **META)}
    with pytest.raises(RuntimeError, match=f"nac_fast: {name} must be on a's device \\(cpu\\), got meta"):
        _bwd({**ok, **bad}, cpu_kernel=True)


@needs_ext
def test_bwd_accepts_empty_ga_without_need_a():
    """nac_fwd(grad_rows=False) returns ga = (0,): fine for a backward that does not need d/da."""
    args = _fwd_args()
    _, lse, ga = _fwd(args, grad_rows=False)
    assert ga.shape == (0,)
    g = torch.rand(N_)
    grad_a, grad_r, _ = _bwd({**args, "lse": lse, "ga": ga, "g": g}, need_a=False)
    assert grad_a.shape == (0,) and grad_r.shape == (N_, D_)
    _, _, ga_full = _fwd(args)
    torch.testing.assert_close(grad_r, _bwd({**args, "lse": lse, "ga": ga_full, "g": g})[1])


@needs_ext
@pytest.mark.parametrize("dtype,acc", [(torch.float64, torch.float64), (torch.bfloat16, torch.float32),
                                       (torch.float16, torch.float32)])
def test_accumulation_dtype_of_lse_and_ga(dtype, acc):
    args = _fwd_args(a=torch.randn(N_, D_, dtype=dtype), r=torch.randn(N_, D_, dtype=dtype),
                     noise=torch.ones(N_, D_, dtype=dtype))
    _, lse, ga = _fwd(args)
    assert lse.dtype == acc and ga.dtype == acc
    g = torch.rand(N_, dtype=dtype)
    got = _bwd({**args, "lse": lse, "ga": ga, "g": g})  # g is converted to the accumulation dtype
    want = _bwd({**args, "lse": lse, "ga": ga, "g": g.to(acc)})
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and torch.equal(x, y)
    with pytest.raises(RuntimeError, match="lse must have the accumulation dtype"):
        _bwd({**args, "lse": lse.to(dtype if dtype != torch.float64 else torch.float32), "ga": ga,
              "g": torch.rand(N_)})


@needs_ext
def test_strided_and_mixed_dtype_inputs_are_converted_not_misread():
    """Contiguity is not required: the kernels make every operand contiguous (and r, noise, keys,
    g of another supported float dtype are converted), so strided views give the results of
    their contiguous copies."""
    torch.manual_seed(0)
    base = _fwd_args(keys=torch.randn(6, D_))
    lse_c, ga_c = _fwd(base)[1:]
    g = torch.rand(N_)
    strided = dict(a=base["a"].t().contiguous().t(),                       # column-major
                   r=torch.stack([base["r"], base["r"]], 2)[:, :, 0],         # stride (6, 2)
                   noise=base["noise"].t().contiguous().t(),
                   keys=torch.cat([base["keys"], base["keys"]], 1)[:, :D_])  # row stride 2D
    assert not any(strided[k].is_contiguous() for k in ("a", "r", "noise", "keys"))
    for got, want in zip(_fwd(strided), _fwd(base)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    lse_s = torch.stack([lse_c, lse_c], 1)[:, 0]
    ga_s = ga_c.t().contiguous().t()
    g_s = torch.stack([g, g], 1)[:, 1]
    assert not lse_s.is_contiguous() and not ga_s.is_contiguous() and not g_s.is_contiguous()
    want = _bwd({**base, "lse": lse_c, "ga": ga_c, "g": g}, need_keys=True)
    got = _bwd({**strided, "lse": lse_s, "ga": ga_s, "g": g_s}, need_keys=True)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    # zero-stride noise (an expanded row) and float64 r / g are read as their float32 values
    row = base["noise"][:1]
    mixed = dict(base, noise=row.expand(N_, D_), r=base["r"].double())
    for x, y in zip(_fwd(mixed), _fwd(dict(base, noise=row.repeat(N_, 1)))):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    got = _bwd({**base, "lse": lse_c, "ga": ga_c, "g": g.double()}, need_keys=True)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


NOISE_BAD = [
    (dict(like=torch.zeros(3, 2, dtype=torch.int32)), "nac_noise's like must be floating point"),
    (dict(seed=torch.tensor([1], dtype=torch.int32)), "nac_noise's seed must be a one-element int64"),
    (dict(seed=torch.tensor([1, 2])), "nac_noise's seed must be a one-element int64"),
    (dict(p=0.5), "nac_noise's p must lie in \\(0, 0.5\\)"),
    (dict(p=float("nan")), "nac_noise's p must lie in"),
]


@needs_ext
@pytest.mark.parametrize("over,msg", NOISE_BAD)
def test_noise_rejects_bad_argument(over, msg):
    args = dict(like=torch.zeros(3, 2), seed=torch.tensor([7]), p=0.1)
    args.update(over)
    with pytest.raises(RuntimeError, match="nac_fast: " + msg):
        torch.ops.nac_fast.nac_noise(args["like"], args["seed"], args["p"])


@needs_ext
def test_noise_rejects_seed_on_another_device():
    with pytest.raises(RuntimeError, match="nac_fast: nac_noise's seed must be on like's device"):
        torch.ops.nac_fast.nac_noise.default.redispatch(
            CPU_KEYS, torch.zeros(3, 2), torch.empty(1, dtype=torch.int64, **META), 0.1)


# ---------------------------------------------------------------------------------------------
# (d) the 'cuda' backend is experimental: backend="auto" does not pick it; the host refuses the
#     tensor-core path below compute capability 8.0
# ---------------------------------------------------------------------------------------------

class _OnDevice:
    """Stands for a tensor on `device` (resolve_backend reads t.device only): no GPU needed."""

    def __init__(self, device):
        self.device = torch.device(device)


@pytest.mark.parametrize("op", ["nac", "noise"])
def test_auto_on_cuda_tensors_picks_triton_then_cuda(monkeypatch, op):
    """'cuda' passed the GPU suite (H100, 2026-11-27): auto takes triton first (the shorter GPU
    work there), then cuda, then the reference; an EXPERIMENTAL backend is never auto's."""
    from nac_fast.ops import dispatch
    assert "cuda" not in dispatch.EXPERIMENTAL
    t = _OnDevice("cuda")
    monkeypatch.setattr(dispatch, "_available",
                        lambda dt, op="nac": ("reference", "triton", "cuda"))
    assert dispatch.resolve_backend("auto", t, op) == "triton"
    assert dispatch.resolve_backend("cuda", t, op) == "cuda"  # by name
    monkeypatch.setattr(dispatch, "_available", lambda dt, op="nac": ("reference", "cuda"))
    assert dispatch.resolve_backend("auto", t, op) == "cuda"  # no Triton: the fused cuda kernel
    monkeypatch.setattr(dispatch, "EXPERIMENTAL", ("cuda",))
    assert dispatch.resolve_backend("auto", t, op) == "reference"  # experimental: never auto's
    monkeypatch.setattr(dispatch, "_available", lambda dt, op="nac": ("reference",))
    monkeypatch.setattr(dispatch, "EXPERIMENTAL", ())
    assert dispatch.resolve_backend("auto", t, op) == "reference"


def test_host_refuses_the_tensor_core_path_below_sm80():
    """bf16/fp16 inputs on a GPU below compute capability 8.0 (no bf16 mma.sync, no cp.async)
    stop with an error naming the capability and the way out, before any launch; the matrix
    kernels built for such an arch are a trap, never silently wrong numbers."""
    with open(os.path.join(ROOT, "csrc", "nac_cuda.cu")) as fh:
        host = fh.read()
    start = host.index("MmaPrep mma_prologue(")
    body = host[start:host.index("\n}\n", start)]
    check = body.index("TORCH_CHECK(prop->major >= 8")
    assert check < body.index("nac_mma::prologue(")
    assert "compute capability 8.0 or newer" in body and "backend='triton'" in body
    with open(os.path.join(ROOT, "csrc", "nac_cuda_mma.cu")) as fh:
        dev = fh.read()
    assert "__CUDA_ARCH__ < 800" in dev and dev.count("__trap();") == 2
