"""One training step's loss for each method, and the code statistics that are logged.

    loss, a = nac_step(model, x, p)                                   # in-batch NAC
    loss, a = nac_mq_step(model, momentum_model, queue, x, p, l2)     # NAC-MQ
    loss, a = simclr_step(model, x, tau=0.5)                          # SimCLR NT-Xent baseline
    code_stats(a) -> {"distinct_frac", "mean_hamming", "balance_score", "code_sat"}
    learning_stats(a, r, loss, zero_code_loss(method, D, batch)) -> {"code_mag", "r_mag",
                                                                     "r_slope", "loss_excess"}
    collapse_warning(...)                                             # the one-line warning

`x` is this rank's batch of both views, cat([view1, view2]) (2K rows; row i and row i+K are two
views of one image).  `model` may be wrapped in DistributedDataParallel: it is called once per
step.

Precision.  Under autocast (AMP) the NAC losses get the codes in the autocast dtype (bf16/fp16
a, r, r_hat, keys and queue; `loss_dtype`), with no float32 copy: the fused kernels widen each tile
and compute tanh, the code-similarity logits' accumulation, the logsumexp, the Bernoulli term and
the reductions in float32, and return a float32 loss; `nac_vi_loss` widens its (2K, D) inputs to
float32 itself.  Without AMP everything is float32 as before (float64 inputs stay float64).
SimCLR keeps its own path: the head output is normalised in float32, the logits' matmul is left to
autocast (bf16 under AMP), the cross-entropy runs in float32.

Host syncs.  nac_step and nac_mq_step never read device data on the host when the loss-input value
checks are off, which is how train.py runs them (`step_value_checks`): on a GPU the host can queue
whole steps ahead.  tests/test_sync_free.py proves it on the CPU under a dispatch mode that fails
on every host-reading op; on a GPU, wrap a warmed-up step in
torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import distributed as nd
from ..ops import loss as _loss
from ..codestats import code_statistics
from ..ops.loss import nac_loss, nac_mq_loss, nac_vi_loss
from ..ops.noise import draw_noise
from .models import swap_halves

METHODS = ("nac", "nac-mq", "simclr")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or float64 if it already is (double-precision tests)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def loss_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the NAC losses get their inputs in for model output `t`: the autocast dtype of
    t's device when autocast is on there (bf16 by default on GPU), else t's own dtype (float32;
    float64 in double-precision tests, which autocast never narrows)."""
    if t.dtype == torch.float64:
        return t.dtype
    dev = t.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def step_value_checks():
    """The loss-input value checks of a training step, as train.py runs it: a context manager
    that turns the data-reading checks (NaN/inf, noise +-1; nac_fast.ops.loss.CHECK_VALUES) off, since
    train.py checks the loss itself (NaN and inf inputs reach it) without a host sync per step.
    NAC_FAST_CHECK_INPUTS=1 (CHECK_VALUES True) keeps them on, on every device."""
    return _loss.value_checks(True if _loss.CHECK_VALUES is True else False)


def nac_step(model, x, p, noise=None, backend="auto", *, out=None, freeze_codes=False):
    """In-batch NAC (docs/math.md [M:inbatch]), cross-pathway r.

    Queries are this rank's 2K rows; keys are the clean codes of the GLOBAL batch, all-gathered
    with gradient (so every rank's rows receive the gradient they get in one big process).
    noise: None = drawn from torch's RNG; or an explicit (2K, D) +-1 tensor.
    backend: the loss backend (nac_fast.nac_loss's `backend`).
    out: a dict that receives "r", the inference logits (detached), for the log's statistics.
    freeze_codes: the loss's gradient reaches only the inference network (a and phi's input h
    detached): the inference network's warm-up (train.py --infer-warmup-steps).
    Returns (loss, a) with a = the head pre-activations (for code statistics).
    """
    _, a, r = model(x, detach_r_input=freeze_codes)
    if out is not None:
        out["r"] = r.detach()
    dt = loss_dtype(a)
    a_l, r_l = a.to(dt), r.to(dt)  # no-ops unless the model's output dtype differs
    if freeze_codes:
        a_l = a_l.detach()
    keys = nd.all_gather_with_grad(torch.tanh(a_l)) if nd.is_dist() else None
    return nac_loss(a_l, r_l, p, keys=keys, noise=noise, backend=backend), a


