"""Training throughput: images/s and data-wait fraction of train.py's step for one config.

    python bench/train_throughput.py --arch resnet-tiny --method nac --batch-size 256
    python bench/train_throughput.py --data fashion-mnist --arch resnet18-small --method nac-mq
    torchrun --nproc_per_node=8 bench/train_throughput.py --data /path/imagenet --arch resnet50 \
        --method nac-mq --batch-size 1024 --amp bf16 --channels-last --loader dali-gpu
    # the GPU suite's run (bench/gpu_suite.sh train): data made on the GPU, one kernel profile,
    # and the host-sync check of the loss
    python bench/train_throughput.py --data synthetic-device:1281167 --arch resnet50 \
        --method nac-mq --batch-size 256 --image-size 224 --amp bf16 --channels-last \
        --queue-size 65536 --profile-out kernels.txt --sync-check --json-out train.json

It runs train.py itself (same model, loss, optimizer, DDP, loader) for --warmup + --steps steps
with checkpoints off and measures the last --steps from train.py's log (img/s over all ranks,
data-wait = time blocked on the loader / wall time, on rank 0).  The last line printed is one
JSON object: {"arch", "method", "batch_size", "world_size", "device", "img_per_s", "data_wait",
"step_ms", ...}.

--data synthetic-device[:N]: train.py's loader is replaced by DeviceSyntheticPairLoader (below):
a pool of random images drawn once ON the training device, batches taken from it with device ops
only, so the loader costs no host work and no copies (DALI-free stand-in for a GPU data pipeline;
the data wait then measures the loader's launches only).  "synthetic[:N]" is train.py's own
loader, which makes each image on the CPU.

After the throughput run (rank 0, one process only), on a fresh model of the same config:
  --profile-out FILE  torch.profiler of one full training step (forward, backward, optimizer, EMA)
                      after 3 warm-up steps: the top 15 CUDA kernels by total time (name, calls,
                      total and mean time, share of all kernel time), then the top operators.  On a
                      CPU run: the top operators by CPU time.  No CUDA kernel event on a GPU run
                      fails the run (profile "FAIL").
  --sync-check        the loss forward and backward of one step (methods.nac_step / nac_mq_step /
                      simclr_step under autocast, then .backward()) run under
                      torch.cuda.set_sync_debug_mode: first "warn", recording every synchronizing
                      call and the Python line that made it, then "error", whose exception names
                      the offending operation.  JSON: sync_check "PASS" / "FAIL" (+ sync_offender,
                      sync_warnings); "n/a" without a GPU.  A FAIL makes the exit status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from nac_fast.data.sources.synthetic_pairs import SyntheticPairLoader  # noqa: E402


class DeviceSyntheticPairLoader(SyntheticPairLoader):
    """SyntheticPairLoader's interface with the images made and kept on `device`.

    `pool` smooth random images (a 4 x 4 random pattern upsampled, like SyntheticPairLoader's) are
    drawn once, on the device.  Batch b of an epoch takes pool images by a seeded random index
    (device generator), view 1 flips each image horizontally with probability 1/2 and view 2 is
    one random roll (host RNG, per batch) of the images plus its own flips.  Every per-batch op
    runs on the device; nothing waits for the host.  Deterministic in (seed, epoch, batch)."""

    def __init__(self, num_images=4096, batch_size=64, rank=0, world_size=1, seed=0,
                 image_size=32, in_channels=3, device="cpu", channels_last=False,
                 dtype=torch.float32, pool=256):
        super().__init__(num_images, batch_size, rank, world_size, seed, image_size, in_channels,
                         device, channels_last, dtype)
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"pool must be a positive int, got {pool!r}")
        g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
        low = torch.randn(pool, in_channels, 4, 4, generator=g).to(self.device)
        self.pool = torch.nn.functional.interpolate(
            low, size=(image_size, image_size), mode="bilinear", align_corners=False).to(dtype)

    def __iter__(self):
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 7919 + self.epoch) * 31 + self.rank)
        host = random.Random((self.seed * 7919 + self.epoch) * 31 + self.rank)
        B, P = self.batch_size, self.pool.shape[0]
        for b in range(len(self)):
            idx = torch.randint(0, P, (B,), device=self.device, generator=g)
            flip1 = torch.rand(B, 1, 1, 1, device=self.device, generator=g) < 0.5
            flip2 = torch.rand(B, 1, 1, 1, device=self.device, generator=g) < 0.5
            dy, dx = host.randint(-2, 2), host.randint(-2, 2)
            if b < self.start_batch:  # resume: same draws as an uninterrupted epoch
                continue
            x = self.pool[idx]
            v1 = torch.where(flip1, x.flip(3), x)
            x2 = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            v2 = torch.where(flip2, x2.flip(3), x2)
            yield self._out(v1), self._out(v2)
        self.start_batch = 0


def _device_loader_factory(num_images):
    def build_loader(args, dist_info, channels_last):
        per_rank = args.batch_size // dist_info.world_size
        return DeviceSyntheticPairLoader(num_images, per_rank, dist_info.rank,
                                         dist_info.world_size, args.seed,
                                         image_size=args.image_size or 32,
                                         device=dist_info.device, channels_last=channels_last)
    return build_loader


# ---- one-step harness for the profile and the sync check -------------------------------------------

def _harness(args, device):
    """(full_step, loss_fwd, x): a fresh model/optimizer of the run's config on `device`."""
    from nac_fast import NACMQ
    from nac_fast.train.lars import LARS, param_groups_for_lars
    from nac_fast.train.methods import nac_mq_step, nac_step, simclr_step
    from nac_fast.train.models import build_model

    cuda = device.type == "cuda"
    torch.manual_seed(0)
    image_size = args.image_size or 32
    channels_last = args.channels_last if args.channels_last is not None else True
    amp = {"auto": "bf16" if cuda else "off"}.get(args.amp, args.amp)
    model = build_model(args.arch, 3, image_size, 128,
                        inference_net=args.method != "simclr").to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    mq = None
    if args.method == "nac-mq":
        mq = NACMQ(model, queue_size=args.queue_size or 16 * args.batch_size, p=0.1, l2=0.1,
                   momentum=0.99)
    opt = LARS(param_groups_for_lars(model, 1e-6), lr=0.1, momentum=0.9, weight_decay=1e-6,
               trust_coefficient=0.001)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
                if amp != "off" else contextlib.nullcontext())
    loader = DeviceSyntheticPairLoader(args.batch_size, args.batch_size, image_size=image_size,
                                       device=device, channels_last=channels_last)
    v1, v2 = next(iter(loader))
    x = torch.cat([v1, v2])
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    model.train()
    if mq is not None:
        mq.train()

    def loss_fwd(x):
        with autocast:
            if args.method == "nac":
                return nac_step(model, x, 0.1)
            if args.method == "nac-mq":
                return nac_mq_step(mq, x)  # with the EMA update, as train.py's step
            return simclr_step(model, x, 0.5)

    def full_step(x):
        loss, _ = loss_fwd(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return full_step, loss_fwd, opt, x


def _time_us(e) -> float:
    return float(e.time_range.elapsed_us())


def kernel_table(prof, cuda: bool, top: int = 15) -> tuple[str, int]:
    """(text, number of CUDA kernel events): the top kernels of a profile (CPU: top operators)."""
    from torch.autograd import DeviceType
    lines = []
    n_kernels = 0
    if cuda:
        agg = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                n_kernels += 1
                t, c = agg.get(e.name, (0.0, 0))
                agg[e.name] = (t + _time_us(e), c + 1)
        total = sum(t for t, _ in agg.values())
        lines.append(f"top {top} CUDA kernels of one training step: {n_kernels} kernel launches, "
                     f"{len(agg)} distinct kernels, {total / 1e3:.3f} ms of kernel time")
        lines.append(f"{'#':>3s} {'total ms':>9s} {'share':>6s} {'calls':>6s} {'mean us':>9s}  kernel")
        for i, (name, (t, c)) in enumerate(sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]):
            lines.append(f"{i + 1:3d} {t / 1e3:9.3f} {100 * t / max(total, 1e-9):5.1f}% {c:6d} "
                         f"{t / c:9.1f}  {name[:160]}")
    else:
        lines.append("no CUDA device: top operators by self CPU time instead of kernels")
    lines.append("")
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)):
        try:
            lines.append(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=80))
            break
        except Exception:  # noqa: BLE001 - the sort key's name differs between torch versions
            continue
    return "\n".join(lines) + "\n", n_kernels


