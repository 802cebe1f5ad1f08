"""Feature storage for evaluation at full size: one preallocated (N, D) buffer in 16 bits, filled
a batch at a time, in memory or as a memory-mapped .npy file (issue 55).

    from nac_fast.eval.features import FeatureBuffer
    buf = FeatureBuffer(n_images, dim)                     # float16 in memory
    buf = FeatureBuffer(n_images, dim, path="h.npy")       # float16 .npy memmap (h.npy.partial
                                                           # until commit())
    for h in batches:
        buf.write(h)                                       # rows [filled, filled + len(h))
    x = buf.commit()                                       # the (N, D) tensor, every row written

    buf.write(h_shard, rows=ids)                           # or by row id (a rank's gathered
                                                           # share), each row once
    FeatureBuffer(n, dim, nonfinite="keep")                # NaN / inf stored as they are, for a
                                                           # later check that names the run

Why 16 bits, and why float16: 1.28M x 2048 ImageNet features are 10.5 GB in float32, 5.2 GB in
16 bits.  float16 keeps 11 significant bits (a stored value is within a relative 2^-11 = 4.9e-4
of the float32 one; below 6.1e-5 the absolute error is at most 2^-25 = 3.0e-8), bfloat16 only 8
(2^-8 = 3.9e-3), at the price of float16's range: |h| <= 65504.  A value beyond it would be
stored as inf, so :meth:`FeatureBuffer.write` refuses it (ValueError naming the row) instead;
``dtype=torch.bfloat16`` (in memory only: numpy has no bfloat16 for the .npy file) or
``torch.float32`` are the alternatives.  The linear probe upcasts a batch at a time and trains in
float32 (metrics.linear_probe): on 16-bit features it is exactly today's probe run on the rounded
features (tests/test_eval_metrics.py).

No second copy: the buffer is allocated once at its final size (no list of batches concatenated
at the end), and the probe reads it in place.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from .. import _checks

__all__ = ["FeatureBuffer", "FeatureRangeError", "open_features", "FEATURE_DTYPES"]

FEATURE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}
_FINITE_MAX = {torch.float16: 65504.0, torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
               torch.float32: float(torch.finfo(torch.float32).max)}


class FeatureRangeError(ValueError):
    """A feature row that the buffer cannot store as it is (beyond the dtype's range, or NaN /
    inf where they are refused); the message names the row."""


class FeatureBuffer:
    """A preallocated (rows, dim) feature tensor of ``dtype``, filled in order by :meth:`write`.

    ``path``: back it with a .npy memmap written at ``path + ".partial"`` and renamed to ``path``
    by :meth:`commit` (a run that stops half-way leaves no file under the final name); an
    existing ``path`` is refused unless ``overwrite``.  ``name``: how errors call the features."""

    def __init__(self, rows: int, dim: int, dtype=torch.float16, *, path: str | None = None,
                 overwrite: bool = False, name: str = "features", nonfinite: str = "error"):
        _checks.positive_int("rows", rows)
        _checks.positive_int("dim", dim)
        if dtype not in _FINITE_MAX:
            raise ValueError(f"dtype must be one of {list(FEATURE_DTYPES)}, got {dtype!r}")
        if nonfinite not in ("error", "keep"):
            raise ValueError(f"nonfinite must be 'error' or 'keep', got {nonfinite!r}")
        self.rows, self.dim, self.dtype, self.name = int(rows), int(dim), dtype, name
        self.path, self.filled, self._mm, self.nonfinite = path, 0, None, nonfinite
        self.written = torch.zeros(self.rows, dtype=torch.bool)
        if path is None:
            self.tensor = torch.empty(self.rows, self.dim, dtype=dtype)
            return
        if dtype not in _NUMPY:
            raise ValueError(f"dtype {dtype} cannot back a .npy memmap (numpy has no bfloat16); "
                             "use torch.float16 or torch.float32, or path=None")
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"path {path!r} exists; pass overwrite=True to replace it")
        self._mm = np.lib.format.open_memmap(path + ".partial", mode="w+", dtype=_NUMPY[dtype],
                                             shape=(self.rows, self.dim))
        self.tensor = torch.from_numpy(self._mm)

    def write(self, values: torch.Tensor, rows=None) -> None:
        """Store ``values`` (m, dim), any float dtype and device, as the next m rows, or as the
        rows ``rows`` (int64 ids, e.g. one rank's share gathered from a process group), each
        written once.  A finite value beyond the storage dtype's range (float16: 65504) is a
        ValueError naming the row (it would be stored as inf), and so are NaN and inf unless
        ``nonfinite="keep"`` (stored as they are, for a later check that names the run); nothing
        of a refused batch is stored."""
        _checks.tensor("values", values)
        if values.dim() != 2 or values.shape[1] != self.dim or not values.is_floating_point():
            raise ValueError(f"values must be a float (m, {self.dim}) tensor, got "
                             f"{values.dtype} {tuple(values.shape)}")
        m = values.shape[0]
        if rows is None:
            if self.filled + m > self.rows:
                raise ValueError(f"{self.name}: {self.filled} + {m} rows exceed the buffer's "
                                 f"{self.rows}")
            where = torch.arange(self.filled, self.filled + m)
        else:
            _checks.tensor("rows", rows)
            where = rows.to("cpu", torch.int64).reshape(-1)
            if where.numel() != m:
                raise ValueError(f"rows has {where.numel()} ids for {m} rows of values")
            if m and (int(where.min()) < 0 or int(where.max()) >= self.rows):
                raise ValueError(f"{self.name}: rows must lie in [0, {self.rows})")
            if bool(self.written[where].any()) or where.unique().numel() != m:
                raise ValueError(f"{self.name}: a row of rows is written twice")
        v = values.detach()
        bad = v.abs() > _FINITE_MAX[self.dtype]
        if self.nonfinite == "error":
            bad |= ~torch.isfinite(v)
        else:
            bad &= torch.isfinite(v)
        if bool(bad.any()):
            r = int(bad.any(1).nonzero()[0, 0])
            raise FeatureRangeError(f"{self.name}: row {int(where[r])} holds "
                             f"{'NaN, inf or ' if self.nonfinite == 'error' else ''}a value "
                             f"beyond {self.dtype}'s range ±{_FINITE_MAX[self.dtype]:g} "
                             f"(e.g. {float(v[r][bad[r]][0])!r})")
        if rows is None:
            self.tensor[self.filled:self.filled + m].copy_(v)
        else:
            self.tensor[where] = v.to("cpu", self.dtype)
        self.written[where] = True
        self.filled += m

    def commit(self) -> torch.Tensor:
        """The filled tensor; a memmap is flushed and renamed to its final path.  A buffer with
        rows never written is a ValueError."""
        if self.filled != self.rows or not bool(self.written.all()):
            raise ValueError(f"{self.name}: {self.filled} of {self.rows} rows written")
        if self._mm is not None:
            self._mm.flush()
            os.replace(self.path + ".partial", self.path)
        return self.tensor


def open_features(path: str) -> torch.Tensor:
    """A committed .npy feature file as a read-only memory-mapped (N, D) tensor (its pages are
    read on demand: nothing is copied into memory up front)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path {path!r}: no such file")
    try:
        mm = np.load(path, mmap_mode="r")
    except ValueError as exc:
        raise ValueError(f"path {path!r} is not a .npy array ({exc})") from None
    if mm.ndim != 2 or mm.dtype not in (np.float16, np.float32):
        raise ValueError(f"path {path!r} holds a {mm.dtype} array of shape {mm.shape}, not (N, D) "
                         "float16 / float32 features")
    with warnings.catch_warnings():  # read-only memory: the probe never writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(mm)
