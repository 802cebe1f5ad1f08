"""The autotune stage (issue 38) on the CPU: tuned tables (format, validation, lookup by size
class and kind, nearest arch, NAC_FAST_TUNED), the first-use autotune and its disk cache, the
split's waves, every candidate configuration's kernels under the interpreter against float64,
and tools/autotune.py's CPU mode end to end.  GPU timings come from the GPU suite's autotune
stage (tools/autotune.py on a GPU), never from here."""
import copy
import csv
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import nac_fast
from nac_fast.kernels import launch as KL
from nac_fast.kernels import nac_triton as NT
from nac_fast.kernels import autotuner as AT
from nac_fast.kernels import tuning as TU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = torch.bfloat16
FWD16 = NT.CANDIDATES[("fwd", "bfloat16", 128)]
BWD16 = NT.CANDIDATES[("bwd_keys", "bfloat16", 128)]


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    """Each test: an empty shipped-table folder, its own cache folder, no table settings."""
    monkeypatch.setattr(TU, "TABLE_DIR", str(tmp_path / "tuned"))
    monkeypatch.setenv(TU.ENV_CACHE, str(tmp_path / "cache"))
    for v in (TU.ENV_TUNED, TU.ENV_AUTOTUNE, "NAC_FAST_FP32_DOT"):
        monkeypatch.delenv(v, raising=False)
    TU.reset()
    yield
    TU.reset()


def entry(kernel="fwd", kind="inbatch", n=8192, N=8192, cfg=FWD16[0], dtype="bfloat16",
          precision="ieee"):
    return dict(kernel=kernel, dtype=dtype, D=128, block_d=128, precision=precision, kind=kind,
                size_class=list(TU.size_class(n, N)), n=n, N=N, config=TU.config_dict(cfg),
                median_ms=0.1, builtin_ms=0.12, speedup=1.2)


def table(entries, arch=90):
    t = TU.table_header(arch, "NVIDIA H100 80GB HBM3", 132, "abc1234")
    t["entries"] = entries
    return t


def ship(data, arch=90):
    TU.write_table(os.path.join(TU.TABLE_DIR, f"sm{arch}.json"), data)
    TU.reset()


def cfg(kernel="fwd", dtype=BF16, target=KL.SM90, **kw):
    return NT.config(kernel, dtype, 128, target, **kw)


# ---- the candidate lists -----------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(NT.CANDIDATES))
def test_candidates_hold_the_builtin_configuration_and_no_duplicates(key, monkeypatch):
    kernel, name, bd = key
    dname, mode = TU.split_candidate_dtype(name)  # "float32:bf16x6": fp32 in that product mode
    if mode:
        monkeypatch.setenv("NAC_FAST_FP32_DOT", mode)
    assert TU.candidate_dtype(getattr(torch, dname), bd) == name
    assert TU.candidates(kernel, getattr(torch, dname), bd) == list(NT.CANDIDATES[key])
    cands = NT.CANDIDATES[key]
    labels = [TU.config_label(c) + str(c.archs) for c in cands]
    assert len(set(labels)) == len(labels)
    for target in KL.CHECKED_TARGETS:
        builtin = NT.builtin_config(kernel, getattr(torch, dname), bd, target)
        assert any(TU._same(c, builtin) for c in cands), (key, target.arch)
        for c in cands:  # the estimate prunes what cannot fit an arch it may run on
            if c.applies(target.arch):
                assert NT.smem_estimate(kernel, c, getattr(torch, dname), bd) <= target.smem


def test_split_count_waves():
    assert KL.split_count(64, 1000, 132) == 2               # one wave: 128 programs
    assert KL.split_count(64, 1000, 132, waves=2) == 4      # two: 256
    assert KL.split_count(64, 3, 132, waves=2) == 2         # never more than the inner tiles
    assert KL.split_count(1, 1000, 132, waves=2) == 64      # the cap
    with pytest.raises(ValueError, match="waves"):
        KL.split_count(64, 1000, 132, waves=0)


def test_split_follows_the_configuration_waves():
    """_split aims at cfg.waves waves of the target's programs."""
    a = torch.empty((8192, 128), dtype=BF16, device="meta")

    def make(split, probe=False):
        return KL.Launch(NT._fwd_kernel, (64, split), (a,), {}, 8, 2, "fwd")
    assert NT._split(make, 64, 128, KL.SM90) == 2
    assert NT._split(make, 64, 128, KL.SM90, waves=2) == 4


# ---- tables: format and validation -------------------------------------------------------

def test_size_class():
    assert TU.size_class(8192, 65536) == (13, 16)
    assert TU.size_class(12000, 12000) == (14, 14)   # log2 = 13.55
    assert TU.size_class(1, 1) == (0, 0)
    with pytest.raises(ValueError, match="n and N"):
        TU.size_class(0, 5)


