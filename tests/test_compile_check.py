"""The compile-only GPU check (tools/compile_check.py): every Triton kernel configuration the
launchers can choose, compiled for sm_80 and sm_90 on this CPU, fits shared memory, does not spill
on the 16-bit and TF32 paths and uses tensor cores there; the CUDA kernels likewise (nvcc).  It
runs once per test session, in a child process without TRITON_INTERPRET.  It reuses the committed
table's figures of every launch whose content key (`launch_key`: no line number or comment) is
unchanged, and compiles 64 of those again to verify them (a few minutes); a launch whose kernel
changed is compiled, and test_the_committed_table_is_current then asks for the table to be
regenerated."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import compile_check as CC  # noqa: E402

NAC_KERNELS = ("prologue", "fwd", "finish", "bwd_keys", "bwd_rows")
COMMITTED = os.path.join(ROOT, "bench", "results", "compile_check.csv")
REGENERATE = ("python tools/compile_check.py --reuse bench/results/compile_check.csv "
              "--csv /tmp/cc.csv && mv /tmp/cc.csv bench/results/compile_check.csv")


def _run_check(args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def check_rows(tmp_path_factory):
    out_csv = tmp_path_factory.mktemp("cc") / "compile_check.csv"
    # a stale table costs time (its changed launches compile), never coverage
    proc = _run_check(["--csv", str(out_csv), "--jobs", str(max(2, os.cpu_count() or 2)),
                       "--reuse", COMMITTED, "--verify", "64"], timeout=3600)
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    with open(out_csv) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_every_configuration_compiles_within_limits(check_rows):
    bad = [r for r in check_rows if r["problems"]]
    assert not bad, bad
    # a note only on folded kernels that spill (the plans run those configurations unfolded)
    for r in check_rows:
        if r["note"]:
            assert r["folded"] == "1" and int(r["spill_store_bytes"]) > 0, r


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_the_committed_table_is_current(check_rows):
    """Every launch's figures came from bench/results/compile_check.csv (the table the docs
    cite), and the 64 compiled again to verify them matched (test above: a mismatch is a
    problem)."""
    triton = [r for r in check_rows if not r["kernel"].startswith("cuda:")]
    assert sum(r["checked"] == "verified" for r in triton) == 64
    stale = [(r["kernel"], r["arch"], r["dtype"], r["D"], r["blocks"]) for r in triton
             if r["checked"] == "compiled"]
    assert not stale, (f"{len(stale)} launches changed since bench/results/compile_check.csv "
                       f"was written (e.g. {stale[:3]}): regenerate it: {REGENERATE}")


@pytest.mark.slow  # compiles a slice (about 30 s)
def test_verify_catches_a_wrong_reused_figure(tmp_path):
    """--verify compiles reused launches again: a reused figure that is not what the compiler
    gives is a problem (exit 1), and the rest of the slice is clean."""
    with open(COMMITTED, newline="") as f:
        rows = list(csv.DictReader(f))
    args = ["--archs", "90", "--dtypes", "float64", "--D", "16", "--modes", "inbatch",
            "--no-candidates", "--no-cuda", "--jobs", "2"]
    # the slice's keys, from a reuse run that compiles nothing
    probe = _run_check(args + ["--reuse", COMMITTED, "--csv", str(tmp_path / "a.csv")], 600)
    assert probe.returncode == 0, probe.stdout[-4000:] + probe.stderr[-4000:]
    with open(tmp_path / "a.csv", newline="") as f:
        keys = {r["key"] for r in csv.DictReader(f)}
    assert keys and all(r["checked"] == "reused" for r in csv.DictReader(open(tmp_path / "a.csv")))
    victim = next(r for r in rows if r["key"] in keys and r["kernel"] == "finish")
    victim["registers"] = str(int(victim["registers"]) + 8)
    tampered = tmp_path / "tampered.csv"
    with open(tampered, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if r["key"] in keys)
    proc = _run_check(args + ["--reuse", str(tampered), "--verify", str(len(keys)),
                              "--csv", str(tmp_path / "b.csv")], 600)
    assert proc.returncode == 1, proc.stdout[-4000:]
    bad = [line for line in proc.stdout.splitlines() if line.startswith("PROBLEM")]
    assert len(bad) == 1 and "finish" in bad[0] and "registers" in bad[0], bad
    assert f"registers {victim['registers']} reused" in bad[0]


def test_verify_sample_takes_every_kernel_then_draws(monkeypatch):
    import types
    reused = {}
    for i in range(30):
        tag = ("fwd", "finish", "noise")[i % 3] if i < 27 else "fwd"
        reused[f"k{i:02d}"] = dict(launch=types.SimpleNamespace(tag=tag), arch=80 + 10 * (i % 2))
    groups = {(u["launch"].tag, u["arch"]) for u in reused.values()}
    a = CC._verify_sample(reused, 10, seed=3)
    assert len(a) == 10 and a == CC._verify_sample(reused, 10, seed=3)
    assert {(reused[k]["launch"].tag, reused[k]["arch"]) for k in a} == groups
    assert len(CC._verify_sample(reused, 3, seed=3)) == 3
    assert CC._verify_sample(reused, 100, seed=1) == set(reused)


@pytest.mark.parametrize("argv,msg", [
    (["--verify", "3"], "--verify needs --reuse"),
    (["--reuse", "/nonexistent.csv"], "is not a file"),
    (["--reuse", COMMITTED, "--verify", "-1"], "--verify"),
    (["--reuse", COMMITTED, "--csv", COMMITTED], "would be overwritten"),
])
def test_reuse_arguments_are_checked(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        CC.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_reuse_refuses_a_table_without_keys(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("kernel,arch,registers\nfwd,90,128\n")
    with pytest.raises(ValueError, match="no `key` column"):
        CC.read_reusable(str(old))


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_the_grid_is_covered(check_rows):
    seen = {(r["kernel"], r["arch"], r["dtype"], r["D"]) for r in check_rows}
    for arch in ("80", "90"):
        for dtype in CC.DTYPES:
            for D in map(str, CC.DS):
                for k in NAC_KERNELS:
                    assert (k, arch, dtype, D) in seen, (k, arch, dtype, D)
        for k in ("noise", "hamming_cdist", "hamming_ap"):
            assert any(r["kernel"] == k and r["arch"] == arch for r in check_rows), (k, arch)
        # the keys' backward's one-split modes: the keys' gradient written directly, and the rows'
        # backward fused in wherever FUSED_CONFIGS has a configuration; the split sums
        from nac_fast.kernels import nac_triton
        for dtype in CC.DTYPES:
            fam = nac_triton._family(getattr(__import__("torch"), dtype))
            for D in CC.DS:
                assert ("bwd_keys_out1", arch, dtype, str(D)) in seen, (arch, dtype, D)
                fused = nac_triton.FUSED_CONFIGS.get((fam, D), "default") is not None
                assert (("bwd_keys_out2", arch, dtype, str(D)) in seen) == fused, (arch, dtype, D)
                # the rows' backward folded into the keys' backward of several splits
                assert ("bwd_keys_out3", arch, dtype, str(D)) in seen, (arch, dtype, D)
        # the forward with and without its finish folded in, at every dtype and D
        folds = {(r["dtype"], r["D"], r["folded"]) for r in check_rows
                 if r["kernel"] == "fwd" and r["arch"] == arch}
        for dtype in CC.DTYPES:
            for D in map(str, CC.DS):
                assert {(dtype, D, "1"), (dtype, D, "0")} <= folds, (arch, dtype, D)
        assert any(r["kernel"] == "sum_splits" and r["arch"] == arch for r in check_rows)
        # both modes, each with the rows' own keys left out too ([M:self-key]: the kernels'
        # SELF), and fp32's five product modes, were planned
        fwd = [r for r in check_rows if r["kernel"] == "fwd" and r["arch"] == arch]
        assert {m for r in fwd for m in r["modes"].split("+")} == {
            "inbatch", "queue", "inbatch-self", "queue-self"}
        own = {(r["kernel"], r["dtype"], r["D"], m) for r in check_rows if r["arch"] == arch
               for m in r["modes"].split("+") if m.endswith("-self")}
        for dtype in CC.DTYPES:
            for D in map(str, CC.DS):
                for mode in ("inbatch-self", "queue-self"):
                    assert ("fwd", dtype, D, mode) in own, (arch, dtype, D, mode)
                    assert any(k.startswith("bwd_keys") and tuple(x) == (dtype, D, mode)
                               for k, *x in own), (arch, dtype, D, mode)
        # only the matrix kernels take SELF: the row-wise ones are the paper's own launches
        assert {k for k, *_ in own} <= set(CC.MATRIX_KERNELS)
        assert {r["precision"] for r in fwd if r["dtype"] == "float32"} == {
            "tf32x3", "tf32", "ieee", "bf16x6", "fp16x3"}


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_smem_estimate_bounds_the_compiled_figure(check_rows):
    """The launchers prune configurations by nac_triton.smem_estimate: it must not undercount."""
    rows = [r for r in check_rows if r["smem_estimate"]]
    assert rows
    for r in rows:
        assert int(r["smem_bytes"]) <= int(r["smem_estimate"]), r


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_matrix_kernels_use_tensor_cores(check_rows):
    for r in check_rows:
        if r["kernel"] in ("fwd", "bwd_keys") and (r["dtype"] in ("bfloat16", "float16")
                                                   or r["precision"] in (
                                                       "tf32", "tf32x3", "bf16x6", "fp16x3")):
            assert int(r["mma_count"]) > 0 and r["mma_instr"], r
    # Hopper's warpgroup MMA on the headline shape (bf16, D = 128)
    hopper = [r for r in check_rows if r["kernel"] in ("fwd", "bwd_keys") and r["arch"] == "90"
              and r["dtype"] == "bfloat16" and r["D"] == "128"]
    assert hopper and all("HGMMA" in r["mma_instr"] for r in hopper), hopper


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_hamming_topk_mma_runs_on_the_tensor_cores(check_rows):
    """The Hamming top-k's int8 filter (kernels/hamming_triton.py `_topk_mma_kernel`) at every
    word count of the grid's code lengths (one launch per word count: the bits are a run-time
    argument): IGMMA (wgmma) on sm_90, IMMA on sm_80, no spill."""
    rows = [r for r in check_rows if r["kernel"] == "hamming_topk_mma"]
    assert {(r["arch"], -(-int(r["D"]) // 64)) for r in rows} == {
        (a, -(-d // 64)) for a in ("80", "90") for d in CC.DS}
    for r in rows:
        assert ("IGMMA" if r["arch"] == "90" else "IMMA") in r["mma_instr"].split("+"), r
        assert r["spill_store_bytes"] == "0" and r["spill_load_bytes"] == "0", r


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_cuda_kernels_checked_when_nvcc_is_present(check_rows):
    cuda = [r for r in check_rows if r["kernel"].startswith("cuda:")]
    try:
        sys.path.insert(0, os.path.join(ROOT, "csrc"))
        import build_flags
        have_nvcc = build_flags.find_cuda_home() is not None
    except Exception:  # noqa: BLE001 - no toolkit helper: judged by nvcc on PATH below
        have_nvcc = os.path.exists("/usr/local/cuda/bin/nvcc")
    if not have_nvcc:
        pytest.skip("no CUDA toolkit here: the .cu file is not compiled")
    assert {r["arch"] for r in cuda} == {"80", "90"}
    for r in cuda:
        if r["dtype"] in ("bfloat16", "float16"):
            assert r["spill_store_bytes"] == "0" and r["spill_load_bytes"] == "0", r


def _row(**kw):
    base = dict(kernel="fwd", arch=90, dtype="bfloat16", D=128, precision="ieee",
                smem_bytes=1000, smem_limit=2000, spill_store_bytes=0, spill_load_bytes=0,
                mma_count=4, compile_s=1.0)
    base.update(kw)
    return base


@pytest.mark.parametrize("row,expect", [
    (_row(), None),
    (_row(smem_bytes=3000), "shared memory"),
    (_row(spill_store_bytes=8), "spills"),
    (_row(dtype="float32", precision="tf32x3", spill_load_bytes=4), "spills"),
    (_row(dtype="float32", precision="bf16x6", spill_store_bytes=4), "spills"),  # 16-bit parts
    (_row(dtype="float32", precision="bf16x6", mma_count=0), "tensor-core"),
    (_row(dtype="float32", precision="fp16x3", spill_store_bytes=4), "spills"),
    (_row(dtype="float32", precision="fp16x3", mma_count=0), "tensor-core"),
    (_row(dtype="float32", precision="ieee", spill_store_bytes=64), None),  # FMA path: reported
    (_row(dtype="float64", precision="ieee-fp64", spill_store_bytes=64), None),
    (_row(mma_count=0), "tensor-core"),
    (_row(kernel="finish", mma_count=0), None),
    (_row(compile_s=25.0), "compile took"),
    # a folded kernel that spills: not launched (Target.clean), noted, not a problem; its other
    # problems stay problems
    (_row(kernel="bwd_keys_out3", folded=1, spill_store_bytes=8), None),
    (_row(folded=1, spill_store_bytes=8, smem_bytes=3000), "shared memory"),
    (_row(folded=1, mma_count=0), "tensor-core"),
    # the int8 tensor-core filter of the Hamming top-k: IMMA / IGMMA and no spill, or a problem
    (_row(kernel="hamming_topk_mma", dtype="int64", precision="", mma_instr="IGMMA"), None),
    (_row(kernel="hamming_topk_mma", dtype="int64", precision="", mma_instr="IMMA"), None),
    (_row(kernel="hamming_topk_mma", dtype="int64", precision="", mma_instr=""),
     "integer tensor-core"),
    (_row(kernel="hamming_topk_mma", dtype="int64", precision="", mma_instr="HMMA"),
     "integer tensor-core"),
    (_row(kernel="hamming_topk_mma", dtype="int64", precision="", mma_instr="IGMMA",
          spill_load_bytes=4), "int8 tensor-core kernel"),
    (_row(kernel="hamming_topk", dtype="int64", precision="", mma_instr="", mma_count=0,
          spill_store_bytes=8), None),  # the popcount filter: no matrix instruction to find
])
def test_problem_rules(row, expect):
    got = CC._triton_problems(row, 20.0)
    if expect is None:
        assert got == []
    else:
        assert any(expect in p for p in got), got
    if row.get("folded") and row["spill_store_bytes"]:
        assert "not launched" in row["note"]


# ---- occupancy (issue 23, item 3): programs per SM from each compiled configuration ----------

def test_blocks_per_sm_limits():
    from nac_fast.kernels.launch import SM90, blocks_per_sm
    sm = SM90.smem_per_sm
    assert blocks_per_sm(190, 65536, 8, sm) == 1      # the bf16 configurations: one per SM
    assert blocks_per_sm(96, 9216, 4, sm) == 5        # registers: 65536 // (3072 * 4)
    assert blocks_per_sm(32, 0, 4, sm) == 16          # warps: 64 // 4
    assert blocks_per_sm(16, 0, 1, sm) == 32          # the 32-block limit
    assert blocks_per_sm(32, 120 * 1024, 4, sm) == 1  # shared memory
    assert blocks_per_sm(255, 0, 16, sm) == 0         # 255 x 512 threads: does not fit
    with pytest.raises(ValueError):
        blocks_per_sm(0, 0, 4, sm)


def test_split_plans_follow_the_occupancy(monkeypatch):
    """One block per SM: in-batch 8192 x 128 bf16 on sm_90 (64 query blocks of the built-in
    configuration) splits the keys in 2, not the 4 of a fixed 2 blocks per SM (two waves, twice
    the partials' traffic).  The built-in configuration: the shipped tuned table is off here."""
    import dataclasses
    monkeypatch.setenv("NAC_FAST_TUNED", "0")

    import torch
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton
    a = torch.empty((8192, 128), dtype=torch.bfloat16, device="meta")
    asked = []

    def occ(per_sm):
        def f(L):
            asked.append(L.tag)
            return per_sm
        return f
    for per_sm, split in ((1, 2), (2, 4)):
        t = dataclasses.replace(KL.SM90, occupancy=occ(per_sm))
        launches, _ = nac_triton.fwd_plan(a, a, a, None, 1.1, 0.0, True, t)
        fwd = [L for L in launches if L.tag == "fwd"][0]
        assert fwd.grid == (64, split)
    assert asked == ["fwd", "fwd"]


def test_compiled_occupancy_reads_the_compiled_kernel(monkeypatch):
    """On a GPU the occupancy comes from the kernel Triton compiled (registers, shared memory,
    warps), compiled once per specialisation (JITFunction.warmup, no launch)."""
    import types

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nac_fast.kernels import launch as KL
    calls = []

    class Kernel:
        __name__ = "k"

        def warmup(self, *args, grid, num_warps, num_stages, **constexprs):
            calls.append(grid)
            return types.SimpleNamespace(n_regs=168, metadata=types.SimpleNamespace(
                shared=4096, num_warps=num_warps), _init_handles=lambda: None)
    monkeypatch.setattr(KL, "_cuda_target", lambda index: KL.SM90)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    KL._OCCUPANCY.clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(10, device="cuda:0")
        L = KL.Launch(Kernel(), (3,), (x, 10), dict(BLOCK=4), 4, 1, "t")
        # 168 registers x 128 threads: 21504 of 65536 registers, 3 blocks
        assert KL.compiled_occupancy(L) == KL.blocks_per_sm(168, 4096, 4, KL.SM90.smem_per_sm) == 3
        assert KL.compiled_occupancy(L) == 3
    assert len(calls) == 1  # cached
    KL._OCCUPANCY.clear()


_PTXAS_PROBE = r"""
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
import compile_check as CC
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def k(X, Y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + o, tl.exp(tl.load(X + o, mask=o < n)) * 2.0, mask=o < n)

def build():
    return triton.compile(ASTSource(k, {"X": "*fp32", "Y": "*fp32", "n": "i32"},
                                    {"BLOCK": 256}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1))

compiled, log = CC._ptxas_log(build)
again, log2 = CC._ptxas_log(build)          # Triton's cache: no ptxas ran
with tempfile.TemporaryDirectory() as tmp:  # the same cubin's figures, ptxas asked again
    ptx = os.path.join(tmp, "k.ptx")
    open(ptx, "w").write(compiled.asm["ptx"])
    own = subprocess.run([CC._triton_bin("ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o",
                          os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
regs = lambda s: int(re.search(r"Used (\d+) registers", s).group(1))
print(json.dumps(dict(log=regs(log), own=regs(own), second=log2,
                      same_cubin=again.asm["cubin"] == compiled.asm["cubin"])))
"""


def test_ptxas_figures_are_tritons_own(tmp_path):
    """The registers and spills are read from the ptxas that Triton ran to build the cubin (its
    log, that Triton version's flags), not from a second ptxas run; a cache hit gives no log."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    probe = tmp_path / "probe.py"  # @triton.jit wants its source in a file
    probe.write_text(_PTXAS_PROBE)
    proc = subprocess.run([sys.executable, str(probe), os.path.join(ROOT, "tools")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["log"] == got["own"] > 0
    assert got["second"] is None and got["same_cubin"]


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_compile_check_records_occupancy(check_rows):
    for r in check_rows:
        assert int(r["blocks_per_sm"]) >= 1, r


# ---- autotune candidates (issue 38): a tuned table may name only compile-checked ones --------

def _candidate_name(dtype, precision):
    """The CANDIDATES key's dtype part of a candidate launch or row (kernels/tuning.py
    candidate_name: "float32:bf16x6" / "float32:fp16x3" for fp32 in those modes, else the
    dtype)."""
    from nac_fast.kernels import tuning
    return tuning.candidate_name(dtype, precision)


def _candidate_keys(arch):
    from nac_fast.kernels import nac_triton
    out = set()
    for (kernel, dname, bd), cands in nac_triton.CANDIDATES.items():
        for c in cands:
            if c.applies(arch):
                out.add((kernel, dname, f"{c.BLOCK_M}x{c.BLOCK_N}x{bd}", c.num_warps,
                         c.num_stages))
    return out


@pytest.mark.parametrize("arch", [80, 90])
def test_candidate_plans_cover_every_candidate(arch):
    """The check plans each candidate (forced into the forward and backward plans) on each arch
    it applies to, and no candidate on an arch it does not (no compile here: meta tensors)."""
    from nac_fast.kernels import launch as KL
    target = {t.arch: t for t in KL.CHECKED_TARGETS}[arch]
    seen = set()
    for case, L in CC._candidate_plans(target, list(CC.DTYPES)):
        assert case["source"] == "candidate"
        c = L.constexprs
        seen.add((CC.config_kernel(L.tag), _candidate_name(case["dtype"], c["PRECISION"]),
                  f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_D']}", L.num_warps, L.num_stages))
    want = _candidate_keys(arch)
    fused = {k for k in seen - want if k[0] == "bwd_keys"}  # the fused mode's own table
    assert want <= seen and seen - want == fused, (want - seen, seen - want)
    assert os.environ.get("NAC_FAST_FP32_DOT") is None


@pytest.mark.slow  # compiles every configuration (minutes): CI's make test runs it
def test_every_autotune_candidate_is_compile_checked(check_rows):
    """Each candidate's launches are rows of the check (whose problems fail the test above) on
    each arch it applies to."""
    for arch in (80, 90):
        got = {(CC.config_kernel(r["kernel"]), _candidate_name(r["dtype"], r["precision"]),
                r["blocks"], int(r["warps"]), int(r["stages"])) for r in check_rows
               if "candidate" in r["source"] and r["arch"] == str(arch)}
        missing = _candidate_keys(arch) - got
        assert not missing, (arch, missing)


_KEY_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import compile_check as CC
from nac_fast.kernels import launch as KL
target = {t.arch: t for t in KL.CHECKED_TARGETS}[90]
_, L = next(iter(CC._plans(target, ["bfloat16"], [64], ["inbatch"], ["tf32x3"])))
job = CC._job(L, 90)
key = CC.launch_key(job)
assert len(key) == 64 and key == CC.launch_key(CC._job(L, 90))
module, name, arch, sig, consts, attrs, warps, stages = job
others = [(module, name, 80, sig, consts, attrs, warps, stages),
          (module, name, arch, sig, consts, attrs, warps * 2, stages),
          (module, name, arch, sig, consts, attrs, warps, stages + 1)]
c = next(k for k, v in consts.items() if isinstance(v, int) and not isinstance(v, bool))
others.append((module, name, arch, sig, {**consts, c: consts[c] * 2}, attrs, warps, stages))
keys = {CC.launch_key(j) for j in others} | {CC.launch_key(job, triton_version="0.0")}
assert key not in keys and len(keys) == len(others) + 1, keys
CC._measuring_code_digest = lambda: "another"
assert CC.launch_key(job) != key
print("ok")
"""


