"""Pretrain an encoder with Neural Activation Coding (NAC, ICML 2021), NAC-MQ or SimCLR.

One process (CPU or one GPU), or several with torchrun (DDP; gloo on CPU, NCCL on GPUs):
    python train.py                                   # Fashion-MNIST, CPU-sized defaults
    torchrun --nproc_per_node=2 train.py              # the default run: 2 CPU processes
    torchrun --nproc_per_node=2 train.py --flip-prob 0.4   # torchrun takes "--p" for its own flag
    torchrun --nproc_per_node=8 train.py --config configs/imagenet_nac_mq.toml --data /path/imagenet
Several machines: the same command on every node plus torchrun's rendezvous flags
(--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=JOB).

Recipes are TOML files of flag values (configs/; nac_fast/train/config.py resolves them): an
ImageFolder root gets configs/imagenet.toml, other data configs/fashion_mnist.toml, and any flag
on the command line overrides the recipe.  --batch-size is GLOBAL (all processes).  Outputs in
--out: last.pt and prev.pt (the newest checkpoint and the one before), log.jsonl (and
tensorboard/ with --tensorboard), config.json.  Resume with the same command plus --resume
(a larger --max-steps extends the run); under torchrun --max-restarts=K a restarted worker group
resumes by itself.  Exit status: 0 done, 2 bad flags or checkpoint, 3 non-finite loss, 4 a
checkpoint could not be written (README "Fault tolerance").  Evaluate: python -m nac_fast.eval
--checkpoint OUT/last.pt.  The objectives: docs/math.md; the parts: nac_fast/train/.
"""
from __future__ import annotations

import sys
import time

import torch

from nac_fast.train import distributed as nd
from nac_fast.train.config import build_parser, parse
from nac_fast.train.methods import code_stats, collapse_warning, learning_stats, zero_code_loss
from nac_fast.train.monitor import LossWatch, RunLog
from nac_fast.train.run import (RunStopped, build, print_main, save, start, stop_non_finite,
                                train_step)


def main(argv=None) -> int:
    parser = build_parser()
    args = parse(argv, parser)  # the command line over the recipe; usage errors exit 2
    di = nd.init_distributed(args.device)
    try:
        try:
            st = build(args, di)
            start(st)  # --resume, or by itself in a restarted torchrun worker group
        except ValueError as exc:
            parser.error(str(exc))
        except RunStopped as exc:
            print_main(di, exc, file=sys.stderr)
            return exc.status
        return train(st)
    finally:
        if nd.is_dist():
            torch.distributed.destroy_process_group()


def train(st) -> int:
    args, di, run = st.args, st.di, st.run
    print_main(di, f"NAC pretraining: method={args.method} arch={args.arch} data={args.data} "
                   f"({st.loader.num_images} images, {st.loader.image_size}px, "
                   f"{st.loader.in_channels} ch) recipe={args.recipe} world={di.world_size} "
                   f"device={di.device} batch={args.batch_size} lr={run.lr:.4g} "
                   f"steps={run.total_steps} ({run.steps_per_epoch}/epoch, warm-up "
                   f"{run.warmup_steps}) amp={run.amp}")
    stop = min(run.total_steps, args.stop_at_step or run.total_steps)
    log = RunLog(args.out, di.is_main, tensorboard=args.tensorboard, append=bool(st.resumed_from),
                 progress_total=run.total_steps if args.progress else None, initial=st.step)
    watch = LossWatch(st.step, di.device)  # the loss stays on the device between log points
    st.net.train()
    if st.mom_model is not None:
        st.mom_model.train()
    status, last_loss, step, spe = 0, None, st.step, run.steps_per_epoch
    zero_loss = zero_code_loss(args.method, args.code_dim, args.batch_size)
    warned = args.method == "simclr"  # the collapse warning (once): NAC's codes only
    win_t, win_wait, win_img, t_start = time.perf_counter(), 0.0, 0, time.perf_counter()
    while step < stop and status == 0:
        st.loader.set_epoch(step // spe, start_batch=step % spe)
        it = iter(st.loader)
        while step < stop:
            t0 = time.perf_counter()
            try:
                v1, v2 = next(it)
            except StopIteration:
                break
            win_wait += time.perf_counter() - t0
            # each view to the device first: a cat of pinned host tensors is pageable
            x = torch.cat([v1.to(di.device, non_blocking=True), v2.to(di.device, non_blocking=True)])
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            lr_now = st.optimizer.param_groups[0]["lr"]  # the lr this update uses
            loss, a = train_step(st, x)
            watch.update(loss)
            step += 1
            win_img += args.batch_size
            log.tick()
            log_due, save_due = step % args.log_every == 0, step % args.save_every == 0
            if not (log_due or save_due or step == stop):
                continue
            # Checked here, so no checkpoint is written after a non-finite loss (steps after it up
            # to here did update the weights in memory: the step never waits to read its loss).
            bad = watch.first_non_finite()
            if bad is not None:
                status = stop_non_finite(st, bad, step)
                break
            if log_due or step == stop:
                last_loss, loss_avg = watch.read_window(loss)  # waits for the window's work
                dt = time.perf_counter() - win_t
                rec = {"step": step, "epoch": (step - 1) // spe, "loss": last_loss,
                       "loss_avg": loss_avg, "elapsed_s": round(time.perf_counter() - t_start, 3),
                       "lr": lr_now, "img_per_s": win_img / dt, "data_wait": win_wait / dt}
                if di.is_main:  # statistics of this rank's view-1 rows (a host read: log points)
                    k = a.shape[0] // 2
                    rec.update(code_stats(a[:k]))
                    rec.update(learning_stats(a[:k], None if st.last_r is None else st.last_r[:k],
                                              last_loss, zero_loss))
                log.write(rec)
                warning = None if warned else collapse_warning(step, run.warmup_steps, rec,
                                                               args.collapse_warn)
                if warning:
                    print(warning, file=sys.stderr, flush=True)
                    warned = True
                win_t, win_wait, win_img = time.perf_counter(), 0.0, 0
            if save_due or step == stop:
                t_save = time.perf_counter()
                status = save(st, step)  # 0, or 4 on every rank when it could not be written
                win_t += time.perf_counter() - t_save  # img/s measures training, not saving
                if status:
                    break
    first_loss = watch.first_loss() if status == 0 else None
    log.close()
    if status == 0:
        print_main(di, f"done: step {step}/{run.total_steps}, loss {first_loss} -> {last_loss}; "
                       f"checkpoint {st.ckpt_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
