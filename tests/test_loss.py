"""The loss as a library user calls it (nac_fast.nac_loss / nac_mq_loss / nac_vi_loss, the
criteria NACLoss / NACMQLoss / NACMQ), one class per subject:

- TestCriteria: the nn.Module criteria as the trainer uses them, bit for bit 0.1.0's formula.
- TestLibraryUse: what an audit of the API used as a library found broken (queue keys' dtypes,
  noise that requires grad, the dispatcher's helpers, repr, pointer width, gradient penalties,
  numpy scalars).
- TestInputs: bad inputs get named errors; the value-check policy (NAC_FAST_CHECK_INPUTS).
- TestContracts: second derivatives, refused calls leave the queue, noise dtypes, checkpointed
  pointers, gradient accumulation, backend="auto" on wide CUDA codes.
- TestDeviceGuard: every Triton launch runs under its tensors' device.
- TestAuto: backend="auto" never picks the slower CPU path.
- TestFuncTransforms: the losses under torch.func (grad, vmap, jacrev).

Their numerics against float64 are in tests/test_loss_numerics.py, the host path in
tests/test_loss_host.py.  bench/gpu_suite.sh runs TestInputs, TestContracts and TestDeviceGuard
with NAC_FAST_TEST_DEVICE=cuda.
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import nac_fast
from nac_fast import CodeQueue, NACLoss, NACMQ, NACMQLoss
from nac_fast.ops import dispatch
from nac_fast.ops.momentum import NACMQOutput, ema_update_, make_momentum_copy
from nac_fast.train import methods
from nac_fast.train.models import build_model

from _loss_helpers import fused_backends
from _old_steps import old_nac_mq_step, old_nac_step

try:  # the Triton kernels (the optional [triton] extra); TestDeviceGuard needs them
    from nac_fast.kernels import hamming_triton, launch, nac_noise_triton, nac_triton
except ImportError:
    hamming_triton = launch = nac_noise_triton = nac_triton = None


# ==== the criteria (NACLoss, NACMQLoss, NACMQ) ====================================================

P, L2, D, K = 0.1, 0.1, 16, 8
BF16 = torch.bfloat16
BACKENDS = [b for b in ("reference", "cpu") if b in nac_fast.available_backends("cpu")]
HEADS = {
    "paper": {},
    "learning": dict(head_bn=True, infer_bn=True, a_gain=3.0, r_gain="auto", learn_gain=True,
                     infer_init="copy"),
    "bn-per-view": dict(head_bn=True, infer_bn=True, bn_per_view=True),
}


def _model(heads, encoder="linear"):
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 1, 8, code_dim=D, p=P, **HEADS[heads])
    if encoder == "linear":  # the heads as they are on a fast encoder (the pairing is in them)
        m.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, m.feature_dim), nn.ReLU())
    return m


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_same(old, new, what):
    assert len(old) == len(new), what
    for i, (o, n) in enumerate(zip(old, new)):
        assert (o is None) == (n is None), (what, i)
        if o is not None:
            assert o.dtype == n.dtype and torch.equal(o, n), (what, i, (o - n).abs().max())


def _compare_with_old(method, heads, amp, backend, encoder):
    old_m, new_m = _model(heads, encoder), _model(heads, encoder)
    qdt = BF16 if amp else torch.float32
    if method == "nac-mq":
        old_mom, old_q = make_momentum_copy(old_m), CodeQueue(6 * K, D, dtype=qdt)
        mq = NACMQ(new_m, queue_size=6 * K, p=P, l2=L2, momentum=0.9, queue_dtype=qdt,
                   backend=backend)
    opts = {path: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
            for path, m in (("old", old_m), ("new", new_m))}
    g = torch.Generator().manual_seed(1)
    for t in range(3):
        x = torch.randn(2 * K, 1, 8, 8, generator=g)
        freeze = t == 0
        got = {}
        for path, model in (("old", old_m), ("new", new_m)):
            torch.manual_seed(100 + t)  # the channel noise is drawn inside, from here
            with torch.autocast("cpu", dtype=BF16) if amp else contextlib.nullcontext():
                if method == "nac" and path == "old":
                    loss, a = old_nac_step(model, x, P, backend=backend, freeze_codes=freeze)
                elif method == "nac":
                    loss, a = methods.nac_step(model, x, P, backend=backend, freeze_codes=freeze)
                elif path == "old":
                    loss, a = old_nac_mq_step(model, old_mom, old_q, x, P, L2, backend=backend,
                                              freeze_codes=freeze)
                else:
                    loss, a = methods.nac_mq_step(mq, x, freeze_codes=freeze)
            opts[path].zero_grad(set_to_none=True)
            loss.backward()
            got[path] = (loss.detach(), a.detach(), _grads(model))
            opts[path].step()
            if method == "nac-mq" and path == "old":
                ema_update_(old_mom, old_m, 0.9)  # 0.1.0: the caller's EMA after the step
        (lo, ao, go), (ln, an, gn) = got["old"], got["new"]
        assert lo.dtype == ln.dtype == torch.float32
        assert torch.equal(lo, ln), (t, lo.item(), ln.item())
        assert ao.dtype == an.dtype and torch.equal(ao, an), t
        _assert_same(go, gn, f"gradients at step {t}")
    _assert_same(list(old_m.parameters()), list(new_m.parameters()), "weights")
    _assert_same(list(old_m.buffers()), list(new_m.buffers()), "BatchNorm statistics")
    if method == "nac-mq":
        assert torch.equal(old_q.codes, mq.queue.codes) and int(old_q.ptr) == int(mq.queue.ptr)
        mq.update_momentum()  # the last step's EMA, which NACMQ makes at its next call
        _assert_same(list(old_mom.parameters()), list(mq.momentum_model.parameters()),
                     "momentum model")
        _assert_same(list(old_mom.buffers()), list(mq.momentum_model.buffers()),
                     "momentum model's BatchNorm statistics")


# ---- what the criteria compute ------------------------------------------------------------------

def _views(n=K, d=D, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g).requires_grad_(requires_grad) for _ in range(4)]


class _Tiny(nn.Module):
    """NACModel's interface on a linear encoder (no BatchNorm): forward, encode, infer_logits."""

    def __init__(self):
        super().__init__()
        self.encoder, self.head, self.infer = nn.Linear(6, 5), nn.Linear(5, D), nn.Linear(5, D)
        self.code_dim = D

    def encode(self, x):
        h = self.encoder(x)
        return h, self.head(h)

    def infer_logits(self, h):
        return self.infer(h)

    def forward(self, x, detach_r_input=False):
        h, a = self.encode(x)
        k = h.shape[0] // 2
        hr = torch.cat([h[k:], h[:k]])
        return h, a, self.infer_logits(hr.detach() if detach_r_input else hr)