def test_table_round_trip(tmp_path):
    data = table([entry(), entry(kind="queue", n=8192, N=65536, cfg=FWD16[3])])
    path = str(tmp_path / "t.json")
    TU.write_table(path, data)
    t = TU.load_table(path)
    assert t.arch == 90 and t.device == "NVIDIA H100 80GB HBM3" and len(t.entries) == 2
    assert t.data["versions"]["torch"] == torch.__version__
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # written by a rename


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format=2), "format must be 1"),
    (lambda d: d.update(arch="90"), "arch must be"),
    (lambda d: d.update(entries={}), "entries must be a list"),
    (lambda d: d["entries"][0].update(kernel="prologue"), "'kernel'"),
    (lambda d: d["entries"][0].update(kind="keys"), "'kind'"),
    (lambda d: d["entries"][0].pop("median_ms"), "'median_ms'"),
    (lambda d: d["entries"][0].update(size_class=[13]), "'size_class'"),
    (lambda d: d["entries"][0]["config"].update(BLOCK_M=96), "not one of nac_triton.CANDIDATES"),
    (lambda d: d["entries"][0]["config"].pop("waves"), "config must give"),
    (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "two entries"),
])
def test_bad_tables_are_refused_naming_the_file(tmp_path, mutate, match):
    data = table([entry()])
    mutate(data)
    path = str(tmp_path / "bad.json")
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match=match) as exc:
        TU.load_table(path)
    assert path in str(exc.value)
    with pytest.raises(ValueError, match=match):
        TU.write_table(str(tmp_path / "bad2.json"), data)
    assert not os.path.exists(tmp_path / "bad2.json")


def test_shipped_tables_are_valid():
    """kernels/tuned/sm<arch>.json (written by the GPU suite's autotune stage): each validates
    and its arch is its name's."""
    real = os.path.join(ROOT, "kernels", "tuned")
    tables = TU.repo_tables(real)
    for arch, path in tables.items():
        assert TU.load_table(path).arch == arch, path


def test_the_shipped_sm90_table_reaches_an_sm90_plan(monkeypatch):
    """The H100 table (the autotune stage of 2026-11-27) is what an sm_90 plan takes, and
    NAC_FAST_TUNED=0 gives the built-in configuration back."""
    path = os.path.join(ROOT, "kernels", "tuned", "sm90.json")
    if not os.path.exists(path):
        pytest.skip("no shipped sm90 table")
    with open(path) as f:
        data = json.load(f)
    want = [e for e in data["entries"] if e["kernel"] == "fwd" and e["dtype"] == "bfloat16"
            and e["kind"] == "inbatch" and e["n"] == 8192]
    assert want, "the table has a bf16 in-batch 8192 forward entry"
    monkeypatch.setattr(TU, "TABLE_DIR", os.path.dirname(path))  # the real folder, not _fresh's
    TU.reset()
    got = NT.config("fwd", torch.bfloat16, 128, KL.SM90, kind="inbatch", n=8192, N=8192)
    assert TU.config_dict(got) == TU.config_dict(TU.entry_config(want[0], path))
    monkeypatch.setenv("NAC_FAST_TUNED", "0")
    TU.reset()
    assert NT.config("fwd", torch.bfloat16, 128, KL.SM90, kind="inbatch", n=8192,
                     N=8192) == NT.builtin_config("fwd", torch.bfloat16, 128, KL.SM90)


# ---- lookup --------------------------------------------------------------------------------

def test_config_reads_the_table_by_kind_and_nearest_size_class():
    a8, a16, q = FWD16[4], FWD16[6], FWD16[10]
    ship(table([entry(cfg=a8), entry(n=16384, N=16384, cfg=a16),
                entry(kind="queue", n=8192, N=65536, cfg=q),
                entry(kernel="bwd_keys", cfg=BWD16[2])]))
    assert cfg(kind="inbatch", n=8192, N=8192) == a8
    assert cfg(kind="inbatch", n=12000, N=12000) == a16      # class (14, 14)
    assert cfg(kind="inbatch", n=256, N=256) == a8           # nearest: (13, 13)
    assert cfg(kind="queue", n=8192, N=65536) == q
    assert cfg(kind="queue", n=256, N=65536) == q
    assert cfg("bwd_keys", kind="inbatch", n=8192, N=8192) == BWD16[2]
    builtin = NT.builtin_config("fwd", BF16, 128, KL.SM90)
    assert cfg() == builtin                                  # no kind/n/N: built-in
    assert cfg("bwd_keys", kind="queue", n=8192, N=65536) == NT.builtin_config(
        "bwd_keys", BF16, 128, KL.SM90)                      # no entry of that key
    assert cfg(dtype=torch.float16, kind="inbatch", n=8192, N=8192) == NT.builtin_config(
        "fwd", torch.float16, 128, KL.SM90)                  # fp16 is not tuned
    interp = KL.Target(0, 1 << 30, 4)
    assert cfg(target=interp, kind="inbatch", n=8192, N=8192) == NT._INTERP["fwd"]
    with pytest.raises(ValueError, match="kind"):
        cfg(kind="keys", n=8, N=8)


