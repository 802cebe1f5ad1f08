"""Training checkpoints: atomic writes with a rotation of two, choosing the checkpoint to resume
from, RNG state capture, and loading a trained model for evaluation.

    save_atomic(state, path, previous=None)   # temp file, fsync, rename, fsync the dir
    w = BackgroundSave(); w.start(w.snapshot(state), path, previous)   # the same, in a thread:
    outcome = w.wait()                        # at most one in flight; its error in outcome.error
    path, ck, notes = pick_checkpoint(out)    # the newest good one: out/last.pt, else out/prev.pt
    ck = load_checkpoint(path)                # weights_only: tensors, numbers, strings, containers
    model = load_model(path)                  # NACModel with the trained (online or momentum) weights

A run keeps two checkpoints in --out: last.pt (the newest) and prev.pt (the one before).  A crash
at any moment leaves complete files under both names, never a torn one: the new checkpoint is
written to a temp file and fsynced, prev.pt becomes a hard link to the current last.pt (a rename
where the file system has no hard links), and only then does os.replace give the new file the
name last.pt.  So a failed write (disk full, read-only directory) leaves last.pt as it was, and
a checkpoint that is damaged later (a truncated copy, bad storage) still has prev.pt behind it.

A save need not stall training (train.py --save-mode async, the default): `snapshot` copies the
state to host memory at the step boundary (later steps cannot change the copy), and a
`BackgroundSave` thread writes the copy with save_atomic while the steps go on; a kill during
that write leaves the checkpoints of before, as above.
"""
from __future__ import annotations

import copy
import glob
import json
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._files import atomic_write

LAST = "last.pt"    # the newest checkpoint
PREV = "prev.pt"    # the one before it (rotation: see the module docstring)
CONFIG = "config.json"
# What every train.py checkpoint holds; resume needs all of them, evaluation the first two.
MODEL_KEYS = ("model", "config")
STATE_KEYS = MODEL_KEYS + ("optimizer", "scaler", "step", "rng")
_TMP = ".tmp-"      # prefix of save_atomic's temp files
# TEST HOOK: "STEP:SECONDS" makes the BackgroundSave of label STEP pause SECONDS after the first
# bytes of its temp file are written (tests/test_train_resume.py kills a run during that write)
PAUSE_ENV = "NAC_FAST_TEST_SAVE_PAUSE"


def save_atomic(state: dict, path: str, previous: str | None = None, *,
                _pause_s: float = 0.0) -> None:
    """Write `state` to `path` so that `path` is always a complete file (old or new).

    previous: a path in the same directory that takes over the file now at `path` (if any) just
    before the new one replaces it: the rotation last.pt -> prev.pt.  Any failure (a full disk,
    an unwritable directory, an unpicklable state) raises, leaves no temp file behind, and leaves
    `path` and `previous` unchanged, except when only the final rename failed: then `previous`
    holds the file `path` still holds (or, on a file system without hard links, the file `path`
    held, `path` being absent)."""
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP + os.path.basename(path) + ".", dir=d)
    link = tmp + ".prev"
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, _PausedFile(f, _pause_s) if _pause_s > 0 else f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the mode a plain open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if previous is not None and os.path.isfile(path):
            try:
                os.link(path, link)             # previous and path: the same file for a moment
            except OSError:                     # no hard links here: path is absent until the
                os.replace(path, previous)      # next line (pick_checkpoint falls back then)
            else:
                os.replace(link, previous)
                if os.path.lexists(link):       # previous was this very file already: rename
                    os.unlink(link)             # of a file onto itself does nothing
        os.replace(tmp, path)
    except BaseException:
        for t in (tmp, link):
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the renames themselves durable
    finally:
        os.close(dfd)


class _PausedFile:
    """TEST HOOK (PAUSE_ENV): a file whose first write is flushed, then followed by a pause of
    `seconds`, so that a test can kill the process while a checkpoint is half written."""

    def __init__(self, f, seconds: float):
        self._f, self._seconds, self._paused = f, seconds, False

    def write(self, b):
        n = self._f.write(b)
        if not self._paused:
            self._paused = True
            self._f.flush()
            time.sleep(self._seconds)
        return n

    def flush(self):
        self._f.flush()


def snapshot(state):
    """A copy of `state` (a checkpoint's dict) that later training steps cannot change: every
    tensor copied to host memory (same values, dtype, shape and strides; a tensor that appears
    twice is copied once and stays one object), containers rebuilt (a dict subclass such as a
    state dict's OrderedDict keeps its type and its attributes, e.g. _metadata), numbers,
    strings, None and other immutable values kept, anything else deep-copied.  Taken
    synchronously at the step boundary; on a GPU, one device-to-host copy per tensor.
    (BackgroundSave.snapshot: the same into the host memory of the previous save.)"""
    return _copy(state, {}, set(), (), None)