class TestCriteria:
    """The public criteria as the trainer uses them: NACLoss / NACMQLoss take the two views' outputs
    and pair them themselves, NACMQ makes a NAC-MQ step in one call, and the trainer's steps built
    on them give the losses and gradients of 0.1.0's hand-written formula bit for bit
    (tests/_old_steps.py; the two-process version is in tests/test_train_ddp.py).  Bad input names
    the argument."""

    # ---- the trainer's steps equal the old formula bit for bit -----------------------------------

    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("heads", list(HEADS))
    @pytest.mark.parametrize("method", ["nac", "nac-mq"])
    def test_trainer_steps_equal_the_old_formula(self, method, heads, amp, backend):
        """Three optimizer steps from one initialisation along both paths, the noise drawn inside
        from the same RNG state: equal losses, code pre-activations and gradients at every step
        (the first one with frozen codes, the inference network's warm-up), equal weights, queue and
        momentum model at the end."""
        _compare_with_old(method, heads, amp, backend, "linear")

    @pytest.mark.slow  # 3-15 s a case on the shared 2-core machine (load average 14-20)
    @pytest.mark.parametrize("method", ["nac", "nac-mq"])
    def test_trainer_steps_equal_the_old_formula_on_a_resnet(self, method):
        """The same on train.py's CPU model (convolutions and BatchNorm in the encoder)."""
        _compare_with_old(method, "learning", True, "auto", "resnet-tiny")

    def test_nac_loss_pairs_each_view_with_the_partners_logits(self):
        a0, r0, a1, r1 = _views(requires_grad=True)
        noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(3))
        got = NACLoss(P)((a0, r0), (a1, r1), noise=noise)
        want = nac_fast.nac_loss(torch.cat([a0, a1]), torch.cat([r1, r0]), P, noise=noise)
        assert torch.equal(got, want)
        same_view = nac_fast.nac_loss(torch.cat([a0, a1]), torch.cat([r0, r1]), P, noise=noise)
        assert not torch.allclose(got, same_view)  # the pairing matters
        got.backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (a0, r0, a1, r1))
        rows = NACLoss(P, reduction="none")((a0, r0), (a1, r1), noise=noise)
        assert rows.shape == (2 * K,) and torch.allclose(rows.mean(), got)
        # one process: gathering across ranks changes nothing
        assert torch.equal(NACLoss(P, gather_distributed=True)((a0, r0), (a1, r1), noise=noise),
                           got)

    def test_nac_loss_under_autocast_gives_the_loss_the_autocast_dtype(self):
        a0, r0, a1, r1 = _views()
        noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(3))
        with torch.autocast("cpu", dtype=BF16):
            got = NACLoss(P)((a0, r0.to(BF16)), (a1, r1.to(BF16)), noise=noise)  # float32 a, bf16 r
        want = nac_fast.nac_loss(torch.cat([a0, a1]).to(BF16), torch.cat([r1, r0]).to(BF16), P,
                                 noise=noise)
        assert got.dtype == torch.float32 and torch.equal(got, want)
        with pytest.raises(TypeError, match=r"out0\[1\] must have out0\[0\]'s dtype"):
            NACLoss(P)((a0, r0.to(BF16)), (a1, r1))  # autocast off: no silent conversion

    def test_nac_mq_loss_enqueues_the_momentum_keys_before_the_loss(self):
        a0, r0, a1, r1 = _views(requires_grad=True)
        am0, rm0, am1, rm1 = _views(seed=1)
        queue = CodeQueue(6 * K, D)
        queue.codes.copy_(torch.tanh(torch.randn(6 * K, D)))
        before = queue.codes.clone()
        noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(3))
        got = NACMQLoss(P, l2=L2)((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), queue, noise=noise)
        keys = torch.tanh(torch.cat([am0, am1]))
        assert int(queue.ptr) == 2 * K and torch.equal(queue.codes[:2 * K], keys)
        assert torch.equal(queue.codes[2 * K:], before[2 * K:])
        a = torch.cat([a0, a1])
        want = (nac_fast.nac_mq_loss(a, torch.cat([rm1, rm0]), queue.codes, P, l2=L2, noise=noise)
                + nac_fast.nac_vi_loss(a, torch.cat([r1, r0]), P, noise=noise))
        assert torch.equal(got, want)
        got.backward()
        assert a0.grad is not None and r0.grad is not None
        # without the online logits: the MQ term alone
        q2 = CodeQueue(6 * K, D)
        q2.codes.copy_(before)
        alone = NACMQLoss(P, l2=L2)((a0, None), (a1, None), (am0, rm0), (am1, rm1), q2, noise=noise)
        assert torch.equal(alone, nac_fast.nac_mq_loss(a, torch.cat([rm1, rm0]), q2.codes, P, l2=L2,
                                                       noise=noise))

    def test_l2_auto_is_the_papers_lambda_scaled_by_the_bits_gain(self):
        """l2="auto" ([M:mq-l2]): 0.1 ((1 - 2p)/0.8)^2, the paper's 0.1 at p = 0.1, the value the
        functional and the criterion use at each call's p (the trainer changes the criterion's p
        between steps under the p schedule)."""
        assert nac_fast.mq_l2(0.1) == pytest.approx(0.1, rel=1e-15)
        for p in (0.01, 0.25, 0.3, 0.4, 0.49):
            assert nac_fast.mq_l2(p) == pytest.approx(0.1 * ((1 - 2 * p) / 0.8) ** 2, rel=1e-15)
        assert nac_fast.mq_l2(0.25) == pytest.approx(0.0390625, rel=1e-15)
        for bad in (0.0, 0.5, -0.1, float("nan"), "0.1"):
            with pytest.raises((ValueError, TypeError), match="p must"):
                nac_fast.mq_l2(bad)
        a0, r0, a1, r1 = _views()
        am0, rm0, am1, rm1 = _views(seed=1)
        a, rh = torch.cat([a0, a1]), torch.cat([rm1, rm0])
        keys = torch.tanh(torch.randn(6 * K, D, generator=torch.Generator().manual_seed(5)))
        for p in (0.1, 0.25, 0.4):
            noise = nac_fast.draw_noise((2 * K, D), p, generator=torch.Generator().manual_seed(3))
            want = nac_fast.nac_mq_loss(a, rh, keys, p, l2=nac_fast.mq_l2(p), noise=noise)
            assert torch.equal(nac_fast.nac_mq_loss(a, rh, keys, p, l2="auto", noise=noise), want)
            if p != 0.1:  # away from the paper's p, "auto" is not the paper's 0.1
                assert not torch.equal(nac_fast.nac_mq_loss(a, rh, keys, p, l2=0.1, noise=noise),
                                       want)
        # the criterion resolves it at its p of each call
        crit = NACMQLoss(0.25, l2="auto")
        for p in (0.25, 0.4):
            crit.p = p
            noise = nac_fast.draw_noise((2 * K, D), p, generator=torch.Generator().manual_seed(3))
            q1, q2 = CodeQueue(6 * K, D), CodeQueue(6 * K, D)
            got = crit((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), q1, noise=noise)
            fixed = NACMQLoss(p, l2=nac_fast.mq_l2(p))((a0, r0), (a1, r1), (am0, rm0), (am1, rm1),
                                                         q2, noise=noise)
            assert torch.equal(got, fixed)
        for bad in ("Auto", "", "0.1"):
            with pytest.raises(ValueError, match="l2 must be a finite float >= 0 or 'auto'"):
                nac_fast.nac_mq_loss(a, rh, keys, 0.1, l2=bad)
            with pytest.raises(ValueError, match="l2 must be"):
                NACMQLoss(P, l2=bad)

    def test_nac_mq_loss_reads_a_queue_of_another_dtype(self):
        a0, r0, a1, r1 = _views()
        am0, rm0, am1, rm1 = _views(seed=1)
        noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(3))
        q16, q32 = CodeQueue(4 * K, D, dtype=BF16), CodeQueue(4 * K, D)
        got = NACMQLoss(P)((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), q16, noise=noise)
        NACMQLoss(P)((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), q32, noise=noise)
        assert q16.codes.dtype == BF16 and torch.equal(q16.codes, q32.codes.to(BF16))
        want = (nac_fast.nac_mq_loss(torch.cat([a0, a1]), torch.cat([rm1, rm0]), q16.codes.float(),
                                     P, noise=noise)
                + nac_fast.nac_vi_loss(torch.cat([a0, a1]), torch.cat([r1, r0]), P, noise=noise))
        assert torch.equal(got, want)

    def test_nacmq_is_one_call_per_step(self):
        torch.manual_seed(0)
        model = _Tiny()
        mq = NACMQ(model, queue_size=4 * K, momentum=0.5)
        assert mq.queue.codes.shape == (4 * K, D) and mq.model is model
        assert all(not p.requires_grad for p in mq.momentum_model.parameters())
        assert {k.split(".")[0] for k in mq.state_dict()} == {"model", "momentum_model", "queue"}
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        v0, v1 = torch.randn(K, 6), torch.randn(K, 6)
        out = mq(v0, v1)
        assert isinstance(out, NACMQOutput) and out.loss.dim() == 0
        assert out.a.shape == out.r.shape == (2 * K, D) and not out.a.requires_grad
        assert int(mq.queue.ptr) == 2 * K
        with torch.no_grad():
            keys = torch.tanh(mq.momentum_model.encode(torch.cat([v0, v1]))[1])
        assert torch.allclose(mq.queue.codes[:2 * K], keys)
        opt.zero_grad()
        out.loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        mom_before = [p.clone() for p in mq.momentum_model.parameters()]
        mq(v0, v1)  # the next call starts with the EMA of the updated online weights ([M:ema])
        for b, m, o in zip(mom_before, mq.momentum_model.parameters(), model.parameters()):
            torch.testing.assert_close(m, 0.5 * b + 0.5 * o.detach())
        assert int(mq.queue.ptr) == 0  # wrapped around: 4K codes in a queue of 4K
        # freeze_codes: only the inference network learns
        opt.zero_grad()
        mq(v0, v1, freeze_codes=True).loss.backward()
        assert model.head.weight.grad is None and model.infer.weight.grad.abs().sum() > 0

    # ---- bad input names the argument ------------------------------------------------------------

    def test_criteria_name_bad_arguments(self):
        a0, r0, a1, r1 = _views()
        crit = NACLoss(P)
        for kw, err, msg in [(dict(gather_distributed="yes"), TypeError, "gather_distributed"),
                             (dict(reduction="avg"), ValueError, "reduction"),
                             (dict(backend="gpu"), ValueError, "backend")]:
            with pytest.raises(err, match=msg):
                NACLoss(P, **kw)
            with pytest.raises(err, match=msg):
                NACMQLoss(P, **kw)
        with pytest.raises(ValueError, match="l2"):
            NACMQLoss(P, l2=-1.0)
        with pytest.raises(ValueError, match="p must lie"):
            NACLoss(0.5)
        cases = [
            (lambda: crit(a0, (a1, r1)), TypeError, r"out0 must be a pair \(a, r\)"),
            (lambda: crit((a0, r0, r0), (a1, r1)), TypeError, "out0 must be a pair.*length 3"),
            (lambda: crit((a0, r0), (a1[:3], r1)), ValueError, r"out1\[0\] must have 8 rows like "
                                                                r"out0\[0\]"),
            (lambda: crit((a0, r0[:, :3]), (a1, r1)), ValueError, r"out0\[1\] must have D=16"),
            (lambda: crit((a0, r0), (a1, r1.double())), TypeError, r"out1\[1\] must have "
                                                                   r"out0\[0\]'s dtype"),
            (lambda: crit((a0, r0), (a1, "r")), TypeError, r"out1\[1\] must be a torch.Tensor"),
            (lambda: crit((a0, r0), (a1.to("meta"), r1)), ValueError, r"out1\[0\] is on meta"),
            (lambda: crit((a0, r0), (a1, r1), noise=torch.ones(3, D)), ValueError,
             "noise must have"),
        ]
        for call, err, msg in cases:
            with pytest.raises(err, match=msg):
                call()
        mq, q = NACMQLoss(P), CodeQueue(4 * K, D)
        m0, m1 = (a0, r0), (a1, r1)
        cases = [
            (lambda: mq((a0, r0), (a1, r1), m0, m1, q.codes), TypeError, "queue must be a "
                                                                          "nac_fast.CodeQueue"),
            (lambda: mq((a0, r0), (a1, r1), m0, m1, CodeQueue(4 * K, 3)), ValueError,
             "queue must hold codes of D=16"),
            (lambda: mq((a0, r0), (a1, None), m0, m1, q), ValueError, r"out0\[1\] and out1\[1\]"),
            (lambda: mq((a0, r0), (a1, r1), m0, (a1, None), q), TypeError,
             r"momentum_out1\[1\] must be a torch.Tensor"),
            (lambda: mq((a0, r0), (a1, r1), (a0[:2], r0), m1, q), ValueError,
             r"momentum_out0\[0\] must have 8 rows"),
            (lambda: mq((a0, r0), (a1, r1), m0, m1, CodeQueue(4 * K, D, device="meta")), ValueError,
             "queue is on meta"),
        ]
        for call, err, msg in cases:
            with pytest.raises(err, match=msg):
                call()
        assert int(q.ptr) == 0  # nothing was enqueued by a refused call

    def test_nacmq_names_bad_arguments(self):
        model = _Tiny()
        for kw, err, msg in [
            (dict(queue_size=0), ValueError, "queue_size must be a positive int"),
            (dict(queue_size=8, code_dim=0), ValueError, "code_dim must be a positive int"),
            (dict(queue_size=8, momentum=1.5), ValueError, "momentum must be a float in"),
            (dict(queue_size=8, shuffle_bn=1), TypeError, "shuffle_bn must be a bool"),
            (dict(queue_size=8, queue_dtype=torch.int32), TypeError, "queue_dtype must be"),
            (dict(queue_size=8, l2=float("nan")), ValueError, "l2 must be"),
            (dict(queue_size=8, backend="gpu"), ValueError, "backend must be"),
        ]:
            with pytest.raises(err, match=msg):
                NACMQ(model, **kw)
        with pytest.raises(TypeError, match="model must be an nn.Module"):
            NACMQ(lambda x: x, queue_size=8)
        with pytest.raises(TypeError, match="model must have NACModel's interface.*encode"):
            NACMQ(nn.Linear(2, 2), queue_size=8, code_dim=2)
        plain = _Tiny()
        del plain.code_dim
        with pytest.raises(ValueError, match="code_dim must be given"):
            NACMQ(plain, queue_size=8)
        mq = NACMQ(model, queue_size=4 * K)
        v = torch.randn(K, 6)
        for call, err, msg in [
            (lambda: mq(v.numpy(), v), TypeError, "view0 must be a torch.Tensor"),
            (lambda: mq(v, v[:3]), ValueError, "view1 must match view0"),
            (lambda: mq(v, v.double()), ValueError, "view1 must match view0"),
            (lambda: mq(v[:0], v[:0]), ValueError, "view0 must be a non-empty batch"),
            (lambda: mq(v, v, freeze_codes="yes"), TypeError, "freeze_codes must be a bool"),
        ]:
            with pytest.raises(err, match=msg):
                call()
        assert int(mq.queue.ptr) == 0

    def test_refused_calls_leave_the_queue_and_the_momentum_model_as_they_were(self):
        a0, r0, a1, r1 = _views()
        am0, rm0, am1, rm1 = _views(seed=1)
        q = CodeQueue(4 * K, D)
        bad = am1.clone()
        bad[2, 3] = float("nan")
        with pytest.raises(ValueError, match=r"momentum_out1\[0\] contains NaN"):
            NACMQLoss(P)((a0, r0), (a1, r1), (am0, rm0), (bad, rm1), q)
        with pytest.raises(ValueError, match=r"noise must have the rows \[view 0; view 1\] shape"):
            NACMQLoss(P)((a0, r0), (a1, r1), (am0, rm0), (am1, rm1), q, noise=torch.ones(K, D))
        assert int(q.ptr) == 0 and not q.codes.any()
        torch.manual_seed(0)
        model = _Tiny()
        mq = NACMQ(model, queue_size=4 * K, momentum=0.5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # online != momentum: an EMA would show
        before = [p.clone() for p in mq.momentum_model.parameters()]
        v = torch.randn(K, 6)
        with pytest.raises(ValueError, match="noise must have"):
            mq(v, v, noise=torch.ones(K, D))
        with pytest.raises(RuntimeError):  # the model refuses 7 features
            mq(torch.randn(K, 7), torch.randn(K, 7))
        # refused by the criterion, after the online forward: still before the EMA update
        small = NACMQ(model, queue_size=K)  # room for one view's keys, not both
        small.momentum_model.load_state_dict(mq.momentum_model.state_dict())
        with pytest.raises(ValueError, match="cannot enqueue"):
            small(v, v)
        _assert_same(before, list(small.momentum_model.parameters()), "momentum model")
        nan = v.clone()
        nan[0, 0] = float("nan")
        with pytest.raises(ValueError, match=r"out0\[0\] contains NaN"):
            mq(nan, nan)
        mq.criterion.p = 0.7  # set between steps
        with pytest.raises(ValueError, match="p must lie"):
            mq(v, v)
        mq.criterion.p = P
        assert int(mq.queue.ptr) == 0
        _assert_same(before, list(mq.momentum_model.parameters()), "momentum model")
        for kw, err, msg in [(dict(p=0.7), ValueError, "p must lie"),
                             (dict(reduction="avg"), ValueError, "reduction must be")]:
            with pytest.raises(err, match=msg):
                NACMQ(model, queue_size=8, **kw)


# ==== the API used as a library ===================================================================

CPU_BACKENDS = nac_fast.available_backends("cpu")
ENQUEUE = ["reference"] + (["triton"] if "triton" in fused_backends("cpu") else [])


# ---- noise that requires grad: one answer on every backend -------------------------------------

def _views8(K=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(K, D, generator=g, dtype=torch.float64) for _ in range(8)]


class TestLibraryUse:
    """The loss API used as a library user would (audit of 2026-11-29): what was found broken."""

    # ---- CodeQueue.enqueue: keys that cannot hold codes ------------------------------------------

    @pytest.mark.parametrize("backend", ENQUEUE)
    @pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.uint8])
    def test_enqueue_refuses_keys_that_cannot_hold_codes(self, backend, dtype):
        """CodeQueue.enqueue took keys of dtypes that cannot hold codes in [-1, 1] and converted
        them silently: complex keys lost their imaginary part, bool keys became 0/1 codes (the
        package's bool codes mean False = -1, ops/codes.py), unsigned ones held 255 for a -1 cast
        to uint8."""
        q = nac_fast.CodeQueue(6, 3)
        q.enqueue(torch.full((2, 3), -0.5))
        before, ptr = q.codes.clone(), int(q.ptr)
        keys = torch.ones(2, 3).to(dtype)
        with pytest.raises(TypeError, match=f"keys must .*got {dtype}"):
            q.enqueue(keys, backend=backend)
        assert torch.equal(q.codes, before) and int(q.ptr) == ptr

    def test_enqueue_still_takes_signed_integer_and_floating_keys(self):
        q = nac_fast.CodeQueue(6, 3, dtype=torch.float64)
        q.enqueue(torch.tensor([[1, -1, 1]], dtype=torch.int8))
        q.enqueue(torch.tensor([[0.25, -0.5, 1.0]], dtype=torch.float16))
        assert q.codes[:2].tolist() == [[1.0, -1.0, 1.0], [0.25, -0.5, 1.0]] and int(q.ptr) == 2

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    def test_noise_that_requires_grad_is_refused(self, backend):
        """An explicit `noise` that requires grad made the backends disagree: the reference
        differentiated through it (the loss required grad, noise.grad was filled), the fused
        backends ignored it (noise.grad None; with nothing else requiring grad, the loss had no
        grad_fn)."""
        v = _views8()
        a, r = torch.cat(v[:2]), torch.cat(v[2:4])
        noise = nac_fast.draw_noise(a.shape, 0.2, dtype=a.dtype).requires_grad_()
        queue = torch.tanh(v[4])
        calls = [
            lambda: nac_fast.nac_loss(a, r, 0.2, noise=noise, backend=backend),
            lambda: nac_fast.nac_mq_loss(a, r, queue, 0.2, noise=noise, backend=backend),
            lambda: nac_fast.nac_vi_loss(a, r, 0.2, noise=noise),
            lambda: nac_fast.NACLoss(0.2, backend=backend)((v[0], v[1]), (v[2], v[3]), noise=noise),
        ]
        for call in calls:
            with pytest.raises(ValueError, match="noise must not require grad"):
                call()
        q = nac_fast.CodeQueue(8, 4, dtype=torch.float64)
        with pytest.raises(ValueError, match="noise must not require grad"):
            nac_fast.NACMQLoss(0.2, backend=backend)((v[0], v[1]), (v[2], v[3]), (v[4], v[5]),
                                                     (v[6], v[7]), q, noise=noise)
        assert int(q.ptr) == 0  # refused before the enqueue
        # detached, the same noise gives the same loss on every backend (float64)
        want = nac_fast.nac_loss(a, r, 0.2, noise=noise.detach(), backend="reference")
        got = nac_fast.nac_loss(a, r, 0.2, noise=noise.detach(), backend=backend)
        assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))

    # ---- the dispatcher's public helpers name bad arguments --------------------------------------

    def test_available_backends_names_a_bad_device(self):
        """available_backends("gpu") raised torch's RuntimeError, not a ValueError naming the
        argument."""
        with pytest.raises(ValueError, match="device"):
            nac_fast.available_backends("gpu")
        with pytest.raises(ValueError, match="device"):
            nac_fast.available_backends("gpu", reasons=True)
        assert nac_fast.available_backends("cpu:0") == nac_fast.available_backends("cpu")

    def test_explain_auto_names_a_non_tensor(self):
        """explain_auto([1]) raised an AttributeError, not a TypeError naming the argument."""
        with pytest.raises(TypeError, match="t must be a torch.Tensor"):
            dispatch.explain_auto([[1.0]])
        with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
            dispatch.explain_auto(torch.ones(2, 3), keys=[[1.0]])
        assert "backend='auto' runs" in dispatch.explain_auto(torch.ones(2, 3), keys=None)

    # ---- repr ------------------------------------------------------------------------------------

    def test_mq_criterion_repr_quotes_l2_auto(self):
        """NACMQLoss's repr wrote l2=auto unquoted, beside reduction='mean'."""
        assert "l2='auto'," in repr(nac_fast.NACMQLoss(0.2, l2="auto"))
        assert "l2=0.1," in repr(nac_fast.NACMQLoss(0.2, l2=0.1))

    # ---- CodeQueue.load_state_dict(assign=True): the pointer stays int64 -------------------------

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
    def test_an_assigned_narrow_pointer_is_loaded_as_int64(self, dtype):
        """assign=True (loading into a queue built on the meta device) took the checkpoint's pointer
        tensor as it was: a uint8 pointer of a 300-row queue wrapped at 256 (the next keys went to
        row 4, not row 260), an int16 one at 32768 (the paper's queue has 65536 rows)."""
        for device in ("cpu", "meta"):
            q = nac_fast.CodeQueue(300, 2, device=device)
            sd = {"codes": torch.zeros(300, 2), "ptr": torch.tensor(250, dtype=dtype)}
            q.load_state_dict(sd, assign=True)
            assert q.ptr.dtype == torch.int64 and q.ptr.device.type == "cpu"
            assert sd["ptr"].dtype == dtype  # the caller's state dict is left as it was
        q.enqueue(torch.ones(10, 2))
        q.enqueue(torch.full((1, 2), 0.5))
        assert int(q.ptr) == 261 and q.codes[260].tolist() == [0.5, 0.5]
        assert q.codes[4].tolist() == [0.0, 0.0]

    # ---- a second derivative through a fused backend: raises on every path ----------------------

    @pytest.mark.parametrize("kind", ["inbatch", "queue"])
    @pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "reference"])
    def test_a_gradient_penalty_through_a_fused_backend_raises(self, backend, kind):
        """Found: a gradient penalty through a fused backend was silently wrong: the node that
        raises on a second derivative took only the gradients' detached aliases, so autograd.grad
        of the weights that made the codes (or of the codes themselves) never reached it.

        A = x W; the penalty |d loss / dA|^2, differentiated by W (or A) with autograd.grad: the
        fused backward has no derivative, so this must raise, as it does for .backward() of the
        whole graph, not return the direct term alone (W) or None (A).  The first derivative with
        create_graph=True stays the plain one, bit for bit."""
        g = torch.Generator().manual_seed(1)
        n, D = 4, 5
        x = torch.randn(n, D, generator=g, dtype=torch.float64)
        r = torch.randn(n, D, generator=g, dtype=torch.float64)
        noise = nac_fast.draw_noise((n, D), 0.2, dtype=torch.float64, generator=g)
        keys = torch.randn(7, D, generator=g, dtype=torch.float64).tanh()
        kw = dict(noise=noise, backend=backend)

        def loss_of(a):
            if kind == "inbatch":
                return nac_fast.nac_loss(a, r, 0.2, **kw)
            return nac_fast.nac_mq_loss(a, r, keys, 0.2, **kw)

        A = x.clone().requires_grad_()
        W = torch.eye(D, dtype=torch.float64, requires_grad=True)
        ga, = torch.autograd.grad(loss_of(A @ W), A, create_graph=True)
        A2 = x.clone().requires_grad_()
        plain, = torch.autograd.grad(loss_of(A2 @ torch.eye(D, dtype=torch.float64)), A2)
        assert torch.equal(ga.detach(), plain)
        with pytest.raises(RuntimeError, match="once differentiable"):
            torch.autograd.grad(ga.pow(2).sum(), W, retain_graph=True)
        with pytest.raises(RuntimeError, match="once differentiable"):
            torch.autograd.grad(ga.pow(2).sum(), A, allow_unused=True, retain_graph=True)
        ref, = torch.autograd.grad(  # the reference: a right second derivative, as documented
            torch.autograd.grad(nac_fast.nac_loss(A @ W, r, 0.2, noise=noise, backend="reference")
                                if kind == "inbatch" else
                                nac_fast.nac_mq_loss(A @ W, r, keys, 0.2, noise=noise,
                                                     backend="reference"),
                                A, create_graph=True)[0].pow(2).sum(), W)
        assert torch.isfinite(ref).all() and ref.abs().sum() > 0

    @pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "reference"])
    def test_a_gradient_penalty_through_the_mq_criterion_raises_or_is_right(self, backend):
        """NACMQLoss (its inference term [M:vi] inside the fused loss on the Triton backend): a
        penalty on d loss / d a differentiated by the weights W that made a raises; one on
        d loss / d r by the weights V that made r raises or equals the reference backend's."""
        g = torch.Generator().manual_seed(2)
        n, D = 3, 4
        x = torch.randn(2 * n, D, generator=g, dtype=torch.float64)
        y = torch.randn(2 * n, D, generator=g, dtype=torch.float64)
        am = torch.randn(2 * n, D, generator=g, dtype=torch.float64)
        rm = torch.randn(2 * n, D, generator=g, dtype=torch.float64)
        noise = nac_fast.draw_noise((2 * n, D), 0.2, dtype=torch.float64, generator=g)

        def penalties(be):
            queue = nac_fast.CodeQueue(4 * n, D, dtype=torch.float64)
            queue.enqueue(torch.randn(2 * n, D, generator=torch.Generator().manual_seed(3),
                                      dtype=torch.float64).tanh())
            A, R = x.clone().requires_grad_(), y.clone().requires_grad_()
            W = torch.eye(D, dtype=torch.float64, requires_grad=True)
            V = torch.eye(D, dtype=torch.float64, requires_grad=True)
            a, r = A @ W, R @ V
            crit = nac_fast.NACMQLoss(p=0.2, backend=be)
            loss = crit((a[:n], r[:n]), (a[n:], r[n:]), (am[:n], rm[:n]), (am[n:], rm[n:]), queue,
                        noise=noise)
            ga, gr = torch.autograd.grad(loss, (A, R), create_graph=True)
            return ga, gr, W, V

        ga, gr, W, V = penalties(backend)
        with pytest.raises(RuntimeError, match="once differentiable"):
            torch.autograd.grad(ga.pow(2).sum(), W, retain_graph=True)
        _, gr_ref, _, V_ref = penalties("reference")
        want, = torch.autograd.grad(gr_ref.pow(2).sum(), V_ref)
        try:
            got, = torch.autograd.grad(gr.pow(2).sum(), V)
        except RuntimeError as exc:
            assert "once differentiable" in str(exc)
        else:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    # ---- numpy scalars for p, l2 and the EMA decay -----------------------------------------------

    def test_numpy_float32_settings_are_taken_as_their_value(self):
        """Bug: p=np.float32(0.1) (or l2, decay) was a TypeError, while np.float64 (a float
        subclass) was accepted.  They are the same number, so the same loss; numpy bools stay
        refused."""
        import numpy as np
        g = torch.Generator().manual_seed(4)
        a, r = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
        noise = nac_fast.draw_noise((4, 5), 0.25, generator=g)
        queue = torch.randn(8, 5, generator=g).tanh()
        p32, l232 = np.float32(0.25), np.float32(0.125)   # exact in float32: the same values
        for be in CPU_BACKENDS:
            assert torch.equal(nac_fast.nac_loss(a, r, p32, noise=noise, backend=be),
                               nac_fast.nac_loss(a, r, 0.25, noise=noise, backend=be))
            assert torch.equal(
                nac_fast.nac_mq_loss(a, r, queue, p32, l2=l232, noise=noise, backend=be),
                nac_fast.nac_mq_loss(a, r, queue, 0.25, l2=0.125, noise=noise, backend=be))
        assert nac_fast.NACLoss(p=p32).p == 0.25
        assert nac_fast.NACMQLoss(p=p32, l2=l232).l2 == 0.125
        m, o = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        from nac_fast.ops.momentum import ema_update_
        ema_update_(m, o, np.float32(0.5))
        with pytest.raises(TypeError, match="p must be a float"):
            nac_fast.nac_loss(a, r, np.bool_(True), noise=noise)