def test_the_own_key_left_out_reads_no_table_and_takes_its_own_configurations():
    """SELF launches (self_offset >= 0, docs/math.md [M:self-key]) skip the tuned table (the
    autotune stage times the paper's kernels) and take SELF_CONFIGS where the paper's built-in
    configuration spilled with SELF's mask; the plans pick them for SELF only."""
    a8 = FWD16[4]
    ship(table([entry(cfg=a8)]))
    assert cfg(kind="inbatch", n=8192, N=8192) == a8
    assert cfg(kind="inbatch", n=8192, N=8192, own=True) == NT.builtin_config(
        "fwd", BF16, 128, KL.SM90, own=True) == NT.builtin_config("fwd", BF16, 128, KL.SM90)
    with TU.forced(fwd=FWD16[2]):  # a forced configuration still wins (the autotune stage's)
        assert cfg(own=True) == FWD16[2]
    for (kernel, fam, bd), cands in NT.SELF_CONFIGS.items():
        dtype = {"16": BF16, "32p": torch.float32}[fam]
        for t in (KL.SM80, KL.SM90):
            with NT.fp32_dot("bf16x6" if fam == "32p" else None):
                own = NT.builtin_config(kernel, dtype, bd, t, own=True)
                assert own in cands and own == NT.pick(
                    cands, t, lambda c: NT.smem_estimate(kernel, c, dtype, bd), NT._INTERP[kernel])
    # the plans: bf16 D = 64's forward is 128 x 64 with 4 warps, with SELF 8 warps (sm_80)
    meta = dict(device="meta")
    a = torch.empty((4096, 64), dtype=BF16, **meta)
    paper = NT.fwd_plan(a, a, a, None, 1.1, 0.0, True, KL.SM80)[0]
    own = NT.fwd_plan(a, a, a, None, 1.1, 0.0, True, KL.SM80, self_offset=0)[0]
    fwd = [L for L in paper if L.tag == "fwd"][0]
    fwd_own = [L for L in own if L.tag == "fwd"][0]
    assert (fwd.num_warps, fwd_own.num_warps) == (4, 8)
    assert fwd_own.constexprs["SELF"] and not fwd.constexprs["SELF"]


def test_forced_configurations_win_and_nest():
    c1, c2 = FWD16[2], FWD16[5]
    with TU.forced(fwd=c1):
        assert cfg() == c1
        with TU.forced(fwd=c2, bwd_keys=BWD16[1]):
            assert cfg() == c2 and cfg("bwd_keys") == BWD16[1]
        assert cfg() == c1 and cfg("bwd_keys") == NT.builtin_config("bwd_keys", BF16, 128,
                                                                     KL.SM90)
    assert cfg() == NT.builtin_config("fwd", BF16, 128, KL.SM90)
    with pytest.raises(ValueError, match="kernel"):
        with TU.forced(finish=c1):
            pass
    with pytest.raises(TypeError):
        with TU.forced(fwd=(128, 64)):
            pass


def test_fp32_entries_apply_to_their_own_precision_only(monkeypatch):
    """A table's fp32 entries are per product mode: tf32x3's apply under tf32x3, bf16x6's (their
    own candidates) under bf16x6, and none under ieee (no candidates: the built-in table)."""
    c = NT.CANDIDATES[("fwd", "float32", 128)][2]
    c6 = NT.CANDIDATES[("fwd", "float32:bf16x6", 128)][4]
    ship(table([entry(cfg=c, dtype="float32", precision="tf32x3"),
                entry(cfg=c6, dtype="float32", precision="bf16x6")]))
    assert cfg(dtype=torch.float32, kind="inbatch", n=8192, N=8192) == c
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "bf16x6")
    assert cfg(dtype=torch.float32, kind="inbatch", n=8192, N=8192) == c6
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "ieee")
    assert cfg(dtype=torch.float32, kind="inbatch", n=8192, N=8192) == NT.builtin_config(
        "fwd", torch.float32, 128, KL.SM90)
    # a bf16x6 entry naming a tf32x3 candidate is refused: only its own candidates
    bad = [x for x in NT.CANDIDATES[("fwd", "float32", 128)]
           if not any(TU._same(x, y) for y in NT.CANDIDATES[("fwd", "float32:bf16x6", 128)])][0]
    with pytest.raises(ValueError, match="not one of nac_triton.CANDIDATES"):
        TU.entry_config(entry(cfg=bad, dtype="float32", precision="bf16x6"))


