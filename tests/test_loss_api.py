"""The public criteria as the trainer uses them: NACLoss / NACMQLoss take the two views' outputs
and pair them themselves, NACMQ makes a NAC-MQ step in one call, and the trainer's steps built on
them give the losses and gradients of 0.1.0's hand-written formula bit for bit (tests/_old_steps.py;
the two-process version is in tests/test_train_ddp.py).  Bad input names the argument."""
import contextlib

import pytest
import torch
import torch.nn as nn

import nac_fast
from nac_fast import CodeQueue, NACLoss, NACMQ, NACMQLoss
from nac_fast.ops.momentum import NACMQOutput, ema_update_, make_momentum_copy
from nac_fast.train import methods
from nac_fast.train.models import build_model

from _old_steps import old_nac_mq_step, old_nac_step

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


# ---- the trainer's steps equal the old formula bit for bit -------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("method", ["nac", "nac-mq"])
def test_trainer_steps_equal_the_old_formula(method, heads, amp, backend):
    """Three optimizer steps from one initialisation along both paths, the noise drawn inside
    from the same RNG state: equal losses, code pre-activations and gradients at every step
    (the first one with frozen codes, the inference network's warm-up), equal weights, queue and
    momentum model at the end."""
    _compare_with_old(method, heads, amp, backend, "linear")


@pytest.mark.slow  # 3-15 s a case on the shared 2-core machine (load average 14-20)
@pytest.mark.parametrize("method", ["nac", "nac-mq"])
def test_trainer_steps_equal_the_old_formula_on_a_resnet(method):
    """The same on train.py's CPU model (convolutions and BatchNorm in the encoder)."""
    _compare_with_old(method, "learning", True, "auto", "resnet-tiny")


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


def test_nac_loss_pairs_each_view_with_the_partners_logits():
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
    assert torch.equal(NACLoss(P, gather_distributed=True)((a0, r0), (a1, r1), noise=noise), got)


def test_nac_loss_under_autocast_gives_the_loss_the_autocast_dtype():
    a0, r0, a1, r1 = _views()
    noise = nac_fast.draw_noise((2 * K, D), P, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=BF16):
        got = NACLoss(P)((a0, r0.to(BF16)), (a1, r1.to(BF16)), noise=noise)  # float32 a, bf16 r
    want = nac_fast.nac_loss(torch.cat([a0, a1]).to(BF16), torch.cat([r1, r0]).to(BF16), P,
                             noise=noise)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(TypeError, match=r"out0\[1\] must have out0\[0\]'s dtype"):
        NACLoss(P)((a0, r0.to(BF16)), (a1, r1))  # autocast off: no silent conversion


def test_nac_mq_loss_enqueues_the_momentum_keys_before_the_loss():
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


def test_l2_auto_is_the_papers_lambda_scaled_by_the_bits_gain():
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


def test_nac_mq_loss_reads_a_queue_of_another_dtype():
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


def test_nacmq_is_one_call_per_step():
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


# ---- bad input names the argument ---------------------------------------------------------------

def test_criteria_name_bad_arguments():
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
        (lambda: crit((a0, r0), (a1, r1), noise=torch.ones(3, D)), ValueError, "noise must have"),
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


def test_nacmq_names_bad_arguments():
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


def test_refused_calls_leave_the_queue_and_the_momentum_model_as_they_were():
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
