"""One training step's loss for each method, and the code statistics that are logged.

    loss, a = nac_step(model, x, p)                                   # in-batch NAC
    loss, a = nac_mq_step(model, momentum_model, queue, x, p, l2)     # NAC-MQ
    loss, a = simclr_step(model, x, tau=0.5)                          # SimCLR NT-Xent baseline
    code_stats(a) -> {"distinct_frac", "mean_hamming", "bit_balance"}

`x` is this rank's batch of both views, cat([view1, view2]) (2K rows; row i and row i+K are two
views of one image).  `model` may be wrapped in DistributedDataParallel: it is called once per
step.  The losses are computed in float32 whatever the autocast dtype (the code-similarity
logits are sums of D products of numbers in [-1, 1], where bf16's 8-bit mantissa would blur
the ranking); the (2K, D) inputs are tiny next to the encoder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import distributed as nd
from .hashing import code_statistics
from .loss import draw_noise, nac_loss, nac_mq_loss, nac_vi_loss
from .models import swap_halves

METHODS = ("nac", "nac-mq", "simclr")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in float32, or float64 if it already is (double-precision tests)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def nac_step(model, x, p, noise=None):
    """In-batch NAC (NAC_SPEC.md eq. `optimization_objective`), cross-pathway r.

    Queries are this rank's 2K rows; keys are the clean codes of the GLOBAL batch, all-gathered
    with gradient (so every rank's rows receive the gradient they get in one big process).
    noise: None = drawn from torch's RNG; or an explicit (2K, D) +-1 tensor.
    Returns (loss, a) with a = the head pre-activations (for code statistics).
    """
    _, a, r = model(x)
    a32, r32 = _acc(a), _acc(r)
    keys = nd.all_gather_with_grad(torch.tanh(a32)) if nd.is_dist() else None
    return nac_loss(a32, r32, p, keys=keys, noise=noise), a


def nac_mq_step(model, momentum_model, queue, x, p, l2, noise=None, shuffle_bn=True):
    """NAC-MQ (NAC_SPEC.md eq. `momentum_objective`) plus the online inference net's VI term.

    The momentum model (EMA of encoder, head and inference net; updated by the caller after the
    optimizer step) gives the keys v = tanh(a_m) of both views and r_hat = phi_m(h_m of the other
    view).  The keys of the whole global batch are enqueued BEFORE the loss, so every query sees
    its partner's key.  shuffle_bn: MoCo's batch shuffle across ranks for the momentum forward.
    """
    _, a, r = model(x, detach_r_input=True)  # r: online inference net on sg(h), VI term only
    with torch.no_grad():
        xs, idx = nd.batch_shuffle(x) if shuffle_bn else (x, None)
        hm, am = momentum_model.encode(xs)
        hm, am = nd.batch_unshuffle(hm, idx), nd.batch_unshuffle(am, idx)
        r_hat = momentum_model.infer_logits(swap_halves(hm))
        queue.enqueue(nd.all_gather_nograd(torch.tanh(_acc(am))))
    a32 = _acc(a)
    if noise is None:
        noise = draw_noise(a32.shape, p, device=a32.device)
    loss = nac_mq_loss(a32, _acc(r_hat).to(a32.dtype), queue.codes.to(a32.dtype), p, l2=l2,
                       noise=noise)
    # One channel sample per step for both terms (the VI term sees the same z~ as the MQ term).
    vi = nac_vi_loss(a32, _acc(r).to(a32.dtype), p, noise=noise)
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
    """Expressivity of the batch's hash codes c = sgn(a) (nac_fast.hashing's convention, 0 -> +1),
    from nac_fast.hashing.code_statistics (exact, O(nD)):
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