def profile_step(full_step, x, device, path) -> dict:
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        full_step(x)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        full_step(x)
        sync()
    text, n_kernels = kernel_table(prof, cuda)
    with open(path, "w") as f:
        f.write(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}; torch "
                f"{torch.__version__}\n{text}")
    if cuda and n_kernels == 0:
        return {"profile": "FAIL: no CUDA kernel events recorded (CUPTI unavailable?)",
                "profile_file": path}
    return {"profile": "ok", "profile_file": path, "profile_kernel_launches": n_kernels}


def _frames(tb, limit=4) -> list[str]:
    fr = traceback.extract_tb(tb)
    return [f"{os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT) else f.filename}:"
            f"{f.lineno} in {f.name}: {(f.line or '').strip()[:120]}" for f in fr[-limit:]]


def sync_check(loss_fwd, opt, x, device) -> dict:
    """set_sync_debug_mode around one step's loss forward + backward (module docstring)."""
    if device.type != "cuda":
        return {"sync_check": "n/a (no CUDA device)"}
    loss, _ = loss_fwd(x)  # warm: first-call work (e.g. Triton compiles) is not the step's
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss, _ = loss_fwd(x)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        msg = str(w.message)
        if "synchroniz" in msg.lower():
            where = w.filename
            where = os.path.relpath(where, ROOT) if where.startswith(ROOT) else where
            found.append(f"{where}:{w.lineno}: {msg.splitlines()[0][:160]}")
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    res = {"sync_warnings": found[:20], "sync_warning_count": len(found)}
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = loss_fwd(x)
        loss.backward()
        torch.cuda.set_sync_debug_mode("default")
        res["sync_check"] = "PASS" if not found else "FAIL"
        if found:
            res["sync_offender"] = found[0]
    except RuntimeError as exc:
        torch.cuda.set_sync_debug_mode("default")
        res["sync_check"] = "FAIL"
        res["sync_offender"] = str(exc).strip().splitlines()[0][:300]
        res["sync_offender_frames"] = _frames(exc.__traceback__)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.zero_grad(set_to_none=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--data", default="synthetic:65536",
                    help="synthetic[:N] (default, train.py's loader, images made on the CPU), "
                    "synthetic-device[:N] (images made on the training device), or a train.py --data")
    ap.add_argument("--arch", default="resnet-tiny")
    ap.add_argument("--method", default="nac")
    ap.add_argument("--batch-size", type=int, default=256, help="global batch")
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=20, help="measured steps")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured first steps")
    ap.add_argument("--amp", default="auto")
    ap.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--loader", default="auto")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--queue-size", type=int, default=None)
    ap.add_argument("--profile-out", default=None, help="write the kernel profile of one step here")
    ap.add_argument("--sync-check", action="store_true", help="host-sync check of the loss")
    ap.add_argument("--json-out", default=None, help="also write the result JSON here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")

    import train
    from nac_fast.train import run as run_mod
    data = args.data
    if data == "synthetic-device" or data.startswith("synthetic-device:"):
        try:
            n_img = int(data.split(":", 1)[1]) if ":" in data else 65536
        except ValueError:
            ap.error(f"--data {data!r}: expected synthetic-device[:N] with an int N")
        run_mod.build_loader = _device_loader_factory(n_img)  # run.build calls it by name
    out = tempfile.mkdtemp(prefix="nac_tp_")
    total = args.warmup + args.steps
    targv = ["--data", data, "--arch", args.arch, "--method", args.method,
             "--batch-size", str(args.batch_size), "--max-steps", str(total),
             "--log-every", str(args.warmup), "--save-every", str(10 ** 9), "--no-progress",
             "--amp", args.amp, "--loader", args.loader, "--out", out,
             "--warmup-epochs", "0"]
    for flag, v in (("--image-size", args.image_size), ("--workers", args.workers),
                    ("--queue-size", args.queue_size)):
        if v is not None:
            targv += [flag, str(v)]
    if args.channels_last is not None:
        targv.append("--channels-last" if args.channels_last else "--no-channels-last")
    if args.compile:
        targv.append("--compile")
    # log-every = warmup: the log's first record covers the warm-up steps (compilation, first
    # allocations), the later ones only measured steps.  --steps is rounded up to whole windows.
    if args.steps % args.warmup:
        total = args.warmup * (1 + -(-args.steps // args.warmup))
        targv[targv.index("--max-steps") + 1] = str(total)
    status = train.main(targv)
    if status:
        sys.exit(status)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    with open(os.path.join(out, "log.jsonl")) as f:
        recs = [json.loads(line) for line in f][1:]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    # windows have equal step counts, so the mean of rates weights them by time correctly only
    # via the harmonic mean: total images / total time
    secs = sum(args.warmup * args.batch_size / r["img_per_s"] for r in recs)
    imgs = args.warmup * args.batch_size * len(recs)
    wait = sum(r["data_wait"] * args.warmup * args.batch_size / r["img_per_s"] for r in recs)
    dev = "cpu"
    if torch.cuda.is_available() and cfg.get("device") != "cpu":
        dev = torch.cuda.get_device_name(0)
    res = {"arch": args.arch, "method": args.method, "data": args.data,
           "batch_size": args.batch_size, "world_size": cfg["world_size"],
           "image_size": cfg["image_size"], "amp": cfg["amp"],
           "channels_last": cfg["channels_last"], "compile": args.compile, "device": dev,
           "torch": torch.__version__,
           "threads": torch.get_num_threads(), "measured_steps": len(recs) * args.warmup,
           "img_per_s": round(imgs / secs, 1), "data_wait": round(wait / secs, 4),
           "step_ms": round(1000 * secs / (len(recs) * args.warmup), 1)}
    shutil.rmtree(out, ignore_errors=True)
    failed = False
    if args.profile_out or args.sync_check:
        if cfg["world_size"] != 1:
            ap.error("--profile-out and --sync-check run in one process (no torchrun)")
        device = torch.device("cuda" if dev != "cpu" else "cpu")  # train.py's choice (above)
        import gc
        gc.collect()  # the throughput run's model and optimizer are garbage now: free them
        if device.type == "cuda":
            torch.cuda.empty_cache()
        full_step, loss_fwd, opt, x = _harness(args, device)
        if args.profile_out:
            res.update(profile_step(full_step, x, device, args.profile_out))
            failed |= res["profile"] != "ok"
        if args.sync_check:
            res.update(sync_check(loss_fwd, opt, x, device))
            failed |= res["sync_check"] == "FAIL"
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f)
            f.write("\n")
    print(json.dumps(res))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
