"""The one backend dispatcher of nac_fast's ops: which backends this install can run for each op,
why the others cannot, and the choice behind backend="auto".

    available_backends(device=None, op="nac")              # ['reference', 'cpu', ...]
    available_backends(device, op="hamming", reasons=True)  # {backend: None or why not}
    resolve_backend(backend, tensor, op="nac", keys=keys)    # what runs for this tensor
    explain_auto(tensor, op="nac", keys=keys)                # why backend="auto" picks it

Ops and their backends:
    "nac"      the fused NAC losses: reference, cpu (csrc/nac_cpu.cpp), triton
               (kernels/nac_triton.py), cuda (csrc/nac_cuda.cu)
    "noise"    the channel noise from a seed: reference, cpu, triton, cuda
    "hamming"  the Hamming retrieval engine: reference, cpu (csrc/hamming.cpp), triton
               (kernels/hamming_triton.py), cuda (csrc/hamming_cuda.cu through
               nac_fast/ops/hamming_cuda.py)

The compiled extension `nac_fast._C` is optional: without it the package works on the reference
backend (and Triton on GPU) and warns once, at import.  The Triton kernels are the subpackage
`nac_fast.kernels` (the top-level kernels/ folder of the source tree); when they fail to import
where they would run, that warns once with the exception and `reasons=True` gives it.  Every
answer is settled once per process (functools.cache, the package's one caching idiom) and read
through `torch._dynamo.assume_constant_result`, so `torch.compile` sees constants.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import warnings

import torch

from .. import _checks
from .._tensors import eager_real  # noqa: F401  (the ops read it from here)

BACKENDS = ("reference", "cpu", "triton", "cuda")
OPS = {  # op -> (backends, the torch.ops.nac_fast op the compiled backends register)
    "nac": (BACKENDS, "nac_fwd"),
    "noise": (BACKENDS, "nac_noise"),
    "hamming": (BACKENDS, "hamming_lanes_cdist"),
}
_TRITON_MODULES = ("nac_triton", "nac_noise_triton", "hamming_triton", "autotuner")  # autotuner:
# importing it registers the first-use autotune (NAC_FAST_AUTOTUNE=1) with kernels/tuning.py
# Backends that run when asked by name but that backend="auto" never picks.  Empty: 'cuda' (the
# tensor-core kernels of csrc/nac_cuda_mma.cu) passed the GPU suite against the float64 reference
# on an H100 (bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27_run3/pytest_gpu.xml: 557 passed).
# auto still takes 'triton' first on CUDA tensors: its GPU work was the shorter at every shape
# measured there (host_gpu.csv, graph_s: in-batch 8192 bf16 0.158 vs 0.326 ms, queue 8192 x 65536
# 0.482 vs 1.064 ms, fp32 in-batch 8192 1.95 vs 5.00 ms; queue 256 x 65536 bf16 0.081 vs
# 0.083 ms), with host times within that run's noise of each other; 'cuda' is the fused fallback
# where Triton is missing.
EXPERIMENTAL: tuple = ()
# The widest codes (D) each fused GPU backend of op "nac" computes: kernels/nac_triton.py MAX_D,
# csrc/nac_cuda.cu check_cuda_limits (tests/test_loss.py holds them equal).  Wider codes
# on CUDA tensors: backend="auto" runs the next backend that takes them, else the reference.
FUSED_MAX_D = {"triton": 512, "cuda": 256}


def _build_note(name: str):
    """What setup.py recorded in nac_fast/_build_info.py (generated at build time) under `name`,
    or None: the true reason the extension is missing, the torch it was compiled against."""
    try:
        info = importlib.import_module("nac_fast._build_info")
    except ImportError:
        return None
    return getattr(info, name, None)


try:
    from .. import _C  # noqa: F401  (loading it registers the torch.ops.nac_fast ops)
    _C_ERROR = None
except ImportError as _exc:  # pragma: no cover - depends on the install
    _C = None
    if importlib.util.find_spec("nac_fast._C") is None:  # Python's message blames a circular import
        _C_ERROR = _build_note("EXTENSION") or (
            "not built: no nac_fast/_C*.so in "
            f"{os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}")
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
    """Triton kernels run compiled on CUDA tensors with a GPU, or on CPU tensors under the
    interpreter ("any": either).  Not on CUDA tensors under the interpreter: the kernels choose
    their GPU or interpreter arithmetic by the tensors' device (the interpreter's casts, inline
    PTX), so an interpreted run of CUDA tensors would compute neither.  Import availability is
    checked separately."""
    interpreted = triton_interpreted()
    return ((torch.cuda.is_available() and not interpreted and device_type in ("any", "cuda"))
            or (interpreted and device_type in ("any", "cpu")))


@functools.cache
def triton_import_error() -> str | None:
    """None when the Triton kernels (nac_fast.kernels.*) import; else the exception, as text.
    Tried once per process; a failure warns once."""
    for name in _TRITON_MODULES:
        try:
            importlib.import_module(f"nac_fast.kernels.{name}")
        except Exception as exc:  # any failure: a missing triton, a broken install, a bug
            err = f"importing nac_fast.kernels.{name} failed: {type(exc).__name__}: {exc}"
            warnings.warn(f"nac_fast: the Triton backend is off: {err}", RuntimeWarning,
                          stacklevel=2)
            return err
    return None


def triton_importable() -> bool:
    return triton_import_error() is None


def func_transform_active() -> bool:
    """Whether a torch.func transform (grad, vmap, jvp, jacrev, functional_call under them, ...)
    is running.  The compiled kernels read their inputs' data pointers and their autograd layers
    have no functorch rules, so under a transform only the reference (plain PyTorch ops, which
    every transform understands) runs: backend="auto" resolves to it, an explicit compiled
    backend is refused (resolve_backend).  False while torch.compile traces (its tracing runs
    under functorch's interpreters; the registered ops serve it)."""
    try:
        if torch.compiler.is_compiling():
            return False
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:  # a torch without functorch's interpreter stack
        return False


def _check_op(op) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {tuple(OPS)}, got {op!r}")


def _reason(backend: str, device_type: str, op: str) -> str | None:
    """Why `backend` cannot run `op` on `device_type` ("cpu", "cuda", "any") here, or None."""
    backends, compiled_op = OPS[op]
    if backend not in backends:
        return f"op {op!r} has no {backend!r} backend (its backends: {list(backends)})"
    if backend == "reference":
        return None
    if backend == "triton":
        if not triton_runs_on(device_type):
            return ("Triton needs CUDA tensors and a visible GPU with TRITON_INTERPRET unset, "
                    "or CPU tensors with TRITON_INTERPRET=1 set before triton is imported")
        return triton_import_error()
    if backend == "cpu" and device_type not in ("any", "cpu"):
        return "the 'cpu' backend runs on CPU tensors only"
    if backend == "cuda":
        if device_type not in ("any", "cuda"):
            return "the 'cuda' backend runs on CUDA tensors only"
        if not torch.cuda.is_available():
            return "no CUDA GPU is visible"
    if _C is None:
        return f"the compiled extension nac_fast._C did not load ({_C_ERROR})"
    if not hasattr(torch.ops.nac_fast, compiled_op):
        return f"nac_fast._C loaded but registered no nac_fast::{compiled_op} op"
    if backend == "cuda" and not cuda_extension_built():
        return ("nac_fast._C was built without the CUDA kernels ("
                + (_build_note("CUDA") or "no nvcc / CUDA torch at build time")
                + "; NAC_FAST_FORCE_CUDA=1 makes that an error)")
    return None


@torch._dynamo.assume_constant_result
def _available(device_type: str, op: str = "nac") -> tuple:
    return _available_cached(device_type, op)


@functools.cache
def _available_cached(device_type: str, op: str) -> tuple:
    return tuple(b for b in OPS[op][0] if _reason(b, device_type, op) is None)


def _device_type(device) -> str:
    if device is None:
        return "any"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        return torch.device(device).type
    except RuntimeError as exc:  # torch's message for a bad device string
        raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:0', ...), got "
                         f"{device!r}") from exc


