"""Evaluation metrics on given (cached) feature tensors: kNN classification and a linear probe.

    from nac_fast.eval.metrics import knn_accuracy, linear_probe
    acc = knn_accuracy(train_h, train_y, test_h, test_y, k=200, temperature=0.1)
    res = linear_probe(train_h, train_y, test_h, test_y)   # lr searched on a held-out split
    res.test_accuracy, res.best_lr, res.val_accuracy

Protocols (docs/math.md):

* kNN: docs/math.md [M:knn] (the weighted kNN of Wu et al. 2018 used by SimCLR/MoCo-style
  evaluations).
* Linear probe: docs/math.md [M:linear-probe], on frozen features.
* ITQ (an opt-in post-processing of the hash codes, not NAC's code): docs/math.md [M:itq].

Both work on any device the tensors live on; memory stays bounded by chunking the test set.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import torch

from .. import _checks
from ..data.sources.subset import class_split

__all__ = ["knn_predict", "knn_plan", "knn_accuracy", "train_linear_probe", "linear_predict",
           "accuracy", "linear_probe",
           "LinearProbeResult", "retrieval_split", "itq_fit", "itq_codes"]


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------

def _features(name: str, x, rows: int | None = None, dim: int | None = None) -> torch.Tensor:
    _checks.tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D (n, d) tensor, got shape "
                         f"{tuple(x.shape)}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected {rows}")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name} has {x.shape[1]} columns but the training features have {dim}")
    if not all_finite(x):
        raise ValueError(f"{name} contains NaN or inf")
    return x.detach()


def all_finite(x: torch.Tensor, block_bytes: int = 1 << 22) -> bool:
    """Whether every entry of a 2-D tensor is finite, checked a block of rows at a time (a
    whole-tensor torch.isfinite of 1.28M x 2048 features would be a 2.6 GB mask)."""
    step = max(1, block_bytes // max(1, x.shape[1]))
    return all(bool(torch.isfinite(x[s:s + step]).all()) for s in range(0, x.shape[0], step))


def _labels(name: str, y, rows: int) -> torch.Tensor:
    _checks.tensor(name, y)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer class ids, got {y.dtype}")
    if y.dim() != 1 or y.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows},) to match the features, got "
                         f"{tuple(y.shape)}")
    if bool((y < 0).any()):
        raise ValueError(f"{name} must be non-negative class ids")
    return y.detach().to(torch.int64)


def _num_classes(num_classes, *labels: torch.Tensor) -> int:
    top = max(int(y.max()) for y in labels) + 1
    if num_classes is None:
        return top
    if not _checks.is_int(num_classes) or num_classes < top:
        raise ValueError(f"num_classes must be an int >= {top} (largest label + 1), got "
                         f"{num_classes!r}")
    return num_classes


# --------------------------------------------------------------------------------------------
# kNN
# --------------------------------------------------------------------------------------------

# Streamed kNN's train chunks are whole blocks of this many rows: the similarity products keep
# large shapes, for which the CPU's matrix product gives each entry bit for bit as the whole
# product does (tested; a product only a few columns wide is computed otherwise and can differ in
# the last bit, which could flip an exact near-tie).
KNN_TRAIN_BLOCK = 1024


def knn_plan(n_train: int, d: int, *, k: int, chunk_size: int = 1024, device_mem=None) -> dict:
    """How :func:`knn_predict` holds the train features on its device under a budget of
    ``device_mem`` bytes (None: no bound): {"train_chunk": train rows per streamed chunk (all of
    them when they fit), "device_bytes": the planned peak}.  A train row costs its normalized
    float32 copy (4 d) and its column of a test chunk's similarities and of the merge with the
    running top-k (chunk_size (4 + 4 + 8) bytes); the running top-k (values and indices) of a
    test chunk and its votes are fixed.  Streamed chunks are whole KNN_TRAIN_BLOCKs; too small a
    budget for one is a ValueError naming device_mem."""
    per_row = 4 * d + 16 * chunk_size
    fixed = chunk_size * (4 * d + 24 * k) + 16 * chunk_size * k
    if device_mem is None:
        return {"train_chunk": n_train, "device_bytes": fixed + per_row * n_train}
    budget = _parse_bytes("device_mem", device_mem)
    rows = (budget - fixed) // per_row
    if rows < n_train:  # streamed: whole blocks (the products' shapes stay large)
        if rows < KNN_TRAIN_BLOCK:
            raise ValueError(f"device_mem {device_mem!r} ({budget} bytes) is too small for kNN: "
                             f"a test chunk of {chunk_size}, its top-{k} and a streamed block "
                             f"of {KNN_TRAIN_BLOCK} train rows take "
                             f"{fixed + per_row * KNN_TRAIN_BLOCK} bytes")
        rows = rows // KNN_TRAIN_BLOCK * KNN_TRAIN_BLOCK
    rows = int(min(rows, n_train))
    return {"train_chunk": rows, "device_bytes": fixed + per_row * rows}


def knn_predict(train_features, train_labels, test_features, *, k: int = 200,
                temperature: float = 0.1, num_classes: int | None = None,
                chunk_size: int = 1024, progress: bool = False, device=None,
                device_mem=None) -> torch.Tensor:
    """Weighted kNN predictions (int64, one per test row, on ``device``); see the module
    docstring.

    ``k`` must be in [1, n_train].  Similarity matrices are built ``chunk_size`` test rows at a
    time.  ``device`` (default: the train features' device) computes them; the features may
    live elsewhere (host memory, 16 bits, a memmap): they are moved and upcast a chunk at a
    time.  ``device_mem`` (bytes or "8G"; None: no bound) bounds the device memory
    (:func:`knn_plan`): the train features are then streamed in chunks of rows, each test
    chunk's top-k merged with each train chunk's (a tie at the k-th similarity still goes to
    the lowest train index, the merge keeping the earlier rows first), so the predictions are
    those of the unbounded run, bit for bit (tests/test_eval_metrics.py)."""
    tr = _features("train_features", train_features)
    ytr = _labels("train_labels", train_labels, tr.shape[0])
    te = _features("test_features", test_features, dim=tr.shape[1])
    k = _checks.integer("k", k, numpy=True)
    if not 1 <= k <= tr.shape[0]:
        raise ValueError(f"k must be in [1, {tr.shape[0]}] (the training set size), got {k}")
    _checks.positive_number("temperature", temperature)
    _checks.positive_int("chunk_size", chunk_size)
    C = _num_classes(num_classes, ytr)
    dev = tr.device if device is None else torch.device(device)
    n = tr.shape[0]
    step = knn_plan(n, tr.shape[1], k=k, chunk_size=min(chunk_size, te.shape[0]),
                    device_mem=device_mem)["train_chunk"]
    ytr = ytr.to(dev)
    from tqdm.auto import tqdm
    # Cosine similarity as (q . t) / (|q| |t|), not as a product of normalised rows: equal
    # similarities then come out equal (codes of +-1: the dot product is an exact integer,
    # every norm the same), so the tie rule below sees the ties; normalised rows gave them one
    # ulp apart, depending on the GEMM's summation order (one thread against two) ([M:knn]).
    trn = _rows(tr.to(dev)) if step >= n else None  # resident: once
    out = []
    for s in tqdm(range(0, te.shape[0], chunk_size), desc=f"kNN (k={k})", unit="chunk",
                  disable=not progress, leave=False, file=sys.stderr):
        q = _rows(te[s:s + chunk_size].to(dev))
        if trn is not None:
            top_sim, top_idx = _topk_lowest_index(_cosine(q, trn), k)
        else:
            top_sim = top_idx = None
            for t in range(0, n, step):
                sim = _cosine(q, _rows(tr[t:t + step].to(dev)))
                if top_sim is not None:
                    # the running top-k first, in ascending train index: a position's order is
                    # then its index's, which _topk_lowest_index's tie rule goes by
                    sim = torch.cat([top_sim, sim], 1)
                vals, pos = _topk_lowest_index(sim, min(k, sim.shape[1]))
                r = 0 if top_idx is None else top_idx.shape[1]
                idx = pos - r + t
                if top_idx is not None:
                    idx = torch.where(pos < r, top_idx.gather(1, pos.clamp(max=r - 1)), idx)
                order = idx.argsort(dim=1)
                top_sim, top_idx = vals.gather(1, order), idx.gather(1, order)
                del sim
            # by similarity, largest first, as topk gives them: each class's votes are then
            # summed in the same order as the unbounded run's (equal weights may swap)
            order = top_sim.argsort(dim=1, descending=True, stable=True)
            top_sim, top_idx = top_sim.gather(1, order), top_idx.gather(1, order)
        votes = torch.zeros(q[0].shape[0], C, dtype=torch.float64, device=dev)
        # Weights in float64: exp(1/0.1) ~ 2e4 per vote, summed over 200 votes, stays exact
        # enough that near-ties are decided by the weights, not by rounding.  They are taken
        # relative to the row's largest similarity, exp((s - s_max) / T) (the same vote up to a
        # factor per row, so the same winner): exp(s / T) itself overflows to inf for
        # T < 1 / 709.78, and classes tied at inf would go to the lower index.
        sd = top_sim.double()
        votes.scatter_add_(1, ytr[top_idx],
                           torch.exp((sd - sd.amax(1, keepdim=True)) / temperature))
        out.append(votes.argmax(1))  # first maximum: ties go to the lower class index
    return torch.cat(out)


def _rows(x: torch.Tensor):
    """(x as float32, its rows' L2 norms clamped at 1e-12, F.normalize's eps)."""
    x = x.float()
    return x, torch.linalg.vector_norm(x, dim=1).clamp_min(1e-12)


def _cosine(q, t) -> torch.Tensor:
    """Cosine similarities of _rows q and t: (q . t) / (|q| |t|)."""
    return (q[0] @ t[0].T).div_(q[1][:, None] * t[1][None, :])


def _topk_lowest_index(sim: torch.Tensor, k: int):
    """(values, indices) of the k largest entries of each row of `sim`, a tie at the k-th value
    going to the lower index ([M:knn]).  torch.topk leaves that tie's order unspecified (it
    differs between devices and sizes), and hash codes' similarities tie often.  Rows where
    more than k entries reach the k-th value are re-selected: every entry above it, then the
    lowest-index entries equal to it."""
    top_sim, top_idx = sim.topk(k, dim=1)
    kth = top_sim[:, -1:]
    tied = (sim >= kth).sum(1) > k
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        s, t = sim[rows], kth[rows]
        above = s > t
        need = k - above.sum(1, keepdim=True)
        eq = s == t
        take = above | (eq & (eq.cumsum(1) <= need))
        idx = take.nonzero()[:, 1].view(len(rows), k)  # row-major: ascending index per row
        val = s.gather(1, idx)
        order = val.argsort(dim=1, descending=True, stable=True)
        top_idx[rows] = idx.gather(1, order)
        top_sim[rows] = val.gather(1, order)
    return top_sim, top_idx


def accuracy(pred: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy in [0, 1]."""
    if pred.shape != labels.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and labels {tuple(labels.shape)} differ")
    return float((pred == labels.to(pred.device)).double().mean())