def test_tuned_env_off_and_file(tmp_path, monkeypatch):
    ship(table([entry(cfg=FWD16[4])]))
    monkeypatch.setenv(TU.ENV_TUNED, "0")
    assert cfg(kind="inbatch", n=8192, N=8192) == NT.builtin_config("fwd", BF16, 128, KL.SM90)
    other = str(tmp_path / "mine.json")
    TU.write_table(other, table([entry(cfg=FWD16[8])], arch=86))
    monkeypatch.setenv(TU.ENV_TUNED, other)
    assert cfg(kind="inbatch", n=8192, N=8192) == FWD16[8]


def test_nearest_arch_announced_once_and_unfit_configurations_skipped(caplog):
    ok, hopper_only = FWD16[0], FWD16[10]  # 128x64 w8 s2 (any arch), 64x128 w4 s2 (sm_90)
    assert not ok.archs and hopper_only.archs == (90,)
    ship(table([entry(cfg=ok), entry(kind="queue", n=8192, N=65536, cfg=hopper_only)]))
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        assert cfg(target=KL.SM80, kind="inbatch", n=8192, N=8192) == ok
        assert cfg(target=KL.SM80, kind="inbatch", n=4096, N=4096) == ok
        assert cfg(target=KL.SM80, kind="queue", n=8192, N=65536) == NT.builtin_config(
            "fwd", BF16, 128, KL.SM80)
        assert cfg(target=KL.SM80, kind="queue", n=8192, N=65536) == NT.builtin_config(
            "fwd", BF16, 128, KL.SM80)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("using sm_90's" in m for m in msgs) == 1, msgs
    assert sum("does not fit sm_80" in m for m in msgs) == 1, msgs


def test_no_table_is_announced_once(caplog):
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        for _ in range(3):
            assert cfg(kind="inbatch", n=8192, N=8192) == NT.builtin_config("fwd", BF16, 128,
                                                                             KL.SM90)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "built-in kernel configurations are used" in msgs[0], msgs


# ---- the first-use autotune ----------------------------------------------------------------

def test_first_use_autotune_times_once_per_class_and_caches(monkeypatch, caplog, tmp_path):
    """NAC_FAST_AUTOTUNE=1 on an arch with no table: each (kernel, kind, size class) is timed on
    its first call (here: the interpreter, two candidates), the winner cached on disk and used;
    a later process reads the cache without timing."""
    two = [FWD16[0], FWD16[10]]
    monkeypatch.setattr(TU, "candidates", lambda kernel, dtype, D: two)
    monkeypatch.setattr(TU, "_device_name", lambda device: "Fake GPU 7")
    calls = []
    real = AT.tune_key

    def counted(kernel, case, *a, **k):
        calls.append((kernel, case.n, case.N))
        return real(kernel, case, *a, **k, cpu_reps=1)
    monkeypatch.setattr(AT, "tune_key", counted)
    monkeypatch.setenv(TU.ENV_AUTOTUNE, "1")
    target = KL.Target(100, 227 * 1024, 4)  # an arch with no table (the interpreter runs it)
    cpu = torch.device("cpu")
    recording = []  # as if the op were recording its plan (kernels/launch.py Plan)
    monkeypatch.setattr(KL, "_RECORDING", recording)
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        got = NT.config("fwd", BF16, 128, target, kind="inbatch", n=40, N=40, device=cpu)
        assert got in two
    assert KL._RECORDING is recording and recording == []  # the autotune's buffers stay out
    monkeypatch.setattr(KL, "_RECORDING", None)
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        assert NT.config("fwd", BF16, 128, target, kind="inbatch", n=36, N=36,
                         device=cpu) == got                    # the same class, (5, 5)
    assert calls[0] == ("fwd", 40, 40)
    path = TU.cache_path("Fake GPU 7", 100)
    assert os.path.exists(path) and "Fake-GPU-7-sm100" in path
    t = TU.load_table(path)
    assert t.arch == 100 and {tuple(e["size_class"]) for e in t.entries} == {
        TU.size_class(c[1], c[2]) for c in calls}
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("first call" in m for m in msgs) == 1 and any("first-use autotune of fwd" in m
                                                             for m in msgs), msgs
    # another class: timed and added
    n_before = len(calls)
    NT.config("fwd", BF16, 128, target, kind="inbatch", n=200, N=200, device=cpu)
    assert len(calls) == n_before + 1 and len(TU.load_table(path).entries) == len(
        {TU.size_class(c[1], c[2]) for c in calls})
    # a new process without the variable: the cache is read, nothing timed
    TU.reset()
    monkeypatch.delenv(TU.ENV_AUTOTUNE)
    n_before = len(calls)
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        assert NT.config("fwd", BF16, 128, target, kind="inbatch", n=40, N=40,
                         device=cpu) == got
    assert len(calls) == n_before
    assert any("cached in" in r.getMessage() and path in r.getMessage()
               for r in caplog.records)


