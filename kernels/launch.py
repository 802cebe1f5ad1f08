"""Launch plans shared by the Triton kernels and the compile-only GPU check.

Every Triton op of nac_fast builds a *plan* before it launches anything: the list of kernel
launches (kernel, grid, arguments, constexprs, warps, stages) that one call makes, for a given
:class:`Target`.  The op runs its plan; ``bench/compile_check.py`` builds the same plans from
meta tensors for sm_80 and sm_90 and compiles every launch with ``triton.compile`` on the CPU,
so the configurations the launchers choose and the ones CI checks cannot drift apart.

Block sizes come from one table per kernel (``Config`` candidates in order of preference); the
launcher takes the first candidate whose shared-memory *estimate* fits the target.  The estimate
only prunes; the compile check measures the real figure (and the registers and spills) with the
``ptxas`` that Triton ships.

Splits (how many programs share one row block's inner loop) fill one wave: ``Target.programs``,
the SMs times the blocks per SM the launch's kernel keeps resident (``blocks_per_sm`` of its
registers, shared memory and warps; on a GPU read from the kernel Triton compiled,
``compiled_occupancy``).  Every plan runs under its tensors' device (``run`` ->
``device_guard``), whatever the current CUDA device is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """What a launch plan depends on.  arch: compute capability as 10*major + minor (80, 90);
    0 for the interpreter.  smem: the opt-in shared memory per block in bytes.  sms: the
    streaming multiprocessors (the interpreter: NAC_FAST_TRITON_CPU_PROGRAMS "SMs" of one program
    each).  smem_per_sm: the shared memory one SM holds for all its resident blocks.
    occupancy: None, or a function (Launch) -> resident blocks per SM of that launch's compiled
    kernel (a GPU: `compiled_occupancy`, measured from the kernel Triton compiled); None counts
    one block per SM, the figure every compiled configuration reaches (bench/compile_check.py
    records each configuration's own figure, column blocks_per_sm)."""
    arch: int
    smem: int
    sms: int
    smem_per_sm: int = 0
    occupancy: Optional[Callable[["Launch"], int]] = dataclasses.field(default=None, compare=False)

    def programs(self, launch: "Launch") -> int:
        """How many programs of `launch` run at once on the whole machine (one wave)."""
        per_sm = 1 if self.occupancy is None or self.arch == 0 else self.occupancy(launch)
        return self.sms * max(1, int(per_sm))


# The targets the compile check covers (A100: 108 SMs, 163 KB per block of 164 KB per SM;
# H100/H200: 132 SMs, 227 KB of 228 KB).
SM80 = Target(80, 163 * 1024, 108, 164 * 1024)
SM90 = Target(90, 227 * 1024, 132, 228 * 1024)
CHECKED_TARGETS = (SM80, SM90)

# Per-SM limits of sm_80 and sm_90 (CUDA C Programming Guide, "Compute capabilities" table):
# 64 K 32-bit registers, allocated per warp in units of 256; 64 resident warps; 32 resident
# blocks; 1 KB of shared memory reserved per resident block.
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SMEM_RESERVED_PER_BLOCK = 1024


def blocks_per_sm(registers: int, smem_bytes: int, num_warps: int, smem_per_sm: int) -> int:
    """Resident blocks per SM of a kernel using `registers` per thread, `smem_bytes` of shared
    memory per block and `num_warps` warps (sm_80 / sm_90 limits above): the smallest of the
    register, warp, block and shared-memory limits.  0: the kernel cannot run (too many
    registers or too much shared memory)."""
    if registers <= 0 or num_warps <= 0:
        raise ValueError(f"registers and num_warps must be positive, got {registers}, {num_warps}")
    regs_per_warp = cdiv(registers * 32, REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = REGS_PER_SM // (regs_per_warp * num_warps)
    by_warps = MAX_WARPS_PER_SM // num_warps
    by_smem = smem_per_sm // (smem_bytes + SMEM_RESERVED_PER_BLOCK)
    return max(0, min(by_regs, by_warps, MAX_BLOCKS_PER_SM, by_smem))


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or smem
    return Target(10 * props.major + props.minor, int(smem), props.multi_processor_count,
                  int(smem_sm), occupancy=compiled_occupancy)


_OCCUPANCY: dict = {}


def compiled_occupancy(launch: "Launch") -> int:
    """Resident blocks per SM of `launch`'s kernel as Triton compiled it for the launch's device
    (its registers, shared memory and warps: `blocks_per_sm`).  Compiles the kernel if it is not
    compiled yet (JITFunction.warmup: what its first launch would do anyway), once per
    specialisation; no launch, no host sync."""
    dev = launch_device([launch])
    key = (launch.kernel, dev, tuple((a.dtype, a.stride(-1) == 1) if isinstance(a, torch.Tensor)
                                     else type(a) for a in launch.args),
           tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)
    if key not in _OCCUPANCY:
        with device_guard(dev):
            k = launch.kernel.warmup(*launch.args, **launch.constexprs, grid=launch.grid,
                                     num_warps=launch.num_warps, num_stages=launch.num_stages)
            k._init_handles()  # loads the module: fills n_regs (Triton 3.6 and 3.8)
        _OCCUPANCY[key] = blocks_per_sm(int(k.n_regs), int(k.metadata.shared),
                                        int(k.metadata.num_warps), target_of(dev).smem_per_sm)
    return _OCCUPANCY[key]


def target_of(device: torch.device) -> Target:
    """The target of a tensor's device: the GPU's own figures, or the interpreter (CPU tensors
    under TRITON_INTERPRET=1), where NAC_FAST_TRITON_CPU_PROGRAMS programs (default 4) make the
    split paths run in CI."""
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else
                            torch.cuda.current_device())
    return Target(0, 1 << 30, int(os.environ.get("NAC_FAST_TRITON_CPU_PROGRAMS", "4")))


@dataclasses.dataclass(frozen=True)
class Config:
    """One block configuration of a kernel.  Fields a kernel does not use stay 0."""
    BLOCK_M: int = 0
    BLOCK_N: int = 0
    num_warps: int = 4
    num_stages: int = 1
    archs: tuple = ()      # the archs (10*major + minor lower bounds) it may run on; () = any

    def applies(self, arch: int) -> bool:
        return not self.archs or any(arch >= a for a in self.archs)


def pick(candidates: Sequence[Config], target: Target,
         smem_estimate: Callable[[Config], int], interpreter: Config) -> Config:
    """The first candidate that applies to the target's arch and whose shared-memory estimate
    fits it; the interpreter (arch 0) takes its own configuration (few, wide numpy steps)."""
    if target.arch == 0:
        return interpreter
    for c in candidates:
        if c.applies(target.arch) and smem_estimate(c) <= target.smem:
            return c
    raise RuntimeError(f"no kernel configuration fits {target}: candidates {list(candidates)}")


class Launch(NamedTuple):
    kernel: Any             # a @triton.jit function
    grid: tuple
    args: tuple             # positional, in the kernel's parameter order (runtime parameters)
    constexprs: dict        # the constexpr parameters
    num_warps: int
    num_stages: int
    tag: str = ""           # what the compile check calls it ("fwd", "finish", ...)


def launch_device(launches: Sequence[Launch]) -> torch.device:
    """The one device of the tensors a plan's launches are handed (ValueError if several)."""
    devices = {a.device for L in launches for a in L.args if isinstance(a, torch.Tensor)}
    if len(devices) != 1:
        raise ValueError(f"a launch plan must work on tensors of one device, got {devices}")
    return devices.pop()


def device_guard(device: torch.device):
    """The context every Triton launch runs in: torch.cuda.device(device) for a CUDA device, so a
    kernel launches on its tensors' GPU and not on the current one (which may be another);
    nothing for the interpreter's CPU tensors."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def run(launches: Sequence[Launch]) -> None:
    """Launch a plan on its tensors' device (`device_guard`), through torch.library.wrap_triton
    (so torch.compile can trace the op)."""
    from torch.library import wrap_triton
    launches = [L for L in launches if all(g > 0 for g in L.grid)]
    if not launches:
        return
    with device_guard(launch_device(launches)):
        for L in launches:
            wrap_triton(L.kernel)[L.grid](*L.args, **L.constexprs, num_warps=L.num_warps,
                                          num_stages=L.num_stages)


def buffer(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer on like's device (meta tensors when a plan is only inspected)."""
    return torch.empty(shape, dtype=dtype, device=like.device)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_count(outer_blocks: int, inner_tiles: int, programs: int, cap: int = 64) -> int:
    """How many ways to split the inner dimension so that about `programs` programs (one wave of
    the launch: `Target.programs`) exist: a power of two, at most the number of inner tiles and
    `cap`."""
    want = max(1, cdiv(programs, max(1, outer_blocks)))
    split = 1
    while split * 2 <= min(want, inner_tiles, cap):
        split *= 2
    return split
