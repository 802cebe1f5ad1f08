"""The CUDA kernels of the loss (csrc/nac_cuda.cu, the SIMT kernels; csrc/nac_cuda_mma.cu, the
tensor-core ones), checked without a GPU.  The same kernels on a GPU: tests/test_loss_gpu.py.

Build: the built library's SASS (cuobjdump, no GPU needed) has no MUFU.TANH, code for every
targeted arch, HMMA/HGMMA in its bf16/fp16 matrix kernels, no spills and at most 48 KB of static
shared memory; tools/cuda_resources.py's parsers and problem rules on canned samples.

Argument checks: csrc/nac_checks.h, shared by the CPU and CUDA kernels, through the CPU kernel;
every bad tensor argument of nac_fwd / nac_bwd / nac_noise is a RuntimeError naming it.

Backend policy: backend="auto" on CUDA tensors takes Triton, then 'cuda'; the host refuses
bf16/fp16 below compute capability 8.0 before any launch.

Tensor-core layouts: the mma kernels' index math (fragments, ldmatrix addresses, tiles, splits),
read out of nac_cuda_mma.cu and run on a numpy model of one warp.  Tensor-core numerics: the fp16
keys' gradient, its rounding steps emulated on whole problems, and nac::pow2_scale.

Launch limits: block sizes and grid dimensions of csrc/hamming_cuda.cu's launches, and the
integer widths of every CUDA source (the loss's and the Hamming engine's), read out of the source.

Compiling csrc/*.cu with ptxas' report (registers, spills, shared memory, HMMA count per
kernel and arch) is tools/compile_check.py's job, once per CI run (tests/test_compile_check.py).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from nac_fast.ops.dispatch import cuda_extension_built, extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
HAMMING_CU = os.path.join(CSRC, "hamming_cuda.cu")

def _load_resources():
    spec = importlib.util.spec_from_file_location(
        "cuda_resources", os.path.join(ROOT, "tools", "cuda_resources.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


res = _load_resources()

needs_ext = pytest.mark.skipif(extension() is None, reason="no compiled extension")


# ---------------------------------------------------------------------------------------------
# (a) SASS of the built library, when the extension was built with CUDA (cuobjdump, no GPU
#     needed): no MUFU.TANH (the --use_fast_math tanh, rel. error ~2^-11) in the NAC kernels;
#     code for every arch the build targets (sm_80 and sm_90 by default); HMMA/HGMMA in the
#     bf16/fp16 matrix kernels; no local memory (spills) in a bf16/fp16/fp32 NAC kernel and
#     at most 48 KB of static shared memory
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(not cuda_extension_built(), reason="extension built without CUDA kernels")
@pytest.mark.slow
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
@pytest.mark.slow
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
# (b) tools/cuda_resources.py's parsers (ptxas report, demangled names, SASS, resource usage)
#     and its problem rules, on canned samples
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
    """What tools/compile_check.py turns into a skip with the reason."""
    bf = res._build_flags()
    monkeypatch.setattr(bf, "find_cuda_home", lambda torch_guess=None: None)
    monkeypatch.setattr(res, "_build_flags", lambda: bf)
    with pytest.raises(RuntimeError, match="no CUDA toolkit"):
        res.cuda_resource_rows(archs=(80,), jobs=1)
    with pytest.raises(ValueError, match="jobs must be"):
        res.cuda_resource_rows(jobs=0)


# ---------------------------------------------------------------------------------------------
# (c) argument checks of the ops (csrc/nac_checks.h through the CPU kernel; the CUDA kernel
#     calls the same functions).  Device mismatches are checked with a 'meta' tensor and a
#     redispatch to the CPU kernel (the dispatcher alone would route a meta argument to the
#     fake implementation)
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
    call = (args["a"], args["r"], args["noise"], args["keys"], 1.1, 0.1, grad_rows,
            args.get("self_offset", -1))
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
            1.1, need_a, need_r, need_keys, args.get("self_offset", -1))
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
    # the row's own key left out (docs/math.md [M:self-key]): -1, or o in [0, N - n], N >= 2
    ("self_offset", dict(self_offset=-2), "self_offset must be -1 \\(every key\\) or >= 0"),
    ("self_offset", dict(self_offset=1), "self_offset must lie in \\[0, N - n\\] = \\[0, 0\\]"),
    ("self_offset", dict(keys=torch.randn(5, D_), self_offset=2),
     "self_offset must lie in \\[0, N - n\\] = \\[0, 1\\] .*n = 4, N = 5\\), got 2"),
    ("self_offset", dict(a=torch.randn(1, D_), r=torch.randn(1, D_), noise=torch.ones(1, D_),
                         self_offset=0), "self_offset >= 0 needs at least 2 keys"),
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
# (d) backend policy: backend="auto" on CUDA tensors takes Triton, then 'cuda' (never an
#     EXPERIMENTAL backend); the host refuses the tensor-core path below compute capability 8.0
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


# ---------------------------------------------------------------------------------------------
# Tensor-core layouts: the index math of csrc/nac_cuda_mma.cu, on the CPU
#
# The kernels cannot run without a GPU, but what decides whether they multiply the right numbers
# is integer arithmetic on lane ids: which element each lane loads into which register, which
# shared-memory row each lane hands ldmatrix, which fragment register mma.sync reads.  This
# section emulates one warp (32 lanes) with numpy:
#
#   * the hardware, from the PTX ISA's tables (independent of the kernel): ldmatrix.m8n8.x4[.trans]
#     .b16 (lanes 8i..8i+7 address the rows of 8 x 8 matrix i; register i of lane 4g+t gets row g,
#     columns 2t, 2t+1, or with .trans rows 2t, 2t+1 of column g) and mma.m16n8k16.row.col with
#     16-bit inputs and fp32 accumulators ("Matrix Fragments for mma.m16n8k16 with floating point
#     type"), cvt.rn.{bf16x2,f16x2}.f32 (first source to the high half);
#   * the kernel, from its own source: each index expression the kernel uses (load_resident,
#     load_tile, score_tile, accumulate_pt, store_acc, the forward's key mask, the keys' backward's
#     query column, pack's operand order) is read out of nac_cuda_mma.cu and evaluated here, so
#     an edit to the kernel's index math is what gets tested (an expression no longer found fails
#     the test, naming the snippet to re-check against the PTX tables).
#
# Then the emulated tile products are compared with matmuls: S = R T^T (score_tile), acc += P T
# with P taken straight from S's accumulators (the C -> A register reuse of accumulate_pt), one
# warp's whole forward (online base-2 logsumexp over several key tiles with a partial last tile,
# [M:lse-online]; acc = sum_j 2^(S2_ij - m) k_j, [M:ga]) and the keys' backward [M:grad-keys],
# for every code width (DPAD 32, 64, 128, 256) and D not a multiple of 8 or 16.  Also: the padded
# shared-memory rows make each ldmatrix phase (8 rows of 16 bytes) conflict-free, the block's
# cp.async copies cover the tile exactly once, and the grid (blocks x warps x 16 rows; the host's
# split plan and each split's [start, end) and tile count) covers every row once.
#
# What this cannot check (needs a GPU): the PTX wrappers' register constraints and asm semantics
# beyond the tables, cp.async/barrier ordering, and the numerics of ex2.approx.
# ---------------------------------------------------------------------------------------------

SRC_PATH = os.path.join(ROOT, "csrc", "nac_cuda_mma.cu")
with open(SRC_PATH) as fh:
    SRC = fh.read()

LANES = np.arange(32)
DPADS = (32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# Reading the kernel's index expressions
# ---------------------------------------------------------------------------------------------

def body(name: str) -> str:
    """The body (braces included) of the device function / kernel `name` in nac_cuda_mma.cu."""
    for m in re.finditer(r"\b" + re.escape(name) + r"\s*\(", SRC):
        head_end = SRC.find("{", m.end())
        if ";" in SRC[m.end():head_end]:  # a call or a declaration, not the definition
            continue
        depth = 0
        for i in range(head_end, len(SRC)):
            depth += {"{": 1, "}": -1}.get(SRC[i], 0)
            if depth == 0:
                return SRC[head_end:i + 1]
    raise AssertionError(f"no definition of {name} in {SRC_PATH}")


def kernel_expr(where: str, snippet: str):
    """`snippet`, an expression of the kernel (must occur verbatim in `where`'s body), as a Python
    function of its variables (lane, t, g, kk, j, nt, e, C's constants...)."""
    assert snippet in body(where), (
        f"{where} in csrc/nac_cuda_mma.cu no longer contains `{snippet}`: its index math changed; "
        "re-derive it against the PTX fragment tables and update this test")
    py = snippet.replace("C::", "").replace(" / ", " // ").replace("&&", "and")
    py = py.replace("||", "or").replace("const int64_t ", "").replace("const int ", "")
    # C's `(cond) ? x : y` (one level, as the kernel writes it) -> Python's conditional
    py = re.sub(r"(\([^()]*\))\s*\?\s*(\w+)\s*:\s*(\w+)", r"(\2 if \1 else \3)", py)
    if " ? " in py and " : " in py:  # a whole-snippet `cond ? x : y`
        cond, rest = py.split(" ? ", 1)
        x, y = rest.rsplit(" : ", 1)
        py = f"(({x}) if ({cond}) else ({y}))"
    try:
        code = compile(py, f"<{where}>", "eval")
    except SyntaxError:  # a statement: checked for presence only
        code = None

    def run(**env):
        assert code is not None, f"`{snippet}` is a statement, not an expression"
        return eval(code, {}, env)
    return run


def cfg(dpad: int) -> dict:
    """Cfg<DPAD>'s constants, as nac_cuda_mma.cu defines them."""
    decl = "kStream = DPAD <= 64 ? 128 : (DPAD == 128 ? 64 : 16)"
    assert decl in SRC, "Cfg<DPAD>::kStream changed: update cfg() in this test"
    assert "kLd = DPAD + 8;" in SRC and "kChunks = DPAD / 8;" in SRC
    assert "constexpr int kWarps = 8;" in SRC
    stream = 128 if dpad <= 64 else (64 if dpad == 128 else 16)
    return dict(DPAD=dpad, kStream=stream, kLd=dpad + 8, kChunks=dpad // 8,
                kKSteps=dpad // 16, kNTiles=stream // 8, kDTiles=dpad // 8, kThreads=256)


# ---------------------------------------------------------------------------------------------
# The hardware, per the PTX ISA (independent of the kernel)
# ---------------------------------------------------------------------------------------------

def ldmatrix_x4(smem: np.ndarray, addr, trans: bool) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16.  smem: flat 16-bit array; addr[lane]:
    the element offset lane supplies (lanes 8i..8i+7: rows 0..7 of matrix i).  Returns
    regs[lane, i, half] (half 0 = low 16 bits)."""
    addr = np.asarray(addr)
    assert addr.shape == (32,) and all(a % 8 == 0 for a in addr), "rows must be 16-byte aligned"
    mats = np.stack([np.stack([smem[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])
                     for i in range(4)])  # (4, 8 rows, 8 cols)
    regs = np.empty((32, 4, 2), smem.dtype)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            for h in range(2):
                regs[lane, i, h] = mats[i, 2 * t + h, g] if trans else mats[i, g, 2 * t + h]
    return regs


def mma_m16n8k16(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: c[lane, 4] (fp32 C), a[lane, 4, 2]
    (registers a0..a3 as (low, high) halves = elements a0..a7), b[lane, 2, 2].  Returns D."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    Cm = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # A element ai: register i // 2, half i % 2
            row = g if (i < 2 or 4 <= i < 6) else g + 8
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            A[row, col] = a[lane, i // 2, i % 2]
        for i in range(4):  # B element bi
            B[2 * t + (i & 1) + (8 if i >= 2 else 0), g] = b[lane, i // 2, i % 2]
        for i in range(4):  # C element ci
            Cm[g + (8 if i >= 2 else 0), 2 * t + (i & 1)] = c[lane, i]
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(Cm).any()), "fragment gap"
    Dm = A.astype(np.float64) @ B.astype(np.float64) + Cm
    out = np.empty((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            out[lane, i] = Dm[g + (8 if i >= 2 else 0), 2 * t + (i & 1)]
    return out


def c_layout(lane: int, e: int) -> tuple:
    """(row, col) of fp32 accumulator element c_e of `lane` in a 16 x 8 tile (PTX table)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (e >= 2), 2 * t + (e & 1)


def round16(x, dtype: str):
    """Round to the 16-bit type (nearest even), as cvt.rn / __float2*_rn do; returns float64."""
    x = np.asarray(x, np.float64)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float64)
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def cvt_pack(src1: float, src2: float, dtype: str) -> tuple:
    """cvt.rn.{f16x2,bf16x2}.f32 d, src1, src2: src1 -> high half, src2 -> low half.
    Returns (low, high)."""
    return round16(src2, dtype), round16(src1, dtype)


# ---------------------------------------------------------------------------------------------
# The kernel's helpers, from its source, on one warp
# ---------------------------------------------------------------------------------------------

def emu_load_resident(src: np.ndarray, row0: int, rows_end: int, chunks: int, C: dict):
    """load_resident: a[lane, kk, q, half] (register q of k-step kk) from global memory."""
    kernel_expr("load_resident", "r_lo = row0 + g, r_hi = row0 + g + 8")
    row_of = kernel_expr("load_resident", "(q & 1) ? r_hi : r_lo")
    col_of = kernel_expr("load_resident", "16 * kk + 2 * t + ((q & 2) ? 8 : 0)")
    inside = kernel_expr("load_resident", "row < rows_end && col < cols")
    cols = chunks * 8
    a = np.zeros((32, C["kKSteps"], 4, 2))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for kk in range(C["kKSteps"]):
            for q in range(4):
                row = row_of(q=q, r_lo=row0 + g, r_hi=row0 + g + 8)
                col = col_of(kk=kk, t=t, q=q)
                if inside(row=row, rows_end=rows_end, col=col, cols=cols):
                    a[lane, kk, q] = src[row, col:col + 2]  # 4-byte load, low half = col
    return a


def emu_load_tile(rows: np.ndarray, row0: int, rows_end: int, chunks: int, C: dict) -> np.ndarray:
    """load_tile: the block's cp.async copies into one (kStream x kLd) buffer, flat; asserts each
    destination chunk is written exactly once and pad columns are never written."""
    r_of = kernel_expr("load_tile", "e / C::kChunks")
    c_of = kernel_expr("load_tile", "e % C::kChunks")
    dst_of = kernel_expr("load_tile", "r * C::kLd + 8 * c")
    passes = kernel_expr("load_tile", "C::kStream * C::kChunks / kThreads")(**C)
    kernel_expr("load_tile", "threadIdx.x + pass * kThreads")
    kernel_expr("load_tile", "row0 + r < rows_end && c < chunks")
    buf = np.full(C["kStream"] * C["kLd"], np.nan)
    written = np.zeros(C["kStream"] * C["kLd"], int)
    for p in range(passes):
        for tid in range(C["kThreads"]):
            e = tid + p * C["kThreads"]
            r, c = r_of(e=e, **C), c_of(e=e, **C)
            dst = dst_of(r=r, c=c, **C)
            valid = row0 + r < rows_end and c < chunks
            buf[dst:dst + 8] = rows[row0 + r, 8 * c:8 * c + 8] if valid else 0.0
            written[dst:dst + 8] += 1
    ld = C["kLd"]
    w = written.reshape(C["kStream"], ld)
    assert (w[:, :C["DPAD"]] == 1).all() and (w[:, C["DPAD"]:] == 0).all()
    return buf


def emu_score_tile(a: np.ndarray, buf: np.ndarray, C: dict, dtype: str) -> np.ndarray:
    """score_tile: s[lane, nt, e] = (this warp's 16 rows) . (the tile's rows)^T."""
    base_of = kernel_expr("score_tile",
                          "((lane & 7) + 8 * (lane >> 4)) * C::kLd + 8 * ((lane >> 3) & 1)")
    off_of = kernel_expr("score_tile", "16 * j * C::kLd + 16 * kk")
    kernel_expr("score_tile", "ldmatrix_x4(b, base + 2 * (16 * j * C::kLd + 16 * kk));")
    kernel_expr("score_tile", "Mma<T>::run(s[2 * j], a[kk], b[0], b[1]);")
    kernel_expr("score_tile", "Mma<T>::run(s[2 * j + 1], a[kk], b[2], b[3]);")
    base = np.array([base_of(lane=lane, **C) for lane in LANES])
    check_bank_conflicts(base, C)
    s = np.zeros((32, C["kNTiles"], 4))
    for kk in range(C["kKSteps"]):
        for j in range(C["kNTiles"] // 2):
            b = ldmatrix_x4(buf, base + off_of(j=j, kk=kk, **C), trans=False)
            s[:, 2 * j] = mma_m16n8k16(s[:, 2 * j], a[:, kk], b[:, 0:2])
            s[:, 2 * j + 1] = mma_m16n8k16(s[:, 2 * j + 1], a[:, kk], b[:, 2:4])
    return s


def emu_accumulate_pt(acc: np.ndarray, s: np.ndarray, buf: np.ndarray, C: dict,
                      dtype: str) -> np.ndarray:
    """accumulate_pt: acc[lane, dt, e] += P . T, P packed from s's C fragments."""
    base_of = kernel_expr("accumulate_pt", "(lane & 15) * C::kLd + 8 * (lane >> 4)")
    off_of = kernel_expr("accumulate_pt", "16 * kk * C::kLd + 16 * j")
    kernel_expr("accumulate_pt", "ldmatrix_x4_trans(b, base + 2 * (16 * kk * C::kLd + 16 * j));")
    kernel_expr("accumulate_pt", "Mma<T>::run(acc[2 * j], p, b[0], b[1]);")
    kernel_expr("accumulate_pt", "Mma<T>::run(acc[2 * j + 1], p, b[2], b[3]);")
    packs = re.findall(r"Mma<T>::pack\(s\[([^\]]+)\]\[(\d)\], s\[([^\]]+)\]\[(\d)\]\)",
                       body("accumulate_pt"))
    assert len(packs) == 4, packs
    # pack(lo, hi): its asm hands cvt (hi, lo), i.e. hi -> high half
    pack_asm = '"=r"(r) : "f"(hi), "f"(lo)'
    assert SRC.count(pack_asm) == 2 and "pack(float lo, float hi)" in SRC, "pack's operand order"
    base = np.array([base_of(lane=lane, **C) for lane in LANES])
    check_bank_conflicts(base, C)
    acc = acc.copy()
    for kk in range(C["kNTiles"] // 2):
        p = np.empty((32, 4, 2))
        for q, (nt_lo, e_lo, nt_hi, e_hi) in enumerate(packs):
            nl = eval(nt_lo, {}, {"kk": kk})
            nh = eval(nt_hi, {}, {"kk": kk})
            for lane in range(32):
                p[lane, q] = cvt_pack(s[lane, nh, int(e_hi)], s[lane, nl, int(e_lo)], dtype)
        for j in range(C["kDTiles"] // 2):
            b = ldmatrix_x4(buf, base + off_of(j=j, kk=kk, **C), trans=True)
            acc[:, 2 * j] = mma_m16n8k16(acc[:, 2 * j], p, b[:, 0:2])
            acc[:, 2 * j + 1] = mma_m16n8k16(acc[:, 2 * j + 1], p, b[:, 2:4])
    return acc


def emu_store_acc(acc: np.ndarray, row0: int, rows_end: int, D: int, C: dict) -> dict:
    """store_acc: {(row, col): value} of what the warp writes."""
    row_of = kernel_expr("store_acc", "row0 + g + 8 * h")
    col_of = kernel_expr("store_acc", "8 * dt + 2 * t + e")
    kernel_expr("store_acc", "o[col] = acc[dt][2 * h + e] * scale")
    out = {}
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            row = row_of(row0=row0, g=g, h=h)
            if row >= rows_end:
                continue
            for dt in range(C["kDTiles"]):
                for e in range(2):
                    col = col_of(dt=dt, t=t, e=e)
                    if col < D:
                        assert (row, col) not in out
                        out[(row, col)] = acc[lane, dt, 2 * h + e]
    return out


def check_bank_conflicts(base: np.ndarray, C: dict):
    """Each 8-lane phase of ldmatrix reads eight 16-byte rows: with rows padded to kLd elements
    they fall in eight distinct 16-byte bank groups (of 128 bytes), for any tile offset that is a
    multiple of 16 elements (what the kernel adds)."""
    for i in range(4):
        groups = {(2 * int(base[8 * i + r]) % 128) // 16 for r in range(8)}
        assert len(groups) == 8, (C["DPAD"], i, sorted(groups))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def _ints(rng, shape, lo=-3, hi=4):
    """Small integers: exact in fp16 and bf16, and their products' sums exact in float64."""
    return rng.integers(lo, hi, size=shape).astype(np.float64)


def _tile_case(dpad, D, rng):
    C = cfg(dpad)
    chunks = -(-D // 8)
    R = _ints(rng, (40, dpad))
    R[:, D:] = 7.0  # columns >= D must read as zero: a nonzero here would show
    T = _ints(rng, (C["kStream"] + 5, dpad))
    T[:, chunks * 8:] = 9.0  # past the operand's chunks: zero-filled by load_tile
    return C, chunks, R, T


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_score_tile_is_R_times_T_transposed(dpad, dtype):
    rng = np.random.default_rng(dpad)
    D = dpad - 3 if dpad > 32 else 29
    C, _, R, T = _tile_case(dpad, D, rng)
    chunks_r = -(-D // 8)
    R[:, chunks_r * 8:] = 0.0  # the prologue's zero columns (Q2 is (n, dpad), zeros >= D)
    row0, rows_end = 24, 35  # a warp whose last 5 rows are past the operand
    tile_row0, tile_end = 3, 3 + C["kStream"] - 2  # two rows past the end: zero-filled
    a = emu_load_resident(R, row0, rows_end, chunks_r, C)
    buf = emu_load_tile(T, tile_row0, tile_end, chunks_r, C)
    s = emu_score_tile(a, buf, C, dtype)
    Rv = np.where(np.arange(40)[:, None] < rows_end, R, 0)[row0:row0 + 16, :chunks_r * 8]
    Tv = T[tile_row0:tile_row0 + C["kStream"]].copy()
    Tv[tile_end - tile_row0:] = 0
    expect = Rv @ Tv[:, :chunks_r * 8].T  # (16, kStream)
    for lane in range(32):
        for nt in range(C["kNTiles"]):
            for e in range(4):
                r, c = c_layout(lane, e)
                assert s[lane, nt, e] == expect[r, 8 * nt + c], (lane, nt, e)


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_accumulate_pt_reuses_the_accumulators_as_A(dpad, dtype):
    rng = np.random.default_rng(100 + dpad)
    C = cfg(dpad)
    D = dpad - 5
    chunks = -(-D // 8)
    T = _ints(rng, (C["kStream"], dpad))
    buf = emu_load_tile(T, 0, C["kStream"], chunks, C)
    s = _ints(rng, (32, C["kNTiles"], 4), -2, 3) / 4  # exact in 16 bits
    acc0 = _ints(rng, (32, C["kDTiles"], 4))
    acc = emu_accumulate_pt(acc0, s, buf, C, dtype)
    P = np.empty((16, C["kStream"]))
    A0 = np.empty((16, dpad))
    for lane in range(32):
        for e in range(4):
            r, c = c_layout(lane, e)
            for nt in range(C["kNTiles"]):
                P[r, 8 * nt + c] = s[lane, nt, e]
            for dt in range(C["kDTiles"]):
                A0[r, 8 * dt + c] = acc0[lane, dt, e]
    Tz = T.copy()
    Tz[:, chunks * 8:] = 0
    expect = A0 + P @ Tz
    got = emu_store_acc(acc, 0, 16, dpad, C)
    assert len(got) == 16 * dpad
    for (r, c), v in got.items():
        assert v == expect[r, c], (r, c)


def _emu_forward_warp(Q2, K, row0, n, jstart, jend, C, dtype, self_offset=-1):
    """fwd_mma_kernel for one warp: (m, l) per row (log2 units) and acc (16 x DPAD).
    self_offset >= 0: each row's own key (key self_offset + row) left out, by the kernel's own
    band test and tile column ([M:self-key])."""
    mask = kernel_expr("fwd_mma_kernel", "j0 + 8 * nt + 2 * t + (e & 1) >= jend")
    own_d = kernel_expr("fwd_mma_kernel", "self_offset + row0 - j0")
    band = kernel_expr("fwd_mma_kernel", "d > -16 && d < C::kStream")
    own = kernel_expr("fwd_mma_kernel", "8 * nt + 2 * t + (e & 1) == dd + g + 8 * (e >> 1)")
    kernel_expr("fwd_mma_kernel",
                "const float m_sub = self_offset >= 0 && m_new == -INFINITY ? 0.f : m_new;")
    kernel_expr("fwd_mma_kernel", "mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));")
    kernel_expr("fwd_mma_kernel", "exp2_approx(s[nt][2 * h + e] - m_sub)")
    kernel_expr("fwd_mma_kernel", "acc[dt][2 * h] *= alpha;")
    kernel_expr("fwd_mma_kernel", "acc[dt][2 * h + 1] *= alpha;")
    kernel_expr("fwd_mma_kernel", "const int64_t row = row0 + g + 8 * h;")
    chunks = C["kChunks"]
    a = emu_load_resident(Q2, row0, n, chunks, C)
    m_run = np.full((32, 2), -np.inf)
    l_run = np.zeros((32, 2))
    acc = np.zeros((32, C["kDTiles"], 4))
    ntiles = -(-(jend - jstart) // C["kStream"])
    for it in range(ntiles):
        j0 = jstart + it * C["kStream"]
        buf = emu_load_tile(K, j0, jend, chunks, C)
        s = emu_score_tile(a, buf, C, dtype)
        if j0 + C["kStream"] > jend:
            for lane in range(32):
                t = lane % 4
                for nt in range(C["kNTiles"]):
                    for e in range(4):
                        if mask(j0=j0, nt=nt, t=t, e=e, jend=jend):
                            s[lane, nt, e] = -np.inf
        if self_offset >= 0:
            d = own_d(self_offset=self_offset, row0=row0, j0=j0)
            if band(d=d, kStream=C["kStream"]):
                _set_own(s, own, d, C, -np.inf, "g")
        for h in range(2):
            mx = np.max(s[:, :, 2 * h:2 * h + 2], axis=(1, 2))
            # quad_max: xor-shuffles 1 and 2 reduce over lanes 4g..4g+3
            mx = np.maximum.reduce([mx[LANES ^ x] for x in (0, 1, 2, 3)])
            m_new = np.maximum(m_run[:, h], mx)
            alpha = np.where(m_run[:, h] == -np.inf, 0.0, np.exp2(m_run[:, h] - m_new))
            m_sub = np.where((self_offset >= 0) & (m_new == -np.inf), 0.0, m_new)
            p = np.exp2(s[:, :, 2 * h:2 * h + 2] - m_sub[:, None, None])
            s[:, :, 2 * h:2 * h + 2] = p
            l_run[:, h] = l_run[:, h] * alpha + p.sum(axis=(1, 2))
            m_run[:, h] = m_new
            acc[:, :, 2 * h:2 * h + 2] *= alpha[:, None, None]
        acc = emu_accumulate_pt(acc, s, buf, C, dtype)
    l_tot = sum(l_run[LANES ^ x] for x in (0, 1, 2, 3))  # quad_sum (xor 1, then 2)
    return m_run, l_tot, acc


def _set_own(s, own, dd, C, value, g_name):
    """s[lane, nt, e] = value where the kernel's own-key test `own` (its expression, over the
    fragment's nt, t = lane % 4, e, the band offset dd and the lane's group lane // 4 under the
    kernel's name g_name) holds: the warp's tile with its rows' own keys set."""
    for lane in range(32):
        for nt in range(C["kNTiles"]):
            for e in range(4):
                if own(nt=nt, t=lane % 4, e=e, dd=dd, **{g_name: lane // 4}):
                    s[lane, nt, e] = value


def _warp_rows(row0, n):
    """(lane, h, row) of each row below n that one warp's accumulator fragments hold: lane's
    group g = lane // 4 holds rows row0 + g (h = 0) and row0 + g + 8 (h = 1)."""
    for lane in range(32):
        for h in range(2):
            r = row0 + lane // 4 + 8 * h
            if r < n:
                yield lane, h, r


def _warp_operands(rng, n, N, D, dpad, scale, dtype):
    """(Q2, K) of the warp emulations, padded to dpad columns and rounded to the 16-bit dtype:
    Q2 = scale log2(e) m tanh(x) of n rows with random signs m, K = tanh(y) of N keys."""
    z = np.tanh(rng.standard_normal((max(n, N), D)))
    m = rng.choice([-1.0, 1.0], size=(n, D))
    Q2 = np.zeros((n, dpad))
    Q2[:, :D] = round16(scale * math.log2(math.e) * m * z[:n], dtype)
    K = np.zeros((N, dpad))
    K[:, :D] = round16(z[:N], dtype)
    return Q2, K


@pytest.mark.parametrize("dpad,D", [(32, 20), (64, 64), (128, 100), (256, 250)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_warp_online_logsumexp(dpad, D, dtype):
    """One warp's forward over a key split of 2+ tiles with a partial last tile: m + log2 l is the
    base-2 logsumexp of S2 = Q2 K^T over the split's keys, acc / l is softmax(S2) K."""
    C = cfg(dpad)
    n, N = 21, 2 * C["kStream"] + 11
    # a small scale keeps S2 near 0: an unmasked zero-filled key (S2 = 0) would move lse visibly
    Q2, K = _warp_operands(np.random.default_rng(dpad + D), n, N, D, dpad, 0.1, dtype)
    row0, jstart, jend = 16, 4, N - 3  # rows 16..20 valid, 21..31 past n; keys [4, N-3)
    m_run, l_tot, acc = _emu_forward_warp(Q2, K, row0, n, jstart, jend, C, dtype)
    S2 = Q2[row0:n] @ K[jstart:jend].T
    lse2 = np.log2(np.exp2(S2 - S2.max(1, keepdims=True)).sum(1)) + S2.max(1)
    P = np.exp2(S2 - lse2[:, None])
    ga = P @ K[jstart:jend, :D]
    got = emu_store_acc(acc, row0, n, D, C)
    for lane, h, r in _warp_rows(row0, n):
        i = r - row0
        got_lse = m_run[lane, h] + math.log2(l_tot[lane, h])
        assert abs(got_lse - lse2[i]) < 1e-9 * max(1, abs(lse2[i]))
        for c in range(D):
            # P rounded to 16 bits before P K: relative error <= 2^-8 (bf16) per term
            unit = 2 ** -8 if dtype == "bf16" else 2 ** -11
            tol = unit * (np.abs(P[i]) @ np.abs(K[jstart:jend, c]))
            assert abs(got[(r, c)] / l_tot[lane, h] - ga[i, c]) <= tol + 1e-12, (r, c)


@pytest.mark.parametrize("dpad,D", [(32, 20), (64, 64), (128, 100), (256, 250)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("where", ["band", "last"])
def test_forward_warp_leaves_the_own_key_out(dpad, D, dtype, where):
    """fwd_mma_kernel with self_offset >= 0 (docs/math.md [M:self-key]), one warp, by the
    kernel's own mask expressions: m + log2 l is the base-2 logsumexp over the split's keys but
    each row's own, acc / l the softmax over them times K.  "band": the own keys cross tile
    boundaries (a tile that holds some of the warp's own keys and one that holds the rest);
    "last": a split of one key, the own key of one row (that row gets m = -inf, l = 0, acc = 0:
    no NaN), the other rows' own keys outside it."""
    C = cfg(dpad)
    n, N = 29, 2 * C["kStream"] + 40
    Q2, K = _warp_operands(np.random.default_rng(3 * dpad + D), n, N, D, dpad, 0.5, dtype)
    row0 = 16  # rows 16..28 valid, 29..31 past n
    if where == "band":  # rows 16..28's own keys: 8 before the second tile's start, 5 from it
        jstart, jend = 9, N - 3
        offset = jstart + C["kStream"] - 24
    else:  # row 20's own key is key N - 1, the split [N - 1, N)
        offset, jstart, jend = N - 1 - 20, N - 1, N
    m_run, l_tot, acc = _emu_forward_warp(Q2, K, row0, n, jstart, jend, C, dtype, offset)
    assert not np.isnan(m_run).any() and not np.isnan(l_tot).any() and not np.isnan(acc).any()
    got = emu_store_acc(acc, row0, n, D, C)
    for lane, h, r in _warp_rows(row0, n):
        keys = [j for j in range(jstart, jend) if j != offset + r]
        if not keys:  # its own key was the split's only one: nothing of it
            assert m_run[lane, h] == -np.inf and l_tot[lane, h] == 0, r
            assert all(got[(r, c)] == 0 for c in range(D)), r
            continue
        S2 = Q2[r] @ K[keys].T
        lse2 = np.log2(np.exp2(S2 - S2.max()).sum()) + S2.max()
        got_lse = m_run[lane, h] + math.log2(l_tot[lane, h])
        assert abs(got_lse - lse2) < 1e-9 * max(1, abs(lse2)), r
        P = np.exp2(S2 - lse2)
        unit = 2 ** -8 if dtype == "bf16" else 2 ** -11
        for c in range(D):
            tol = unit * (np.abs(P) @ np.abs(K[keys, c]))
            assert abs(got[(r, c)] / l_tot[lane, h] - P @ K[keys, c]) <= tol + 1e-12, (r, c)
    if where == "band":  # the test's premise: the own keys cross a tile boundary
        assert offset >= 0 and jstart + C["kStream"] - offset - row0 == 8


@pytest.mark.parametrize("dpad,D", [(32, 32), (64, 57), (128, 128), (256, 193)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("self_offset", [-1, 0, 3, 30], ids=["every-key", "own-0", "own-3",
                                                              "own-none-here"])
def test_keys_backward_warp(dpad, D, dtype, self_offset):
    """One warp of bwd_keys_mma_kernel: dK_j = ln 2 sum_i g_i 2^(S2_ij - log2(e) lse_i) Q2_i over
    a query split with a partial last tile (zero-filled queries: lse = g = 0, contribute 0).
    self_offset >= 0 ([M:self-key]): P of query i's own key, key self_offset + i, is 0, by the
    kernel's own band test and resident row: the warp's keys 0..15 hold the own keys of the
    split's queries 2..15 (offset 0) or 2..12 (offset 3), or none (30: every own key past them)."""
    qcol = kernel_expr("bwd_keys_mma_kernel", "8 * nt + 2 * t + (e & 1)")
    own_d = kernel_expr("bwd_keys_mma_kernel", "key0 - self_offset - (istart + it * C::kStream)")
    band = kernel_expr("bwd_keys_mma_kernel", "d > -16 && d < C::kStream")
    own = kernel_expr("bwd_keys_mma_kernel", "8 * nt + 2 * t + (e & 1) == dd + g8 + 8 * (e >> 1)")
    kernel_expr("bwd_keys_mma_kernel", "s[nt][e] = 0.f;")
    kernel_expr("bwd_keys_mma_kernel",
                "s[nt][e] = exp2_approx(fmaf(s_lse[b][i], -kLog2e, s[nt][e])) * (s_g[b][i] * gscale);")
    kernel_expr("bwd_keys_mma_kernel",
                "store_acc<DPAD>(pdk, dk, key0, N, sp * N, D, kLn2 * ginv);")
    rng = np.random.default_rng(7 * dpad + D)
    C = cfg(dpad)
    n, N = 2 * C["kStream"] + 9, 19
    z = np.tanh(rng.standard_normal((max(n, N), D)))
    Q2 = np.zeros((n, dpad))
    Q2[:, :D] = round16(2.0 * math.log2(math.e) * rng.choice([-1.0, 1.0], (n, D)) * z[:n], dtype)
    K = np.zeros((N, dpad))
    K[:, :D] = round16(z[:N], dtype)
    S = (Q2 @ K.T) / math.log2(math.e)  # natural-log logits
    lse = np.log(np.exp(S).sum(1)) + rng.uniform(-0.1, 0.1, n)  # any saved lse
    g = rng.uniform(0.5, 1.5, n)
    key0, istart, iend = 0, 2, n - 1
    # fp16: g times nac::pow2_scale of the split's max |g| (pow2_scale below, tensor-core numerics)
    gscale, ginv = (float(x) for x in pow2_scale(np.float32(np.abs(g[istart:iend]).max()))) \
        if dtype == "fp16" else (1.0, 1.0)
    a = emu_load_resident(K, key0, N, C["kChunks"], C)
    dk = np.zeros((32, C["kDTiles"], 4))
    for it in range(-(-(iend - istart) // C["kStream"])):
        i0 = istart + it * C["kStream"]
        buf = emu_load_tile(Q2, i0, iend, C["kChunks"], C)
        s_lse = np.array([lse[i0 + e] if i0 + e < iend else 0.0 for e in range(C["kStream"])])
        s_g = np.array([g[i0 + e] if i0 + e < iend else 0.0 for e in range(C["kStream"])])
        s = emu_score_tile(a, buf, C, dtype)
        for lane in range(32):
            t = lane % 4
            for nt in range(C["kNTiles"]):
                for e in range(4):
                    i = qcol(nt=nt, t=t, e=e)
                    assert i == 8 * nt + c_layout(lane, e)[1]
                    s[lane, nt, e] = (np.exp2(s[lane, nt, e] - math.log2(math.e) * s_lse[i])
                                      * (s_g[i] * gscale))
        if self_offset >= 0:
            d = own_d(key0=key0, self_offset=self_offset, istart=istart, it=it,
                      kStream=C["kStream"])
            if band(d=d, kStream=C["kStream"]):
                _set_own(s, own, d, C, 0.0, "g8")
        dk = emu_accumulate_pt(dk, s, buf, C, dtype)
    got = emu_store_acc(dk * (math.log(2) * ginv), key0, N, D, C)
    P = np.exp(S[istart:iend] - lse[istart:iend, None]) * g[istart:iend, None]  # (queries, keys)
    if self_offset >= 0:  # query i's own key, key self_offset + i, takes nothing of it
        for i in range(istart, iend):
            if 0 <= self_offset + i < N:
                P[i - istart, self_offset + i] = 0.0
        assert (P == 0).sum() == sum(self_offset + i < N for i in range(istart, iend))
    expect = (P.T @ Q2[istart:iend, :D]) * math.log(2)
    bound = np.abs(P.T) @ np.abs(Q2[istart:iend, :D]) * math.log(2)
    tol = 2 ** -8 if dtype == "bf16" else 2 ** -11
    assert len(got) == N * D if N <= 16 else len(got) == 16 * D
    for (r, c), v in got.items():
        assert abs(v - expect[r, c]) <= tol * bound[r, c] + 1e-12, (r, c)


def test_bank_conflict_check_catches_unpadded_rows():
    """The padding check is not vacuous: without the +8 elements, rows alias the same banks."""
    C = dict(cfg(64), kLd=64)
    base = np.array([((lane & 7) + 8 * (lane >> 4)) * 64 + 8 * ((lane >> 3) & 1) for lane in LANES])
    with pytest.raises(AssertionError):
        check_bank_conflicts(base, C)


def test_kernel_expr_fails_on_a_changed_expression():
    with pytest.raises(AssertionError, match="index math changed"):
        kernel_expr("score_tile", "16 * j * C::kLd + 8 * kk")


def _host():
    with open(os.path.join(ROOT, "csrc", "nac_cuda.cu")) as fh:
        return fh.read()


def _plan(rows, tiles_stream, stream, programs, sms=132, blocks_per_sm=1):
    """nac_cuda.cu's split_for and tiles_per_split for `rows` streamed rows (host side)."""
    host = _host()
    assert ("int64_t want = (int64_t(sms) * std::max(blocks_per_sm, 1) + programs - 1) / programs"
            in host)
    assert "while (split * 2 <= std::min<int64_t>({want, tiles, 64})) split *= 2;" in host
    assert "const int64_t tiles_per_split = (ktiles + nsplit - 1) / nsplit;" in host  # fwd
    assert "const int64_t per = (qtiles + nsplit - 1) / nsplit;" in host  # keys' backward
    want, split = -(-sms * max(blocks_per_sm, 1) // programs), 1
    while split * 2 <= min(want, tiles_stream, 64):
        split *= 2
    return split, -(-tiles_stream // split)


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("n,N", [(1, 1), (97, 4099), (1000, 131), (8192, 65536), (129, 128)])
@pytest.mark.parametrize("kernel", ["fwd_mma_kernel", "bwd_keys_mma_kernel"])
def test_grid_covers_every_row_and_splits_partition_the_stream(kernel, n, N, dpad):
    """Each resident row belongs to exactly one (block, warp); the splits' [start, end) ranges
    partition the streamed rows, each split's tiles cover its range (empty splits: 0 tiles)."""
    C = cfg(dpad)
    fwd = kernel == "fwd_mma_kernel"
    res_rows, st_rows = (n, N) if fwd else (N, n)
    kernel_expr(kernel, "= int64_t(blockIdx.x) * kResident + 16 * warp;")  # row0 / key0 below
    assert "constexpr int kResident = 16 * kWarps;" in SRC
    s, e = ("jstart", "jend") if fwd else ("istart", "iend")
    total = "N" if fwd else "n"
    start_of = kernel_expr(kernel, "sp * tiles_per_split * C::kStream")
    kernel_expr(kernel, f"{e} = std::min<int64_t>({total}, {s} + tiles_per_split * C::kStream);")
    ntiles_of = kernel_expr(kernel, f"{e} > {s} ? ({e} - {s} + C::kStream - 1) / C::kStream : 0")
    blocks = -(-res_rows // 128)
    seen = np.zeros(res_rows, int)
    for bx in range(blocks):
        for warp in range(8):
            row0 = bx * 128 + 16 * warp
            for r in range(row0, min(row0 + 16, res_rows)):
                seen[r] += 1
    assert (seen == 1).all()
    tiles = -(-st_rows // C["kStream"])
    nsplit, per = _plan(st_rows, tiles, C["kStream"], blocks)
    covered = np.zeros(st_rows, int)
    for sp in range(nsplit):
        start = start_of(sp=sp, tiles_per_split=per, **C)
        end = min(st_rows, start + per * C["kStream"])
        nt = ntiles_of(**{s: start, e: end}, **C)
        length = max(end - start, 0)
        assert nt * C["kStream"] >= length and (nt - 1) * C["kStream"] < max(length, 1)
        covered[start:end] += 1
    assert (covered == 1).all()


def test_host_split_plans_use_each_kernels_occupancy():
    """Issue 23, item 3: every split plan of the host (SIMT and tensor-core, forward and keys'
    backward) asks the occupancy of the kernel it launches, not a fixed 2 blocks per SM."""
    host = _host()
    assert "2 * sms" not in host
    for call in ("split_for(qtiles, ktiles, occupancy)", "split_for(ktiles, qtiles, occupancy)",
                 "split_for(qtiles, ktiles, nac_mma::fwd_blocks_per_sm(p.dt, p.dpad))",
                 "split_for(ktiles, qtiles, nac_mma::bwd_blocks_per_sm(p.dt, p.dpad))",
                 "blocks_per_sm(fwd_kernel<acc_t, acc_t, DPAD>, kThreads)",
                 "blocks_per_sm(bwd_keys_kernel<acc_t, acc_t, DPAD>, kThreads)"):
        assert call in host, call
    for kernel in ("fwd_mma_kernel", "bwd_keys_mma_kernel"):
        for dpad in DPADS:
            assert f"occupancy({kernel}<T, {dpad}>)" in SRC, (kernel, dpad)
    # one block per SM (the bf16 kernels' 190-255 registers x 256 threads) halves the split of a
    # fixed 2 per SM: at n = N = 8192 (64 resident tiles of 128) on 132 SMs, 2 splits, not 4
    assert _plan(8192, 128, 64, 64, blocks_per_sm=1)[0] == 2
    assert _plan(8192, 128, 64, 64, blocks_per_sm=2)[0] == 4


# ---------------------------------------------------------------------------------------------
# Tensor-core numerics: the fp16 keys' gradient (issue 23, item 1), its rounding steps
# emulated in numpy on whole problems; nac::pow2_scale (csrc/nac_math.h) compiled on the host
#
# bwd_keys_mma_kernel forms P^T g in fp32 and packs it to fp16 (cvt.rn.f16x2.f32) for the second
# tensor-core product.  With reduction="mean", g = 1/n and P ~ 1/N: at n = N = 8192, P g ~ 1e-8,
# below fp16's smallest subnormal (6e-8), and the keys' gradient came out 13 % wrong.  The kernel
# now multiplies g by a power of two (max |g| 2^k in [2^13, 2^14)) and divides it out of the fp32
# accumulator at the store (docs/math.md [M:grad-scale]).
#
# The emulation follows the kernel's steps, each rounded as the hardware rounds it:
#   prologue   Q2 = fp16(fp32(fp32(m z) s log2 e)), z = tanh(a) in fp32; keys as given (fp16);
#   forward    lse = fp32(ln 2 * log2-sum-exp2 of S2) (the finish kernel's fp32 result; its own
#              rounding, ~1e-7, is far below what is measured here);
#   backward   S2^T = K Q2^T in fp32 (products of fp16 values are exact in fp32, summed in fp32 by
#              numpy's BLAS: another order than the tensor core's, the same precision);
#              x = fmaf(lse, -log2 e, S2^T) (one rounding); p = ex2.approx.ftz(x) (exact exp2
#              rounded to fp32, results below 2^-126 flushed to 0: the approximation's 2^-22
#              relative error is far below fp16's 2^-11); p * fp32(g * gscale) in fp32, rounded to
#              fp16 with subnormals (cvt.rn.f16x2.f32); dK = sum of fp16(P^T g) Q2 in fp32, times
#              fp32(ln 2 * ginv); then rounded to fp16, the keys' dtype (the autograd glue's cast).
# Whether the kernel scales g is read from its source (the expressions below must occur verbatim in
# bwd_keys_mma_kernel), so this test fails on a kernel without the scale.
# ---------------------------------------------------------------------------------------------

SCALE_USE = "exp2_approx(fmaf(s_lse[b][i], -kLog2e, s[nt][e])) * (s_g[b][i] * gscale)"
SCALE_UNDO = "store_acc<DPAD>(pdk, dk, key0, N, sp * N, D, kLn2 * ginv);"
SCALE_FROM = "const nac::Pow2Scale ps = nac::pow2_scale(gm);"
F32 = np.float32


def kernel_scales_g() -> bool:
    """Whether bwd_keys_mma_kernel scales g (all three steps present in its source)."""
    src = body("bwd_keys_mma_kernel")
    return all(x in src for x in (SCALE_USE, SCALE_UNDO, SCALE_FROM))


def pow2_scale(gmax: float):
    """nac::pow2_scale in numpy: (2^k, 2^-k) as float32, from gmax's exponent bits."""
    e = int(np.array(gmax, F32).view(np.uint32)) >> 23 & 0xFF
    b = min(max(267 - e, 2), 253)
    return (np.array(b << 23, np.uint32).view(F32)[()],
            np.array((254 - b) << 23, np.uint32).view(F32)[()])


def _fp32(x):
    return np.asarray(x, np.float64).astype(F32)


def emulate_keys_grad(a, r, keys, noise, reduction: str, p: float = 0.1,
                      scaled=None, chunk: int = 1024) -> np.ndarray:
    """The keys' gradient (N, D) float64 that bwd_keys_mma_kernel computes for fp16 inputs
    (torch tensors a, r, keys, noise, fp16) and g of `reduction` ("mean" or "sum"), one query
    split; `scaled`: None = as the kernel's source says, else force with/without the scale."""
    assert a.dtype == torch.float16 and keys.dtype == torch.float16
    n, D = a.shape
    s = 0.5 * math.log((1 - p) / p)
    z = np.tanh(a.double().numpy().astype(F32))                   # tanhf, fp32
    mz = _fp32(noise.double().numpy().astype(F32) * z)
    Q2 = round16(_fp32(mz * F32(s * 1.4426950408889634)), "fp16")  # float64 holding fp16 values
    K = keys.double().numpy()
    # forward: lse in natural units, fp32
    S2 = Q2 @ K.T
    mx = S2.max(1, keepdims=True)
    lse = _fp32((mx[:, 0] + np.log2(np.exp2(S2 - mx).sum(1))) * math.log(2))
    del S2
    g = np.full(n, F32(1.0) if reduction == "sum" else F32(1.0) / F32(n), F32)
    if scaled is None:
        scaled = kernel_scales_g()
    gscale, ginv = pow2_scale(float(np.abs(g).max())) if scaled else (F32(1), F32(1))
    gs = _fp32(g.astype(np.float64) * float(gscale))
    log2e = F32(1.4426950408889634)
    Kf, Qf = K.astype(F32), Q2.astype(F32)   # fp16 values: exact in fp32
    dk = np.zeros((K.shape[0], D), F32)
    for i0 in range(0, n, chunk):
        q = Qf[i0:i0 + chunk]
        st = Kf @ q.T                                              # fp32 sums (BLAS)
        x = _fp32(st.astype(np.float64) - lse[i0:i0 + chunk].astype(np.float64) * float(log2e))
        pe = _fp32(np.exp2(x.astype(np.float64)))
        pe[pe < 2.0 ** -126] = 0.0                                # .ftz
        pt = round16(_fp32(pe.astype(np.float64) * gs[i0:i0 + chunk]), "fp16").astype(F32)
        dk += pt @ q                                               # fp32 accumulation
    dk = _fp32(dk.astype(np.float64) * float(_fp32(math.log(2) * float(ginv))))
    return round16(dk, "fp16")  # the op's fp32 result, cast to the keys' dtype by the autograd glue


def exact_keys_grad(a, r, keys, noise, reduction: str, p: float = 0.1,
                    chunk: int = 1024) -> np.ndarray:
    """d/dkeys of the loss in float64 (docs/math.md [M:grad-keys]): sum_i g_i P_ij s m_i z_i,
    from the same fp16-rounded inputs; written independently of nac_fast."""
    n, D = a.shape
    s = 0.5 * math.log((1 - p) / p)
    zt = noise.double().numpy() * np.tanh(a.double().numpy())
    K = keys.double().numpy()
    g = 1.0 if reduction == "sum" else 1.0 / n
    dk = np.zeros_like(K)
    for i0 in range(0, n, chunk):
        L = s * zt[i0:i0 + chunk] @ K.T
        P = np.exp(L - L.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        dk += P.T @ (g * s * zt[i0:i0 + chunk])
    return dk


def fp16_inputs(n, N, D, scale=0.5, seed=0):
    """(a, r, keys, noise) in fp16, a ~ N(0, scale^2), keys tanh of the same: with scale 0.5
    the softmax is nearly flat (P ~ 1/N) and the keys' gradient, ~1e-5 at n = N = 8192, is still
    an fp16 number (smaller codes make it smaller than fp16 can hold, whatever the kernel)."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, D, generator=gen) * scale).half()
    r = (torch.randn(n, D, generator=gen) * 2).half()
    keys = torch.tanh(torch.randn(N, D, generator=gen) * scale).half()
    noise = torch.where(torch.rand(n, D, generator=gen) < 0.1, -1.0, 1.0).half()
    return a, r, keys, noise


def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("n,N", [(64, 8192), (2048, 2048),
                                 pytest.param(8192, 8192, marks=pytest.mark.slow)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp16_keys_gradient_of_the_cuda_kernel(n, N, reduction):
    """Within 1e-2 of float64 (the issue's absolute goal; measured 4e-4 at 2048, 1.6e-3 at 8192:
    the fp16 rounding of the result itself); without the scale the same steps are not (1.05e-2
    at n = N = 2048, 8.0e-2 at 8192, "mean"): the emulation can fail."""
    a, r, keys, noise = fp16_inputs(n, N, 64)
    ref = exact_keys_grad(a, r, keys, noise, reduction)
    assert kernel_scales_g(), "bwd_keys_mma_kernel no longer scales g (see the module doc)"
    err = _rel(emulate_keys_grad(a, r, keys, noise, reduction), ref)
    assert err <= 1e-2, err
    if reduction == "mean" and n * N >= 2048 * 2048:
        assert _rel(emulate_keys_grad(a, r, keys, noise, reduction, scaled=False), ref) > 1e-2


@pytest.mark.parametrize("gmax", [0.0, 1.0, 1.999, 2.0, 1 / 8192, 3e-30, 1e-40, 6e4, 3e38,
                                  float("inf"), float("nan")])
def test_pow2_scale_python_and_its_range(gmax):
    scale, inv = pow2_scale(gmax)
    assert scale > 0 and inv > 0 and float(scale) * float(inv) == 1.0
    assert math.log2(scale) == round(math.log2(scale))  # a power of two: scaling is exact
    if math.isfinite(gmax) and 2.0 ** -114 <= gmax:
        assert 2 ** 13 <= gmax * float(scale) < 2 ** 14
    elif gmax < 2.0 ** -114:  # zero and tiny: the largest scale that keeps 2^-k normal
        assert scale == 2.0 ** 126


def test_pow2_scale_of_the_cuda_header_matches():
    """csrc/nac_math.h's nac::pow2_scale (what the CUDA kernel calls) compiled on the host: the
    same bits as the numpy version (and so as the Triton kernel's _pow2_scale, which the
    interpreter tests check end to end)."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    values = [0.0, 1.0, 1.999, 2.0, 1 / 8192, 3e-30, 1e-40, 6e4, 3e38, float("inf")]
    prog = ('#include <stdio.h>\n#include "nac_math.h"\nint main() {\n  const float v[] = {'
            + ", ".join("INFINITY" if math.isinf(v) else repr(float(v)) + "f" for v in values)
            + '};\n  for (float x : v) { nac::Pow2Scale p = nac::pow2_scale(x);\n'
            '    printf("%a %a\\n", (double)p.scale, (double)p.inv); }\n}\n')
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pow2_scale_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "t.cpp"), "w") as f:
        f.write(prog)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", os.path.join(ROOT, "csrc"),
                    os.path.join(tmp, "t.cpp"), "-o", os.path.join(tmp, "t")], check=True)
    out = subprocess.run([os.path.join(tmp, "t")], capture_output=True, text=True, check=True)
    got = [tuple(float.fromhex(x) for x in line.split()) for line in out.stdout.splitlines()]
    shutil.rmtree(tmp, ignore_errors=True)
    want = [tuple(float(x) for x in pow2_scale(v)) for v in values]
    assert got == want


# ---------------------------------------------------------------------------------------------
# Launch limits: integer widths of csrc/*.cu (the Hamming engine's block sizes and grids:
# tests/test_hamming_cuda.py)
#
# No GPU here: the kernels cannot run; the launches and declarations are read out of the source.
# ---------------------------------------------------------------------------------------------

INT32_MAX = r"(?:std::numeric_limits<int32_t>::max\(\)|INT32_MAX|2147483647|\(int64_t\{1\} << 31\) - 1)"


def _src(path: str) -> str:
    with open(path) as f:
        src = f.read()
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _body(src: str, name: str) -> str:
    """The body (braces included) of the function `name` defined in `src`."""
    m = re.search(r"\b" + name + r"\s*\([^;{}]*\)\s*\{", src)
    assert m, f"{name} not found"
    i, d = m.end() - 1, 0
    for j in range(i, len(src)):
        d += {"{": 1, "}": -1}.get(src[j], 0)
        if d == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


# Guards: the Triton defects' expressions stay int64 in the CUDA kernels.
# Split / slice bounds and tile row bases: the int32 `s*L + L` and `row * stride` of the Triton
# kernels.  In the CUDA sources each is int64_t (a 32-bit type here would wrap within a few tiles
# of 2^31 rows, as Triton's did).
BOUNDS = {
    "nac_cuda.cu": ("i0", "j0", "jstart", "jend", "istart", "iend", "row"),
    "nac_cuda_mma.cu": ("row0", "key0", "sp", "jstart", "jend", "istart", "iend", "ntiles",
                        "j0", "it", "row", "r_lo", "r_hi", "total", "src"),
    "hamming_lanes.h": ("begin", "end", "c0", "c1", "gi", "at", "key", "na", "nb"),
}
NARROW = r"(?:int|unsigned|unsigned int|int32_t|uint32_t|long|auto)"


def test_split_bounds_and_row_bases_are_int64():
    """The Triton kernels twice wrapped an int32 at sizes near 2^31 (a split end `s*L + L`, a row
    offset `row * stride`; kernels/nac_triton.py MAX_ROWS / MAX_ROW_STRIDE, the integer-limit
    tests of the loss's numerics).  The CUDA kernels compute those in int64; this keeps it so."""
    for name, idents in BOUNDS.items():
        src = _src(os.path.join(CSRC, name))
        for ident in idents:
            wide = re.findall(r"\bint64_t\s+(?:[\w\s,=+*/()<>:.\-?]*?,\s*)?" + ident + r"\b\s*[=;,]",
                              src)
            assert wide, f"{name}: {ident} is not declared int64_t"
            narrow = re.findall(r"(?<![\w:])(?:const\s+)?" + NARROW + r"\s+" + ident + r"\s*[=;,]",
                                src)
            assert not narrow, f"{name}: {ident} declared with a 32-bit type: {narrow}"


def test_kernel_row_indices_start_in_64_bits():
    """blockIdx.x * blockDim.x is unsigned int: every product with blockIdx.x / gridDim.x is widened
    first (int64_t(blockIdx.x) * ..., blockIdx.x * int64_t(...) / static_cast<int64_t>(...))."""
    wide = r"(?:int64_t\(|\(int64_t\)|static_cast<int64_t>\()"
    for name in ("nac_cuda.cu", "nac_cuda_mma.cu", "hamming_cuda.cu"):
        src = _src(os.path.join(CSRC, name))
        products = 0
        for m in re.finditer(r"(\S*)\s*\b(blockIdx|gridDim)\.x\)?\s*\*\s*(\S+)", src):
            products += 1
            left, right = m.group(1), m.group(3)
            assert left.endswith(("int64_t(", "(int64_t)")) or re.match(wide, right), \
                f"{name}: 32-bit product {m.group(0)!r}"
        assert not re.search(r"\*\s*(blockIdx|gridDim)\.x", src), name
        assert products, name