def test_a_candidate_that_spills_is_refused_untimed(monkeypatch):
    """Resources are part of correctness: a candidate whose compiled kernel uses local memory on
    the running Triton (the driver's figures: kernels/launch.py compiled_figures on a GPU; faked
    here for the interpreter) is refused before it is timed, however fast it would be, and the
    winner comes from the others.  The built-in configuration is the baseline and is not asked."""
    cands = [c for c in BWD16 if c.waves == 1][:2]
    bad = (cands[1].BLOCK_M, cands[1].BLOCK_N, cands[1].num_warps, cands[1].num_stages)
    asked = []

    def figures(L):
        asked.append(L.tag)
        c = L.constexprs
        key = (c["BLOCK_M"], c["BLOCK_N"], L.num_warps, L.num_stages)
        return KL.CompiledFigures(255, 32 if key == bad else 0, 1024, L.num_warps)
    monkeypatch.setattr(AT, "_time_cpu", lambda fn, reps: (fn(), (1.0, 0.9, 1.1))[1])
    case = AT.Case("inbatch", 40, 40, 128, BF16)
    res = AT.tune_key("bwd_keys", case, "cpu", KL.Target(0, 1 << 30, 4), cands, cpu_reps=1,
                      figures=figures)
    by = {r["label"]: r for r in res["rows"]}
    refused = by[TU.config_label(cands[1])]
    assert refused["status"].startswith("spills (bwd_keys") and " 32 B" in refused["status"]
    assert refused["median_ms"] != refused["median_ms"]  # NaN: never timed
    assert by[TU.config_label(cands[0])]["status"] == "ok"
    assert res["winner"] is by[TU.config_label(cands[0])]
    assert asked and all(t.startswith("bwd_keys") for t in asked)  # only the tuned kernel's
    # with no figures (the interpreter by default) nothing is refused
    res = AT.tune_key("bwd_keys", case, "cpu", KL.Target(0, 1 << 30, 4), cands, cpu_reps=1)
    assert all(r["status"] == "ok" for r in res["rows"])


def test_spilling_lists_the_kernels_launches_that_use_local_memory():
    x = torch.empty(4)
    mk = lambda tag, grid=(1,): KL.Launch(None, grid, (x,), dict(BLOCK_M=64, BLOCK_N=64), 4, 2,  # noqa: E731
                                          tag)
    figs = {"bwd_keys": 0, "bwd_keys_out2": 8, "bwd_rows": 64, "fwd": 16}
    f = lambda L: KL.CompiledFigures(200, figs[L.tag], 0, 4)  # noqa: E731
    launches = [mk("bwd_keys"), mk("bwd_keys_out2"), mk("bwd_rows"), mk("fwd")]
    assert AT.spilling(launches, "bwd_keys", f) == ["bwd_keys_out2: 8 B"]
    assert AT.spilling(launches, "fwd", f) == ["fwd: 16 B"]
    assert AT.spilling([mk("fwd", (0, 2))], "fwd", f) == []  # an empty grid launches nothing


def test_autotune_env_must_be_0_or_1(monkeypatch):
    monkeypatch.setenv(TU.ENV_AUTOTUNE, "yes")
    with pytest.raises(ValueError, match=TU.ENV_AUTOTUNE):
        cfg(target=KL.Target(75, 64 * 1024, 4), kind="inbatch", n=40, N=40)


# ---- every candidate under the interpreter, against float64 --------------------------------

def _distinct_blocks(cands):
    """One candidate per (BLOCK_M, BLOCK_N): the interpreter ignores warps and stages."""
    seen, out = set(), []
    for c in cands:
        if (c.BLOCK_M, c.BLOCK_N) not in seen:
            seen.add((c.BLOCK_M, c.BLOCK_N))
            out.append(c)
    return out


def _f64_reference(a, r, noise, keys, p, g, keys_grad):
    leaves = dict(a=a.double().requires_grad_(), r=r.double().requires_grad_())
    kk = None
    if keys is not None:
        kk = keys.double().requires_grad_(keys_grad)
    rows = nac_fast.nac_loss(leaves["a"], leaves["r"], p, keys=kk, noise=noise.double(),
                             reduction="none", backend="reference")
    (rows * g.double()).sum().backward()
    grads = dict(a=leaves["a"].grad, r=leaves["r"].grad)
    if keys_grad:
        grads["keys"] = kk.grad
    return rows.detach(), grads


@pytest.mark.parametrize("kind,n,N,D", [("inbatch", 97, 97, 100), ("queue", 97, 131, 128),
                                        ("keys", 3, 131, 100)])