def nac_mq_step(model, momentum_model, queue, x, p, l2, noise=None, shuffle_bn=True,
                backend="auto", *, out=None, freeze_codes=False):
    """NAC-MQ (docs/math.md [M:mq]) plus the online inference net's VI term [M:vi].

    The momentum model (EMA of encoder, head and inference net; updated by the caller after the
    optimizer step) gives the keys v = tanh(a_m) of both views and r_hat = phi_m(h_m of the other
    view).  The keys of the whole global batch are enqueued BEFORE the loss, so every query sees
    its partner's key.  shuffle_bn: MoCo's batch shuffle across ranks for the momentum forward.
    The queue is handed to the loss as it is stored when its dtype is the loss dtype (create it
    with CodeQueue(..., dtype=<autocast dtype>) under AMP, as train.py does); otherwise it is
    converted, (M, D) elements per step.
    out, freeze_codes: as for nac_step (r: the online inference net's logits; with freeze_codes
    only the VI term trains, the codes get no gradient).
    """
    _, a, r = model(x, detach_r_input=True)  # r: online inference net on sg(h), VI term only
    if out is not None:
        out["r"] = r.detach()
    with torch.no_grad():
        xs, idx = nd.batch_shuffle(x) if shuffle_bn else (x, None)
        hm, am = momentum_model.encode(xs)
        hm, am = nd.batch_unshuffle(hm, idx), nd.batch_unshuffle(am, idx)
        r_hat = momentum_model.infer_logits(swap_halves(hm))
        # tanh in float32 whatever the AMP dtype; enqueue rounds to the queue's dtype
        queue.enqueue(nd.all_gather_nograd(torch.tanh(_acc(am))))
    dt = loss_dtype(a)
    a_l = a.to(dt)
    if freeze_codes:
        a_l = a_l.detach()
    if noise is None:
        noise = draw_noise(a_l.shape, p, device=a_l.device, dtype=dt)
    codes = queue.codes if queue.codes.dtype == dt else queue.codes.to(dt)
    loss = nac_mq_loss(a_l, r_hat.to(dt), codes, p, l2=l2, noise=noise, backend=backend)
    # One channel sample per step for both terms (the VI term sees the same z~ as the MQ term).
    vi = nac_vi_loss(a_l, r.to(dt), p, noise=noise)
    return loss + vi, a


def simclr_step(model, x, tau=0.5):
    """SimCLR's NT-Xent on the head outputs, negatives from the global batch (with gradient)."""
    _, a, _ = model(x, with_r=False)
    z = F.normalize(_acc(a), dim=1)
    keys = nd.all_gather_with_grad(z)
    n, k = z.shape[0], z.shape[0] // 2
    off = nd.rank() * n  # this rank's rows start here in the gathered keys
    idx = torch.arange(n, device=z.device)
    logits = (z @ keys.t()) / tau
    self_mask = torch.zeros_like(logits, dtype=torch.bool)
    self_mask[idx, off + idx] = True
    logits = logits.masked_fill(self_mask, float("-inf"))
    return F.cross_entropy(logits, off + (idx + k) % n), a


@torch.no_grad()
def code_stats(a: torch.Tensor) -> dict:
    """The training log's code statistics of the batch's hash codes c = sgn(a) (docs/math.md
    [M:code]), from nac_fast.codestats.code_statistics (exact, O(nD)):
    distinct_frac  fraction_distinct, [M:distinct] (1.0 = every row has its own code)
    mean_hamming   mean_pairwise_hamming, [M:mean-hamming] (D/2 for random codes)
    balance_score  1 - 2 balance_dev, [M:balance-score] (1 = every bit 50/50, 0 = every bit
                   constant; logs written before the rename call it bit_balance)
    code_sat       [M:code-sat] (1 = binary codes)."""
    a = a.detach().float()
    st = code_statistics(a)
    return {"distinct_frac": st.fraction_distinct, "mean_hamming": st.mean_pairwise_hamming,
            "balance_score": 1.0 - 2.0 * st.balance_dev,
            "code_sat": float(torch.tanh(a).abs().mean())}


