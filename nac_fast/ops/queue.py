"""The code queue of NAC-MQ (docs/math.md [M:mq]): an nn.Module whose codes and write pointer are
buffers, so state_dict(), .to() and DDP's buffer broadcast work as for any module.

    queue = CodeQueue(size=M, dim=D); queue.enqueue(keys)   # NACMQLoss enqueues before the loss
    queue.enqueue_tanh(am0, am1)     # the keys tanh(am) of two views, one launch on a GPU
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import _checks
from .dispatch import eager_real, triton_importable, triton_runs_on

ENQUEUE_BACKENDS = ("auto", "reference", "triton")


class CodeQueue(nn.Module):
    """FIFO of the M most recent momentum codes (docs/math.md [M:mq]): a ring buffer with a write
    pointer, both registered buffers, so state_dict(), .to() and DDP's buffer broadcast work as
    for any module.

        queue = CodeQueue(65536, 128, device="cuda", dtype=torch.bfloat16)
        queue.enqueue(keys)          # (n, D) momentum codes, before the loss
        queue.codes                  # (M, D), the loss's negatives

    Starts as zeros (neutral, [M:mq]) until real codes overwrite it, after M / (2 x global batch)
    steps.  Enqueue writes at the pointer and wraps around the end of the buffer, the pointer kept
    on the device so it never waits for the host: on CUDA tensors one Triton launch
    (kernels/queue_triton.py), else an index_copy_ and the pointer's arithmetic in torch ops.

    dtype: the codes' storage dtype.  Store them in the loss's compute dtype (the autocast dtype
    under AMP, bf16 on GPU: half the memory and no per-step conversion of the whole queue); codes
    are tanh values in [-1, 1], so bf16 keeps 8 significant bits of each.  A state dict's codes of
    any floating dtype load into a queue of any floating dtype (converted on load).
    """

    codes: torch.Tensor
    ptr: torch.Tensor

    def __init__(self, size: int, dim: int, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        _checks.positive_int("queue size", size)
        _checks.positive_int("queue dim", dim)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"queue dtype must be a floating torch.dtype, got {dtype!r}")
        self.register_buffer("codes", torch.zeros(size, dim, device=device, dtype=dtype))
        self.register_buffer("ptr", torch.zeros((), device=device, dtype=torch.long))
        # the Triton enqueue's arrival counter (kernels/queue_triton.py): zero between calls, not
        # part of the state
        self.register_buffer("_arrived", torch.zeros(1, device=device, dtype=torch.int32),
                             persistent=False)

    @property
    def size(self) -> int:
        return self.codes.shape[0]

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.codes.shape[1]}, dtype={self.codes.dtype}"

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor, *, backend: str = "auto") -> None:
        """Write the (n, D) codes `keys` (a floating or signed integer dtype: TypeError else) at
        the pointer (converted to the queue's dtype) and advance it, wrapping around the end.
        backend: "reference" (torch ops: an index_copy_ and the pointer's modular arithmetic,
        about seven launches), "triton" (one launch, kernels/queue_triton.py, the same codes), or
        "auto": "triton" on CUDA tensors when the Triton kernels import and the call runs
        eagerly, else "reference"."""
        self._check("keys", (keys,), floating=False)
        if self._backend(backend, (keys,)) == "reference":
            self._enqueue_reference(keys)
        else:
            self._enqueue_triton((keys,), tanh=False)

    @torch.no_grad()
    def enqueue_tanh(self, *parts: torch.Tensor, backend: str = "auto") -> None:
        """Enqueue the keys z = tanh(a) of the rows of `parts` in order (NAC-MQ's keys from the
        momentum network's pre-activations, docs/math.md [M:mq]): tanh in float32 (float64 stays
        float64), rounded to the queue's dtype: ``enqueue(torch.tanh(torch.cat(parts).float()))``.

        parts: (n_i, D) tensors of one floating dtype on the queue's device, sum n_i <= size.
        backend: "reference" (torch ops: the cat, casts, tanh and an index_copy_, about ten
        launches), "triton" (one launch, kernels/queue_triton.py, tanh by csrc/nac_math.h's
        formula: within 2 float32 ulp of torch.tanh before the rounding), or "auto": "triton" on
        CUDA tensors when the Triton kernels import and the call runs eagerly, else "reference"."""
        self._check("parts", parts, floating=True)
        if self._backend(backend, parts) == "reference":
            keys = torch.cat(parts) if len(parts) > 1 else parts[0]
            wide = torch.float64 if keys.dtype == torch.float64 else torch.float32
            self._enqueue_reference(torch.tanh(keys.to(wide)))
        else:
            self._enqueue_triton(parts, tanh=True)

    def _check(self, name: str, parts, floating: bool) -> None:
        """Bad input gets its error before the queue changes."""
        if not parts:
            raise ValueError("enqueue_tanh needs at least one tensor of keys' pre-activations")
        D = self.codes.shape[1]
        for i, t in enumerate(parts):
            what = name if name == "keys" else f"{name}[{i}]"
            _checks.tensor(what, t)
            if floating and not t.is_floating_point():
                raise TypeError(f"{what} must be floating, got {t.dtype}")
            if not floating and not _checks.signed_real(t.dtype):
                # codes lie in [-1, 1]: complex keys would lose their imaginary part, bool ones
                # become 0/1 (the package's bool codes mean False = -1), unsigned ones hold 255
                # for a -1 cast to uint8
                raise TypeError(f"{what} must have a floating or signed integer dtype (codes in "
                                f"[-1, 1]), got {t.dtype}")
            if t.dim() != 2 or t.shape[1] != D:
                raise ValueError(f"{what} must have shape (n, {D}), got {tuple(t.shape)}")
            if t.dtype != parts[0].dtype:
                raise TypeError(f"{what} is {t.dtype} but {name}[0] is {parts[0].dtype}: one "
                                "dtype for all parts")
            if t.device != self.codes.device:
                raise ValueError(f"{what} is on {t.device} but the queue is on "
                                 f"{self.codes.device}")
        n = sum(t.shape[0] for t in parts)
        if n > self.size:
            raise ValueError(f"cannot enqueue {n} keys into a queue of size {self.size}")

    def _backend(self, backend: str, parts) -> str:
        if backend not in ENQUEUE_BACKENDS:
            raise ValueError(f"backend must be one of {ENQUEUE_BACKENDS}, got {backend!r}")
        if backend == "auto":
            return "triton" if self._triton_ok(parts) else "reference"
        if backend == "triton":
            why = self._triton_refusal(parts)
            if why:
                raise ValueError(f"backend='triton' cannot enqueue here: {why}")
        return backend

    def _enqueue_reference(self, keys: torch.Tensor) -> None:
        n = keys.shape[0]
        idx = (self.ptr + torch.arange(n, device=self.codes.device)) % self.size
        self.codes.index_copy_(0, idx, keys.detach().to(self.codes.dtype))
        self.ptr.add_(n).remainder_(self.size)

    def _enqueue_triton(self, parts, tanh: bool) -> None:
        from ..kernels import queue_triton
        rows = [t if t.stride(1) == 1 else t.contiguous() for t in parts]
        if not tanh and self.codes.dtype == torch.float16 and rows[0].dtype == torch.float64:
            # torch rounds float64 to float16 through float32 (twice), the kernel's cast once: keys
            # in float32 give enqueue's bits on both paths (a copy, in this rare pairing only)
            rows = [t.float() for t in rows]
        while len(rows) > 2:  # the kernel reads two parts: fold the rest (a copy of those rows)
            rows = [rows[0], torch.cat(rows[1:])]
        x0, x1 = rows[0], rows[1] if len(rows) > 1 else rows[0][:0]
        if x0.shape[0] + x1.shape[0]:
            queue_triton.enqueue(self.codes, self.ptr, self._arrived, x0, x1, tanh=tanh)
            if eager_real(self.codes):  # an in-place write, as index_copy_'s: autograd's check
                # then sees it wherever a graph saved the codes (a loss of the old queue)
                torch.autograd.graph.increment_version((self.codes, self.ptr))

    def _triton_refusal(self, parts) -> str:
        c = self.codes
        if not triton_importable():
            return "the Triton kernels do not import (nac_fast.ops.dispatch.triton_import_error)"
        from ..kernels.nac_triton import MAX_D, MAX_ROWS
        if not triton_runs_on(c.device.type):
            return (f"Triton does not run on {c.device.type} tensors here (a GPU, or CPU tensors "
                    "under TRITON_INTERPRET=1)")
        if c.shape[1] > MAX_D:
            return f"codes of D={c.shape[1]} > {MAX_D}"
        if not c.is_contiguous():
            return "the queue's codes are not contiguous"
        if not parts[0].is_floating_point():
            return f"keys of dtype {parts[0].dtype} (the kernel reads floating keys)"
        if sum(t.shape[0] for t in parts) > MAX_ROWS:
            return f"more than {MAX_ROWS:,} keys in one call (the kernel's rows are int32)"
        return ""

    def _triton_ok(self, parts) -> bool:
        c = self.codes
        return (c.device.type == "cuda" and eager_real(c)
                and all(eager_real(t) for t in parts) and not self._triton_refusal(parts))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # the errors name the state dict's key (prefix: where the queue sits in a larger module)
        codes_key, ptr_key = prefix + "codes", prefix + "ptr"
        codes = state_dict.get(codes_key)
        if codes is not None:
            if not isinstance(codes, torch.Tensor):
                raise TypeError(f"queue codes in the checkpoint must be a torch.Tensor, got "
                                f"{type(codes).__name__} (key {codes_key!r})")
            if tuple(codes.shape) != tuple(self.codes.shape):
                raise ValueError(f"queue in the checkpoint has shape {tuple(codes.shape)}, this "
                                 f"run expects {tuple(self.codes.shape)} (key {codes_key!r};"
                                 " the queue's size and dim must match: --queue-size)")
            if not codes.is_floating_point():
                raise TypeError(f"queue codes in the checkpoint must be floating, got "
                                f"{codes.dtype} (key {codes_key!r})")
        ptr = state_dict.get(ptr_key)
        if ptr is not None:  # the write pointer: an integer in [0, size) (the Triton enqueue's
            # index arithmetic assumes it; a negative one would write before the buffer)
            if not isinstance(ptr, torch.Tensor) or ptr.numel() != 1 or ptr.is_floating_point() \
                    or ptr.dtype == torch.bool or ptr.is_complex():
                raise TypeError("queue pointer (ptr) in the checkpoint must be a one-element "
                                f"integer tensor, got {ptr!r} (key {ptr_key!r})")
            if ptr.device.type != "meta" and not 0 <= int(ptr) < self.size:
                raise ValueError(f"queue pointer (ptr) in the checkpoint is {int(ptr)}, outside "
                                 f"[0, {self.size}) for this queue's size (key {ptr_key!r})")
            if ptr.dtype != torch.int64:  # as the queue keeps it: load_state_dict(assign=True)
                # takes the tensor as it is, and a narrower one wraps in `ptr.add_(n)` (a uint8
                # pointer at 256); torch hands this method its own copy of the state dict
                state_dict[ptr_key] = ptr.to(torch.int64)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
