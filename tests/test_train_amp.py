"""Precision under AMP: the training steps hand the losses the autocast dtype's codes (no float32
copy of a, r, r_hat or the queue), the losses still compute in float32, and the queue is stored in
the loss dtype with checkpoints loading across dtypes.

Tolerance (the loss tests' rule, tests/test_loss_numerics.py): on the bf16 inputs the step handed
over, the step's loss must be within 2x the error of the reference backend computed in bf16, both
against float64 of the same inputs.  And against the float32 run (no autocast) the step may not
move further than the pre-AMP code did (float32 loss of the same bf16 model outputs) plus that
budget: the only new error allowed is the loss's own, the bf16 network's is not ours to judge.
"""
import os
import sys

import pytest
import torch

import nac_fast
from nac_fast.ops import loss as loss_api
from nac_fast.ops import reference
from nac_fast.ops.queue import CodeQueue
from nac_fast.train import methods
from nac_fast.train.models import build_model

from _loss_helpers import rel_err

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint  # noqa: E402

BACKENDS = nac_fast.available_backends("cpu")
P, L2, D, K = 0.1, 0.1, 16, 8
BF16 = torch.bfloat16


class Spy:
    """Records the tensors the step hands to a loss function, then calls it."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kw):
        self.calls.append((args, kw))
        return self.fn(*args, **kw)


def _spies(monkeypatch):
    """Spies on the functional losses the criteria (NACLoss, NACMQLoss) call, and on NACMQLoss's
    fused path for its two terms (`_mq_and_vi_fused`: the Triton backend's; None elsewhere)."""
    spies = {name: Spy(getattr(loss_api, name)) for name in ("nac_loss", "nac_mq_loss",
                                                             "nac_vi_loss", "_mq_and_vi_fused")}
    for name, spy in spies.items():
        monkeypatch.setattr(loss_api, name, spy)
    return spies


def _mq(model, queue_dtype=torch.float32, queue_size=6 * K, backend="auto"):
    return nac_fast.NACMQ(model, queue_size=queue_size, p=P, l2=L2, queue_dtype=queue_dtype,
                          backend=backend)


def _setup(seed=0):
    torch.manual_seed(seed)
    model = build_model("resnet-tiny", 1, 8, D)
    x = torch.randn(2 * K, 1, 8, 8)
    noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(seed + 1))
    return model, x, noise


def _d(t):
    return t.detach().double()


