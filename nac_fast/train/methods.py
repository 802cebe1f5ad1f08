"""One training step's loss for each method, and the code statistics that are logged.

    loss, a = nac_step(model, x, p)                                   # in-batch NAC
    loss, a = nac_mq_step(model, momentum_model, queue, x, p, l2)     # NAC-MQ
    loss, a = simclr_step(model, x, tau=0.5)                          # SimCLR NT-Xent baseline
    code_stats(a) -> {"distinct_frac", "mean_hamming", "bit_balance", "code_sat"}

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

import torch
import torch.nn.functional as F

from . import distributed as nd
from ..ops import loss as _loss
from ..ops.hamming import code_statistics
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


def nac_step(model, x, p, noise=None, backend="auto"):
    """In-batch NAC (NAC_SPEC.md eq. `optimization_objective`), cross-pathway r.

    Queries are this rank's 2K rows; keys are the clean codes of the GLOBAL batch, all-gathered
    with gradient (so every rank's rows receive the gradient they get in one big process).
    noise: None = drawn from torch's RNG; or an explicit (2K, D) +-1 tensor.
    backend: the loss backend (nac_fast.nac_loss's `backend`).
    Returns (loss, a) with a = the head pre-activations (for code statistics).
    """
    _, a, r = model(x)
    dt = loss_dtype(a)
    a_l, r_l = a.to(dt), r.to(dt)  # no-ops unless the model's output dtype differs
    keys = nd.all_gather_with_grad(torch.tanh(a_l)) if nd.is_dist() else None
    return nac_loss(a_l, r_l, p, keys=keys, noise=noise, backend=backend), a


def nac_mq_step(model, momentum_model, queue, x, p, l2, noise=None, shuffle_bn=True,
                backend="auto"):
    """NAC-MQ (NAC_SPEC.md eq. `momentum_objective`) plus the online inference net's VI term.

    The momentum model (EMA of encoder, head and inference net; updated by the caller after the
    optimizer step) gives the keys v = tanh(a_m) of both views and r_hat = phi_m(h_m of the other
    view).  The keys of the whole global batch are enqueued BEFORE the loss, so every query sees
    its partner's key.  shuffle_bn: MoCo's batch shuffle across ranks for the momentum forward.
    The queue is handed to the loss as it is stored when its dtype is the loss dtype (create it
    with CodeQueue(..., dtype=<autocast dtype>) under AMP, as train.py does); otherwise it is
    converted, (M, D) elements per step.
    """
    _, a, r = model(x, detach_r_input=True)  # r: online inference net on sg(h), VI term only
    with torch.no_grad():
        xs, idx = nd.batch_shuffle(x) if shuffle_bn else (x, None)
        hm, am = momentum_model.encode(xs)
        hm, am = nd.batch_unshuffle(hm, idx), nd.batch_unshuffle(am, idx)
        r_hat = momentum_model.infer_logits(swap_halves(hm))
        # tanh in float32 whatever the AMP dtype; enqueue rounds to the queue's dtype
        queue.enqueue(nd.all_gather_nograd(torch.tanh(_acc(am))))
    dt = loss_dtype(a)
    a_l = a.to(dt)
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
    """Expressivity of the batch's hash codes c = sgn(a) (nac_fast.ops.hamming's convention, 0 -> +1),
    from nac_fast.ops.hamming.code_statistics (exact, O(nD)):
    distinct_frac  number of distinct codes / rows (1.0 = every row has its own code),
    mean_hamming   mean Hamming distance over pairs i != j (D/2 for random codes),
    bit_balance    1 - mean_d |2 q_d - 1|, q_d = fraction of +1 in bit d (1 = every bit 50/50,
                   0 = every bit constant),
    code_sat       mean |tanh(a)|: how saturated the relaxed code is (1 = binary)."""
    a = a.detach().float()
    st = code_statistics(a)
    return {"distinct_frac": st.fraction_distinct, "mean_hamming": st.mean_pairwise_hamming,
            "bit_balance": 1.0 - 2.0 * st.balance_mean_abs_deviation,
            "code_sat": float(torch.tanh(a).abs().mean())}
