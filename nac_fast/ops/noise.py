"""The NAC channel: its scale s and its noise m, drawn from a seed (docs/math.md [M:channel],
[M:philox]).

    s = channel_scale(p)                         # the channel scale s
    m = draw_noise((n, D), p)                    # +-1 noise; seeded by torch's RNG
    m = noise_from_seed(like, seed, p)           # the same bits on every backend

The noise is Philox4x32-10 of (seed, element index) [M:philox]: the compiled op nac_fast::nac_noise
(csrc/nac_noise.cpp, csrc/nac_cuda.cu), the Triton kernel (kernels/nac_noise_triton.py) and the
torch reference (nac_fast.ops.reference.philox_noise) compute the same bits, tested bit for bit.
"""
from __future__ import annotations

import math

import torch

from .. import _checks
from . import reference
from .dispatch import eager_real, resolve_backend


def channel_scale(p: float) -> float:
    """The scale s > 0 of the symmetric channel's log-likelihood (docs/math.md [M:channel])."""
    return _scale(check_p(p))


def _scale(p: float) -> float:  # p already checked
    return 0.5 * math.log((1.0 - p) / p)


def check_p(p) -> float:
    """p as a float in (0, 0.5), or ValueError/TypeError naming p."""
    return _checks.flip_prob("p", p)


def draw_noise(shape, p: float, *, device=None, dtype=torch.float32,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Channel noise m of docs/math.md [M:channel], drawn as in [M:philox].

    A 64-bit seed is drawn from torch's RNG (``generator``, else the default generator of
    ``device``), so ``torch.manual_seed`` reproduces it; the noise is then
    :func:`noise_from_seed`, computed by the fused kernel of the device when there is one.  Every
    backend computes the same bits from the same seed."""
    if isinstance(shape, int):
        shape = (shape,)
    if (not isinstance(shape, (tuple, list, torch.Size))
            or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in shape)):
        raise ValueError(f"shape must be a tuple of non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    if not _checks.signed_real(dtype):
        raise TypeError(f"dtype must be a signed real dtype that holds -1 and +1, got {dtype}")
    return _draw(tuple(shape), check_p(p), device=device, dtype=dtype, generator=generator)


def _draw(shape, p: float, *, device=None, dtype=torch.float32, generator=None):  # p checked
    device = torch.device("cpu") if device is None else torch.device(device)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    like_dtype = dtype if dtype.is_floating_point else torch.float32
    like = torch.empty(shape, device=device, dtype=like_dtype)
    seed = host_seed(device, generator) if _takes_host_seed(like) else None
    if seed is not None:  # the Triton noise kernel, its seed an argument (no device draw)
        from ..kernels import nac_noise_triton
        m = nac_noise_triton.noise(like, seed, p)
    else:
        m = noise_from_seed(like, _seed(device, generator), p)
    return m if m.dtype == dtype else m.to(dtype)


def _takes_host_seed(like: torch.Tensor) -> bool:
    """Whether draw_noise's noise for `like` comes from a host seed: where the loss's own draw does
    (a CUDA tensor, the Triton kernels, an eager call), so that drawing the noise first and
    letting the loss draw it (noise=None) give the same bits from the same RNG state."""
    return (like.device.type == "cuda" and eager_real(like)
            and resolve_backend("auto", like, op="noise") == "triton")


def _seed(device: torch.device, generator=None) -> torch.Tensor:
    """The one-element int64 seed of a noise draw on `device`: drawn from `generator` (else the
    default generator of `device`), on the generator's device, moved to `device`."""
    gdev = generator.device if generator is not None else device
    seed = torch.randint(0, 2 ** 63 - 1, (1,), device=gdev, generator=generator)
    return seed if seed.device == device else seed.to(device)


_MASK64 = (1 << 64) - 1


def host_seed(device: torch.device, generator=None):
    """A noise seed for a call on `device`, drawn on the host: an int in [2^62, 2^63) (the kernels
    take it as an int64 argument), or None where the device must draw it (`_seed`).

    On a GPU outside CUDA-graph capture it comes from `generator` if it is that GPU's (else None),
    or from the device's default CUDA generator, whose Philox offset it advances by 4 (what a
    device draw of four 32-bit numbers reserves): a function of the generator's seed and offset,
    so torch.manual_seed and get_rng_state / set_rng_state reproduce it and the generator's other
    draws stay independent of it, with no launch and no allocation (a torch.randint on the device
    costs one of each: ~30 us of an H100 host's time,
    bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27_run3/host_profile.txt).  Fused dropout kernels
    reserve their Philox offsets on the host the same way.  Under capture a host seed would be
    baked into the graph (every replay the same noise): None, and the device draws it,
    graph-safe."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if generator is None:
        gen = torch.cuda.default_generators[index]
    elif generator.device == torch.device("cuda", index):
        gen = generator
    else:
        return None
    offset = gen.get_offset()
    gen.set_offset(offset + 4)
    return mix_seed(gen.initial_seed(), offset)


def mix_seed(seed: int, offset: int) -> int:
    """splitmix64 of a generator's (seed, offset), in [2^62, 2^63): host_seed's value."""
    z = (seed * 0x9E3779B97F4A7C15 + offset + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (1 << 62) | (z >> 2)


def noise_from_seed(like: torch.Tensor, seed: torch.Tensor, p: float, *,
                    backend: str = "auto") -> torch.Tensor:
    """The channel noise for ``seed``: a tensor of like's shape, (floating) dtype and device, the
    Philox4x32-10 noise of docs/math.md [M:philox] (element e = the row-major index).

    ``seed``: a one-element int64 tensor (on like's device: a GPU never waits for the host).
    ``backend``: "auto" (the device's fused kernel, else the reference) or one of "reference"
    (torch ops, nac_fast.ops.reference.philox_noise), "cpu"/"cuda" (the compiled op
    nac_fast::nac_noise, csrc/nac_noise.cpp / nac_cuda.cu), "triton"
    (kernels/nac_noise_triton.py).  All give the same bits."""
    if not isinstance(like, torch.Tensor) or not like.is_floating_point():
        raise TypeError("like must be a floating-point torch.Tensor")
    if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype != torch.int64:
        raise TypeError("seed must be a one-element int64 torch.Tensor")
    if seed.device != like.device:
        raise ValueError(f"seed is on {seed.device} but like is on {like.device}")
    p = check_p(p)
    backend = resolve_backend(backend, like, op="noise")
    if backend == "reference":
        return reference.philox_noise(like, seed, p)
    if backend == "triton":
        from ..kernels import nac_noise_triton
        if eager_real(like):  # the op's body, its plan cached (no custom-op dispatch)
            return nac_noise_triton.noise(like, seed, p)
        return nac_noise_triton.nac_noise_triton(like, seed, p)
    return torch.ops.nac_fast.nac_noise(like, seed, p)
