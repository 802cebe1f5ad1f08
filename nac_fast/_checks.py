"""Argument checks shared by every layer: each raises a TypeError or ValueError whose message
starts with the argument's name (as the caller gives it: "batch_size", "queue size",
"query.nbits", ...) and returns the checked value.

    positive_int("batch_size", b)        # ValueError "batch_size must be a positive int, got 0"
    flag("channels_last", c)             # TypeError  "channels_last must be a bool, got 1"
    tensor("keys", k)                    # TypeError  "keys must be a torch.Tensor, got list"

A bool is never accepted where a number is asked for (True is an int to Python).  A leaf of the
package: it imports nothing of nac_fast (tests/test_layering.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["is_int", "is_number", "integer", "positive_int", "int_in", "flag", "tensor",
           "positive_number", "nonnegative_float", "unit_float", "flip_prob"]


def is_int(v, *, numpy: bool = False) -> bool:
    """v is an int and not a bool (numpy integers count too with ``numpy=True``)."""
    return not isinstance(v, bool) and isinstance(v, (int, np.integer) if numpy else int)


def is_number(v) -> bool:
    """v is a real number and not a bool: an int or a float, or a numpy integer or floating
    scalar (np.float32(0.1) as well as np.float64, which is a float)."""
    return (not isinstance(v, (bool, np.bool_))
            and isinstance(v, (int, float, np.integer, np.floating)))


def signed_real(dtype: torch.dtype) -> bool:
    """A dtype that holds -1 and +1 exactly as numbers: a floating or signed integer one (not
    bool, whose False is 0; not unsigned, whose -1 is 255; not complex)."""
    return dtype != torch.bool and not dtype.is_complex and dtype.is_signed


def integer(name: str, v, *, numpy: bool = False) -> int:
    """TypeError "<name> must be an int, got <type>" unless ``is_int(v, numpy=numpy)``."""
    if not is_int(v, numpy=numpy):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    return int(v)


def positive_int(name: str, v) -> int:
    """ValueError "<name> must be a positive int, got <v>" unless v is an int >= 1."""
    if not is_int(v) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def int_in(name: str, v, low: int, high: int | None = None, *, note: str = "") -> int:
    """ValueError "<name> must be an int in [low, high]<note>, got <v>" (">= low" without
    ``high``) unless v is such an int."""
    if not is_int(v) or v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {span}{note}, got {v!r}")
    return v


def flag(name: str, v) -> bool:
    """TypeError "<name> must be a bool, got <v>" unless v is True or False."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def tensor(name: str, t, what: str = "a torch.Tensor") -> torch.Tensor:
    """TypeError "<name> must be <what>, got <type>" unless t is a torch.Tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be {what}, got {type(t).__name__}")
    return t


def positive_number(name: str, v) -> float:
    """ValueError "<name> must be a positive number, got <v>" unless v is a number > 0."""
    if not is_number(v) or not v > 0:
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return float(v)


def nonnegative_float(name: str, v, *, finite: bool = False) -> float:
    """ValueError "<name> must be a [finite ]float >= 0, got <v>" unless v is a number >= 0
    (and finite, when asked)."""
    if not is_number(v) or not v >= 0 or (finite and not math.isfinite(v)):
        raise ValueError(f"{name} must be a {'finite ' if finite else ''}float >= 0, got {v!r}")
    return float(v)


def unit_float(name: str, v) -> float:
    """ValueError "<name> must be a float in [0, 1], got <v>" unless v is a number in [0, 1]."""
    if not is_number(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{name} must be a float in [0, 1], got {v!r}")
    return float(v)


def flip_prob(name: str, p) -> float:
    """The channel's bit-flip probability (docs/math.md [M:channel]) as a float in the open
    interval (0, 0.5): TypeError for a tensor, a bool or a non-number, ValueError outside it."""
    if isinstance(p, torch.Tensor):
        if p.numel() != 1:
            raise TypeError(f"{name} must be a float in (0, 0.5), got a tensor of shape "
                            f"{tuple(p.shape)}")
        p = p.item()
    if not is_number(p):
        raise TypeError(f"{name} must be a float in (0, 0.5), got {type(p).__name__}")
    p = float(p)
    if not 0.0 < p < 0.5:
        raise ValueError(f"{name} must lie in the open interval (0, 0.5), got {p}")
    return p
