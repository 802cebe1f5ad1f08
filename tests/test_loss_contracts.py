"""Contracts of the loss API that an audit found broken (2026-11-28): a second derivative through a
fused backend raises instead of being silently zero; a refused NACMQLoss call leaves the queue as
it was, whatever the reason; noise and draw_noise refuse dtypes that cannot hold -1; the Triton
fp64 keys' gradient is fp64-accurate; a checkpoint's queue pointer is checked; gradient
accumulation over two NACMQLoss calls works on every backend, and the Triton enqueue tells
autograd that it wrote the codes; backend="auto" on CUDA tensors wider than a fused kernel takes.
The GPU suite runs this file with NAC_FAST_TEST_DEVICE=cuda (the fused GPU backends)."""
import os

import pytest
import torch

import nac_fast

from _loss_helpers import fused_backends

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
BACKENDS = nac_fast.available_backends(DEVICE)
FUSED = fused_backends(DEVICE)
needs_triton = pytest.mark.skipif("triton" not in FUSED,
                                  reason="the Triton kernels do not run here")


def _inputs(n=6, D=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, D, generator=g, dtype=dtype)
    r = torch.randn(n, D, generator=g, dtype=dtype)
    m = nac_fast.draw_noise((n, D), 0.2, dtype=dtype, generator=g)
    return a.to(DEVICE), r.to(DEVICE), m.to(DEVICE)


# ---- a second derivative -------------------------------------------------------------------

@pytest.mark.parametrize("backend", FUSED)
def test_second_derivative_through_a_fused_backend_raises(backend):
    a0, r, m = _inputs()
    a = a0.clone().requires_grad_()
    loss = nac_fast.nac_loss(a, r, 0.2, noise=m, backend=backend)
    ga, = torch.autograd.grad(loss, a, create_graph=True)  # the first derivative: right
    a2 = a0.clone().requires_grad_()
    ref, = torch.autograd.grad(nac_fast.nac_loss(a2, r, 0.2, noise=m, backend=backend), a2)
    torch.testing.assert_close(ga.detach(), ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="once differentiable.*backend='reference'"):
        (loss + ga.pow(2).sum()).backward()


def test_second_derivative_through_the_reference_is_right():
    a0, r, m = _inputs(n=4, D=3)
    a = a0.clone().requires_grad_()
    assert torch.autograd.gradgradcheck(
        lambda x: nac_fast.nac_loss(x, r, 0.2, noise=m, backend="reference"), (a,))


# ---- NACMQLoss: a refused call leaves the queue as it was -----------------------------------

def _views(K=4, D=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(K, D, generator=g).to(DEVICE) for _ in range(8)]


def _refused(crit, queue, v, exc, match, **kw):
    codes, ptr = queue.codes.clone(), queue.ptr.clone()
    with pytest.raises(exc, match=match):
        crit((v[0], v[1]), (v[2], v[3]), (v[4], v[5]), (v[6], v[7]), queue, **kw)
    assert torch.equal(queue.codes, codes) and torch.equal(queue.ptr, ptr), "the queue changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_mq_call_leaves_the_queue(backend):
    K, D = 4, 3
    v = _views(K, D)
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


def test_an_unavailable_backend_or_a_tiny_multilinear_p_leaves_the_queue():
    K, D = 4, 3
    v = _views(K, D)
    q = nac_fast.CodeQueue(4 * K, D, device=DEVICE)
    nac_fast.CodeQueue.enqueue(q, torch.ones(3, D, device=DEVICE))
    if "cuda" not in BACKENDS:
        _refused(nac_fast.NACMQLoss(0.1, backend="cuda"), q, v, ValueError, "not available")
    _refused(nac_fast.NACMQLoss(1e-4, likelihood="multilinear", backend="reference"), q, v,
             ValueError, "multilinear")


