"""Tests of nac_fast.eval.metrics (kNN and linear probe) on synthetic features."""
from __future__ import annotations

import re

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


def test_knn_streamed_train_chunks_give_the_unbounded_predictions():
    """device_mem bounds kNN's device memory: the train features (16 bits, on the host) are
    streamed in whole blocks of KNN_TRAIN_BLOCK rows, each test chunk's top-k merged with each
    block's; a tie at the k-th similarity still goes to the lowest train index (+-1 codes tie
    all the time), so the predictions are the unbounded run's, bit for bit."""
    g = torch.Generator().manual_seed(0)
    n, d, m, k = 5000, 32, 700, 50
    cases = [(torch.randn(n, d, generator=g).half(), torch.randn(m, d, generator=g).half()),
             (torch.where(torch.rand(n, d, generator=g) < 0.5, -1.0, 1.0),
              torch.where(torch.rand(m, d, generator=g) < 0.5, -1.0, 1.0))]
    y = torch.randint(0, 10, (n,), generator=g)
    for tr, te in cases:
        ref = E.knn_predict(tr, y, te, k=k, chunk_size=256)
        for mem, rows in ((6_000_000, 1024), (12_000_000, 2048), (20_000_000, 4096)):
            plan = E.knn_plan(n, d, k=k, chunk_size=256, device_mem=mem)
            assert plan["train_chunk"] == rows and plan["device_bytes"] <= mem
            got = E.knn_predict(tr, y, te, k=k, chunk_size=256, device_mem=mem)
            assert torch.equal(got, ref), (tr.dtype, mem)
    assert E.knn_plan(n, d, k=k, chunk_size=256, device_mem="1G")["train_chunk"] == n
    with pytest.raises(ValueError, match="device_mem .* too small for kNN"):
        E.knn_predict(tr, y, te, k=k, chunk_size=256, device_mem="1M")


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


# --------------------------------------------------------------------------------------------
# The probe at full size (issue 55): 16-bit or memmapped features, no copies, no one-hot,
# streamed chunks.  The reference is the probe as it was before (main at 46d7d72), kept here.
# --------------------------------------------------------------------------------------------

def _reference_fit(x, y, C, lrs, epochs, batch_size, momentum, seed):
    """metrics._fit_linear before issue 55: float32 x copied whole, dense one-hot."""
    import math
    n, d = x.shape
    L = len(lrs)
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(d)
    w0 = torch.empty(C, d).uniform_(-bound, bound, generator=gen)
    W = w0.T.unsqueeze(1).repeat(1, L, 1).contiguous()
    b = torch.zeros(L, C)
    bW, bb = torch.zeros_like(W), torch.zeros_like(b)
    lr0 = torch.tensor([float(v) for v in lrs])
    onehot = torch.nn.functional.one_hot(y, C).to(x.dtype)
    steps = epochs * math.ceil(n / batch_size)
    Wf, bWf = W.view(d, L * C), bW.view(d, L * C)
    t = 0
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, batch_size):
            idx = perm[s:s + batch_size]
            xb, m = x[idx], idx.numel()
            logits = (xb @ Wf).view(m, L, C) + b
            g = (torch.softmax(logits, dim=-1) - onehot[idx][:, None, :]).div_(m)
            gW = xb.T @ g.view(m, L * C)
            gb = g.sum(0)
            bWf.mul_(momentum).add_(gW)
            bb.mul_(momentum).add_(gb)
            lr_t = (lr0 * (0.5 * (1.0 + math.cos(math.pi * t / steps)))).view(L, 1)
            Wf.sub_((gW.add_(bWf, alpha=momentum).view(d, L, C) * lr_t).view(d, L * C))
            b.sub_(gb.add_(bb, alpha=momentum) * lr_t)
            t += 1
    return W, b