# ---- what the training log records about learning (docs/math.md [M:z0], [M:floor]) ----------

def zero_code_loss(method: str, code_dim: int, global_batch: int) -> float:
    """The logged loss's zero-code value Z: its minimum over the inference logits when every
    code is zero (docs/math.md [M:z0], which derives both NAC values).

      nac      D ln 2      at z = 0 every similarity logit is 0, lse - log N = 0 exactly, and the
                           Bernoulli part is sum_d log(2 cosh(r_d / 2)) >= D ln 2 (= at r = 0)
      nac-mq   2 D ln 2    the logged loss is loss + vi: two such Bernoulli parts (r_hat and r),
                           the queue's keys and the l2 term contribute 0 at z = 0
      simclr   ln(2B - 1)  NT-Xent when all embeddings are equal (every logit the same), 2B - 1
                           the other rows of the global batch of B images

    loss - Z < 0 means the codes carry information the loss rewards; at zero codes the excess
    is sum_d log cosh(r_d / 2) >= 0."""
    if method == "nac":
        return code_dim * math.log(2.0)
    if method == "nac-mq":
        return 2.0 * code_dim * math.log(2.0)
    if method == "simclr":
        return math.log(2 * global_batch - 1)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@torch.no_grad()
def learning_stats(a: torch.Tensor, r, loss: float | None = None,
                   zero_loss: float | None = None) -> dict:
    """Whether the codes and the inference network learn, from the rows of one logged batch
    (called at log points only: it reads device data).

      code_mag     mean |tanh(a)| over the rows and bits (0 = zero codes, 1 = binary)
      r_mag        mean |r|, the inference logits' magnitude
      r_slope      least-squares slope of r on z = tanh(a) over all rows and bits, with one
                   intercept per bit: sum (z - zbar_d)(r - rbar_d) / sum (z - zbar_d)^2
                   (zbar_d, rbar_d the bit's means over the rows; None when z is constant).
                   r_i is predicted from row i's partner view; at small codes the Bernoulli term
                   is best served by r = 2 atanh((1 - 2p) z) ~ 2 (1 - 2p) z (slope 1.6 at
                   p = 0.1) when the partner's code is the row's own: ~0 means r ignores the code
      loss_excess  loss - zero_loss (zero_code_loss): < 0 once the codes pay off

    r None (SimCLR) leaves out r_mag and r_slope; loss or zero_loss None leaves out loss_excess."""
    z = torch.tanh(a.detach().double())
    out = {"code_mag": float(z.abs().mean())}
    if r is not None:
        r = r.detach().double()
        if r.shape != z.shape:
            raise ValueError(f"r must have a's shape {tuple(z.shape)}, got {tuple(r.shape)}")
        zc, rc = z - z.mean(0), r - r.mean(0)
        szz = float((zc * zc).sum())
        out["r_mag"] = float(r.abs().mean())
        out["r_slope"] = float((zc * rc).sum()) / szz if szz > 0 else None
    if loss is not None and zero_loss is not None:
        out["loss_excess"] = float(loss) - float(zero_loss)
    return out


COLLAPSE_HINT = ("the learning heads (--head-bn --infer-bn --a-gain 3 --r-gain auto --infer-init "
                 "copy --learn-gain; configs/fashion_mnist.toml, docs/results.md) keep the codes "
                 "from shrinking")


def collapse_warning(step: int, after_step: int, stats: dict, threshold: float,
                     hint: str = COLLAPSE_HINT) -> str | None:
    """The one-line warning for codes that collapse to zero, or None: from step `after_step`
    (the end of the lr warm-up) on, a logged code_mag below `threshold` (0 disables)."""
    mag = stats.get("code_mag")
    if threshold <= 0 or mag is None or step < after_step or not mag < threshold:
        return None
    extra = ""
    if stats.get("loss_excess") is not None:
        extra = f", loss {stats['loss_excess']:+.4f} from its zero-code value"
    if stats.get("r_slope") is not None:
        extra += f", r-on-z slope {stats['r_slope']:.3g}"
    return (f"warning: the codes are collapsing to zero: mean |tanh a| = {mag:.4f} at step {step} "
            f"(< {threshold:g}{extra}); {hint} (--collapse-warn 0 silences this)")
