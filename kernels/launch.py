"""Launch plans shared by the Triton kernels and the compile-only GPU check.

Every Triton op of nac_fast builds a *plan* before it launches anything: the list of kernel
launches (kernel, grid, arguments, constexprs, warps, stages) that one call makes, for a given
:class:`Target`.  The op runs its plan; ``tools/compile_check.py`` builds the same plans from
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

from nac_fast._tensors import eager_real  # noqa: F401  (the kernels' ops read it from here)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a launch plan depends on.  arch: compute capability as 10*major + minor (80, 90);
    0 for the interpreter.  smem: the opt-in shared memory per block in bytes.  sms: the
    streaming multiprocessors (the interpreter: NAC_FAST_TRITON_CPU_PROGRAMS "SMs" of one program
    each).  smem_per_sm: the shared memory one SM holds for all its resident blocks.
    occupancy: None, or a function (Launch) -> resident blocks per SM of that launch's compiled
    kernel (a GPU: `compiled_occupancy`, measured from the kernel Triton compiled); None counts
    one block per SM, the figure every compiled configuration reaches (tools/compile_check.py
    records each configuration's own figure, column blocks_per_sm)."""
    arch: int
    smem: int
    sms: int
    smem_per_sm: int = 0
    occupancy: Optional[Callable[["Launch"], int]] = dataclasses.field(default=None, compare=False)
    spills: Optional[Callable[["Launch"], int]] = dataclasses.field(default=None, compare=False)

    def clean(self, launch: "Launch") -> bool:
        """Whether `launch`'s kernel compiles without register spills here (a GPU: the compiled
        figure, `compiled_figures`; a target without a compiler, the interpreter and the compile
        check's: True, the check judges the figure itself).  The plans fold a row-wise tail into
        a matrix kernel only where the folded kernel is clean (kernels/nac_triton.py
        `folding`)."""
        return self.spills is None or self.arch == 0 or self.spills(launch) == 0

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
# The most rows (of a, the keys, a gallery) a kernel that indexes rows in int32 takes: its tiles
# and splits run past the last row by up to 2^16 rows (nac_triton: 64 splits + 1 blocks of <= 128;
# hamming_triton: the filter's g0 + BG), which must stay below 2^31
INT32_ROWS_MAX = (1 << 31) - (1 << 16)


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
                  int(smem_sm), occupancy=compiled_occupancy,
                  spills=lambda launch: compiled_figures(launch).local_bytes)


_OCCUPANCY: dict = {}  # (kernel, device, specialisation, warps, stages) -> CompiledFigures


class CompiledFigures(NamedTuple):
    """What the driver reports of a kernel as Triton compiled it for a GPU."""
    registers: int
    local_bytes: int   # local memory per thread: register spills (the driver's n_spills x 4)
    smem_bytes: int
    num_warps: int


def compiled_figures(launch: "Launch") -> CompiledFigures:
    """Registers, local memory (spills) and shared memory of `launch`'s kernel as Triton compiled
    it for the launch's device.  Compiles the kernel if it is not compiled yet
    (JITFunction.warmup: what its first launch would do anyway), once per specialisation; no
    launch, no host sync."""
    dev = launch_device([launch])
    key = (launch.kernel, dev, tuple((a.dtype, a.stride(-1) == 1) if isinstance(a, torch.Tensor)
                                     else type(a) for a in launch.args),
           tuple(sorted(launch.constexprs.items())), launch.num_warps, launch.num_stages)
    if key not in _OCCUPANCY:
        with device_guard(dev):
            k = launch.kernel.warmup(*launch.args, **launch.constexprs, grid=launch.grid,
                                     num_warps=launch.num_warps, num_stages=launch.num_stages)
            k._init_handles()  # loads the module: fills n_regs, n_spills (Triton 3.6 and 3.8)
        # Triton's n_spills is CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES / 4 (driver.c, 3.6 and 3.8)
        _OCCUPANCY[key] = CompiledFigures(int(k.n_regs), 4 * int(getattr(k, "n_spills", 0) or 0),
                                          int(k.metadata.shared), int(k.metadata.num_warps))
    return _OCCUPANCY[key]


