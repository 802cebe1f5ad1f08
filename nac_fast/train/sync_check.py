"""Does a training step make the host wait for the device?  One check, two detectors:

    res = check_step(lambda: train_step(st, x), device)
    res["sync_check"]   # "PASS" or "FAIL"; FAIL names the offender (op, file:line, frames)

A GPU runs ahead of the host only while the host never reads device data: one `.item()`, `bool`
of a tensor, `nonzero`, boolean-mask indexing or copy to the CPU in the step, and every step
waits for the GPU to drain.  `check_step` runs the step once (warm it up first: a first call
that compiles or autotunes is not the steady step) under

  CUDA  torch.cuda.set_sync_debug_mode("warn"): torch warns "called a synchronizing CUDA
        operation" at every synchronising call (cudaStreamSynchronize, cudaMemcpy to the host,
        ...), from the Python line that made it; that message alone makes an offender.  Setting
        the mode also warns, once, that the mode "is a prototype feature": a notice about the
        detector, listed under sync_ignored, never an offender.  With an offender the step runs
        again under "error", whose exception gives the offender's Python frames.
  CPU   NoHostReads, a TorchDispatchMode that raises HostRead at every op that makes the host
        read tensor data (item/bool/float of a tensor, nonzero, masked_select, unique, equal,
        allclose, boolean-mask indexing, repeat_interleave without output_size, a copy of a
        non-CPU tensor to the CPU).  On the CPU nothing waits, but the same Python runs on
        both devices, so a host read it finds is a sync on a GPU.  It sees the ops of
        torch.compile'd code as it runs (ignore_compile_internals: compilation itself runs
        without the mode; aot_eager's graphs are aten ops, inductor's C++ kernels are not).

tests/test_sync_free.py proves train.py's step sync-free on the CPU with NoHostReads; the GPU
suite's train stage (bench/train_throughput.py --sync-check) runs check_step on the GPU.
"""
from __future__ import annotations

import os
import traceback
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning / error text

# ops whose result the host must read (or whose output shape depends on data)
_HOST_READS = {
    aten._local_scalar_dense, aten.is_nonzero, aten.item, aten.nonzero, aten.masked_select,
    aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.equal,
    aten.allclose, aten.bincount, aten.histc,
}


class HostRead(AssertionError):
    """An op read device data on the host (NoHostReads)."""


def _is_cpu(dev) -> bool:
    return dev is not None and torch.device(dev).type == "cpu"


