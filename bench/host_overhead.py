"""Host time of one fused NAC forward+backward as a training loop calls it (issue 37).

    python bench/host_overhead.py                      # no GPU: the Python side, launches stubbed
    python bench/host_overhead.py --gpu --csv bench/results/<gpu>_<date>/host_gpu.csv

What a call costs the host is Python and dispatch: argument checks, the noise draw, the backend
choice, autograd, the launch plan and the launches.  When it exceeds the GPU work (a training
step's shapes: tens of microseconds of kernels) the GPU waits for the host, and the fused loss is
no faster than eager PyTorch.

--stub (the default without a GPU): the real call path of the Triton backend on CPU tensors
(TRITON_INTERPRET=1 so the backend is there), planned for an sm_90 target (132 SMs), with the
kernel launches replaced by no-ops at the last step (the compiled kernel's launcher: what
kernels/launch.py Plan calls on a GPU).  Everything else runs as on a GPU: the loss API and its
checks (value checks off, as on GPU tensors), the noise op, the autograd layer, the plan cache and
the argument binding.  It prints microseconds per forward+backward for
  triton          nac_loss / nac_mq_loss(backend="triton") as users call them (noise drawn inside)
  triton-unfolded the same with NAC_FAST_FOLD=0: the finish and (in-batch) the rows' backward
                  as launches of their own (kernels/nac_triton.py `folding`): the fold's A/B
  triton-op-path  the same through the registered torch.library ops with a plan built per call
                  (the path every eager call took before the cache: the "before" figure)
  triton-criterion  the nn.Module criteria around the same loss, as a training loop calls them:
                  NACLoss on two views of n/2 rows, NACMQLoss with its queue and VI term
  cpu, cpu-op-path, reference   the fused CPU kernel (both paths) and the reference at n = 4,
                  D = 8, where the kernels' own work is negligible: the CPU backend's overhead
and per call the Triton launches, the ATen ops that launch a kernel (aten_launches, aten_ops) and
the tensors allocated (allocations).  The ATen counts see the eager path whole; on the
triton-op-path rows they miss what runs inside the registered ops.  A CPU has no GPU launcher, so
this is the host side without the driver's few microseconds per launch.

--gpu: on a CUDA GPU, per shape (in-batch 512 and 8192, queue 256 and 8192 x 65536 in bf16;
in-batch 8192 and queue 256 x 65536 in fp32; D = 128) and backend (reference, compiled-reference,
triton, triton-unfolded (bf16 shapes only), cuda, auto):
  host_s          48 fwd+bwd issued back to back from an idle GPU, host clock, no sync: the
                  host's time per call (few enough that the launch queue never fills and blocks)
  back_to_back_s  200 fwd+bwd back to back and the sync after them, per call: what a training
                  loop gets (the larger of host and GPU time)
  graph_s         the step captured in a CUDA graph (fresh inputs, the noise drawn once before:
                  no RNG in the capture), replays timed by do_bench: the GPU work alone
and first two floor rows (kind "floor", `floor_rows`): one ATen launch, and an autograd.Function
with one launch each way, the least a loss called through autograd costs this host;
and, per fused backend, the ratios to eager and torch.compile (compiled-reference:
torch.compile(reference, fullgraph=True, dynamic=False), the noise drawn outside it by the same
call).  Each is the median of 3 repetitions.  Rows are appended to --csv (columns FIELDS) and a
table and the goals of issue 37 are printed last; --profile-out writes cProfile's top functions of
100 triton calls at in-batch 8192.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time

if "--gpu" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors reach the op

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import nac_fast  # noqa: E402
from nac_fast.ops import dispatch, loss as loss_mod, nac, reference  # noqa: E402

FIELDS = ["timestamp", "host", "device", "torch", "triton", "commit", "mode", "kind", "n", "N",
          "D", "dtype", "backend", "resolved", "host_s", "back_to_back_s", "graph_s",
          "launches", "plans_recorded", "x_eager", "x_compile", "status",
          # --stub: the kernel-launching ATen ops of one call (the seed, the mean, casts...)
          "aten_launches", "aten_ops",
          # --stub: the tensors with memory of their own that one call allocates
          "allocations",
          # the case's floor on this GPU (common.bound) and graph_s against it
          "bound_s", "pct_of_bound"]
GPU_CASES = [("inbatch", 512, 512, "bfloat16"), ("inbatch", 8192, 8192, "bfloat16"),
             ("mq", 256, 65536, "bfloat16"), ("mq", 8192, 65536, "bfloat16"),
             # fp32 (the loss's default precision) at a large and a training step's shape
             ("inbatch", 8192, 8192, "float32"), ("mq", 256, 65536, "float32")]
CALLS = 200
P = 0.1


def _inputs(kind, n, N, D, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + n + N)
    a = (torch.randn(n, D, generator=g) * 1.5).to(device, dtype).requires_grad_()
    if kind == "mq":  # a training step: the momentum net's r_hat takes no gradient
        r = torch.randn(n, D, generator=g).to(device, dtype)
        queue = torch.tanh(torch.randn(N, D, generator=g)).to(device, dtype)
    else:
        r = torch.randn(n, D, generator=g).to(device, dtype).requires_grad_()
        queue = None
    return a, r, queue


def user_step(kind, n, N, D, dtype, device, backend, noise_inside: bool = True):
    """One forward+backward as users call it: noise drawn inside, the loss's own checks.
    noise_inside=False: the noise drawn once, outside (the CUDA-graph rows: no RNG in a
    capture).  Fresh inputs at each call of user_step."""
    a, r, queue = _inputs(kind, n, N, D, dtype, device)
    noise = None if noise_inside else nac_fast.draw_noise((n, D), P, device=device, dtype=dtype)
    if kind == "mq":
        def step():
            a.grad = None
            nac_fast.nac_mq_loss(a, r, queue, P, l2=0.1, noise=noise, backend=backend).backward()
    else:
        def step():
            a.grad = r.grad = None
            nac_fast.nac_loss(a, r, P, noise=noise, backend=backend).backward()
    return step


def criterion_step(kind, n, N, D, dtype, device, backend):
    """One forward+backward of the nn.Module criterion as a training loop calls it: NACLoss on the
    two views' (a, r) (kind "inbatch", 2 x n/2 rows), or NACMQLoss with the momentum outputs and
    a CodeQueue of N codes (kind "mq"; its VI term included).  What the criterion adds around
    the fused loss (pairing the views, the queue, the VI term) counts here."""
    half = max(1, n // 2)
    g = torch.Generator(device="cpu").manual_seed(n + N)
    leaf = lambda: torch.randn(half, D, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    outs = [(leaf(), leaf()), (leaf(), leaf())]
    if kind == "mq":
        crit = nac_fast.NACMQLoss(P, l2=0.1, backend=backend)
        mom = [(torch.randn(half, D, generator=g).to(device, dtype),
                torch.randn(half, D, generator=g).to(device, dtype)) for _ in range(2)]
        queue = nac_fast.CodeQueue(N, D, device=device, dtype=dtype)

        def step():
            for x in (t for o in outs for t in o):
                x.grad = None
            crit(outs[0], outs[1], mom[0], mom[1], queue).backward()
    else:
        crit = nac_fast.NACLoss(P, backend=backend)

        def step():
            for x in (t for o in outs for t in o):
                x.grad = None
            crit(outs[0], outs[1]).backward()
    return step


def _reference_fn(a, r, noise, queue):
    s = nac_fast.channel_scale(P)
    if queue is None:
        return reference.nac_loss_reference(a, r, noise, s)
    return reference.nac_mq_loss_reference(a, r, queue, noise, s, l2=0.1)


def compiled_step(kind, n, N, D, dtype, device, backend_name="inductor", fn=None,
                  noise_inside: bool = True):
    """torch.compile of the reference (`fn`: one compiled already), noise drawn outside it by
    the loss's own call (noise_inside=False: once, for the graph rows).  Returns (step, fn)."""
    if fn is None:
        torch._dynamo.reset()
        fn = torch.compile(_reference_fn, backend=backend_name, fullgraph=True, dynamic=False)
    a, r, queue = _inputs(kind, n, N, D, dtype, device)
    fixed = None if noise_inside else nac_fast.draw_noise((n, D), P, device=device, dtype=dtype)

    def step():
        a.grad = None
        if r.requires_grad:
            r.grad = None
        noise = fixed if fixed is not None else nac_fast.draw_noise((n, D), P, device=a.device,
                                                                    dtype=dtype)
        fn(a, r, noise, queue).backward()
    return step, fn


