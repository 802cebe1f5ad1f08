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
