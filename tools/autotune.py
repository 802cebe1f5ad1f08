"""The autotune stage of the GPU suite (issue 38): time every candidate configuration of the
Triton NAC kernels (kernels/nac_triton.py `CANDIDATES`) per (arch, dtype, D, kind, size class),
and write the winners, with the figures that chose them, to a table the launchers read
(kernels/tuning.py; kernels/tuned/sm<arch>.json).

    python tools/autotune.py --out-dir bench/results/<gpu>_<date>_tune          # GPU, <= 150 s
    python tools/autotune.py --out-dir DIR --install      # and copy the table to kernels/tuned/
    python tools/autotune.py --cpu --out-dir /tmp/tune    # CPU mode: interpreter, tiny shapes

What it times, per case (GPU default, D = 128: bf16 in-batch 8192 and 16384, queue 8192 x 65536;
then fp32 in-batch 8192 and queue 8192 x 65536, once in each fp32 product mode with candidates of
its own, tf32x3, bf16x6 and (in-batch) fp16x3: NAC_FAST_FP32_DOT is set per case, whatever the
caller's) and kernel:
  fwd        the forward's plan (prologue, _fwd_kernel with its finish folded in, or the finish
             after it: the finish merges as many splits as the candidate makes) with the rows'
             gradient, as training runs it;
  bwd_keys   the backward's plan from the forward's saved tensors (_bwd_keys_kernel with the
             rows' backward folded in, or the rows' backward or split sums after it); in-batch
             only (the queue takes no gradient).
Each candidate: its launches captured in a CUDA graph, the replays timed by triton.testing.do_bench
(median, p20, p80; L2 flushed between replays), its outputs checked against the built-in
configuration's (norm-wise relative difference; kernels/tuning.py CHECK_TOL), random data.  The
winner is the fastest candidate that passed; the built-in configuration is timed beside it.
Before timing, every distinct kernel the candidates compile to is compiled in parallel processes
(triton.compile into Triton's cache, which the launches then read), so compile time is shared by
the cores.  The stage stops timing new candidates at --budget-s (default 150 s, compile
included) and says which it skipped.

Writes to --out-dir (created; nothing in it is replaced unless --overwrite):
  autotune.csv       one row per candidate and case (host, versions, commit, shape, config,
                     split, programs, median/p20/p80 ms, peak MiB (the buffers the plan
                     allocates; the kernels allocate nothing), ratio to the built-in, check)
  sm<arch>.json      the table (kernels/tuning.py format; CPU mode: cpu_interpreter.json, arch 0)
and prints a short table last.  --install copies sm<arch>.json to kernels/tuned/ (refused when a
table is there, unless --overwrite).

--rows-sweep (after the table): a training step's forward and backward plans (the tuned
configurations) timed with each row tile of the row-wise kernels (prologue, finish, rows'
backward: nac_triton.ROW_TILE elements per program, ROW_TILES) at bf16 in-batch 512 and 8192 and
queue 256 x 65536, each checked bit for bit against the default tile's outputs: rows_sweep.csv.
It measures whether smaller tiles (more programs: run 1's ncu showed the row-wise kernels at ~8
warps per SM) shorten a step; the default changes only on its figures.

CPU mode (no CUDA, or --cpu): TRITON_INTERPRET=1, tiny shapes (in-batch 40, queue 24 x 72, D =
128), at most --max-candidates (default 2) per kernel, a few timed runs each: it proves the
plumbing (plans, forced configurations, checks, table, CSV) and its timings are the
interpreter's, meaningless for a GPU.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

GPU_CASES = "bfloat16:inbatch:8192,bfloat16:inbatch:16384,bfloat16:queue:8192x65536," \
            "float32:inbatch:8192,float32:queue:8192x65536"
CPU_CASES = "bfloat16:inbatch:40,bfloat16:queue:24x72"
FIELDS = ["timestamp", "host", "device", "arch", "sms", "torch", "triton", "python", "commit",
          "mode", "kernel", "dtype", "D", "kind", "n", "N", "precision", "config", "BLOCK_M",
          "BLOCK_N", "num_warps", "num_stages", "waves", "split", "programs", "median_ms",
          "p20_ms", "p80_ms", "peak_mib", "ratio_to_builtin", "max_rel_diff", "status", "winner"]


# --rows-sweep: elements per program of the row-wise kernels (prologue, finish, rows' backward:
# nac_triton.ROW_TILE, today 4096), timed in a whole training step's plans
ROW_TILES = (4096, 2048, 1024)
ROWS_CASES_GPU = "bfloat16:inbatch:512,bfloat16:inbatch:8192,bfloat16:queue:256x65536"
ROWS_CASES_CPU = "bfloat16:inbatch:40,bfloat16:queue:24x72"
ROWS_FIELDS = ["timestamp", "host", "device", "arch", "torch", "triton", "commit", "mode",
               "dtype", "D", "kind", "n", "N", "row_tile", "rows_per_program", "programs",
               "median_ms", "p20_ms", "p80_ms", "ratio_to_default", "same_bits", "status"]


def step_plan(case, inputs, target):
    """(launches, outputs) of one training step's forward and backward as a call plans them (the
    tuned table's configurations, the rows' gradients; the queue's keys take none)."""
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels import autotuner as AT
    s = AT.channel_scale(AT.P_CHANNEL)
    l2 = 0.1 if case.kind == "queue" else 0.0
    a, r, noise, keys, g = (inputs[k] for k in ("a", "r", "noise", "keys", "g"))
    fl, st = NT.fwd_plan(a, r, noise, keys, s, l2, True, target)
    loss, lse, ga, q, k = st[:5]
    bl, out = NT.bwd_plan(a, r, noise, keys, lse, ga, g, q, k, s, True, True, False, target)
    return fl + bl, dict(loss=loss, lse=lse, ga=ga, grad_a=out[0], grad_r=out[1])


