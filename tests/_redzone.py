"""Red zones around every tensor a Triton launch is handed: out-of-bounds reads and writes, and
reads of memory no one wrote, made visible on any device (tests/test_redzone.py).

    with Redzones(fill=0x7F) as rz:
        out = op(...)
    rz.violations      # [] when no launch wrote outside its tensors' storages

While active, each launch of the Triton modules (their `run`) gets, for every distinct storage among
its tensor arguments, a copy of that storage with RED bytes of `fill` before and after it, the
arguments made views into the copy at their own offsets and strides (aliases stay aliases,
alignment is kept: RED is a multiple of 128).  After the launch each red zone must still hold
`fill` (else a violation names the launch, the argument and the side), and the storage's bytes
go back to the original tensors.  The buffers the launch plans allocate uninitialised
(`kernels/launch.py` buffer and Plan._alloc) are filled with `fill` too; zero-filled ones (the
counters) stay zero.

A kernel that reads outside its tensors, or reads memory nothing wrote, gives results that depend
on `fill`: run the same op with two fills (0x7F: large finite floats and positive integers;
0xFF: NaN and -1) and compare the results bit for bit (`same_bits`).  The interpreter runs every
program in turn, so races are out of reach here; a GPU runs the same checks on its compiled
kernels (CUDA tensors: nothing here is CPU-specific).
"""
from __future__ import annotations

import importlib

import pytest
import torch

RED = 4096  # bytes of red zone on each side of a storage: more than any tile reaches past it

MODULES = ("nac_triton", "queue_triton", "nac_noise_triton", "hamming_triton")


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Redzones:
    def __init__(self, fill: int):
        if not 0 <= fill <= 255:
            raise ValueError(f"fill must be a byte, got {fill}")
        self.mp = pytest.MonkeyPatch()  # its own: leaving undoes only what it set
        self.fill = fill
        self.violations: list[str] = []
        self.launches = 0

    # -- the launches -----------------------------------------------------------------------
    def _run(self, launches):
        for L in launches:
            if not all(g > 0 for g in L.grid):
                continue
            self.launches += 1
            copies = {}  # storage key -> (original storage, padded bytes, nbytes)
            args = []
            for pos, x in enumerate(L.args):
                if not isinstance(x, torch.Tensor):
                    args.append(x)
                    continue
                st = x.untyped_storage()
                key = (st.data_ptr(), st.nbytes()) if st.nbytes() else ("empty", pos)
                if key not in copies:
                    big = torch.full((RED + st.nbytes() + RED,), self.fill, dtype=torch.uint8,
                                     device=x.device)
                    if st.nbytes():
                        big[RED:RED + st.nbytes()].copy_(_bytes_of(st))
                    copies[key] = (st, big, st.nbytes(), [])
                st0, big, nb, names = copies[key]
                names.append(f"argument {pos}")
                view = torch.empty(0, dtype=x.dtype, device=x.device)
                view.set_(big.untyped_storage(), RED // x.element_size() + x.storage_offset(),
                          x.size(), x.stride())
                args.append(view)
            L.kernel[tuple(L.grid)](*args, **L.constexprs, num_warps=L.num_warps,
                                    num_stages=L.num_stages)
            for st, big, nb, names in copies.values():
                for side, zone in (("before", big[:RED]), ("after", big[RED + nb:])):
                    bad = int((zone != self.fill).sum())
                    if bad:
                        self.violations.append(
                            f"launch {L.tag or L.kernel.__name__!r} wrote {bad} bytes {side} the "
                            f"storage of its {', '.join(names)} ({nb} bytes)")
                if nb:
                    _bytes_of(st).copy_(big[RED:RED + nb])

    # -- the plans' own buffers -----------------------------------------------------------------
    def _filled(self, t: torch.Tensor) -> torch.Tensor:
        if t.numel():
            _bytes_of(t.untyped_storage()).fill_(self.fill)
        return t

    def __enter__(self):
        from nac_fast.kernels import launch
        for name in MODULES:
            mod = importlib.import_module(f"nac_fast.kernels.{name}")
            self.mp.setattr(mod, "run", self._run)
        real_buffer, real_alloc = launch.buffer, launch.Plan._alloc
        rz = self

        def buffer(shape, dtype, like, zero=False):
            t = real_buffer(shape, dtype, like, zero)
            return t if zero else rz._filled(t)

        def _alloc(plan, i):
            t = real_alloc(plan, i)
            return t if plan.zeroed[i] else rz._filled(t)

        self.mp.setattr(launch, "buffer", buffer)
        for name in ("nac_triton", "nac_noise_triton"):
            self.mp.setattr(importlib.import_module(f"nac_fast.kernels.{name}"), "buffer", buffer)
        self.mp.setattr(launch.Plan, "_alloc", _alloc)
        # a GPU's cached plans launch their compiled kernels directly: through `run` here
        self.mp.setattr(launch, "DIRECT_LAUNCH", False)
        return self

    def __exit__(self, *exc):
        self.mp.undo()
        return False


def same_bits(x, y, what: str = "result") -> None:
    """x and y (tensors, None or nested tuples/lists of them) equal bit for bit, NaNs included."""
    if isinstance(x, (tuple, list)):
        assert isinstance(y, (tuple, list)) and len(x) == len(y), what
        for i, (a, b) in enumerate(zip(x, y)):
            same_bits(a, b, f"{what}[{i}]")
        return
    if x is None or y is None:
        assert x is None and y is None, what
        return
    assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
    xb, yb = x.detach().contiguous().cpu(), y.detach().contiguous().cpu()
    if xb.is_floating_point():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[xb.element_size()]
        xb, yb = xb.view(width), yb.view(width)
    diff = int((xb != yb).sum())
    assert diff == 0, f"{what}: {diff} of {xb.numel()} elements differ"