def available_backends(device: str | torch.device | None = None, *, op: str = "nac",
                       reasons: bool = False) -> list[str] | dict[str, str | None]:
    """Backends of `op` usable on `device` ("cpu", "cuda", ...); None = on any device of this
    machine.  reasons=True: a dict of every backend of the op -> None if usable, else why not."""
    dt = _device_type(device)
    _check_op(op)
    if reasons:
        return {b: _reason(b, dt, op) for b in OPS[op][0]}
    return list(_available(dt, op))


# backend="auto" on CPU tensors: the fused kernel, except for the NAC losses in bf16 when the
# keys take a gradient (the in-batch loss with a needing a gradient, or keys that require one).
# There the fused CPU kernel (which widens bf16 to fp32 and recomputes the logits in the keys'
# backward: 4 fp32 GEMMs) is 1.10-1.97x slower than the eager reference (3 bf16 GEMMs on the CPU's
# AVX512-BF16 units through oneDNN): bench/results/loss_cpu.csv, in-batch n = 1000 ... 4096.
# Without the keys' gradient (NAC-MQ's queue) the fused kernel is 0.29-0.49x the reference's time
# and stays the choice.  docs/kernels.md "Choosing a backend".
AUTO_CPU_REFERENCE_DTYPES = (torch.bfloat16,)
_UNSET = object()


