"""No host sync in a training step, proven on the CPU.

A GPU runs ahead of the host only while the host never reads device data.  This suite runs
train.py's step (train.train_step: the method's loss forward and backward, LARS, lr schedule,
EMA and queue), eager and torch.compile'd, under `NoHostReads` (nac_fast/train/sync_check.py,
also the CPU detector of bench/train_throughput.py --sync-check), a TorchDispatchMode that fails
on every op that makes the host read tensor data: item/bool/float of a tensor (aten._local_scalar_dense, aten.is_nonzero),
nonzero, masked_select, unique, equal, allclose, boolean-mask indexing, repeat_interleave without
output_size, and any copy of a non-CPU tensor to the CPU.  The CPU step runs the same Python as
the GPU step (the loss-input value checks are off in both: nac_fast.train.methods.step_value_checks),
so what passes here has no sync from Python code on a GPU either; the GPU suite repeats it there
with torch.cuda.set_sync_debug_mode("error"), which also sees inside the compiled CUDA ops.

Also here: the mode does catch host reads (so the step tests cannot pass vacuously), NaN/inf
inputs reach the loss on every CPU backend with the value checks off (the policy that lets the
step skip them), and a non-finite loss stops train.py naming its first step, with no checkpoint
written after it.
"""
import json
import math
import os
import sys

import pytest
import torch

import nac_fast
from nac_fast.ops import loss as nloss
from nac_fast.ops.noise import noise_from_seed
from nac_fast.train.methods import nac_mq_step, nac_step, step_value_checks
from nac_fast.train.models import build_model
from nac_fast.train.sync_check import HostRead, NoHostReads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train import run as run_mod  # noqa: E402  (train.py's step: run.train_step)
from nac_fast.train.checkpoint import load_checkpoint  # noqa: E402

aten = torch.ops.aten
BACKENDS = nac_fast.available_backends("cpu")  # reference, cpu (extension), triton (interpreter)


# ---- the mode catches what it must --------------------------------------------------------------

@pytest.mark.parametrize("read", [
    lambda t: float(t.sum()), lambda t: bool(t[0] > 0), lambda t: t.sum().item(),
    lambda t: int(t.argmax()), lambda t: t.nonzero(), lambda t: t[t > 0],
    lambda t: t.masked_select(t > 0), lambda t: torch.unique(t), lambda t: torch.equal(t, t),
    lambda t: torch.allclose(t, t), lambda t: t.repeat_interleave(t.long().abs()),
    lambda t: torch.empty(3, device="meta").to("cpu"),
], ids=["float", "bool", "item", "int", "nonzero", "bool-index", "masked_select", "unique",
        "equal", "allclose", "repeat_interleave", "non-cpu-to-cpu"])
def test_mode_catches_host_reads(read):
    t = torch.randn(6)
    with pytest.raises(HostRead, match="host sync"):
        with NoHostReads():
            read(t)


