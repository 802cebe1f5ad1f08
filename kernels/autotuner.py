"""The runtime autotuner of the Triton NAC kernels: times the candidate configurations of one
tuned-table key (kernels/tuning.py) on random data of the call's shape, checks each against the
built-in configuration, refuses spilling ones, and writes the first-use cache (NAC_FAST_AUTOTUNE=1)
or feeds the autotune stage (tools/autotune.py).

It imports nac_triton (the plans it times) one way: nac_triton and tuning never import this
module.  Importing it registers `first_use_autotune` with kernels/tuning.py (`register_autotuner`);
nac_fast.ops.dispatch imports it with the other Triton kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import configs as CF
from . import nac_triton as NT
from . import tuning as TU
from .launch import Config
from .tuning import (CHECK_TOL, ENV_AUTOTUNE, KINDS, Table, _fits, announce, config_dict,
                     config_label, dtype_name, entry_config, forced, load_table, make_entry,
                     table_header, validate, write_table)

# ---------------------------------------------------------------------------------------------
# Timing the candidates of one key (the autotune stage and the first-use autotune)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One shape to tune at: `kind` with n query rows, N keys (n for in-batch), D code bits."""
    kind: str
    n: int
    N: int
    D: int
    dtype: torch.dtype

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "inbatch" and self.N != self.n:
            raise ValueError(f"in-batch: N must equal n, got n={self.n}, N={self.N}")
        if min(self.n, self.N, self.D) < 1:
            raise ValueError(f"n, N, D must be >= 1, got {self.n}, {self.N}, {self.D}")


P_CHANNEL = 0.1  # the channel's flip probability of the random data (s = channel_scale(p))


def case_inputs(case: Case, device, seed: int = 0) -> dict:
    """Random inputs of a case (never zeros): codes a ~ 1.5 N(0,1), logits r ~ 2 N(0,1), noise
    +-1 flipped with p = 0.1, keys tanh(1.5 N(0,1)) (queue), upstream gradient g in [0.5, 1.5)/n."""
    gen = torch.Generator().manual_seed(seed)
    n, N, D, dt = case.n, case.N, case.D, case.dtype
    t = dict(a=torch.randn(n, D, generator=gen) * 1.5, r=torch.randn(n, D, generator=gen) * 2,
             noise=torch.where(torch.rand(n, D, generator=gen) < P_CHANNEL, -1.0, 1.0),
             g=(torch.rand(n, generator=gen) + 0.5) / n)
    t["keys"] = (torch.tanh(torch.randn(N, D, generator=gen) * 1.5) if case.kind == "queue"
                 else None)
    acc = torch.float64 if dt == torch.float64 else torch.float32
    return {k: (None if v is None else v.to(device=device, dtype=acc if k == "g" else dt))
            for k, v in t.items()}


def channel_scale(p: float) -> float:
    return 0.5 * math.log((1.0 - p) / p)


def plan_call(kernel: str, case: Case, inputs: dict, target, cfg: Optional[Config],
              fwd_state: Optional[tuple] = None):
    """(launches, outputs, split, state) of `kernel`'s plan for the case with configuration `cfg`
    forced (None: the built-in one, `nac_triton.builtin_config`, whatever a table says).  fwd:
    the forward plan (prologue, forward, finish) with the rows' gradient, state = its (loss,
    lse, ga, q, k) for the backward; bwd_keys: the backward plan (keys' backward and what follows
    it) from the forward's state.  outputs: the tensors the check compares; split: the kernel's
    split count (grid[1])."""
    s = channel_scale(P_CHANNEL)
    l2 = 0.1 if case.kind == "queue" else 0.0
    a, r, noise, keys = inputs["a"], inputs["r"], inputs["noise"], inputs["keys"]
    if cfg is None:
        cfg = NT.builtin_config(kernel, case.dtype, case.D, target)
    with forced(**{kernel: cfg}):
        if kernel == "fwd":
            launches, state = NT.fwd_plan(a, r, noise, keys, s, l2, True, target)
            outputs = dict(loss=state[0], lse=state[1], ga=state[2])
        else:
            loss, lse, ga, q, k = fwd_state[:5]
            launches, out = NT.bwd_plan(a, r, noise, keys, lse, ga, inputs["g"], q, k, s,
                                        True, True, keys is not None, target)
            outputs = dict(grad_a=out[0], grad_r=out[1], grad_keys=out[2])
            state = None
    mine = [L for L in launches if L.tag.startswith(kernel)]
    return launches, outputs, (mine[0].grid[1] if mine else 0), state