@contextlib.contextmanager
def op_path():
    """The path of every eager call before the plan cache: the registered ops (torch.library
    dispatch and autograd) with each call's plan built afresh and launched through `run`."""
    from nac_fast.kernels import nac_noise_triton, nac_triton
    from nac_fast.ops import noise
    mods = (nac, nac_triton, nac_noise_triton, noise)
    names = ("_eager_real", "eager_real", "eager_real", "eager_real")
    saved = [getattr(m, nm) for m, nm in zip(mods, names)]
    for m, nm in zip(mods, names):
        setattr(m, nm, lambda t: False)
    try:
        yield
    finally:
        for m, nm, v in zip(mods, names, saved):
            setattr(m, nm, v)


# ---------------------------------------------------------------------------------------------
# --stub: no GPU
# ---------------------------------------------------------------------------------------------

class StubLaunches:
    """Kernel launches replaced by no-ops at the compiled kernel's launcher, the plans made for
    sm_90, their scratch kept and the noise's seed drawn on the host as on a GPU outside graph
    capture (kernels/launch.py, nac_fast/ops/noise.py host_seed: here from a counter, through the
    same mix), and backend="auto" resolving as on a GPU (triton for the loss and the noise).
    Counts the launches."""

    def __init__(self):
        self.launches = 0

    def __enter__(self):
        from nac_fast.kernels import launch, nac_noise_triton, nac_triton
        self._saved = [(launch, "direct_launches", launch.direct_launches),
                       (nac_noise_triton, "run", nac_noise_triton.run),
                       (launch, "_first_launch", launch._first_launch),
                       (launch, "_stream", launch._stream),
                       (launch, "_keeps_scratch", launch._keeps_scratch),
                       (launch, "run", launch.run),
                       (nac_triton, "run", nac_triton.run),
                       (nac_triton, "target_of", nac_triton.target_of),
                       (dispatch, "_auto", dispatch._auto),
                       (loss_mod, "host_seed", loss_mod.host_seed)]
        stub = self

        def noop(*args):
            stub.launches += 1

        def run_stub(launches):  # the uncached path's launcher (wrap_triton -> JITFunction.run)
            stub.launches += sum(1 for L in launches if all(g > 0 for g in L.grid))

        launch.direct_launches = lambda device: True
        launch._first_launch = lambda L: (noop(), (noop, 0, None))[1]
        launch._stream = lambda index: 0
        launch._keeps_scratch = lambda device: launch.KEEP_SCRATCH
        from nac_fast.ops.noise import mix_seed
        offset = [0]

        def host_seed(device, generator=None):
            offset[0] += 4
            return mix_seed(12345, offset[0])

        loss_mod.host_seed = host_seed
        launch.run = run_stub
        nac_triton.run = run_stub
        nac_noise_triton.run = run_stub
        nac_triton.target_of = lambda device: launch.SM90
        dispatch._auto = lambda t, op, keys, avail: ("triton", "probe: as on a GPU")
        # plans cached under another stub would launch that stub's counter: start afresh
        for cache in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS, nac_noise_triton.PLANS):
            cache.clear()
        self._checks = loss_mod.value_checks(False)  # as on GPU tensors: no data-reading checks
        self._checks.__enter__()
        return self

    def __exit__(self, *exc):
        self._checks.__exit__(*exc)
        for mod, name, val in self._saved:
            setattr(mod, name, val)
        return False


