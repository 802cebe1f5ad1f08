"""The channel's own relaxed likelihood (docs/math.md [M:multilinear], --channel-likelihood
multilinear): its series against a float64 numpy transcription of the definition at awkward
sizes, its precision in float32 and bf16 against the naive same-dtype computation, its gradient
against the exact log1p form (its gradcheck: tests/test_loss_reference.py), the identities that
tie it to the paper's dot likelihood, and the API's refusals."""
import math
import os
import sys

import numpy as np
import pytest
import torch

import nac_fast
from nac_fast.ops import reference

from _loss_helpers import oracle_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inputs(n, N, D, p, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, D, generator=g, dtype=torch.float64) * 2
    r = torch.randn(n, D, generator=g, dtype=torch.float64) * 3
    keys = None if N is None else torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64))
    noise = nac_fast.draw_noise((n, D), p, dtype=torch.float64, generator=g)
    cast = (lambda t: None if t is None else t.to(dtype))
    return cast(a), cast(r), cast(keys), noise.to(dtype)


@pytest.mark.parametrize("n,N,D", [(1, 1, 1), (3, 97, 7), (97, None, 128), (64, 1031, 16),
                                   (4099, 3, 5)])
@pytest.mark.parametrize("p", [0.05, 0.25, 0.4])
def test_rows_match_the_float64_definition(n, N, D, p):
    a, r, keys, noise = _inputs(n, N, D, p, seed=n + D)
    want = oracle_rows(a, r, noise, p, keys, likelihood="multilinear")
    got = nac_fast.nac_loss(a, r, p, keys=keys, noise=noise, reduction="none",
                            likelihood="multilinear")  # auto: the reference
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-11)
    if keys is not None:  # NAC-MQ's rows: the same plus lambda ||z||^2
        mq = nac_fast.nac_mq_loss(a, r, keys, p, l2=0.1, noise=noise, reduction="none",
                                  likelihood="multilinear")
        np.testing.assert_allclose(mq.numpy(), oracle_rows(a, r, noise, p, keys, l2=0.1,
                                                               likelihood="multilinear"),
                                   rtol=1e-12, atol=1e-11)


@pytest.mark.parametrize("p", [0.02, 0.1, 0.25, 0.4, 0.49])
def test_series_length_is_the_shortest_with_its_tail_below_eps(p):
    t = 1 - 2 * p
    for eps in (2.0 ** -24, 2.0 ** -53):
        T = reference.multilinear_terms(t, eps)
        tail = lambda T: t ** (T + 1) / ((T + 1) * (1 - t))  # noqa: E731
        assert tail(T) <= eps and (T == 1 or tail(T - 1) > eps)
        # the bound holds: the true tail of the series at x = -1 (its worst case)
        # (fsum: the partial sum exact to rounding; the float64 rounding of log1p itself allowed)
        true_tail = abs(math.log1p(-t) - math.fsum(-(t ** m) / m for m in range(1, T + 1)))
        assert true_tail <= tail(T) + 4 * 2.0 ** -53 * abs(math.log1p(-t))


def test_a_tiny_p_needs_too_many_terms_and_says_which_p():
    with pytest.raises(ValueError, match="p = 0.001: the multilinear likelihood's series needs"):
        nac_fast.nac_loss(torch.randn(4, 8), torch.randn(4, 8), 0.001, likelihood="multilinear")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_beats_the_naive_same_dtype_form(dtype):
    """Against float64: the series (computed in float32 for every low-precision input) is within
    the float32 budget, and no worse than log1p computed element by element in the input dtype
    plus that budget.  At 97 x 1031 x 128, p = 0.25."""
    a, r, keys, noise = _inputs(97, 1031, 128, 0.25, seed=5)
    q = (noise * torch.tanh(a))
    exact = reference.multilinear_logits_exact(q, keys, 0.5)
    got = reference.multilinear_logits(q.to(dtype), keys.to(dtype), 0.5).double()
    naive = reference.multilinear_logits_exact(q.to(dtype), keys.to(dtype), 0.5).double()
    # the inputs' own rounding is the same for both; what each computation adds is compared
    rounded = reference.multilinear_logits_exact(q.to(dtype).double(), keys.to(dtype).double(),
                                                 0.5)
    err_series = (got - rounded).abs().max().item()
    err_naive = (naive - rounded).abs().max().item()
    budget = 1e-4  # float32 accumulation over T x D = 20 x 128 products of logits of size <~ 30
    assert err_series <= budget, err_series
    assert err_series <= err_naive + budget
    if dtype == torch.bfloat16:  # the naive bf16 form is itself broken; the series is not
        assert err_naive > 10 * err_series
    assert (got - exact).abs().max().item() <= (naive - exact).abs().max().item() + budget
    assert reference.multilinear_logits(q.to(dtype), keys.to(dtype), 0.5).dtype == torch.float32