def _copy(obj, memo: dict, taken: set, path: tuple, pool: dict | None):
    """snapshot's recursion.  memo: {id(source tensor): its copy}; taken: ids of the pool's
    tensors this copy uses (one buffer never holds two tensors); pool: {key path: host tensor}
    of an earlier copy, whose tensors are overwritten where shape, dtype and strides match, and
    which is updated with this copy's."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            t = obj.detach()
            old = pool.get(path) if pool is not None else None
            if (old is not None and id(old) not in taken and old.shape == t.shape
                    and old.dtype == t.dtype and old.stride() == t.stride()):
                memo[id(obj)] = old.copy_(t)
            else:
                memo[id(obj)] = t.to("cpu", copy=True)
            taken.add(id(memo[id(obj)]))
        if pool is not None:
            pool[path] = memo[id(obj)]
        return memo[id(obj)]
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        out = type(obj)()
        for k, v in obj.items():
            out[k] = _copy(v, memo, taken, path + (k,), pool)
        if getattr(obj, "__dict__", None):   # OrderedDict._metadata of a module state dict
            out.__dict__.update(copy.deepcopy(obj.__dict__))
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_copy(v, memo, taken, path + (i,), pool) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


@dataclass
class SaveOutcome:
    """What a BackgroundSave's write came to: error None = `path` holds the state of `label`."""
    label: Any
    path: str
    error: BaseException | None
    seconds: float          # the write itself (save_atomic), in the background thread


class BackgroundSave:
    """save_atomic in a background thread, at most one write at a time.

        w = BackgroundSave()
        w.start(w.snapshot(state), path, previous, label=step)   # returns at once
        outcome = w.wait()      # blocks until the write is done: SaveOutcome, or None if idle

    start() refuses (RuntimeError) while a write is in flight: wait() first, so that no
    outcome, and no error, is lost.  The thread is not a daemon: an interpreter that exits with a
    write in flight finishes it first.  The state passed must not change while it is written
    (`snapshot`)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self._pause = _parse_pause(os.environ.get(PAUSE_ENV))
        self._pool: dict = {}   # the last snapshot's host tensors by key path (snapshot)

    def snapshot(self, state):
        """`snapshot(state)`, written into the host memory of the previous save's copy where the
        tensors fit (no new allocation, no page faults: the copy is a plain memcpy), so the
        BackgroundSave keeps one host copy of the state between saves.  RuntimeError while a
        write is in flight (it reads that memory): wait() first."""
        if self._thread is not None:
            raise RuntimeError("BackgroundSave.snapshot: a write is in flight; wait() for it "
                               "first")
        # one thread: a copy is memory-bound, and on a CPU shared with other work OpenMP's
        # spinning threads turned the ~800 parallel copies of a ResNet-50 state into seconds
        # (bench/results/checkpoint_save_cpu.md)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _copy(state, {}, set(), (), self._pool)
        finally:
            torch.set_num_threads(threads)

    @property
    def busy(self) -> bool:
        """A write was started and its outcome not yet collected by wait()."""
        return self._thread is not None

    def start(self, state: dict, path: str, previous: str | None = None, label=None) -> None:
        if self._thread is not None:
            raise RuntimeError("BackgroundSave.start: a write is in flight; wait() for it first")
        pause = self._pause[1] if self._pause is not None and self._pause[0] == label else 0.0

        def write():
            t0, err = time.perf_counter(), None
            try:
                save_atomic(state, path, previous=previous, _pause_s=pause)
            except BaseException as exc:  # noqa: BLE001  (reported by wait(), never lost)
                err = exc
            self._outcome = SaveOutcome(label, path, err, time.perf_counter() - t0)

        self._outcome = None
        self._thread = threading.Thread(target=write, name=f"nac_fast-save-{label}")
        self._thread.start()

    def wait(self) -> SaveOutcome | None:
        """Block until the write in flight is done; its outcome (None when there was none)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        out, self._outcome = self._outcome, None
        return out


def _parse_pause(v: str | None):
    """PAUSE_ENV's value "STEP:SECONDS" as (STEP, SECONDS); None when unset or empty."""
    if v is None or not v.strip():
        return None
    try:
        step, seconds = v.split(":")
        step, seconds = int(step), float(seconds)
    except ValueError:
        step = seconds = None
    if step is None or not (seconds >= 0 and seconds < float("inf")):
        raise ValueError(f"environment variable {PAUSE_ENV} must be STEP:SECONDS (a test hook), "
                         f"got {v!r}")
    return step, seconds


def remove_stale_temp_files(out_dir: str) -> list:
    """Delete the temp files a killed save_atomic left for last.pt / prev.pt in out_dir (a kill
    during a save leaves a partial file of up to a checkpoint's size).  Call before any save of
    the run starts; returns the removed paths."""
    gone = []
    for name in (LAST, PREV):
        for p in glob.glob(os.path.join(glob.escape(out_dir), _TMP + name + ".*")):
            try:
                os.unlink(p)
                gone.append(p)
            except FileNotFoundError:
                pass
    return gone