_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
              "narrow", "as_strided", "detach", "alias", "empty", "empty_like", "empty_strided",
              "new_empty", "new_empty_strided", "unsqueeze", "squeeze", "reshape", "_to_copy_noop",
              "lift_fresh", "is_same_size", "_reshape_alias", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "_local_scalar_dense", "set_", "resize_",
              "split", "unbind", "clone_noop", "_has_compatible_shallow_copy_type"}


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple, dict)):
        for y in (x.values() if isinstance(x, dict) else x):
            yield from _tensors(y)


class AtenLaunches:
    """Counts the ATen ops of a call that would launch a kernel on a GPU (views, allocations and
    metadata ops launch none: _NO_KERNEL), the call still taking its eager path:
    a dispatch mode records them, and the eager-path test (dispatch.eager_real: no mode on the
    stack) is told the stack is empty while it does."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.ops: list = []
        self.allocs = 0  # tensors with memory of their own made by the call's ATen ops

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if func.namespace == "aten" and name not in _NO_KERNEL:
                    counter.ops.append(name)
                out = func(*args, **(kwargs or {}))
                seen = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))
                        if t.device.type != "meta"}
                counter.allocs += sum(1 for t in _tensors(out) if t.numel() and
                                      t.untyped_storage().data_ptr() not in seen)
                return out

        self._mode = Mode()

    def __enter__(self):
        self._saved = torch._C._len_torch_dispatch_stack
        torch._C._len_torch_dispatch_stack = lambda: 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        torch._C._len_torch_dispatch_stack = self._saved
        return False


def _per_call(step, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call of `calls` calls (after 3 warm-ups)."""
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _folding(backend: str):
    """The context a backend row runs in: "triton-unfolded" is the Triton backend with the
    row-wise tails as launches of their own (NAC_FAST_FOLD=0: the finish, and in-batch the rows'
    backward), the A/B of kernels/nac_triton.py `folding`; the others as the environment says."""
    from nac_fast.kernels import nac_triton
    return nac_triton.fold(False) if backend == "triton-unfolded" else contextlib.nullcontext()