def _reference_probe(tr, ytr, te, yte, lrs, epochs, batch_size, seed):
    """metrics.linear_probe before issue 55 (tr[fit_idx].float() copies, a one-hot): (held-out
    accuracies, best lr, final W (d, C), final b, test accuracy)."""
    n_val = max(1, int(round(0.1 * tr.shape[0])))
    C = int(max(ytr.max(), yte.max())) + 1
    perm = torch.randperm(tr.shape[0], generator=torch.Generator().manual_seed(seed))
    val_idx, fit_idx = perm[:n_val], perm[n_val:]
    W, b = _reference_fit(tr[fit_idx].float(), ytr[fit_idx], C, lrs, epochs, batch_size, 0.9, seed)
    xv = tr[val_idx].float()
    val = {lr: float(((xv @ W[:, i, :] + b[i]).argmax(1) == ytr[val_idx]).double().mean())
           for i, lr in enumerate(lrs)}
    best = min(lrs, key=lambda lr: (-val[lr], lr))
    W, b = _reference_fit(tr.float(), ytr, C, [best], epochs, batch_size, 0.9, seed)
    acc = float(((te.float() @ W[:, 0, :] + b[0]).argmax(1) == yte).double().mean())
    return val, best, W[:, 0, :], b[0], acc


def _probe_data():
    x, y = blobs(150, 6, 12, 2.5, seed=21)
    return x[:750], y[:750], x[750:], y[750:]


def test_probe_float32_is_the_reference_bit_for_bit():
    """Index lists instead of copies and the one-hot subtracted by index change nothing: float32
    features give the reference probe's weights exactly (the 1e-6 of issue 55, with 0)."""
    tr, ytr, te, yte = _probe_data()
    val, best, W, b, acc = _reference_probe(tr, ytr, te, yte, (0.01, 0.1, 1.0, 10.0), 3, 64, 4)
    got = E.linear_probe(tr, ytr, te, yte, epochs=3, batch_size=64, seed=4)
    assert got.val_accuracy == val and got.best_lr == best and got.test_accuracy == acc
    assert torch.equal(got.model.weight, W.T) and torch.equal(got.model.bias, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_probe_16_bit_is_the_reference_on_the_rounded_features(dtype):
    """16-bit storage: the probe upcasts each batch, so it is exactly the reference probe run on
    the features rounded to 16 bits.  The rounding itself moves the weights by about one rounding
    unit of the storage, relative to their scale (here 4.3e-4 for float16, unit 2^-11 = 4.9e-4;
    4.1e-3 for bfloat16, unit 2^-8 = 3.9e-3; bound: 4 units), and leaves the chosen rate and the
    test accuracy as they are."""
    tr, ytr, te, yte = _probe_data()
    tr16, te16 = tr.to(dtype), te.to(dtype)
    val, best, W, b, acc = _reference_probe(tr16.float(), ytr, te16.float(), yte,
                                            (0.01, 0.1, 1.0, 10.0), 3, 64, 4)
    got = E.linear_probe(tr16, ytr, te16, yte, epochs=3, batch_size=64, seed=4)
    assert got.val_accuracy == val and got.best_lr == best and got.test_accuracy == acc
    assert torch.equal(got.model.weight, W.T) and torch.equal(got.model.bias, b)
    val32, best32, W32, _, acc32 = _reference_probe(tr, ytr, te, yte, (0.01, 0.1, 1.0, 10.0),
                                                    3, 64, 4)
    assert (best, acc) == (best32, acc32)
    rel = ((got.model.weight - W32.T).abs().max() / W32.abs().max()).item()
    assert 0 < rel < (2e-3 if dtype == torch.float16 else 1.6e-2), rel


def test_probe_streamed_chunks_equal_the_in_memory_epoch():
    """A device-memory bound smaller than the features streams them in chunks of whole batches
    (here 2 batches of 64 per chunk, the last chunk and batch partial): the same batches in the
    same order, so the same weights bit for bit, and the plan says so."""
    tr, ytr, te, yte = _probe_data()
    tr16 = tr.half()
    d, n = tr.shape[1], tr.shape[0]
    budget = E._probe_state_bytes(n, d, 1, 6, 64) + 150 * d * 2   # 150 rows -> 128 (2 batches)
    plan = E.probe_plan(n, d, 2, num_rates=1, num_classes=6, batch_size=64, device_mem=budget)
    assert plan["stream"] and plan["chunk"] == 128
    assert plan["device_bytes"] <= budget
    rows = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:700]
    want = E._fit_linear(tr16, ytr, 6, [0.5], epochs=2, batch_size=64, momentum=0.9, seed=1,
                         rows=rows)[0]
    got_plan = {}
    got = E._fit_linear(tr16, ytr, 6, [0.5], epochs=2, batch_size=64, momentum=0.9, seed=1,
                        rows=rows, device_mem=budget, stream=True, plan_out=got_plan)[0]
    assert got_plan["stream"] and got_plan["chunk"] == 128
    assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)
    res = E.linear_probe(tr16, ytr, te.half(), yte, epochs=2, batch_size=64, seed=4,
                         device_mem=E._probe_state_bytes(n, d, 4, 6, 64) + 200 * d * 2,
                         stream=True)
    ref = E.linear_probe(tr16, ytr, te.half(), yte, epochs=2, batch_size=64, seed=4)
    assert res.plan["stream"] and res.val_accuracy == ref.val_accuracy
    assert torch.equal(res.model.weight, ref.model.weight)


