"""Audit of nac_fast/eval/metrics.py and the argument checks of nac_fast/ops/retrieval.py:

* kNN [M:knn] against an independent float64 numpy implementation, and a regression test: the
  vote weights exp(s / T) overflowed to inf for T < 1 / 709.78, so every class with a close
  neighbour tied at inf and the lowest class index won.
* The linear probe [M:linear-probe] against torch.optim.SGD (Nesterov) + CosineAnnealingLR +
  nn.functional.cross_entropy, its determinism for a seed, and regression tests for arguments it
  took silently (lr = inf or a NaN / negative momentum trained NaN weights) or failed on with an
  error that did not name them (val_fraction, lrs, seed).
* retrieval_metrics(radius=None) raised "'NoneType' object is not iterable"."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nac_fast as H
from nac_fast.eval.metrics import knn_predict, linear_probe, train_linear_probe


def _np_knn(tr, ytr, te, k, T, C):
    trn = tr / np.linalg.norm(tr, axis=1, keepdims=True)
    ten = te / np.linalg.norm(te, axis=1, keepdims=True)
    s = ten @ trn.T
    out = []
    for row in s:
        idx = np.argsort(-row, kind="stable")[:k]
        w = np.exp((row[idx] - row[idx].max()) / T)
        votes = np.bincount(ytr[idx], weights=w, minlength=C)
        out.append(int(np.argmax(votes)))
    return np.array(out)


@pytest.mark.parametrize("k,T", [(1, 0.1), (7, 0.1), (7, 1.0), (50, 0.01), (300, 0.1)])
def test_knn_matches_an_independent_implementation(k, T):
    rng = np.random.default_rng(k)
    tr = rng.normal(size=(300, 16)).astype(np.float32)
    te = rng.normal(size=(60, 16)).astype(np.float32)
    ytr = rng.integers(0, 5, 300)
    got = knn_predict(torch.from_numpy(tr), torch.from_numpy(ytr), torch.from_numpy(te), k=k,
                      temperature=T)
    want = _np_knn(tr.astype(np.float64), ytr, te.astype(np.float64), k, T, 5)
    assert (got.numpy() == want).mean() >= 0.98  # float32 similarities may reorder a near tie


def test_knn_small_temperature_does_not_overflow():
    """Before the fix: neighbours at cosine 0.98 (class 0) and 0.99 (class 1), T = 0.001: the true
    weights are e^980 and e^990 (class 1 wins by e^10); both overflowed to inf and class 0 won
    the tie."""
    row = lambda s: [s, math.sqrt(1 - s * s)]  # noqa: E731
    tr = torch.tensor([row(0.98), row(0.99)], dtype=torch.float64).float()
    y = torch.tensor([0, 1])
    for T in (0.1, 0.001, 1e-6):
        assert knn_predict(tr, y, torch.tensor([[1.0, 0.0]]), k=2, temperature=T).item() == 1


def test_knn_exact_vote_tie_goes_to_the_lower_class():
    tr = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    assert knn_predict(tr, torch.tensor([3, 1, 0]), torch.tensor([[1.0, 0.0]]), k=2).item() == 1


def test_knn_tie_at_the_kth_similarity_goes_to_the_lower_training_index():
    """Hash codes tie: ten training codes equal to the query, k = 4.  The four that vote are the
    first four in training order ([M:knn]), whatever order torch.topk returns them in; the
    labels make any other choice change the prediction.  Also against the numpy oracle (stable
    argsort) on random +-1 codes, where ties at the k-th similarity are the rule."""
    q = torch.ones(1, 8)
    tr = torch.cat([q.repeat(10, 1), -q.repeat(5, 1)])
    y = torch.tensor([2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    for order in (torch.arange(15), torch.tensor([9, 8, 7, 6, 5, 4, 0, 1, 2, 3, 10, 11, 12, 13,
                                                  14])):
        # permuted training order: the first four equal codes in the new order vote
        want = int(y[order][:10][:4].mode().values)
        assert knn_predict(tr[order], y[order], q, k=4).item() == want
    rng = np.random.default_rng(0)
    tr = np.where(rng.random((400, 12)) < 0.5, -1.0, 1.0).astype(np.float32)
    te = np.where(rng.random((50, 12)) < 0.5, -1.0, 1.0).astype(np.float32)
    ytr = rng.integers(0, 6, 400)
    for k in (1, 5, 37):
        got = knn_predict(torch.from_numpy(tr), torch.from_numpy(ytr), torch.from_numpy(te),
                          k=k, temperature=0.1, chunk_size=7)
        want = _np_knn(tr.astype(np.float64), ytr, te.astype(np.float64), k, 0.1, 6)
        assert (got.numpy() == want).all()


@pytest.mark.parametrize("lr", [0.1, 1.0])
def test_linear_probe_matches_torch_optim(lr):
    rng = np.random.default_rng(0)
    n, d, C, bs, epochs, seed = 200, 8, 3, 64, 3, 3
    x = torch.tensor(rng.normal(size=(n, d)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, C, n))
    got = train_linear_probe(x, y, lr=lr, epochs=epochs, batch_size=bs, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(d, C)
    with torch.no_grad():
        bound = 1 / math.sqrt(d)
        lin.weight.copy_(torch.empty(C, d).uniform_(-bound, bound, generator=gen))
        lin.bias.zero_()
    opt = torch.optim.SGD(lin.parameters(), lr=lr, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * math.ceil(n / bs))
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, bs):
            idx = perm[s:s + bs]
            opt.zero_grad()
            F.cross_entropy(lin(x[idx]), y[idx]).backward()
            opt.step()
            sched.step()
    torch.testing.assert_close(got.weight, lin.weight, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.bias, lin.bias, atol=1e-5, rtol=0)


def test_linear_probe_is_deterministic_for_a_seed():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 6, generator=g), torch.randint(0, 3, (120,), generator=g)
    a = linear_probe(x, y, x[:30], y[:30], epochs=2, seed=4)
    b = linear_probe(x, y, x[:30], y[:30], epochs=2, seed=np.int64(4))
    assert a.val_accuracy == b.val_accuracy and a.best_lr == b.best_lr
    assert torch.equal(a.model.weight, b.model.weight)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(lr=math.inf), ValueError, "lr must be a finite positive number"),
    (dict(momentum=math.nan), ValueError, "momentum must be"),
    (dict(momentum=-0.5), ValueError, "momentum must be"),
    (dict(momentum=1.0), ValueError, "momentum must be"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
])
def test_train_linear_probe_refuses_bad_arguments(kw, exc, match):
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    with pytest.raises(exc, match=match):
        train_linear_probe(x, y, epochs=1, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(lrs=(0.1, math.inf)), ValueError, "lr must be a finite positive number"),
    (dict(lrs=0.1), TypeError, "lrs must be a sequence"),
    (dict(val_fraction="0.1"), ValueError, "val_fraction must be"),
    (dict(seed=None), TypeError, "seed must be an int"),
])
def test_linear_probe_refuses_bad_arguments(kw, exc, match):
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    with pytest.raises(exc, match=match):
        linear_probe(x, y, x, y, epochs=1, **kw)


def test_retrieval_metrics_radius_none_names_the_argument():
    q = torch.ones(2, 8)
    g = torch.ones(3, 8)
    with pytest.raises(TypeError, match="radius must be an int or a sequence"):
        H.retrieval_metrics(q, torch.zeros(2, dtype=torch.long), g, torch.zeros(3, dtype=torch.long),
                            radius=None, backend="reference")


def test_numpy_integers_count_as_ints_where_the_index_takes_them():
    """topk's and knn_predict's k take a numpy int as HashIndex.search's does, with the same
    result as the int; a float or a bool is still a TypeError naming k."""
    g = torch.randint(0, 2, (40, 24)).float() * 2 - 1
    q = g[:5]
    d, i = H.topk(q, g, np.int64(3))
    d2, i2 = H.topk(q, g, 3)
    assert torch.equal(d, d2) and torch.equal(i, i2)
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.arange(30) % 3
    assert torch.equal(knn_predict(x, y, x[:7], k=np.int32(5)), knn_predict(x, y, x[:7], k=5))
    for bad in (3.0, True):
        with pytest.raises(TypeError, match="k must be an int"):
            H.topk(q, g, bad)
        with pytest.raises(TypeError, match="k must be an int"):
            knn_predict(x, y, x[:7], k=bad)