def _call_backend(backend: str) -> str:
    return "triton" if backend == "triton-unfolded" else backend


def stub_rows(calls: int = 200, repeats: int = 5):
    """The --stub measurement: rows of microseconds per call (see the module docstring)."""
    from nac_fast.kernels import nac_triton
    rows = []
    cases = [("inbatch", 512, 512, 128, torch.bfloat16), ("mq", 256, 4096, 128, torch.bfloat16)]
    for kind, n, N, D, dtype in cases:
        for backend in ("triton", "triton-unfolded", "triton-op-path"):
            with StubLaunches() as stub, (op_path() if backend.endswith("op-path")
                                          else contextlib.nullcontext()), _folding(backend):
                step = user_step(kind, n, N, D, dtype, "cpu", "triton")
                step()  # records the plans
                step()  # their first call: the kept scratch is made
                before = nac_triton.FWD_PLANS.recorded + nac_triton.BWD_PLANS.recorded
                stub.launches = 0
                with AtenLaunches() as aten:
                    step()
                per_call_launches = stub.launches
                t = _per_call(step, calls, repeats)
                rebuilt = nac_triton.FWD_PLANS.recorded + nac_triton.BWD_PLANS.recorded - before
            rows.append(dict(mode="stub-sm90", kind=kind, n=n, N=N, D=D, dtype=str(dtype)[6:],
                             backend=backend, resolved="triton", host_s=t,
                             launches=per_call_launches, aten_launches=len(aten.ops),
                             allocations=aten.allocs,
                             aten_ops=" ".join(aten.ops),
                             plans_recorded=rebuilt if backend != "triton-op-path" else "",
                             status="ok"))
    # the criteria (nn.Module) around the same fused loss: what their glue adds
    for kind, n, N, D, dtype in cases:
        with StubLaunches() as stub:
            step = criterion_step(kind, n, N, D, dtype, "cpu", "triton")
            step()
            step()
            stub.launches = 0
            with AtenLaunches() as aten:
                step()
            per_call_launches = stub.launches
            t = _per_call(step, calls, repeats)
        rows.append(dict(mode="stub-sm90", kind=kind, n=n, N=N, D=D, dtype=str(dtype)[6:],
                         backend="triton-criterion", resolved="triton", host_s=t,
                         launches=per_call_launches, aten_launches=len(aten.ops),
                         allocations=aten.allocs, aten_ops=" ".join(aten.ops), status="ok"))
    # the CPU backend's own overhead: a tiny shape, its kernel's work negligible
    with loss_mod.value_checks(False):
        for kind, n, N, D in (("inbatch", 4, 4, 8), ("mq", 4, 16, 8)):
            for backend in ("cpu", "cpu-op-path", "reference"):
                with (op_path() if backend.endswith("op-path") else contextlib.nullcontext()):
                    step = user_step(kind, n, N, D, torch.float32, "cpu",
                                     backend.replace("-op-path", ""))
                    t = _per_call(step, calls, repeats)
                rows.append(dict(mode="cpu", kind=kind, n=n, N=N, D=D, dtype="float32",
                                 backend=backend, resolved=backend.replace("-op-path", ""),
                                 host_s=t, status="ok"))
    return rows


# ---------------------------------------------------------------------------------------------
# --gpu
# ---------------------------------------------------------------------------------------------

