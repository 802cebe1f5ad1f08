"""An ImageFolder listed and checked once per run, not once per process.

Scanning a folder (imagefolder.py: walking its class folders, reading 16 bytes of every file to
check it is an image) costs one open per file.  Done by every process of a run, that is N x
ranks opens of a shared file system before step 1 (41M for ImageNet at 32 ranks), and again at
every restart.  A `Listing` says how the processes of one run share the work:

  first      this process scans (the run's rank 0); the others receive its result
  broadcast  broadcast(obj) -> the first process's obj, called by every process in the same order
             (torch.distributed.broadcast_object_list from rank 0, or train's broadcast_object);
             None: this process is on its own (it scans)
  cache_dir  where the first process keeps the scan between runs: one gzip'd JSON file per
             folder (`cache_path`), written atomically, reused while the folder's stamp (the
             mtimes of the folders the scan read, imagefolder._unchanged) still holds, scanned
             again when a file or folder was added, removed or renamed since.  Never inside the
             data; train.py keeps it in its --out.
  defer      True: a new scan is held (`pending`) until `flush()` writes it; train.py flushes
             once the run has begun, so a run refused at its start (a checkpoint that does not
             fit the grown folder, a bad flag) leaves --out as it found it.

Why rank 0 of the run and not one process per node: the sample order, the shards and the labels
are indices into the file list, so every rank must hold the same list; one scan broadcast to all
guarantees it even if the tree changes while the run starts (two scans on two nodes could
differ).  The broadcast costs one collective of ~40 bytes per file (~50 MB for ImageNet).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable

from ..._files import atomic_write

CACHE_VERSION = 1
CACHE_PREFIX = "data_list-"


@dataclass(frozen=True)
class Listing:
    """How the processes of a run list an ImageFolder: see the module docstring."""
    cache_dir: str | None = None
    first: bool = True
    broadcast: Callable | None = None
    defer: bool = False
    pending: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir must be None or a path, got "
                            f"{type(self.cache_dir).__name__}")
        if not isinstance(self.first, bool):
            raise TypeError(f"first must be a bool, got {type(self.first).__name__}")
        if self.broadcast is not None and not callable(self.broadcast):
            raise TypeError(f"broadcast must be None or callable, got "
                            f"{type(self.broadcast).__name__}")
        if not isinstance(self.defer, bool):
            raise TypeError(f"defer must be a bool, got {type(self.defer).__name__}")

    def store(self, key, packed) -> None:
        """Keep the first process's new scan `packed` of `key` in the cache: now, or at `flush()`
        when deferred."""
        if self.cache_dir is None or not self.first:
            return
        if self.defer:
            self.pending[key] = packed
        else:
            self._write(key, packed)

    def flush(self) -> None:
        """Write the scans held back by `defer` (see `store`)."""
        held = list(self.pending.items())
        self.pending.clear()
        for key, packed in held:
            self._write(key, packed)

    def _write(self, key, packed) -> None:
        """A cache that cannot be written is reported (RuntimeWarning) and the run goes on: a
        restart then scans the folder again."""
        try:
            write_cache(self.cache_dir, key, packed)
        except OSError as exc:
            warnings.warn(f"nac_fast.data: the data list cache cannot be written in "
                          f"{self.cache_dir} ({exc.strerror or exc}); a restart scans the folder "
                          "again", RuntimeWarning, stacklevel=4)


def check_listing(listing) -> None:
    if listing is not None and not isinstance(listing, Listing):
        raise TypeError(f"listing must be None or a Listing, got {type(listing).__name__}")


def cache_path(cache_dir, key) -> str:
    """The cache file of the scan `key` (the folders it reads, as real paths) in `cache_dir`."""
    text = repr((CACHE_VERSION, key)).encode("utf-8", "surrogateescape")
    return os.path.join(os.fspath(cache_dir),
                        f"{CACHE_PREFIX}{hashlib.sha256(text).hexdigest()[:16]}.json.gz")


def read_cache(cache_dir, key):
    """The packed scan stored for `key`, or None (no file, another key, an older format).  A file
    that cannot be read is reported (RuntimeWarning naming it) and scanned again."""
    path = cache_path(cache_dir, key)
    if not os.path.isfile(path):
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            packed = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        warnings.warn(f"nac_fast.data: the data list cache {path} cannot be read ({exc}); "
                      "scanning the folder again (the cache is rewritten)", RuntimeWarning,
                      stacklevel=3)
        return None
    if (not isinstance(packed, dict) or packed.get("version") != CACHE_VERSION
            or packed.get("key") != list(key)):
        return None
    return packed


def write_cache(cache_dir, key, packed) -> None:
    """Store `packed` (a JSON-able dict) for `key`, atomically (nac_fast._files)."""
    data = dict(packed, version=CACHE_VERSION, key=list(key))
    raw = json.dumps(data, separators=(",", ":")).encode("utf-8")
    atomic_write(cache_path(cache_dir, key), lambda f: f.write(gzip.compress(raw, 1)))


def shared(listing, make):
    """make() on the first process; its result (or its ValueError / FileNotFoundError, raised
    again with the same message) on every process of the `listing`.  One process (no listing,
    or no broadcast): make()."""
    if listing is None or listing.broadcast is None:
        return make()
    msg = None
    if listing.first:
        try:
            msg = ("ok", make())
        except FileNotFoundError as exc:
            msg = ("FileNotFoundError", str(exc))
        except ValueError as exc:
            msg = ("ValueError", str(exc))
        except BaseException as exc:   # the others must not wait for a list that never comes
            listing.broadcast(("ValueError", f"data: the scan failed on the first process: "
                                             f"{type(exc).__name__}: {exc}"))
            raise
    msg = listing.broadcast(msg)
    if msg[0] == "ok":
        return msg[1]
    raise (FileNotFoundError if msg[0] == "FileNotFoundError" else ValueError)(msg[1])
