"""Which loss backends this install can run, and the choice behind backend="auto".

The compiled extension `nac_fast._C` is optional: without it the package works on the reference
backend (and Triton on GPU) and warns once, at import, not per call.  Availability is settled once
per process and read through `torch._dynamo.assume_constant_result`, so `torch.compile` sees
constants, not import machinery.
"""
from __future__ import annotations

import os
import warnings

import torch

BACKENDS = ("reference", "cpu", "triton", "cuda")

try:
    from . import _C  # noqa: F401  (loading it registers the torch.ops.nac_fast ops)
except ImportError as _exc:  # pragma: no cover - depends on the install
    _C = None
    warnings.warn(f"nac_fast: compiled extension not available ({_exc}); the fused 'cpu' and "
                  "'cuda' backends are off, 'reference' (and 'triton' on GPU) still work. Build it "
                  "with: pip install --no-build-isolation -e .", RuntimeWarning, stacklevel=2)


def extension():
    """The compiled extension module, or None when it is not built."""
    return _C


def cuda_extension_built() -> bool:
    return _C is not None and bool(_C.built_with_cuda())


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device_type: str) -> bool:
    """Triton kernels run on CUDA tensors with a GPU, on CPU tensors under the interpreter
    ("any": either).  Import availability is checked separately."""
    return ((torch.cuda.is_available() and device_type in ("any", "cuda"))
            or (triton_interpreted() and device_type in ("any", "cpu")))


_TRITON_OK: bool | None = None


def triton_importable() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            from .kernels import nac_triton  # noqa: F401
            _TRITON_OK = True
        except Exception:  # pragma: no cover - depends on the install
            _TRITON_OK = False
    return _TRITON_OK


@torch._dynamo.assume_constant_result
def _available(device_type: str) -> tuple:
    out = ["reference"]
    if _C is not None and device_type in ("any", "cpu") and hasattr(torch.ops.nac_fast, "nac_fwd"):
        out.append("cpu")
    if triton_runs_on(device_type) and triton_importable():
        out.append("triton")
    if torch.cuda.is_available() and device_type in ("any", "cuda") and cuda_extension_built():
        out.append("cuda")
    return tuple(out)


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """Backends usable on `device` ("cpu", "cuda", ...); None = on any device of this machine."""
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    return list(_available("any" if device is None else torch.device(device).type))


def resolve_backend(backend, a: torch.Tensor) -> str:
    """Map the user's `backend` to the implementation that runs for tensor `a`."""
    if not isinstance(backend, str) or backend not in BACKENDS + ("auto",):
        raise ValueError(f"backend must be one of {BACKENDS + ('auto',)}, got {backend!r}; "
                         f"available here: {available_backends()}")
    avail = _available(a.device.type)
    if backend == "auto":
        if a.device.type == "cuda":
            for b in ("triton", "cuda"):  # order set by the GPU suite's measurements
                if b in avail:
                    return b
            return "reference"
        return "cpu" if "cpu" in avail else "reference"
    if backend not in avail:
        raise ValueError(f"backend {backend!r} is not available for {a.device.type} tensors in "
                         f"this install; available: {list(avail)}")
    return backend
