"""Atomic training checkpoints, RNG state capture, and loading a trained model for evaluation.

    save_atomic(state, path)      # temp file in the same directory, fsync, rename, fsync the dir
    latest_checkpoint(out_dir)    # out_dir/last.pt or None
    ck = load_checkpoint(path)    # weights_only: tensors, numbers, strings, containers
    model = load_model(path)      # NACModel with the trained (online or momentum) weights

A crash at any moment leaves either the previous checkpoint or the new one, never a torn file:
os.replace is atomic within a file system, and the fsyncs make the data durable before the name
points at it.
"""
from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import torch

LAST = "last.pt"


def save_atomic(state: dict, path: str) -> None:
    path = os.path.abspath(path)
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; give it the mode a plain open() would have
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)  # make the rename itself durable
    finally:
        os.close(dfd)


def latest_checkpoint(out_dir: str) -> str | None:
    p = os.path.join(out_dir, LAST)
    return p if os.path.isfile(p) else None


def resolve_resume(resume: str, out_dir: str) -> str | None:
    """--resume value -> checkpoint path. 'auto'/'latest' = out_dir/last.pt if present (None if
    not: a fresh start); anything else must be an existing file or a directory holding last.pt."""
    if resume in ("auto", "latest"):
        return latest_checkpoint(out_dir)
    if os.path.isdir(resume):
        p = latest_checkpoint(resume)
        if p is None:
            raise ValueError(f"--resume {resume!r}: directory has no {LAST}")
        return p
    if not os.path.isfile(resume):
        raise ValueError(f"--resume {resume!r}: no such checkpoint file")
    return resume


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
    if isinstance(npst, dict):
        np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                             npst["has_gauss"], npst["cached"]))
    else:  # a checkpoint written before 0.2: numpy's own tuple
        np.random.set_state(npst)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _numpy_globals() -> list:
    """The numpy types a checkpoint written before 0.2 pickled (its numpy RNG state), allowed
    for weights_only loading; nothing else outside torch's own allow-list."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out.append(dtypes.UInt32DType)
    return out


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """A train.py checkpoint, loaded with weights_only=True: tensors, numbers, strings and
    containers only (no code runs from the file).  A file that is not one raises ValueError
    naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r}: no such file")
    with torch.serialization.safe_globals(_numpy_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as exc:  # truncated, corrupt, or not a checkpoint of ours
            raise ValueError(f"checkpoint {path!r} cannot be read: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


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
    model.load_state_dict(ck[key])
    return model.eval()