def test_probe_plan_and_device_mem_errors():
    # ImageNet: 1.28M x 2048 16-bit features are 5.2 GB; a 4 GB bound streams them
    p = E.probe_plan(1281167, 2048, 2, num_rates=4, num_classes=1000, device_mem="4G")
    assert p["stream"] and p["device_bytes"] <= 4 << 30 and p["chunk"] % 256 == 0
    p = E.probe_plan(1281167, 2048, 2, num_rates=4, num_classes=1000, device_mem="8G")
    assert not p["stream"] and p["feature_bytes"] == 1281167 * 2048 * 2
    assert E.parse_bytes("x", "512M") == 512 << 20 and E.parse_bytes("x", "1.5k") == 1536
    with pytest.raises(ValueError, match="device_mem .* too small"):
        E.probe_plan(1000, 2048, 2, num_rates=4, num_classes=1000, device_mem="1M")
    x, y = torch.randn(20, 4), torch.arange(20) % 3
    for bad, exc in (("eight", ValueError), (-5, ValueError), (1.5, TypeError)):
        with pytest.raises(exc, match="device_mem"):
            E.linear_probe(x, y, x, y, device_mem=bad, epochs=1)


def test_feature_buffer_fills_in_place_and_memmaps(tmp_path):
    from nac_fast.eval.features import FeatureBuffer, open_features
    x = torch.randn(10, 3) * 100
    buf = FeatureBuffer(10, 3)
    base = buf.tensor.data_ptr()
    buf.write(x[:4])
    with pytest.raises(ValueError, match="4 of 10 rows written"):
        buf.commit()
    buf.write(x[4:])
    got = buf.commit()
    assert got.dtype == torch.float16 and got.data_ptr() == base   # no second buffer
    assert torch.equal(got, x.half())
    with pytest.raises(ValueError, match="exceed"):
        buf.write(x[:1])
    big = FeatureBuffer(3, 2, name="h train")
    with pytest.raises(ValueError, match=r"h train: row 2 holds .*float16's range"):
        big.write(torch.tensor([[1.0, 2.0], [3.0, 4.0], [7e4, 0.0]]))
    assert big.filled == 0
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        big.write(torch.tensor([[1.0, 2.0], [float("nan"), 4.0]]))
    path = str(tmp_path / "h.npy")
    mm = FeatureBuffer(10, 3, path=path)
    mm.write(x)
    assert not (tmp_path / "h.npy").exists() and (tmp_path / "h.npy.partial").exists()
    mm.commit()
    assert not (tmp_path / "h.npy.partial").exists()
    back = open_features(path)
    assert torch.equal(back, x.half())
    with pytest.raises(ValueError, match="exists"):
        FeatureBuffer(10, 3, path=path)
    with pytest.raises(ValueError, match="bfloat16"):
        FeatureBuffer(10, 3, torch.bfloat16, path=str(tmp_path / "b.npy"))
    # rows written by id (a rank's share), each once; NaN kept for a later check if asked
    part = FeatureBuffer(4, 3, nonfinite="keep")
    part.write(x[[1, 3]], rows=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="written twice"):
        part.write(x[:1], rows=torch.tensor([3]))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 4\)"):
        part.write(x[:1], rows=torch.tensor([4]))
    part.write(torch.tensor([[float("nan"), 0.0, 1.0], [1.0, 2.0, 3.0]]),
               rows=torch.tensor([2, 0]))
    got = part.commit()
    assert torch.equal(got[[1, 3]], x[[1, 3]].half()) and torch.isnan(got[2, 0])
    with pytest.raises(ValueError, match="row 0 holds a value beyond"):
        FeatureBuffer(1, 2, nonfinite="keep").write(torch.tensor([[1e5, 0.0]]))
    # the probe trains on the memmap in place, as on the in-memory tensor
    y = torch.arange(10) % 2
    a = E.train_linear_probe(back, y, epochs=2, batch_size=4)
    b = E.train_linear_probe(x.half(), y, epochs=2, batch_size=4)
    assert torch.equal(a.weight, b.weight)


