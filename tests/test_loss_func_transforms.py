"""The losses under torch.func transforms (grad, vmap, jacrev): backend="auto" runs the reference
there (the compiled kernels read data pointers and have no functorch rules), an explicit compiled
backend is refused naming `backend`, and the data-reading input checks stay out of vmap's way.
Before: grad with "auto" raised torch's "must override the setup_context staticmethod", and vmap
failed even with the reference, in the NaN check's bool()."""
from __future__ import annotations

import pytest
import torch

import nac_fast
from nac_fast.ops import dispatch

P = 0.1


def _inputs(n=6, D=16, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, n, D, generator=g, dtype=torch.float64) * 1.5
    r = torch.randn(B, n, D, generator=g, dtype=torch.float64)
    noise = torch.where(torch.rand(n, D, generator=g) < P, -1.0, 1.0).double()
    return a, r, noise


def _fused_or_reference() -> str:
    return "cpu" if "cpu" in nac_fast.available_backends("cpu") else "reference"


def test_grad_with_auto_equals_the_backends_autograd_gradient():
    a, r, noise = _inputs()
    be = _fused_or_reference()
    got = torch.func.grad(lambda x: nac_fast.nac_loss(x, r[0], P, noise=noise))(a[0])
    x = a[0].clone().requires_grad_()
    nac_fast.nac_loss(x, r[0], P, noise=noise, backend=be).backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-13)


def test_vmap_of_grad_gives_per_sample_gradients():
    a, r, noise = _inputs()

    def loss(x, y):
        return nac_fast.nac_loss(x, y, P, noise=noise)
    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(a, r)
    for i in range(a.shape[0]):
        x, y = a[i].clone().requires_grad_(), r[i].clone().requires_grad_()
        loss(x, y).backward()
        torch.testing.assert_close(got[0][i], x.grad, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(got[1][i], y.grad, rtol=1e-12, atol=1e-13)


def test_the_queue_loss_and_the_criterion_under_grad():
    a, r, noise = _inputs(n=8)
    queue = torch.tanh(torch.randn(32, 16, dtype=torch.float64))
    got = torch.func.grad(lambda x: nac_fast.nac_mq_loss(x, r[0], queue, P, noise=noise))(a[0])
    x = a[0].clone().requires_grad_()
    nac_fast.nac_mq_loss(x, r[0], queue, P, noise=noise).backward()
    torch.testing.assert_close(got, x.grad, rtol=1e-12, atol=1e-13)
    crit = nac_fast.NACLoss(p=P)
    got = torch.func.grad(lambda x0: crit((x0, r[0][:4]), (a[0][4:], r[0][4:]), noise=noise))(
        a[0][:4])
    x0 = a[0][:4].clone().requires_grad_()
    crit((x0, r[0][:4]), (a[0][4:], r[0][4:]), noise=noise).backward()
    torch.testing.assert_close(got, x0.grad, rtol=1e-12, atol=1e-13)


def test_jacrev_of_the_rows():
    a, r, noise = _inputs(n=5, D=4, B=1)
    jac = torch.func.jacrev(lambda x: nac_fast.nac_loss(x, r[0], P, noise=noise,
                                                        reduction="none"))(a[0])
    assert jac.shape == (5, 5, 4)
    x = a[0].clone().requires_grad_()
    rows = nac_fast.nac_loss(x, r[0], P, noise=noise, reduction="none")
    want = torch.stack([torch.autograd.grad(rows[i], x, retain_graph=True)[0] for i in range(5)])
    torch.testing.assert_close(jac, want, rtol=1e-12, atol=1e-13)


def test_an_explicit_compiled_backend_is_refused_under_a_transform():
    if "cpu" not in nac_fast.available_backends("cpu"):
        pytest.skip("the compiled CPU kernel is not built here")
    a, r, noise = _inputs()
    with pytest.raises(ValueError, match=r"backend 'cpu' cannot run under a torch\.func"):
        torch.func.grad(lambda x: nac_fast.nac_loss(x, r[0], P, noise=noise, backend="cpu"))(a[0])
    # outside the transform the same call runs the fused kernel
    assert dispatch.resolve_backend("auto", a[0]) == "cpu"
    assert not dispatch.func_transform_active()


def test_auto_says_why_under_a_transform():
    seen = []
    a, r, noise = _inputs()

    def f(x):
        seen.append(dispatch.explain_auto(x))
        return nac_fast.nac_loss(x, r[0], P, noise=noise)
    torch.func.grad(f)(a[0])
    assert "torch.func transform" in seen[0] and "'reference'" in seen[0]