@pytest.mark.parametrize("name", ["bfloat16", "float32", "float32:bf16x6", "float32:fp16x3"])
def test_every_candidate_against_float64(kind, n, N, D, name, monkeypatch):
    """Each candidate block shape of the forward and the keys' backward (the interpreter ignores
    warps and stages), forced into the op's plans at awkward sizes (partial tiles, D < BLOCK_D,
    several splits: 4 interpreter programs), within the tests' budgets against float64: fp32
    1e-5 (loss) / 1e-4 (gradients) in each fp32 mode with candidates of its own, bf16 2.5e-2
    (tests/_loss_helpers.py ABS_16)."""
    dname, mode = TU.split_candidate_dtype(name)
    if mode == "fp16x3" and kind != "inbatch":
        pytest.skip("fp16x3 is in-batch only: given keys run bf16x6")
    monkeypatch.setenv("NAC_FAST_TRITON_CPU_PROGRAMS", "4")
    monkeypatch.setenv("NAC_FAST_FP32_DOT", mode or "tf32x3")
    dtype = getattr(torch, dname)
    tol_v, tol_g = (1e-5, 1e-4) if dtype == torch.float32 else (2.5e-2, 2.5e-2)
    gen = torch.Generator().manual_seed(n + N + D)
    p = 0.1
    a = (torch.randn(n, D, generator=gen) * 1.5).to(dtype)
    r = (torch.randn(n, D, generator=gen) * 2).to(dtype)
    noise = nac_fast.draw_noise((n, D), p, generator=gen).to(dtype)
    keys = None if kind == "inbatch" else torch.tanh(torch.randn(N, D, generator=gen)).to(dtype)
    g = torch.rand(n, generator=gen) + 0.5
    keys_grad = kind == "keys"
    v64, g64 = _f64_reference(a, r, noise, keys, p, g, keys_grad)
    s = nac_fast.channel_scale(p)
    target = KL.target_of(a.device)
    acc = torch.float32
    fwd_c = _distinct_blocks(NT.CANDIDATES[("fwd", name, 128)])
    bwd_c = _distinct_blocks(NT.CANDIDATES[("bwd_keys", name, 128)])
    for i in range(max(len(fwd_c), len(bwd_c))):
        fc, bc = fwd_c[i % len(fwd_c)], bwd_c[i % len(bwd_c)]
        with TU.forced(fwd=fc, bwd_keys=bc):
            launches, (loss, lse, ga, q, k, _) = NT.fwd_plan(a, r, noise, keys, s, 0.0, True,
                                                             target)
            KL.run(launches)
            assert rel(loss, v64) <= tol_v, (fc, rel(loss, v64))
            launches, (da, dr, dk) = NT.bwd_plan(a, r, noise, keys, lse, ga, g.to(acc), q, k, s,
                                                 True, True, keys_grad, target)
            KL.run(launches)
        got = dict(a=da, r=dr, keys=dk)
        for name, ref in g64.items():
            assert rel(got[name], ref) <= tol_g, (fc, bc, name, rel(got[name], ref))


def rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


# ---- tools/autotune.py's CPU mode ----------------------------------------------------------

@pytest.mark.slow
def test_autotune_stage_cpu_mode(tmp_path):
    out = tmp_path / "tune"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "autotune.py"), "--cpu", "--out-dir",
           str(out), "--max-candidates", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    head = [i for i, x in enumerate(lines) if x.startswith("kernel ")]
    assert head and len(lines) - head[-1] - 1 == 3, lines[-6:]  # the table is printed last
    with open(out / "autotune.csv") as f:
        rows = list(csv.DictReader(f))
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import autotune
    assert set(rows[0]) == set(autotune.FIELDS)
    assert {(r["kernel"], r["kind"]) for r in rows} == {("fwd", "inbatch"),
                                                        ("bwd_keys", "inbatch"),
                                                        ("fwd", "queue")}
    assert all(r["mode"] == "cpu-interpreter" for r in rows)
    built = [r for r in rows if r["config"] == "built-in"]
    assert len(built) == 3 and all(float(r["median_ms"]) > 0 for r in built)
    assert sum(int(r["winner"]) for r in rows) == 3
    t = TU.load_table(str(out / "cpu_interpreter.json"))
    assert t.arch == 0 and len(t.entries) == 3
    assert "interpreter" in t.data["timing"]
    for e in t.entries:
        assert e["speedup"] > 0 and e["candidates"] and e["builtin_ms"] > 0
    # nothing is replaced without being asked
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env=dict(os.environ, TRITON_INTERPRET="1"))
    assert again.returncode == 2 and "--overwrite" in again.stderr


