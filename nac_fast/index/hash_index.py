"""HashIndex: a flat index of binary codes searched by Hamming distance, with the conventions of
FAISS's ``IndexBinaryFlat`` (docs/math.md [M:hamming], [M:rank]).

    import nac_fast
    index = nac_fast.HashIndex(128)                       # code length in bits
    index.add(codes, paths=files, labels=names)           # +-1, bool or PackedCodes; in order
    D, I = index.search(query_codes, 10)                  # (Q, k) int32 distances, int64 positions
                                                          # (numpy arrays for a numpy query)
    paths = index.paths                                   # a copy, O(ntotal): take it once
    paths[I[0, 0]], index.ids_at(I)                       # what was found (I's device)
    index.save("gallery.nacidx"); index = nac_fast.HashIndex.load("gallery.nacidx")

As in FAISS: ``add`` appends in order; ``search`` returns positions in insertion order
(``IndexBinaryFlat``'s labels), nearest first, equal distances in increasing position (FAISS
leaves that order to its heap); ``ntotal``; ``reset``.  Unlike FAISS, ``k > ntotal`` returns
``ntotal`` columns (FAISS pads with -1), and codes of any length are accepted (not only multiples
of 8 bits).  Optional per-code ``ids`` (int64), ``paths`` and ``labels`` (str or None) are stored
beside the codes; ``meta`` is a JSON-able dict saved with the index (``python -m nac_fast.index``
records the checkpoint, its SHA-256, the preprocessing and the encoder mode there).

Search runs through the Hamming engine's dispatcher (nac_fast/ops/search.py): the C++ engine for
CPU codes (top-k for k <= 128 over query blocks x gallery tiles, one compare against the k-th
distance per candidate), Triton on a GPU (kernels/hamming_triton.py: a bound on each query's k-th
distance from a strided sample, then one pass that keeps a few candidates per query and gallery
slice; exact, no Q x G matrix).  Memory: ceil(nbits / 64) x 8 bytes a code (16 at 128 bits), plus
8 a code when ``ids`` are given, plus the paths and labels.

On a GPU, in the spirit of FAISS's ``GpuIndexBinaryFlat``: ``HashIndex(nbits, device="cuda")``,
or ``index.to("cuda")`` (in place, returning the index, as ``nn.Module.to``), keeps the codes on
that GPU; ``add`` copies new codes there and ``search`` runs there, whatever device the queries
are on (results come back on the queries' device, numpy for numpy).  Queries on another GPU are a
ValueError, as are codes or a search that need more memory than the GPU has free
(``torch.cuda.mem_get_info`` plus what torch's allocator holds unused), checked before anything is
copied or launched.  A CPU index searched with CUDA queries copies its codes to that GPU once
(same check) and keeps the copy until the next ``add``.

On disk (FORMAT_VERSION 1): an uncompressed zip holding ``meta.json`` (format name, version,
nbits, ntotal, words per code, byte order, which of ids / paths / labels are present, and the
user's ``meta``), ``codes.npy`` ((ntotal, words) uint64, little-endian, bit j of a code = bit
j % 64 of word j // 64, set for +1, padding bits 0), ``ids.npy`` (int64), ``paths.json`` and
``labels.json``.  numpy, zipfile and json read it without nac_fast.  Every member carries the
zip CRC, so a truncated or damaged file is an error at load, never a shorter index; so is a file
of another format version.  Saving writes a temporary file and renames it: the target is always
the old file or the complete new one.
"""
from __future__ import annotations

import io
import json
import os
import sys
import zipfile

import numpy as np
import torch

from .. import _checks
from ..ops import dispatch
from ..ops.codes import MAX_BITS, PackedCodes, as_packed, check_packed
from ..ops.search import (cuda_kernels, ref_topk_workspace_bytes, resolve_backend, topk_words,
                          triton_kernels)
from .._files import atomic_write

__all__ = ["HashIndex", "FORMAT", "FORMAT_VERSION"]