# ==== inputs, named errors, the value-check policy ================================================

def _ok(n=4, D=3, N=5):
    return torch.randn(n, D), torch.randn(n, D), torch.tanh(torch.randn(N, D))


class TestInputs:
    """Bad input is a ValueError/TypeError naming the argument: never a crash, never a silent
    result."""

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    @pytest.mark.parametrize("p,exc", [(0.0, ValueError), (0.5, ValueError), (-0.1, ValueError),
                                       (1.0, ValueError), (math.nan, ValueError),
                                       (math.inf, ValueError),
                                       ("0.1", TypeError), (True, TypeError), (None, TypeError),
                                       (torch.tensor([0.1, 0.2]), TypeError)])
    def test_bad_p(self, backend, p, exc):
        a, r, q = _ok()
        with pytest.raises(exc, match="p must"):
            nac_fast.nac_loss(a, r, p, backend=backend)
        with pytest.raises(exc, match="p must"):
            nac_fast.nac_mq_loss(a, r, q, p, backend=backend)

    def test_p_as_scalar_tensor_is_accepted(self):
        a, r, _ = _ok()
        noise = nac_fast.draw_noise(a.shape, 0.1)
        assert torch.equal(nac_fast.nac_loss(a, r, torch.tensor(0.1), noise=noise),
                           nac_fast.nac_loss(a, r, 0.1, noise=noise))

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    def test_shape_mismatches(self, backend):
        a, r, q = _ok()
        with pytest.raises(ValueError, match="r must have 4 rows"):
            nac_fast.nac_loss(a, r[:3], 0.1, backend=backend)
        with pytest.raises(ValueError, match="r must have D=3"):
            nac_fast.nac_loss(a, torch.randn(4, 2), 0.1, backend=backend)
        with pytest.raises(ValueError, match="queue must have D=3"):
            nac_fast.nac_mq_loss(a, r, torch.randn(5, 2), 0.1, backend=backend)
        with pytest.raises(ValueError, match="r_hat must have 4 rows"):
            nac_fast.nac_mq_loss(a, r[:2], q, 0.1, backend=backend)
        with pytest.raises(ValueError, match="keys must have D=3"):
            nac_fast.nac_loss(a, r, 0.1, keys=torch.randn(5, 4), backend=backend)
        with pytest.raises(ValueError, match="noise must have a's shape"):
            nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 2), backend=backend)

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    @pytest.mark.parametrize("bad", [torch.zeros(4, 3), torch.full((4, 3), 0.5),
                                     torch.full((4, 3), 2.0)])
    def test_noise_values_must_be_pm1(self, backend, bad):
        a, r, _ = _ok()
        with pytest.raises(ValueError, match="noise must contain only -1 and \\+1"):
            nac_fast.nac_loss(a, r, 0.1, noise=bad, backend=backend)

    def test_noise_type_errors(self):
        a, r, _ = _ok()
        with pytest.raises(TypeError, match="noise"):
            nac_fast.nac_loss(a, r, 0.1, noise=[[1.0] * 3] * 4)
        with pytest.raises(TypeError, match="noise"):
            nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 3, dtype=torch.bool))
        # integer +-1 noise is fine: the loss of the same float noise, flips included
        nac_fast.nac_loss(a, r, 0.1, noise=torch.ones(4, 3, dtype=torch.int8))
        m = nac_fast.draw_noise((4, 3), 0.3, generator=torch.Generator().manual_seed(2))
        assert (m == -1).any() and (m == 1).any()
        for dtype in (torch.int8, torch.int32, torch.int64):
            assert torch.equal(nac_fast.nac_loss(a, r, 0.1, noise=m.to(dtype)),
                               nac_fast.nac_loss(a, r, 0.1, noise=m)), dtype

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    def test_dtype_and_rank_errors(self, backend):
        a, r, q = _ok()
        with pytest.raises(TypeError, match="a must have a floating dtype"):
            nac_fast.nac_loss(a.long(), r, 0.1, backend=backend)
        with pytest.raises(TypeError, match="r must have a floating dtype"):
            nac_fast.nac_loss(a, r.int(), 0.1, backend=backend)
        with pytest.raises(TypeError, match="queue must have a floating dtype"):
            nac_fast.nac_mq_loss(a, r, q.long(), 0.1, backend=backend)
        with pytest.raises(TypeError, match="r must have a's dtype"):
            nac_fast.nac_loss(a, r.double(), 0.1, backend=backend)
        with pytest.raises(TypeError, match="a must be a torch.Tensor"):
            nac_fast.nac_loss(a.numpy(), r, 0.1, backend=backend)
        with pytest.raises(ValueError, match="a must be 2-D"):
            nac_fast.nac_loss(a[0], r[0], 0.1, backend=backend)
        with pytest.raises(ValueError, match="r must be 2-D"):
            nac_fast.nac_loss(a, r[None], 0.1, backend=backend)
        with pytest.raises(TypeError, match="queue must be a torch.Tensor"):
            nac_fast.nac_mq_loss(a, r, None, 0.1, backend=backend)

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    def test_empty_inputs(self, backend):
        a, r, q = _ok()
        with pytest.raises(ValueError, match="a must be non-empty"):
            nac_fast.nac_loss(a[:0], r[:0], 0.1, backend=backend)
        with pytest.raises(ValueError, match="queue must be non-empty"):
            nac_fast.nac_mq_loss(a, r, q[:0], 0.1, backend=backend)
        with pytest.raises(ValueError, match="a must be non-empty"):
            nac_fast.nac_loss(a[:, :0], r[:, :0], 0.1, backend=backend)

    def test_mixed_devices(self):
        a, r, q = _ok()
        with pytest.raises(ValueError, match="r is on meta but a is on cpu"):
            nac_fast.nac_loss(a, r.to("meta"), 0.1)
        with pytest.raises(ValueError, match="queue is on meta"):
            nac_fast.nac_mq_loss(a, r, q.to("meta"), 0.1)

    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    @pytest.mark.parametrize("which", ["a", "r", "keys"])
    @pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
    def test_non_finite_inputs(self, backend, which, value):
        a, r, q = _ok()
        t = {"a": a, "r": r, "keys": q}[which]
        t[1, 2] = value
        with pytest.raises(ValueError, match=f"{which} contains NaN or inf"):
            nac_fast.nac_loss(a, r, 0.1, keys=q, backend=backend)
        if which == "keys":
            with pytest.raises(ValueError, match="queue contains NaN or inf"):
                nac_fast.nac_mq_loss(a, r, q, 0.1, backend=backend)

    def test_reduction_backend_l2_queue_errors(self):
        a, r, q = _ok()
        with pytest.raises(ValueError, match="reduction must be one of"):
            nac_fast.nac_loss(a, r, 0.1, reduction="avg")
        with pytest.raises(ValueError, match="backend must be one of .* available here"):
            nac_fast.nac_loss(a, r, 0.1, backend="tpu")
        with pytest.raises(ValueError, match="backend 'cuda' is not available for cpu tensors"):
            nac_fast.nac_loss(a, r, 0.1, backend="cuda")
        with pytest.raises(ValueError, match="l2 must be a finite float >= 0"):
            nac_fast.nac_mq_loss(a, r, q, 0.1, l2=-1.0)
        with pytest.raises(ValueError, match="l2 must be"):
            nac_fast.nac_mq_loss(a, r, q, 0.1, l2=math.nan)
        with pytest.raises(ValueError, match="queue must not require grad"):
            nac_fast.nac_mq_loss(a, r, q.requires_grad_(), 0.1)
        with pytest.raises(TypeError, match="device must be"):
            nac_fast.available_backends(3)

    def test_direct_op_calls_are_checked(self):
        """torch.ops entry points check shapes too (a RuntimeError, not a crash)."""
        if "cpu" not in CPU_BACKENDS:
            pytest.skip("no compiled extension")
        a, r, _ = _ok()
        with pytest.raises(RuntimeError, match="noise must have a's shape"):
            torch.ops.nac_fast.nac_fwd(a, r, torch.ones(2, 2), None, 1.0, 0.0, False)
        with pytest.raises(RuntimeError, match="keys must be a non-empty"):
            torch.ops.nac_fast.nac_fwd(a, r, torch.ones(4, 3), torch.ones(0, 3), 1.0, 0.0, False)

    @pytest.mark.parametrize("op", ["compiled", "triton"])
    def test_direct_op_calls_check_self_offset(self, op):
        """The ops' self_offset (docs/math.md [M:self-key]): -1 or in [0, N - n] with N >= 2, else
        an error naming self_offset (the compiled ops: RuntimeError from csrc/nac_checks.h; the
        Triton ops: ValueError / TypeError), forward and backward alike, before any kernel runs;
        the edges of the range pass."""
        if op == "compiled" and "cpu" not in CPU_BACKENDS:
            pytest.skip("no compiled extension")
        if op == "triton" and "triton" not in CPU_BACKENDS:
            pytest.skip("no Triton backend here")

        def fwd(n, keys, off):
            a, r, noise = torch.randn(n, 3), torch.randn(n, 3), torch.ones(n, 3)
            if op == "compiled":
                return torch.ops.nac_fast.nac_fwd(a, r, noise, keys, 1.0, 0.0, True, off)
            from nac_fast.kernels import nac_triton
            return nac_triton.fwd(a, r, noise, keys, 1.0, 0.0, True, self_offset=off)

        def bwd(n, keys, off):
            a, r, noise = torch.randn(n, 3), torch.randn(n, 3), torch.ones(n, 3)
            lse, ga, g = torch.zeros(n), torch.zeros(n, 3), torch.ones(n)
            if op == "compiled":
                return torch.ops.nac_fast.nac_bwd(a, r, noise, keys, lse, ga, g, 1.0, True, True,
                                                  keys is not None, off)
            from nac_fast.kernels import nac_triton
            q = torch.zeros(n, 3)
            return nac_triton.bwd(a, r, noise, keys, lse, ga, g, q, q if keys is None else q[:0],
                                  1.0, True, True, keys is not None, self_offset=off)

        exc = RuntimeError if op == "compiled" else ValueError
        keys = torch.tanh(torch.randn(9, 3))
        for call in (fwd, bwd):
            with pytest.raises(exc, match=r"self_offset must be -1 \(every key\) or >= 0"):
                call(4, keys, -2)
            with pytest.raises(exc, match=r"self_offset must lie in \[0, N - n\] = \[0, 5\]"):
                call(4, keys, 6)
            with pytest.raises(exc, match=r"self_offset must lie in \[0, N - n\] = \[0, 0\]"):
                call(4, None, 1)  # without keys the rows' own codes are the keys: offset 0
            with pytest.raises(exc, match="self_offset >= 0 needs at least 2 keys"):
                call(1, None, 0)
            with pytest.raises(exc, match="self_offset >= 0 needs at least 2 keys"):
                call(1, keys[:1], 0)
            for n, k, off in ((4, keys, 5), (4, keys, 0), (4, keys, -1), (1, None, -1),
                              (1, keys[:2], 1), (4, None, 0)):
                call(n, k, off)  # the edges pass
        if op == "triton":
            with pytest.raises(TypeError, match="self_offset must be an int"):
                fwd(4, keys, 1.5)

    def test_vi_loss_checks_inputs(self):
        a, r, _ = _ok()
        with pytest.raises(ValueError, match="r must have 4 rows"):
            nac_fast.nac_vi_loss(a, r[:1], 0.1)
        with pytest.raises(ValueError, match="p must"):
            nac_fast.nac_vi_loss(a, r, 0.7)

    def test_draw_noise_and_channel_scale_check_p(self):
        with pytest.raises(ValueError, match="p must"):
            nac_fast.draw_noise((2, 2), 0.6)
        for bad in (0.0, 0.5, 0.7):
            with pytest.raises(ValueError, match="p must"):
                nac_fast.channel_scale(bad)
        assert nac_fast.channel_scale(0.1) == pytest.approx(0.5 * math.log(9.0))

    def test_works_without_compiled_extension_with_one_warning(self):
        """Without nac_fast._C the package imports, warns once (not per call) and runs 'auto' on the
        reference backend.  Run in a fresh interpreter where importing the extension fails."""
        import os
        import subprocess
        import sys
        code = (
            "import sys, warnings\n"
            "sys.modules['nac_fast._C'] = None  # makes 'from . import _C' raise ImportError\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import torch, nac_fast\n"
            "    a, r = torch.randn(6, 4, requires_grad=True), torch.randn(6, 4)\n"
            "    for _ in range(3):\n"
            "        nac_fast.nac_loss(a, r, 0.1).backward()\n"
            "    mine = [x for x in w if 'compiled extension not available' in str(x.message)]\n"
            "print(len(mine), nac_fast.available_backends('cpu'))\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "TRITON_INTERPRET": "0"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "1 ['reference']"

    # ---- value-check policy (nac_fast.ops.loss.CHECK_VALUES, NAC_FAST_CHECK_INPUTS) --------------

    @pytest.mark.parametrize("env,mode", [("", "auto"), ("auto", "auto"), (" AUTO ", "auto"),
                                          ("1", True), ("true", True), ("on", True),
                                          ("0", False), ("false", False), ("off", False)])
    def test_check_inputs_env_values(self, env, mode):
        got = nac_fast.ops.loss._parse_check_values(env)
        assert got == mode and type(got) is type(mode)

    def test_check_inputs_env_bad_value_names_the_variable(self):
        with pytest.raises(ValueError, match="NAC_FAST_CHECK_INPUTS must be 0, 1 or auto"):
            nac_fast.ops.loss._parse_check_values("2")

    def test_value_checks_policy_by_device(self):
        from nac_fast.ops.loss import value_checks, value_checks_on
        on = {}
        for mode in ("auto", True, False):
            with value_checks(mode):
                on[mode] = {dev: value_checks_on(torch.device(dev))
                            for dev in ("cpu", "cuda", "meta")}
        assert on["auto"] == {"cpu": True, "cuda": False, "meta": False}   # no host sync on a GPU
        assert on[True] == {"cpu": True, "cuda": True, "meta": False}
        assert on[False] == {"cpu": False, "cuda": False, "meta": False}
        assert nac_fast.ops.loss.CHECK_VALUES == "auto"                         # restored

    def test_check_values_off_skips_value_checks_but_not_metadata_checks(self):
        a, r, q = _ok()
        a[0, 0] = math.nan
        with nac_fast.ops.loss.value_checks(False):
            assert math.isnan(nac_fast.nac_loss(a, r, 0.1, keys=q).item())   # NaN reaches the loss
            nac_fast.nac_loss(a, r, 0.1, noise=torch.full((4, 3), 2.0))      # unchecked noise
            with pytest.raises(ValueError, match="r must have 4 rows"):
                nac_fast.nac_loss(a, r[:3], 0.1)
            with pytest.raises(TypeError, match="r must have a's dtype"):
                nac_fast.nac_loss(a, r.double(), 0.1)
        with pytest.raises(ValueError, match="a contains NaN or inf"):    # back to "auto": checked
            nac_fast.nac_loss(a, r, 0.1)

    def test_check_values_global_switch_and_bad_values(self, monkeypatch):
        a, r, _ = _ok()
        a[0, 0] = math.inf
        monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", False)   # the documented switch
        nac_fast.nac_loss(a, r, 0.1)
        monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", True)
        with pytest.raises(ValueError, match="a contains NaN or inf"):
            nac_fast.nac_loss(a, r, 0.1)
        monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", "yes")
        with pytest.raises(ValueError, match="CHECK_VALUES must be True, False or 'auto'"):
            nac_fast.nac_loss(a, r, 0.1)
        with pytest.raises(ValueError, match="mode must be True, False or 'auto'"):
            with nac_fast.ops.loss.value_checks(1):
                pass

    def test_step_value_checks_follow_the_policy(self, monkeypatch):
        from nac_fast.train.methods import step_value_checks
        for outer, inner in (("auto", False), (False, False), (True, True)):
            monkeypatch.setattr(nac_fast.ops.loss, "CHECK_VALUES", outer)
            with step_value_checks():
                assert nac_fast.ops.loss.CHECK_VALUES is inner
            assert nac_fast.ops.loss.CHECK_VALUES == outer


# ==== contracts ===================================================================================

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
DEVICE_BACKENDS = nac_fast.available_backends(DEVICE)
FUSED = fused_backends(DEVICE)
needs_triton = pytest.mark.skipif("triton" not in FUSED,
                                  reason="the Triton kernels do not run here")


def _contract_inputs(n=6, D=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, D, generator=g, dtype=dtype)
    r = torch.randn(n, D, generator=g, dtype=dtype)
    m = nac_fast.draw_noise((n, D), 0.2, dtype=dtype, generator=g)
    return a.to(DEVICE), r.to(DEVICE), m.to(DEVICE)


# ---- NACMQLoss: a refused call leaves the queue as it was -----------------------------------

def _contract_views(K=4, D=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(K, D, generator=g).to(DEVICE) for _ in range(8)]


def _refused(crit, queue, v, exc, match, **kw):
    codes, ptr = queue.codes.clone(), queue.ptr.clone()
    with pytest.raises(exc, match=match):
        crit((v[0], v[1]), (v[2], v[3]), (v[4], v[5]), (v[6], v[7]), queue, **kw)
    assert torch.equal(queue.codes, codes) and torch.equal(queue.ptr, ptr), "the queue changed"


class TestContracts:
    """Contracts of the loss API that an audit found broken (2026-11-28): a second derivative
    through a fused backend raises instead of being silently zero; a refused NACMQLoss call leaves
    the queue as it was, whatever the reason; noise and draw_noise refuse dtypes that cannot hold
    -1; the Triton fp64 keys' gradient is fp64-accurate; a checkpoint's queue pointer is checked;
    gradient accumulation over two NACMQLoss calls works on every backend, and the Triton enqueue
    tells autograd that it wrote the codes; backend="auto" on CUDA tensors wider than a fused kernel
    takes. The GPU suite runs this class with NAC_FAST_TEST_DEVICE=cuda (the fused GPU backends)."""

    # ---- a second derivative -------------------------------------------------------------------

    @pytest.mark.parametrize("backend", FUSED)
    def test_second_derivative_through_a_fused_backend_raises(self, backend):
        a0, r, m = _contract_inputs()
        a = a0.clone().requires_grad_()
        loss = nac_fast.nac_loss(a, r, 0.2, noise=m, backend=backend)
        ga, = torch.autograd.grad(loss, a, create_graph=True)  # the first derivative: right
        a2 = a0.clone().requires_grad_()
        ref, = torch.autograd.grad(nac_fast.nac_loss(a2, r, 0.2, noise=m, backend=backend), a2)
        torch.testing.assert_close(ga.detach(), ref, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="once differentiable.*backend='reference'"):
            (loss + ga.pow(2).sum()).backward()

    def test_second_derivative_through_the_reference_is_right(self):
        a0, r, m = _contract_inputs(n=4, D=3)
        a = a0.clone().requires_grad_()
        assert torch.autograd.gradgradcheck(
            lambda x: nac_fast.nac_loss(x, r, 0.2, noise=m, backend="reference"), (a,))

    @pytest.mark.parametrize("backend", DEVICE_BACKENDS)
    def test_a_refused_mq_call_leaves_the_queue(self, backend):
        K, D = 4, 3
        v = _contract_views(K, D)
        q = nac_fast.CodeQueue(4 * K, D, device=DEVICE)
        crit = nac_fast.NACMQLoss(0.1, backend=backend)
        crit((v[0], v[1]), (v[2], v[3]), (v[4], v[5]), (v[6], v[7]), q)  # not empty, ptr not 0
        with nac_fast.ops.loss.value_checks(True):  # (on a GPU the data-reading checks are opt-in)
            _refused(crit, q, v, ValueError, "noise must contain only",
                     noise=torch.zeros(2 * K, D, device=DEVICE))
        _refused(crit, q, v, ValueError, "noise is on meta",
                 noise=torch.ones(2 * K, D, device="meta"))
        _refused(crit, q, v, TypeError, "noise must hold",
                 noise=torch.ones(2 * K, D, dtype=torch.uint8, device=DEVICE))
        for attr, bad, exc, match in (("p", 0.7, ValueError, "p must"),
                                      ("reduction", "avg", ValueError, "reduction"),
                                      ("l2", -1.0, ValueError, "l2"),
                                      ("backend", "fastest", ValueError, "backend")):
            crit2 = nac_fast.NACMQLoss(0.1, backend=backend)
            setattr(crit2, attr, bad)  # set between steps, as the trainer sets p
            _refused(crit2, q, v, exc, match)

    def test_an_unavailable_backend_or_a_tiny_multilinear_p_leaves_the_queue(self):
        K, D = 4, 3
        v = _contract_views(K, D)
        q = nac_fast.CodeQueue(4 * K, D, device=DEVICE)
        nac_fast.CodeQueue.enqueue(q, torch.ones(3, D, device=DEVICE))
        if "cuda" not in DEVICE_BACKENDS:
            _refused(nac_fast.NACMQLoss(0.1, backend="cuda"), q, v, ValueError, "not available")
        _refused(nac_fast.NACMQLoss(1e-4, likelihood="multilinear", backend="reference"), q, v,
                 ValueError, "multilinear")

    # ---- noise dtypes ----------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
    def test_unsigned_noise_is_refused(self, dtype):
        a, r, m = _contract_inputs(dtype=torch.float32)
        # uint8's 255 compares equal to -1 in torch: it passed the +-1 check and gave a wrong loss
        bad = torch.where(m > 0, 1, 255).to(torch.uint8).to(dtype) if dtype == torch.uint8 else \
            torch.ones(a.shape, dtype=dtype)
        with pytest.raises(TypeError, match="noise must hold \\+-1 as a signed"):
            nac_fast.nac_loss(a, r, 0.2, noise=bad)

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.complex64, torch.uint16])
    def test_draw_noise_refuses_dtypes_without_minus_one(self, dtype):
        with pytest.raises(TypeError, match="dtype must be a signed real dtype"):
            nac_fast.draw_noise((2, 3), 0.2, dtype=dtype)

    def test_draw_noise_in_signed_dtypes_is_the_same_noise(self):
        m = nac_fast.draw_noise((64, 8), 0.3, generator=torch.Generator().manual_seed(4))
        for dtype in (torch.int8, torch.int32, torch.float64, torch.bfloat16):
            got = nac_fast.draw_noise((64, 8), 0.3, dtype=dtype,
                                      generator=torch.Generator().manual_seed(4))
            assert got.dtype == dtype and torch.equal(got.to(torch.float32), m), dtype

    # ---- Triton fp64 ---------------------------------------------------------------------------

    @needs_triton
    @pytest.mark.parametrize("n,N,D", [(1, 3, 1), (97, 33, 16), (40, 130, 7)])
    def test_triton_fp64_keys_gradient_is_fp64_accurate(self, n, N, D):
        """The keys' backward multiplied by ln 2 rounded to fp32 (relative error 2.7e-9 on every
        element of d/dkeys, 6e-10 on the in-batch d/da); fp64 is the correctness path."""
        g = torch.Generator().manual_seed(n + N + D)
        a0 = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE)
        r = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE)
        keys = torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64)).to(DEVICE)
        m = nac_fast.draw_noise((n, D), 0.1, dtype=torch.float64, generator=g).to(DEVICE)
        for given in (True, False):
            out = {}
            for b in ("reference", "triton"):
                a = a0.clone().requires_grad_()
                k = keys.clone().requires_grad_()
                nac_fast.nac_loss(a, r, 0.1, keys=k if given else None, noise=m, backend=b,
                                  reduction="sum").backward()
                out[b] = k.grad if given else a.grad
            err = (out["triton"] - out["reference"]).norm() / out["reference"].norm()
            assert err < 1e-13, (given, float(err))

    # ---- the queue's pointer in a checkpoint -----------------------------------------------------

    @pytest.mark.parametrize("ptr,exc", [(torch.tensor(-1), ValueError),
                                         (torch.tensor(5), ValueError),
                                         (torch.tensor(1.5), TypeError),
                                         (torch.tensor(True), TypeError),
                                         (torch.tensor([1, 2]), TypeError)])
    def test_a_checkpoint_pointer_outside_the_queue_is_refused(self, ptr, exc):
        q = nac_fast.CodeQueue(5, 3)
        with pytest.raises(exc, match="queue pointer"):
            q.load_state_dict({"codes": torch.zeros(5, 3), "ptr": ptr})
        assert int(q.ptr) == 0

    def test_a_checkpoint_pointer_inside_the_queue_loads(self):
        q = nac_fast.CodeQueue(5, 3)
        q.load_state_dict({"codes": torch.ones(5, 3), "ptr": torch.tensor(4)})
        assert int(q.ptr) == 4 and bool((q.codes == 1).all())

    # ---- gradient accumulation over two NACMQLoss calls ------------------------------------------

    @pytest.mark.parametrize("backend", DEVICE_BACKENDS)
    @pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
    def test_two_mq_calls_before_one_backward(self, backend, qdtype):
        """Two micro-batches' losses, one backward: the sum of each call's own gradient.  The
        queue's codes, when stored in the loss dtype, were the live buffer the next call writes in
        place."""
        K, D = 4, 3
        g = torch.Generator().manual_seed(7)
        online = [torch.randn(K, D, generator=g).to(DEVICE) for _ in range(4)]
        moms = [[torch.randn(K, D, generator=g).to(DEVICE) for _ in range(4)] for _ in range(2)]
        noises = [nac_fast.draw_noise((2 * K, D), 0.1, generator=g).to(DEVICE) for _ in range(2)]

        def run(together):
            q = nac_fast.CodeQueue(8 * K, D, dtype=qdtype, device=DEVICE)
            crit = nac_fast.NACMQLoss(0.1, backend=backend)
            leaves = [t.clone().requires_grad_() for t in online]
            grads, total = [torch.zeros_like(t) for t in leaves], 0
            for mom, noise in zip(moms, noises):
                loss = crit((leaves[0], leaves[1]), (leaves[2], leaves[3]), (mom[0], mom[1]),
                            (mom[2], mom[3]), q, noise=noise)
                if together:
                    total = total + loss
                else:
                    for acc, gr in zip(grads, torch.autograd.grad(loss, leaves)):
                        acc += gr
            if together:
                total.backward()
                grads = [t.grad for t in leaves]
            return grads

        for x, y in zip(run(True), run(False)):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)

    @needs_triton
    def test_the_triton_enqueue_bumps_the_codes_version(self):
        q = nac_fast.CodeQueue(8, 3, device=DEVICE)
        before = (q.codes._version, q.ptr._version)
        q.enqueue(torch.ones(2, 3, device=DEVICE), backend="triton")
        assert q.codes._version > before[0] and q.ptr._version > before[1]
        assert int(q.ptr) == 2 and bool((q.codes[:2] == 1).all())

    # ---- backend="auto" on CUDA tensors wider than a fused kernel takes --------------------------

    def test_fused_max_d_is_the_kernels_limit(self):
        import re
        from nac_fast.ops import dispatch
        root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
        with open(f"{root}/kernels/nac_triton.py") as f:
            assert int(re.search(r"^MAX_D = (\d+)", f.read(), re.M).group(1)) == \
                dispatch.FUSED_MAX_D["triton"]
        with open(f"{root}/csrc/nac_cuda.cu") as f:
            assert int(re.search(r"a\.size\(1\) <= (\d+)", f.read()).group(1)) == \
                dispatch.FUSED_MAX_D["cuda"]

    @pytest.mark.parametrize("D,avail,want", [(128, ("reference", "triton", "cuda"), "triton"),
                                              (512, ("reference", "triton", "cuda"), "triton"),
                                              (513, ("reference", "triton", "cuda"), "reference"),
                                              (256, ("reference", "cuda"), "cuda"),
                                              (300, ("reference", "cuda"), "reference")])
    def test_auto_on_cuda_skips_a_fused_backend_too_narrow_for_d(self, D, avail, want):
        """Wider codes than the Triton kernels take (D > 512) raised "use backend='reference' or
        'cpu'" on CUDA tensors, where 'cpu' cannot run and auto could have run the reference."""
        from nac_fast.ops import dispatch
        t = torch.empty(4, D, device="meta")
        t = type("Cuda", (), {"device": torch.device("cuda"), "dim": t.dim, "shape": t.shape,
                              "dtype": t.dtype})()
        b, why = dispatch._auto(t, "nac", dispatch._UNSET, avail)
        assert b == want, why
        if want == "reference":
            assert f"D = {D}" in why

    @pytest.mark.skipif(DEVICE != "cuda", reason="CUDA tensors (the GPU suite's test stage)")
    def test_auto_runs_wide_codes_on_cuda(self):
        """D = 640 (over every fused GPU kernel's limit): auto runs the reference, which is
        right."""
        a, r, m = _contract_inputs(n=9, D=640, dtype=torch.float32)
        a.requires_grad_()
        from nac_fast.ops import dispatch
        assert dispatch.resolve_backend("auto", a) == "reference"
        loss = nac_fast.nac_loss(a, r, 0.2, noise=m)
        ref = nac_fast.nac_loss(a, r, 0.2, noise=m, backend="reference")
        torch.testing.assert_close(loss, ref, rtol=0, atol=0)
        loss.backward()
        assert torch.isfinite(a.grad).all()


