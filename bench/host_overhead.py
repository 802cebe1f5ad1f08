"""Host time of one fused NAC forward+backward as a training loop calls it (issue 37).

    python bench/host_overhead.py                      # no GPU: the Python side, launches stubbed
    python bench/host_overhead.py --gpu --csv bench/results/<gpu>_<date>/host_gpu.csv

Rows, columns and method: docs/kernels.md "The benchmark scripts in detail".
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import sys
import types
from unittest import mock

if "--gpu" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors reach the op

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the source tree on sys.path)

import torch  # noqa: E402

import nac_fast  # noqa: E402
from bench_loss import (P, case_bound, compile_reference, failure, graph_step,  # noqa: E402
                        make_step, mean_time)
from nac_fast.ops import dispatch, loss as loss_mod  # noqa: E402

FIELDS = ["timestamp", "host", "device", "torch", "triton", "commit", "mode", "kind", "n", "N",
          "D", "dtype", "backend", "resolved", "host_s", "back_to_back_s", "graph_s",
          "launches", "plans_recorded", "x_eager", "x_compile", "status",
          "aten_launches", "aten_ops", "allocations", "bound_s", "pct_of_bound"]
GPU_CASES = [("inbatch", 512, 512, "bfloat16"), ("inbatch", 8192, 8192, "bfloat16"),
             ("mq", 256, 65536, "bfloat16"), ("mq", 8192, 65536, "bfloat16"),
             ("inbatch", 8192, 8192, "float32"), ("mq", 256, 65536, "float32")]
GPU_BACKENDS = "reference,compiled-reference,triton,cuda,auto"
CALLS, REPEATS = 200, 3
HOST_CALLS = 48  # under the GPU's launch queue (about 1,000 launches) at ~10 launches a call


# one fwd+bwd as users call it: the noise drawn inside, r_hat without a gradient
user_step = functools.partial(make_step, noise_inside=True, r_grad=False)


def criterion_step(kind, n, N, D, dtype, device, backend):
    """NACLoss on two views of n/2 rows, or NACMQLoss with its CodeQueue of N codes: one step."""
    half, g = max(1, n // 2), torch.Generator(device="cpu").manual_seed(n + N)
    rand = lambda: torch.randn(half, D, generator=g).to(device, dtype)  # noqa: E731
    outs = [(rand().requires_grad_(), rand().requires_grad_()) for _ in range(2)]
    if kind == "mq":
        crit = nac_fast.NACMQLoss(P, l2=0.1, backend=backend)
        mom = [(rand(), rand()) for _ in range(2)]
        queue = nac_fast.CodeQueue(N, D, device=device, dtype=dtype)
        call = lambda: crit(outs[0], outs[1], mom[0], mom[1], queue)  # noqa: E731
    else:
        crit = nac_fast.NACLoss(P, backend=backend)
        call = lambda: crit(outs[0], outs[1])  # noqa: E731

    def step():
        for x in (t for o in outs for t in o):
            x.grad = None
        call().backward()
    return step


def patched(patches) -> contextlib.ExitStack:
    """setattr(module, name, value) for each of `patches` now, undone when the stack closes."""
    stack = contextlib.ExitStack()
    for m, name, val in patches:
        stack.enter_context(mock.patch.object(m, name, val))
    return stack


# ---- --stub: no GPU ------------------------------------------------------------------------------

@contextlib.contextmanager
def stub_launches():
    """The --stub machine (docs/kernels.md "The benchmark scripts in detail"): launches counted
    (.launches), not run; sm_90 plans; the seed, "auto" and value checks as on a GPU."""
    from nac_fast.kernels import launch, nac_noise_triton, nac_triton
    from nac_fast.ops.noise import mix_seed
    stub, offset = types.SimpleNamespace(launches=0), [0]

    def noop(*args):
        stub.launches += 1

    def run_stub(launches):  # the uncached path's launcher (wrap_triton -> JITFunction.run)
        stub.launches += sum(1 for L in launches if all(g > 0 for g in L.grid))

    def host_seed(device, generator=None):
        offset[0] += 4
        return mix_seed(12345, offset[0])
    with patched([(launch, "direct_launches", lambda device: True),
                  (launch, "_first_launch", lambda L: (noop(), (noop, 0, None))[1]),
                  (launch, "_stream", lambda index: 0),
                  (launch, "_keeps_scratch", lambda device: launch.KEEP_SCRATCH),
                  (loss_mod, "host_seed", host_seed), (launch, "run", run_stub),
                  (nac_triton, "run", run_stub), (nac_noise_triton, "run", run_stub),
                  (nac_triton, "target_of", lambda device: launch.SM90),
                  (dispatch, "_auto", lambda t, op, keys, avail: ("triton", "probe: as on a GPU"))]):
        # plans cached under another stub would launch that stub's counter: start afresh
        for cache in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS, nac_noise_triton.PLANS):
            cache.clear()
        with loss_mod.value_checks(False):
            yield stub


_NO_KERNEL = set("""view _unsafe_view t transpose permute expand slice select narrow as_strided
    detach alias empty empty_like empty_strided new_empty new_empty_strided unsqueeze squeeze
    reshape _to_copy_noop lift_fresh is_same_size _reshape_alias sym_size sym_stride sym_numel
    sym_storage_offset _local_scalar_dense set_ resize_ split unbind clone_noop
    _has_compatible_shallow_copy_type""".split())


@contextlib.contextmanager
def aten_launches():
    """The ATen ops that would launch a GPU kernel (.ops) and the tensors they allocate (.allocs);
    the eager-path test is told the dispatch stack is empty meanwhile."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    tensors = lambda x: [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]  # noqa: E731
    counter = types.SimpleNamespace(ops=[], allocs=0)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if func.namespace == "aten" and name not in _NO_KERNEL:
                counter.ops.append(name)
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs))
                    if t.device.type != "meta"}
            counter.allocs += sum(1 for t in tensors(out) if t.numel() and
                                  t.untyped_storage().data_ptr() not in seen)
            return out
    with patched([(torch._C, "_len_torch_dispatch_stack", lambda: 0)]), Mode():
        yield counter