def knn_accuracy(train_features, train_labels, test_features, test_labels, **kw) -> float:
    """Top-1 accuracy of :func:`knn_predict` on the test set."""
    te = _features("test_features", test_features)
    yte = _labels("test_labels", test_labels, te.shape[0])
    return accuracy(knn_predict(train_features, train_labels, te, **kw), yte)


# --------------------------------------------------------------------------------------------
# Linear probe
# --------------------------------------------------------------------------------------------

def _parse_bytes(name: str, v) -> int:
    """A byte count: an int, or a string such as "8G", "512M", "64k" (powers of 1024)."""
    if _checks.is_int(v, numpy=True) and not isinstance(v, bool):
        n = int(v)
    elif isinstance(v, str):
        t = v.strip().upper().removesuffix("B").removesuffix("I")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
        try:
            n = int(float(t[:-1] if mult > 1 else t) * mult)
        except ValueError:
            raise ValueError(f"{name} must be a byte count such as 8G, 512M or 1000000, got "
                             f"{v!r}") from None
    else:
        raise TypeError(f"{name} must be an int or a string such as '8G', got {v!r}")
    if n < 1:
        raise ValueError(f"{name} must be positive, got {v!r}")
    return n


parse_bytes = _parse_bytes


def _probe_state_bytes(n: int, d: int, L: int, C: int, batch_size: int) -> int:
    """Device bytes of the probe besides the features: W, its momentum and the step's gradient
    and update temporaries (5 d L C floats), the bias terms, a step's logits / probabilities
    (3 m L C), the batch upcast to float32 (m d), and the labels and one epoch's order (int64)."""
    return 4 * (5 * d * L * C + 4 * L * C + 3 * batch_size * L * C + batch_size * d) + 16 * n


