"""Binary codes and their packed form: the input format of the Hamming engine (docs/math.md
[M:code], [M:hamming]).

    import nac_fast
    packed = nac_fast.pack_codes(codes)          # (n, ceil(D/64)) int64 words + nbits
    codes = nac_fast.unpack_codes(packed)         # +-1 float32 again

Codes are +-1 tensors (any real or signed integer dtype; bool means False = -1, True = +1), or
0/1 tensors with ``zero_one=True`` (1 = +1, 0 = -1; unsigned dtypes too), or a
:class:`PackedCodes`.  An unsigned integer dtype cannot hold -1, so +-1 codes in one (say -1 cast to
uint8, 255) are a TypeError.  Bit j of a code is bit
j % 64 of word j // 64, set for +1; padding bits past ``nbits`` are 0, so they never add to a
distance.  The search (ops/search.py), the retrieval metrics (ops/retrieval.py), the code
statistics (nac_fast/codestats.py) and the index (nac_fast/index) all take codes through here.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import torch

from .. import _checks

__all__ = ["PackedCodes", "pack_codes", "unpack_codes", "MAX_BITS"]

# The C++ kernel stores distances as uint16; 1023 words is the most that fits.
MAX_BITS = 1023 * 64


class PackedCodes(NamedTuple):
    """Binary codes packed into 64-bit words.

    ``words``: (n, ceil(nbits / 64)) int64; bit j of a code is bit j % 64 of word j // 64 (a set
    bit means +1); padding bits past ``nbits`` are 0.  The int64 dtype only stores the bit pattern.
    """

    words: torch.Tensor
    nbits: int


def check_tensor(name: str, t) -> None:
    _checks.tensor(name, t, "a torch.Tensor or PackedCodes")


def code_bits(name: str, codes: torch.Tensor, zero_one: bool, *, check: bool = True) -> torch.Tensor:
    """(n, D) codes -> (n, D) bool, True meaning +1; checks the values."""
    _checks.flag("zero_one", zero_one)
    check_tensor(name, codes)
    if codes.dim() != 2:
        raise ValueError(f"{name} must be 2-D (n, bits), got shape {tuple(codes.shape)}")
    if codes.shape[1] < 1:
        raise ValueError(f"{name} must have at least one bit per code, got shape {tuple(codes.shape)}")
    if codes.shape[1] > MAX_BITS:
        raise ValueError(f"{name} has {codes.shape[1]} bits; at most {MAX_BITS} are supported")
    if codes.dtype == torch.bool:
        return codes
    if codes.is_complex() or not (codes.is_floating_point() or is_integer_dtype(codes.dtype)):
        raise TypeError(f"{name} must have a real or bool dtype, got {codes.dtype}")
    codes = codes.detach()
    if not zero_one and is_unsigned_dtype(codes.dtype):
        # torch compares an unsigned tensor with -1 as with its maximum (255 for uint8): refuse
        # rather than take 255 for -1
        zo = bool(((codes == 0) | (codes == 1)).all()) if check else False
        raise TypeError(f"{name} has the unsigned dtype {codes.dtype}, which cannot hold the -1 "
                        "of +-1 codes" + (" (it looks like 0/1 codes: pass zero_one=True)" if zo
                                          else "; use a signed or floating dtype, or bool"))
    if zero_one:
        pos = codes == 1
        if check and not bool((pos | (codes == 0)).all()):
            raise ValueError(f"{name} must contain only 0 and 1 (zero_one=True)")
    else:
        pos = codes == 1
        if check and not bool((pos | (codes == -1)).all()):
            hint = (" (it looks like 0/1 codes: pass zero_one=True)"
                    if bool(((codes == 0) | (codes == 1)).all()) else
                    " (take the sign first, e.g. torch.where(a >= 0, 1, -1))")
            raise ValueError(f"{name} must contain only -1 and +1{hint}")
    return pos


def is_integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


_UNSIGNED = tuple(getattr(torch, f"uint{b}") for b in (8, 16, 32, 64) if hasattr(torch, f"uint{b}"))
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)


def is_unsigned_dtype(dtype: torch.dtype) -> bool:
    """An integer dtype that cannot hold -1 (uint8, uint16, uint32, uint64)."""
    return dtype in _UNSIGNED


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(n, D) bool -> (n, ceil(D/64)) int64 words (layout of PackedCodes).

    CPU tensors go through numpy.packbits, several times faster than the torch version
    (bench/results/cpu_micro.md, "Code statistics")."""
    n, d = bits.shape
    nw = (d + 63) // 64
    if n == 0:  # (numpy gives a zero-size array stride 0, which torch cannot view as int64)
        return torch.zeros((0, nw), dtype=torch.int64, device=bits.device)
    if bits.device.type != "cpu":
        return pack_bits_torch(bits)
    by = np.packbits(bits.numpy(), axis=1, bitorder="little")  # bit j -> byte j//8, bit j%8
    out = np.zeros((n, nw * 8), dtype=np.uint8)
    out[:, :by.shape[1]] = by
    if sys.byteorder != "little":  # pragma: no cover - no big-endian machine to test on
        out = out.reshape(n, nw, 8)[:, :, ::-1].reshape(n, nw * 8).copy()
    return torch.from_numpy(out).view(torch.int64)


def pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """The same packing in torch ops, for tensors on other devices."""
    n, d = bits.shape
    nw = (d + 63) // 64
    padded = torch.zeros((n, nw * 64), dtype=torch.uint8, device=bits.device)
    padded[:, :d] = bits
    p = padded.view(n, nw * 8, 8)  # byte b of a word holds bits 8b..8b+7
    by = p[..., 0].clone()
    for b in range(1, 8):
        by |= p[..., b] << b
    if sys.byteorder != "little":  # pragma: no cover
        by = by.view(n, nw, 8).flip(-1).reshape(n, nw * 8)
    return by.contiguous().view(torch.int64)


def unpack_bits(words: torch.Tensor, nbits: int) -> torch.Tensor:
    n, nw = words.shape
    by = words.contiguous().view(torch.uint8).view(n, nw * 8)
    if sys.byteorder != "little":  # pragma: no cover
        by = by.view(n, nw, 8).flip(-1).reshape(n, nw * 8)
    shifts = torch.arange(8, device=words.device, dtype=torch.uint8)
    bits = (by.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(n, nw * 64)[:, :nbits].bool()


def check_packed(name: str, p: PackedCodes) -> PackedCodes:
    words, nbits = p
    check_tensor(f"{name}.words", words)
    _checks.int_in(f"{name}.nbits", nbits, 1, MAX_BITS)
    if words.dtype != torch.int64:
        raise TypeError(f"{name}.words must be int64, got {words.dtype}")
    if words.dim() != 2 or words.shape[1] != (nbits + 63) // 64:
        raise ValueError(f"{name}.words must have shape (n, {(nbits + 63) // 64}) for "
                         f"nbits={nbits}, got {tuple(words.shape)}")
    if nbits % 64 and words.shape[0]:
        # Padding bits must be 0, or they would add to every distance.
        pad_mask = ~((1 << (nbits % 64)) - 1) & 0xFFFFFFFFFFFFFFFF
        pad_mask -= (1 << 64) if pad_mask >= (1 << 63) else 0  # as a signed int64
        if bool(((words[:, -1] & pad_mask) != 0).any()):
            raise ValueError(f"{name}.words has set padding bits past nbits={nbits}")
    return p


def pack_codes(codes: torch.Tensor, *, zero_one: bool = False) -> PackedCodes:
    """Pack (n, D) binary codes into (n, ceil(D/64)) int64 words: 128 bits -> 2 words.

    ``codes``: +-1 values (or bool), or 0/1 with ``zero_one=True``; anything else is a
    ValueError.  Bit j of a code is bit j % 64 of word j // 64, set for +1; padding bits are 0.
    """
    return as_packed("codes", codes, zero_one)


def unpack_codes(packed: PackedCodes, *, zero_one: bool = False,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (n, nbits) codes of ``dtype``, +-1 (or 0/1 with
    ``zero_one=True``; bool dtype gives True for +1).  ``dtype`` must be a torch.dtype that holds
    the values: an unsigned one (uint8, ...) only with ``zero_one=True`` (a TypeError else)."""
    if not isinstance(packed, PackedCodes):
        raise TypeError(f"packed must be PackedCodes, got {type(packed).__name__}")
    _checks.flag("zero_one", zero_one)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r}")
    if not zero_one and is_unsigned_dtype(dtype):
        raise TypeError(f"dtype {dtype} cannot hold the -1 of +-1 codes: use a signed or floating "
                        "dtype, bool, or zero_one=True for 0/1 codes")
    if not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex
            or dtype in _SIGNED + _UNSIGNED):
        raise TypeError(f"dtype must be a real, complex or bool torch.dtype, got {dtype}")
    words, nbits = check_packed("packed", packed)
    bits = unpack_bits(words, nbits)
    if dtype == torch.bool:
        return bits
    if zero_one:
        return bits.to(dtype)
    return (bits.to(torch.int8) * 2 - 1).to(dtype)  # (int8 first: float8 has no arithmetic)


def as_packed(name: str, codes, zero_one: bool = False) -> PackedCodes:
    """Any accepted code form -> a checked PackedCodes (the argument named ``name`` in errors)."""
    _checks.flag("zero_one", zero_one)
    if isinstance(codes, PackedCodes):
        return check_packed(name, codes)
    bits = code_bits(name, codes, zero_one)
    return PackedCodes(pack_bits(bits), int(bits.shape[1]))