# ==== the device guard ============================================================================

class Recorder:
    def __init__(self):
        self.open = []      # device indices of the guards entered and not yet left
        self.launches = []  # (kernel name, the innermost open guard's index or None)

    def device(self, device):
        rec = self

        class Guard:
            def __enter__(self):
                rec.open.append(torch.device(device).index)

            def __exit__(self, *exc):
                rec.open.pop()
                return False
        return Guard()

    def wrap_triton(self, kernel):
        rec = self

        class Launcher:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    rec.launches.append((kernel.__name__, rec.open[-1] if rec.open else None))
                return call
        return Launcher()


def _fake_devices(count: int) -> None:
    """Fake cuda:k tensors need no GPU where CUDA is absent (CI); where it is present the runtime
    checks each device index, so a machine with fewer GPUs than the test's indices skips (the
    logic is what CI checks; a multi-GPU machine runs it for real)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < count:
        pytest.skip(f"fake cuda:{count - 1} tensors need {count} GPUs on a machine with CUDA; this "
                    f"one has {torch.cuda.device_count()} (CI checks it without CUDA)")


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "device", rec.device)
    monkeypatch.setattr(torch.library, "wrap_triton", rec.wrap_triton)
    # the GPU's figures (no GPU here): sm_90, one block per SM
    monkeypatch.setattr(launch, "_cuda_target", lambda index: launch.SM90)
    return rec


def _ops(dev):
    """(name, thunk) of every Triton op's body on `dev` tensors."""
    n, N, D = 70, 300, 32
    a, r, noise = (torch.empty(n, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    keys = torch.empty(N, D, device=dev, dtype=torch.bfloat16)
    lse, g = torch.empty(n, device=dev), torch.empty(n, device=dev)
    ga = torch.empty(n, D, device=dev)

    def fwd(keys):
        return nac_triton.fwd(a, r, noise, keys, 1.1, 0.1, True)

    def bwd(keys):
        q, k = fwd(keys)[3:5]
        return nac_triton.bwd(a, r, noise, keys, lse, ga, g, q, k, 1.1, True, True,
                              keys is not None)
    qw = torch.empty(40, 2, device=dev, dtype=torch.int64)
    gw = torch.empty(90, 2, device=dev, dtype=torch.int64)
    ql = torch.empty(40, device=dev, dtype=torch.int64)
    gl = torch.empty(90, device=dev, dtype=torch.int64)
    seed = torch.empty(1, device=dev, dtype=torch.int64)
    return [("loss fwd, in-batch", lambda: fwd(None)), ("loss fwd, keys", lambda: fwd(keys)),
            ("loss bwd, in-batch", lambda: bwd(None)), ("loss bwd, keys", lambda: bwd(keys)),
            ("noise", lambda: nac_noise_triton.noise(a, seed, 0.1)),
            ("hamming cdist", lambda: hamming_triton.cdist(qw, gw)),
            ("hamming ap", lambda: hamming_triton.average_precision(qw, gw, ql, gl, 100))]


class TestDeviceGuard:
    """Every Triton launch runs under its tensors' device (issue 23, item 2).

    A process holding tensors on cuda:1 while the current device is cuda:0 must launch on cuda:1:
    kernels/launch.py's `run` enters `device_guard(device)` = torch.cuda.device(device) around every
    plan.  Checked here with no GPU: the ops' bodies run on fake cuda:1 tensors (FakeTensorMode
    makes them without a device), torch.cuda.device is replaced by a recorder, and the kernel launch
    itself (torch.library.wrap_triton) by one that notes which device context is open when it is
    called."""
    pytestmark = pytest.mark.skipif(nac_triton is None, reason="triton is not installed")

    @pytest.mark.parametrize("index", [1, 3])
    def test_every_op_launches_under_its_tensors_device(self, recorder, index):
        _fake_devices(index + 1)
        with FakeTensorMode(allow_non_fake_inputs=True):
            ops = _ops(torch.device("cuda", index))
            for name, op in ops:
                recorder.launches.clear()
                op()
                assert recorder.launches, f"{name}: no launch recorded"
                outside = [k for k, dev in recorder.launches if dev != index]
                assert not outside, f"{name}: {outside} launched outside torch.cuda.device({index})"
                assert not recorder.open, f"{name}: a device guard was left open"

    def test_cpu_tensors_enter_no_cuda_device(self, recorder):
        """The interpreter's CPU tensors: no torch.cuda call at all (there may be no CUDA)."""
        assert isinstance(launch.device_guard(torch.device("cpu")), contextlib.nullcontext)

    def test_a_plan_on_two_devices_is_refused(self):
        _fake_devices(2)
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(4, device="cuda:0")
            y = torch.empty(4, device="cuda:1")
            L = launch.Launch(None, (1,), (x, y), {}, 4, 1)
            with pytest.raises(ValueError, match="one device"):
                launch.launch_device([L])


# ==== backend="auto" ==============================================================================

def _t(dtype, grad=True, rows=8):
    return torch.randn(rows, 16, dtype=dtype).requires_grad_(grad)


class TestAuto:
    """backend="auto" never picks the slower CPU path (issue 23, item 6).

    The fused CPU kernel widens bf16 to fp32; with the keys' gradient (the in-batch loss, or keys
    requiring a gradient) it runs 4 fp32 GEMMs where the eager reference runs 3 bf16 ones on the
    CPU's AVX512-BF16 units, and was 1.10-1.97x slower (bench/results/loss_cpu.csv).  There "auto"
    picks the reference, and says why (dispatch.explain_auto); everywhere else the fused kernel."""
    pytestmark = pytest.mark.skipif("cpu" not in nac_fast.available_backends("cpu"),
                                    reason="the compiled CPU kernel is not built")

    def test_bf16_with_keys_gradient_runs_the_reference(self):
        a = _t(torch.bfloat16)
        assert dispatch.resolve_backend("auto", a, keys=None) == "reference"
        assert dispatch.resolve_backend("auto", a, keys=_t(torch.bfloat16, rows=32)) == "reference"
        assert "reference" in dispatch.explain_auto(a, keys=None)
        assert "bf16" in dispatch.explain_auto(a, keys=None)

    @pytest.mark.parametrize("case", ["fp32", "fp16", "queue", "no_grad", "a_without_grad",
                                      "keys_unsaid"])
    def test_everything_else_runs_the_fused_kernel(self, case):
        a = _t(torch.float32 if case == "fp32" else torch.float16 if case == "fp16"
               else torch.bfloat16, grad=case != "a_without_grad")
        kw = dict(keys=None)
        if case == "queue":   # NAC-MQ: the queue takes no gradient
            kw = dict(keys=_t(torch.bfloat16, grad=False, rows=64))
        if case == "keys_unsaid":
            kw = {}
        if case == "no_grad":
            with torch.no_grad():
                assert dispatch.resolve_backend("auto", a, **kw) == "cpu"
            return
        assert dispatch.resolve_backend("auto", a, **kw) == "cpu"
        assert "'cpu'" in dispatch.explain_auto(a, **kw)

    def test_explicit_backends_are_kept(self):
        a = _t(torch.bfloat16)
        assert dispatch.resolve_backend("cpu", a, keys=None) == "cpu"


# ==== torch.func transforms =======================================================================

FT_P = 0.1


def _ft_inputs(n=6, D=16, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, n, D, generator=g, dtype=torch.float64) * 1.5
    r = torch.randn(B, n, D, generator=g, dtype=torch.float64)
    noise = torch.where(torch.rand(n, D, generator=g) < FT_P, -1.0, 1.0).double()
    return a, r, noise


def _fused_or_reference() -> str:
    return "cpu" if "cpu" in nac_fast.available_backends("cpu") else "reference"


class TestFuncTransforms:
    """The losses under torch.func transforms (grad, vmap, jacrev): backend="auto" runs the
    reference there (the compiled kernels read data pointers and have no functorch rules), an
    explicit compiled backend is refused naming `backend`, and the data-reading input checks stay
    out of vmap's way. Before: grad with "auto" raised torch's "must override the setup_context
    staticmethod", and vmap failed even with the reference, in the NaN check's bool()."""

    def test_grad_with_auto_equals_the_backends_autograd_gradient(self):
        a, r, noise = _ft_inputs()
        be = _fused_or_reference()
        got = torch.func.grad(lambda x: nac_fast.nac_loss(x, r[0], FT_P, noise=noise))(a[0])
        x = a[0].clone().requires_grad_()
        nac_fast.nac_loss(x, r[0], FT_P, noise=noise, backend=be).backward()
        torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-13)

    def test_vmap_of_grad_gives_per_sample_gradients(self):
        a, r, noise = _ft_inputs()

        def loss(x, y):
            return nac_fast.nac_loss(x, y, FT_P, noise=noise)
        got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(a, r)
        for i in range(a.shape[0]):
            x, y = a[i].clone().requires_grad_(), r[i].clone().requires_grad_()
            loss(x, y).backward()
            torch.testing.assert_close(got[0][i], x.grad, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(got[1][i], y.grad, rtol=1e-12, atol=1e-13)

    def test_the_queue_loss_and_the_criterion_under_grad(self):
        a, r, noise = _ft_inputs(n=8)
        queue = torch.tanh(torch.randn(32, 16, dtype=torch.float64))
        got = torch.func.grad(
            lambda x: nac_fast.nac_mq_loss(x, r[0], queue, FT_P, noise=noise))(a[0])
        x = a[0].clone().requires_grad_()
        nac_fast.nac_mq_loss(x, r[0], queue, FT_P, noise=noise).backward()
        torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-13)
        crit = nac_fast.NACLoss(p=FT_P)
        got = torch.func.grad(lambda x0: crit((x0, r[0][:4]), (a[0][4:], r[0][4:]), noise=noise))(
            a[0][:4])
        x0 = a[0][:4].clone().requires_grad_()
        crit((x0, r[0][:4]), (a[0][4:], r[0][4:]), noise=noise).backward()
        torch.testing.assert_close(got, x0.grad, rtol=1e-12, atol=1e-13)

    def test_jacrev_of_the_rows(self):
        a, r, noise = _ft_inputs(n=5, D=4, B=1)
        jac = torch.func.jacrev(lambda x: nac_fast.nac_loss(x, r[0], FT_P, noise=noise,
                                                            reduction="none"))(a[0])
        assert jac.shape == (5, 5, 4)
        x = a[0].clone().requires_grad_()
        rows = nac_fast.nac_loss(x, r[0], FT_P, noise=noise, reduction="none")
        want = torch.stack([torch.autograd.grad(rows[i], x, retain_graph=True)[0]
                            for i in range(5)])
        torch.testing.assert_close(jac, want, rtol=1e-12, atol=1e-13)

    def test_an_explicit_compiled_backend_is_refused_under_a_transform(self):
        if "cpu" not in nac_fast.available_backends("cpu"):
            pytest.skip("the compiled CPU kernel is not built here")
        a, r, noise = _ft_inputs()
        with pytest.raises(ValueError, match=r"backend 'cpu' cannot run under a torch\.func"):
            torch.func.grad(
                lambda x: nac_fast.nac_loss(x, r[0], FT_P, noise=noise, backend="cpu"))(a[0])
        # outside the transform the same call runs the fused kernel
        assert dispatch.resolve_backend("auto", a[0]) == "cpu"
        assert not dispatch.func_transform_active()

    def test_auto_says_why_under_a_transform(self):
        seen = []
        a, r, noise = _ft_inputs()

        def f(x):
            seen.append(dispatch.explain_auto(x))
            return nac_fast.nac_loss(x, r[0], FT_P, noise=noise)
        torch.func.grad(f)(a[0])
        assert "torch.func transform" in seen[0] and "'reference'" in seen[0]