class _Feed:
    """The training rows of one probe fit, batch by batch, on the training device ``dev``.

    Resident: the features live on ``dev`` (already there, or copied there once in their own
    dtype) and each batch is gathered there.  Streamed: they stay where they are (host memory,
    a memmap) and every ``chunk`` rows of an epoch's order (a whole number of batches) are
    gathered into a host staging buffer (pinned for CUDA; two of them, so the host fills one
    while the device copies from the other) and copied to one device buffer of ``chunk``
    rows; the batches are then slices of it.  Either way a batch holds the same rows in the same
    order, upcast to float32 the same way: the epochs are the same, bit for bit."""

    def __init__(self, x, y, dev, *, stream, chunk):
        self.x, self.dev, self.stream = x, dev, stream
        self.y = y.to(dev)
        if not stream:
            self.x = x if x.device == dev else x.to(dev)   # its own dtype: 16 bits stay 16
            return
        self.chunk = chunk
        pin = dev.type == "cuda"
        self.stage = [torch.empty(chunk, x.shape[1], dtype=x.dtype, pin_memory=pin)
                      for _ in range(2 if pin else 1)]
        self.events = [None] * len(self.stage)
        self.buf = torch.empty(chunk, x.shape[1], dtype=x.dtype, device=dev)
        self.k = 0

    def chunks(self, order: torch.Tensor, batch_size: int):
        """(x rows, labels) of consecutive pieces of ``order`` (row ids, CPU int64): the whole
        order at once when resident, else ``chunk`` rows at a time."""
        if not self.stream:
            o = order.to(self.dev)
            yield _Rows(self.x, o), self.y[o]
            return
        for s in range(0, order.numel(), self.chunk):
            o = order[s:s + self.chunk]
            i = self.k % len(self.stage)
            self.k += 1
            if self.events[i] is not None:
                self.events[i].synchronize()   # its previous copy to the device has finished
            st = self.stage[i][:o.numel()]
            torch.index_select(self.x, 0, o.to(self.x.device), out=st)
            buf = self.buf[:o.numel()]
            buf.copy_(st, non_blocking=True)
            if self.dev.type == "cuda":
                self.events[i] = torch.cuda.Event()
                self.events[i].record()
            yield _Slices(buf), self.y[o.to(self.dev)]