def _time_cpu(fn: Callable[[], None], reps: int) -> Tuple[float, float, float]:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) > 1 else ts * 9
    return statistics.median(ts), q[1], q[7]


def _time_gpu(fn: Callable[[], None], rep_ms: float, warmup_ms: float
              ) -> Tuple[float, float, float]:
    """CUDA-graph replay of `fn` (its launches captured once), triton.testing.do_bench's median,
    p20, p80 in ms (L2 flushed between replays, as bench/bench_loss.py's +graph rows)."""
    from triton.testing import do_bench
    fn()  # compiles (or loads from triton's cache) before the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    med, p20, p80 = do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms,
                             quantiles=[0.5, 0.2, 0.8])
    del graph
    return float(med), float(p20), float(p80)


def _rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    den = float(ref.norm())
    return float((x - ref).norm()) / (den if den > 0 else 1.0)


def run_fwd(case: Case, inputs: dict, target) -> tuple:
    """The forward with the built-in configuration, run: its state for the keys' backward."""
    from .launch import run
    launches, _, _, state = plan_call("fwd", case, inputs, target, None)
    run(launches)
    return state


def spilling(launches, kernel: str, figures: Callable) -> List[str]:
    """'tag: N B' for each of `kernel`'s launches whose compiled kernel uses local memory
    (`figures(launch)`: kernels/launch.py compiled_figures, the driver's figures of the kernel as
    the running Triton compiled it).  Resources are part of correctness: a candidate that spills
    is refused, whatever its time (the compile check holds the shipped configurations to it on
    CI's Triton; this holds the autotune's winners to it on the device's)."""
    out = []
    for L in launches:
        if L.tag.startswith(kernel) and all(g > 0 for g in L.grid):
            local = figures(L).local_bytes
            if local:
                out.append(f"{L.tag}: {local} B")
    return out


def tune_key(kernel: str, case: Case, device, target, cands: Sequence[Config],
             rep_ms: float = 25.0, warmup_ms: float = 5.0, cpu_reps: int = 3,
             deadline: Optional[float] = None, progress: Optional[Callable[[], None]] = None,
             figures: Optional[Callable] = None) -> dict:
    """Time every candidate of `kernel` on the case (random data) and check each one's outputs
    against the built-in configuration's.  Returns dict(default=row, rows=[row per candidate
    timed or refused], winner=the fastest "ok" row or None, skipped=[labels of the candidates
    past the deadline, not timed]).  A row: label, config, split, programs, median_ms, p20_ms,
    p80_ms, peak_mib (GPU: the MiB of buffers the plan allocates), max_rel_diff, status:
    "ok", "mismatch (...)", "error: ...", "spills (...)" (refused untimed: `spilling`, with
    `figures`, by default on a GPU kernels/launch.py compiled_figures; the interpreter has none),
    "same plan as waves 1", or "no-effect: ..." (the plan does not pass Config.waves to the
    split)."""
    from .launch import compiled_figures, run
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    inputs = case_inputs(case, dev)
    fwd_state = run_fwd(case, inputs, target) if kernel == "bwd_keys" else None
    timer = ((lambda f: _time_gpu(f, rep_ms, warmup_ms)) if gpu
             else (lambda f: _time_cpu(f, cpu_reps)))

    def split_of(cfg):
        return plan_call(kernel, case, inputs, target, cfg, fwd_state)[2]

    if figures is None and gpu:
        figures = compiled_figures

    def measure(cfg):
        before = torch.cuda.memory_allocated(dev) if gpu else 0
        launches, outputs, split, _ = plan_call(kernel, case, inputs, target, cfg, fwd_state)
        spills = spilling(launches, kernel, figures) if cfg is not None and figures else []
        if spills:
            import triton
            return dict(split=split, status=f"spills ({'; '.join(spills)}; triton "
                                            f"{triton.__version__})")
        # the plan's buffers (outputs, split partials); the kernels allocate nothing
        peak = round((torch.cuda.memory_allocated(dev) - before) / 2 ** 20, 1) if gpu else ""
        med, p20, p80 = timer(lambda: run(launches))
        programs = next((L.grid[0] * L.grid[1] for L in launches if L.tag.startswith(kernel)), 0)
        return dict(split=split, programs=programs, median_ms=med, p20_ms=p20, p80_ms=p80,
                    peak_mib=peak, outputs={k: v.clone() for k, v in outputs.items()})

    base = measure(None)
    base_out = base.pop("outputs")
    default_row = dict(label="built-in", config=None, max_rel_diff=0.0, status="ok", **base)
    tol = CHECK_TOL.get(dtype_name(case.dtype), 1e-4)
    honours = None
    rows, skipped = [], []
    nan = float("nan")
    for c in cands:
        if deadline is not None and time.monotonic() > deadline:
            skipped.append(config_label(c))
            continue
        row = dict(label=config_label(c), config=config_dict(c), split=0, programs=0,
                   median_ms=nan, p20_ms=nan, p80_ms=nan, peak_mib="", max_rel_diff=nan)
        try:
            if c.waves > 1:
                if honours is None:
                    honours = split_of(dataclasses.replace(c, waves=1)) != split_of(
                        dataclasses.replace(c, waves=1 << 12))
                if not honours:
                    row["status"] = ("no-effect: the plan does not pass Config.waves to _split "
                                     "(kernels/nac_triton.py fwd_plan/bwd_plan)")
                elif split_of(c) == split_of(dataclasses.replace(c, waves=1)):
                    row["status"] = "same plan as waves 1"
            if "status" not in row:
                m = measure(c)
                out = m.pop("outputs", None)  # None: refused before timing (its status says)
                row.update(m)
                if out is not None:
                    diff = max(_rel_diff(out[k], base_out[k]) for k in base_out)
                    row["max_rel_diff"] = diff
                    row["status"] = ("ok" if diff <= tol
                                     else f"mismatch ({diff:.2e} > {tol:g})")
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a finding, not a stop
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            row["status"] = f"error: {type(exc).__name__}: {first}"
        rows.append(row)
        if progress is not None:
            progress()
    ok = [r for r in rows if r["status"] == "ok"]
    winner = min(ok, key=lambda r: r["median_ms"]) if ok else None
    return dict(default=default_row, rows=rows, winner=winner, skipped=skipped)


