"""The VAE's encoder from a train.py checkpoint (NAC, NAC-MQ or SimCLR: one code path).

    enc, info = load_pretrained_encoder("runs/nac/last.pt", which="online")
    info   # {"method", "arch", "in_channels", "image_size", "data", "run_id", "step", "which"}

Only the encoder f is taken (the keys "encoder.*" of the model's state dict, loaded strictly
into a nac_fast.train.models.ResNetEncoder of the recorded architecture); the projection head
and the inference network are dropped, as for the linear probe.  "momentum" takes NAC-MQ's EMA
model.  Every failure is a ValueError naming the file and what is wrong.
"""
from __future__ import annotations

import torch

from ..train.checkpoint import load_checkpoint
from ..train.models import RESNETS, ResNetEncoder

WHICH = ("online", "momentum")
PREFIX = "encoder."


def load_pretrained_encoder(path: str, which: str = "online"):
    if which not in WHICH:
        raise ValueError(f"--which must be one of {WHICH}, got {which!r}")
    ck = load_checkpoint(path)             # ValueError for missing / corrupt / not a dict
    cfg = ck["config"]
    if isinstance(cfg, dict) and cfg.get("kind") == "vae":
        raise ValueError(f"--init {path!r} is a VAE checkpoint of python -m nac_fast.vae, not a "
                         "train.py checkpoint; resume it with --out <its folder> --resume")
    if not isinstance(cfg, dict):
        raise ValueError(f"--init {path!r}: its config is a {type(cfg).__name__}, not a dict")
    missing = [k for k in ("arch", "in_channels", "image_size") if k not in cfg]
    if missing:
        raise ValueError(f"--init {path!r}: its config lacks {', '.join(missing)}: not a train.py "
                         "checkpoint")
    if cfg["arch"] not in RESNETS:
        raise ValueError(f"--init {path!r}: encoder architecture {cfg['arch']!r} is not one the "
                         f"VAE's decoder mirrors (a ResNet: {sorted(RESNETS)})")
    key = "model" if which == "online" else "momentum_model"
    state = ck.get(key)
    if state is None:
        raise ValueError(f"--init {path!r} --which {which}: the checkpoint has no {which} model "
                         f"(method {cfg.get('method')!r}; only nac-mq keeps a momentum model)")
    if not isinstance(state, dict):
        raise ValueError(f"--init {path!r}: its {key!r} is a {type(state).__name__}, not a "
                         "state dict")
    enc_state = {k[len(PREFIX):]: v for k, v in state.items()
                 if isinstance(k, str) and k.startswith(PREFIX)}
    if not enc_state:
        raise ValueError(f"--init {path!r}: the checkpoint's {which} model has no encoder weights "
                         f"(no '{PREFIX}*' keys among {len(state)} entries)")
    bad = [k for k, v in enc_state.items() if isinstance(v, torch.Tensor)
           and v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # the VAE would stop at its first step with a non-finite loss
        raise ValueError(f"--init {path!r}: the checkpoint's {which} encoder holds NaN or inf "
                         f"weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): a "
                         "diverged run; start from another checkpoint")
    enc = ResNetEncoder(cfg["arch"], int(cfg["in_channels"]), int(cfg["image_size"]))
    try:
        enc.load_state_dict(enc_state, strict=True)
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise ValueError(f"--init {path!r}: the encoder weights do not fit a {cfg['arch']} with "
                         f"{cfg['in_channels']} channels: {first}") from None
    info = {"method": cfg.get("method"), "arch": cfg["arch"],
            "in_channels": int(cfg["in_channels"]), "image_size": int(cfg["image_size"]),
            "data": cfg.get("data"), "run_id": cfg.get("run_id"), "step": ck.get("step"),
            "which": which}
    return enc, info