# --------------------------------------------------------------------------------------------
# ImageNet-100 hashing protocol: list files and the seeded rule (nac_fast.eval.hashlists)
# --------------------------------------------------------------------------------------------

def _write_list(path, rows):
    path.write_text("".join(f"{p} {' '.join(map(str, v))}\n" for p, v in rows))
    return str(path)


def test_hash_lists_parse_and_match(tmp_path):
    from nac_fast.eval import hashlists as H
    hot = lambda c, C=4: [int(i == c) for i in range(C)]  # noqa: E731
    f = _write_list(tmp_path / "test.txt", [("val_image/ILSVRC2012_val_00000003.JPEG", hot(2)),
                                            ("val_image/ILSVRC2012_val_00000001.JPEG", hot(0))])
    paths, y = H.read_list(f)
    assert paths[0].endswith("00000003.JPEG") and y.tolist() == [2, 0]
    split = ["/d/val/n1/ILSVRC2012_val_00000001.JPEG", "/d/val/n3/ILSVRC2012_val_00000003.JPEG"]
    assert H.match_list(paths, split).tolist() == [1, 0]
    multi = _write_list(tmp_path / "m.txt", [("a.jpg", [1, 1, 0]), ("b.jpg", [0, 0, 1])])
    _, ym = H.read_list(multi)
    assert ym.dtype == torch.int8 and ym.tolist() == [[1, 1, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match=r"--hash-query-list .*test.txt: row 2: .*00000001"):
        H.match_list(paths, split[1:], flag="--hash-query-list", path=f)


@pytest.mark.parametrize("text, match", [
    ("a.jpg 0 1\nb.jpg 0 1 0\n", r"row 2: 3 label entries, the first row has 2"),
    ("a.jpg 0 1\nb.jpg\n", r"row 2: expected '<path> <0/1 label vector>'"),
    ("a.jpg 0 1\n\nb.jpg 0 2\n", r"row 3: label entries must be 0 or 1, got '2'"),
    ("a.jpg 0 0\n", r"row 1: the label vector has no 1"),
    ("a.jpg 0 1\na.jpg 1 0\n", r"row 2: 'a.jpg' is listed again \(first at row 1\)"),
    ("\n", r"no rows"),
])
def test_hash_list_errors_name_the_file_and_row(tmp_path, text, match):
    from nac_fast.eval import hashlists as H
    p = tmp_path / "database.txt"
    p.write_text(text)
    with pytest.raises(ValueError, match=r"--hash-database-list .*database.txt: " + match):
        H.read_list(str(p), flag="--hash-database-list")
    with pytest.raises(ValueError, match="cannot be read"):
        H.read_list(str(tmp_path / "missing.txt"))


def test_imagenet100_seeded_rule():
    from nac_fast.eval import hashlists as H
    g = torch.Generator().manual_seed(0)
    ytr = torch.arange(20).repeat_interleave(torch.randint(8, 12, (20,), generator=g))
    ytr = ytr[torch.randperm(len(ytr), generator=g)]
    yva = torch.arange(20).repeat_interleave(3)
    s = H.imagenet100_split(ytr, yva, classes=5, train_per_class=4, seed=7)
    cls = s["classes"]
    assert len(cls) == 5 and torch.equal(cls, cls.sort().values)
    assert torch.equal(s["database"], torch.isin(ytr, cls).nonzero().squeeze(1))
    assert torch.equal(s["query"], torch.isin(yva, cls).nonzero().squeeze(1))
    assert len(s["query"]) == 15
    assert torch.bincount(ytr[s["train"]], minlength=20)[cls].tolist() == [4] * 5
    assert set(s["train"].tolist()) <= set(s["database"].tolist())
    again = H.imagenet100_split(ytr, yva, classes=5, train_per_class=4, seed=7)
    assert all(torch.equal(s[k], again[k]) for k in s)
    other = H.imagenet100_split(ytr, yva, classes=5, train_per_class=4, seed=8)
    assert not torch.equal(s["classes"], other["classes"])
    with pytest.raises(ValueError, match="fewer than train_per_class 50"):
        H.imagenet100_split(ytr, yva, classes=5, train_per_class=50)
    with pytest.raises(ValueError, match="classes 21 exceeds the 20"):
        H.imagenet100_split(ytr, yva, classes=21)


# --------------------------------------------------------------------------------------------
# The augmented probe (nac_fast.eval.augprobe): fresh crops every epoch through the encoder
# --------------------------------------------------------------------------------------------

class _PixelEncoder(torch.nn.Module):
    """encode(x) = (the pixels, None): the augmented probe's features are then its views."""

    def encode(self, x):
        return x.flatten(1), None


def _fmnist_loader(split, limit):
    from nac_fast.data import build_eval_loader
    return build_eval_loader("fashion-mnist", split, batch_size=64, limit=limit)


def test_augmented_probe_is_the_cached_probe_on_its_crops():
    """One epoch of the augmented probe is metrics._fit_linear (same init, permutation, steps)
    on the crops of that epoch: the crops are drawn per (seed, epoch, image) and each differs
    from the centre view and from the next epoch's."""
    from nac_fast.eval import augprobe as A
    ld = _fmnist_loader("train", 120)
    views = A._Views(ld, 5, torch.device("cpu"), 0)
    x0 = torch.cat(list(views.batches(0, [ld.indices[:50], ld.indices[50:]])))
    x0b = next(views.batches(0, [ld.indices]))
    x1 = next(views.batches(1, [ld.indices]))
    assert torch.allclose(x0, x0b, atol=1e-6) and not torch.allclose(x0, x1, atol=0.1)
    centre = torch.cat([x for x, _ in ld])
    assert (x0 - centre).abs().mean() > 0.1
    y = torch.as_tensor(ld.source.labels[ld.indices])
    rows = torch.randperm(120, generator=torch.Generator().manual_seed(1))[:100]
    got = A._fit_augmented(_PixelEncoder(), views, ld.indices, y, rows, 10, [0.1, 1.0], epochs=1,
                           batch_size=32, seed=3, device=torch.device("cpu"), progress=False,
                           desc="")
    want = E._fit_linear(x0b.flatten(1), y, 10, [0.1, 1.0], epochs=1, batch_size=32,
                         momentum=0.9, seed=3, rows=rows)
    for g, w in zip(got, want):
        assert torch.allclose(g.weight, w.weight, atol=1e-6) and torch.allclose(g.bias, w.bias,
                                                                               atol=1e-6)


def test_augmented_probe_on_a_tiny_checkpoint(tmp_path):
    """The whole path on a train.py checkpoint: frozen encoder, crops, lr search on the cached
    centre features, final fit, test score; bad inputs named."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train  # train.py lives at the repository root
    from nac_fast.eval.augprobe import augmented_linear_probe
    from nac_fast.eval.cli import extract_features
    from nac_fast.train.checkpoint import load_model
    assert train.main(["--max-steps", "1", "--batch-size", "32", "--code-dim", "16", "--out",
                       str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    model = load_model(str(tmp_path / "last.pt"), "online").eval()
    ld, lt = _fmnist_loader("train", 24), _fmnist_loader("test", 10)
    tr = extract_features(model, ld, 24, "cpu", False, "")
    te = extract_features(model, lt, 10, "cpu", False, "")
    run = lambda **kw: augmented_linear_probe(model, ld, tr["h"], tr["labels"], te["h"],  # noqa
                                              te["labels"], epochs=1, batch_size=8, **kw)
    a = run(lrs=(0.1, 1.0))
    assert set(a.val_accuracy) == {0.1, 1.0} and 0 <= a.test_accuracy <= 1
    assert a.plan["protocol"] == "augmented" and a.model.weight.shape[1] == tr["h"].shape[1]
    one = run(lrs=(0.5,))
    assert one.val_accuracy == {} and one.best_lr == 0.5   # one rate: no search
    with pytest.raises(ValueError, match="train_loader has 10 images, train_h 24 rows"):
        augmented_linear_probe(model, lt, tr["h"], tr["labels"], te["h"], te["labels"])
    with pytest.raises(ValueError, match="num_workers"):
        run(num_workers=-1)


@pytest.mark.parametrize("extra, match", [
    (["--hash-database-list", "{db}", "--hash-query-list", "{q}"],
     r"--hash-database-list .*database.txt: row 2: 3 label entries, the first row has 2"),
    (["--hash-query-list", "{q}"], "--hash-database-list and --hash-query-list go together"),
    (["--hash-classes", "0"], "--hash-classes 0"),
    (["--probe-device-mem", "lots"], "--probe-device-mem must be a byte count"),
    (["--probe", "augmented", "--probe-device-mem", "1G"], "--probe-device-mem bounds"),
])
def test_cli_list_and_probe_flags_stop_before_any_work(tmp_path, capsys, extra, match):
    """Bad list files and probe flags: one line naming the flag, the file and the row, exit
    status 2, before the checkpoint is even loaded (a placeholder file stands in for it)."""
    from nac_fast.eval import cli
    ck = tmp_path / "ck.pt"
    ck.write_bytes(b"not loaded")
    db = _write_list(tmp_path / "database.txt", [("a.JPEG", [1, 0]), ("b.JPEG", [0, 1, 0])])
    q = _write_list(tmp_path / "test.txt", [("c.JPEG", [1, 0])])
    argv = ["--checkpoint", str(ck), "--out", str(tmp_path / "out"), "--hash-protocol",
            "imagenet100"] + [a.format(db=db, q=q) for a in extra]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()


def test_imagenet100_sets_from_lists_and_rule(tmp_path):
    """The CLI's imagenet100 sets: list rows matched by file name to the feature rows of the
    train (database) and val (query) splits, the lists' labels; a training list must lie in the
    database; without lists the seeded rule on the extracted labels."""
    from types import SimpleNamespace as NS
    from nac_fast.eval import hashlists as H
    train_files = [f"/data/train/n{c}/n{c}_{i}.JPEG" for c in range(3) for i in range(140)]
    val_files = [f"/data/val/ILSVRC2012_val_{i:08d}.JPEG" for i in range(6)]
    loader = lambda files: (NS(source=NS(files=files), indices=np.arange(len(files))),  # noqa
                            len(files))
    ytr = torch.arange(3).repeat_interleave(140)
    tr = {"a": torch.randn(420, 8), "labels": ytr}
    te = {"a": torch.randn(6, 8), "labels": torch.tensor([0, 1, 2, 0, 1, 2])}
    hot = lambda c: [int(i == c) for i in range(3)]  # noqa: E731
    db = _write_list(tmp_path / "database.txt", [(f"image/n{c}_{i}.JPEG", hot(c))
                                                 for c in (2, 0) for i in range(5)])
    q = _write_list(tmp_path / "test.txt", [("val_image/ILSVRC2012_val_00000004.JPEG", hot(1))])
    t = _write_list(tmp_path / "train.txt", [("image/n0_3.JPEG", hot(0))])
    args = NS(hash_protocol="imagenet100", hash_database_list=db, hash_query_list=q,
              hash_train_list=t, hash_classes=None, split_seed=None, seed=0,
              split_loaders={"train": loader(train_files), "test": loader(val_files)})
    H.check_list_flags(args)
    qa, ql, ga, gl, info = H.imagenet100_sets(args, tr, te)
    assert torch.equal(qa, te["a"][[4]]) and ql.tolist() == [1]
    assert torch.equal(ga[:5], tr["a"][280:285]) and torch.equal(ga[5:], tr["a"][:5])
    assert gl.tolist() == [2] * 5 + [0] * 5 and info["train_list"]["images"] == 1
    _write_list(tmp_path / "train.txt", [("image/n1_3.JPEG", hot(1))])
    H.check_list_flags(args)
    with pytest.raises(ValueError, match=r"--hash-train-list .*train.txt: row 1: .*n1_3.JPEG' is "
                                         r"not in the database list"):
        H.imagenet100_sets(args, tr, te)
    # an image extraction skipped (undecodable) shifts the rows after it against the file
    # names: the CLI records it with the features (skipped_files), the lists refuse them
    for key, flag, split in (("tr", "--hash-database-list", "train"),
                             ("te", "--hash-query-list", "val")):
        bad = {"tr": tr, "te": te}
        bad[key] = {**bad[key], "skipped_files": ["/data/x/n1_7.JPEG", "/data/x/n2_1.JPEG"]}
        with pytest.raises(ValueError, match=rf"^{flag}: the {split} split's image "
                                             r"'/data/x/n1_7.JPEG' could not be decoded .*\(2 "):
            H.imagenet100_sets(args, bad["tr"], bad["te"])
    rule = NS(**{**vars(args), "hash_database_list": None, "hash_query_list": None,
                 "hash_train_list": None, "hash_classes": 2})
    H.check_list_flags(rule)
    qa, ql, ga, gl, info = H.imagenet100_sets(rule, tr, te)
    assert len(info["classes"]) == 2 and set(gl.tolist()) == set(info["classes"])
    assert ga.shape == (280, 8) and len(ql) == 4 and info["train_subset"]["images"] == 260
    with pytest.raises(ValueError, match="--hash-protocol imagenet100: .*130 training images"):
        H.imagenet100_sets(NS(**{**vars(rule), "hash_classes": 3}),
                           {"a": tr["a"][::2], "labels": ytr[::2]}, te)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _augmented_fit(world=1, rank=0):
    from nac_fast.eval import augprobe as A
    ld = _fmnist_loader("train", 65)   # the last global batch of 32 has 1 row: rank 1 none
    y = torch.as_tensor(ld.source.labels[ld.indices])
    views = A._Views(ld, 2, torch.device("cpu"), 0)
    m = A._fit_augmented(_PixelEncoder(), views, ld.indices, y, torch.arange(65), 10, [0.3, 3.0],
                         epochs=2, batch_size=32, seed=1, device=torch.device("cpu"),
                         progress=False, desc="")
    return torch.stack([x.weight for x in m]).detach(), torch.stack([x.bias for x in m]).detach()


def _augmented_worker(rank, port, out):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        torch.save(_augmented_fit(), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # two spawned processes (as the multi-process train.py tests: 30-70 s here)
def test_augmented_probe_under_a_process_group_takes_the_whole_batch_step(tmp_path):
    """Two gloo processes: each encodes half of every global batch (rows rank::2; rank 1's share
    of the last batch is empty and it still joins the all-reduce) and the gradients are summed
    before the step, so both end with the one-process weights (float32 summation order only)
    and with each other's exactly."""
    import torch.multiprocessing as mp
    mp.spawn(_augmented_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    w0, b0 = torch.load(tmp_path / "rank0.pt")
    w1, b1 = torch.load(tmp_path / "rank1.pt")
    assert torch.equal(w0, w1) and torch.equal(b0, b1)
    w, b = _augmented_fit()
    scale = w.abs().max()   # float32 sums in another order: ~5e-6 of the weights' scale here
    assert torch.allclose(w0, w, atol=2e-5 * scale) and torch.allclose(b0, b, atol=2e-5 * scale)
    assert not torch.equal(w, torch.zeros_like(w))


# ------------------------------------------------------------------------------------------
# kNN [M:knn] against an independent float64 numpy implementation; the linear probe
# [M:linear-probe] against torch.optim.SGD (Nesterov) + CosineAnnealingLR +
# nn.functional.cross_entropy, and the arguments it took silently or refused without naming them
# ------------------------------------------------------------------------------------------

import math  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from nac_fast.eval.metrics import knn_predict, linear_probe, train_linear_probe  # noqa: E402


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
    """The vote weights exp(s / T) overflowed to inf for T < 1 / 709.78, so every class with a
    close neighbour tied at inf and the lowest class index won.  Before the fix: neighbours at
    cosine 0.98 (class 0) and 0.99 (class 1), T = 0.001: the true weights are e^980 and e^990
    (class 1 wins by e^10); both overflowed to inf and class 0 won the tie."""
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
    _check_random_codes_against_the_oracle()


def _check_random_codes_against_the_oracle():
    """knn_predict on random +-1 codes (ties at the k-th similarity are the rule) against the
    numpy oracle's stable argsort, k = 1, 5, 37."""
    rng = np.random.default_rng(0)
    tr = np.where(rng.random((400, 12)) < 0.5, -1.0, 1.0).astype(np.float32)
    te = np.where(rng.random((50, 12)) < 0.5, -1.0, 1.0).astype(np.float32)
    ytr = rng.integers(0, 6, 400)
    for k in (1, 5, 37):
        got = knn_predict(torch.from_numpy(tr), torch.from_numpy(ytr), torch.from_numpy(te),
                          k=k, temperature=0.1, chunk_size=7)
        want = _np_knn(tr.astype(np.float64), ytr, te.astype(np.float64), k, 0.1, 6)
        assert (got.numpy() == want).all(), (k, np.nonzero(got.numpy() != want)[0])


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
    """Before the fix: lr = inf or a NaN / negative momentum trained NaN weights, and a float
    seed failed with an error that did not name it."""
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
    """Before the fix: lrs, val_fraction and seed failed with errors that did not name them."""
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    with pytest.raises(exc, match=match):
        linear_probe(x, y, x, y, epochs=1, **kw)


@pytest.mark.parametrize("threads", [1, 2])
def test_knn_ties_of_codes_are_ties_at_any_thread_count(threads):
    """Codes of +-1 tie in their cosine similarities, and [M:knn] sends a tie at the k-th
    similarity to the lower training index.  Similarities taken as products of L2-normalised rows
    came out one ulp apart for equal codes' dot products, depending on the GEMM's summation
    order: on one thread (make test's pytest-xdist workers) query 47 below lost its tie rule and
    voted 1 where the float64 oracle says 2; on two threads it passed.  Now (q . t) / (|q| |t|):
    an integer dot product over equal norms, the same bits whatever the order."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_random_codes_against_the_oracle()
    finally:
        torch.set_num_threads(before)
