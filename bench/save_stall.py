"""How long a checkpoint save stalls training: train.py's `save` with --save-mode sync against
--save-mode async (issue 54 point 5).

    python bench/save_stall.py                                   # ResNet-50 NAC-MQ, this machine
    python bench/save_stall.py --csv bench/results/save_stall_cpu.csv --dir /local/scratch

The state is a real one, built by train.py's own code (nac_fast.train.run.build, recipe
configs/imagenet_nac_mq.toml: ResNet-50 at 224 px, NAC-MQ's momentum model, LARS with its
momentum buffers filled by one update of zero gradients, a 65,536 x 128 queue), about 0.4 GB; no
training.  Each repeat times, alternately:

  sync_s     save() with --save-mode sync: every rank waits while rank 0 writes OUT/last.pt
             (temp file, fsync, rename: checkpoint.save_atomic)
  stall_s    save() with --save-mode async: what the step waits for, the host copy of the state
             (checkpoint.snapshot) and the start of the background write; the previous write
             has finished (the next save waits for it only when --save-every steps take less
             time than write_s)
  write_s    that background write, done while training would go on
  first_stall_s  the run's first async save: its host copy is new memory (page faults); the
             later ones copy into it (BackgroundSave.snapshot)

and prints the medians and stall_s / sync_s (issue 54's goal: at most 0.2).  The checkpoints go
to a fresh folder in --dir (the system's temp folder by default; a local disk, as --out would
be), removed at the end.  --csv appends one row (columns FIELDS).  On a CPU shared with other
work, run it with OMP_WAIT_POLICY=PASSIVE (nac_fast/_omp.py: spinning OpenMP threads slow the
host copy, a multi-threaded memcpy, several times over; the row records the policy).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from nac_fast.train import distributed as nd  # noqa: E402
from nac_fast.train.config import parse  # noqa: E402
from nac_fast.train.run import build, save, settle_save  # noqa: E402

FIELDS = ["timestamp", "host", "device", "torch", "commit", "arch", "queue_size", "code_dim",
          "state_mb", "repeats", "sync_s", "stall_s", "first_stall_s", "write_s",
          "stall_over_sync", "omp_wait_policy"]
GOAL = 0.2   # issue 54: a save's stall at most 20% of a synchronous save's


def build_state(arch: str, queue_size: int, code_dim: int, device: str, out: str):
    """train.py's TrainState for the ImageNet NAC-MQ recipe (one process), its optimizer state
    filled; no data is read (synthetic pairs, generated only when a batch is drawn)."""
    cfg = parse(["--config", os.path.join(ROOT, "configs", "imagenet_nac_mq.toml"),
                 "--data", "synthetic:4096", "--image-size", "224", "--batch-size", "64",
                 "--arch", arch, "--queue-size", str(queue_size), "--code-dim", str(code_dim),
                 "--device", device, "--no-compile", "--no-progress", "--out", out])
    st = build(cfg, nd.init_distributed(cfg.device))
    for p in st.model.parameters():          # LARS's momentum buffers, as after any update
        p.grad = torch.zeros_like(p)
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)
    st.step = 1                              # not the run's last step: async does not wait
    return st


def _state_mb(st) -> float:
    n = sum(t.numel() * t.element_size() for m in (st.model, st.mom_model)
            for t in m.state_dict().values())
    n += sum(t.numel() * t.element_size() for s in st.optimizer.state.values()
             for t in s.values() if isinstance(t, torch.Tensor))
    n += st.queue.codes.numel() * st.queue.codes.element_size()
    return n / 2**20


def measure(st, repeats: int):
    """(first_stall_s, medians of sync_s, stall_s, write_s over `repeats` alternating saves of
    each mode).  first_stall_s: the run's first async save, whose host copy is new memory (later
    ones reuse it: BackgroundSave.snapshot)."""
    sync, stall, write = [], [], []

    def async_save():
        st.cfg.save_mode = "async"
        t0 = time.perf_counter()
        save(st)
        s = time.perf_counter() - t0
        out = st.saver.wait()                # the write, done in the background
        if out.error is not None:
            raise out.error
        st.saved, st.rotate = (out.path, out.label), True
        return s, out.seconds

    first, _ = async_save()
    for _ in tqdm(range(repeats), desc="saves (sync + async)", unit="pair"):
        st.cfg.save_mode = "sync"
        t0 = time.perf_counter()
        save(st)
        sync.append(time.perf_counter() - t0)
        s, w = async_save()
        stall.append(s)
        write.append(w)
    return first, statistics.median(sync), statistics.median(stall), statistics.median(write)


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="resnet50", help="encoder (default resnet50)")
    ap.add_argument("--queue-size", type=int, default=65536, help="NAC-MQ queue rows")
    ap.add_argument("--code-dim", type=int, default=128, help="code bits")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the state lives (default cpu)")
    ap.add_argument("--repeats", type=int, default=3, help="saves of each mode (median)")
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="folder in which a fresh folder for the checkpoints is made (and removed)")
    ap.add_argument("--csv", default=None, help="append the row to this CSV")
    args = ap.parse_args(argv)
    from bench_csv import check_least, check_output_file, check_output_folder
    check_least(ap, args, {"--repeats": 1, "--queue-size": 1, "--code-dim": 1})
    check_output_folder(ap, "--dir", args.dir)
    if args.csv is not None:
        check_output_file(ap, "--csv", args.csv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="save_stall-", dir=args.dir)
    try:
        st = build_state(args.arch, args.queue_size, args.code_dim, args.device,
                         os.path.join(work, "run"))
        mb = _state_mb(st)
        print(f"state: {args.arch} NAC-MQ, queue {args.queue_size} x {args.code_dim}, LARS: "
              f"{mb:.0f} MiB of tensors; checkpoints in {work}", flush=True)
        first_s, sync_s, stall_s, write_s = measure(st, args.repeats)
        settle_save(st)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = stall_s / sync_s
    print(f"sync save {sync_s:.3f} s | async: stall {stall_s:.3f} s (the first save: "
          f"{first_s:.3f} s), background write {write_s:.3f} s | stall / sync = {ratio:.3f} "
          f"(goal <= {GOAL}: {'met' if ratio <= GOAL else 'NOT met'})")
    if args.csv is not None:
        from bench_csv import append_rows
        device = (torch.cuda.get_device_name() if args.device == "cuda"
                  else f"cpu x{os.cpu_count()}")
        append_rows(args.csv, [{
            "timestamp": dt.datetime.now().isoformat(timespec="seconds"),
            "host": socket.gethostname(), "device": device, "torch": torch.__version__,
            "commit": _commit(), "arch": args.arch, "queue_size": args.queue_size,
            "code_dim": args.code_dim, "state_mb": round(mb, 1), "repeats": args.repeats,
            "sync_s": round(sync_s, 4), "stall_s": round(stall_s, 4),
            "first_stall_s": round(first_s, 4),
            "write_s": round(write_s, 4), "stall_over_sync": round(ratio, 4),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}], FIELDS)
        print(f"appended a row to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