# ---- noise dtypes ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_noise_is_refused(dtype):
    a, r, m = _inputs(dtype=torch.float32)
    # uint8's 255 compares equal to -1 in torch: it passed the +-1 check and gave a wrong loss
    bad = torch.where(m > 0, 1, 255).to(torch.uint8).to(dtype) if dtype == torch.uint8 else \
        torch.ones(a.shape, dtype=dtype)
    with pytest.raises(TypeError, match="noise must hold \\+-1 as a signed"):
        nac_fast.nac_loss(a, r, 0.2, noise=bad)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.complex64, torch.uint16])
def test_draw_noise_refuses_dtypes_without_minus_one(dtype):
    with pytest.raises(TypeError, match="dtype must be a signed real dtype"):
        nac_fast.draw_noise((2, 3), 0.2, dtype=dtype)


def test_draw_noise_in_signed_dtypes_is_the_same_noise():
    m = nac_fast.draw_noise((64, 8), 0.3, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.int8, torch.int32, torch.float64, torch.bfloat16):
        got = nac_fast.draw_noise((64, 8), 0.3, dtype=dtype,
                                  generator=torch.Generator().manual_seed(4))
        assert got.dtype == dtype and torch.equal(got.to(torch.float32), m), dtype


# ---- Triton fp64 ---------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("n,N,D", [(1, 3, 1), (97, 33, 16), (40, 130, 7)])
def test_triton_fp64_keys_gradient_is_fp64_accurate(n, N, D):
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


# ---- the queue's pointer in a checkpoint -------------------------------------------------------

@pytest.mark.parametrize("ptr,exc", [(torch.tensor(-1), ValueError), (torch.tensor(5), ValueError),
                                     (torch.tensor(1.5), TypeError),
                                     (torch.tensor(True), TypeError),
                                     (torch.tensor([1, 2]), TypeError)])
def test_a_checkpoint_pointer_outside_the_queue_is_refused(ptr, exc):
    q = nac_fast.CodeQueue(5, 3)
    with pytest.raises(exc, match="queue pointer"):
        q.load_state_dict({"codes": torch.zeros(5, 3), "ptr": ptr})
    assert int(q.ptr) == 0


def test_a_checkpoint_pointer_inside_the_queue_loads():
    q = nac_fast.CodeQueue(5, 3)
    q.load_state_dict({"codes": torch.ones(5, 3), "ptr": torch.tensor(4)})
    assert int(q.ptr) == 4 and bool((q.codes == 1).all())


# ---- gradient accumulation over two NACMQLoss calls -------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_two_mq_calls_before_one_backward(backend, qdtype):
    """Two micro-batches' losses, one backward: the sum of each call's own gradient.  The queue's
    codes, when stored in the loss dtype, were the live buffer the next call writes in place."""
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
def test_the_triton_enqueue_bumps_the_codes_version():
    q = nac_fast.CodeQueue(8, 3, device=DEVICE)
    before = (q.codes._version, q.ptr._version)
    q.enqueue(torch.ones(2, 3, device=DEVICE), backend="triton")
    assert q.codes._version > before[0] and q.ptr._version > before[1]
    assert int(q.ptr) == 2 and bool((q.codes[:2] == 1).all())


# ---- backend="auto" on CUDA tensors wider than a fused kernel takes ------------------------------

def test_fused_max_d_is_the_kernels_limit():
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
def test_auto_on_cuda_skips_a_fused_backend_too_narrow_for_d(D, avail, want):
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
def test_auto_runs_wide_codes_on_cuda():
    """D = 640 (over every fused GPU kernel's limit): auto runs the reference, which is right."""
    a, r, m = _inputs(n=9, D=640, dtype=torch.float32)
    a.requires_grad_()
    from nac_fast.ops import dispatch
    assert dispatch.resolve_backend("auto", a) == "reference"
    loss = nac_fast.nac_loss(a, r, 0.2, noise=m)
    ref = nac_fast.nac_loss(a, r, 0.2, noise=m, backend="reference")
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    loss.backward()
    assert torch.isfinite(a.grad).all()
