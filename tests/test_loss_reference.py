"""The reference loss against a float64 transcription of docs/math.md [M:rows], its gradients
(gradcheck), the channel noise, and the paper's central claim in miniature."""

import numpy as np
import pytest
import torch

import nac_fast
from nac_fast.ops import reference

from _loss_helpers import oracle_rows, rel_err


@pytest.mark.parametrize("n,N,D", [(1, 1, 1), (3, 131, 7), (97, 4099, 128), (64, None, 16),
                                   (1000, None, 256)])
@pytest.mark.parametrize("p", [0.05, 0.1, 0.4])
def test_reference_matches_float64_oracle(n, N, D, p):
    g = torch.Generator().manual_seed(n * 7 + D)
    a = torch.randn(n, D, generator=g, dtype=torch.float64) * 2
    r = torch.randn(n, D, generator=g, dtype=torch.float64) * 3
    keys = None if N is None else torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64))
    noise = nac_fast.draw_noise((n, D), p, dtype=torch.float64, generator=g)
    want = oracle_rows(a, r, noise, p, keys)
    got = nac_fast.nac_loss(a, r, p, keys=keys, noise=noise, reduction="none", backend="reference")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    mean = nac_fast.nac_loss(a, r, p, keys=keys, noise=noise, backend="reference")
    assert mean.dtype == torch.float64 and mean.dim() == 0
    np.testing.assert_allclose(mean.item(), want.mean(), rtol=1e-12)
    if keys is not None:  # NAC-MQ: same rows plus lambda ||z||^2
        mq = nac_fast.nac_mq_loss(a, r, keys, p, l2=0.1, noise=noise, reduction="none",
                                  backend="reference")
        np.testing.assert_allclose(mq.numpy(), oracle_rows(a, r, noise, p, keys, l2=0.1),
                                   rtol=1e-12, atol=1e-12)


def test_reference_float32_output_and_sum():
    a, r = torch.randn(5, 4), torch.randn(5, 4)
    noise = nac_fast.draw_noise((5, 4), 0.1)
    rows = nac_fast.nac_loss(a, r, 0.1, noise=noise, reduction="none", backend="reference")
    total = nac_fast.nac_loss(a, r, 0.1, noise=noise, reduction="sum", backend="reference")
    assert rows.dtype == torch.float32 and rows.shape == (5,)
    assert torch.allclose(total, rows.sum())
    bf = nac_fast.nac_loss(a.bfloat16(), r.bfloat16(), 0.1, noise=noise, backend="reference")
    assert bf.dtype == torch.float32


@pytest.mark.parametrize("likelihood", ["dot", "multilinear"])  # [M:channel], [M:multilinear]
@pytest.mark.parametrize("case", ["inbatch", "keys", "mq"])
def test_reference_gradcheck(case, likelihood):
    g = torch.Generator().manual_seed(1)
    n, N, D = 5, 7, 3
    a = torch.randn(n, D, dtype=torch.float64, generator=g, requires_grad=True)
    r = torch.randn(n, D, dtype=torch.float64, generator=g, requires_grad=True)
    keys = torch.tanh(torch.randn(N, D, dtype=torch.float64, generator=g)).requires_grad_(case == "keys")
    noise = nac_fast.draw_noise((n, D), 0.2, dtype=torch.float64, generator=g)
    kw = dict(noise=noise, reduction="none", backend="reference", likelihood=likelihood)
    if case == "inbatch":
        fn = lambda a, r: nac_fast.nac_loss(a, r, 0.2, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (a, r))
    elif case == "keys":
        fn = lambda a, r, k: nac_fast.nac_loss(a, r, 0.2, keys=k, **kw)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (a, r, keys))
    else:
        fn = lambda a, r: nac_fast.nac_mq_loss(a, r, keys.detach(), 0.2, l2=0.1,  # noqa: E731
                                               **kw)
        assert torch.autograd.gradcheck(fn, (a, r))


def test_vi_loss_trains_only_r_and_matches_bernoulli_term():
    a = torch.randn(6, 5, requires_grad=True)
    r = torch.randn(6, 5, requires_grad=True)
    noise = nac_fast.draw_noise((6, 5), 0.1)
    vi = nac_fast.nac_vi_loss(a, r, 0.1, noise=noise)
    vi.backward()
    assert a.grad is None and r.grad is not None
    zt = noise * torch.tanh(a.detach())
    want = -0.5 * (zt * r + torch.log(torch.sigmoid(r)) + torch.log(torch.sigmoid(-r))).sum(1).mean()
    assert torch.allclose(vi, want, atol=1e-6)
    # d vi / d r = sigmoid(r) - (1 + z~)/2, averaged over rows
    assert torch.allclose(r.grad, (torch.sigmoid(r) - 0.5 * (1 + zt)).detach() / 6, atol=1e-6)


def _code_stats(a):
    c = torch.sign(a)
    c[c == 0] = 1
    n = c.shape[0]
    dist = (c.shape[1] - c @ c.t()) / 2  # Hamming distance of +-1 codes
    mean_h = dist.sum().item() / (n * (n - 1))
    return mean_h, len({tuple(row.tolist()) for row in c})


def test_gradient_descent_raises_code_expressivity():
    """The paper's claim in miniature: minimising the in-batch NAC loss over free pre-activations
    spreads the codes apart (mean pairwise Hamming distance and number of distinct codes go up)."""
    g = torch.Generator().manual_seed(0)
    n, D = 64, 16
    base = torch.randn(1, D, generator=g)
    a = (base + 0.3 * torch.randn(n, D, generator=g)).requires_grad_()  # codes start clustered
    r = torch.zeros(n, D, requires_grad=True)
    h0, d0 = _code_stats(a.detach())
    opt = torch.optim.SGD([a, r], lr=0.5)
    for _ in range(300):
        opt.zero_grad()
        nac_fast.nac_loss(a, r, 0.1, backend="reference").backward()
        opt.step()
    h1, d1 = _code_stats(a.detach())
    assert h1 > h0 + 2.0, (h0, h1)
    assert d1 > d0, (d0, d1)
    assert d1 >= 0.9 * n