def _keys_take_grad(t: torch.Tensor, keys) -> bool:
    if not torch.is_grad_enabled():
        return False
    return bool(t.requires_grad) if keys is None else bool(keys.requires_grad)


def _auto(t: torch.Tensor, op: str, keys, avail) -> tuple:
    """(backend, why) of backend="auto" for `t` (and, for op "nac", its keys: None = the in-batch
    keys, _UNSET = not said)."""
    if func_transform_active():
        return "reference", ("a torch.func transform (grad, vmap, ...) is running: the compiled "
                             "kernels have no functorch rules")
    if t.device.type == "cuda":
        shape = tuple(getattr(t, "shape", ()))
        D = shape[1] if op == "nac" and len(shape) == 2 else 0
        for b in ("triton", "cuda"):
            if b in avail and b not in EXPERIMENTAL and D <= FUSED_MAX_D[b]:
                return b, f"the fused {b!r} kernel of CUDA tensors"
        if D > min(FUSED_MAX_D.values()):
            return "reference", (f"D = {D}: wider than the fused GPU kernels take here "
                                 f"({FUSED_MAX_D})")
        return "reference", "no fused GPU backend is available here"
    if "cpu" not in avail:
        return "reference", "the compiled CPU kernel is not available here"
    if (op == "nac" and keys is not _UNSET and t.dtype in AUTO_CPU_REFERENCE_DTYPES
            and _keys_take_grad(t, keys)):
        return "reference", ("bf16 CPU tensors whose keys take a gradient: the eager reference's "
                             "bf16 GEMMs are faster than the fused kernel's fp32 ones "
                             "(bench/results/loss_cpu.csv)")
    return "cpu", "the fused 'cpu' kernel of CPU tensors"


def resolve_backend(backend, t: torch.Tensor, op: str = "nac", *, keys=_UNSET) -> str:
    """Map the user's `backend` to the implementation of `op` that runs for tensor `t`.  "auto":
    the fused kernel of t's device (CPU: cpu; GPU: triton, then cuda), else
    the reference; for op "nac" on bf16 CPU tensors whose keys take a gradient (`keys`: the keys
    tensor, None for the in-batch keys; left out: not considered), the reference, which is the
    faster there (`explain_auto` says why, docs/kernels.md "Choosing a backend")."""
    _check_op(op)
    names = OPS[op][0] + ("auto",)
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}; available here: "
                         f"{available_backends(op=op)}")
    avail = _available(t.device.type, op)
    if backend == "auto":
        return _auto(t, op, keys, avail)[0]
    if backend != "reference" and func_transform_active():
        raise ValueError(f"backend {backend!r} cannot run under a torch.func transform (grad, "
                         "vmap, jvp, ...): its compiled kernels read the tensors' data and have "
                         "no functorch rules; use backend='reference' (or 'auto', which runs it "
                         "there)")
    if backend not in avail:
        raise ValueError(f"backend {backend!r} is not available for {t.device.type} tensors in "
                         f"this install ({_reason(backend, t.device.type, op)}); available: "
                         f"{list(avail)}")
    return backend


