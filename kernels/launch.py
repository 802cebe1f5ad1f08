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
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, NamedTuple, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Target:
    """What a launch plan depends on.  arch: compute capability as 10*major + minor (80, 90);
    0 for the interpreter.  smem: the opt-in shared memory per block in bytes.  programs: how
    many programs fill the machine (2 per SM)."""
    arch: int
    smem: int
    programs: int


# The targets the compile check covers (A100: 108 SMs, 163 KB; H100/H200: 132 SMs, 227 KB).
SM80 = Target(80, 163 * 1024, 2 * 108)
SM90 = Target(90, 227 * 1024, 2 * 132)
CHECKED_TARGETS = (SM80, SM90)


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024
    return Target(10 * props.major + props.minor, int(smem), 2 * props.multi_processor_count)


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


def run(launches: Sequence[Launch]) -> None:
    """Launch a plan, through torch.library.wrap_triton (so torch.compile can trace the op)."""
    from torch.library import wrap_triton
    for L in launches:
        if all(g > 0 for g in L.grid):
            wrap_triton(L.kernel)[L.grid](*L.args, **L.constexprs, num_warps=L.num_warps,
                                          num_stages=L.num_stages)


def buffer(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer on like's device (meta tensors when a plan is only inspected)."""
    return torch.empty(shape, dtype=dtype, device=like.device)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_count(outer_blocks: int, inner_tiles: int, target: Target, cap: int = 64) -> int:
    """How many ways to split the inner dimension so that about target.programs programs exist:
    a power of two, at most the number of inner tiles and `cap`."""
    want = max(1, cdiv(target.programs, max(1, outer_blocks)))
    split = 1
    while split * 2 <= min(want, inner_tiles, cap):
        split *= 2
    return split