def compiled_occupancy(launch: "Launch") -> int:
    """Resident blocks per SM of `launch`'s kernel as Triton compiled it for the launch's device
    (its registers, shared memory and warps: `blocks_per_sm`, from `compiled_figures`)."""
    f = compiled_figures(launch)
    return blocks_per_sm(f.registers, f.smem_bytes, f.num_warps,
                         target_of(launch_device([launch])).smem_per_sm)


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
    """One block configuration of a kernel.  Fields a kernel does not use stay 0.  waves: how
    many waves of programs the split of a matrix kernel's inner loop aims at (`split_count`): 1
    fills the machine once; 2 gives twice the programs, shorter ones (the autotune stage times
    both, kernels/tuning.py)."""
    BLOCK_M: int = 0
    BLOCK_N: int = 0
    num_warps: int = 4
    num_stages: int = 1
    archs: tuple = ()      # the archs (10*major + minor lower bounds) it may run on; () = any
    waves: int = 1

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
    # float parameters that change from call to call (the channel scale s, lambda): (parameter
    # name, function of the call's scalars giving its value).  A cached `Plan` recomputes them;
    # in `args` they hold this call's values.
    scalars: tuple = ()


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


def _nbytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


_ZEROED: set = set()  # ids of the recording plan's zero-filled buffers (cleared per record)


def buffer(shape, dtype, like: torch.Tensor, zero: bool = False) -> torch.Tensor:
    """An uninitialised buffer on like's device (meta tensors when a plan is only inspected), or
    zero-filled (`zero`: a counter the kernels leave zero when they are done with it, which a plan
    may then keep as scratch).  While a `Plan` is recorded, every buffer is noted: the plan
    allocates its like at each call."""
    t = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=like.device)
    if _RECORDING is not None:
        _RECORDING.append(t)
        if zero:
            _ZEROED.add(id(t))
    return t


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_count(outer_blocks: int, inner_tiles: int, programs: int, cap: int = 64,
                waves: int = 1) -> int:
    """How many ways to split the inner dimension so that about `waves` x `programs` programs
    (`programs`: one wave of the launch, `Target.programs`) exist: a power of two, at most the
    number of inner tiles and `cap`."""
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    want = max(1, cdiv(programs * waves, max(1, outer_blocks)))
    split = 1
    while split * 2 <= min(want, inner_tiles, cap):
        split *= 2
    return split


# ---------------------------------------------------------------------------------------------
# Cached plans: the host side of a call in microseconds (issue 37).
#
# Building a plan (configurations, splits, occupancy, Launch tuples) and launching each kernel
# through triton's JITFunction.run (argument binding, specialisation, cache lookup) cost about a
# millisecond of Python per forward + backward.  A `Plan` is one call's plan recorded once per
# key (shapes, strides, dtypes, device, flags: everything a plan depends on but the tensors' data
# and the per-call scalars) and bound to each later call's tensors: its buffers allocated like the
# recorded ones, its arguments taken from the call's inputs, its scalars recomputed.  On a GPU the
# bound launches go straight to the compiled kernels' launchers (what JITFunction.run ends with),
# found once per pointer-alignment signature (triton specialises pointers on 16-byte alignment);
# elsewhere (the interpreter) through `run`, as an uncached plan would.
# ---------------------------------------------------------------------------------------------

_RECORDING: Optional[list] = None  # the buffers of the plan being recorded (see `buffer`)
PLAN_CACHE_SIZE = 256               # plans kept per op (least recently recorded dropped first)

# Scratch: a plan's buffers that are no output (the forward's split partials, the keys' backward's
# split sums) live only while the plan's own launches run.  On a GPU, outside CUDA-graph capture,
# a plan keeps them per stream and hands them to its next call on that stream, whose launches
# queue behind the previous call's: no allocation (a few us of host each, issue 37).  Plans whose
# scratch exceeds SCRATCH_PLAN_MAX, or that would take the held total past SCRATCH_TOTAL_MAX,
# allocate per call as before (large calls are GPU-bound: their host time is hidden anyway).
# NAC_FAST_KEEP_SCRATCH=0 turns it off; release_scratch() frees what is held.
SCRATCH_PLAN_MAX = 32 << 20
SCRATCH_TOTAL_MAX = 256 << 20
KEEP_SCRATCH = os.environ.get("NAC_FAST_KEEP_SCRATCH", "1") != "0"
_SCRATCH_HELD = [0]       # bytes held by every plan's kept scratch
_PLANS_HOLDING: set = set()  # the plans that hold some (release_scratch)


