"""The loss API used as a library user would (audit of 2026-11-29): what the audit found broken.

- CodeQueue.enqueue took keys of dtypes that cannot hold codes in [-1, 1] and converted them
  silently: complex keys lost their imaginary part, bool keys became 0/1 codes (the package's bool
  codes mean False = -1, ops/codes.py), unsigned ones held 255 for a -1 cast to uint8.
- An explicit `noise` that requires grad made the backends disagree: the reference
  differentiated through it (the loss required grad, noise.grad was filled), the fused backends
  ignored it (noise.grad None; with nothing else requiring grad, the loss had no grad_fn).
- available_backends("gpu") raised torch's RuntimeError, explain_auto([1]) an AttributeError,
  not TypeError/ValueError naming the argument.
- NACMQLoss's repr wrote l2=auto unquoted, beside reduction='mean'.
- A gradient penalty through a fused backend was silently wrong: the node that raises on a second
  derivative took only the gradients' detached aliases, so autograd.grad of the weights that made
  the codes (or of the codes themselves) never reached it.
"""
import pytest
import torch

import nac_fast
from nac_fast.ops import dispatch

from _loss_helpers import fused_backends

BACKENDS = nac_fast.available_backends("cpu")
ENQUEUE = ["reference"] + (["triton"] if "triton" in fused_backends("cpu") else [])


# ---- CodeQueue.enqueue: keys that cannot hold codes --------------------------------------------

@pytest.mark.parametrize("backend", ENQUEUE)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.uint8])
def test_enqueue_refuses_keys_that_cannot_hold_codes(backend, dtype):
    q = nac_fast.CodeQueue(6, 3)
    q.enqueue(torch.full((2, 3), -0.5))
    before, ptr = q.codes.clone(), int(q.ptr)
    keys = torch.ones(2, 3).to(dtype)
    with pytest.raises(TypeError, match=f"keys must .*got {dtype}"):
        q.enqueue(keys, backend=backend)
    assert torch.equal(q.codes, before) and int(q.ptr) == ptr


def test_enqueue_still_takes_signed_integer_and_floating_keys():
    q = nac_fast.CodeQueue(6, 3, dtype=torch.float64)
    q.enqueue(torch.tensor([[1, -1, 1]], dtype=torch.int8))
    q.enqueue(torch.tensor([[0.25, -0.5, 1.0]], dtype=torch.float16))
    assert q.codes[:2].tolist() == [[1.0, -1.0, 1.0], [0.25, -0.5, 1.0]] and int(q.ptr) == 2


# ---- noise that requires grad: one answer on every backend -------------------------------------

def _views(K=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(K, D, generator=g, dtype=torch.float64) for _ in range(8)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_that_requires_grad_is_refused(backend):
    v = _views()
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


# ---- the dispatcher's public helpers name bad arguments ----------------------------------------

def test_available_backends_names_a_bad_device():
    with pytest.raises(ValueError, match="device"):
        nac_fast.available_backends("gpu")
    with pytest.raises(ValueError, match="device"):
        nac_fast.available_backends("gpu", reasons=True)
    assert nac_fast.available_backends("cpu:0") == nac_fast.available_backends("cpu")


def test_explain_auto_names_a_non_tensor():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        dispatch.explain_auto([[1.0]])
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        dispatch.explain_auto(torch.ones(2, 3), keys=[[1.0]])
    assert "backend='auto' runs" in dispatch.explain_auto(torch.ones(2, 3), keys=None)


# ---- repr ---------------------------------------------------------------------------------------

def test_mq_criterion_repr_quotes_l2_auto():
    assert "l2='auto'," in repr(nac_fast.NACMQLoss(0.2, l2="auto"))
    assert "l2=0.1," in repr(nac_fast.NACMQLoss(0.2, l2=0.1))


# ---- CodeQueue.load_state_dict(assign=True): the pointer stays int64 ----------------------------

@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_an_assigned_narrow_pointer_is_loaded_as_int64(dtype):
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
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_gradient_penalty_through_a_fused_backend_raises(backend, kind):
    """A = x W; the penalty |d loss / dA|^2, differentiated by W (or A) with autograd.grad: the
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


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_a_gradient_penalty_through_the_mq_criterion_raises_or_is_right(backend):
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


# ---- numpy scalars for p, l2 and the EMA decay ------------------------------------------------

def test_numpy_float32_settings_are_taken_as_their_value():
    """Bug: p=np.float32(0.1) (or l2, decay) was a TypeError, while np.float64 (a float
    subclass) was accepted.  They are the same number, so the same loss; numpy bools stay
    refused."""
    import numpy as np
    g = torch.Generator().manual_seed(4)
    a, r = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    noise = nac_fast.draw_noise((4, 5), 0.25, generator=g)
    queue = torch.randn(8, 5, generator=g).tanh()
    p32, l232 = np.float32(0.25), np.float32(0.125)   # exact in float32: the same values
    for be in BACKENDS:
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