def test_mode_sees_inside_this_packages_python_ops():
    """The Triton ops are Python bodies behind one custom op: the mode runs them under itself."""
    @torch.library.custom_op("nac_fast::_test_reads_host", mutates_args=())
    def reads_host(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().item()

    with pytest.raises(HostRead, match="host sync: aten.(item|_local_scalar_dense)"):
        with NoHostReads():
            reads_host(torch.randn(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_from_seed_is_sync_free(backend):
    like = torch.empty(5, 7)
    with NoHostReads() as mode:
        seed = torch.randint(0, 2 ** 62, (1,))
        noise_from_seed(like, seed, 0.1, backend=backend)
    assert {"cpu": "nac_fast.nac_noise", "triton": "nac_fast.nac_noise_triton",
            "reference": "aten.bitwise_xor"}[backend] in mode.ops, mode.ops


def test_mode_catches_the_value_checks_of_a_cpu_loss_call():
    """With the default policy ("auto") a CPU loss call checks values, which reads data: the mode
    sees inside the loss, so the step tests below are not vacuous."""
    a, r = torch.randn(8, 4), torch.randn(8, 4)
    with nloss.value_checks("auto"), pytest.raises(HostRead, match="_local_scalar_dense"):
        with NoHostReads():
            nac_fast.nac_loss(a, r, 0.1)
    with step_value_checks(), NoHostReads() as mode:
        nac_fast.nac_loss(a, r, 0.1)
    assert "aten.tanh" in mode.ops or any("nac_fwd" in o for o in mode.ops)


# ---- one training step, as train.py runs it ------------------------------------------------------

def _loss_ops(backend):
    """Op names that show the loss of `backend` ran under the mode (forward and backward)."""
    return {"cpu": ("nac_fast.nac_fwd", "nac_fast.nac_bwd"),
            "triton": ("nac_fast.nac_fwd_triton", "nac_fast.nac_bwd_triton"),
            "reference": ("aten.logsumexp",)}[backend]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["nac", "nac-draws", "nac-mq"])
def test_loss_forward_backward_of_a_step_is_sync_free(backend, method):
    """nac_step / nac_mq_step (+ its VI term) forward and backward under the step's checks: what
    the GPU suite wraps in torch.cuda.set_sync_debug_mode("error").  nac-draws: in-batch NAC
    averaged over 3 channel draws with the own key left out (docs/math.md [M:draws])."""
    torch.manual_seed(0)
    model = build_model("resnet-tiny", 1, 8, 16)
    x = torch.randn(16, 1, 8, 8)
    with step_value_checks(), NoHostReads() as mode:
        if method == "nac":
            loss, _ = nac_step(model, x, 0.1, backend=backend)
        elif method == "nac-draws":
            loss, _ = nac_step(model, x, 0.1, backend=backend, noise_draws=3, self_key="exclude")
        else:
            mq = nac_fast.NACMQ(model, queue_size=48, p=0.1, l2=0.1, backend=backend)
            loss, _ = nac_mq_step(mq, x)
        loss.backward()
    for op in _loss_ops(backend):
        assert op in mode.ops, (op, sorted(set(mode.ops)))
    assert "aten.convolution_backward" in mode.ops  # the whole backward ran under the mode
    assert math.isfinite(loss.item())


def _run(argv, monkeypatch, wrap=None):
    if wrap is not None:
        real = train.train_step
        monkeypatch.setattr(train, "train_step", lambda st, x: wrap(real, st, x))
    return train.main(argv)


SMALL = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--code-dim", "16",
         "--no-progress"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["nac", "nac-mq", "simclr"])
def test_train_py_step_is_sync_free(backend, method, monkeypatch, tmp_path):
    """train.py's own step (loss forward and backward, LARS, schedule, EMA, enqueue) and its
    per-step loss bookkeeping (LossWatch.update) under the mode, for every loss backend: the
    training loop reaches the model, the loss and the optimizer only through train.train_step."""
    if method == "simclr" and backend != BACKENDS[0]:
        pytest.skip("SimCLR does not use the NAC loss backends")
    seen = []

    def wrap(real, st, x):
        with NoHostReads() as mode:
            out = real(st, x)
        seen.append(mode.ops)
        return out

    real_update = train.LossWatch.update

    def update(self, loss):  # the loop's per-step bookkeeping of the loss, on the device
        with NoHostReads() as mode:
            real_update(self, loss)
        seen_update.append(mode.ops)

    seen_update = []
    monkeypatch.setattr(train.LossWatch, "update", update)
    argv = SMALL + ["--method", method, "--loss-backend", backend, "--max-steps", "3",
                    "--log-every", "2", "--save-every", "100", "--queue-size", "32",
                    "--out", str(tmp_path / "run")]
    assert _run(argv, monkeypatch, wrap) == 0
    assert len(seen) == len(seen_update) == 3
    assert "aten.where" in seen_update[0]
    ops = set(seen[0])
    if method != "simclr":
        for op in _loss_ops(backend):
            assert op in ops, (op, sorted(ops))
    assert "aten._foreach_norm" in ops            # LARS ran under the mode
    if method == "nac-mq":
        assert "aten._foreach_lerp_" in ops       # EMA
        # CodeQueue.enqueue_tanh: the reference's index_copy_, or the Triton kernel (its launch
        # is not an ATen op: the pointer's update stays on the device all the same)
        assert ("aten.index_copy_" in ops) == (backend != "triton")


@pytest.mark.parametrize("method", ["nac", "nac-mq"])
def test_compiled_train_py_step_is_sync_free(method, monkeypatch, tmp_path):
    """train.py's step with the encoders torch.compile'd (aot_eager: the compiled graphs are
    aten ops, so the mode sees them as they run; compilation itself runs without the mode, at
    the first step, which is left out): the compiled graphs ran under the mode (the
    functionalised BatchNorm is theirs alone) and read nothing on the host."""
    import torch._dynamo
    torch._dynamo.reset()
    seen = []

    def wrap(real, st, x):
        if st.step == 0:  # compiles
            return real(st, x)
        with NoHostReads() as mode:
            out = real(st, x)
        seen.append(mode.ops)
        return out

    argv = SMALL + ["--method", method, "--max-steps", "3", "--log-every", "2",
                    "--save-every", "100", "--queue-size", "32", "--compile",
                    "--compile-backend", "aot_eager", "--out", str(tmp_path / "run")]
    try:
        assert _run(argv, monkeypatch, wrap) == 0
    finally:
        torch._dynamo.reset()
    assert len(seen) == 2
    for ops in seen:
        assert "aten._native_batch_norm_legit_functional" in ops    # a compiled graph ran
        assert "aten.native_batch_norm_backward" in ops
        assert "aten._foreach_norm" in ops                          # LARS
        if method == "nac-mq":
            assert "aten._foreach_lerp_" in ops and "aten.index_copy_" in ops


def test_check_step_on_cpu_names_a_host_read():
    """sync_check.check_step's CPU detector (what bench/train_throughput.py --sync-check runs
    on a CPU): a step with a host read fails, naming the op and the line; one without passes."""
    from nac_fast.train.sync_check import check_step
    t = torch.randn(5)

    def bad_step():
        return t * t.sum().item()  # the host read

    bad = check_step(bad_step, "cpu")
    assert bad["sync_check"] == "FAIL"
    assert bad["sync_offender"] == "host sync: aten._local_scalar_dense.default"
    assert any("test_sync_free.py" in f and "in bad_step" in f
               for f in bad["sync_offender_frames"])
    good = check_step(lambda: t * t.sum(), "cpu")
    assert good["sync_check"] == "PASS" and good["sync_ops_seen"] == 2
    with pytest.raises(ValueError, match="device"):
        check_step(lambda: None, "meta")


# ---- NaN/inf reach the loss with the value checks off --------------------------------------------

def _inputs(n=6, D=5, N=7):
    g = torch.Generator().manual_seed(1)
    a, r = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    keys = torch.tanh(torch.randn(N, D, generator=g))
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g)
    return a, r, keys, noise