def _keeps_scratch(device: torch.device) -> bool:
    """Whether a plan call on `device` may reuse kept scratch: a GPU whose current stream is not
    being captured into a CUDA graph (a graph would bake the pointers in), and KEEP_SCRATCH."""
    return (KEEP_SCRATCH and device.type == "cuda"
            and not torch.cuda.is_current_stream_capturing())


def _stream_key(device: torch.device) -> int:
    return _stream(device.index)


def release_scratch() -> int:
    """Free the scratch every plan keeps (see SCRATCH_PLAN_MAX); returns the bytes released."""
    freed = _SCRATCH_HELD[0]
    for plan in _PLANS_HOLDING:
        plan.scratch.clear()
    _PLANS_HOLDING.clear()
    _SCRATCH_HELD[0] = 0
    return freed


@contextlib.contextmanager
def not_recording():
    """Buffers made inside are not the recording plan's (kernels/tuning.py's first-use autotune
    runs plans of its own while an op records one)."""
    global _RECORDING
    saved, _RECORDING = _RECORDING, None
    try:
        yield
    finally:
        _RECORDING = saved


def _stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def _first_launch(L: Launch):
    """Launch `L` through triton's own path (compiling it if needed) and return the compiled
    kernel it ran, whose launcher later calls use directly.  On the GPU only."""
    k = L.kernel.run(*L.args, grid=L.grid, warmup=False, **L.constexprs,
                     num_warps=L.num_warps, num_stages=L.num_stages)
    if hasattr(k, "result"):  # an asynchronous compile's future (triton 3.6)
        k = k.result()
    return k.run, k.function, k.packed_metadata


def _runtime_knobs():
    try:
        from triton import knobs
        return knobs.runtime
    except Exception:  # a triton without knobs: no hooks to call
        return None


_KNOBS = _runtime_knobs()


def _hook_active(hook) -> bool:
    # triton 3.6/3.8: a HookChain, never None, active when it holds calls; older: a callable or None
    return hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))


def _hooks_set() -> bool:
    """Whether triton's launch hooks are set (a profiler such as proton): then every launch goes
    through triton's own path, which calls them."""
    return _KNOBS is not None and (_hook_active(_KNOBS.launch_enter_hook)
                                   or _hook_active(_KNOBS.launch_exit_hook))


# NAC_FAST_DIRECT_LAUNCH=0: every launch through triton's own path (JITFunction.run), for
# debugging; the plans are still cached.
DIRECT_LAUNCH = os.environ.get("NAC_FAST_DIRECT_LAUNCH", "1") != "0"


def direct_launches(device: torch.device) -> bool:
    """Whether plans on `device` launch their compiled kernels directly (a GPU, no launch hook,
    DIRECT_LAUNCH); else through `run`."""
    return device.type == "cuda" and DIRECT_LAUNCH and not _hooks_set()