class _Rows:
    """Batches gathered from resident features: rows ``order[s:e]``."""

    def __init__(self, x, order):
        self.x, self.order = x, order

    def __len__(self):
        return self.order.numel()

    def batch(self, s, e):
        return self.x[self.order[s:e]].float()


class _Slices:
    """Batches that are slices of a streamed chunk (already in order)."""

    def __init__(self, buf):
        self.buf = buf

    def __len__(self):
        return self.buf.shape[0]

    def batch(self, s, e):
        return self.buf[s:e].float()


def probe_plan(n: int, d: int, itemsize: int, *, num_rates: int, num_classes: int,
               batch_size: int = 256, device_mem=None, on_device: bool = False) -> dict:
    """How a probe fit holds ``n`` x ``d`` features of ``itemsize`` bytes on its device under a
    budget of ``device_mem`` bytes (None: no bound): {"stream": bool, "chunk": rows per
    streamed chunk, "feature_bytes", "state_bytes", "device_bytes": the planned total}.
    Features already on the device (``on_device``) are used where they are.  Too small a budget
    for the probe's state and one batch is a ValueError naming device_mem."""
    state = _probe_state_bytes(n, d, num_rates, num_classes, batch_size)
    feat = n * d * itemsize
    if on_device or device_mem is None:
        return {"stream": False, "chunk": n, "feature_bytes": feat, "state_bytes": state,
                "device_bytes": state + (0 if on_device else feat)}
    budget = _parse_bytes("device_mem", device_mem)
    if state + feat <= budget:
        return {"stream": False, "chunk": n, "feature_bytes": feat, "state_bytes": state,
                "device_bytes": state + feat}
    rows = (budget - state) // (d * itemsize) // batch_size * batch_size
    if rows < batch_size:
        need = state + batch_size * d * itemsize
        raise ValueError(f"device_mem {device_mem!r} ({budget} bytes) is too small for the linear "
                         f"probe: its state and one streamed batch of {batch_size} x {d} features "
                         f"take {need} bytes")
    return {"stream": True, "chunk": int(min(rows, n)), "feature_bytes": feat,
            "state_bytes": state, "device_bytes": state + int(min(rows, n)) * d * itemsize}


