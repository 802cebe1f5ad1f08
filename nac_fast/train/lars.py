"""LARS (You et al. 2017) as the NAC recipe needs it, on torch._foreach ops: the update of
docs/math.md [M:lars].  Excluded group (BatchNorm parameters and biases): plain SGD with momentum,
no weight decay, no trust ratio; a zero norm gives trust ratio 1, so parameters initialised to 0
move, unlike in the authors' LARS [M:bug3].

`param_groups_for_lars(model, weight_decay)` builds the two groups.  timm.optim.Lars is not used:
it is not a dependency of this package, and its exclusion rules depend on how the groups are set.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim import Optimizer

from .. import _checks

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


def param_groups_for_lars(model: nn.Module, weight_decay: float = 1e-6) -> list[dict]:
    """[{params: weights, lars_exclude: False}, {params: BN params and biases, excluded}].

    A parameter is excluded when it belongs to a normalisation layer or is named `bias`; each
    parameter is listed once even when shared between modules.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _checks.nonnegative_float("weight_decay", weight_decay, finite=True)
    seen, decay, exclude = set(), [], []
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if isinstance(mod, _NORM_TYPES) or name == "bias" or p.ndim <= 1:
                exclude.append(p)
            else:
                decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lars_exclude": False}]
    if exclude:
        groups.append({"params": exclude, "weight_decay": 0.0, "lars_exclude": True})
    return groups


class LARS(Optimizer):
    """Layer-wise adaptive rate scaling with momentum (see the module docstring for the update)."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 1e-6,
                 trust_coefficient: float = 0.001):
        for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                        ("trust_coefficient", trust_coefficient)):
            _checks.nonnegative_float(name, v, finite=True)
        if momentum >= 1:
            raise ValueError(f"momentum must be < 1, got {momentum}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, lars_exclude=False)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """torch's add_param_group, with the group's own settings checked as the constructor's
        (ValueError/TypeError naming the group and the setting): a group's value overrides the
        default, so an unchecked one (weight_decay < 0, momentum >= 1, a NaN lr, lars_exclude
        "yes") would go into every update unseen."""
        if isinstance(param_group, dict):
            i = len(getattr(self, "param_groups", ()))
            for name in ("lr", "momentum", "weight_decay", "trust_coefficient"):
                if name in param_group:
                    _checks.nonnegative_float(f"param_groups[{i}]['{name}']", param_group[name],
                                              finite=True)
            if param_group.get("momentum", 0.0) >= 1:
                raise ValueError(f"param_groups[{i}]['momentum'] must be < 1, got "
                                 f"{param_group['momentum']}")
            if "lars_exclude" in param_group:
                _checks.flag(f"param_groups[{i}]['lars_exclude']", param_group["lars_exclude"])
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient, in a fixed number of foreach launches
        per group (no Python loop over parameters on the device, no host sync): the update,
        its trust ratios (all of a group's norms in one tensor), the momentum and the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if group["lars_exclude"]:
                updates = grads
            else:
                wd = group["weight_decay"]
                updates = torch._foreach_add(grads, params, alpha=wd) if wd else None
                trust = trust_ratios(params, grads if updates is None else updates,
                                     group["trust_coefficient"])
                if updates is None:
                    updates = torch._foreach_mul(grads, trust)
                else:
                    torch._foreach_mul_(updates, trust)
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, updates)
            torch._foreach_add_(params, bufs, alpha=-group["lr"])
        return loss


def trust_ratios(params: list, updates: list, trust_coefficient: float) -> list:
    """LARS's trust ratio of each parameter, q = tc ||p|| / ||u|| where both norms are positive,
    else 1 ([M:lars]), as 0-dim device tensors: the norms by _foreach_norm, and q for all the
    parameters of one device and dtype in one stacked tensor (a handful of launches, not several
    per parameter).  Elementwise the same float operations as one parameter at a time."""
    p_norm, u_norm = torch._foreach_norm(params), torch._foreach_norm(updates)
    by_kind: dict = {}
    for i, pn in enumerate(p_norm):
        by_kind.setdefault((pn.device, pn.dtype), []).append(i)
    out = [None] * len(params)
    for idx in by_kind.values():
        pn = torch.stack([p_norm[i] for i in idx])
        un = torch.stack([u_norm[i] for i in idx])
        q = torch.where((pn > 0) & (un > 0), trust_coefficient * pn / un.clamp_min(1e-38),
                        torch.ones_like(pn))
        for i, qi in zip(idx, q.unbind(0)):
            out[i] = qi
    return out