def explain_auto(t: torch.Tensor, op: str = "nac", *, keys=_UNSET) -> str:
    """What backend="auto" runs for `t` (and `keys`, as resolve_backend takes them), and why."""
    _checks.tensor("t", t)
    if keys is not _UNSET and keys is not None:
        _checks.tensor("keys", keys)
    _check_op(op)
    b, why = _auto(t, op, keys, _available(t.device.type, op))
    return f"backend='auto' runs {b!r}: {why}"


# ---- value-check policy (the loss's inputs, collectives.check_same_shape) ----------------------
# Shape, dtype and device checks read only metadata and always run.  The value checks (NaN/inf in
# a, r, keys/queue; noise entries +-1) read the data: on a CPU tensor that is free of host syncs,
# on a GPU tensor each one is a device-to-host copy that stalls the host until the GPU has caught
# up.  Policy, CHECK_VALUES (from the environment variable NAC_FAST_CHECK_INPUTS at import):
#   "auto" (NAC_FAST_CHECK_INPUTS unset, "" or "auto")  check CPU tensors, skip every other device
#   True   (NAC_FAST_CHECK_INPUTS=1)                    check every device (a host sync per input
#                                                       on a GPU: for debugging)
#   False  (NAC_FAST_CHECK_INPUTS=0)                    never check values
# Unchecked, NaN and inf propagate to the loss (tests/test_sync_free.py checks every backend): a NaN
# anywhere (a, r, keys, queue, noise) gives a NaN loss, +-inf in r a non-finite loss, +-inf in the
# keys a non-finite loss or gradient; +-inf in a is a legitimate limit there (tanh(+-inf) = +-1:
# a finite loss, zero gradient), though the checks, where on, refuse it with the rest (an infinite
# activation is an overflow upstream).  Noise that is not +-1 goes into the formula unchecked.  train.py turns the checks off in
# its training step (nac_fast.train.methods.step_value_checks) and checks the loss itself instead.
_CHECK_ENV = "NAC_FAST_CHECK_INPUTS"


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # torch < 2.3
        return False


def _parse_check_values(v: str):
    key = v.strip().lower()
    if key in ("", "auto"):
        return "auto"
    if key in ("1", "true", "on", "yes"):
        return True
    if key in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"environment variable {_CHECK_ENV} must be 0, 1 or auto, got {v!r}")


CHECK_VALUES = _parse_check_values(os.environ.get(_CHECK_ENV, "auto"))


def value_checks_on(device) -> bool:
    """Whether the data-reading checks (NaN/inf, noise +-1) run for tensors on `device` under the
    current policy CHECK_VALUES (True, False or "auto": CPU only).  Never while torch.compile
    traces, never under a torch.func transform (vmap has no data to branch on), never on the
    meta device (no data)."""
    mode = CHECK_VALUES
    if mode is not True and mode is not False and mode != "auto":
        raise ValueError(f"nac_fast.ops.loss.CHECK_VALUES must be True, False or 'auto' (the policy of "
                         f"nac_fast.ops.dispatch), got {mode!r}")
    dev = torch.device(device).type
    if mode is False or dev == "meta" or _compiling() or func_transform_active():
        return False
    return mode is True or dev == "cpu"


@contextlib.contextmanager
def value_checks(mode):
    """Set CHECK_VALUES (True, False or "auto") inside a with-block and restore it after."""
    global CHECK_VALUES
    if mode is not True and mode is not False and mode != "auto":
        raise ValueError(f"mode must be True, False or 'auto', got {mode!r}")
    old, CHECK_VALUES = CHECK_VALUES, mode
    try:
        yield
    finally:
        CHECK_VALUES = old
