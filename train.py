"""Pretrain an encoder with Neural Activation Coding (NAC, ICML 2021), NAC-MQ or SimCLR.

One process (CPU or one GPU), or several with torchrun (DDP; gloo on CPU, NCCL on GPUs):
    python train.py --out runs/demo                   # Fashion-MNIST, CPU-sized defaults
    torchrun --nproc_per_node=2 train.py --out runs/demo   # what `make train` runs (2 CPU processes)
    torchrun --nproc_per_node=2 train.py --flip-prob 0.4 --out runs/p04
    torchrun --nproc_per_node=8 train.py --config configs/imagenet_nac_mq.toml --data /path/imagenet
    torchrun --nproc_per_node=8 train.py --config configs/cifar10_hashing.toml --data /path/cifar10
Several machines: the same command on every node plus torchrun's rendezvous flags
(--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=JOB).

Recipes are TOML files of flag values (configs/): without --config, data of more than 200,000
training images or larger than 96 px gets configs/imagenet.toml, smaller data configs/small.toml
(nac_fast/train/config.py auto_recipe), and any flag on the command line overrides the recipe
(train.py --help shows the values a run uses and the recipe file).  --batch-size is GLOBAL (all
processes).  Outputs in --out: last.pt and prev.pt (the newest checkpoint and the one before),
log.jsonl (and tensorboard/ with --tensorboard), config.json (the resolved configuration),
status.json (how the run ended).  A fresh run refuses an --out that holds a run; continue one
with the same command plus --resume (a larger --max-steps extends it); under torchrun
--max-restarts=K a restarted worker group resumes by itself.  Exit status: 0 done, 2 bad flags,
recipe, data, --out or checkpoint, 3 non-finite loss, 4 --out could not be written; the last line
says which ("train.py: exit status N", also under torchrun, which exits 1 on any failure).
On a GPU the encoders run torch.compile'd (the start line says what, the first step's line
what it cost; --no-compile: eager, for debugging).  Evaluate: python -m nac_fast.eval
--checkpoint OUT/last.pt.  The objectives: docs/math.md; the parts: nac_fast/train/; the flags,
speed and fault tolerance: docs/training.md.
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from nac_fast.train import distributed as nd
from nac_fast.train.config import UsageError, parse
from nac_fast.train.methods import (code_stats, collapse_warning, gain_stats, learning_stats,
                                    zero_code_loss)
from nac_fast.train.monitor import LossWatch, RunLog, summary_lines
from nac_fast.train.run import (EXIT_USAGE, RunStopped, build, describe_l2, describe_p,
                                finish, flip_prob_of, lr_at, plan_start, prepare_batch,
                                print_main, remove_unused_out, save, start,
                                stop_non_finite, train_step, write_status)


def main(argv=None) -> int:
    di = st = plan = None
    try:
        nd.adopt_slurm_env()  # `srun python train.py`: SLURM's variables as torchrun's
    except nd.LaunchError as exc:  # a partial or contradictory set: one line, nothing written
        return finish(EXIT_USAGE, str(exc))
    try:
        cfg = parse(argv)  # the command line over the recipe over the built-in values
        di = nd.init_distributed(cfg.device)
        plan = plan_start(cfg, di)  # before the data is read: --out free or resumable, writable
        st = build(cfg, di)
        start(st, plan)  # --resume, or by itself in a restarted torchrun worker group
        train(st, cfg)
        return finish(0, di=di, st=st)
    except nd.LaunchError as exc:  # torchrun's variables, or the GPUs, do not fit: one line
        return finish(EXIT_USAGE, str(exc), di)
    except UsageError as exc:  # flags, recipe, data, checkpoint (a bad file: also in training)
        began = st is not None and st.began
        if not began and plan is not None:
            give_up(plan)  # the --out this call made, still empty
        return finish(EXIT_USAGE, str(exc), di, st if began else None)
    except RunStopped as exc:
        started = st is not None and (st.began or st.cfg.run_id is not None
                                      and exc.status != EXIT_USAGE)
        if not started and plan is not None:
            give_up(plan)
        return finish(exc.status, str(exc), di, st if started else None)
    except Exception as exc:  # a bug (status 1, traceback): recorded, not left "running"
        if st is not None and st.began and di is not None and di.is_main:
            try:
                write_status(st.cfg, 1, f"{type(exc).__name__}: {exc}", st.step)
            except OSError:
                pass
        elif plan is not None:
            give_up(plan)
        raise
    finally:
        if plan is not None and plan.lock is not None:
            plan.lock.release()  # after the last write to --out (finish: status.json)
        if nd.is_dist():
            torch.distributed.destroy_process_group()


def give_up(plan) -> None:
    """A run that stopped before it began: its lock (and lock file) go, then the --out folders
    this call created, when empty."""
    if plan.lock is not None:
        plan.lock.release()
    remove_unused_out(plan.created)


def train(st, flags) -> None:
    """The training loop from st.step to the end (or --stop-at-step): logs, checkpoints, the
    summary (`flags`: the configuration as parsed, for its reference points); RunStopped at a
    non-finite loss or a checkpoint that cannot be written."""
    cfg, di = st.cfg, st.di
    print_main(di, f"NAC pretraining: method={cfg.method} arch={cfg.arch} data={cfg.data} "
                   f"({cfg.num_images} images, {cfg.image_size}px, {cfg.in_channels} ch) "
                   f"recipe={os.path.relpath(cfg.recipe)} world={cfg.world_size} "
                   f"device={di.device} batch={cfg.batch_size} "
                   + (f"({cfg.batch_note}) " if cfg.batch_note else "") + f"lr={cfg.lr:.4g} "
                   + (f"p={describe_p(cfg)} " if cfg.method != "simclr" else "")
                   + (f"l2={describe_l2(cfg)} " if cfg.method == "nac-mq" else "") +
                   ("likelihood=multilinear (reference loss: no fused kernel) "
                    if cfg.method != "simclr" and cfg.channel_likelihood == "multilinear"
                    else "") +
                   ("self_key=exclude " if cfg.self_key == "exclude" else "") +
                   (f"noise_draws={cfg.noise_draws} " if cfg.noise_draws != 1 else "") +
                   f"steps={cfg.total_steps} ({cfg.steps_per_epoch}/epoch, warm-up "
                   f"{cfg.warmup_steps}) amp={cfg.amp} compile="
                   + ("off " if st.compiled is None else f"{st.compiled}, at the first step ")
                   + f"out={cfg.out}")
    stop = min(cfg.total_steps, cfg.stop_at_step or cfg.total_steps)
    log = RunLog(cfg.out, di.is_main, tensorboard=cfg.tensorboard, append=bool(st.resumed_from),
                 progress_total=cfg.total_steps if cfg.progress else None, initial=st.step)
    watch = LossWatch(st.step, di.device)  # the loss stays on the device between log points
    st.net.train()
    if st.mom_model is not None:
        st.mom_model.train()
    last, spe, first_step = None, cfg.steps_per_epoch, st.step
    zero_loss = zero_code_loss(cfg.method, cfg.code_dim, cfg.batch_size)
    warned = cfg.method == "simclr"  # the collapse warning (once): NAC's codes only
    win_t, win_wait, win_img = time.perf_counter(), 0.0, 0
    st.t_start = time.perf_counter()   # the log's elapsed_s goes on from the checkpoint's
    compile_pending, compile_s = st.compiled is not None, None
    try:
        while st.step < stop:
            st.loader.set_epoch(st.step // spe, start_batch=st.step % spe)
            it = iter(st.loader)
            while st.step < stop:
                t0 = time.perf_counter()
                try:
                    v1, v2 = next(it)
                except StopIteration:
                    break
                except ValueError as exc:  # a bad file under --on-bad-file error (status 2)
                    raise UsageError(f"--data {cfg.data!r}: {exc}") from exc
                t1 = time.perf_counter()
                win_wait += t1 - t0
                x = prepare_batch(st, v1, v2)
                lr_now = lr_at(cfg, st.step)  # the lr this update uses
                loss, a = train_step(st, x)
                if compile_pending:  # once: the first step compiled; wait for it to finish
                    compile_s = first_step_seconds(di.device, t1)
                    compile_pending = False
                    print_main(di, f"compiled at step {st.step}: {compile_s:.1f} s, one-time "
                                   "(the compilation and the step itself; --no-compile: eager)")
                watch.update(loss)
                step = st.step
                win_img += cfg.batch_size
                log.tick()
                log_due, save_due = step % cfg.log_every == 0, step % cfg.save_every == 0
                if not (log_due or save_due or step == stop):
                    continue
                # Checked here, so no checkpoint is written after a non-finite loss (steps after
                # it up to here did update the weights in memory: the step never waits to read
                # its loss).
                bad = watch.first_non_finite()
                if bad is not None:
                    stop_non_finite(st, bad)
                if log_due or step == stop:
                    loss_now, loss_avg = watch.read_window(loss)  # waits for the window's work
                    dt = time.perf_counter() - win_t
                    rec = {"step": step, "epoch": (step - 1) // spe, "loss": loss_now,
                           "loss_avg": loss_avg,
                           "elapsed_s": round(st.elapsed(), 3), "lr": lr_now,
                           "img_per_s": win_img / dt, "data_wait": win_wait / dt}
                    if cfg.method != "simclr":  # the channel's p of this update
                        rec["flip_prob"] = flip_prob_of(cfg, step - 1)
                    if compile_s is not None:  # the first record after the compiling step
                        rec["first_step_s"], compile_s = round(compile_s, 3), None
                    if di.is_main:  # statistics of this rank's view-1 rows (a host read)
                        k = a.shape[0] // 2
                        rec.update(code_stats(a[:k]))
                        rec.update(learning_stats(a[:k], None if st.last_r is None
                                                  else st.last_r[:k], loss_now, zero_loss))
                        rec.update(gain_stats(st.model))
                    log.write(rec)
                    last = rec
                    warning = None if warned else collapse_warning(step, cfg.warmup_steps, rec,
                                                                   cfg.collapse_warn)
                    if warning:
                        print(warning, file=sys.stderr, flush=True)
                        warned = True
                    win_t, win_wait, win_img = time.perf_counter(), 0.0, 0
                if save_due or step == stop:
                    t_save = time.perf_counter()
                    save(st)  # RunStopped on every rank when it could not be written
                    win_t += time.perf_counter() - t_save  # img/s measures training, not saving
    finally:
        log.close()
    first_loss = watch.first_loss()
    if di.is_main:
        print("\n".join(summary_lines(st, flags, first_step, first_loss, last, zero_loss,
                                      time.perf_counter() - st.t_start)), flush=True)


def first_step_seconds(device, t0: float) -> float:
    """Seconds from t0 to the end of the first step's device work (a host sync, once per run:
    the step that compiled; the steps after it never wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


if __name__ == "__main__":
    # @record: an unexpected exception's traceback reaches torchrun's report (its error file)
    sys.exit(record(main)())
