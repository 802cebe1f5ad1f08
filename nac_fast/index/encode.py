"""From a checkpoint and image files to binary codes: what `python -m nac_fast.index` encodes with.

    enc = CodeEncoder("runs/default/last.pt", bits=64)       # the model in eval mode + its preprocessing
    files, labels, ignored = scan_images("my_images/")         # recursive; class folders -> labels
    result = enc.encode_files(files, batch_size=256)           # codes of the readable files
    result.codes (n, bits) bool, result.files, result.unreadable [(path, error), ...]

The code of an image is c = sgn(a) with 0 -> +1 (docs/math.md [M:code]), a = the projection
head's output of the frozen model (``which``: the online model, or NAC-MQ's momentum model) in
eval mode (BatchNorm with its running statistics), under torch.no_grad; ``bits`` < D keeps the
first ``bits`` bits (a prefix of the D-bit code, as in `python -m nac_fast.eval --bits`,
[M:prefix]).  The image is decoded and preprocessed as the model's evaluation view
(nac_fast.data.preprocess.checkpoint_preprocessing: read from the checkpoint's config).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import _checks
from ..data.preprocess import checkpoint_preprocessing, load_image
from ..data.sources.imagefolder import IMAGE_EXTENSIONS, walk_following_links
from ..train.checkpoint import load_checkpoint, load_model
from .hash_index import _check_device

__all__ = ["CodeEncoder", "EncodeResult", "scan_images", "file_sha256", "describe_paths"]

CODE_RULE = "c = sgn(a), 0 -> +1 (docs/math.md [M:code]); the first `bits` bits of the D-bit code"


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def describe_paths(paths, most: int = 5) -> str:
    """'a, b, c and 7 more' (the first few names of a list, for messages)."""
    paths = list(paths)
    shown = ", ".join(str(p) for p in paths[:most])
    return shown + (f" and {len(paths) - most} more" if len(paths) > most else "")


def scan_images(root: str):
    """Image files under ``root``, recursively, in sorted order (hidden files and folders
    skipped): ``(files, labels, ignored)``.  ``labels[i]`` is the name of the first-level
    sub-folder of ``root`` that holds files[i] (a class folder), or None for a file directly
    in ``root``; ``ignored`` lists the files whose extension is not an image's
    (``IMAGE_EXTENSIONS``).  Paths are absolute.  Symlinked folders are followed, as the
    training ImageFolder (nac_fast/data/sources/imagefolder.py) follows them, so a class folder
    that is a link is indexed rather than silently left out; a link to a folder already read (a
    loop back to an ancestor, or a second link to one folder) is not followed again."""
    root = os.path.abspath(root)
    files, labels, ignored = [], [], []
    for d, names in walk_following_links(root, {os.path.realpath(root)}):
        rel = os.path.relpath(d, root)
        label = None if rel == "." else rel.split(os.sep)[0]
        for name in sorted(names):
            if name.startswith("."):
                continue
            p = os.path.join(d, name)
            if name.lower().endswith(IMAGE_EXTENSIONS):
                files.append(p)
                labels.append(label)
            else:
                ignored.append(p)
    return files, labels, ignored


@dataclasses.dataclass
class EncodeResult:
    codes: torch.Tensor        # (n, bits) bool, True = +1, for the readable files
    files: list                # the readable files, in input order
    kept: list                 # their positions in the input list
    unreadable: list           # [(path, "ErrorType: message"), ...]


class CodeEncoder:
    """The frozen model of a train.py checkpoint and its preprocessing (module docstring).

    ValueError naming the checkpoint when it is not a train.py checkpoint, has no code head, or
    does not record its preprocessing; ``bits`` must be in [1, D]; ``device`` must be "cpu" or an
    available "cuda[:i]" (checked first, a ValueError naming it: "device ...")."""

    def __init__(self, checkpoint: str, *, bits: int | None = None, which: str = "online",
                 device: str = "cpu"):
        if which not in ("online", "momentum"):
            raise ValueError(f"which must be 'online' or 'momentum', got {which!r}")
        device = _check_device("device", device)
        ck = load_checkpoint(checkpoint)                    # ValueError for damaged / foreign files
        cfg = ck.get("config")
        state = ck.get("model" if which == "online" else "momentum_model")
        if not isinstance(cfg, dict) or not isinstance(state, dict):
            raise ValueError(f"checkpoint {checkpoint!r} has no {which} model and config")
        if cfg.get("code_dim") is None or not any(str(k).startswith("head.") for k in state):
            raise ValueError(f"checkpoint {checkpoint!r} has no code head (no projection head g "
                             "and code_dim in its model): there are no codes to index")
        D = int(cfg["code_dim"])
        if bits is None:
            bits = D
        _checks.int_in("bits", bits, 1, D, note=" (the model's code length)")
        try:
            self.prep = checkpoint_preprocessing(cfg)
        except ValueError as exc:
            raise ValueError(f"checkpoint {checkpoint!r}: {exc}") from None
        self.checkpoint = os.path.abspath(checkpoint)
        self.bits, self.code_dim, self.which = bits, D, which
        self.device = device
        self.model = load_model(checkpoint, which).to(self.device).eval()
        self.meta = {
            "checkpoint": self.checkpoint,
            "checkpoint_sha256": file_sha256(checkpoint),
            "checkpoint_step": ck.get("step"),
            "method": cfg.get("method"), "arch": cfg.get("arch"),
            "code_dim": D, "bits": bits, "which": which,
            "encoder_mode": "eval (BatchNorm running statistics), torch.no_grad",
            "code": CODE_RULE,
            "image_size": self.prep["image_size"], "in_channels": self.prep["in_channels"],
            "normalization": {"mean": self.prep["mean"], "std": self.prep["std"]},
            "resize": self.prep["resize"], "trained_on": self.prep["data"],
        }

    @torch.no_grad()
    def encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) preprocessed images -> (B, bits) bool codes (True = +1)."""
        _, a = self.model.encode(x.to(self.device))
        return (a[:, :self.bits] >= 0).cpu()

    def encode_files(self, files, *, batch_size: int = 256, progress: bool = True,
                     desc: str = "encoding") -> EncodeResult:
        """Codes of every readable file (decoded in 2 threads, encoded in batches); a file PIL
        cannot decode is skipped and listed in ``unreadable``, never fatal here."""
        from tqdm.auto import tqdm
        _checks.positive_int("batch_size", batch_size)
        files = list(files)
        codes, kept, unreadable = [], [], []

        def decode(p):
            try:
                return load_image(p, self.prep), None
            except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ...
                return None, f"{type(exc).__name__}: {exc}"

        with ThreadPoolExecutor(2) as pool, tqdm(total=len(files), desc=desc, unit="img",
                                                 disable=not progress, file=sys.stderr) as bar:
            for s in range(0, len(files), batch_size):
                chunk = files[s:s + batch_size]
                xs = []
                for j, (x, err) in enumerate(pool.map(decode, chunk)):
                    if x is None:
                        unreadable.append((chunk[j], err))
                    else:
                        xs.append(x)
                        kept.append(s + j)
                if xs:
                    codes.append(self.encode_tensor(torch.stack(xs)))
                bar.update(len(chunk))
        c = torch.cat(codes) if codes else torch.zeros((0, self.bits), dtype=torch.bool)
        return EncodeResult(c, [files[i] for i in kept], kept, unreadable)