HOST_CALLS = 48  # under the GPU's launch queue (about 1,000 launches) at ~10 launches a call


REPEATS = 3


def _host_and_back_to_back(step, calls: int | None = None, repeats: int | None = None):
    """(host_s, back_to_back_s) per call, medians over `repeats` runs.  host_s: HOST_CALLS calls
    issued from an idle GPU, host clock only (so few that the launch queue never fills and blocks
    the host: the host's own time even where the GPU work is longer); back_to_back_s: `calls`
    calls and the sync after them, per call."""
    calls = CALLS if calls is None else calls
    repeats = REPEATS if repeats is None else repeats
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(min(calls, HOST_CALLS)):
            step()
        host.append((time.perf_counter() - t0) / min(calls, HOST_CALLS))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        total.append((time.perf_counter() - t0) / calls)
    return statistics.median(host), statistics.median(total)


def _graph_time(step) -> float:
    from bench_loss import graph_step
    from triton.testing import do_bench
    replay = graph_step(step)
    return do_bench(replay, warmup=25, rep=200, return_mode="median") / 1e3


def gpu_rows(cases, backends, compile_backend: str = "inductor", graphs: bool = True,
             device: str = "cuda"):
    """The --gpu rows (`device` other than cuda: the tests' CPU run of this code, with the CUDA
    calls stood in)."""
    rows = []
    for kind, n, N, dname in cases:
        D, dtype = 128, getattr(torch, dname)
        for backend in backends:
            if backend == "triton-unfolded" and dname != "bfloat16":
                continue  # the fold's A/B at the bf16 shapes (the host stage's time)
            row = dict(mode="gpu", kind=kind, n=n, N=N, D=D, dtype=dname, backend=backend)
            try:
                if backend == "compiled-reference":
                    step, cfn = compiled_step(kind, n, N, D, dtype, device, compile_backend)
                    graph_step_fn = lambda: compiled_step(  # noqa: E731
                        kind, n, N, D, dtype, device, fn=cfn, noise_inside=False)[0]
                    row["resolved"] = f"torch.compile({compile_backend})"
                else:
                    call = _call_backend(backend)
                    step = user_step(kind, n, N, D, dtype, device, call)
                    graph_step_fn = lambda: user_step(  # noqa: E731
                        kind, n, N, D, dtype, device, call, noise_inside=False)
                    row["resolved"] = (dispatch.resolve_backend(
                        "auto", torch.empty(1, device=device, dtype=dtype),
                        keys=None if kind == "inbatch" else torch.empty(1, 1, device=device))
                        if backend == "auto" else call)
                with _folding(backend):
                    host, total = _host_and_back_to_back(step)
                row.update(host_s=host, back_to_back_s=total, status="ok")
                if graphs:
                    try:
                        # fresh inputs (their autograd nodes made on the capture's side stream)
                        # and the noise given: no RNG inside the capture
                        with _folding(backend):
                            row["graph_s"] = _graph_time(graph_step_fn())
                    except Exception as exc:  # the row's other figures stand; the note says why
                        row["status"] = (f"ok (no graph: {type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0][:120] if str(exc) else ''})")
                        torch.cuda.synchronize()
                    else:
                        bnd = _bound(kind, n, N, D, dname)
                        if bnd is not None:
                            row.update(bound_s=bnd, pct_of_bound=100.0 * bnd / row["graph_s"])
            except Exception as exc:  # a failed row is recorded and fails the run
                row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            finally:
                if backend == "compiled-reference":
                    torch._dynamo.reset()
            rows.append(row)
            print(_fmt(row), flush=True)
            torch.cuda.empty_cache()
    # ratios of each row to eager (reference) and torch.compile at its case, per call as a loop
    # sees it (back_to_back_s)
    for row in rows:
        case = ("kind", "n", "N", "dtype")
        same = [r for r in rows if all(r[k] == row[k] for k in case) and _ok(r)]
        base = {r["backend"]: r["back_to_back_s"] for r in same}
        if _ok(row):
            if "reference" in base:
                row["x_eager"] = base["reference"] / row["back_to_back_s"]
            if "compiled-reference" in base:
                row["x_compile"] = base["compiled-reference"] / row["back_to_back_s"]
    return rows


CRITERION_CASES = (("inbatch", 512, 512), ("mq", 256, 65536))  # a training step's sizes, bf16


