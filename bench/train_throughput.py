"""Training throughput: images/s and data-wait fraction of train.py's step for one config, with
the one-time compile cost and the eager rate beside it.

    python bench/train_throughput.py --arch resnet-tiny --method nac --batch-size 256

Parts: 1. train.py itself; 2. --profile-out and --sync-check (FAIL exits 1); 3. --eager-baseline,
only while --budget-s leaves time.  The last line is one JSON object.  Details: docs/training.md
"The training throughput benchmark".
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import (append_rows, check_least, check_output_file, commit,  # noqa: E402
                    quantiles, run_fields, write_text)  # (common puts the source tree on sys.path)
from nac_fast.data.sources.synthetic_pairs import DeviceSyntheticPairLoader  # noqa: E402,F401

CSV_FIELDS = ["timestamp", "host", "device", "torch", "triton", "commit", "threads", "config",
              "arch", "method", "data", "loader", "batch_size", "world_size", "image_size", "amp",
              "channels_last", "compile", "compile_backend", "img_per_s", "step_ms_median",
              "step_ms_p20", "step_ms_p80", "windows", "steps_per_window", "data_wait",
              "first_step_s", "compile_s", "peak_mem_mib", "status"]


def _device_loader_factory(num_images):
    def build_loader(args, dist_info, channels_last, listing=None):  # no folder to list
        per_rank = args.batch_size // dist_info.world_size
        return DeviceSyntheticPairLoader(num_images, per_rank, dist_info.rank,
                                         dist_info.world_size, args.seed,
                                         image_size=args.image_size or 32,
                                         device=dist_info.device, channels_last=channels_last)
    return build_loader


# ---- part 2: the profile -------------------------------------------------------------------------

def profile_step(step_fn, device, path, top: int = 15) -> dict:
    """torch.profiler around one step_fn() after one warm step (module docstring, part 2): the top
    CUDA kernels and operators to `path` (a CPU run: the top operators)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    step_fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        step_fn()
        sync()
    lines, agg = [], {}
    for e in prof.events() if cuda else ():
        if e.device_type == DeviceType.CUDA:
            t, c = agg.get(e.name, (0.0, 0))
            agg[e.name] = (t + float(e.time_range.elapsed_us()), c + 1)
    n_kernels, total = sum(c for _, c in agg.values()), sum(t for t, _ in agg.values())
    if cuda:
        lines.append(f"top {top} CUDA kernels of one training step: {n_kernels} kernel launches, "
                     f"{len(agg)} distinct kernels, {total / 1e3:.3f} ms of kernel time")
        lines.append(f"{'#':>3s} {'total ms':>9s} {'share':>6s} {'calls':>6s} {'mean us':>9s}"
                     "  kernel")
        for i, (name, (t, c)) in enumerate(sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]):
            lines.append(f"{i + 1:3d} {t / 1e3:9.3f} {100 * t / max(total, 1e-9):5.1f}% {c:6d} "
                         f"{t / c:9.1f}  {name[:160]}")
    else:
        lines.append("no CUDA device: top operators by self CPU time instead of kernels")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines += ["", prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=80)]
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    text = f"device: {name}; torch {torch.__version__}\n" + "\n".join(lines) + "\n"
    write_text(path, text)
    if cuda and n_kernels == 0:
        return {"profile": "FAIL: no CUDA kernel events recorded (CUPTI unavailable?)",
                "profile_file": path}
    return {"profile": "ok", "profile_file": path, "profile_kernel_launches": n_kernels}


# ---- helpers -------------------------------------------------------------------------------------

def window_stats(window_secs, steps_per_window, images_per_step) -> dict:
    """img/s (all images / all time: the harmonic mean of the windows' rates) and ms per step
    (median and p20/p80 over the windows) of equal-sized timed windows."""
    secs = sum(window_secs)
    n = len(window_secs) * steps_per_window
    med, p20, p80 = quantiles([1000 * s / steps_per_window for s in window_secs])
    return {"img_per_s": round(n * images_per_step / secs, 1), "step_ms": round(1000 * secs / n, 1),
            "step_ms_median": round(med, 2), "step_ms_p20": round(p20, 2),
            "step_ms_p80": round(p80, 2), "windows": len(window_secs),
            "steps_per_window": steps_per_window, "measured_steps": n}