def _vi_rows(a, r, noise):
    """The VI term's rows in the inputs' dtype (the bf16 yardstick; float64 for float64)."""
    return -reference.bernoulli_term(noise.to(a.dtype) * torch.tanh(a), r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nac_step_under_bf16_autocast(backend, monkeypatch):
    model, x, noise = _setup()
    with torch.no_grad():
        l32, _ = methods.nac_step(model, x, P, noise=noise, backend=backend)
    spies = _spies(monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        loss, a = methods.nac_step(model, x, P, noise=noise, backend=backend)
    (args, kw), = spies["nac_loss"].calls
    a_b, r_b = args[0], args[1]
    assert a_b.dtype == r_b.dtype == BF16 and a.dtype == BF16   # no float32 copy
    assert kw["keys"] is None and loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        v64 = nac_fast.nac_loss(_d(a_b), _d(r_b), P, noise=noise.double(), backend="reference",
                                reduction="none")
        vref = nac_fast.nac_loss(a_b, r_b, P, noise=noise, backend="reference", reduction="none")
        old = nac_fast.nac_loss(a_b.float(), r_b.float(), P, noise=noise, backend=backend)
    budget = rel_err(vref, v64)
    assert rel_err(loss, v64.mean()) <= 2 * budget, (rel_err(loss, v64.mean()), budget)
    assert abs(loss.item() - l32.item()) <= abs(old.item() - l32.item()) \
        + 2 * budget * abs(v64.mean().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("queue_dtype", [BF16, torch.float32])
def test_nac_mq_step_under_bf16_autocast(backend, queue_dtype, monkeypatch):
    model, x, noise = _setup(1)
    mq32, mq = _mq(model, backend=backend), _mq(model, queue_dtype, backend=backend)
    q32, q = mq32.queue, mq.queue
    q32.codes.copy_(torch.tanh(torch.randn(6 * K, D)))
    q.codes.copy_(q32.codes)
    with torch.no_grad():
        l32, _ = methods.nac_mq_step(mq32, x, noise=noise)
    spies = _spies(monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        loss, _ = methods.nac_mq_step(mq, x, noise=noise)
    if spies["nac_mq_loss"].calls:  # the two calls
        (margs, mkw), = spies["nac_mq_loss"].calls
        (vargs, vkw), = spies["nac_vi_loss"].calls
        a_b, rh_b, queue_b = margs[:3]
        r_b = vargs[1]
        assert mkw["noise"] is vkw["noise"] is noise  # one channel sample, converted by the loss
    else:  # the Triton backend: both terms in one fused call (docs/math.md [M:vi])
        (fargs, _), = spies["_mq_and_vi_fused"].calls
        a_b, rh_b, r_b, queue_b = fargs[:4]
        assert fargs[6] is noise and backend == "triton"
    assert {t.dtype for t in (a_b, rh_b, queue_b, r_b)} == {BF16}
    if queue_dtype == BF16 and backend != "reference":
        assert queue_b is q.codes          # the stored queue itself: no per-step conversion
    elif queue_dtype == BF16:  # the reference's autograd saves the codes: a copy, not a
        # conversion (the next enqueue must not invalidate this loss's graph, loss.py NACMQLoss)
        assert queue_b is not q.codes and torch.equal(queue_b, q.codes)
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        rows64 = reference.nac_mq_loss_reference(_d(a_b), _d(rh_b), _d(queue_b), noise.double(),
                                                 nac_fast.channel_scale(P), l2=L2,
                                                 reduction="none") \
            + _vi_rows(_d(a_b), _d(r_b), noise.double())
        rows_ref = reference.nac_rows_reference(a_b, rh_b, noise.to(BF16),
                                                nac_fast.channel_scale(P), keys=queue_b, l2=L2) \
            + _vi_rows(a_b, r_b, noise)
        old = (nac_fast.nac_mq_loss(a_b.float(), rh_b.float(), queue_b.float(), P, l2=L2,
                                    noise=noise, backend=backend)
               + nac_fast.nac_vi_loss(a_b.float(), r_b.float(), P, noise=noise))
    v64 = rows64.mean()
    budget = rel_err(rows_ref, rows64)
    assert rel_err(loss, v64) <= 2 * budget, (rel_err(loss, v64), budget)
    # the float32 queue of the reference run differs from the bf16 one by its rounding too:
    # part of what the old code (float32 loss of the same bf16 inputs) also sees
    assert abs(loss.item() - l32.item()) <= abs(old.item() - l32.item()) \
        + 2 * budget * abs(v64.item())


def test_nac_mq_step_draws_its_noise_in_the_loss_dtype(monkeypatch):
    model, x, _ = _setup(2)
    spies = _spies(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        methods.nac_mq_step(_mq(model, BF16, 4 * K), x)
    (_, mkw), = spies["nac_mq_loss"].calls
    (_, vkw), = spies["nac_vi_loss"].calls
    assert mkw["noise"] is vkw["noise"] and mkw["noise"].dtype == BF16
    assert set(mkw["noise"].unique().tolist()) <= {-1.0, 1.0}


def test_vi_loss_computes_in_float32_for_bf16_inputs():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(64, 32, generator=g).to(BF16)
    r = (3 * torch.randn(64, 32, generator=g)).to(BF16).requires_grad_()
    noise = nac_fast.draw_noise(a.shape, P, generator=g)
    with torch.autocast("cpu", dtype=BF16):
        v = nac_fast.nac_vi_loss(a, r, P, noise=noise, reduction="none")
    exact = nac_fast.nac_vi_loss(a.double(), r.detach().double(), P, noise=noise.double(),
                                 reduction="none")
    assert v.dtype == torch.float32
    # float32 arithmetic on the bf16 values: float32 rounding, not bf16's
    assert rel_err(v, exact) <= 1e-6, rel_err(v, exact)
    assert rel_err(_vi_rows(a, r.detach(), noise), exact) > 1e-4   # bf16 arithmetic is worse
    v.sum().backward()
    assert r.grad.dtype == BF16


def test_loss_dtype_follows_autocast():
    t = torch.randn(2, 2)
    assert loss_api.loss_dtype(t) == torch.float32
    assert loss_api.loss_dtype(t.double()) == torch.float64
    with torch.autocast("cpu", dtype=BF16):
        assert loss_api.loss_dtype(t) == BF16
        assert loss_api.loss_dtype(t.to(BF16)) == BF16
        assert loss_api.loss_dtype(t.double()) == torch.float64


@pytest.mark.parametrize("src,dst", [(torch.float32, BF16), (BF16, torch.float32)])
def test_queue_checkpoint_loads_across_dtypes(src, dst):
    q = CodeQueue(8, 4, dtype=src)
    q.enqueue(torch.tanh(torch.randn(6, 4)))
    state = q.state_dict()
    assert state["codes"].dtype == src
    r = CodeQueue(8, 4, dtype=dst)
    r.load_state_dict(state)
    assert r.codes.dtype == dst and r.ptr == 6
    assert torch.equal(r.codes, q.codes.to(dst))
    with pytest.raises(TypeError, match="queue codes in the checkpoint must be floating"):
        r.load_state_dict({"codes": torch.zeros(8, 4, dtype=torch.int64), "ptr": 0})
    with pytest.raises(TypeError, match="queue dtype"):
        CodeQueue(8, 4, dtype=torch.int32)


@pytest.mark.slow
def test_bf16_amp_run_stores_a_bf16_queue_and_resumes_across_amp(tmp_path):
    """train.py --amp bf16 on the CPU: the queue is bf16 in the checkpoint; a run resumed with
    --amp off loads it into its float32 queue (and the other way round)."""
    base = ["--method", "nac-mq", "--data", "synthetic:64", "--image-size", "8",
            "--batch-size", "16", "--code-dim", str(D), "--queue-size", "32", "--max-steps", "4",
            "--log-every", "1", "--no-progress"]
    for first, second in (("bf16", "off"), ("off", "bf16")):
        out = str(tmp_path / first)
        assert train.main(base + ["--amp", first, "--stop-at-step", "2", "--out", out]) == 0
        ck = load_checkpoint(os.path.join(out, "last.pt"))
        assert ck["queue"]["codes"].dtype == (BF16 if first == "bf16" else torch.float32)
        assert train.main(base + ["--amp", second, "--resume", "--out", out]) == 0
        ck = load_checkpoint(os.path.join(out, "last.pt"))
        assert ck["step"] == 4
        assert ck["queue"]["codes"].dtype == (BF16 if second == "bf16" else torch.float32)