def criterion_rows(device: str = "cuda", cases=CRITERION_CASES, dname: str = "bfloat16"):
    """--gpu: the nn.Module criteria as a training loop calls them (`criterion_step`: NACLoss on
    two views, NACMQLoss with its queue, enqueue and VI term), host and back-to-back time per
    step, the reference criterion (backend "reference": torch ops throughout, the queue's too)
    against "auto" (the fused loss and the fused enqueue).  No graph row: the criterion draws
    its noise and writes the queue."""
    rows = []
    dtype = getattr(torch, dname)
    for kind, n, N in cases:
        base = None
        for backend in ("reference", "auto"):
            row = dict(mode="gpu", kind=kind, n=n, N=N, D=128, dtype=dname,
                       backend=f"criterion-{backend}", resolved=backend)
            try:
                host, total = _host_and_back_to_back(
                    criterion_step(kind, n, N, 128, dtype, device, backend))
                row.update(host_s=host, back_to_back_s=total, status="ok")
                if backend == "reference":
                    base = total
                elif base:
                    row["x_eager"] = base / total
            except Exception as exc:  # a failed row is recorded and fails the run
                row["status"] = (f"failed: {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


class _OneEachWay(torch.autograd.Function):
    """The least a fused loss can launch: one kernel forward (a sum), one backward (the expanded
    gradient, materialised)."""

    @staticmethod
    def forward(ctx, a):
        ctx.shape = a.shape
        return a.sum()

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape).contiguous()


def floor_rows(device: str = "cuda", n: int = 512, D: int = 128):
    """The host floor of this machine (kind "floor"), timed as the loss rows are:
      floor-launch    one ATen kernel launch on a tiny tensor (x.add_(1)): no allocation
      floor-autograd  _OneEachWay on a fresh leaf of (n, D) bf16, then backward(): the forward's
                      and the backward's launch, autograd's ones_like, three allocations, the
                      autograd engine (on a GPU: its device thread) - the least any fused loss
                      called through autograd costs the host here"""
    x = torch.zeros(4, device=device)
    a = torch.randn(n, D, device=device).to(torch.bfloat16)

    def launch():
        x.add_(1.0)

    def autograd_step():
        _OneEachWay.apply(a.detach().requires_grad_()).backward()

    rows = []
    for name, step in (("floor-launch", launch), ("floor-autograd", autograd_step)):
        row = dict(mode="gpu", kind="floor", n=n, N=0, D=D, dtype="bfloat16", backend=name,
                   resolved=name)
        try:
            host, total = _host_and_back_to_back(step)
            row.update(host_s=host, back_to_back_s=total, status="ok")
        except Exception as exc:  # recorded, and fails the run
            row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _ok(row) -> bool:
    """A measured row (its graph replay may have failed: "ok (no graph: ...)")."""
    return str(row.get("status", "ok")).startswith("ok")


def _bound(kind, n, N, D, dname):
    """The time floor of the case on this GPU (common.bound, the kernels' fp32 mode), or
    None on a GPU it does not know.  The queue rows' r_hat takes no gradient: its bytes are
    counted all the same (a few percent of a floor that is matrix-bound)."""
    import common
    name = torch.cuda.get_device_name()
    if not common.known_gpu(name):
        return None
    from nac_fast.kernels.nac_triton import fp32_mode_of
    kname = "queue" if kind == "mq" else "inbatch"
    return common.bound(kname, n, N, D, dname, name,
                          fp32_mode=fp32_mode_of(D, kname, n, N, "cuda"))["bound_s"]


def profile_triton(path: str) -> None:
    step = user_step("inbatch", 8192, 8192, 128, torch.bfloat16, "cuda", "triton")
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        step()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
    with open(path, "w") as f:
        f.write("cProfile of 100 triton fwd+bwd, in-batch 8192 x 128 bf16 (as users call it)\n")
        f.write(out.getvalue())


# ---------------------------------------------------------------------------------------------

def _fmt(row) -> str:
    def us(k):
        v = row.get(k)
        return f"{v * 1e6:9.1f}" if isinstance(v, float) else f"{'':>9s}"
    x = lambda k: f"{row[k]:6.2f}" if isinstance(row.get(k), float) else f"{'':>6s}"  # noqa: E731
    return (f"{row['mode']:9s} {row['kind']:8s} {row['n']:6d} {row['N']:6d} "
            f"{row['dtype'][:5]:5s} {row['backend']:19s}"
            f"{us('host_s')} {us('back_to_back_s')} {us('graph_s')} {x('x_eager')} "
            f"{x('x_compile')} {_launches(row):>12s} {row.get('status', '')}")