def rows_sweep(cases, device, target, base: dict, rep_ms: float, deadline: float) -> list:
    """Time a training step's plans (`step_plan`) with each of ROW_TILES (nac_triton.row_tile)
    per case: CUDA-graph replays on a GPU (autotuner._time_gpu), the interpreter's wall time on a
    CPU.  Every tile must give the default's bits (the tile changes which program computes a
    row, not how).  Rows for the CSV; cases past `deadline` are left out, and said."""
    import torch
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels import autotuner as AT
    gpu = torch.device(device).type == "cuda"
    rows = []
    for dname, kind, n, N in cases:
        case = AT.Case(kind, n, N, 128, getattr(torch, dname))
        inputs = AT.case_inputs(case, device)
        ref, ref_ms = None, None
        for elems in ROW_TILES:
            if time.monotonic() > deadline:
                print(f"autotune: rows sweep: budget reached, {kind} {n}x{N} row tile {elems} "
                      "not timed", flush=True)
                continue
            row = dict(base, dtype=dname, D=128, kind=kind, n=n, N=N, row_tile=elems)
            try:
                with NT.row_tile(elems):
                    launches, outputs = step_plan(case, inputs, target)
                    row["rows_per_program"] = NT._rows_block(128, case.dtype)
                    row["programs"] = " ".join(
                        f"{L.tag}:{L.grid[0]}" for L in launches
                        if L.tag in ("prologue", "finish", "bwd_rows"))
                    # the timed runs leave the outputs in place (graph replays write the
                    # launches' own buffers)
                    med, p20, p80 = (AT._time_gpu(lambda: KL.run(launches), rep_ms, 5.0) if gpu
                                     else AT._time_cpu(lambda: KL.run(launches), 2))
                    outs = {k: v.clone() for k, v in outputs.items()}
                if ref is None:
                    ref, ref_ms = outs, med
                same = all(torch.equal(outs[k], ref[k]) for k in ref)
                row.update(median_ms=med, p20_ms=p20, p80_ms=p80, ratio_to_default=ref_ms / med,
                           same_bits=int(same), status="ok" if same else "different bits")
            except Exception as exc:  # noqa: BLE001 - a failing tile is a finding, not a stop
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                row["status"] = f"error: {type(exc).__name__}: {first}"
            rows.append(row)
            print(f"autotune: rows sweep {kind} {n}x{N} {dname} row tile {elems}: "
                  + (f"{row['median_ms']:.4f} ms, x{row['ratio_to_default']:.3f} of the default, "
                     f"{row['programs']}" if "median_ms" in row else "")
                  + f" [{row['status']}]", flush=True)
    return rows


