"""One training step's loss for each method, and the code statistics that are logged.

    loss, a = nac_step(model, x, p)                  # in-batch NAC: nac_fast.NACLoss
    loss, a = nac_mq_step(mq, x)                     # NAC-MQ: one call of nac_fast.NACMQ
    loss, a = simclr_step(model, x, tau=0.5)         # SimCLR NT-Xent baseline
    code_stats(a) -> {"distinct_frac", "mean_hamming", "balance_score", "code_sat"}
    learning_stats(a, r, loss, zero_code_loss(method, D, batch)) -> {"code_mag", "r_mag",
                                                                     "r_slope", "loss_excess"}
    gain_stats(model) -> {"a_gain", "r_gain"}        # the learnable gains' means, if any
    collapse_warning(...)                            # the one-line warning

`x` is this rank's batch of both views, cat([view1, view2]) (2K rows; row i and row i+K are two
views of one image).  The NAC steps use the public criteria and nothing else: nac_step hands
NACLoss(gather_distributed=True) the two views' outputs, nac_mq_step is one call of an NACMQ
(EMA, momentum keys with shuffle BN, enqueue, loss).  `model` (or the NACMQ) may be wrapped in
DistributedDataParallel: it is called once per step.

Precision.  Under autocast (AMP) the NAC criteria hand the losses the codes in the autocast dtype
(bf16/fp16 a, r, r_hat, keys and queue; nac_fast.ops.loss.loss_dtype), with no float32 copy: the
fused kernels widen each tile and compute tanh, the code-similarity logits' accumulation, the
logsumexp, the Bernoulli term and the reductions in float32, and return a float32 loss;
`nac_vi_loss` widens its (2K, D) inputs to float32 itself.  Without AMP everything is float32
(float64 inputs stay float64).  SimCLR keeps its own path: the head output is normalised in
float32, the logits' matmul is left to autocast (bf16 under AMP), the cross-entropy runs in
float32.

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

from ..ops import collectives
from ..codestats import code_statistics
from ..ops import loss as _loss
from ..ops.loss import NACLoss
from .models import Gain

METHODS = ("nac", "nac-mq", "simclr")


def step_value_checks():
    """The loss-input value checks of a training step, as train.py runs it: a context manager
    that turns the data-reading checks (NaN/inf, noise +-1; nac_fast.ops.loss.CHECK_VALUES) off, since
    train.py checks the loss itself (NaN and inf inputs reach it) without a host sync per step.
    NAC_FAST_CHECK_INPUTS=1 (CHECK_VALUES True) keeps them on, on every device."""
    return _loss.value_checks(True if _loss.CHECK_VALUES is True else False)


def _check_views(x) -> int:
    """K, the images of this rank's batch x = cat([view1, view2]); ValueError naming x unless it
    is a tensor of an even number >= 2 of rows (with an odd count the halves are not the two
    views of the same images: SimCLR would pair rows with the wrong positives)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[0] < 2 or x.shape[0] % 2:
        raise ValueError(f"x must be cat([view1, view2]) of one batch: an even number >= 2 of "
                         f"rows, got shape {tuple(x.shape)}")
    return x.shape[0] // 2


def view_outputs(a: torch.Tensor, r: torch.Tensor):
    """NACModel's outputs (a, r) on x = cat([view1, view2]) as the two views' outputs the criteria
    take, ((a_1, r_1), (a_2, r_2)) with r_v = phi(h_v): the model's r rows come from the partner
    view ([M:notation]), so view 1's own logits are its second half."""
    k = a.shape[0] // 2
    return (a[:k], r[k:]), (a[k:], r[:k])


def nac_step(model, x, p, noise=None, backend="auto", *, out=None, freeze_codes=False,
             likelihood="dot", self_key="include", noise_draws=1):
    """In-batch NAC (docs/math.md [M:inbatch]), cross-pathway r: nac_fast.NACLoss with
    gather_distributed=True (the keys are the clean codes of the GLOBAL batch, all-gathered with
    gradient, so every rank's rows receive the gradient they get in one big process).
    noise: None = drawn from torch's RNG; or an explicit (2K, D) +-1 tensor ((noise_draws, 2K,
    D) with noise_draws > 1).
    backend, likelihood, self_key, noise_draws: the loss's (nac_fast.NACLoss's `backend`,
    `likelihood`, `self_key` and `noise_draws`).
    out: a dict that receives "r", the inference logits (detached), for the log's statistics.
    freeze_codes: the loss's gradient reaches only the inference network (a and phi's input h
    detached): the inference network's warm-up (train.py --infer-warmup-steps).
    Returns (loss, a) with a = the head pre-activations (for code statistics).
    """
    _check_views(x)
    _, a, r = model(x, detach_r_input=freeze_codes)
    if out is not None:
        out["r"] = r.detach()
    criterion = NACLoss(p, gather_distributed=True, backend=backend, likelihood=likelihood,
                        self_key=self_key, noise_draws=noise_draws)
    return criterion(*view_outputs(a.detach() if freeze_codes else a, r), noise=noise), a


def nac_mq_step(mq, x, noise=None, *, out=None, freeze_codes=False):
    """NAC-MQ (docs/math.md [M:mq]) plus the online inference net's VI term [M:vi]: one call of
    `mq`, a nac_fast.NACMQ (or DistributedDataParallel around one), on the two views of x.  The
    call makes the EMA update of the momentum model that follows the previous optimizer step
    ([M:ema]) before its momentum forward, and enqueues the keys of the whole global batch
    before the loss.  noise, out, freeze_codes: as for nac_step (r: the online inference net's
    logits; with freeze_codes only the VI term trains, the codes get no gradient).
    """
    k = _check_views(x)
    res = mq(x[:k], x[k:], noise=noise, freeze_codes=freeze_codes)
    if out is not None:
        out["r"] = res.r
    return res.loss, res.a


def simclr_step(model, x, tau=0.5):
    """SimCLR's NT-Xent on the head outputs, negatives from the global batch (with gradient)."""
    _check_views(x)
    _, a, _ = model(x, with_r=False)
    z = F.normalize(a if a.dtype in (torch.float32, torch.float64) else a.float(), dim=1)
    keys = collectives.all_gather_with_grad(z)
    n, k = z.shape[0], z.shape[0] // 2
    off = collectives.rank() * n  # this rank's rows start here in the gathered keys
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
                   constant)
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


@torch.no_grad()
def gain_stats(model) -> dict:
    """The learnable output gains' means over the bits (the learning heads' per-bit parameters,
    docs/math.md [M:heads]): {"a_gain": ..., "r_gain": ...}, each key only where that gain is
    learnable ({} for the paper's heads and fixed gains).  `model` is the online NACModel
    (unwrapped).  The gains start at --a-gain and --r-gain and are what the start of a run
    changes ([M:recipe-small])."""
    out = {}
    for name in ("a_gain", "r_gain"):
        g = getattr(model, name, None)
        if isinstance(g, Gain) and g.learnable:
            out[name] = float(g.weight.detach().double().mean())
    return out


COLLAPSE_HINT = ("the learning heads (--head-bn --infer-bn --a-gain 3 --r-gain auto --infer-init "
                 "copy --learn-gain; configs/small.toml, docs/results.md) keep the codes "
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