def _losses(backend, a, r, keys, noise):
    with nloss.value_checks(False):
        return {"in-batch": nac_fast.nac_loss(a, r, 0.1, noise=noise, backend=backend),
                "keys": nac_fast.nac_loss(a, r, 0.1, keys=keys, noise=noise, backend=backend),
                "mq": nac_fast.nac_mq_loss(a, r, keys, 0.1, noise=noise, backend=backend),
                "vi": nac_fast.nac_vi_loss(a, r, 0.1, noise=noise)}


@pytest.fixture
def four_threads():
    """The fused CPU kernel splits the keys over threads (and Triton over programs) when there
    are few query blocks: with 1100 keys both merge several splits, the path where a NaN in one
    split could be dropped."""
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["a", "r", "keys", "noise"])
@pytest.mark.parametrize("N", [7, 1100])
def test_nan_input_gives_nan_loss_with_checks_off(backend, which, N, four_threads):
    a, r, keys, noise = _inputs(N=N)
    {"a": a, "r": r, "keys": keys, "noise": noise}[which][2 if which != "keys" else N - 1, 3] = \
        math.nan
    for kind, v in _losses(backend, a, r, keys, noise).items():
        if which == "keys" and kind in ("in-batch", "vi"):
            assert math.isfinite(v.item()), kind            # these do not read the keys
        else:
            assert math.isnan(v.item()), (kind, v)


