"""Which backends this install can run, why the others cannot, and the choice behind "auto".

The compiled extension `nac_fast._C` is optional: without it the package works on the reference
backend (and Triton on GPU) and warns once, at import, not per call.  The Triton kernels are the
subpackage `nac_fast.kernels` (the top-level kernels/ folder of the source tree); when they fail
to import where they would run, that warns once with the exception, and
``available_backends(reasons=True)`` gives the reason.  Availability is settled once per process
and read through `torch._dynamo.assume_constant_result`, so `torch.compile` sees constants, not
import machinery.
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

BACKENDS = ("reference", "cpu", "triton", "cuda")


def _build_note(name: str):
    """What setup.py recorded in nac_fast/_build_info.py (generated at build time) under `name`,
    or None: the true reason the extension is missing, the torch it was compiled against."""
    try:
        info = importlib.import_module(__name__.split(".")[0] + "._build_info")
    except ImportError:
        return None
    return getattr(info, name, None)


try:
    from . import _C  # noqa: F401  (loading it registers the torch.ops.nac_fast ops)
    _C_ERROR = None
except ImportError as _exc:  # pragma: no cover - depends on the install
    _C = None
    import importlib.util as _ilu
    if _ilu.find_spec(f"{__package__}._C") is None:  # Python's own message blames a circular import
        _C_ERROR = _build_note("EXTENSION") or (
            f"not built: no {__package__}/_C*.so next to {os.path.dirname(__file__)}/__init__.py")
    else:
        _C_ERROR = f"{type(_exc).__name__}: {_exc}"
        if _build_note("TORCH") not in (None, torch.__version__):
            _C_ERROR += (f"; it was compiled against torch {_build_note('TORCH')}, this is torch "
                         f"{torch.__version__}: rebuild it")
    warnings.warn(f"nac_fast: compiled extension not available ({_C_ERROR}); the fused 'cpu' and "
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


_TRITON_MODULES = ("nac_triton", "nac_noise_triton", "hamming_triton")
_TRITON_ERROR: list = []  # [None] when the kernels import, [reason] when they do not


def triton_import_error() -> str | None:
    """None when the Triton kernels (nac_fast.kernels.*) import; else the exception, as text.
    Tried once per process; a failure warns once."""
    if not _TRITON_ERROR:
        import importlib
        err = None
        for name in _TRITON_MODULES:
            try:
                importlib.import_module(f"{__package__}.kernels.{name}")
            except Exception as exc:  # any failure: a missing triton, a broken install, a bug
                err = f"importing {__package__}.kernels.{name} failed: {type(exc).__name__}: {exc}"
                warnings.warn(f"nac_fast: the Triton backend is off: {err}", RuntimeWarning,
                              stacklevel=2)
                break
        _TRITON_ERROR.append(err)
    return _TRITON_ERROR[0]


def triton_importable() -> bool:
    return triton_import_error() is None


def _reason(backend: str, device_type: str) -> str | None:
    """Why `backend` cannot run on `device_type` ("cpu", "cuda", "any") here, or None."""
    if backend == "reference":
        return None
    if backend == "cpu":
        if device_type not in ("any", "cpu"):
            return "the 'cpu' backend runs on CPU tensors only"
        if _C is None:
            return f"the compiled extension nac_fast._C did not load ({_C_ERROR})"
        if not hasattr(torch.ops.nac_fast, "nac_fwd"):
            return "nac_fast._C loaded but registered no nac_fast::nac_fwd op"
        return None
    if backend == "triton":
        if not triton_runs_on(device_type):
            return ("Triton needs CUDA tensors and a visible GPU, or CPU tensors with "
                    "TRITON_INTERPRET=1 set before triton is imported")
        return triton_import_error()
    if backend == "cuda":
        if device_type not in ("any", "cuda"):
            return "the 'cuda' backend runs on CUDA tensors only"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
        if _C is None:
            return f"the compiled extension nac_fast._C did not load ({_C_ERROR})"
        if not cuda_extension_built():
            return ("nac_fast._C was built without the CUDA kernels ("
                    + (_build_note("CUDA") or "no nvcc / CUDA torch at build time")
                    + "; NAC_FAST_FORCE_CUDA=1 makes that an error)")
        return None
    raise ValueError(f"unknown backend {backend!r}")


@torch._dynamo.assume_constant_result
def _available(device_type: str) -> tuple:
    return tuple(b for b in BACKENDS if _reason(b, device_type) is None)


def _device_type(device) -> str:
    if device is None:
        return "any"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    return torch.device(device).type


def available_backends(device: str | torch.device | None = None, *,
                       reasons: bool = False) -> list[str] | dict[str, str | None]:
    """Backends usable on `device` ("cpu", "cuda", ...); None = on any device of this machine.
    reasons=True: a dict of every backend -> None if usable, else why not."""
    dt = _device_type(device)
    if reasons:
        return {b: _reason(b, dt) for b in BACKENDS}
    return list(_available(dt))


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
                         f"this install ({_reason(backend, a.device.type)}); available: "
                         f"{list(avail)}")
    return backend