def _fit_linear(x, y, C: int, lrs, *, epochs: int, batch_size: int, momentum: float, seed: int,
                progress: bool = False, desc: str = "linear probe", rows=None, device=None,
                device_mem=None, stream=None, plan_out=None):
    """Train one linear classifier per learning rate in ``lrs`` on the same data order, as one
    batched layer: W (d, L, C), b (L, C).  SGD with Nesterov momentum (PyTorch's update:
    buf = m buf + g, p -= lr_t (g + m buf)), cosine schedule per iteration lr_t = lr (1 +
    cos(pi t / T)) / 2 (CosineAnnealingLR, eta_min 0), mean cross-entropy, no weight decay;
    gradients in closed form, (softmax - onehot) / batch, the onehot subtracted at the label's
    index (no dense one-hot).  Every rate starts from the same uniform(-1/sqrt(d), 1/sqrt(d))
    weights (zero bias) and sees the same per-epoch permutations, all drawn from ``seed``: the
    L runs are exactly the L separate runs, in one pass.

    ``x`` (N, d): any float dtype (16-bit storage is upcast to float32 a batch at a time), on any
    device, a memmap's tensor included; it is never copied whole on the host.  ``rows``: the
    training rows (int64 ids into x; None: all), gathered a batch at a time in place of a copy
    x[rows].  ``device``: where to train (default x's).  ``device_mem`` / ``stream``: see
    :func:`probe_plan` (``stream`` True / False forces the mode, for tests); a streamed epoch
    is the resident epoch, bit for bit (:class:`_Feed`)."""
    N, d = x.shape
    n = N if rows is None else int(rows.numel())
    L = len(lrs)
    dev = x.device if device is None else torch.device(device)
    # the plan of all N rows: a resident copy holds x whole (the held-out rows too)
    plan = probe_plan(N, d, x.element_size(), num_rates=L, num_classes=C, batch_size=batch_size,
                      device_mem=device_mem, on_device=x.device == dev and stream is None)
    if stream is not None:
        plan["stream"] = bool(stream)
    plan["chunk"] = min(plan["chunk"], n)
    if plan_out is not None:
        plan_out.update(plan)
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(d)
    w0 = torch.empty(C, d).uniform_(-bound, bound, generator=gen)  # nn.Linear's (C, d) layout
    W = w0.T.to(dev).unsqueeze(1).repeat(1, L, 1).contiguous()      # (d, L, C)
    b = torch.zeros(L, C, device=dev)
    bW, bb = torch.zeros_like(W), torch.zeros_like(b)
    lr0 = torch.tensor([float(v) for v in lrs], device=dev)
    steps = epochs * math.ceil(n / batch_size)
    Wf, bWf = W.view(d, L * C), bW.view(d, L * C)
    # One thread: the per-step ops are tiny (256 x d x 4C), and a second OpenMP thread only adds
    # a wait per op; on a busy machine that wait was 200x the work (bench/results/eval_cpu.md).
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        feed = _Feed(x, y, dev, stream=plan["stream"], chunk=plan["chunk"])
        rows = None if rows is None else rows.to("cpu", torch.int64)
        _sgd_epochs(feed, n, W, b, bW, bb, Wf, bWf, lr0, gen, epochs, batch_size, momentum,
                    steps, progress, desc, rows)
    finally:
        torch.set_num_threads(threads)
    return _layers(W, b)


def _layers(W: torch.Tensor, b: torch.Tensor) -> list:
    """The L linear layers (eval mode, on W's device) of the rates trained together:
    W (d, L, C) and b (L, C) as _sgd_step updates them."""
    d, L, C = W.shape
    models = []
    for l in range(L):
        lin = torch.nn.Linear(d, C).to(W.device)
        with torch.no_grad():
            lin.weight.copy_(W[:, l, :].T)
            lin.bias.copy_(b[l])
        models.append(lin.eval())
    return models