def _per_call(step, calls: int, repeats: int = 5, sync=None, after: bool = False) -> float:
    """Median over `repeats` of the mean seconds per call of `calls` calls (after 3 warm-ups;
    bench_loss.mean_time's `sync` before them, and after when `after`)."""
    for _ in range(3):
        step()
    return statistics.median(mean_time(step, calls, sync, after) for _ in range(repeats))


def _stub_row(kind, n, N, backend, calls, repeats):
    """One --stub row (bf16, D = 128): launches, allocations, time, plans a further call records."""
    from nac_fast.kernels import nac_triton
    plans = lambda: nac_triton.FWD_PLANS.recorded + nac_triton.BWD_PLANS.recorded  # noqa: E731
    make = criterion_step if backend == "triton-criterion" else user_step
    with stub_launches() as stub:
        step = make(kind, n, N, 128, torch.bfloat16, "cpu", "triton")
        step()  # records the plans
        step()  # their first call: the kept scratch is made
        before, stub.launches = plans(), 0
        with aten_launches() as aten:
            step()
        launches, t = stub.launches, _per_call(step, calls, repeats)
        rebuilt = plans() - before
    return dict(mode="stub-sm90", kind=kind, n=n, N=N, D=128, dtype="bfloat16",
                backend=backend, resolved="triton", host_s=t, launches=launches,
                aten_launches=len(aten.ops), allocations=aten.allocs, aten_ops=" ".join(aten.ops),
                plans_recorded="" if backend == "triton-criterion" else rebuilt,
                status="ok")


def stub_rows(calls: int = 200, repeats: int = 5):
    # the fused loss as users call it and in its criterion (nn.Module)
    rows = [_stub_row(*case, backend, calls, repeats)
            for case in (("inbatch", 512, 512), ("mq", 256, 4096))
            for backend in ("triton", "triton-criterion")]
    with loss_mod.value_checks(False):  # the CPU backend's own overhead: a tiny shape
        for (kind, n, N), b in itertools.product((("inbatch", 4, 4), ("mq", 4, 16)),
                                                 ("cpu", "reference")):
            t = _per_call(user_step(kind, n, N, 8, torch.float32, "cpu", b), calls, repeats)
            rows.append(dict(mode="cpu", kind=kind, n=n, N=N, D=8, dtype="float32", backend=b,
                             resolved=b, host_s=t, status="ok"))
    return rows


# ---- --gpu ---------------------------------------------------------------------------------------

def _graph_time(step) -> float:
    from triton.testing import do_bench
    return do_bench(graph_step(step), warmup=25, rep=200, return_mode="median") / 1e3


def _bound(kind, n, N, D, dname):
    """The case's floor in seconds on this GPU (bench_loss.case_bound), or None."""
    b = case_bound(kind, n, N, D, getattr(torch, dname), "cuda", torch.cuda.get_device_name())[1]
    return None if b is None else b["bound_s"]


