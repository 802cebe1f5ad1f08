"""The anchors' linear probe: augmented crops every epoch through the frozen encoder (MoCo,
SimCLR), beside the cached-feature probe of metrics.linear_probe (issue 55; docs/evaluation.md,
"Which probe").

    res = augmented_linear_probe(model, train_loader, train_h, train_labels, test_h, test_labels,
                                 lrs=(0.01, 0.1, 1.0, 10.0), epochs=100, device=dev)

Per epoch every training image is seen once as a fresh random-resized crop (area scale
(0.08, 1), aspect ratio (3/4, 4/3): torchvision's RandomResizedCrop, MoCo's linear-probe
augmentation) and horizontal flip (p = 0.5), drawn from (seed, epoch, image index) by the data
stage's counter-based parameters (nac_fast.data.augment.view_params, crop_windows; no colour
jitter), encoded by the frozen model (eval mode, no gradient) and used for one SGD step of the
linear layer.  The optimiser is the cached probe's (metrics._fit_linear: the searched rates
train together as one batched layer, Nesterov momentum 0.9, cosine schedule per step, no weight
decay, the same initial weights): only the features differ.  The learning-rate search holds out
the same seeded 10% of the training rows as the cached probe and scores them, and the test
split, on the cached centre-crop features (MoCo evaluates on centre crops too); one rate (e.g.
MoCo's 30) skips the search.

Under torch.distributed (a process group initialised, e.g. by torchrun): every process draws the
same permutation, takes the rows rank::world of each global batch of ``batch_size``, and the
gradients are summed over the processes (all_reduce) before the step: every process takes the
step of the whole batch, so the weights are those of one process up to the summation order.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .. import _checks
from ..data.augment import Recipe, crop_windows, normalize, resized_crop_flip, view_params
from .metrics import (LinearProbeResult, _check_probe_args, _features, _labels, _layers,
                      _num_classes, _sgd_step, accuracy, linear_predict)

__all__ = ["augmented_linear_probe", "CROP_RECIPE"]

# RandomResizedCrop(0.08, 1) + flip: the crop and flip fields of a Recipe (the rest is unused)
CROP_RECIPE = Recipe("linear-probe", scale=(0.08, 1.0))


class _FolderCrops(torch.utils.data.Dataset):
    """One random-resized crop + flip of an ImageFolder image (PIL, float box: the window of
    crop_windows), uint8 (3, size, size); the epoch is set before each pass."""

    def __init__(self, source, size, seed):
        self.source, self.size, self.seed, self.epoch = source, size, seed, 0

    def __len__(self):
        return len(self.source.files)

    def __getitem__(self, i):
        from PIL import Image
        from ..data.augment import to_uint8_chw
        path = self.source.files[i]
        try:
            with Image.open(path) as im:
                img = im.convert("RGB")
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"augmented probe: cannot decode {path} ({exc})") from None
        p = view_params(CROP_RECIPE, self.seed, self.epoch, np.array([i]), 0)
        x0, y0, w, h = crop_windows(p, img.height, img.width, CROP_RECIPE.ratio)[0].tolist()
        v = img.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        if p["flip"][0]:
            v = v.transpose(Image.FLIP_LEFT_RIGHT)
        return to_uint8_chw(v), int(self.source.labels[i])


class _Views:
    """Augmented views of dataset images by index, for one loader's source: in-memory sources
    crop with one batched grid_sample on the device, folders decode in DataLoader workers."""

    def __init__(self, loader, seed, device, num_workers):
        self.source = loader.source
        self.size = int(loader.image_size)
        self.seed, self.device, self.workers = seed, device, num_workers
        self.in_memory = hasattr(self.source, "images")
        if not self.in_memory and not hasattr(self.source, "files"):
            raise TypeError(f"augmented probe: a {type(self.source).__name__} source has neither "
                            "images in memory nor image files")
        if self.in_memory:
            self.images = self.source.images.to(device)
        else:
            self.ds = _FolderCrops(self.source, self.size, seed)

    def batches(self, epoch, index_batches):
        """(views (m, C, size, size) normalised float32 on the device) per batch of dataset
        indices, in order."""
        if self.in_memory:
            for idx in index_batches:
                p = view_params(CROP_RECIPE, self.seed, epoch, idx, 0)
                imgs = self.images[torch.as_tensor(idx, device=self.device)]
                win = crop_windows(p, imgs.shape[2], imgs.shape[3], CROP_RECIPE.ratio)
                x = resized_crop_flip(imgs.float().div_(255.0), win, p["flip"], self.size)
                yield normalize(x, self.source.mean, self.source.std, torch.float32, False)
            return
        self.ds.epoch = epoch
        dl = torch.utils.data.DataLoader(self.ds, batch_sampler=[list(map(int, b))
                                                                 for b in index_batches],
                                         num_workers=self.workers,
                                         pin_memory=self.device.type == "cuda")
        for x, _ in dl:
            x = x.to(self.device, non_blocking=True).float().div_(255.0)
            yield normalize(x, self.source.mean, self.source.std, torch.float32, False)


def _dist():
    """(rank, world) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fit_augmented(model, views, dataset_index, y, rows, C, lrs, *, epochs, batch_size, seed,
                   device, progress, desc):
    """metrics._fit_linear's batched SGD with each step's features the encoder's output on fresh
    crops of the rows' images (see the module docstring)."""
    from tqdm.auto import tqdm
    import torch.distributed as dist
    rank, world = _dist()
    n = int(rows.numel())
    L = len(lrs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        d = int(model.encode(next(views.batches(0, [dataset_index[rows[:1].numpy()]])))[0]
                .shape[1])
    bound = 1.0 / math.sqrt(d)
    w0 = torch.empty(C, d).uniform_(-bound, bound, generator=gen)
    W = w0.T.to(device).unsqueeze(1).repeat(1, L, 1).contiguous()
    b = torch.zeros(L, C, device=device)
    bW, bb = torch.zeros_like(W), torch.zeros_like(b)
    Wf, bWf = W.view(d, L * C), bW.view(d, L * C)
    lr0 = torch.tensor([float(v) for v in lrs], device=device)
    steps = epochs * math.ceil(n / batch_size)
    y = y.to(device)

    def reduce(gW, gb):
        dist.all_reduce(gW)
        dist.all_reduce(gb)

    t = 0
    with tqdm(total=epochs, desc=desc, unit="epoch", disable=not progress or rank != 0,
              leave=False, file=sys.stderr) as bar:
        for epoch in range(epochs):
            order = rows[torch.randperm(n, generator=gen)]
            mine = [order[s:s + batch_size][rank::world] for s in range(0, n, batch_size)]
            totals = [min(batch_size, n - s) for s in range(0, n, batch_size)]
            # a rank whose share of the last batch is empty still joins its all-reduce
            xs = views.batches(epoch, [dataset_index[r.numpy()] for r in mine if r.numel()])
            for r, total in zip(mine, totals):
                if r.numel():
                    with torch.no_grad():
                        h = model.encode(next(xs))[0].float()
                else:
                    h = torch.zeros(0, d, device=device)
                _sgd_step(h, y[r.to(device)], W, b, bW, bb, Wf, bWf, lr0, t, steps, 0.9,
                          total=total, reduce=reduce if world > 1 else None)
                t += 1
            bar.update(1)
    return _layers(W, b)


def augmented_linear_probe(model, train_loader, train_h, train_labels, test_h, test_labels, *,
                           lrs=(0.01, 0.1, 1.0, 10.0), val_fraction: float = 0.1,
                           epochs: int = 100, batch_size: int = 256, seed: int = 0, device=None,
                           num_workers: int = 0, progress: bool = False) -> LinearProbeResult:
    """The augmented linear probe (module docstring).  ``model``: the frozen network (its
    ``encode(x)`` gives (h, a)); ``train_loader``: the evaluation loader of the training split
    whose images gave ``train_h`` (row i is image ``train_loader.indices[i]`` of its source);
    ``train_h`` / ``test_h``: the cached centre-crop features, for the held-out and test
    scores.  With world > 1 (torch.distributed), ``batch_size`` is the global batch size, and
    the processes other than rank 0 may pass ``train_h=None, test_h=None, test_labels=None``:
    the scores are rank 0's (its chosen rate is broadcast, so every process fits the same
    layer); theirs are None in the result."""
    rank, world = _dist()
    scorer = train_h is not None
    if not scorer and (world == 1 or rank == 0):
        raise ValueError("train_h is None: only a process other than rank 0 of a process group "
                         "may leave the scoring features to rank 0")
    if scorer:
        tr = _features("train_h", train_h)
        ytr = _labels("train_labels", train_labels, tr.shape[0])
        te = _features("test_h", test_h, dim=tr.shape[1])
        yte = _labels("test_labels", test_labels, te.shape[0])
    else:
        if test_h is not None:
            raise ValueError("test_h must be None where train_h is")
        if not isinstance(train_labels, torch.Tensor):
            raise TypeError("train_labels must be a tensor of class indices")
        ytr = _labels("train_labels", train_labels, train_labels.shape[0])
        tr = te = yte = None
    try:
        lrs = tuple(lrs)
    except TypeError:
        raise TypeError(f"lrs must be a sequence of learning rates, got {lrs!r}") from None
    if not lrs:
        raise ValueError("lrs must name at least one learning rate")
    seed = _check_probe_args(lrs, epochs, batch_size, 0.9, seed)
    if not _checks.is_number(val_fraction) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")
    if not _checks.is_int(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    index = np.asarray(getattr(train_loader, "indices", ()))
    n = ytr.shape[0]
    if index.shape != (n,):
        raise ValueError(f"train_loader has {index.shape[0]} images, train_h {n} rows: "
                         "the features must be the loader's images, in its order")
    dev = torch.device(device) if device is not None else ytr.device
    model = model.to(dev).eval()
    C = _num_classes(None, ytr, yte) if scorer else None
    if world > 1:   # the class count (the layer's width) is rank 0's, which sees the test labels
        C = _broadcast_from_0(C)
    views = _Views(train_loader, seed, dev, num_workers)
    kw = dict(epochs=epochs, batch_size=batch_size, seed=seed, device=dev, progress=progress)
    val_acc = {}
    if len(lrs) > 1:
        n_val = max(1, int(round(val_fraction * n)))
        if n_val >= n:
            raise ValueError(f"the training set ({n} rows) is too small to hold out {n_val} rows "
                             "for the learning-rate search")
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        val_idx, fit_idx = perm[:n_val], perm[n_val:]
        searched = _fit_augmented(model, views, index, ytr, fit_idx, C, lrs,
                                  desc=f"augmented probe: lr search ({len(lrs)} rates at once)",
                                  **kw)
        if scorer:
            yv = ytr[val_idx.to(ytr.device)]
            val_acc = {lr: accuracy(linear_predict(m, tr, rows=val_idx), yv)
                       for lr, m in zip(lrs, searched)}
    best = min(lrs, key=lambda lr: (-val_acc.get(lr, 0.0), lr))
    if world > 1:   # the rate rank 0's scores chose, for every process's final fit
        best = _broadcast_from_0(best)
    final = _fit_augmented(model, views, index, ytr, torch.arange(n), C, [best],
                           desc=f"augmented probe: final fit, lr {best:g}", **kw)[0]
    test = accuracy(linear_predict(final, te), yte) if scorer else None
    return LinearProbeResult(test, best, val_acc, final,
                             {"protocol": "augmented", "world_size": world})


def _broadcast_from_0(obj):
    """obj as rank 0 of the process group has it (one broadcast_object_list)."""
    import torch.distributed as dist
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --------------------------------------------------------------------------------------------
# python -m nac_fast.eval: --probe cached|augmented, --probe-device-mem
# --------------------------------------------------------------------------------------------

PROBES = ("cached", "augmented")


def check_probe_flags(args) -> None:
    """--probe-device-mem as bytes (ValueError naming the flag); --probe augmented needs the
    linear task's images, so not with cached features alone (it loads the model)."""
    from .metrics import parse_bytes
    mem = getattr(args, "probe_device_mem", None)
    if mem is not None:
        try:
            args.probe_device_mem = parse_bytes("--probe-device-mem", mem)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    if getattr(args, "probe", "cached") == "augmented" and mem is not None:
        raise ValueError("--probe-device-mem bounds the cached probe's features on the device; "
                         "--probe augmented holds no features there (it encodes each batch)")


def run_linear_probe(args, tr, te, device, model, train_loader) -> LinearProbeResult:
    """The linear task of the CLI: the cached probe (metrics.linear_probe: features stay on the
    host, 16-bit or float32 as extracted, streamed to ``device`` within --probe-device-mem) or
    the augmented one (``model()`` and ``train_loader()`` give the frozen network and the
    training split's loader, called only then)."""
    from .metrics import linear_probe
    common = dict(epochs=args.linear_epochs, batch_size=args.linear_batch_size, seed=args.seed,
                  lrs=args.linear_lrs, progress=args.progress, device=device)
    if getattr(args, "probe", "cached") == "augmented":
        return augmented_linear_probe(model(), train_loader(), tr["h"], tr["labels"], te["h"],
                                      te["labels"], num_workers=getattr(args, "workers", 0) or 0,
                                      **common)
    return linear_probe(tr["h"], tr["labels"], te["h"], te["labels"],
                        device_mem=getattr(args, "probe_device_mem", None), **common)