def _sgd_epochs(feed, n, W, b, bW, bb, Wf, bWf, lr0, gen, epochs, batch_size, momentum, steps,
                progress, desc, rows):
    from tqdm.auto import tqdm
    t = 0
    with tqdm(total=epochs, desc=desc, unit="epoch", disable=not progress, leave=False,
              file=sys.stderr) as bar:
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen)
            order = perm if rows is None else rows[perm]
            for xs, ys in feed.chunks(order, batch_size):
                for s in range(0, len(xs), batch_size):
                    _sgd_step(xs.batch(s, s + batch_size), ys[s:s + batch_size], W, b, bW, bb,
                              Wf, bWf, lr0, t, steps, momentum)
                    t += 1
            bar.update(1)


def _sgd_step(xb, yb, W, b, bW, bb, Wf, bWf, lr0, t, steps, momentum, total=None, reduce=None):
    """One step of :func:`_fit_linear`'s batched SGD on the float32 batch ``xb`` (m, d) with
    class ids ``yb``.  ``total``: the batch's size over all processes when ``xb`` is this
    process's share of it (default m); ``reduce``: sums the gradient over the processes
    (an all-reduce), so that every process takes the step of the whole batch."""
    d = W.shape[0]
    L, C = b.shape
    m = xb.shape[0]
    logits = (xb @ Wf).view(m, L, C) + b
    g = torch.softmax(logits, dim=-1)
    g[torch.arange(m, device=g.device), :, yb] -= 1.0   # - onehot, by index
    g.div_(m if total is None else total)
    gW = xb.T @ g.view(m, L * C)                       # (d, L C)
    gb = g.sum(0)                                        # (L, C)
    if reduce is not None:
        reduce(gW, gb)
    bWf.mul_(momentum).add_(gW)
    bb.mul_(momentum).add_(gb)
    lr_t = (lr0 * (0.5 * (1.0 + math.cos(math.pi * t / steps)))).view(L, 1)
    Wf.sub_((gW.add_(bWf, alpha=momentum).view(d, L, C) * lr_t).view(d, L * C))
    b.sub_(gb.add_(bb, alpha=momentum) * lr_t)


def _check_probe_args(lr_list, epochs, batch_size, momentum=0.9, seed=0):
    for lr in lr_list:
        # finite: lr = inf passes "positive" but trains NaN weights (a probe that predicts class 0)
        if not _checks.is_number(lr) or not 0 < lr < math.inf:
            raise ValueError(f"lr must be a finite positive number, got {lr!r}")
    _checks.positive_int("epochs", epochs)
    _checks.positive_int("batch_size", batch_size)
    if not _checks.is_number(momentum) or not 0 <= momentum < 1:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    return _checks.integer("seed", seed, numpy=True)  # (a numpy int as an int: manual_seed)


def train_linear_probe(features, labels, *, num_classes: int | None = None, lr: float = 0.1,
                       epochs: int = 100, batch_size: int = 256, momentum: float = 0.9,
                       seed: int = 0, progress: bool = False, device=None, device_mem=None,
                       stream=None) -> torch.nn.Linear:
    """A linear classifier trained on fixed features: SGD, Nesterov momentum, cosine schedule
    stepped per iteration, cross-entropy, no weight decay.  Deterministic for a given seed.
    (One rate of :func:`_fit_linear`, which trains several at once; ``device``, ``device_mem``,
    ``stream`` as there.)"""
    x = _features("features", features)
    y = _labels("labels", labels, x.shape[0])
    seed = _check_probe_args([lr], epochs, batch_size, momentum, seed)
    C = _num_classes(num_classes, y)
    return _fit_linear(x, y, C, [lr], epochs=epochs, batch_size=batch_size,
                       momentum=momentum, seed=seed, progress=progress, device=device,
                       device_mem=device_mem, stream=stream)[0]