@pytest.mark.slow
def test_launch_keys_follow_what_the_compiler_sees():
    """A launch's key (no compile) is the same for the same launch, and differs when the arch,
    the warps, the stages, a constexpr, the Triton version or the measuring code differ.  In
    a child process: the kernels of the compiled path, not the interpreter's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _KEY_PROBE, os.path.join(ROOT, "tools")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


# Runs the compile check's --check-keys with nac_fast.kernels loaded from a copy of kernels/
# (argv: the copy, the bench folder, then the check's arguments); prints the kernels' file and the
# forward kernel's starting line first.
_COPY_PROBE = r"""
import importlib.util, os, sys
copy = sys.argv[1]
spec = importlib.util.spec_from_file_location("nac_fast.kernels", os.path.join(copy, "__init__.py"),
                                              submodule_search_locations=[copy])
mod = importlib.util.module_from_spec(spec)
sys.modules["nac_fast.kernels"] = mod
spec.loader.exec_module(mod)
import nac_fast
from nac_fast.kernels import nac_triton
print("FROM", nac_triton.__file__, nac_triton._fwd_kernel.starting_line_number, flush=True)
sys.path.insert(0, sys.argv[2])
import compile_check as CC
sys.exit(CC.main(sys.argv[3:]))
"""
_SLICE = ["--archs", "90", "--dtypes", "bfloat16", "--D", "128", "--modes", "inbatch"]


def _check_kernel_copy(tmp_path, edit):
    """--check-keys of the committed table over a slice, with the kernels of a copy of kernels/
    that `edit(name, text)` rewrote: (exit status, output, the copy's forward kernel line)."""
    import shutil
    copy = tmp_path / "kernels"
    shutil.copytree(os.path.join(ROOT, "kernels"), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in copy.glob("*.py"):
        f.write_text(edit(f.name, f.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COPY_PROBE, str(copy), os.path.join(ROOT, "tools"),
                           "--check-keys", COMMITTED, *_SLICE], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FROM "))
    assert line.split()[1] == str(copy / "nac_triton.py"), line
    return proc.returncode, proc.stdout + proc.stderr, int(line.split()[2])


@pytest.mark.slow
def test_a_blank_line_in_a_kernel_file_leaves_the_table_current(tmp_path):
    """Issue 57: the table's keys hold no source line.  A blank line at the top of every kernel
    file (every kernel's starting line moves) keeps each launch's key in the committed table; a
    changed kernel body (the control) does not."""
    lines = open(os.path.join(ROOT, "kernels", "nac_triton.py")).read().splitlines()
    decorator = lines.index(next(x for x in lines if x.startswith("def _fwd_kernel("))) - 1
    assert lines[decorator].startswith("@triton.jit")  # (1-based: decorator + 1 here)
    rc, out, line = _check_kernel_copy(tmp_path / "blank", lambda name, text: "\n" + text)
    assert rc == 0 and "compile check: 0 launches without a row" in out, out[-4000:]
    assert line == decorator + 2  # the copy's kernel starts a line lower

    def changed(name, text):
        if name != "nac_triton.py":
            return text
        assert text.count("def _fwd_kernel(") == 1
        head, tail = text.split("def _fwd_kernel(")
        return head + "def _fwd_kernel(" + tail.replace("\n    pid", "\n    pid_unused = 0\n    pid", 1)
    rc, out, _ = _check_kernel_copy(tmp_path / "changed", changed)
    assert rc == 1 and "STALE fwd sm_90" in out, out[-4000:]
    assert "STALE prologue" not in out  # only the changed kernel's launches


def _jit_bodies(text):
    """The (start, end) line indices of every @triton.jit function's body in a module's text."""
    import ast
    tree = ast.parse(text)
    return [(f.body[0].lineno - 1, f.end_lineno) for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in f.decorator_list)]


@pytest.mark.slow
def test_a_comment_in_a_kernel_body_leaves_the_table_current(tmp_path):
    """The keys hold no comment (`code_text`): a comment added inside every @triton.jit body of
    every kernel file and every existing comment changed keeps each launch's key in the committed
    table; a changed statement (the control) does not."""
    def commented(name, text):
        lines = text.split("\n")
        for start, end in sorted(_jit_bodies(text), reverse=True):
            indent = lines[start][:len(lines[start]) - len(lines[start].lstrip())]
            lines.insert(start, f"{indent}# an added comment  ")
        lines = [x + "  # and one more" if x.lstrip().startswith("#") else x for x in lines]
        return "\n".join(lines)
    text = open(os.path.join(ROOT, "kernels", "nac_triton.py")).read()
    assert len(_jit_bodies(text)) > 10 and commented("x", text) != text
    assert CC.code_text(commented("x", "def f(x):\n    # c\n    return x  # d\n")) == \
        "def f(x):\n    return x"
    rc, out, _ = _check_kernel_copy(tmp_path / "comment", commented)
    assert rc == 0 and "compile check: 0 launches without a row" in out, out[-4000:]

    def changed(name, text):
        text = commented(name, text)
        if name != "nac_triton.py":
            return text
        head, tail = text.split("def _fwd_kernel(")
        return head + "def _fwd_kernel(" + tail.replace("\n    pid", "\n    pid_unused = 0\n    pid", 1)
    rc, out, _ = _check_kernel_copy(tmp_path / "changed", changed)
    assert rc == 1 and "STALE fwd sm_90" in out, out[-4000:]
    assert "STALE prologue" not in out  # only the changed kernel's launches


def test_code_text_cuts_comments_only():
    """Comments go by their tokenize positions, strings that hold a # stay, the lines are the
    source's own (no token re-rendered); a source that does not tokenize is refused."""
    src = ('def f(x,  # a\n      y):\n    # whole line \u2248\n\n    s = "# no"  # b\n'
           '    t = """\n# in a string\n"""\n    return s  \n')
    assert CC.code_text(src) == ('def f(x,\n      y):\n    s = "# no"\n    t = """\n'
                                 '# in a string\n"""\n    return s')
    with pytest.raises(ValueError, match="src: does not tokenize"):
        CC.code_text("def f(:\n    return (1,\n")


def test_the_committed_tables_keys_are_current():
    """Every launch of the full grid has its key in bench/results/compile_check.csv (seconds:
    nothing compiled); test_the_committed_table_is_current (slow) compiles a sample to verify."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"),
                           "--check-keys", COMMITTED], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-2000:]
                                  + f"\nregenerate it: {REGENERATE}")


def test_fail_on_fails_only_its_dtypes_and_writes_the_verdict(tmp_path):
    """--fail-on (the GPU suite's test stage: bfloat16,float16 fail, fp32's are reported): a
    problem of another dtype is counted in the verdict line, exit 0; --verdict-out holds the
    line.  A reuse run of a slice whose reused table has a spilling tf32x3 row (nothing
    compiled)."""
    args = ["--archs", "90", "--dtypes", "float64,float32", "--D", "16", "--modes", "inbatch",
            "--no-candidates", "--no-cuda", "--jobs", "2"]
    probe = _run_check(args + ["--reuse", COMMITTED, "--csv", str(tmp_path / "a.csv")], 600)
    assert probe.returncode == 0, probe.stdout[-4000:] + probe.stderr[-4000:]
    with open(tmp_path / "a.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    victim = next(r for r in rows if r["precision"] == "tf32x3" and r["folded"] == "0")
    victim["spill_store_bytes"] = "32"
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "v" / "verdict.txt"
    proc = _run_check(args + ["--reuse", str(tmp_path / "t.csv"), "--fail-on", "float64",
                              "--verdict-out", str(out)], 600)
    line = "0 problems on float64 paths, 1 on the others' (counted, not failed)"
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1].endswith(line), proc.stdout[-3000:]
    assert out.read_text() == proc.stdout.splitlines()[-1] + "\n"
    assert out.read_text().startswith("compile check sm_90 (triton ")


def test_verdict_counts_and_fails():
    rows = [dict(dtype="bfloat16", problems=""), dict(dtype="float32", problems="spills"),
            dict(dtype="", problems="no block fits")]
    line, failed = CC.verdict(rows, [90], ["bfloat16", "float16"])
    assert not failed and line.endswith("0 problems on bfloat16/float16 paths, 2 on the others' "
                                        "(counted, not failed)")
    rows[0]["problems"] = "spills"
    line, failed = CC.verdict(rows, [90], ["bfloat16", "float16"])
    assert failed and "1 problems on bfloat16/float16 paths, 2 on the others'" in line
    line, failed = CC.verdict(rows, [80, 90])
    assert failed and line.startswith("compile check sm_80/90 (") and line.endswith(": 3 problems")
    assert CC.verdict([dict(dtype="float32", problems="")], [90])[1] is False


@pytest.mark.parametrize("argv,msg", [
    (["--dtypes", "bfloat16,float32", "--fail-on", "float16"], "--fail-on: dtypes among"),
    (["--check-keys", COMMITTED, "--fail-on", "float32"], "--check-keys compiles and writes"),
    (["--verdict-out", "/proc/nac_fast_verdict.txt"], "--verdict-out"),
])
def test_fail_on_and_verdict_out_arguments_are_checked(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        CC.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_check_keys_arguments_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        CC.main(["--check-keys", COMMITTED, "--csv", str(tmp_path / "x.csv")])
    assert e.value.code == 2 and "--check-keys compiles and writes nothing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        CC.main(["--check-keys", str(tmp_path / "none.csv")])
    assert e.value.code == 2 and "--check-keys: " in capsys.readouterr().err


def test_reuse_names_a_bad_row(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(",".join(CC.FIELDS) + "\n" + ",".join(
        "abc" if f == "key" else "many" if f == "registers" else "" for f in CC.FIELDS) + "\n")
    with pytest.raises(ValueError, match=r"line 2 is not a compile check row"):
        CC.read_reusable(str(bad))


def test_plain_progress_without_tqdm(capsys):
    """The GPU machine need not have tqdm: a line with the ETA every tenth of the launches."""
    p = CC._PlainProgress(20)
    with p:
        for _ in range(20):
            p.update(1)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("compile check:")]
    assert len(lines) == 10 and lines[-1].startswith("compile check: 20/20 launches")
    assert all("ETA" in x for x in lines)