class Plan:
    """One call's launch plan, recorded, to be bound to later calls with the same key.

        plan, outputs = Plan.record(build, inputs, launcher)   # first call: runs it
        outputs = plan(inputs, scalars, launcher)               # later calls

    `build()` returns (launches, outputs) for the recorded call's `inputs` (a tuple of tensors or
    None), its per-call floats already in the launches' arguments; a later call's `scalars` (a
    tuple of floats) are the arguments of each Launch.scalars function.  Every
    tensor of a launch or of the outputs must be an input or a `buffer` the build allocated.
    `launcher(launches)`: how launches run when they do not go to the compiled kernels directly
    (`run`, or a recorder)."""

    __slots__ = ("device", "buffers", "launches", "outputs", "compiled", "nbuf", "is_scratch",
                 "scratch_bytes", "scratch", "zeroed")

    def __init__(self, launches, outputs, inputs, buffers):
        self.device = launch_device(launches) if launches else None
        index = {}
        for i, t in enumerate(inputs):
            if t is not None:
                index[id(t)] = (0, i)
        # Only the buffers a launch or an output uses are allocated per call (a split's probe
        # made stand-ins that nothing reads); empty ones are made once, here, and shared by every
        # call (no data to share: a (0,) gradient nobody asked for, the keys' (0,) placeholder).
        used = {id(x) for L in launches for x in L.args if isinstance(x, torch.Tensor)}
        used |= {id(x) for x in outputs if isinstance(x, torch.Tensor)}
        specs, shared, zeroed = [], [], []
        for t in buffers:
            if id(t) in index or id(t) not in used:
                continue
            if t.numel() == 0:
                index[id(t)] = (2, t.new_empty(t.shape))
            else:
                index[id(t)] = (1, len(specs))
                specs.append((tuple(t.shape), t.dtype, t.device))
                zeroed.append(id(t) in _ZEROED)
        self.buffers = specs
        self.zeroed = zeroed  # buffers a call needs zero-filled (`buffer(..., zero=True)`)
        self.nbuf = len(specs)
        # scratch: the allocated buffers no output is (module comment at SCRATCH_PLAN_MAX)
        out_ids = {id(x) for x in outputs if isinstance(x, torch.Tensor)}
        self.is_scratch = [False] * len(specs)
        for t in buffers:
            where = index.get(id(t))
            if where is not None and where[0] == 1 and id(t) not in out_ids:
                self.is_scratch[where[1]] = True
        self.scratch_bytes = sum(
            _nbytes(shape, dt) for (shape, dt, _), s in zip(specs, self.is_scratch) if s)
        self.scratch: dict = {}  # stream -> {buffer index: tensor}

        def ref(x, where):
            if isinstance(x, torch.Tensor):
                if id(x) not in index:
                    raise RuntimeError(f"{where}: a tensor that is neither an input of the plan nor "
                                       "a buffer it allocated (kernels/launch.py Plan)")
                return index[id(x)]
            return None

        self.launches = []
        for L in launches:
            names = list(L.kernel.arg_names) if hasattr(L.kernel, "arg_names") else None
            full = list(L.args)
            if names is not None:
                missing = [nm for nm in names[len(L.args):] if nm not in L.constexprs]
                if missing:
                    raise RuntimeError(f"launch {L.tag!r}: parameters {missing} are neither "
                                       "positional arguments nor constexprs")
                full += [L.constexprs[nm] for nm in names[len(L.args):]]
            dyn = [(pos, *ref(x, f"launch {L.tag!r} argument {pos}"))
                   for pos, x in enumerate(L.args) if isinstance(x, torch.Tensor)]
            scal = []
            for name, fn in L.scalars:
                pos = names.index(name) if names is not None else None
                if pos is None or pos >= len(L.args):
                    raise RuntimeError(f"launch {L.tag!r}: scalar {name!r} is not a runtime "
                                       "parameter of its kernel")
                scal.append((pos, fn))
            for pos, _, _ in dyn:
                full[pos] = None  # the recorded call's tensors are not kept alive by the plan
            grid = tuple(L.grid) + (1,) * (3 - len(L.grid))
            self.launches.append((L, full, dyn, scal, grid))
        self.outputs = [ref(t, f"output {i}") if isinstance(t, torch.Tensor) else (2, t)
                        for i, t in enumerate(outputs)]
        self.compiled: dict = {}

    @classmethod
    def record(cls, build, inputs, launcher):
        """(plan or None, outputs): build the plan, record it, run it.  None when the inputs
        alias one another (one tensor passed twice: a later call's may not), so nothing is
        cached."""
        global _RECORDING
        prev, _RECORDING = _RECORDING, []
        try:
            launches, outputs = build()
            bufs = _RECORDING
        finally:
            _RECORDING = prev
        launches = [L for L in launches if all(g > 0 for g in L.grid)]
        ids = [id(t) for t in inputs if t is not None]
        try:
            plan = cls(launches, outputs, inputs, bufs) if len(set(ids)) == len(ids) else None
        finally:
            _ZEROED.difference_update(id(t) for t in bufs)
        if plan is not None and launches and direct_launches(plan.device):
            plan._launch_direct(inputs, None, launches)
        else:
            launcher(launches)
        return plan, tuple(outputs)

    def _alloc(self, i):
        shape, dt, d = self.buffers[i]
        return (torch.zeros if self.zeroed[i] else torch.empty)(shape, dtype=dt, device=d)

    def _bufs(self, dev):
        """This call's buffers: the outputs' allocated, the scratch kept for this stream (made
        on the stream's first call) where `_keeps_scratch`.  A kept zeroed buffer (a counter) is
        zeroed once: the kernels that use it leave it zero."""
        if not self.scratch_bytes or dev is None or not _keeps_scratch(dev):
            return [self._alloc(i) for i in range(self.nbuf)]
        key = _stream_key(dev)
        held = self.scratch.get(key)
        if held is None:
            if (self.scratch_bytes > SCRATCH_PLAN_MAX
                    or _SCRATCH_HELD[0] + self.scratch_bytes > SCRATCH_TOTAL_MAX):
                return [self._alloc(i) for i in range(self.nbuf)]
            held = {i: self._alloc(i) for i in range(self.nbuf) if self.is_scratch[i]}
            _SCRATCH_HELD[0] += self.scratch_bytes
            _PLANS_HOLDING.add(self)
            self.scratch[key] = held
        return [held[i] if i in held else self._alloc(i) for i in range(self.nbuf)]

    def release(self) -> None:
        """Free this plan's kept scratch (a plan dropped from its cache)."""
        _SCRATCH_HELD[0] -= self.scratch_bytes * len(self.scratch)
        _PLANS_HOLDING.discard(self)
        self.scratch.clear()

    def __call__(self, inputs, scalars, launcher):
        dev = self.device
        bufs = self._bufs(dev)
        pools = (inputs, bufs)
        bound = []
        for L, full, dyn, scal, grid in self.launches:
            args = full.copy()
            for pos, src, i in dyn:
                args[pos] = i if src == 2 else pools[src][i]
            for pos, fn in scal:
                args[pos] = fn(*scalars)
            bound.append(args)
        if dev is not None:
            if direct_launches(dev):
                self._launch_direct(inputs, bound, None)
            else:
                launcher([L._replace(args=tuple(args[:len(L.args)]))
                          for (L, *_), args in zip(self.launches, bound)])
        return tuple(pools[src][i] if src < 2 else i for src, i in self.outputs)

    def _launch_direct(self, inputs, bound, launches):
        """Launch on the GPU: `bound` (full argument lists) through the compiled kernels of this
        alignment signature, or on its first call `launches` through triton's own path, noting
        the kernels it compiled."""
        align = 0
        for i, t in enumerate(inputs):
            if t is not None and t.data_ptr() & 15:
                align |= 1 << i
        kernels = self.compiled.get(align)
        dev = self.device
        # a CUDA tensor's device always has its index
        guard = dev.type == "cuda" and dev.index != torch.cuda.current_device()
        with (device_guard(dev) if guard else contextlib.nullcontext()):
            if kernels is None:
                if launches is None:
                    launches = [L._replace(args=tuple(args[:len(L.args)]))
                                for (L, *_), args in zip(self.launches, bound)]
                self.compiled[align] = [_first_launch(L) for L in launches]
                return
            stream = _stream(dev.index)
            for (run_fn, function, meta), (_, _, _, _, grid), args in zip(kernels, self.launches,
                                                                         bound):
                run_fn(grid[0], grid[1], grid[2], stream, function, meta, None, None, None, *args)


class PlanCache:
    """Plans of one op by key, at most PLAN_CACHE_SIZE (the oldest recorded dropped first).
    key None: a call that may not use a cached plan (traced, fake tensors: `eager_real` false),
    its plan built afresh and handed to the launcher.  `clear()` empties it (tests; a changed
    configuration table)."""

    def __init__(self, name: str):
        self.name = name
        self.plans: dict = {}
        self.recorded = 0  # how many plans were recorded (a test reads it: no rebuild per call)

    def __call__(self, key, build, inputs, scalars, launcher):
        if key is None:
            launches, outputs = build()
            launcher(launches)
            return tuple(outputs)
        plan = self.plans.get(key)
        if plan is not None:
            return plan(inputs, scalars, launcher)
        plan, outputs = Plan.record(build, inputs, launcher)
        self.recorded += 1
        if plan is not None:
            if len(self.plans) >= PLAN_CACHE_SIZE:
                self.plans.pop(next(iter(self.plans))).release()
            self.plans[key] = plan
        return outputs

    def clear(self) -> None:
        for plan in self.plans.values():
            plan.release()
        self.plans.clear()
        self.recorded = 0