def linear_predict(model: torch.nn.Linear, x: torch.Tensor, chunk: int = 2048,
                   rows=None) -> torch.Tensor:
    """The class a fitted probe (:func:`train_linear_probe`) predicts for each row of x (or for
    x[rows]), in chunks of `chunk` rows, each moved to the model's device and upcast to float32
    there (x may be 16-bit, on the host, a memmap's).  2048 rows: a chunk's 1000-class logits
    are 8 MB; at 8192 rows (33 MB, just under glibc's largest mmap threshold) the freed chunks
    fragmented the heap and a probe on 1.28M rows peaked ~190 MB higher per call
    (bench/results/eval_probe_cpu.md)."""
    dev = model.weight.device
    n = x.shape[0] if rows is None else int(rows.numel())
    out = torch.empty(n, dtype=torch.int64, device=dev)
    # one float32 input and one logits buffer for all chunks (nn.Linear's own addmm, into
    # them): no allocation per chunk for the allocator to keep
    fb = torch.empty(min(chunk, n), x.shape[1], device=dev)
    lb = torch.empty(min(chunk, n), model.weight.shape[0], device=dev)
    gb = None if rows is None else torch.empty(min(chunk, n), x.shape[1], dtype=x.dtype,
                                                device=x.device)
    with torch.no_grad():
        for s in range(0, n, chunk):
            if rows is None:
                xb = x[s:s + chunk]
            else:
                idx = rows[s:s + chunk].to(x.device)
                xb = torch.index_select(x, 0, idx, out=gb[:idx.numel()])
            m = xb.shape[0]
            fb[:m].copy_(xb)
            torch.addmm(model.bias, fb[:m], model.weight.t(), out=lb[:m])
            torch.argmax(lb[:m], 1, out=out[s:s + m])
    return out


@dataclasses.dataclass
class LinearProbeResult:
    test_accuracy: float
    best_lr: float
    val_accuracy: dict  # lr -> held-out accuracy
    model: torch.nn.Linear
    plan: dict = dataclasses.field(default_factory=dict)  # probe_plan of the final fit


def linear_probe(train_features, train_labels, test_features, test_labels, *,
                 lrs=(0.01, 0.1, 1.0, 10.0), val_fraction: float = 0.1, epochs: int = 100,
                 batch_size: int = 256, seed: int = 0, progress: bool = False, device=None,
                 device_mem=None, stream=None) -> LinearProbeResult:
    """The paper's linear evaluation on cached features (see the module docstring).

    The held-out split is a seeded random ``val_fraction`` of the training rows; the best rate
    (highest held-out accuracy, the smaller rate on a tie) is retrained on all training rows.
    The rates of the search train together as one batched layer (:func:`_fit_linear`: the same
    runs as one at a time, in one pass over the data); ``progress``: tqdm bars over the epochs.

    Full size: the features may be 16-bit (float16 / bfloat16: upcast to float32 a batch at a
    time, so the probe is today's on the rounded features) and a memmap's tensor; the held-out
    and fitting rows are index lists, never copies.  ``device``: where to train (default the
    features' device); ``device_mem`` (bytes, or "8G"): the device memory the fit may take;
    features that do not fit in it stay on the host and are streamed in chunks, with the same
    epochs as in memory (:func:`probe_plan`, :class:`_Feed`)."""
    tr = _features("train_features", train_features)
    ytr = _labels("train_labels", train_labels, tr.shape[0])
    te = _features("test_features", test_features, dim=tr.shape[1])
    yte = _labels("test_labels", test_labels, te.shape[0])
    if not _checks.is_number(val_fraction) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    try:
        lrs = tuple(lrs)
    except TypeError:
        raise TypeError(f"lrs must be a sequence of learning rates, got {lrs!r}") from None
    if not lrs:
        raise ValueError("lrs must name at least one learning rate")
    seed = _check_probe_args(lrs, epochs, batch_size, 0.9, seed)
    if device_mem is not None:
        _parse_bytes("device_mem", device_mem)
    n_val = max(1, int(round(val_fraction * tr.shape[0])))
    if n_val >= tr.shape[0]:
        raise ValueError(f"the training set ({tr.shape[0]} rows) is too small to hold out "
                         f"{n_val} rows for the learning-rate search")
    C = _num_classes(None, ytr, yte)
    perm = torch.randperm(tr.shape[0], generator=torch.Generator().manual_seed(seed))
    val_idx, fit_idx = perm[:n_val], perm[n_val:]
    kw = dict(epochs=epochs, batch_size=batch_size, momentum=0.9, seed=seed, progress=progress,
              device=device, device_mem=device_mem, stream=stream)
    searched = _fit_linear(tr, ytr, C, lrs, rows=fit_idx,
                           desc=f"linear probe: lr search ({len(lrs)} rates at once)", **kw)
    yv = ytr[val_idx.to(ytr.device)]
    val_acc = {lr: accuracy(linear_predict(m, tr, rows=val_idx), yv)
               for lr, m in zip(lrs, searched)}
    best = min(lrs, key=lambda lr: (-val_acc[lr], lr))
    plan = {}
    model = _fit_linear(tr, ytr, C, [best], desc=f"linear probe: final fit, lr {best:g}",
                        plan_out=plan, **kw)[0]
    return LinearProbeResult(accuracy(linear_predict(model, te), yte), best, val_acc, model, plan)


