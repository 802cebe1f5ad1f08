"""The VAE's math (docs/math.md [M:vae-dgauss], [M:vae-kl], [M:vae-elbo], [M:vae-iwae],
[M:vae-linear]): the discretised Gaussian is a distribution over the 256 values, the analytic KL
matches a Monte Carlo estimate, IWAE >= ELBO and IWAE -> log p(x) on the linear-Gaussian model,
and the decoder mirrors the encoder at any image size.  CPU, a few seconds."""
import math

import pytest
import torch

from nac_fast.vae.bounds import (LinearGaussian, elbo_terms, gaussian_kl, iwae_bound,
                                 log_normal_diag, log_standard_normal)
from nac_fast.vae.likelihood import (LOG_SCALE_MAX, LOG_SCALE_MIN, discretized_gaussian_log_prob,
                                     sample)
from nac_fast.vae.model import VAE, encoder_sizes

ALL = torch.arange(256, dtype=torch.uint8)

# (mean, log_scale) on the [0, 1] scale: centre, edges, far outside, very narrow, very wide,
# beyond the clamps
PARAMS = [(0.5, -2.0), (0.0, -5.0), (1.0, -5.0), (0.001, -3.0), (0.37, -9.0), (0.5, 2.0),
          (-0.3, -1.0), (1.7, -4.0), (0.5, -12.0), (0.5, 5.0), (9.0, 0.0), (-9.0, -9.0),
          (123.5 / 255, -9.0), (0.25, -6.5)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_discretized_gaussian_sums_to_one_over_256_bins(dtype, tol):
    mean = torch.tensor([m for m, _ in PARAMS], dtype=dtype)
    ls = torch.tensor([s for _, s in PARAMS], dtype=dtype)
    lp = discretized_gaussian_log_prob(ALL.view(256, 1), mean.expand(256, -1), ls.expand(256, -1))
    assert lp.dtype == dtype and lp.shape == (256, len(PARAMS))
    assert torch.isfinite(lp).all()
    assert (lp <= 0).all()  # probabilities: no positive log-likelihood
    total = torch.logsumexp(lp.double(), 0).exp()
    assert torch.allclose(total, torch.ones_like(total), atol=tol, rtol=0), total - 1


def test_discretized_gaussian_is_the_bin_mass():
    """Against the plain float64 difference Phi(hi) - Phi(lo), where that is accurate."""
    torch.manual_seed(0)
    mean = torch.rand(500, dtype=torch.float64) * 1.4 - 0.2
    ls = torch.rand(500, dtype=torch.float64) * 5 - 6
    x = torch.randint(0, 256, (500,), dtype=torch.uint8)
    k = x.double()
    s = ls.exp()
    lo = torch.where(x == 0, torch.tensor(-math.inf, dtype=torch.float64), (k - 0.5) / 255)
    hi = torch.where(x == 255, torch.tensor(math.inf, dtype=torch.float64), (k + 0.5) / 255)
    p = torch.special.ndtr((hi - mean) / s) - torch.special.ndtr((lo - mean) / s)
    ok = p > 1e-8
    assert ok.sum() > 100
    lp = discretized_gaussian_log_prob(x, mean, ls)
    assert torch.allclose(lp[ok], p[ok].log(), atol=1e-8, rtol=1e-8)
    # far in a tail the plain difference underflows to 0; the log form stays finite
    assert torch.isfinite(lp).all()


def test_discretized_gaussian_gradients_finite_at_the_edges():
    torch.manual_seed(1)
    x = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    x[:500], x[500:1000] = 0, 255
    mean = (torch.randn(3000) * 3).requires_grad_()
    ls = (torch.randn(3000) * 6).requires_grad_()
    discretized_gaussian_log_prob(x, mean, ls).sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(ls.grad).all()


def test_discretized_gaussian_bad_input():
    m = torch.zeros(4)
    with pytest.raises(TypeError, match="uint8"):
        discretized_gaussian_log_prob(torch.zeros(4), m, m)
    with pytest.raises(TypeError, match="mean"):
        discretized_gaussian_log_prob(torch.zeros(4, dtype=torch.uint8), m.long(), m)
    with pytest.raises(ValueError, match="same shape"):
        discretized_gaussian_log_prob(torch.zeros(4, dtype=torch.uint8), m, torch.zeros(3))
    with pytest.raises(ValueError, match="broadcast"):
        discretized_gaussian_log_prob(torch.zeros(5, dtype=torch.uint8), m, m)


def test_sample_follows_the_bin_probabilities():
    g = torch.Generator().manual_seed(0)
    mean, ls = torch.full((200000,), 0.02), torch.full((200000,), math.log(0.01))
    x = sample(mean, ls, generator=g)
    freq = torch.bincount(x.long(), minlength=256).double() / x.numel()
    p = discretized_gaussian_log_prob(ALL, mean[:256], ls[:256]).double().exp()
    assert (freq - p).abs().max() < 0.005


def test_gaussian_kl_matches_monte_carlo():
    """Analytic KL(q || N(0, I)) against E_q[log q(z) - log p(z)] by reparameterised samples."""
    torch.manual_seed(0)
    mu = torch.randn(4, 6, dtype=torch.float64) * 1.5
    logvar = torch.randn(4, 6, dtype=torch.float64)
    exact = gaussian_kl(mu, logvar)
    n = 200000
    eps = torch.randn(n, 4, 6, dtype=torch.float64)
    z = mu + torch.exp(0.5 * logvar) * eps
    d = log_normal_diag(z, mu, logvar) - log_standard_normal(z)        # (n, 4)
    mc, se = d.mean(0), d.std(0) / math.sqrt(n)
    assert ((mc - exact).abs() < 4 * se + 1e-9).all(), (mc, exact, se)
    assert (exact >= 0).all()
    assert torch.allclose(gaussian_kl(torch.zeros(3, 5), torch.zeros(3, 5)), torch.zeros(3))


def _linear_model(seed=0, n=6, d=3, rows=8):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(n, d, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    lg = LinearGaussian(W, b, 0.3)
    z = torch.randn(rows, d, generator=g, dtype=torch.float64)
    x = z @ W.T + b + math.sqrt(0.3) * torch.randn(rows, n, generator=g, dtype=torch.float64)
    m, S = lg.posterior(x)
    # a diagonal q: the exact posterior mean, the exact marginal variances inflated 1.5x, so
    # q != p(z|x) (the true posterior is correlated) and the ELBO is strictly below log p(x)
    logvar = torch.log(1.5 * torch.diagonal(S)).expand(rows, -1).clone()
    return lg, x, m, logvar


def test_linear_gaussian_model_is_consistent():
    """The closed-form ELBO equals the Monte Carlo one, and equals log p(x) for the exact
    posterior (the model's posterior has a closed form; with d = 1 it is diagonal)."""
    lg, x, m, logvar = _linear_model()
    torch.manual_seed(0)
    res = iwae_bound(x, lambda _: (m, logvar), lg.log_likelihood, k=20000, chunk=5000)
    closed = lg.elbo(x, m, logvar)
    assert (closed < lg.log_marginal(x) - 0.05).all()
    assert torch.allclose(res.elbo, closed, atol=0.05)
    lg1, x1, _, _ = _linear_model(seed=3, d=1)
    m1, S1 = lg1.posterior(x1)
    lv1 = torch.log(torch.diagonal(S1)).expand(x1.shape[0], -1)
    assert torch.allclose(lg1.elbo(x1, m1, lv1), lg1.log_marginal(x1), atol=1e-10)


def test_iwae_at_least_elbo_and_converges_to_log_px():
    lg, x, m, logvar = _linear_model()
    rows = x.shape[0]
    exact = lg.log_marginal(x)
    elbo = lg.elbo(x, m, logvar)
    g = torch.Generator().manual_seed(0)
    gaps = []
    for k in (1, 10, 100, 1000):
        reps = max(20, 40000 // k)  # independent bounds per row: every row repeated
        r = iwae_bound(x.repeat(reps, 1), lambda _: (m.repeat(reps, 1), logvar.repeat(reps, 1)),
                       lg.log_likelihood, k=k, chunk=97, generator=g)
        # Jensen on the same samples: log mean w >= mean log w, for every single draw
        assert (r.iwae >= r.elbo - 1e-12).all()
        assert r.k == k and r.iwae.dtype == torch.float64
        per = r.iwae.view(reps, rows)
        iw, se = per.mean(0), per.std(0) / math.sqrt(reps)
        assert (iw >= elbo - 4 * se).all(), (k, iw - elbo, se)   # E[IWAE_K] >= ELBO
        assert (iw <= exact + 4 * se).all(), (k, iw - exact, se)  # and <= log p(x)
        gaps.append(float((exact - iw).mean()))
    # the mean gap to log p(x) shrinks with K (the expected IWAE bound is monotone in K)
    assert gaps[0] > gaps[1] > gaps[2] > gaps[3] > -0.02, gaps
    # K = 1 is the ELBO, well below log p(x); K = 1000 nearly closes the gap
    assert abs(gaps[0] - float((exact - elbo).mean())) < 0.05 and gaps[0] > 0.3, gaps
    assert gaps[3] < 0.01, gaps
    big = iwae_bound(x, lambda _: (m, logvar), lg.log_likelihood, k=50000, chunk=10000,
                     generator=g)
    assert torch.allclose(big.iwae, exact, atol=0.03), big.iwae - exact


def test_iwae_with_exact_diagonal_posterior_is_exact_for_every_k():
    lg, x, _, _ = _linear_model(seed=3, d=1)
    m, S = lg.posterior(x)
    lv = torch.log(torch.diagonal(S)).expand(x.shape[0], -1)
    r = iwae_bound(x, lambda _: (m, lv), lg.log_likelihood, k=3, chunk=2)
    assert torch.allclose(r.iwae, lg.log_marginal(x), atol=1e-9)


def test_iwae_bad_arguments():
    lg, x, m, logvar = _linear_model()
    post = lambda _: (m, logvar)  # noqa: E731
    for k in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="k must"):
            iwae_bound(x, post, lg.log_likelihood, k=k)
    with pytest.raises(ValueError, match="chunk"):
        iwae_bound(x, post, lg.log_likelihood, k=4, chunk=0)
    with pytest.raises(ValueError, match="posterior must return"):
        iwae_bound(x, lambda _: (m, logvar[:, :2]), lg.log_likelihood, k=4)


def test_elbo_terms_are_recon_minus_kl_and_differentiable():
    lg, x, m, logvar = _linear_model()
    m = m.clone().requires_grad_()
    elbo, recon, kl = elbo_terms(x, lambda _: (m, logvar), lg.log_likelihood)
    assert torch.allclose(elbo, recon - kl)
    elbo.sum().backward()
    assert m.grad is not None and torch.isfinite(m.grad).all()


@pytest.mark.parametrize("size,channels", [(28, 1), (32, 3), (17, 2), (9, 1), (65, 3)])
def test_decoder_mirrors_the_encoder_at_any_size(size, channels):
    torch.manual_seed(0)
    vae = VAE("resnet-tiny", channels, size, latent_dim=5).eval()
    x = torch.randint(0, 256, (2, channels, size, size), dtype=torch.uint8)
    with torch.no_grad():
        mu, logvar = vae.posterior(x.float() / 255)
        mean, ls = vae.decode(mu)
        lp = vae.log_likelihood(x, mu)
    assert mu.shape == logvar.shape == (2, 5)
    assert mean.shape == ls.shape == (2, channels, size, size)
    assert lp.shape == (2,) and (lp <= 0).all()
    sizes = encoder_sizes(size)
    feat = vae.encoder.net
    with torch.no_grad():  # the encoder's stage sizes are the ones the decoder climbs back up
        y = feat.maxpool(feat.relu(feat.bn1(feat.conv1(x.float()))))
        got = []
        for layer in (feat.layer1, feat.layer2, feat.layer3, feat.layer4):
            y = layer(y)
            got.append(y.shape[-1])
    assert got == sizes[1:]


def test_vae_bad_latent_dim():
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="latent_dim"):
            VAE("resnet-tiny", 1, 28, latent_dim=bad)


def test_log_scale_clamp_is_in_the_documented_range():
    assert LOG_SCALE_MIN < math.log(0.5 / 255) < LOG_SCALE_MAX
