"""Atomic training checkpoints, RNG state capture, and loading a trained model for evaluation.

    save_atomic(state, path)      # temp file in the same directory, fsync, rename, fsync the dir
    latest_checkpoint(out_dir)    # out_dir/last.pt or None
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
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's current device
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_checkpoint(path: str, map_location="cpu") -> dict:
    # weights_only=False: the checkpoint holds numpy/python RNG states and the config dict,
    # written by this code; only load checkpoints you trust.
    return torch.load(path, map_location=map_location, weights_only=False)


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