def parse_cases(text: str, D: int):
    """'dtype:kind:n' or 'dtype:kind:nxN' items, comma-separated -> [(dtype name, kind, n, N)]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"--cases: {item!r} is not dtype:kind:n or dtype:kind:nxN")
        dname, kind, size = parts
        if dname not in ("bfloat16", "float32"):
            raise ValueError(f"--cases: dtype must be bfloat16 or float32 (the tuned dtypes), "
                             f"got {dname!r}")
        if kind not in ("inbatch", "queue"):
            raise ValueError(f"--cases: kind must be inbatch or queue, got {kind!r}")
        try:
            n, N = (int(x) for x in size.split("x")) if "x" in size else (int(size), int(size))
        except ValueError:
            raise ValueError(f"--cases: size {size!r} is not n or nxN") from None
        if kind == "inbatch" and n != N:
            raise ValueError(f"--cases: in-batch takes one size, got {size!r}")
        if n < 1 or N < 1:
            raise ValueError(f"--cases: sizes must be >= 1, got {size!r}")
        out.append((dname, kind, n, N))
    if not out:
        raise ValueError("--cases: no case given")
    return out


def commit() -> str:
    if os.environ.get("NAC_FAST_COMMIT"):
        return os.environ["NAC_FAST_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def work_list(cases, D, target, max_candidates, keys_grad):
    """[(Case, kernel, [Config], fp32 mode or None)]: the candidates that apply to the target and
    fit it; an fp32 case once per product mode with candidates of its own (tf32x3, bf16x6, and
    in-batch fp16x3)."""
    import torch
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels import autotuner as AT
    from nac_fast.kernels import tuning as TU
    out = []
    for dname, kind, n, N in cases:
        dtype = getattr(torch, dname)
        case = AT.Case(kind, n, N, D, dtype)
        modes = TU.TUNED_FP32_MODES if dtype == torch.float32 else (None,)
        for mode in modes:
            if kind == "queue" and mode in TU.IN_BATCH_ONLY_FP32_MODES:
                continue  # given keys run bf16x6 there (nac_triton._given_keys_mode)
            for kernel in ("fwd", "bwd_keys"):
                if kernel == "bwd_keys" and kind == "queue" and not keys_grad:
                    continue
                with NT.fp32_dot(mode):
                    cands = [c for c in TU.candidates(kernel, dtype, D)
                             if target.arch == 0 or (c.applies(target.arch)
                                                     and NT.smem_estimate(kernel, c, dtype, D)
                                                     <= target.smem)]
                if not cands:
                    raise SystemExit(f"autotune: no candidates for {kernel} {dname} D={D}"
                                     f"{'' if mode is None else ' ' + mode} "
                                     "(nac_triton.CANDIDATES)")
                if max_candidates and len(cands) > max_candidates:  # spread over the list
                    last = len(cands) - 1
                    cands = [cands[round(i * last / max(1, max_candidates - 1))]
                             for i in range(max_candidates)]
                out.append((case, kernel, cands, mode))
    return out


def precompile(work, target, jobs):
    """Compile every distinct launch of every candidate's plan (meta tensors: the plans the
    timed calls build, at the same shapes) in `jobs` processes, into Triton's cache.  The plans
    are made for 1-4 resident blocks per SM (the real split follows each kernel's compiled
    occupancy, which decides between the split and one-split launches)."""
    import concurrent.futures as cf
    import dataclasses
    import multiprocessing as mp

    import torch
    import compile_check as CC
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels import autotuner as AT
    t0 = time.perf_counter()
    unique = {}
    for case, kernel, cands, mode in work:
        meta = AT.case_inputs(case, "meta")
        for per_sm in (1, 2, 3, 4):
            # (no compiler in the loop: the folded kernels are planned, and a folded kernel
            # that spills, which the timed plan leaves unfolded, compiles when timed)
            t = dataclasses.replace(target, sms=target.sms * per_sm, occupancy=None,
                                    spills=None)
            with NT.fp32_dot(mode):
                fwd_l, _, _, state = AT.plan_call("fwd", case, meta, t, None)
                plans = [fwd_l]
                for c in [None] + list(cands):
                    plans.append(AT.plan_call(kernel, case, meta, t, c, state)[0])
            for launches in plans:
                for L in launches:
                    if all(g > 0 for g in L.grid):
                        unique.setdefault(CC._key(L, target.arch), L)
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    done, failed = 0, []
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futs = {pool.submit(CC.compile_only, CC._job(L, target.arch)): L
                for L in unique.values()}
        for f in cf.as_completed(futs):
            try:
                f.result()
                done += 1
            except Exception as exc:  # noqa: BLE001 - reported; the launch compiles when timed
                failed.append(f"{futs[f].tag}: {str(exc).splitlines()[0][:200]}")
    dt_s = time.perf_counter() - t0
    print(f"autotune: precompiled {done} of {len(unique)} distinct launches in {dt_s:.1f} s "
          f"({jobs} processes)", flush=True)
    for x in failed:
        print(f"autotune: precompile failed (compiled when timed instead): {x}", flush=True)
    return dt_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True, help="folder for autotune.csv and the table")
    ap.add_argument("--cpu", action="store_true", help="CPU mode (the default without CUDA)")
    ap.add_argument("--cases", default=None,
                    help=f"dtype:kind:n[xN],... (GPU default {GPU_CASES}; CPU {CPU_CASES})")
    ap.add_argument("--D", type=int, default=128, help="code bits (the candidates' BLOCK_D)")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop timing new candidates after this many seconds (compile included)")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="do_bench's rep per candidate")
    ap.add_argument("--max-candidates", type=int, default=None,
                    help="at most this many candidates per kernel (CPU default 2; GPU: all)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2,
                    help="compile processes (GPU)")
    ap.add_argument("--keys-grad", action="store_true",
                    help="also tune the keys' backward of the queue kind (given keys that take "
                         "a gradient)")
    ap.add_argument("--rows-sweep", action="store_true",
                    help="after the table: time a training step's plans with each row tile of "
                         f"the row-wise kernels {ROW_TILES} (rows_sweep.csv; GPU cases "
                         f"{ROWS_CASES_GPU})")
    ap.add_argument("--rows-budget-s", type=float, default=30.0,
                    help="--rows-sweep: seconds it may take (default 30)")
    ap.add_argument("--install", action="store_true",
                    help="copy the table to kernels/tuned/sm<arch>.json")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace autotune.csv / the table in --out-dir, and with --install the "
                         "shipped table")
    args = ap.parse_args(argv)
    t_start = time.monotonic()

    import torch
    gpu = torch.cuda.is_available() and not args.cpu
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    os.environ.pop("NAC_FAST_TUNED", None)  # the built-in configurations are the baseline
    try:
        cases = parse_cases(args.cases or (GPU_CASES if gpu else CPU_CASES), args.D)
    except ValueError as exc:
        ap.error(str(exc))
    if args.budget_s <= 0 or args.rep_ms <= 0 or args.rows_budget_s <= 0:
        ap.error("--budget-s, --rep-ms and --rows-budget-s must be > 0")
    if args.install and not gpu:
        ap.error("--install: a CPU-mode table (the interpreter's timings) is not for shipping")
    max_c = args.max_candidates if args.max_candidates is not None else (0 if gpu else 2)

    import triton
    from tqdm import tqdm
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels import autotuner as AT
    from nac_fast.kernels import tuning as TU

    device = torch.device("cuda" if gpu else "cpu")
    target = KL.target_of(device)
    dev_name = torch.cuda.get_device_name(device) if gpu else "cpu-interpreter"
    table_name = f"sm{target.arch}.json" if gpu else "cpu_interpreter.json"
    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, "autotune.csv")
    table_path = os.path.join(args.out_dir, table_name)
    for p in (csv_path, table_path) + ((os.path.join(args.out_dir, "rows_sweep.csv"),)
                                       if args.rows_sweep else ()):
        if os.path.exists(p) and not args.overwrite:
            ap.error(f"{p} exists: pass --overwrite to replace it")
    installed = os.path.join(TU.TABLE_DIR, table_name)
    if args.install and os.path.exists(installed) and not args.overwrite:
        ap.error(f"--install: {installed} exists: pass --overwrite to replace it")

    work = work_list(cases, args.D, target, max_c, args.keys_grad)
    total = sum(len(c) for _, _, c, _ in work)
    print(f"autotune: {dev_name} (sm_{target.arch}, {target.sms} SMs), triton "
          f"{triton.__version__}, torch {torch.__version__}: {len(work)} kernel cases, "
          f"{total} candidates, budget {args.budget_s:.0f} s", flush=True)
    if gpu:
        try:
            precompile(work, target, max(1, args.jobs))
        except Exception as exc:  # noqa: BLE001 - said, then each launch compiles when timed
            print(f"autotune: parallel precompile failed ({type(exc).__name__}: {exc}); "
                  "candidates compile when first timed", flush=True)
        # did the launches find the precompiled kernels in Triton's cache? (a compile takes
        # seconds, a cache hit well under one)
        case0 = work[0][0]
        t0 = time.perf_counter()
        with NT.fp32_dot(work[0][3]):
            AT.run_fwd(case0, AT.case_inputs(case0, device), target)
        torch.cuda.synchronize()
        print(f"autotune: first launch of the built-in forward plan took "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    deadline = t_start + args.budget_s - 5.0  # 5 s to write the files

    header = TU.table_header(target.arch, dev_name, target.sms, commit(), gpu=gpu)
    stamp = header["date"]
    base = dict(timestamp=stamp, host=socket.gethostname(), device=dev_name, arch=target.arch,
                sms=target.sms, torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), commit=header["commit"],
                mode="gpu" if gpu else "cpu-interpreter", D=args.D)
    rows, summary = [], []
    bar = tqdm(total=total, desc="autotune", unit="cand", file=sys.stdout, mininterval=5.0)
    for case, kernel, cands, mode in work:
        with NT.fp32_dot(mode):
            prec = NT._dot_consts(case.dtype, case.D, device)["PRECISION"]
            res = AT.tune_key(kernel, case, device, target, cands, rep_ms=args.rep_ms,
                              warmup_ms=5.0, cpu_reps=2, deadline=deadline,
                              progress=lambda: bar.update(1))
            bar.update(len(res["skipped"]))
            entry = TU.make_entry(kernel, case, prec, res)
            if entry is not None:
                header["entries"].append(entry)
            d = res["default"]
            for r in [d] + res["rows"]:
                cfg = r["config"] or TU.config_dict(NT.builtin_config(kernel, case.dtype, case.D,
                                                                      target))
                rows.append(dict(base, kernel=kernel, dtype=TU.dtype_name(case.dtype),
                                 kind=case.kind, n=case.n, N=case.N, precision=prec,
                                 config=r["label"], **cfg, split=r["split"],
                                 programs=r["programs"], median_ms=r["median_ms"],
                                 p20_ms=r["p20_ms"], p80_ms=r["p80_ms"],
                                 peak_mib=r["peak_mib"],
                                 ratio_to_builtin=(d["median_ms"] / r["median_ms"]
                                                   if r["median_ms"] == r["median_ms"] else ""),
                                 max_rel_diff=r["max_rel_diff"], status=r["status"],
                                 winner=int(res["winner"] is r)))
            summary.append((case, kernel, res, prec))
            if res["skipped"]:
                bar.write(f"autotune: budget reached: {kernel} {case.kind} {case.n}x{case.N} "
                          f"{TU.dtype_name(case.dtype)} {prec}: {len(res['skipped'])} "
                          "candidates not timed")
    bar.close()

    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    TU.write_table(table_path, header)
    if args.install:
        os.makedirs(TU.TABLE_DIR, exist_ok=True)
        shutil.copyfile(table_path, installed)
    elapsed = time.monotonic() - t_start
    print(f"autotune: wrote {csv_path} ({len(rows)} rows) and {table_path} "
          f"({len(header['entries'])} entries)" + (f"; installed {installed}" if args.install
                                                   else "") + f"; {elapsed:.0f} s in all")
    if args.rows_sweep:
        t_rows = time.monotonic()
        rows_cases = parse_cases(ROWS_CASES_GPU if gpu else ROWS_CASES_CPU, args.D)
        sweep = rows_sweep(rows_cases, device, target,
                           {k: base[k] for k in ("timestamp", "host", "device", "arch", "torch",
                                                 "triton", "commit", "mode")},
                           args.rep_ms, t_rows + args.rows_budget_s)
        rows_path = os.path.join(args.out_dir, "rows_sweep.csv")
        with open(rows_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=ROWS_FIELDS)
            w.writeheader()
            w.writerows(sweep)
        print(f"autotune: wrote {rows_path} ({len(sweep)} rows) in "
              f"{time.monotonic() - t_rows:.0f} s")
    print(f"{'kernel':8s} {'dtype':15s} {'case':16s} {'built-in ms':>11s} {'best ms':>8s} "
          f"{'x':>5s}  {'best config':22s} {'split':>5s} {'timed':>5s}")
    for case, kernel, res, prec in summary:
        w, d = res["winner"], res["default"]
        shape = f"{case.kind} {case.n}" + (f"x{case.N}" if case.kind == "queue" else "")
        dname = TU.dtype_name(case.dtype) + (f":{prec}" if case.dtype == torch.float32 else "")
        print(f"{kernel:8s} {dname:15s} {shape:16s} {d['median_ms']:11.4f} "
              + (f"{w['median_ms']:8.4f} {d['median_ms'] / w['median_ms']:5.2f}  "
                 f"{w['label']:22s} {w['split']:5d}" if w else f"{'-':>8s} {'-':>5s}  "
                                                              f"{'none passed':22s} {'':5s}")
              + f" {len(res['rows']):5d}")
    for line in fp32_decisions(TU.validate(header, table_path), cases, args.D):
        print(line)
    return 0


def fp32_decisions(table, cases, D: int) -> list:
    """One line per fp32 case: the product mode the table makes fp32 calls of that case run in
    (kernels/tuning.py Table.fp32_mode: the fastest whole step of the modes tuned there, which
    the launchers then take where NAC_FAST_FP32_DOT is unset), with the steps' figures."""
    import torch
    from nac_fast.kernels import nac_triton as NT
    out = []
    for dname, kind, n, N in cases:
        if getattr(torch, dname) != torch.float32:
            continue
        steps = table.fp32_step_ms(NT.block_d(D), kind, n, N)
        mode = table.fp32_mode(NT.block_d(D), kind, n, N)
        figures = ", ".join(f"{m} {ms:.4f} ms" for m, (_, ms) in steps.items()) or "none"
        out.append(f"autotune: fp32 {kind} {n}" + (f"x{N}" if kind == "queue" else "")
                   + f": step (fwd" + (" + keys' bwd" if kind == "inbatch" else "")
                   + f") {figures} -> "
                   + (f"{mode} (the launchers' fp32 mode here unless NAC_FAST_FP32_DOT is set)"
                      if mode else "no choice (tf32x3 and another mode not tuned at one size "
                      f"class): {NT.FP32_PRECISIONS[0]} stays"))
    return out


if __name__ == "__main__":
    sys.exit(main())