def _launches(row) -> str:
    """Triton launches, + the ATen ones where counted (--stub), / the allocations."""
    t, a = row.get("launches", ""), row.get("aten_launches", "")
    return (f"{t}+{a}/{row.get('allocations', '')}" if a != "" else str(t))


HEADER = (f"{'mode':9s} {'kind':8s} {'n':>6s} {'N':>6s} {'dtype':5s} {'backend':19s}{'host us':>9s} "
          f"{'b2b us':>9s} {'graph us':>9s} {'x eag':>6s} {'x cmp':>6s} {'launch/alloc':>12s}")


def goals(rows) -> list[str]:
    """Issue 37's goals against the GPU rows (PASS/MISS lines)."""
    want = {("inbatch", 8192): (3.0, 1.5), ("mq", 8192): (5.0, 1.8), ("mq", 256): (2.0, None),
            ("inbatch", 512): (2.0, None)}
    out = []
    floor = {r["backend"]: r["host_s"] for r in rows if r.get("kind") == "floor" and _ok(r)}
    if floor:
        out.append("floor of this host: "
                   + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in floor.items())
                   + " (floor-autograd: the least a loss called through autograd costs it; the "
                   "60 us goal is " + ("below" if floor.get("floor-autograd", 0) > 60e-6 else
                                       "above") + " it)")
    for row in rows:
        if row.get("kind") == "floor":
            continue
        if row.get("mode") != "gpu" or not _ok(row):
            continue
        if row["backend"] in ("triton", "cuda", "auto") and row["dtype"] == "bfloat16":
            case = (row["kind"], row["n"])
            if case in want:
                ge, gc = want[case]
                xe = row.get("x_eager")
                ok = xe is not None and xe >= ge
                line = f"{'PASS' if ok else 'MISS'} {row['kind']} {row['n']}x{row['N']} {row['backend']}: {xe or 0:.2f}x eager (goal >= {ge}x)"
                if gc is not None:
                    xc = row.get("x_compile")
                    ok2 = xc is not None and xc >= gc
                    line += f"; {'PASS' if ok2 else 'MISS'} {xc or 0:.2f}x torch.compile (goal >= {gc}x)"
                out.append(line)
            if row["backend"] in ("triton", "cuda"):
                host = row["host_s"] * 1e6
                out.append(f"{'PASS' if host <= 60 else 'MISS'} host time {row['kind']} "
                           f"{row['n']}x{row['N']} {row['backend']}: {host:.1f} us per fwd+bwd "
                           "(goal <= 60 us)")
    out += fold_lines(rows)
    return out


def fold_lines(rows) -> list[str]:
    """The fold's A/B (docs/gpu.md "The row-wise tails folded"): per case, the triton row
    (tails folded) against triton-unfolded (NAC_FAST_FOLD=0) in host, back-to-back and graph
    time, folded minus unfolded in us (negative: the fold is faster)."""
    out = []
    by = {(r["kind"], r["n"], r["N"], r["dtype"], r["backend"]): r for r in rows
          if r.get("mode") == "gpu" and _ok(r)}
    for (kind, n, N, dname, backend), f in by.items():
        u = by.get((kind, n, N, dname, "triton-unfolded"))
        if backend != "triton" or u is None:
            continue
        parts = [f"{k[:-2]} {(f[k] - u[k]) * 1e6:+.1f} us ({f[k] * 1e6:.1f} vs {u[k] * 1e6:.1f})"
                 for k in ("host_s", "back_to_back_s", "graph_s")
                 if isinstance(f.get(k), float) and isinstance(u.get(k), float)]
        out.append(f"fold {kind} {n}x{N} {dname}: " + "; ".join(parts))
    return out


def _commit() -> str:
    from common import commit
    return commit()


