"""Training checkpoints: atomic writes with a rotation of two, choosing the checkpoint to resume
from, RNG state capture, and loading a trained model for evaluation.

    save_atomic(state, path, previous=None)   # temp file, fsync, rename, fsync the dir
    path, ck, notes = pick_checkpoint(out)    # the newest good one: out/last.pt, else out/prev.pt
    ck = load_checkpoint(path)                # weights_only: tensors, numbers, strings, containers
    model = load_model(path)                  # NACModel with the trained (online or momentum) weights

A run keeps two checkpoints in --out: last.pt (the newest) and prev.pt (the one before).  A crash
at any moment leaves complete files under both names, never a torn one: the new checkpoint is
written to a temp file and fsynced, prev.pt becomes a hard link to the current last.pt (a rename
where the file system has no hard links), and only then does os.replace give the new file the
name last.pt.  So a failed write (disk full, read-only directory) leaves last.pt as it was, and
a checkpoint that is damaged later (a truncated copy, bad storage) still has prev.pt behind it.
"""
from __future__ import annotations

import glob
import json
import os
import random
import tempfile

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


def save_atomic(state: dict, path: str, previous: str | None = None) -> None:
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
            torch.save(state, f)
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