@pytest.mark.slow
def test_autotune_tunes_fp32_in_each_product_mode_with_candidates(tmp_path):
    """An fp32 case is tuned once per product mode with candidates of its own (tf32x3, bf16x6,
    in-batch fp16x3): the table holds an entry of each precision, each naming its own mode's
    candidate, and the caller's NAC_FAST_FP32_DOT is left as it was."""
    out = tmp_path / "tune"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "autotune.py"), "--cpu", "--out-dir",
           str(out), "--max-candidates", "2", "--cases", "float32:inbatch:40"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1", NAC_FAST_FP32_DOT="ieee"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "autotune.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["kernel"], r["precision"]) for r in rows} == {
        (k, p) for k in ("fwd", "bwd_keys") for p in ("tf32x3", "bf16x6", "fp16x3")}
    # (on the interpreter a candidate's waves change nothing: "no-effect" rows)
    assert all(r["status"] == "ok" or r["status"].startswith(("no-effect", "same plan"))
               for r in rows), [r["status"] for r in rows]
    t = TU.load_table(str(out / "cpu_interpreter.json"))
    assert sorted((e["kernel"], e["precision"]) for e in t.entries) == sorted(
        (k, p) for k in ("fwd", "bwd_keys") for p in ("tf32x3", "bf16x6", "fp16x3"))
    # the mode the table makes such calls run in, said last with the two steps' figures
    mode = t.fp32_mode(128, "inbatch", 40, 40)
    line = [x for x in proc.stdout.splitlines() if x.startswith("autotune: fp32 inbatch 40:")]
    assert len(line) == 1 and mode in TU.TUNED_FP32_MODES, proc.stdout[-2000:]
    assert all(f"{m} " in line[0] for m in TU.TUNED_FP32_MODES)
    assert line[0].split("-> ")[1].startswith(mode)
    for e in t.entries:
        name = "float32" if e["precision"] == "tf32x3" else f"float32:{e['precision']}"
        assert TU.entry_config(e) in NT.CANDIDATES[(e["kernel"], name, 128)]
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import autotune
    os.environ["NAC_FAST_FP32_DOT"] = "ieee"
    try:
        work = autotune.work_list([("float32", "queue", 24, 72)], 128, KL.Target(0, 1 << 30, 4),
                                  0, False)
        # (fp16x3 is in-batch only: given keys run bf16x6)
        assert [(k, m) for _, k, _, m in work] == [("fwd", "tf32x3"), ("fwd", "bf16x6")]
        assert work[1][2] == NT.CANDIDATES[("fwd", "float32:bf16x6", 128)]
        assert os.environ["NAC_FAST_FP32_DOT"] == "ieee"
    finally:
        del os.environ["NAC_FAST_FP32_DOT"]


def test_rows_sweep_times_each_row_tile_with_the_same_bits(tmp_path):
    """--rows-sweep (interpreter, tiny cases): a row per (case, row tile), each tile's step
    giving the default tile's bits, the tiles' programs in the row; ROW_TILE restored after."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import time

    import autotune
    cases = autotune.parse_cases(autotune.ROWS_CASES_CPU, 128)
    rows = autotune.rows_sweep(cases, "cpu", KL.Target(0, 1 << 30, 4), dict(mode="cpu"), 1.0,
                               time.monotonic() + 600)
    assert len(rows) == len(cases) * len(autotune.ROW_TILES)
    assert all(r["status"] == "ok" and r["same_bits"] == 1 for r in rows), rows
    # 128 code bits: 32, 16 and 8 rows per program; in-batch 40 rows: 2, 3 and 5 programs each
    inb = [r for r in rows if r["kind"] == "inbatch"]
    assert [r["rows_per_program"] for r in inb] == [32, 16, 8]
    # (the finish folded into the forward: FIN_M = 8 rows a chunk there; NAC_FAST_FOLD=0: its
    # own launch of 5 programs)
    assert [r["programs"] for r in inb][-1].split()[0] == "prologue:5"
    assert NT.ROW_TILE == 4096 and NT._rows_block(128, BF16) == 32
    with pytest.raises(ValueError, match="power of two"):
        with NT.row_tile(1000):
            pass
    assert NT.ROW_TILE == 4096


@pytest.mark.parametrize("bad,match", [("bfloat16:inbatch:8x16", "in-batch takes one size"),
                                       ("float16:inbatch:8", "dtype"),
                                       ("bfloat16:keys:8", "kind"),
                                       ("bfloat16:inbatch", "dtype:kind")])
def test_autotune_cases_are_checked(bad, match):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import autotune
    with pytest.raises(ValueError, match=match):
        autotune.parse_cases(bad, 128)


# ---- the fp32 product mode a table chooses ------------------------------------------------

F32, F6 = (NT.CANDIDATES[("fwd", "float32", 128)][0],
           NT.CANDIDATES[("fwd", "float32:bf16x6", 128)][0])
B32, B6 = (NT.CANDIDATES[("bwd_keys", "float32", 128)][0],
           NT.CANDIDATES[("bwd_keys", "float32:bf16x6", 128)][0])


def fp32_entries(ms32, ms6, kind="inbatch", n=8192, N=8192, n6=None):
    """fwd (+ bwd_keys in-batch) entries of tf32x3 and bf16x6 with the given medians (fwd, bwd);
    n6: bf16x6's at another size."""
    out = []
    for prec, (f, b), ms, size in (("tf32x3", (F32, B32), ms32, n), ("bf16x6", (F6, B6), ms6,
                                                                     n6 or n)):
        if ms is None:
            continue
        NN = size if kind == "inbatch" else N
        for kernel, c, m in (("fwd", f, ms[0]), ("bwd_keys", b, ms[1])):
            if m is None or (kernel == "bwd_keys" and kind == "queue"):
                continue
            e = entry(kernel, kind, size, NN, c, "float32", prec)
            e["median_ms"] = m
            out.append(e)
    return out