class _env:
    """Set an environment variable for a block (the Triton kernels read NAC_FAST_FP32_DOT per
    call)."""

    def __init__(self, name, value):
        self.name, self.value = name, value

    def __enter__(self):
        self.old = os.environ.get(self.name)
        os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.old


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf])
@pytest.mark.parametrize("N", [7, 1100])
def test_inf_input_reaches_the_loss_with_checks_off(backend, value, N, four_threads):
    """+-inf in r: a non-finite loss.  +-inf in a key: rows whose logit with that key is +inf get
    an infinite log-sum-exp (non-finite loss); rows where it is -inf drop the key (exp = 0), a
    finite loss whose gradient (0 * inf) is NaN.  +-inf in a is not an error: tanh(+-inf) = +-1,
    the loss is the finite limit (checked against a = +-30, where tanh is +-1 in float32)."""
    a, r, keys, noise = _inputs(N=N)
    r_bad = r.clone()
    r_bad[2, 3] = value
    for kind, v in _losses(backend, a, r_bad, keys, noise).items():
        assert not math.isfinite(v.item()), (kind, v)
    # a key entry +-inf in a column where the queries' signs are mixed: some logit is +inf
    zt = noise * torch.tanh(a)
    assert (zt[:, 3] > 0).any() and (zt[:, 3] < 0).any()
    k_bad = keys.clone()
    k_bad[N - 1, 3] = value  # the last key: the last split of the multi-split kernels
    for kind in ("keys", "mq"):
        assert not math.isfinite(_losses(backend, a, r, k_bad, noise)[kind].item()), kind
    # all queries' logits with the bad key -inf: with exact products, a finite loss and a NaN
    # gradient for a; the Triton kernels' default fp32 products (tf32x3) add the query's small
    # TF32 part times the -inf, which is NaN: a non-finite loss (docs/kernels.md "Precision")
    a_pos, m_pos = a.abs() + 0.1, torch.ones_like(noise)
    k_neg = keys.clone()
    k_neg[N - 1, 3] = -math.inf
    for fp32_dot in (("ieee", "tf32x3") if backend == "triton" else ("ieee",)):
        a_leaf = a_pos.clone().requires_grad_()
        with nloss.value_checks(False), _env("NAC_FAST_FP32_DOT", fp32_dot):
            v = nac_fast.nac_loss(a_leaf, r, 0.1, keys=k_neg, noise=m_pos, backend=backend)
            v.backward()
        if fp32_dot == "ieee":
            assert math.isfinite(v.item()) and not torch.isfinite(a_leaf.grad).all()
        else:
            assert not math.isfinite(v.item())
    # a = +-inf is tanh's limit
    a_inf, a_big = a.clone(), a.clone()
    a_inf[2, 3], a_big[2, 3] = value, math.copysign(30.0, value)
    got, lim = _losses(backend, a_inf, r, keys, noise), _losses(backend, a_big, r, keys, noise)
    for kind in got:
        assert math.isfinite(got[kind].item()), kind
        torch.testing.assert_close(got[kind], lim[kind], rtol=1e-6, atol=1e-6)


# ---- a non-finite loss stops train.py at the next check -----------------------------------------

@pytest.mark.parametrize("bad,log_every,save_every,found,ckpt,logged", [
    (5, 100, 3, 6, 3, []),      # found before the save at 6 (none at 6); last checkpoint 3
    (4, 2, 2, 4, 2, [2]),       # found at once (log and save point): the checkpoint of step 2
    (3, 10, 10, 7, None, []),   # found at the end (step 7 == --max-steps): no checkpoint at all
])
def test_non_finite_loss_names_first_step_and_no_checkpoint_after(bad, log_every, save_every,
                                                                   found, ckpt, logged,
                                                                   monkeypatch, tmp_path, capsys):
    calls = {"n": 0}
    real = run_mod.nac_step

    def poisoned(*a, **k):
        loss, z = real(*a, **k)
        calls["n"] += 1
        return (loss + math.inf if calls["n"] == bad else loss), z

    monkeypatch.setattr(run_mod, "nac_step", poisoned)
    out = tmp_path / "run"
    argv = SMALL + ["--max-steps", "7", "--log-every", str(log_every), "--save-every",
                    str(save_every), "--out", str(out)]
    assert train.main(argv) == 3
    err = capsys.readouterr().err
    later = f" (found at step {found})" if found != bad else ""
    assert f"non-finite loss (inf) at step {bad}{later}; stopping." in err, err
    assert calls["n"] == found                   # stopped at the check, no step after it
    if ckpt is None:
        assert not (out / "last.pt").exists() and "kept: none" in err
    else:
        assert load_checkpoint(str(out / "last.pt"))["step"] == ckpt < bad
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == logged


# ---- moved from tests/test_train_bench.py (issue 57): the sync-check detector of
# nac_fast/train/sync_check.py and the device synthetic loader of bench/train_throughput.py ----