def _measured(row, make, graph=None):
    """`row` with host_s, back_to_back_s of make()'s step (medians over REPEATS of HOST_CALLS
    calls from an idle GPU, host clock only, and of CALLS calls and the sync after them), graph_s
    of graph()'s (fresh inputs, noise given) and its bound; status ok, "ok (no graph: ...)" or
    "failed: ..." (fails the run)."""
    try:
        step, sync = make(), torch.cuda.synchronize
        row.update(host_s=_per_call(step, min(CALLS, HOST_CALLS), REPEATS, sync),
                   back_to_back_s=_per_call(step, CALLS, REPEATS, sync, True), status="ok")
        if graph is not None:
            try:
                row["graph_s"] = _graph_time(graph())
            except Exception as exc:  # the row's other figures stand; the note says why
                row["status"] = f"ok (no graph: {failure(exc, 120)})"
                torch.cuda.synchronize()
        if "graph_s" in row and (bnd := _bound(*map(row.get, ("kind", "n", "N", "D", "dtype")))):
            row.update(bound_s=bnd, pct_of_bound=100.0 * bnd / row["graph_s"])
    except Exception as exc:  # a failed row is recorded and fails the run
        row["status"] = "failed: " + failure(exc, 200)
    finally:
        if row["backend"] == "compiled-reference":
            torch._dynamo.reset()
    print(_fmt(row), flush=True)
    torch.cuda.empty_cache()
    return row


def _loss_makers(row, device, compile_backend):
    """(step maker, graph-row step maker) of a --gpu loss row; make() records row["resolved"]."""
    kind, backend, dtype = row["kind"], row["backend"], getattr(torch, row["dtype"])
    case, fn = (kind, row["n"], row["N"], row["D"], dtype, device), []

    def make():
        if backend == "compiled-reference":
            fn.append(compile_reference(compile_backend)[0])
            row["resolved"] = f"torch.compile({compile_backend})"
            return user_step(*case, "reference", fn[0])
        row["resolved"] = backend if backend != "auto" else dispatch.resolve_backend(
            "auto", torch.empty(1, device=device, dtype=dtype),
            keys=None if kind == "inbatch" else torch.empty(1, 1, device=device))
        return user_step(*case, backend)

    def graph():  # the noise drawn once, before the capture
        return user_step(*case, "reference" if fn else backend, *fn[:1], noise_inside=False)
    return make, graph


def gpu_rows(cases, backends, compile_backend: str = "inductor", graphs: bool = True,
             device: str = "cuda"):
    """The --gpu loss rows (`device` other than cuda: the tests' run, CUDA calls stood in), with
    x_eager, x_compile: the case's reference, compiled-reference back-to-back time / the row's."""
    rows = []
    for (kind, n, N, dname), backend in itertools.product(cases, backends):
        row = dict(mode="gpu", kind=kind, n=n, N=N, D=128, dtype=dname, backend=backend)
        make, graph = _loss_makers(row, device, compile_backend)
        rows.append(_measured(row, make, graph if graphs else None))
    for row in filter(_ok, rows):
        for col, b in (("x_eager", "reference"), ("x_compile", "compiled-reference")):
            if base := [r["back_to_back_s"] for r in rows if _ok(r) and r["backend"] == b and
                        all(r[k] == row[k] for k in ("kind", "n", "N", "dtype"))]:
                row[col] = base[0] / row["back_to_back_s"]
    return rows


def _ok(row) -> bool:
    """A measured row (its graph replay may have failed: "ok (no graph: ...)")."""
    return str(row.get("status", "ok")).startswith("ok")


# ---- output --------------------------------------------------------------------------------------

def _fmt(row) -> str:
    us = lambda k: f"{row[k] * 1e6:9.1f}" if isinstance(row.get(k), float) else " " * 9  # noqa: E731
    x = lambda k: f"{row[k]:6.2f}" if isinstance(row.get(k), float) else " " * 6  # noqa: E731
    t, a = row.get("launches", ""), row.get("aten_launches", "")  # Triton + ATen / allocations
    launches = f"{t}+{a}/{row.get('allocations', '')}" if a != "" else str(t)
    return (f"{row['mode']:9s} {row['kind']:8s} {row['n']:6d} {row['N']:6d} "
            f"{row['dtype'][:5]:5s} {row['backend']:19s}"
            f"{us('host_s')} {us('back_to_back_s')} {us('graph_s')} {x('x_eager')} "
            f"{x('x_compile')} {launches:>12s} {row.get('status', '')}")


HEADER = (f"{'mode':9s} {'kind':8s} {'n':>6s} {'N':>6s} {'dtype':5s} {'backend':19s}{'host us':>9s} "
          f"{'b2b us':>9s} {'graph us':>9s} {'x eag':>6s} {'x cmp':>6s} {'launch/alloc':>12s}")