# --------------------------------------------------------------------------------------------
# Hash-retrieval protocol split
# --------------------------------------------------------------------------------------------

def retrieval_split(labels, *, queries_per_class: int = 1000, train_per_class: int | None = 500,
                    seed: int = 0) -> dict:
    """The paper's CIFAR-10 hash-retrieval split ("paper" protocol of docs/math.md
    [M:hash-split]): ``queries_per_class`` random items of each class are the queries, all other
    items the gallery (the hash table), and ``train_per_class`` random gallery items of each class
    train the encoder (None: no training subset).  Deterministic for a seed.

    Returns int64 index tensors ``{"query", "gallery", "train"}``, each sorted ascending (so the
    gallery keeps the data set's order, which fixes the tie order of the Hamming ranking).  The
    split is the one train.py --train-subset paper-hash trains on: one implementation,
    nac_fast.data.sources.subset.class_split (a class with too few items: ValueError)."""
    return class_split(labels, queries_per_class=queries_per_class,
                       train_per_class=train_per_class, seed=seed)


# --------------------------------------------------------------------------------------------
# Iterative quantisation (docs/math.md [M:itq])
# --------------------------------------------------------------------------------------------

def itq_fit(a, *, iters: int = 50, seed: int = 0, max_rows: int = 20000) -> dict:
    """Fit ITQ (Gong & Lazebnik, CVPR 2011) on unlabelled pre-activations ``a`` (n, k): the
    per-bit mean and std of ``a`` and the orthogonal R (k, k) that locally minimises
    ||sgn(x R) - x R||_F for the standardised x = (a - mean) / std, by ``iters`` alternations
    from a random rotation (``seed``), on at most ``max_rows`` rows (a seeded random subset).
    Returns {"mean", "std", "rotation", "quant_error": per-iteration ||B - xR||_F^2 / n}."""
    a = _features("a", a)
    _checks.positive_int("iters", iters)
    _checks.positive_int("max_rows", max_rows)
    if a.shape[0] < 2:
        raise ValueError(f"a must have at least 2 rows to standardise, got {a.shape[0]}")
    gen = torch.Generator().manual_seed(seed)
    a = a.to(torch.float64)
    if a.shape[0] > max_rows:
        a = a[torch.randperm(a.shape[0], generator=gen)[:max_rows].to(a.device)]
    mean, std = a.mean(0), a.std(0)
    std = torch.where(std > 0, std, torch.ones_like(std))  # a constant bit stays constant
    x = (a - mean) / std
    k = x.shape[1]
    rot = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=torch.float64))[0].to(x.device)
    errors = []
    for _ in range(iters):
        v = x @ rot
        b = torch.where(v >= 0, 1.0, -1.0).to(torch.float64)
        errors.append(((b - v) ** 2).sum().item() / x.shape[0])
        u, _, vh = torch.linalg.svd(x.T @ b)  # argmax_R tr(R^T x^T b) over orthogonal R
        rot = u @ vh
    return {"mean": mean, "std": std, "rotation": rot, "quant_error": errors}


def itq_codes(a, fit: dict) -> torch.Tensor:
    """+-1 int8 codes sgn(((a - mean) / std) R) of pre-activations ``a`` (n, k) under a fit of
    :func:`itq_fit` (0 -> +1 as in [M:code])."""
    a = _features("a", a, dim=int(fit["rotation"].shape[0]))
    x = (a.to(torch.float64) - fit["mean"].to(a.device)) / fit["std"].to(a.device)
    return torch.where(x @ fit["rotation"].to(a.device) >= 0, 1, -1).to(torch.int8)