@pytest.mark.parametrize("ms32,ms6,kind,want", [
    ((1.0, 0.9), (0.5, 0.4), "inbatch", "bf16x6"),
    ((0.5, 0.4), (1.0, 0.9), "inbatch", "tf32x3"),
    ((0.5, 0.5), (0.6, 0.4), "inbatch", "tf32x3"),     # a tie keeps the default
    ((0.5, 2.0), (1.0, 0.9), "inbatch", "bf16x6"),     # the step, not one kernel
    ((8.7, None), (4.0, None), "queue", "bf16x6"),     # a queue's step: its forward
    ((1.0, 0.9), None, "inbatch", None),               # bf16x6 not tuned
    ((1.0, 0.9), (0.5, None), "inbatch", None),        # its step not whole
])
def test_the_table_chooses_the_faster_fp32_step(ms32, ms6, kind, want, caplog):
    N = 65536 if kind == "queue" else 8192
    ship(table(fp32_entries(ms32, ms6, kind, 8192, N)))
    with caplog.at_level(logging.WARNING, logger="nac_fast"):
        for n_call in (8192, 256):                     # the nearest class serves n = 256 too
            got = TU.fp32_choice(128, kind, n_call, N if kind == "queue" else n_call, KL.SM90,
                                 None)
            assert got == want
    said = [r.getMessage() for r in caplog.records if "run in bf16x6" in r.getMessage()]
    assert len(said) == (1 if want == "bf16x6" else 0), said   # once per size class
    if said:
        assert "NAC_FAST_FP32_DOT=tf32x3 keeps tf32x3" in said[0] and "tf32x3 " in said[0]


def test_no_fp32_choice_across_size_classes_or_without_a_table(monkeypatch):
    """Modes tuned at different size classes are not compared; no table (NAC_FAST_TUNED=0, the
    interpreter's arch 0) chooses nothing, and a 16-bit call never asks."""
    ship(table(fp32_entries((1.0, 0.9), (0.5, 0.4), n6=16384)))
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.SM90, None) is None
    ship(table(fp32_entries((1.0, 0.9), (0.5, 0.4))))
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.Target(0, 1 << 30, 4), None) is None
    assert TU.fp32_choice(64, "inbatch", 8192, 8192, KL.SM90, None) is None  # other BLOCK_D
    monkeypatch.setenv(TU.ENV_TUNED, "0")
    TU.reset()
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.SM90, None) is None
    assert NT.call_fp32_mode(torch.bfloat16, 128, "inbatch", 8192, 8192,
                             torch.device("cpu")) is None
    assert NT.call_fp32_mode(torch.float32, 128, "inbatch", 8192, 8192,
                             torch.device("cpu")) is None   # not a GPU


def test_the_table_chooses_among_three_fp32_modes_in_batch():
    """In-batch, fp16x3 (in-batch only) competes too: the fastest of the modes tuned at the
    class where tf32x3 was; without tf32x3 there, no choice."""
    F16, B16 = (NT.CANDIDATES[("fwd", "float32:fp16x3", 128)][0],
                NT.CANDIDATES[("bwd_keys", "float32:fp16x3", 128)][0])

    def h(ms):
        out = []
        for kernel, c, m in (("fwd", F16, ms[0]), ("bwd_keys", B16, ms[1])):
            e = entry(kernel, "inbatch", 8192, 8192, c, "float32", "fp16x3")
            e["median_ms"] = m
            out.append(e)
        return out
    ship(table(fp32_entries((1.0, 0.9), (0.5, 0.4)) + h((0.3, 0.2))))
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.SM90, None) == "fp16x3"
    ship(table(fp32_entries((1.0, 0.9), (0.5, 0.4)) + h((0.6, 0.5))))
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.SM90, None) == "bf16x6"
    ship(table(fp32_entries(None, (0.5, 0.4)) + h((0.3, 0.2))))
    assert TU.fp32_choice(128, "inbatch", 8192, 8192, KL.SM90, None) is None