def _not_recording():
    """The first-use autotune runs while the op records its plan (kernels/launch.py Plan notes
    every buffer made meanwhile): the autotune's own plans' buffers must not join it."""
    from .launch import not_recording
    return not_recording()


def first_use_autotune(kernel, dtype, D, kind, n, N, device, target) -> Table:
    """Time the candidates of one key at the call's shape on `device` and add the winner to this
    device's cache file (created if needed); returns the cache's table."""
    if device is None:
        raise RuntimeError("the first-use autotune needs the call's device")
    cuda = device.type == "cuda"  # (CPU tensors under the interpreter: the tests)
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{ENV_AUTOTUNE}=1: the first call of a new shape class ({kernel}, {dtype}, D={D}, "
            f"{kind}, n={n}, N={N}) came inside a CUDA graph capture, where kernels cannot be "
            "timed: make one call outside the capture first, or unset " + ENV_AUTOTUNE)
    name = TU._device_name(device)
    path = TU.cache_path(name, target.arch)
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # older torch: no fake mode to leave
        unset_fake_temporarily = contextlib.nullcontext
    case = Case(kind, n, N if kind == "queue" else n, D, dtype)
    prec = CF.precision(dtype, D)
    t0 = time.perf_counter()
    with unset_fake_temporarily(), _not_recording(), (
            torch.cuda.device(device) if cuda else contextlib.nullcontext()):
        res = tune_key(kernel, case, device, target,
                       [c for c in TU.candidates(kernel, dtype, D)
                        if _fits(c, kernel, dtype, D, target)])
    entry = make_entry(kernel, case, prec, res)
    data = load_table(path).data if os.path.exists(path) else table_header(
        target.arch, name, target.sms, gpu=cuda)
    if entry is not None:
        data["entries"] = [e for e in data["entries"] if not (
            (e["kernel"], e["dtype"], e["block_d"], e["precision"], e["kind"],
             e["size_class"]) == (entry["kernel"], entry["dtype"], entry["block_d"],
                                  entry["precision"], entry["kind"], entry["size_class"]))]
        data["entries"].append(entry)
        write_table(path, data)
    announce(f"first-use autotune of {kernel} {dtype_name(dtype)} D={D} {kind} n={n} N={N} "
             f"took {time.perf_counter() - t0:.1f} s: "
             + (f"{config_label(entry_config(entry))}, {entry['median_ms']:.3f} ms "
                f"({entry['speedup']:.2f}x the built-in configuration)" if entry else
                "no candidate passed its check; the built-in configuration stays")
             + f"; cached in {path}")
    return load_table(path) if os.path.exists(path) else validate(data, path)


TU.register_autotuner(first_use_autotune)
