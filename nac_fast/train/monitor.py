"""What a run reports: the device-side loss watch, and the log (JSONL, TensorBoard, progress bar).

    watch = LossWatch(step, device)    # every step: watch.update(loss), device ops only
    log = RunLog(out, main_rank, tensorboard=..., append=..., progress_total=..., initial=...)
    log.write(record)                  # one JSON line (+ TensorBoard scalars) at each log point
"""
from __future__ import annotations

import json
import os
import sys

import torch

from . import distributed as nd


class LossWatch:
    """What the loop needs from the per-step losses, kept on the device so that a step never
    waits for the host to read its loss.

    update(loss) (every step, device ops only) counts steps in a device tensor, records the FIRST
    step whose loss is non-finite and that loss (torch.where), and sums the window's losses.
    first_non_finite() and read_window() read them (a host sync and, with several processes, a
    collective: every rank calls them at the same steps): at log points and before saves."""

    NONE = 2 ** 62  # "no non-finite loss yet" (larger than any step: the ranks' MIN is the first)

    def __init__(self, step: int, device):
        self.step = torch.tensor(step, dtype=torch.int64, device=device)
        self.first_bad = torch.tensor(self.NONE, dtype=torch.int64, device=device)
        self.bad_value = torch.zeros((), dtype=torch.float32, device=device)
        self.win_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.win_n = 0
        self.first = None

    def update(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self.step += 1
        new = torch.isfinite(loss).logical_not_() & (self.first_bad == self.NONE)
        self.first_bad = torch.where(new, self.step, self.first_bad)
        self.bad_value = torch.where(new, loss, self.bad_value)
        self.win_sum += loss
        self.win_n += 1
        if self.first is None:
            self.first = loss

    def first_non_finite(self):
        """(step, global loss at that step) of the first non-finite loss on any rank, or None.
        The value is the mean over the ranks whose loss went non-finite at that step (others count
        0): nan or +-inf like the mean over all ranks."""
        fb = self.first_bad.clone()
        if nd.is_dist():
            torch.distributed.all_reduce(fb, op=torch.distributed.ReduceOp.MIN)
        fb_step = int(fb)
        if fb_step == self.NONE:
            return None
        v = torch.where(self.first_bad == fb, self.bad_value, torch.zeros_like(self.bad_value))
        return fb_step, float(nd.all_reduce_mean(v))

    def read_window(self, loss: torch.Tensor):
        """(this step's loss, mean loss since the last read), both averaged over the ranks, as
        Python floats; starts a new window."""
        vals = nd.all_reduce_mean(torch.stack([loss.detach().float(),
                                               self.win_sum / max(self.win_n, 1)]))
        self.win_sum.zero_()
        self.win_n = 0
        loss_g, loss_avg = vals.tolist()
        return loss_g, loss_avg

    def first_loss(self):
        """The first step's loss of this process, averaged over the ranks (None without steps)."""
        return None if self.first is None else float(nd.all_reduce_mean(self.first))


class RunLog:
    """OUT/log.jsonl (one JSON object per log point), OUT/tensorboard/ with --tensorboard (every
    numeric field as a scalar, x = step), and a tqdm progress bar; rank 0 only, the other ranks
    get a log that does nothing.  A resumed run appends (its first records may repeat steps
    after the checkpoint, if the previous process got further); a fresh run starts anew."""

    def __init__(self, out: str, main_rank: bool, *, tensorboard: bool = False,
                 append: bool = False, progress_total: int | None = None, initial: int = 0):
        self.main = main_rank
        self._f = self._tb = self._bar = None
        if not main_rank:
            return
        os.makedirs(out, exist_ok=True)
        self._f = open(os.path.join(out, "log.jsonl"), "a" if append else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(out, "tensorboard"))
        if progress_total is not None:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=progress_total, initial=initial, dynamic_ncols=True,
                                 file=sys.stderr)
            except ImportError:
                print("(pip install tqdm for a progress bar)")

    def say(self, *a, **k) -> None:
        if self.main:
            print(*a, **k)

    def tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def write(self, rec: dict) -> None:
        if not self.main:
            return
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, rec["step"])
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.3g}",
                                  img_s=f"{rec['img_per_s']:.0f}",
                                  wait=f"{100 * rec['data_wait']:.0f}%")

    def close(self) -> None:
        for h in (self._bar, self._tb, self._f):
            if h is not None:
                h.close()