def goals(rows) -> list[str]:
    """Issue 37's goals against the GPU rows (PASS/MISS lines)."""
    want = {("inbatch", 8192): (3.0, 1.5), ("mq", 8192): (5.0, 1.8), ("mq", 256): (2.0, None),
            ("inbatch", 512): (2.0, None)}  # x eager, x torch.compile
    verdict = lambda x, goal: "PASS" if x is not None and x >= goal else "MISS"  # noqa: E731
    out = []
    for row in rows:
        if row.get("mode") != "gpu" or not _ok(row) or row["dtype"] != "bfloat16":
            continue
        case, tag = (row["kind"], row["n"]), f"{row['kind']} {row['n']}x{row['N']} {row['backend']}"
        if row["backend"] in ("triton", "cuda", "auto") and case in want:
            (ge, gc), xe, xc = want[case], row.get("x_eager"), row.get("x_compile")
            line = f"{verdict(xe, ge)} {tag}: {xe or 0:.2f}x eager (goal >= {ge}x)"
            if gc is not None:
                line += f"; {verdict(xc, gc)} {xc or 0:.2f}x torch.compile (goal >= {gc}x)"
            out.append(line)
        if row["backend"] in ("triton", "cuda"):
            host = row["host_s"] * 1e6
            out.append(f"{'PASS' if host <= 60 else 'MISS'} host time {tag}: {host:.1f} us per "
                       "fwd+bwd (goal <= 60 us)")
    return out


def write_csv(path: str, rows) -> None:
    run = common.run_fields(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    fmt = lambda k, v: (f"{v:.3f}" if k in ("x_eager", "x_compile", "pct_of_bound")  # noqa: E731
                        else f"{v:.9f}") if isinstance(v, float) else v
    common.append_rows(path, [{k: fmt(k, v) for k, v in dict(run, **row).items()} for row in rows],
                       FIELDS)


def _cases(ap, text):
    """--cases kind:n:N:dtype,... checked (a usage error names the flag)."""
    try:
        cases = [(k, int(n), int(N), d) for k, n, N, d in (c.split(":") for c in text.split(","))]
    except ValueError:
        ap.error(f"--cases must be kind:n:N:dtype,..., got {text!r}")
    for k, n, N, d in cases:
        if k not in ("inbatch", "mq") or n < 1 or N < 1 or d not in (
                "bfloat16", "float16", "float32", "float64"):
            ap.error(f"--cases: kind inbatch or mq, n and N >= 1, dtype bfloat16, float16, "
                     f"float32 or float64; got {k}:{n}:{N}:{d}")
    return cases


GPU_FLAGS = {"--backends": dict(help="comma list (default: " + GPU_BACKENDS + ")"),
             "--cases": dict(help="kind:n:N:dtype,... (default: bf16 in-batch 512 and 8192, "
                             "queue 256 and 8192 x 65536; fp32 in-batch 8192, queue 256 x 65536)"),
             "--no-graphs": dict(action="store_true", help="skip the CUDA-graph rows"),
             "--compile-backend": dict(help="torch.compile backend of compiled-reference (inductor)")}


def fused_summary(rows) -> str:
    """The fused backends' host time per forward + backward, the range over the ok rows."""
    best = {}
    for r in rows:
        if r["backend"] in ("triton", "cuda") and _ok(r) and r.get("host_s"):
            best.setdefault(r["backend"], []).append(float(r["host_s"]) * 1e6)
    return "; ".join(f"{b} host {min(v):.0f}-{max(v):.0f} us per fwd+bwd"
                     for b, v in best.items()) or "no fused rows"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="measure on the CUDA GPU")
    mode.add_argument("--stub", action="store_true", help="no GPU: launches stubbed (default)")
    ap.add_argument("--csv", default=None, help="append the rows to this CSV")
    ap.add_argument("--calls", type=int, default=CALLS, help="calls per timing (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="--stub: timings per row (median)")
    for flag, kw in GPU_FLAGS.items():
        ap.add_argument(flag, **dict(kw, help="--gpu: " + kw["help"]))
    args = ap.parse_args(argv)
    common.check_least(ap, args, {"--calls": 1, "--repeats": 1})
    if not args.gpu:  # the --gpu options are not silently ignored
        for flag in GPU_FLAGS:
            if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
                ap.error(f"{flag} is an option of --gpu (the stubbed run has no such choice)")
    elif not torch.cuda.is_available():
        ap.error("--gpu but no GPU is visible")
    if args.csv:  # a folder, a path under a file, an unwritable place: before any timing
        common.check_output_file(ap, "--csv", args.csv)
    cases = _cases(ap, args.cases) if args.cases else GPU_CASES
    print(HEADER)
    if args.gpu:
        avail = nac_fast.available_backends("cuda")
        backends = [b for b in (args.backends or GPU_BACKENDS).split(",")
                    if b in ("compiled-reference", "auto") or b in avail
                    or print(f"skipping backend {b!r}: not available ({avail})")]
        rows = gpu_rows(cases, backends, args.compile_backend or "inductor", not args.no_graphs)
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
    for line in goals(rows):
        print(line)
    print("fused host: " + fused_summary(rows))  # the suite's host stage detail
    print(json.dumps({"rows": rows}, default=str))
    return 0 if all(_ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