def _peak_mib(device, reset: bool = False) -> float | None:
    """The allocator's peak (MiB) on a CUDA device, None on a CPU; reset: start a new peak."""
    if device.type != "cuda":
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return round(torch.cuda.max_memory_allocated(device) / 2 ** 20, 1)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- parts 1-3: train.py itself ------------------------------------------------------------------

def _train_argv(args, out, compile_flag) -> list:
    # log-every = warmup: the log's first record covers the warm-up steps (compilation, first
    # allocations), the later ones only measured steps.  --steps is rounded up to whole windows.
    total = args.warmup * (1 + -(-args.steps // args.warmup))
    targv = ["--data", args.data, "--arch", args.arch, "--method", args.method,
             "--batch-size", str(args.batch_size), "--max-steps", str(total),
             "--log-every", str(args.warmup), "--save-every", str(10 ** 9), "--no-progress",
             "--amp", args.amp, "--loader", args.loader, "--out", out,
             "--warmup-epochs", "0"]
    for flag, v in (("--image-size", args.image_size), ("--workers", args.workers),
                    ("--queue-size", args.queue_size), ("--compile-backend", args.compile_backend)):
        if v is not None:
            targv += [flag, str(v)]
    if args.channels_last is not None:
        targv.append("--channels-last" if args.channels_last else "--no-channels-last")
    if compile_flag is not None:
        targv.append("--compile" if compile_flag else "--no-compile")
    return targv


def run_train(args, compile_flag, keep_state: bool = False):
    """train.py's main on a fresh temp --out; (result dict, TrainState or None).  SystemExit
    with train.py's status when it fails."""
    import train
    out = tempfile.mkdtemp(prefix="nac_tp_")
    targv = _train_argv(args, out, compile_flag)
    kept, real_train = {}, train.train

    def train_and_keep(st, flags):  # the run's state: what it compiled, the profile, the check
        kept["st"] = st
        return real_train(st, flags)

    train.train = train_and_keep
    try:
        status = train.main(targv)
    finally:
        train.train = real_train
    if status:
        shutil.rmtree(out, ignore_errors=True)
        sys.exit(status)
    st = kept.pop("st", None)
    compiled = None if st is None else st.compiled
    if not keep_state:
        st = None
    if int(os.environ.get("RANK", "0")) != 0:
        shutil.rmtree(out, ignore_errors=True)
        return None, st
    with open(os.path.join(out, "log.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    first, recs = recs[0], recs[1:]
    w, b = args.warmup, args.batch_size
    secs = [w * b / r["img_per_s"] for r in recs]
    res = {"compile": bool(cfg.get("compile")),
           "compile_backend": cfg.get("compile_backend") if cfg.get("compile") else None,
           "compiled": compiled}
    res.update(window_stats(secs, w, b))
    res["data_wait"] = round(sum(r["data_wait"] * s for r, s in zip(recs, secs)) / sum(secs), 4)
    if "first_step_s" in first:
        res["first_step_s"] = first["first_step_s"]
        res["compile_s"] = round(first["first_step_s"] - res["step_ms"] / 1000, 2)
    return (res, cfg), st


# ---- the report ----------------------------------------------------------------------------------

def csv_rows(res) -> list:
    """One row per configuration measured (part 1, the eager baseline), CSV_FIELDS' columns
    (None as blank)."""
    common = {**run_fields(res["device"]), **{k: res[k] for k in (
        "commit", "threads", "arch", "method", "data", "loader", "batch_size", "world_size",
        "image_size", "amp", "channels_last")}}
    rows = []
    for config, r in [("defaults", res)] + ([("eager", res["eager"])] if "eager" in res else []):
        row = dict(common, config=f"{res['method']}-{config}")
        rows.append(row)
        if "img_per_s" not in r:
            row["status"] = r["skipped"]
            continue
        row.update({k: r.get(k) for k in ("compile", "compile_backend", "img_per_s",
                                          "step_ms_median", "step_ms_p20", "step_ms_p80",
                                          "windows", "steps_per_window", "data_wait",
                                          "first_step_s", "compile_s", "peak_mem_mib")})
        row["status"] = "ok"
    return [{k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS} for r in rows]


def summary_line(res) -> str:
    """The run in one line: the GPU suite's train-stage detail (bench/gpu_suite.sh)."""
    s = (f"{res['img_per_s']:.0f} img/s ({res['device']}), data wait {100 * res['data_wait']:.1f}%"
         f", profile {res.get('profile', 'not run')}, "
         f"sync check {res.get('sync_check', 'not run')}")
    if res.get("sync_offenders"):
        s += f" ({str(res['sync_offenders'])[:120]})"
    s += f", compiled: {res.get('compiled') or 'no'}"
    s += f", compile {res['compile_s']} s" if "compile_s" in res else ""
    if "eager" in res:
        e = res["eager"]
        s += ", eager " + (f"{e['img_per_s']:.0f}" if "img_per_s" in e else "skipped")
    return s


# ---- main ----------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add = ap.add_argument
    add("--data", default="synthetic:65536", help="synthetic[:N] (train.py's loader, images made "
        "on the CPU), synthetic-device[:N] (made on the training device), or a train.py --data")
    add("--arch", default="resnet-tiny")
    add("--method", default="nac", choices=("nac", "nac-mq", "simclr"))
    add("--batch-size", type=int, default=256, help="global batch")
    add("--image-size", type=int, default=None)
    add("--steps", type=int, default=20, help="measured steps")
    add("--warmup", type=int, default=5, help="unmeasured first steps; the steps of each window")
    add("--amp", default="auto", choices=("auto", "bf16", "fp16", "off"))
    add("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    add("--compile", action=argparse.BooleanOptionalAction, default=None, help="train.py's "
        "--compile / --no-compile (default: train.py's: compiled on a GPU, eager on a CPU)")
    add("--compile-backend", default=None, choices=("inductor", "aot_eager"),
        help="train.py's --compile-backend")
    add("--loader", default="auto")
    add("--workers", type=int, default=None)
    add("--queue-size", type=int, default=None)
    add("--eager-baseline", action=argparse.BooleanOptionalAction, default=None, help="also "
        "measure train.py --no-compile (default: when the run compiled; one process only)")
    add("--budget-s", type=float, default=0.0, help="seconds for the whole benchmark: the eager "
        "baseline only while it fits (0: no limit)")
    add("--profile-out", default=None, help="write the kernel profile of one step here")
    add("--sync-check", action="store_true", help="host-sync check of one step")
    add("--json-out", default=None, help="also write the result JSON here")
    add("--csv-out", default=None, help="append one CSV row per configuration here")
    add("--overwrite", action="store_true", help="replace an existing --json-out or "
        "--profile-out (without it they are refused)")
    args = ap.parse_args(argv)
    check_least(ap, args, {"--steps": 1, "--warmup": 1})
    if not args.budget_s >= 0:  # (NaN too: it would skip every later part)
        ap.error(f"--budget-s must be >= 0, got {args.budget_s}")
    # the output paths, before any measurement: a folder, a path under a file, an unwritable
    # place, a damaged --csv-out (a missing folder is made)
    for flag, path in (("--json-out", args.json_out), ("--profile-out", args.profile_out)):
        if path is not None:
            check_output_file(ap, flag, path, csv_file=False)
            if os.path.lexists(path) and not args.overwrite:
                ap.error(f"{flag} {path!r} exists; pass --overwrite to replace it")
    if args.csv_out is not None:
        check_output_file(ap, "--csv-out", args.csv_out)
    t0 = time.perf_counter()

    from nac_fast.train import run as run_mod
    data, n_img = args.data, None
    if data == "synthetic-device" or data.startswith("synthetic-device:"):
        try:
            n_img = int(data.split(":", 1)[1]) if ":" in data else 65536
        except ValueError:
            ap.error(f"--data {data!r}: expected synthetic-device[:N] with an int N")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if (args.profile_out or args.sync_check) and world != 1:
        ap.error("--profile-out and --sync-check run in one process (no torchrun)")
    real_build_loader = run_mod.build_loader
    if n_img is not None:  # run.build calls it by name; put back after the runs
        run_mod.build_loader = _device_loader_factory(n_img)
    try:
        res, failed = measure(args, t0, world)
    finally:
        run_mod.build_loader = real_build_loader
    if res is None:  # ranks > 0: the parts after the first run are rank 0's alone
        return
    res["summary"] = summary_line(res)
    if args.csv_out:
        append_rows(args.csv_out, csv_rows(res), CSV_FIELDS)  # all or nothing
    if args.json_out:
        write_text(args.json_out, json.dumps(res) + "\n")
    print(res["summary"])
    print(json.dumps(res))
    if failed:
        sys.exit(1)


def measure(args, t0: float, world: int):
    """Parts 1-3 (module docstring; t0: the benchmark's start, perf_counter): (result dict,
    whether the profile or the sync check failed); (None, False) on ranks > 0."""
    from nac_fast.train import run as run_mod
    from nac_fast.train.monitor import LossWatch
    from nac_fast.train.sync_check import check_step
    want_state = bool(args.profile_out or args.sync_check)
    dev_guess = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _peak_mib(dev_guess, reset=True)
    measured, st = run_train(args, args.compile, keep_state=want_state)
    if measured is None:
        return None, False
    main_res, cfg = measured
    device = torch.device("cuda" if cfg.get("device") != "cpu" and torch.cuda.is_available()
                          else "cpu")
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    res = {"arch": args.arch, "method": args.method, "data": args.data, "loader": cfg["loader"],
           "batch_size": args.batch_size, "world_size": cfg["world_size"],
           "image_size": cfg["image_size"], "amp": cfg["amp"],
           "channels_last": cfg["channels_last"], "device": dev, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "commit": commit()}
    res.update(main_res)
    res["peak_mem_mib"] = _peak_mib(device)
    failed = False
    if st is not None:
        v1, v2 = next(iter(st.loader))
        x = run_mod.prepare_batch(st, v1, v2)
        if args.profile_out:
            res.update(profile_step(lambda: run_mod.train_step(st, x), device, args.profile_out))
            failed |= res["profile"] != "ok"
        if args.sync_check:
            watch = LossWatch(st.step, device)
            run_mod.train_step(st, x)  # warm (the profile may not have run)
            res["sync_scope"] = ("one step of train.py's loop: train_step (loss forward and "
                                 "backward, LARS, EMA, queue) and LossWatch.update")
            res.update(check_step(lambda: watch.update(run_mod.train_step(st, x)[0]), device))
            failed |= res["sync_check"] == "FAIL"
        del x, v1, v2
    st = None
    _free(device)
    eager = args.eager_baseline if args.eager_baseline is not None else res["compile"]
    if eager and world != 1:
        res["eager"] = {"skipped": "the eager baseline runs in one process (no torchrun)"}
    elif eager:
        # about the compiled run's time again, slower (eager), plus building the model
        need = 5.0 + 2.0 * (args.warmup + args.steps) * res["step_ms"] / 1000
        spent = time.perf_counter() - t0
        if args.budget_s > 0 and args.budget_s - spent < need:
            res["eager"] = {"skipped": f"skipped: --budget-s {args.budget_s:g} leaves "
                            f"{max(args.budget_s - spent, 0):.0f} s after {spent:.0f} s, this "
                            f"part needs about {need:.0f} s"}
        else:
            _peak_mib(device, reset=True)
            (e, _), _ = run_train(args, False)
            e["peak_mem_mib"] = _peak_mib(device)
            res["eager"] = e
            _free(device)
    res["budget_s"], res["elapsed_s"] = args.budget_s, round(time.perf_counter() - t0, 1)
    return res, failed


if __name__ == "__main__":
    main()