FORMAT = "nac_fast.HashIndex"
FORMAT_VERSION = 1
_MEMBERS = ("meta.json", "codes.npy", "ids.npy", "paths.json", "labels.json")


def _check_nbits(nbits) -> int:
    _checks.integer("nbits", nbits, numpy=True)
    if not 1 <= nbits <= MAX_BITS:
        raise ValueError(f"nbits must be in [1, {MAX_BITS}], got {nbits}")
    return int(nbits)


TOPK_METHODS = ("auto", "popc", "mma")  # kernels/hamming_triton.py TOPK_METHODS, and "auto"


def _check_topk_method(method) -> str:
    """The Triton engine's top-k filter: "auto", "popc" or "mma" (TypeError / ValueError
    naming topk_method otherwise)."""
    if not isinstance(method, str):
        raise TypeError(f"topk_method must be a str, got {type(method).__name__}")
    if method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {method!r}")
    return method


def _check_backend(backend) -> str:
    """The Hamming engine's backend name ("auto", "cpu", "triton", "cuda", "reference"): a
    TypeError for a non-str, a ValueError for another name (whether it runs for the index's
    device is checked at the search, as the device may change)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    names = dispatch.OPS["hamming"][0] + ("auto",)
    if backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")
    return backend


def _str_list(name: str, values, n: int, allow_none: bool) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a list of {n} strings, got {type(values).__name__}")
    out = list(values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but {n} codes are added")
    for v in out:
        if not (isinstance(v, str) or (allow_none and v is None)):
            raise TypeError(f"{name} entries must be str{' or None' if allow_none else ''}, "
                            f"got {v!r}")
    return out


_INT64_MAX = 2 ** 63 - 1


def _ids_tensor(ids, n: int) -> torch.Tensor:
    """``ids`` given to add() for ``n`` codes as a CPU int64 tensor.  Integers only (any integer
    dtype, a list, a tensor), each in the int64 range: a uint64 id of 2**63 or more would wrap to
    a negative one and silently name another item, so it is a ValueError; anything torch cannot
    read as integers (strings, None, ...) is a TypeError naming ``ids``."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"ids must be {n} integers, got {type(ids).__name__}")
    if isinstance(ids, (list, tuple)) and not ids:
        t = torch.zeros(0, dtype=torch.int64)  # (torch makes [] float32)
    else:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            if "overflow" in str(exc).lower():
                raise ValueError(f"ids must be in the int64 range [-2**63, 2**63 - 1] ({exc})") \
                    from None
            raise TypeError(f"ids must be {n} integers, got {type(ids).__name__} ({exc})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"ids must be integers, got {t.dtype}")
    if t.shape != (n,):
        raise ValueError(f"ids must have shape ({n},) to match the codes, got {tuple(t.shape)}")
    if t.dtype == torch.uint64 and n and bool((t.view(torch.int64) < 0).any()):
        # (torch has no comparisons for uint64: a value >= 2**63 is a negative int64 bit pattern)
        raise ValueError(f"ids must be in the int64 range [-2**63, 2**63 - 1], got a uint64 id "
                         f"above {_INT64_MAX}")
    return t.to("cpu", torch.int64)


def _check_device(name: str, device) -> torch.device:
    """A torch.device for "cpu" or an available "cuda[:i]" (a ValueError naming `name` else)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{name} {device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{name} must be 'cpu' or 'cuda' (a GPU index), got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{name} {str(dev)!r}: no CUDA device is available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"{name} {str(dev)!r}: this machine has {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return torch.device("cuda", index)


def gpu_free_bytes(device: torch.device) -> int:
    """Bytes a new allocation can get on a CUDA device: the driver's free memory plus what torch's
    caching allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def check_gpu_memory(device: torch.device, need: int, what: str) -> None:
    """ValueError (before any work) when `need` bytes do not fit in the GPU's free memory."""
    free = gpu_free_bytes(device)
    if need > free:
        raise ValueError(f"{what} needs {need / 2**20:,.0f} MiB on {device}, which has "
                         f"{free / 2**20:,.0f} MiB free")


class HashIndex:
    """A flat Hamming index of ``nbits``-bit codes (see the module docstring).

    ``backend``: the Hamming engine's backend for searches ("auto", "cpu", "triton", "cuda",
    "reference"); ``meta``: a JSON-able dict saved with the index; ``device``: where the codes
    live and searches run ("cpu", or "cuda[:i]": a GPU index).  ``topk_method``: the Triton
    engine's top-k filter ("auto"; "popc", popcounts; "mma", int8 products of +-1 codes on the
    tensor cores): "auto" takes what kernels/hamming_triton.py `topk_method` picks for the code
    length and device (its switch point MMA_MIN_BITS, set from the GPU suite's figures);
    "popc" / "mma" need the Triton backend (a search on another is a ValueError)."""

    def __init__(self, nbits: int, *, backend: str = "auto", meta: dict | None = None,
                 device="cpu", topk_method: str = "auto"):
        self.nbits = _check_nbits(nbits)
        self.words_per_code = (self.nbits + 63) // 64
        self.backend = _check_backend(backend)
        self.topk_method = _check_topk_method(topk_method)
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict, got {type(meta).__name__}")
        self.meta = dict(meta or {})
        self._device = _check_device("device", device)
        self.reset()

    @property
    def device(self) -> torch.device:
        """Where the codes live and searches run."""
        return self._device

    def to(self, device) -> "HashIndex":
        """Move the codes to ``device`` ("cpu" or "cuda[:i]"), in place; returns the index.  A GPU
        without room for them is a ValueError, before anything is copied."""
        dev = _check_device("device", device)
        if dev == self._device:
            return self
        if dev.type == "cuda":
            check_gpu_memory(dev, self._n * self.words_per_code * 8,
                             f"the index's {self._n:,} codes of {self.nbits} bits")
        self._words = self._words[:self._n].to(dev)
        self._device = dev
        self._device_words = None
        return self

    # ---------------------------------------------------------------------------- contents
    def reset(self) -> None:
        """Remove every code (and ids, paths, labels); nbits, meta and the device stay."""
        self._words = torch.zeros((0, self.words_per_code), dtype=torch.int64,
                                  device=self._device)
        self._n = 0
        self._ids = None
        self._paths = None
        self._labels = None
        self._device_words = None

    @property
    def ntotal(self) -> int:
        """Number of codes in the index."""
        return self._n

    def __len__(self) -> int:
        return self._n

    @property
    def codes(self) -> PackedCodes:
        """The codes, packed (a view: do not modify)."""
        return PackedCodes(self._words[:self._n], self.nbits)

    @property
    def ids(self) -> torch.Tensor:
        """int64 (ntotal,): the ids given to add(), or the positions 0..ntotal-1 if none were."""
        if self._ids is None:
            return torch.arange(self._n, dtype=torch.int64)
        return self._ids[:self._n]

    def ids_at(self, positions):
        """The ids of `positions` (search()'s indices), of their shape, on their device: int64
        tensors for a tensor (CUDA indices from a GPU search included, which ``ids[I]`` would
        refuse: the ids are kept on the CPU), an int64 numpy array for a numpy array.  A position
        outside 0..ntotal-1 is a ValueError naming it."""
        if isinstance(positions, np.ndarray):
            if positions.dtype.kind not in "iu":
                raise TypeError(f"positions must hold integers, got a numpy array of "
                                f"{positions.dtype}")
            return self.ids_at(torch.from_numpy(
                np.ascontiguousarray(positions).astype(np.int64))).numpy()
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor or numpy array (search()'s "
                            f"indices), got {type(positions).__name__}")
        if positions.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8):
            raise TypeError(f"positions must hold integers, got {positions.dtype}")
        if positions.numel():
            # one pass and one read back (a CUDA I: one sync, not one per bound)
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= self._n:
                bad = lo if lo < 0 else hi
                raise ValueError(f"positions holds {bad}, outside 0..{self._n - 1} (the index "
                                 f"has {self._n:,} codes)")
        if self._ids is None:
            return positions.to(torch.int64, copy=True)
        pos = positions.to("cpu", torch.int64)
        return self._ids[:self._n][pos].to(positions.device)

    @property
    def paths(self) -> list | None:
        """A copy of the paths given to add(), in position order, or None if none were.  Each
        access copies all ntotal of them: take it once, not once per lookup."""
        return None if self._paths is None else list(self._paths)

    @property
    def labels(self) -> list | None:
        """A copy of the labels given to add() (None for an item without one), or None if none
        were.  Each access copies all ntotal of them: take it once, not once per lookup."""
        return None if self._labels is None else list(self._labels)

    def __repr__(self) -> str:
        extra = [x for x, v in (("ids", self._ids), ("paths", self._paths),
                                ("labels", self._labels)) if v is not None]
        return (f"HashIndex(nbits={self.nbits}, ntotal={self._n}"
                + (f", device={str(self._device)!r}" if self._device.type != "cpu" else "")
                + (f", with {'/'.join(extra)}" if extra else "") + ")")

    def add(self, codes, *, ids=None, paths=None, labels=None, zero_one: bool = False) -> None:
        """Append ``codes`` (n, nbits) in order: +-1 values, bool (True = +1), 0/1 with
        ``zero_one=True``, or PackedCodes.  ``ids`` (n int64), ``paths`` (n str) and ``labels``
        (n str or None) are stored beside them; an index that holds one of them needs it on every
        add (and one that does not refuses it), so every code has one.  An empty index holds none
        of them: its first add of at least one code decides (an add of 0 codes to it records
        nothing).  Everything is checked before anything is added.  numpy arrays are taken as
        tensors of the same values."""
        _checks.flag("zero_one", zero_one)
        p = as_packed("codes", _from_numpy(codes), zero_one)
        if p.nbits != self.nbits:
            raise ValueError(f"codes have {p.nbits} bits but the index holds {self.nbits}-bit codes")
        words = p.words.detach()
        n = words.shape[0]
        new_ids = None if ids is None else _ids_tensor(ids, n)
        new_paths = None if paths is None else _str_list("paths", paths, n, False)
        new_labels = None if labels is None else _str_list("labels", labels, n, True)
        if self._n:  # (an empty index holds no ids / paths / labels: see the append below)
            for name, have, given in (("ids", self._ids, new_ids), ("paths", self._paths, new_paths),
                                      ("labels", self._labels, new_labels)):
                if (have is None) != (given is None):
                    raise ValueError(f"{name}: the index {'holds' if have is not None else 'has no'}"
                                     f" {name} for its {self._n} codes, so add() must "
                                     f"{'give' if have is not None else 'not give'} them")
        need = self._n + n
        cap = max(need, 2 * self._words.shape[0], 1024) if need > self._words.shape[0] else 0
        if self._device.type == "cuda":
            grow = cap * self.words_per_code * 8
            check_gpu_memory(self._device, grow + (0 if words.device == self._device else
                                                    n * self.words_per_code * 8),
                             f"adding {n:,} codes to the index's {self._n:,}")
        # -- nothing has changed so far; now append
        if cap:
            grown = torch.zeros((cap, self.words_per_code), dtype=torch.int64,
                                device=self._device)
            grown[:self._n] = self._words[:self._n]
            self._words = grown
        self._words[self._n:need] = words.to(self._device)
        if self._n == 0:  # an empty index takes ids / paths / labels from its first codes, so a
            # batch of 0 codes never commits it (an index of codes without paths would follow)
            self._ids = self._paths = self._labels = None
            if n == 0:
                new_ids = new_paths = new_labels = None
        # ids, paths and labels grow in place (a buffer of spare capacity, list.extend), so many
        # small adds cost what one large add does, not a copy of everything held per add
        if new_ids is not None:
            held = 0 if self._ids is None else self._ids.shape[0]
            if need > held:
                grown_ids = torch.empty(max(need, 2 * held, 1024), dtype=torch.int64)
                if self._ids is not None:
                    grown_ids[:self._n] = self._ids[:self._n]
                self._ids = grown_ids
            self._ids[self._n:need] = new_ids
        if new_paths is not None:  # (the lists are the index's own: the properties copy them)
            if self._paths is None:
                self._paths = new_paths
            else:
                self._paths.extend(new_paths)
        if new_labels is not None:
            if self._labels is None:
                self._labels = new_labels
            else:
                self._labels.extend(new_labels)
        self._n = need
        self._device_words = None

    # ---------------------------------------------------------------------------- search
    def search(self, codes, k: int, *, zero_one: bool = False):
        """The k nearest codes of each query: ``(distances, indices)``, int32 and int64 tensors of
        shape (Q, min(k, ntotal)) on the queries' device, nearest first, equal distances in
        insertion order; indices are positions (0..ntotal-1; ``ids``, ``paths`` and ``labels``
        map them).  ``k`` > ntotal returns ntotal columns; k < 1, an empty index, or codes of
        another length are a ValueError.  numpy queries get numpy arrays back (FAISS's
        convention).  A GPU index searches on its GPU (queries on another GPU are a ValueError,
        as is a search that would not fit in its free memory)."""
        _checks.flag("zero_one", zero_one)
        if isinstance(codes, np.ndarray):
            D, I = self.search(_from_numpy(codes), k, zero_one=zero_one)
            return D.numpy(), I.numpy()
        _checks.integer("k", k, numpy=True)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if self._n == 0:
            raise ValueError("the index is empty (ntotal = 0): add codes before searching")
        q = as_packed("codes", codes, zero_one)
        if q.nbits != self.nbits:
            raise ValueError(f"query codes have {q.nbits} bits but the index holds "
                             f"{self.nbits}-bit codes")
        k = min(int(k), self._n)
        qdev = q.words.device
        if self._device.type == "cuda" and qdev.type == "cuda" and qdev != self._device:
            raise ValueError(f"the query codes are on {qdev} but the index is on {self._device}: "
                             "move one of them")
        run_on = self._device if self._device.type == "cuda" else qdev
        Q = q.words.shape[0]
        if Q == 0:
            return (torch.zeros((0, k), dtype=torch.int32, device=qdev),
                    torch.zeros((0, k), dtype=torch.int64, device=qdev))
        # the engine for tensors on run_on (top-k: no bit limit on Triton, 1024 bits on CUDA),
        # checked before any copy
        be = resolve_backend(self.backend,
                             torch.empty((0, self.words_per_code), dtype=torch.int64, device=run_on))
        if self.topk_method != "auto" and be != "triton":
            raise ValueError(f"topk_method {self.topk_method!r} is a filter of the Triton engine, "
                             f"but this search runs on backend {be!r}: use topk_method='auto' or "
                             "backend='triton'")
        method = ("popc" if be != "triton" else self.topk_method if self.topk_method != "auto"
                  else triton_kernels().topk_method(self.nbits, run_on))
        if run_on.type == "cuda":
            need = Q * (self.words_per_code * 8 + k * 12)  # the queries and the results
            if self._device.type == "cpu" and (self._device_words is None or
                                               self._device_words.device != run_on):
                need += self._n * self.words_per_code * 8  # the copy of the codes
            if be in ("triton", "cuda"):
                kernels = triton_kernels() if be == "triton" else cuda_kernels()
                need += (kernels.topk_workspace_bytes(Q, self._n, k, self.words_per_code, run_on)
                         if method == "popc" else
                         kernels.topk_mma_workspace_bytes(Q, self._n, k, self.words_per_code,
                                                          run_on))
            elif be == "reference":  # torch ops in query chunks: their temporaries
                need += ref_topk_workspace_bytes(Q, self._n, k, self.words_per_code)
            check_gpu_memory(run_on, need, f"searching {Q:,} queries (top {k}) in "
                             f"{self._n:,} codes")
        gw = self._gallery_on(run_on)
        if method == "mma":
            D, I = triton_kernels().topk_with(q.words.to(run_on).contiguous(), gw, k, "mma",
                                              self.nbits)
        else:
            D, I = topk_words(q.words.to(run_on).contiguous(), gw, k, be)
        return (D.to(qdev), I.to(qdev)) if qdev != run_on else (D, I)

    def _gallery_on(self, device: torch.device) -> torch.Tensor:
        gw = self._words[:self._n]
        if device == self._device:
            return gw
        if self._device_words is None or self._device_words.device != device:
            self._device_words = gw.to(device)
        return self._device_words

    # ---------------------------------------------------------------------------- files
    def save(self, path, *, overwrite: bool = False) -> None:
        """Write the index to ``path`` (format: module docstring), atomically: a temporary file in
        the same folder, then a rename.  An existing ``path`` is a FileExistsError unless
        ``overwrite=True`` (a bool); a missing folder is created."""
        _checks.flag("overwrite", overwrite)
        path = os.fspath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path!r} is a directory; name the index file")
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(parent):  # the nearest part of the path that exists must be a
            parent = os.path.dirname(parent)  # folder (else os.makedirs' "File exists" would hint
        if not os.path.isdir(parent):         # at overwrite=True, which cannot help)
            raise NotADirectoryError(f"{path!r}: {parent!r} is a file, not a folder, so the "
                                     "index cannot be written under it")
        if os.path.lexists(path) and not overwrite:
            raise FileExistsError(f"{path!r} exists; pass overwrite=True to replace it")
        head = {"format": FORMAT, "version": FORMAT_VERSION, "nbits": self.nbits,
                "ntotal": self._n, "words_per_code": self.words_per_code, "byte_order": "little",
                "has_ids": self._ids is not None, "has_paths": self._paths is not None,
                "has_labels": self._labels is not None, "meta": self.meta}
        try:
            meta_bytes = json.dumps(head, indent=1, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise TypeError(f"meta must be JSON-serialisable (no NaN): {exc}") from exc
        words = self._words[:self._n].cpu().numpy().view(np.uint64)
        if sys.byteorder != "little":  # pragma: no cover - no big-endian machine to test on
            words = words.byteswap()

        def write(f):
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as z:
                z.writestr("meta.json", meta_bytes)
                z.writestr("codes.npy", _npy_bytes(words))
                if self._ids is not None:
                    z.writestr("ids.npy", _npy_bytes(self._ids[:self._n].numpy()))
                if self._paths is not None:
                    z.writestr("paths.json", json.dumps(self._paths).encode())
                if self._labels is not None:
                    z.writestr("labels.json", json.dumps(self._labels).encode())
        atomic_write(path, write)

    @classmethod
    def load(cls, path, *, backend: str = "auto", device="cpu",
             topk_method: str = "auto") -> "HashIndex":
        """Read an index written by :meth:`save`, its codes onto ``device`` (as :meth:`to`).  A
        missing file is FileNotFoundError; a file that is not a HashIndex, is truncated or
        damaged, or has another format version is a ValueError naming it.  ``backend``,
        ``device`` and ``topk_method`` are checked first, before the file is read (errors naming
        them, as for the constructor)."""
        path = os.fspath(path)
        backend = _check_backend(backend)
        topk_method = _check_topk_method(topk_method)
        dev = _check_device("device", device)
        if not os.path.exists(path):
            raise FileNotFoundError(f"index {path!r}: no such file")
        if os.path.isdir(path):
            raise ValueError(f"index {path!r} is a directory, not an index file")
        try:
            with zipfile.ZipFile(path) as z:
                names = set(z.namelist())
                if "meta.json" not in names or "codes.npy" not in names:
                    raise ValueError("it holds no meta.json and codes.npy")
                head = json.loads(z.read("meta.json"))
                if not isinstance(head, dict):
                    kind = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
                            float: "a number", type(None): "null"}.get(type(head), "no object")
                    raise ValueError(f"meta.json holds {kind}, not the JSON object of a HashIndex")
                if head.get("format") != FORMAT:
                    raise ValueError(f"meta.json names format {head.get('format')!r} if any, "
                                     f"not {FORMAT!r}")
                version = head.get("version")
                if type(version) is not int or version != FORMAT_VERSION:  # (not True or 1.0)
                    raise _VersionError(version)
                has = {}
                for key in ("has_ids", "has_paths", "has_labels"):
                    has[key] = head.get(key, False)
                    if not isinstance(has[key], bool):  # ("no" would read as true)
                        raise ValueError(f"meta.json's {key} must be true or false, got "
                                         f"{has[key]!r}")
                words = np.load(io.BytesIO(z.read("codes.npy")), allow_pickle=False)
                ids = (np.load(io.BytesIO(z.read("ids.npy")), allow_pickle=False)
                       if has["has_ids"] else None)
                paths = json.loads(z.read("paths.json")) if has["has_paths"] else None
                labels = json.loads(z.read("labels.json")) if has["has_labels"] else None
        except _VersionError as exc:
            raise ValueError(f"index {path!r} was written in HashIndex format version "
                             f"{exc.args[0]!r}; this nac_fast reads version {FORMAT_VERSION} "
                             "(rebuild it: python -m nac_fast.index build ...)") from None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, ValueError, OSError,
                EOFError, UnicodeDecodeError) as exc:
            raise ValueError(f"index {path!r} is not a complete nac_fast HashIndex file "
                             f"(truncated, damaged or another kind of file): {exc}") from None
        try:
            nbits, ntotal = _check_nbits(head["nbits"]), head["ntotal"]
            if type(ntotal) is not int or ntotal < 0:  # (not "97", 97.9 or true)
                raise ValueError(f"ntotal must be an int >= 0, got {ntotal!r}")
            W = (nbits + 63) // 64
            if head.get("words_per_code", W) != W or type(head.get("words_per_code", W)) is not int:
                raise ValueError(f"words_per_code is {head.get('words_per_code')!r}, but "
                                 f"{nbits}-bit codes take {W}")
            if head.get("byte_order", "little") != "little":
                raise ValueError(f"byte_order is {head.get('byte_order')!r}; version "
                                 f"{FORMAT_VERSION} files are little-endian")
            if words.dtype != np.dtype("<u8") or words.shape != (ntotal, W):
                raise ValueError(f"codes.npy is {words.dtype} {words.shape}, expected little-endian "
                                 f"uint64 ({ntotal}, {W})")
            if ids is not None and (ids.dtype != np.int64 or ids.shape != (ntotal,)):
                raise ValueError(f"ids.npy is {ids.dtype} {ids.shape}, expected int64 ({ntotal},)")
            for name, v in (("paths", paths), ("labels", labels)):
                if v is not None:
                    _str_list(name, v, ntotal, name == "labels")
            index = cls(nbits, backend=backend, meta=head.get("meta") or {},
                        topk_method=topk_method)
            t = torch.from_numpy(words.astype("=u8", copy=False).view(np.int64).copy())
            check_packed("codes.npy", PackedCodes(t, nbits))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"index {path!r} is inconsistent: {exc}") from None
        index._words, index._n = t, ntotal
        index._ids = torch.from_numpy(ids.copy()) if ids is not None else None
        index._paths, index._labels = paths, labels
        return index.to(dev)


class _VersionError(Exception):
    pass


def _from_numpy(codes):
    """A numpy array of codes as a CPU tensor of the same values (anything else unchanged)."""
    if isinstance(codes, np.ndarray):
        if codes.dtype == object:
            raise TypeError("codes must be a numeric or bool array, got dtype object")
        a = np.ascontiguousarray(codes)
        return torch.from_numpy(a if a.flags.writeable else a.copy())
    return codes


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()
