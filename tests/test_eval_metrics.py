"""Tests of nac_fast.eval.metrics (kNN and linear probe) on synthetic features."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from nac_fast.eval import metrics as E


def blobs(n_per_class: int, classes: int, dim: int, spread: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 3
    y = torch.arange(classes).repeat_interleave(n_per_class)
    x = centers[y] + spread * torch.randn(len(y), dim, generator=g)
    perm = torch.randperm(len(y), generator=g)
    return x[perm], y[perm]


def np_knn(tr, ytr, te, k, t, C):
    """Brute force from the definition: cosine similarities, k largest, exp(s/t) weighted votes,
    ties to the lower class."""
    trn = tr / np.linalg.norm(tr, axis=1, keepdims=True)
    ten = te / np.linalg.norm(te, axis=1, keepdims=True)
    preds = []
    for row in ten @ trn.T:
        top = np.argsort(-row, kind="stable")[:k]
        votes = np.zeros(C)
        for j in top:
            votes[ytr[j]] += np.exp(row[j] / t)
        preds.append(int(np.argmax(votes)))
    return np.array(preds)


def test_knn_matches_brute_force():
    rng = np.random.default_rng(0)
    tr = rng.normal(size=(300, 16))
    ytr = rng.integers(0, 5, 300)
    te = rng.normal(size=(70, 16))
    for k, t in ((1, 0.1), (7, 0.07), (200, 0.5), (300, 1.0)):
        got = E.knn_predict(torch.tensor(tr), torch.tensor(ytr), torch.tensor(te), k=k,
                            temperature=t, chunk_size=32)
        np.testing.assert_array_equal(got.numpy(), np_knn(tr, ytr, te, k, t, 5), err_msg=f"k={k}")


def test_knn_temperature_weighting_changes_the_vote():
    # Query along e0: one very similar class-1 item, two less similar class-0 items.
    tr = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8]])
    y = torch.tensor([1, 0, 0])
    q = torch.tensor([[1.0, 0.0]])
    # weights exp(1/t) vs 2 exp(0.6/t): class 1 wins for small t, class 0 for large t
    assert E.knn_predict(tr, y, q, k=3, temperature=0.1).item() == 1
    assert E.knn_predict(tr, y, q, k=3, temperature=10.0).item() == 0


def test_knn_separable_clusters():
    x, y = blobs(100, 4, 8, 0.3, seed=1)
    assert E.knn_accuracy(x[:300], y[:300], x[300:], y[300:], k=20) == 1.0


def test_linear_probe_recovers_separable_set():
    x, y = blobs(250, 4, 10, 1.0, seed=2)
    res = E.linear_probe(x[:800], y[:800], x[800:], y[800:], epochs=10)
    assert set(res.val_accuracy) == {0.01, 0.1, 1.0, 10.0}
    assert res.val_accuracy[res.best_lr] == max(res.val_accuracy.values())
    assert res.test_accuracy >= 0.98
    # chance is 0.25: a probe on labels shuffled against the features cannot do this
    yr = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(0))]
    shuffled = E.linear_probe(x[:800], yr[:800], x[800:], yr[800:], epochs=5, lrs=(0.1,))
    assert shuffled.test_accuracy < 0.5


def test_linear_probe_is_deterministic():
    x, y = blobs(50, 3, 6, 2.0, seed=3)
    a = E.train_linear_probe(x, y, lr=0.1, epochs=3, seed=5)
    b = E.train_linear_probe(x, y, lr=0.1, epochs=3, seed=5)
    c = E.train_linear_probe(x, y, lr=0.1, epochs=3, seed=6)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.weight, c.weight)


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, y: E.knn_predict(x, y, x[:, :3]), ValueError, "test_features"),
    (lambda x, y: E.knn_predict(x, y[:5], x), ValueError, "train_labels"),
    (lambda x, y: E.knn_predict(x, y.float(), x), TypeError, "train_labels"),
    (lambda x, y: E.knn_predict(x.long(), y, x), TypeError, "train_features"),
    (lambda x, y: E.knn_predict(x, y, x, k=11), ValueError, "k must be in"),
    (lambda x, y: E.knn_predict(x, y, x, k=3, temperature=0.0), ValueError, "temperature"),
    (lambda x, y: E.knn_predict(x[:0], y[:0], x), ValueError, "train_features"),
    (lambda x, y: E.knn_predict(x, y - 5, x), ValueError, "non-negative"),
    (lambda x, y: E.train_linear_probe(x, y, num_classes=1), ValueError, "num_classes"),
    (lambda x, y: E.train_linear_probe(x * float("nan"), y), ValueError, "NaN"),
    (lambda x, y: E.linear_probe(x, y, x, y, val_fraction=1.5), ValueError, "val_fraction"),
    (lambda x, y: E.linear_probe(x, y, x, y[:3]), ValueError, "test_labels"),
])
def test_bad_inputs(call, exc, match):
    x = torch.randn(10, 4)
    y = torch.arange(10) % 3
    with pytest.raises(exc, match=match):
        call(x, y)


def test_retrieval_split():
    y = torch.arange(3).repeat_interleave(torch.tensor([20, 25, 30]))
    y = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(1))]
    sp = E.retrieval_split(y, queries_per_class=5, train_per_class=8, seed=3)
    q, g, t = sp["query"], sp["gallery"], sp["train"]
    assert torch.bincount(y[q]).tolist() == [5, 5, 5]
    assert torch.bincount(y[t]).tolist() == [8, 8, 8]
    assert len(set(q.tolist()) & set(g.tolist())) == 0 and len(q) + len(g) == len(y)
    assert set(t.tolist()) <= set(g.tolist())
    assert torch.equal(g, torch.sort(g).values)
    again = E.retrieval_split(y, queries_per_class=5, train_per_class=8, seed=3)
    assert all(torch.equal(sp[k], again[k]) for k in sp)
    other = E.retrieval_split(y, queries_per_class=5, train_per_class=8, seed=4)
    assert not torch.equal(sp["query"], other["query"])
    assert len(E.retrieval_split(y, queries_per_class=5, train_per_class=None)["train"]) == 0
    with pytest.raises(ValueError, match="class 0 has 20 items"):
        E.retrieval_split(y, queries_per_class=15, train_per_class=8)
    with pytest.raises(ValueError, match="labels"):
        E.retrieval_split(y.float())


# --------------------------------------------------------------------------------------------
# ITQ (docs/math.md [M:itq])
# --------------------------------------------------------------------------------------------

def _rotated_hypercube(n, k, noise, seed):
    """Binary codes B0 hidden behind a random rotation, per-bit scales and offsets."""
    g = torch.Generator().manual_seed(seed)
    b0 = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0).double()
    r0 = torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))[0]
    a = (b0 + noise * torch.randn(n, k, generator=g, dtype=torch.float64)) @ r0.T
    return b0, a * torch.linspace(0.5, 3.0, k, dtype=torch.float64) + 7.0


@pytest.mark.parametrize("k", [1, 3, 8])
def test_itq_recovers_codes_hidden_by_a_rotation(k):
    b0, a = _rotated_hypercube(4099, k, 0.15, seed=k)
    fit = E.itq_fit(a, seed=0, iters=50)
    rot = fit["rotation"]
    assert torch.allclose(rot.T @ rot, torch.eye(k, dtype=torch.float64), atol=1e-10)
    err = fit["quant_error"]
    assert len(err) == 50 and all(e2 <= e1 + 1e-9 for e1, e2 in zip(err, err[1:]))  # monotone
    c = E.itq_codes(a, fit)
    assert c.dtype == torch.int8 and set(c.unique().tolist()) <= {-1, 1}
    c = c.double()
    # each ITQ bit is one hidden bit up to its sign (a signed permutation of B0)
    agree = (c.T @ b0).abs() / len(b0)
    assert agree.max(1).values.min() > 0.97 and agree.max(0).values.min() > 0.97
    # the plain signs of the rotated codes do not recover them (else the test proves nothing)
    if k > 1:
        plain = torch.where(a - a.mean(0) >= 0, 1.0, -1.0).double()
        assert ((plain.T @ b0).abs() / len(b0)).max(1).values.min() < 0.9


def test_itq_codes_use_the_fit_and_check_their_inputs():
    _, a = _rotated_hypercube(500, 4, 0.1, seed=1)
    fit = E.itq_fit(a, max_rows=97, seed=3)  # a seeded row subset
    assert fit["mean"].shape == (4,) and torch.equal(fit["rotation"],
                                                    E.itq_fit(a, max_rows=97, seed=3)["rotation"])
    x = (a - fit["mean"]) / fit["std"]
    assert torch.equal(E.itq_codes(a, fit), torch.where(x @ fit["rotation"] >= 0, 1, -1)
                       .to(torch.int8))
    const = torch.ones(10, 2, dtype=torch.float64)  # zero-variance bits: no division by 0
    assert torch.equal(E.itq_codes(const, E.itq_fit(const)).abs(), torch.ones(10, 2, dtype=torch.int8))
    with pytest.raises(TypeError, match="a must"):
        E.itq_fit(a.numpy())
    with pytest.raises(TypeError, match="a must"):
        E.itq_fit(a.long())
    with pytest.raises(ValueError, match="at least 2 rows"):
        E.itq_fit(a[:1])
    for bad in ({"iters": 0}, {"max_rows": -1}, {"iters": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            E.itq_fit(a, **bad)
    with pytest.raises(ValueError, match="a has 3 columns"):
        E.itq_codes(a[:, :3], fit)


def _probe_one_at_a_time(x, y, C, lr, epochs, batch_size, seed):
    """The linear probe as it was trained before the rates were batched: nn.Linear,
    torch.optim.SGD (Nesterov 0.9), CosineAnnealingLR per iteration, autograd (the oracle)."""
    import math
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(x.shape[1], C)
    with torch.no_grad():
        bound = 1.0 / math.sqrt(x.shape[1])
        model.weight.copy_(torch.empty_like(model.weight).uniform_(-bound, bound, generator=gen))
        model.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    n = x.shape[0]
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=epochs * math.ceil(n / batch_size))
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return model


def test_batched_rates_equal_separate_runs():
    """All rates of the lr search trained as one batched layer give the weights of the separate
    torch.optim runs (same init, same batches; float32 rounding only), including a last batch
    smaller than the others (97 rows, batch 32)."""
    x, y = blobs(25, 4, 7, 1.5, seed=11)
    x, y = x[:97], y[:97]
    lrs = (0.01, 0.1, 1.0, 10.0)
    got = E._fit_linear(x, y, 4, lrs, epochs=4, batch_size=32, momentum=0.9, seed=3)
    for lr, m in zip(lrs, got):
        want = _probe_one_at_a_time(x, y, 4, lr, 4, 32, 3)
        scale = want.weight.abs().max().item()
        assert torch.allclose(m.weight, want.weight, rtol=1e-4, atol=1e-5 * scale), lr
        assert torch.allclose(m.bias, want.bias, rtol=1e-4, atol=1e-5 * scale), lr
