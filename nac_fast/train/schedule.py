"""Per-step learning-rate schedule: linear warm-up, then cosine decay to 0 (docs/math.md
[M:schedule])."""
from __future__ import annotations

import math

from .. import _checks


class WarmupCosine:
    """Multiplier of the base lr at optimizer step `step` (0-based): lr(step) / base_lr of
    docs/math.md [M:schedule] (the first update already uses a small non-zero lr)."""

    def __init__(self, warmup_steps: int, total_steps: int):
        _checks.int_in("warmup_steps", warmup_steps, 0)
        _checks.int_in("total_steps", total_steps, 0)
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if warmup_steps > total_steps:
            raise ValueError(f"warmup_steps ({warmup_steps}) must not exceed total_steps "
                             f"({total_steps})")
        self.warmup_steps, self.total_steps = warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        # a negative step would give a negative (or zero) lr, a float one an lr between steps
        _checks.int_in("step", step, 0)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * t))


def get_lr(step: int, base_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of the update at optimizer step `step` (0-based), as nanoGPT's get_lr: a
    function of the step alone, so a resumed or extended run needs no scheduler state (the
    multiplication LambdaLR did, base_lr * factor, in the same order: the same float).
    ValueError naming the argument for a step that is not an int >= 0 or a base_lr that is not
    a finite float >= 0."""
    _checks.nonnegative_float("base_lr", base_lr, finite=True)
    return base_lr * WarmupCosine(warmup_steps, total_steps)(step)


def p_schedule_shortfalls(min_steps: int | None, total_steps: int, min_images: int | None = None,
                          batch_size: int | None = None) -> list[str]:
    """The thresholds of the p schedule ([M:p-schedule]) a run of total_steps optimizer steps at
    global batch batch_size falls short of, as "153,600 images seen < 450,000" /
    "5 steps < 6" (images first); empty where every threshold set holds (None: no condition).
    ValueError naming batch_size where min_images is set without a positive batch."""
    short = []
    if min_images is not None:
        if batch_size is None:
            raise ValueError("batch_size: needed with min_images (images seen = steps x batch)")
        _checks.positive_int("batch_size", batch_size)
        if total_steps * batch_size < min_images:
            short.append(f"{total_steps * batch_size:,} images seen < {min_images:,}")
    if min_steps is not None and total_steps < min_steps:
        short.append(f"{total_steps} steps < {min_steps}")
    return short


def p_schedule_applies(p1: float | None, min_steps: int | None, total_steps: int,
                       min_images: int | None = None, batch_size: int | None = None) -> bool:
    """Whether a run of total_steps optimizer steps at global batch batch_size follows the p
    schedule towards p1 (--flip-prob-final; None: no schedule), docs/math.md [M:p-schedule]: only
    runs of at least min_steps steps (--flip-prob-final-min-steps) that see at least min_images
    training images, total_steps x batch_size (--flip-prob-final-min-images), do; a threshold of
    None is no condition (`p_schedule_shortfalls` names the ones a run misses)."""
    return p1 is not None and not p_schedule_shortfalls(min_steps, total_steps, min_images,
                                                        batch_size)


def flip_prob_at(step: int, p0: float, p1: float | None, total_steps: int) -> float:
    """The channel's flip probability at optimizer step `step` (0-based), docs/math.md
    [M:p-schedule]: p0 at the first step rising linearly to p1 at the last (total_steps - 1);
    p1 = None: p0 throughout.  A function of the step alone, as get_lr.  ValueError/TypeError
    naming the argument for a step < 0, total_steps < 1 or a p outside (0, 0.5)."""
    _checks.int_in("step", step, 0)
    _checks.positive_int("total_steps", total_steps)
    p0 = _checks.flip_prob("p0", p0)
    if p1 is None:
        return p0
    p1 = _checks.flip_prob("p1", p1)
    t = min(1.0, step / max(1, total_steps - 1))
    return p0 + (p1 - p0) * t
