"""The VAE's bounds on log p(x): reparameterised sample, analytic KL, ELBO and the IWAE bound
(docs/math.md [M:vae-kl], [M:vae-elbo], [M:vae-iwae]), plus the linear-Gaussian model whose
marginal likelihood is known exactly ([M:vae-linear]), against which the estimators are tested.

    kl = gaussian_kl(mu, logvar)                                   # (B,) KL(q(z|x) || N(0, I))
    res = iwae_bound(x, posterior, log_likelihood, k=1000, chunk=100, generator=g)
    res.iwae, res.elbo                                             # (B,) each, no gradient

`posterior(x) -> (mu, logvar)` and `log_likelihood(x, z) -> (n,)` are any callables, so the
same code evaluates the ResNet VAE and the linear-Gaussian test model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_2PI = math.log(2.0 * math.pi)


def log_normal_diag(z: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """log N(z; mu, diag(exp(logvar))), summed over the last dimension."""
    return -0.5 * (LOG_2PI + logvar + (z - mu) ** 2 * torch.exp(-logvar)).sum(-1)


def log_standard_normal(z: torch.Tensor) -> torch.Tensor:
    """log N(z; 0, I), summed over the last dimension."""
    return -0.5 * (LOG_2PI + z ** 2).sum(-1)


def gaussian_kl(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, diag(exp(logvar))) || N(0, I)) per row, docs/math.md [M:vae-kl]."""
    return 0.5 * (mu ** 2 + torch.exp(logvar) - 1.0 - logvar).sum(-1)


def reparameterize(mu: torch.Tensor, logvar: torch.Tensor, generator=None) -> torch.Tensor:
    """z = mu + exp(logvar / 2) eps, eps ~ N(0, I) (docs/math.md [M:vae-elbo])."""
    eps = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
    return mu + torch.exp(0.5 * logvar) * eps


def elbo_terms(x, posterior, log_likelihood, generator=None):
    """One-sample ELBO of each row, docs/math.md [M:vae-elbo]: (elbo, recon, kl), each (B,),
    with recon = log p(x | z), z ~ q(z|x) reparameterised (differentiable), and the analytic KL."""
    mu, logvar = posterior(x)
    z = reparameterize(mu, logvar, generator)
    recon = log_likelihood(x, z)
    kl = gaussian_kl(mu, logvar)
    return recon - kl, recon, kl


@dataclass
class IWAEResult:
    iwae: torch.Tensor      # (B,) log (1/K sum_k w_k), float64
    elbo: torch.Tensor      # (B,) (1/K) sum_k log w_k: the K-sample Monte Carlo ELBO, float64
    kl: torch.Tensor        # (B,) analytic KL(q(z|x) || p(z)), float64
    k: int


def iwae_bound(x, posterior, log_likelihood, k: int, chunk: int = 64, generator=None,
               batch_dim_first: bool = True) -> IWAEResult:
    """The importance-weighted bound with K samples per row of x, docs/math.md [M:vae-iwae].

    Runs under torch.no_grad, `chunk` samples of every row at a time (the decoder then sees
    B x chunk inputs per call); the K log-weights of each row are kept (B x K float64) and
    combined with one logsumexp.  generator: a torch.Generator for the samples (the same
    generator state gives the same bound)."""
    for name, v in (("k", k), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    with torch.no_grad():
        mu, logvar = posterior(x)
        if mu.dim() != 2 or mu.shape != logvar.shape:
            raise ValueError(f"posterior must return (mu, logvar) of one (B, d) shape, got "
                             f"{tuple(mu.shape)} and {tuple(logvar.shape)}")
        B, d = mu.shape
        std = torch.exp(0.5 * logvar)
        logw = torch.empty(B, k, dtype=torch.float64, device=mu.device)
        for s in range(0, k, chunk):
            kk = min(chunk, k - s)
            eps = torch.randn((kk, B, d), generator=generator, device=mu.device, dtype=mu.dtype)
            z = mu + std * eps                                            # (kk, B, d)
            log_q = -0.5 * (LOG_2PI + logvar + eps ** 2).sum(-1)          # log q(z | x), exact
            log_prior = log_standard_normal(z)
            xs = x.unsqueeze(0).expand(kk, *x.shape).reshape(kk * B, *x.shape[1:])
            log_px = log_likelihood(xs, z.reshape(kk * B, d)).reshape(kk, B)
            logw[:, s:s + kk] = (log_px + log_prior - log_q).t().to(torch.float64)
        iwae = torch.logsumexp(logw, dim=1) - math.log(k)
        return IWAEResult(iwae=iwae, elbo=logw.mean(1),
                          kl=gaussian_kl(mu, logvar).to(torch.float64), k=k)


# --------------------------------------------------------------------------------------------
# The linear-Gaussian VAE: p(z) = N(0, I_d), p(x | z) = N(W z + b, s2 I_n), docs/math.md
# [M:vae-linear].  Its marginal p(x) = N(b, W W^T + s2 I) and its posterior are known exactly.
# --------------------------------------------------------------------------------------------

class LinearGaussian:
    """The test model of [M:vae-linear].  W: (n, d), b: (n,), s2 > 0 (float64 recommended)."""

    def __init__(self, W: torch.Tensor, b: torch.Tensor, s2: float):
        if W.dim() != 2 or b.shape != (W.shape[0],):
            raise ValueError(f"W must be (n, d) and b (n,), got {tuple(W.shape)}, {tuple(b.shape)}")
        if not s2 > 0:
            raise ValueError(f"s2 must be > 0, got {s2!r}")
        self.W, self.b, self.s2 = W, b, float(s2)

    def log_marginal(self, x: torch.Tensor) -> torch.Tensor:
        """log p(x) = log N(x; b, W W^T + s2 I), exactly, per row."""
        n = self.W.shape[0]
        cov = self.W @ self.W.T + self.s2 * torch.eye(n, dtype=self.W.dtype)
        return torch.distributions.MultivariateNormal(self.b, covariance_matrix=cov).log_prob(x)

    def posterior(self, x: torch.Tensor):
        """The exact posterior N(m, S): S = (I + W^T W / s2)^-1, m = S W^T (x - b) / s2."""
        d = self.W.shape[1]
        S = torch.linalg.inv(torch.eye(d, dtype=self.W.dtype) + self.W.T @ self.W / self.s2)
        m = (x - self.b) @ self.W @ S / self.s2  # S is symmetric
        return m, S

    def log_likelihood(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """log p(x | z) per row."""
        mean = z @ self.W.T + self.b
        n = self.W.shape[0]
        return -0.5 * (n * (LOG_2PI + math.log(self.s2)) + ((x - mean) ** 2).sum(-1) / self.s2)

    def elbo(self, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        """The ELBO of a diagonal q = N(mu, diag(exp(logvar))), in closed form:
        E_q log p(x|z) = log N(x; W mu + b, s2 I) - tr(W^T W diag(var)) / (2 s2)."""
        var = torch.exp(logvar)
        expected = self.log_likelihood(x, mu) - 0.5 * (var * (self.W ** 2).sum(0)).sum(-1) / self.s2
        return expected - gaussian_kl(mu, logvar)