@pytest.mark.parametrize("syncs", [False, True])
def test_cuda_sync_check_verdict_and_offender(monkeypatch, syncs):
    """check_step's CUDA path with torch.cuda's sync-debug switch simulated (no GPU here), as
    torch behaves: setting the mode warns that it "is a prototype feature" (never an offender),
    and in "warn" / "error" mode a synchronising call warns / raises "called a synchronizing
    CUDA operation" from the line that made it.  A step with such a call: FAIL naming that line
    and, from the "error" run, its frames; else PASS with the notice listed as ignored."""
    import warnings
    import torch
    from nac_fast.train import sync_check
    mode = {"m": "default"}

    def set_mode(m):
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                      "detect all synchronizing operations", UserWarning)
        mode.update(m=m)

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def synchronising_op():
        if mode["m"] == "warn":
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
        elif mode["m"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")

    def step():
        if syncs:
            synchronising_op()

    res = sync_check.check_step(step, torch.device("cuda"))
    assert mode["m"] == "default"  # switched back
    assert any("prototype feature" in w for w in res["sync_ignored"])
    if syncs:
        assert res["sync_check"] == "FAIL" and res["sync_offender_count"] == 1
        assert "test_sync_free.py" in res["sync_offender"]
        assert res["sync_offender"].endswith("called a synchronizing CUDA operation")
        assert any("in synchronising_op" in f for f in res["sync_offender_frames"])
    else:
        assert res["sync_check"] == "PASS" and res["sync_offender_count"] == 0
        assert res["sync_offenders"] == [] and "sync_offender" not in res


def test_device_synthetic_loader_is_deterministic_and_resumes():
    from nac_fast.data.sources.synthetic_pairs import DeviceSyntheticPairLoader
    import torch
    ld = DeviceSyntheticPairLoader(64, 8, image_size=6, pool=5, channels_last=True)
    assert len(ld) == 8 and ld.num_images == 64 and ld.in_channels == 3
    ld.set_epoch(1)
    full = list(ld)
    assert len(full) == 8
    v1, v2 = full[0]
    assert v1.shape == (8, 3, 6, 6) and v1.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(v1, v2)
    ld.set_epoch(1, start_batch=5)
    resumed = list(ld)
    assert len(resumed) == 3
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(resumed, full[5:]))
    ld.set_epoch(2)
    assert not torch.equal(next(iter(ld))[0], full[0][0])
    with pytest.raises(ValueError, match="pool"):
        DeviceSyntheticPairLoader(64, 8, pool=0)


# the GPU suite's train stage in its CPU mode (bench/gpu_suite.sh stage_train)
CPU_STAGE = ["--data", "synthetic-device:256", "--arch", "resnet-tiny", "--method", "nac-mq",
             "--batch-size", "32", "--image-size", "16", "--amp", "off", "--queue-size", "128",
             "--warmup", "1", "--steps", "2", "--compile", "--compile-backend", "aot_eager",
             "--budget-s", "150", "--sync-check"]


@pytest.mark.slow
def test_train_throughput_sync_check_names_a_planted_host_read(monkeypatch, tmp_path, capsys):
    """A real .item() planted in the step (inside LARS) fails the check on the CPU: exit status
    1, the offending op and the planted line named."""
    from nac_fast.train import lars
    real = lars.trust_ratios

    def reads_the_host(params, updates, tc):
        out = real(params, updates, tc)
        if out:
            out[0].item()  # the planted host read
        return out

    monkeypatch.setattr(lars, "trust_ratios", reads_the_host)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "train.json"
    args = CPU_STAGE + ["--no-eager-baseline", "--json-out", str(out)]
    with pytest.raises(SystemExit) as exc:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        try:
            import train_throughput
        finally:
            sys.path.pop(0)
        train_throughput.main(args)
    assert exc.value.code == 1
    res = json.loads(out.read_text())
    assert res["sync_check"] == "FAIL"
    assert res["sync_offender"] == "host sync: aten._local_scalar_dense.default"
    assert any("test_sync_free.py" in f and "out[0].item()" in f
               for f in res["sync_offender_frames"]), res["sync_offender_frames"]
    assert "eager" not in res
    # train.py's own loader is back: the benchmark's device-data stand-in does not leak
    from nac_fast.train import run as run_mod
    assert run_mod.build_loader.__module__ == "nac_fast.train.run"