def host_read(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` reads device data on the host, or None."""
    packet = func.overloadpacket
    if packet in _HOST_READS:
        return str(func)
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx):
            return f"{func} with a boolean mask (nonzero inside)"
    if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor \
            and kwargs.get("output_size") is None:
        return f"{func} without output_size"
    # copies of a non-CPU tensor to the CPU
    if packet is aten._to_copy and isinstance(args[0], torch.Tensor) \
            and args[0].device.type != "cpu" and _is_cpu(kwargs.get("device")):
        return f"{func}: {args[0].device} -> cpu"
    if packet in (aten.copy_, aten._copy_from, aten._copy_from_and_resize):
        dst, src = (args[0], args[1]) if packet is aten.copy_ else (args[1], args[0])
        if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) \
                and src.device.type != "cpu" and dst.device.type == "cpu":
            return f"{func}: {src.device} -> cpu"
    return None


def _python_body(func):
    """The Python implementation of a custom op of this package (the Triton ops are triton_ops:
    Python that allocates, converts and launches), or None (aten ops; the compiled C++ ops)."""
    name = func._schema.name
    if not name.startswith("nac_fast::"):
        return None
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS.get(name)
    return None if opdef is None else opdef._init_fn


class NoHostReads(TorchDispatchMode):
    """Raises HostRead on any op that reads tensor data on the host; records every op it saw
    (`ops`, the overload packets' names, in order).

    A dispatch mode sees a custom op as one call; for this package's Python-implemented ops (the
    Triton backend's) it runs their body under itself, so their host-side code is checked too.
    The compiled C++ ops are opaque here: their CUDA versions never read device data on the host
    (csrc/nac_cuda.cu reads the noise seed in the kernel), which the GPU check sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code runs compiled (not skipped to eager) under this mode, and the mode
        # sees its ops at run time; tracing and compilation run without it
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = host_read(func, args, kwargs)
        if why is not None:
            raise HostRead(f"host sync: {why}")
        self.ops.append(str(func.overloadpacket))
        body = _python_body(func)
        if body is not None:
            with self:  # the mode is off inside __torch_dispatch__: back on for the body
                return body(*args, **kwargs)
        return func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _where(filename: str, lineno: int) -> str:
    name = os.path.abspath(filename)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if name.startswith(root + os.sep):
        name = os.path.relpath(name, root)
    elif "site-packages" + os.sep in name:
        name = name.split("site-packages" + os.sep, 1)[1]
    return f"{name}:{lineno}"


def offender_frames(tb, limit: int = 6) -> list:
    """The innermost `limit` frames of a traceback outside torch itself, as 'file:line in
    function: source' (the code that made the synchronising call)."""
    frames = [f for f in traceback.extract_tb(tb)
              if not os.path.abspath(f.filename).startswith(_TORCH_DIR + os.sep)]
    return [f"{_where(f.filename, f.lineno)} in {f.name}: {(f.line or '').strip()[:120]}"
            for f in frames[-limit:]]


def classify_warnings(caught) -> tuple[list, list]:
    """(offenders, ignored) among warnings recorded while the step ran under
    set_sync_debug_mode("warn"): a warning whose message is torch's SYNC_MESSAGE is an
    offender ('file:line: message', the Python line that made the call); any other warning
    (the mode's "prototype feature" notice, a deprecation, ...) is listed as ignored."""
    offenders, ignored = [], []
    for w in caught:
        msg = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
        line = f"{_where(w.filename, w.lineno)}: {msg[:200]}"
        (offenders if SYNC_MESSAGE in msg else ignored).append(line)
    return offenders, ignored


def _check_cuda(step_fn, device) -> dict:
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step_fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")  # before the sync below, which it flags
    torch.cuda.synchronize(device)
    offenders, ignored = classify_warnings(caught)
    res = {"sync_detector": 'torch.cuda.set_sync_debug_mode("warn"), then "error" for frames',
           "sync_check": "FAIL" if offenders else "PASS", "sync_offenders": offenders[:20],
           "sync_offender_count": len(offenders), "sync_ignored": ignored[:20]}
    if offenders:
        res["sync_offender"] = offenders[0]
        torch.cuda.set_sync_debug_mode("error")
        try:
            step_fn()
        except RuntimeError as exc:
            if SYNC_MESSAGE in str(exc):
                res["sync_offender_frames"] = offender_frames(exc.__traceback__)
            else:
                raise
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
    return res


def _check_cpu(step_fn) -> dict:
    res = {"sync_detector": "NoHostReads (CPU dispatch mode: ops that read tensor data on the "
                            "host)", "sync_ignored": []}
    mode = NoHostReads()
    try:
        with mode:
            step_fn()
    except HostRead as exc:
        res.update(sync_check="FAIL", sync_offender=str(exc), sync_offenders=[str(exc)],
                   sync_offender_count=1, sync_offender_frames=offender_frames(exc.__traceback__))
        return res
    res.update(sync_check="PASS", sync_offenders=[], sync_offender_count=0,
               sync_ops_seen=len(mode.ops))
    return res


def check_step(step_fn, device) -> dict:
    """Run step_fn() once under the device's host-sync detector (module docstring).  Returns
    {"sync_check": "PASS"|"FAIL", "sync_detector", "sync_offenders" (up to 20),
    "sync_offender_count", "sync_ignored" (warnings that are not offenders), and on a FAIL
    "sync_offender" (the first) and "sync_offender_frames"}.  Exceptions of the step other than
    the detector's propagate."""
    device = torch.device(device)
    if device.type == "cuda":
        return _check_cuda(step_fn, device)
    if device.type == "cpu":
        return _check_cpu(step_fn)
    raise ValueError(f"device must be a cuda or cpu device, got {device}")