def read_json(path: str):
    """A small JSON file of ours (config.json, non_finite.json) or None if absent or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json_atomic(obj, path: str) -> None:
    """`obj` as JSON at `path`, written atomically (nac_fast/_files.py)."""
    atomic_write(path, lambda f: json.dump(obj, f, indent=1, default=str), mode="w")


def pick_checkpoint(directory: str, run_id: str | None = None, reject=None,
                    require=STATE_KEYS):
    """The checkpoint to resume from in `directory`: last.pt if it loads as a complete train.py
    checkpoint, else prev.pt.  run_id (the run that owns the directory, from its config.json):
    a checkpoint recorded as another run's is skipped.  reject(path, checkpoint): a reason why a
    checkpoint that loads is not of this kind (e.g. python -m nac_fast.vae's), counted as
    damaged, or None; require: the keys a complete checkpoint of that kind holds.

    Returns (path, checkpoint, notes): (None, None, notes) when there is none to resume (a fresh
    start); notes say what was skipped and why.  Raises ValueError, naming the files, when a
    checkpoint exists but none can be used (a damaged last.pt and no good prev.pt of the run)."""
    damaged, notes = [], []
    for name in (LAST, PREV):
        p = os.path.join(directory, name)
        if not os.path.lexists(p):
            continue
        try:
            ck = load_checkpoint(p, require=require)
        except ValueError as exc:
            damaged.append(str(exc))
            continue
        why = reject(p, ck) if reject is not None else None
        if why:
            damaged.append(why)
            continue
        rid = ck["config"].get("run_id")
        if run_id and rid and rid != run_id:
            notes.append(f"{p} is a checkpoint of another run (run_id {rid}; {CONFIG}: "
                         f"{run_id}): not resumed")
            continue
        return p, ck, damaged + notes
    if damaged:
        raise ValueError(f"no usable checkpoint in {directory!r}: " + "; ".join(damaged + notes))
    return None, None, notes


def capture_rng_state() -> dict:
    """Every RNG a run draws from, as tensors and Python ints only (what weights_only loads)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's current device
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached"]))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_checkpoint(path: str, map_location="cpu", require=MODEL_KEYS) -> dict:
    """A train.py checkpoint, loaded with weights_only=True: tensors, numbers, strings and
    containers only (no code runs from the file).  A file that is missing, unreadable, empty,
    truncated or corrupt, or that is not a dict with the keys `require`, raises ValueError
    naming it."""
    if not os.path.lexists(path):
        raise ValueError(f"checkpoint {path!r}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} is not a regular file")
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise ValueError(f"checkpoint {path!r} cannot be read: {exc}") from exc
    if size == 0:
        raise ValueError(f"checkpoint {path!r} is empty (0 bytes): a write that never finished")
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except (PermissionError, FileNotFoundError, IsADirectoryError) as exc:
        raise ValueError(f"checkpoint {path!r} cannot be read: {exc}") from exc
    except Exception as exc:  # truncated, corrupt, or not a file of torch.save
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise ValueError(f"checkpoint {path!r} ({size} bytes) is truncated, corrupt or not a "
                         f"checkpoint: {type(exc).__name__}: {msg}") from exc
    if not isinstance(ck, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(ck).__name__}, not a train.py "
                         "checkpoint (a dict)")
    missing = [k for k in require if k not in ck]
    if missing:
        raise ValueError(f"checkpoint {path!r} is not a train.py checkpoint: it has no "
                         f"{', '.join(missing)} (keys: {sorted(map(str, ck))[:8]})")
    if "config" in require and not isinstance(ck["config"], dict):
        raise ValueError(f"checkpoint {path!r} is not a train.py checkpoint: its config is a "
                         f"{type(ck['config']).__name__}, not a dict")
    return ck


COMPILED_PREFIX = "_orig_mod."  # what a torch.compile wrapper (OptimizedModule) adds to keys


def plain_state_dict(sd: dict) -> dict:
    """A module state dict with the "_orig_mod." segments of torch.compile wrappers removed
    (a model saved as torch.compile(model).state_dict() by other code; train.py's own
    checkpoints never have them: it compiles in place, run.compile_encoders).  ValueError when
    two keys become one."""
    if not any(COMPILED_PREFIX in k for k in sd):
        return sd
    out = {}
    for k, v in sd.items():
        plain = k.replace(COMPILED_PREFIX, "")
        if plain in out:
            raise ValueError(f"state dict has both {plain!r} and a compiled wrapper's {k!r}")
        out[plain] = v
    return out


def load_model(path: str, which: str = "online", map_location="cpu"):
    """The trained NACModel (encoder, head, inference net) from a train.py checkpoint.

    which: "online" (default) or "momentum" (NAC-MQ's EMA model).  Returned in eval mode.
    The config stored in the checkpoint says which architecture to build.
    """
    from .models import build_model, model_kwargs_from_config
    if which not in ("online", "momentum"):
        raise ValueError(f"which must be 'online' or 'momentum', got {which!r}")
    ck = load_checkpoint(path, map_location)
    key = "model" if which == "online" else "momentum_model"
    if ck.get(key) is None:
        raise ValueError(f"checkpoint {path} has no {which} model (method {ck['config']['method']})")
    model = build_model(**model_kwargs_from_config(ck["config"]))
    model.load_state_dict(plain_state_dict(ck[key]))
    return model.eval()
