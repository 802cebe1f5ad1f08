"""The code queue of NAC-MQ (docs/math.md [M:mq]): an nn.Module whose codes and write pointer are
buffers, so state_dict(), .to() and DDP's buffer broadcast work as for any module.

    queue = CodeQueue(size=M, dim=D); queue.enqueue(keys)   # NACMQLoss enqueues before the loss
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import _checks


class CodeQueue(nn.Module):
    """FIFO of the M most recent momentum codes (docs/math.md [M:mq]): a ring buffer with a write
    pointer, both registered buffers, so state_dict(), .to() and DDP's buffer broadcast work as
    for any module.

        queue = CodeQueue(65536, 128, device="cuda", dtype=torch.bfloat16)
        queue.enqueue(keys)          # (n, D) momentum codes, before the loss
        queue.codes                  # (M, D), the loss's negatives

    Starts as zeros (neutral, [M:mq]) until real codes overwrite it, after M / (2 x global batch)
    steps.  Enqueue writes at the pointer and wraps around the end of the buffer: one index_copy_
    and the pointer kept on the device, so it never waits for the host.

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

    @property
    def size(self) -> int:
        return self.codes.shape[0]

    def extra_repr(self) -> str:
        return f"size={self.size}, dim={self.codes.shape[1]}, dtype={self.codes.dtype}"

    @torch.no_grad()
    def enqueue(self, keys: torch.Tensor) -> None:
        _checks.tensor("keys", keys)
        if keys.dim() != 2 or keys.shape[1] != self.codes.shape[1]:
            raise ValueError(f"keys must have shape (n, {self.codes.shape[1]}), "
                             f"got {tuple(keys.shape)}")
        n = keys.shape[0]
        if n > self.size:
            raise ValueError(f"cannot enqueue {n} keys into a queue of size {self.size}")
        idx = (self.ptr + torch.arange(n, device=self.codes.device)) % self.size
        self.codes.index_copy_(0, idx, keys.detach().to(self.codes.dtype))
        self.ptr.add_(n).remainder_(self.size)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        codes = state_dict.get(prefix + "codes")
        if codes is not None:
            if tuple(codes.shape) != tuple(self.codes.shape):
                raise ValueError(f"queue in the checkpoint has shape {tuple(codes.shape)}, this "
                                 f"run expects {tuple(self.codes.shape)} (--queue-size must match)")
            if not codes.is_floating_point():
                raise TypeError(f"queue codes in the checkpoint must be floating, got {codes.dtype}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
