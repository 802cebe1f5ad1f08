"""What a run reports: the device-side loss watch, the log (JSONL, TensorBoard, progress bar),
and the summary at the end (the loss against its zero-code value, what to run next, and the
recipe's reference points from docs/results_summary.json).

    watch = LossWatch(step, device)    # every step: watch.update(loss), device ops only
    log = RunLog(out, main_rank, tensorboard=..., append=..., progress_total=..., initial=...)
    log.write(record)                  # one JSON line (+ TensorBoard scalars) at each log point
    print("\n".join(summary_lines(st, ...)))
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys

import torch

from . import distributed as nd

# OUT/tensorboard/: --tensorboard's event files (--overwrite deletes them)
TENSORBOARD = "tensorboard"


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
            self._tb = SummaryWriter(os.path.join(out, TENSORBOARD))
        if progress_total is not None:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=progress_total, initial=initial, dynamic_ncols=True,
                                 file=sys.stderr)
            except ImportError:
                print("(pip install tqdm for a progress bar)")

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


# The zero-code value of each method's logged loss (methods.zero_code_loss), as the summary names it
ZERO_CODE_NAME = {"nac": "D ln 2", "nac-mq": "2 D ln 2", "simclr": "ln(2B - 1)"}
# One line each: what the log's statistics say (docs/training.md "Reading a run" has more)
STAT_MEANINGS = {
    "code_mag": "mean |tanh a|: 0 = codes collapsed to zero, 1 = binary",
    "r_slope": "slope of r on tanh a: ~0 = the inference net ignores the codes",
    "balance_score": "1 = every bit +1 on half the images, 0 = every bit constant",
    "distinct_frac": "fraction of the batch's images with a code of their own",
}


def _checkout() -> str:
    from .config import CONFIG_DIR
    return os.path.dirname(CONFIG_DIR)


def _cmd(*parts) -> str:
    return " ".join(shlex.quote(p) for p in parts)


def summary_lines(st, flags, first_step: int, first_loss, last: dict | None, zero_loss: float,
                  seconds: float) -> list:
    """What train.py prints when a run ends well (rank 0): where it got, the loss (rounded) against
    its zero-code value, the commands to evaluate and plot this run, the last log point's
    statistics with their meanings, and the reference points of docs/results.md for this
    configuration (`flags`: the run's TrainConfig as parsed, before config.resolve)."""
    cfg = st.cfg
    out, ck = cfg.out, st.ckpt_path
    zname = f"{ZERO_CODE_NAME[cfg.method]} = {zero_loss:.2f}, the loss of codes that carry nothing"
    if first_loss is None and st.step < cfg.total_steps:   # resumed at or past --stop-at-step
        lines = [f"done: step {st.step}/{cfg.total_steps}: nothing to train (the checkpoint is at "
                 f"or past --stop-at-step {cfg.stop_at_step}; continue with --resume and a larger "
                 "--stop-at-step, or none)"]
    elif first_loss is None:
        lines = [f"done: step {st.step}/{cfg.total_steps}: nothing to train (the checkpoint is at "
                 f"the end of the schedule; a larger --max-steps with --resume extends it)"]
    else:
        now = last["loss"] if last else float("nan")
        lines = [f"done: step {st.step}/{cfg.total_steps} in {seconds / 60:.1f} min; loss "
                 f"{first_loss:.3f} (step {first_step + 1}) -> {now:.3f} ({zname})"]
    if st.step < cfg.total_steps and first_loss is not None:
        lines.append(f"  stopped at --stop-at-step {cfg.stop_at_step}: continue with the same "
                     "command plus --resume")
    if last:
        stats = [(k, last[k], m) for k, m in STAT_MEANINGS.items()
                 if isinstance(last.get(k), (int, float))]
        if stats:
            lines.append(f"  last log    step {last['step']} (docs/training.md \"Reading a run\"):")
            lines += [f"    {k:<13} {v:<7.3g} {m}" for k, v, m in stats]
    skipped = len(getattr(st.loader, "skipped_files", ()) or ())
    if skipped:
        lines.append(f"  data        {skipped} unreadable files skipped (--on-bad-file warn; the "
                     "loader's skipped_files lists them)")
    ref = reference_line(flags, cfg.world_size)
    if ref:
        lines.append(f"  reference   {ref}")
    plot = os.path.join(_checkout(), "scripts", "plot_train_log.py")
    # an evaluation or picture of this run's earlier state is replaced only by a command that
    # says so (the tools refuse an existing output without --overwrite)
    ev, png = os.path.join(out, "eval"), os.path.join(out, "curves.png")
    def again(path):
        return ["--overwrite"] if os.path.exists(path) else []
    evaluate = _cmd("python", "-m", "nac_fast.eval", "--checkpoint", ck, "--out", ev,
                    *again(os.path.join(ev, "report.json")))
    lines += [f"  checkpoint  {ck}", f"  evaluate    {evaluate}"]
    if os.path.isfile(plot):
        draw = _cmd("python", os.path.relpath(plot), os.path.join(out, "log.jsonl"), "--out", png,
                    *again(png))
        lines.append(f"  plot        {draw}")
    return lines


# What does not change what a run trains (its reference rows may differ in these)
_NOT_TRAINING = ("recipe", "out", "resume", "overwrite", "stop_at_step", "progress", "log_every",
                 "save_every", "tensorboard", "seed", "workers", "loader", "device", "compile",
                 "compile_backend", "loss_backend", "collapse_warn", "on_bad_file",
                 "channels_last", "amp")


def _row_config(cmd: str, root: str):
    """(TrainConfig as parsed, processes) of a results row's train.py command, or None."""
    from .config import parse
    argv = shlex.split(cmd)
    if "train.py" not in argv:
        return None
    nproc = next((int(t.split("=", 1)[1]) for t in argv if t.startswith("--nproc_per_node=")), 1)
    argv = argv[argv.index("train.py") + 1:]
    if "--config" in argv:
        i = argv.index("--config") + 1
        argv[i] = os.path.join(root, argv[i])
    try:
        return parse(argv), nproc
    except ValueError:
        return None


def reference_rows(flags, world_size: int, summary_path: str | None = None) -> dict:
    """{"this": rows, "simclr": rows, "random": rows, "budget": str}: the rows of
    docs/results_summary.json that trained what `flags` (a TrainConfig as parsed) trains: every
    training flag but the seed equal, as parsed from the row's train.py command, and as many
    processes; then SimCLR and the random-init encoder in the same grid at the same budget.
    Empty when the file is absent (an installed wheel) or has no such rows."""
    root = _checkout()
    path = summary_path or os.path.join(root, "docs", "results_summary.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        summary = json.load(f)
    mine = flags.to_dict()
    flag_keys = [k for k in mine if k not in _NOT_TRAINING]
    found = {}
    for grid, rows in summary.items():
        for r in rows:
            cmds = [c for c in r.get("commands", []) if "train.py" in c]
            if (r.get("variant") == "random" or not cmds
                    or f"--method {flags.method}" not in cmds[0]):
                continue
            if "--config" not in cmds[0] and r.get("default") is not True:
                continue  # trained with the default recipe of its day, not today's
            parsed = _row_config(cmds[0], root)
            if parsed is None:
                continue
            rc, nproc = parsed
            theirs = rc.to_dict()
            if nproc == world_size and all(theirs[k] == mine[k] for k in flag_keys):
                found.setdefault((grid, r.get("budget")), []).append(r)
    if not found:
        return {}
    (grid, budget), this = max(found.items(), key=lambda kv: len(kv[1]))

    def at_budget(variant):
        """The grid's own rows of `variant` at this budget, else another Fashion-MNIST grid's
        (the held-out data's sections, "heldout:<name>", are other data)."""
        for g in [grid] + [g for g in summary if g != grid and not g.startswith("heldout:")]:
            rows = [r for r in summary[g] if r.get("budget") == budget
                    and r.get("variant") == variant]
            if rows:
                return rows
        return []
    return {"this": this, "budget": budget, "simclr": at_budget("simclr"),
            "random": at_budget("random")}


def _mean(rows, get):
    vals = [get(r) for r in rows]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return 100 * sum(vals) / len(vals) if vals else None


def _figures(rows, bits: int) -> str:
    f = [_mean(rows, lambda r: (r.get("map") or {}).get(str(bits))),
         _mean(rows, lambda r: r.get("linear_top1")), _mean(rows, lambda r: r.get("knn_top1"))]
    return " / ".join("-" if v is None else f"{v:.1f}" for v in f)


def reference_line(flags, world_size: int) -> str | None:
    """One line: the mean figures of docs/results.md for this configuration, SimCLR and the
    random-init encoder at the same budget (mAP@all at D bits / linear top-1 / kNN top-1, %)."""
    try:
        ref = reference_rows(flags, world_size)
    except (OSError, ValueError, KeyError) as exc:  # a damaged results file: say so, go on
        return f"(docs/results_summary.json not read: {type(exc).__name__}: {exc})"
    if not ref:
        return None
    bits = flags.code_dim
    seeds = len(ref["this"])
    epochs = {m.group(1) for r in ref["this"] for c in r.get("commands", [])
              for m in [re.search(r"--linear-epochs (\d+)", c)] if m and "nac_fast.eval" in c}
    probe = f", linear probe {'/'.join(sorted(epochs))} epochs" if epochs else ""
    line = (f"docs/results.md, {ref['budget']}, mean of {seeds} seed{'s' * (seeds > 1)}{probe} "
            f"(mAP@all {bits} b / linear top-1 / kNN top-1, %): this configuration "
            f"{_figures(ref['this'], bits)}")
    if ref["simclr"]:
        line += f"; SimCLR {_figures(ref['simclr'], bits)}"
    if ref["random"]:
        line += f"; random-init encoder {_figures(ref['random'], bits)}"
    return line