def write_csv(path: str, rows) -> None:
    from common import append_rows
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    try:
        import triton
        tv = triton.__version__
    except Exception:
        tv = ""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    common = dict(timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  host=socket.gethostname(), device=dev, torch=torch.__version__, triton=tv,
                  commit=_commit())
    out = []
    for row in rows:
        r = dict(common, **row)
        for k in ("host_s", "back_to_back_s", "graph_s", "bound_s"):
            if isinstance(r.get(k), float):
                r[k] = f"{r[k]:.9f}"
        for k in ("x_eager", "x_compile", "pct_of_bound"):
            if isinstance(r.get(k), float):
                r[k] = f"{r[k]:.3f}"
        out.append(r)
    append_rows(path, out, FIELDS)


GPU_BACKENDS = "reference,compiled-reference,triton,triton-unfolded,cuda,auto"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="measure on the CUDA GPU")
    mode.add_argument("--stub", action="store_true", help="no GPU: launches stubbed (default)")
    ap.add_argument("--csv", default=None, help="append the rows to this CSV")
    ap.add_argument("--calls", type=int, default=CALLS, help="calls per timing (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="--stub: timings per row (median)")
    ap.add_argument("--backends", default=None,
                    help="--gpu: comma list (default: " + GPU_BACKENDS + "; triton-unfolded: "
                    "triton with NAC_FAST_FOLD=0)")
    ap.add_argument("--cases", default=None,
                    help="--gpu: kind:n:N:dtype,... (default: bf16 in-batch 512 and 8192, queue "
                    "256 and 8192 x 65536; fp32 in-batch 8192 and queue 256 x 65536)")
    ap.add_argument("--no-graphs", action="store_true", help="--gpu: skip the CUDA-graph rows")
    ap.add_argument("--compile-backend", default=None,
                    help="--gpu: torch.compile backend of the compiled-reference rows (inductor)")
    ap.add_argument("--profile-out", default=None, help="--gpu: cProfile of 100 triton calls")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats must be >= 1")
    if not args.gpu:  # the --gpu options are not silently ignored
        for flag in ("--backends", "--cases", "--no-graphs", "--compile-backend", "--profile-out"):
            if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
                ap.error(f"{flag} is an option of --gpu (the stubbed run has no such choice)")
    elif not torch.cuda.is_available():
        ap.error("--gpu but no GPU is visible")
    from common import check_output_file
    if args.csv:  # a folder, a path under a file, an unwritable place: before any timing
        check_output_file(ap, "--csv", args.csv)
    if args.profile_out:
        check_output_file(ap, "--profile-out", args.profile_out, csv_file=False)
    print(HEADER)
    if args.gpu:
        args.backends = args.backends or GPU_BACKENDS
        args.compile_backend = args.compile_backend or "inductor"
        cases = GPU_CASES
        if args.cases:
            try:
                cases = [(k, int(n), int(N), d) for k, n, N, d in
                         (c.split(":") for c in args.cases.split(","))]
            except ValueError:
                ap.error(f"--cases must be kind:n:N:dtype,..., got {args.cases!r}")
            for k, n, N, d in cases:
                if k not in ("inbatch", "mq"):
                    ap.error(f"--cases: kind must be inbatch or mq, got {k!r}")
                if d not in ("bfloat16", "float16", "float32", "float64"):
                    ap.error(f"--cases: dtype must be bfloat16, float16, float32 or float64, got {d!r}")
                if n < 1 or N < 1:
                    ap.error("--cases: n and N must be >= 1")
        avail = nac_fast.available_backends("cuda")
        backends = []
        for b in args.backends.split(","):
            if b not in ("compiled-reference", "auto") and _call_backend(b) not in avail:
                print(f"skipping backend {b!r}: not available ({avail})")
                continue
            backends.append(b)
        rows = floor_rows() + gpu_rows(cases, backends, args.compile_backend,
                                       not args.no_graphs) + criterion_rows()
        if args.profile_out and "triton" in avail:
            profile_triton(args.profile_out)
    else:
        # one thread: a tiny op's OpenMP region waits for a second core that other processes may
        # hold (12 ms per log_sigmoid of 4 x 8 on a loaded 2-core machine, against 1.5 us)
        torch.set_num_threads(1)
        rows = stub_rows(args.calls, args.repeats)
        for row in rows:
            print(_fmt(row))
    if args.csv:
        write_csv(args.csv, rows)
        print(f"appended {len(rows)} rows to {args.csv}")
    lines = goals(rows)
    for line in lines:
        print(line)
    print(json.dumps({"rows": [{k: v for k, v in r.items()} for r in rows]}, default=str))
    return 0 if all(_ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