def test_gradient_equals_the_exact_forms_at_awkward_sizes():
    """The series' gradient (autograd through the powers and one matmul) is the gradient of the
    log1p definition, for the codes and for the keys, at 97 rows x 1031 keys."""
    a, r, keys, noise = _inputs(97, 1031, 16, 0.3, seed=9)
    t = 0.4
    out = []
    for f in (reference.multilinear_logits, reference.multilinear_logits_exact):
        a_ = a.clone().requires_grad_()
        k_ = keys.clone().requires_grad_()
        L = f(noise * torch.tanh(a_), k_, t)
        torch.logsumexp(L, 1).sum().backward()
        out.append((a_.grad, k_.grad))
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_on_binary_codes_it_is_the_dot_likelihood_less_a_constant():
    """At +-1 codes log(1 + t x) = s x - log cosh s: every logit, and so every row, is the dot
    form's less D log cosh s ([M:multilinear])."""
    p, D = 0.25, 12
    a, r, _, noise = _inputs(6, None, D, p, seed=2)
    binary = torch.sign(a) * 40.0  # tanh = +-1 in float64
    dot = nac_fast.nac_loss(binary, r, p, noise=noise, reduction="none", backend="reference")
    ml = nac_fast.nac_loss(binary, r, p, noise=noise, reduction="none", likelihood="multilinear")
    s = 0.5 * math.log((1 - p) / p)
    torch.testing.assert_close(dot - ml, torch.full_like(dot, D * math.log(math.cosh(s))),
                               rtol=0, atol=1e-12)
    # zero codes: both logits are 0, the rows equal
    zero = torch.zeros_like(a)
    torch.testing.assert_close(
        nac_fast.nac_loss(zero, r, p, noise=noise, reduction="none", backend="reference"),
        nac_fast.nac_loss(zero, r, p, noise=noise, reduction="none", likelihood="multilinear"))


def test_relaxed_codes_make_it_differ_from_the_dot_form():
    """Not the dot form under another name: on relaxed codes the two rows differ by more than a
    constant."""
    a, r, _, noise = _inputs(8, None, 16, 0.25, seed=4)
    a = a * 0.3
    dot = nac_fast.nac_loss(a, r, 0.25, noise=noise, reduction="none", backend="reference")
    ml = nac_fast.nac_loss(a, r, 0.25, noise=noise, reduction="none", likelihood="multilinear")
    assert (dot - ml).std().item() > 1e-3


def test_criteria_take_it_and_refuse_a_fused_backend():
    g = torch.Generator().manual_seed(0)
    a0, r0, a1, r1 = (torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(4))
    noise = nac_fast.draw_noise((8, 8), 0.25, dtype=torch.float64, generator=g)
    crit = nac_fast.NACLoss(0.25, likelihood="multilinear")
    assert "likelihood='multilinear'" in repr(crit)
    got = crit((a0, r0), (a1, r1), noise=noise)
    want = nac_fast.nac_loss(torch.cat([a0, a1]), torch.cat([r1, r0]), 0.25, noise=noise,
                             likelihood="multilinear")
    assert got.item() == want.item()
    assert got.item() != nac_fast.NACLoss(0.25)((a0, r0), (a1, r1), noise=noise).item()
    for backend in ("cpu", "triton", "cuda"):
        with pytest.raises(ValueError, match=f"backend '{backend}' has no multilinear"):
            nac_fast.NACLoss(0.25, backend=backend, likelihood="multilinear")
        with pytest.raises(ValueError, match=f"backend '{backend}' has no multilinear"):
            nac_fast.NACMQLoss(0.25, backend=backend, likelihood="multilinear")
        with pytest.raises(ValueError, match=f"backend '{backend}' has no multilinear"):
            nac_fast.nac_loss(a0, r0, 0.25, backend=backend, likelihood="multilinear")
    for bad in ("soft", None, 1):
        with pytest.raises(ValueError, match="likelihood must be one of"):
            nac_fast.NACLoss(0.25, likelihood=bad)
        with pytest.raises(ValueError, match="likelihood must be one of"):
            nac_fast.nac_mq_loss(a0, r0, torch.tanh(a1), 0.25, likelihood=bad)


def test_train_flag(tmp_path, capsys):
    sys.path.insert(0, ROOT)
    import train
    base = ["--data", "synthetic:64", "--batch-size", "32", "--max-steps", "2", "--no-progress",
            "--device", "cpu", "--channel-likelihood", "multilinear"]
    assert train.main(base + ["--out", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "likelihood=multilinear (reference loss: no fused kernel)" in out
    assert train.main(base + ["--out", str(tmp_path / "bad"), "--loss-backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--loss-backend cpu: the fused kernels compute the dot likelihood only" in err
    assert train.main(base[:-1] + ["soft", "--out", str(tmp_path / "bad2")]) == 2
    assert "invalid choice: 'soft'" in capsys.readouterr().err
    # the recipe key
    rec = tmp_path / "r.toml"
    rec.write_text('channel_likelihood = "multilinear"\nflip_prob = 0.25\nepochs = 1\n'
                   'batch_size = 32\n')
    assert train.main(["--config", str(rec), "--data", "synthetic:64", "--max-steps", "1",
                       "--no-progress", "--device", "cpu", "--out", str(tmp_path / "rec")]) == 0
    assert "likelihood=multilinear" in capsys.readouterr().out
