"""LARS: BN/bias exclusions, zero-norm parameters move, a hand-computed update, validation.

Its edges (an audit): against a float64 reference over several steps with a changing lr, zero
weights, zero and missing gradients and three groups; each group's own settings checked like
the constructor's; param_groups_for_lars's weight_decay and model checked."""
import math

import pytest
import torch
import torch.nn as nn

from nac_fast.train.lars import LARS, param_groups_for_lars
from nac_fast.train.schedule import get_lr


def _hand_lars(w, g, buf, lr, mom, wd, tc, exclude):
    """The update of docs/math.md [M:lars] written out with Python floats."""
    w, g = [float(v) for v in w], [float(v) for v in g]
    if exclude:
        u = g
    else:
        u = [gi + wd * wi for gi, wi in zip(g, w)]
        pn = math.sqrt(sum(v * v for v in w))
        un = math.sqrt(sum(v * v for v in u))
        q = tc * pn / un if pn > 0 and un > 0 else 1.0
        u = [q * v for v in u]
    buf = [mom * b + v for b, v in zip(buf, u)]
    return [wi - lr * b for wi, b in zip(w, buf)], buf


def test_groups_exclude_bn_and_bias():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2),
                      nn.LayerNorm(2))
    groups = param_groups_for_lars(m, weight_decay=1e-6)
    decay = {id(p) for p in groups[0]["params"]}
    excl = {id(p) for p in groups[1]["params"]}
    assert groups[0]["lars_exclude"] is False and groups[0]["weight_decay"] == 1e-6
    assert groups[1]["lars_exclude"] is True and groups[1]["weight_decay"] == 0.0
    assert decay == {id(m[0].weight), id(m[3].weight)}
    assert excl == {id(m[0].bias), id(m[1].weight), id(m[1].bias), id(m[3].bias),
                    id(m[4].weight), id(m[4].bias)}


def test_matches_hand_computation_two_steps():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5, dtype=torch.float64).view(5, 1))
    b = nn.Parameter(torch.randn(3, dtype=torch.float64))
    lr, mom, wd, tc = 0.7, 0.9, 0.01, 0.001
    opt = LARS([{"params": [w], "weight_decay": wd, "lars_exclude": False},
                {"params": [b], "weight_decay": 0.0, "lars_exclude": True}],
               lr=lr, momentum=mom, weight_decay=wd, trust_coefficient=tc)
    hw, hb = w.detach().flatten().tolist(), b.detach().tolist()
    bw, bb = [0.0] * 5, [0.0] * 3
    for step in range(2):
        gw, gb = torch.randn(5, 1, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        hw, bw = _hand_lars(hw, gw.flatten(), bw, lr, mom, wd, tc, exclude=False)
        hb, bb = _hand_lars(hb, gb, bb, lr, mom, wd, tc, exclude=True)
        torch.testing.assert_close(w.detach().flatten(), torch.tensor(hw, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(b.detach(), torch.tensor(hb, dtype=torch.float64),
                                   rtol=1e-12, atol=1e-14)


def test_excluded_group_is_plain_sgd_momentum_without_decay():
    b = nn.Parameter(torch.full((4,), 3.0))
    opt = LARS([{"params": [b], "weight_decay": 0.5, "lars_exclude": True}], lr=0.1,
               weight_decay=0.5)
    b.grad = torch.ones(4)
    opt.step()
    # no trust ratio (0.001*||b||/||g|| would shrink the step) and no weight decay
    torch.testing.assert_close(b.detach(), torch.full((4,), 3.0 - 0.1))


def test_zero_norm_parameters_move():
    # The authors' LARS has trust ratio 0 for ||p|| = 0: zero-initialised weights never move.
    w = nn.Parameter(torch.zeros(3, 2))
    bias = nn.Parameter(torch.zeros(2))
    opt = LARS([{"params": [w], "lars_exclude": False},
                {"params": [bias], "lars_exclude": True, "weight_decay": 0.0}], lr=0.5)
    w.grad = torch.full((3, 2), 2.0)
    bias.grad = torch.full((2,), -1.0)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 2), -1.0))   # trust ratio 1
    torch.testing.assert_close(bias.detach(), torch.full((2,), 0.5))


def test_zero_grad_moves_by_trust_scaled_weight_decay():
    w = nn.Parameter(torch.full((2, 2), 2.0))
    opt = LARS([{"params": [w], "lars_exclude": False}], lr=1.0, weight_decay=0.1)
    w.grad = torch.zeros(2, 2)
    opt.step()
    # u = 0 + 0.1*w = 0.2, ||u|| > 0 so q = 0.001*||w||/||u|| = 0.001*4/0.4 = 0.01
    torch.testing.assert_close(w.detach(), torch.full((2, 2), 2.0 - 0.01 * 0.2))


def test_params_without_grad_are_skipped_and_state_round_trips():
    a, b = nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(2, 2))
    opt = LARS([a, b], lr=0.1)
    a.grad = torch.ones(2, 2)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(2, 2))
    # a took the step of the defaults (momentum 0.9, weight decay 1e-6, trust coefficient 0.001)
    want, _ = _hand_lars([1.0] * 4, [1.0] * 4, [0.0] * 4, 0.1, 0.9, 1e-6, 0.001, exclude=False)
    torch.testing.assert_close(a.detach().flatten(), torch.tensor(want))
    opt2 = LARS([a, b], lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[a]["momentum_buffer"], opt.state[a]["momentum_buffer"])


@pytest.mark.parametrize("kw", [{"lr": -1.0}, {"lr": 0.1, "momentum": 1.0},
                                {"lr": 0.1, "weight_decay": -1e-6},
                                {"lr": 0.1, "trust_coefficient": float("nan")},
                                {"lr": True}])
def test_bad_hyperparameters(kw):
    with pytest.raises(ValueError):
        LARS([nn.Parameter(torch.ones(1))], **kw)


def _ref_step(p, g, buf, group):
    """docs/math.md [M:lars] for one parameter, float64 tensors."""
    if g is None:
        return p, buf
    if group["lars_exclude"]:
        u = g
    else:
        u = g + group["weight_decay"] * p
        pn, un = p.norm(), u.norm()
        u = (group["trust_coefficient"] * pn / un if pn > 0 and un > 0 else 1.0) * u
    buf = group["momentum"] * buf + u
    return p - group["lr"] * buf, buf


def test_lars_matches_float64_reference_over_steps_with_groups_and_zero_norms():
    torch.manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 3), (6, 1), (3, 3)]
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    with torch.no_grad():
        params[3].zero_()  # a zero-norm weight: trust ratio 1, it moves
    groups = [{"params": params[:2], "weight_decay": 0.1, "lars_exclude": False},
              {"params": params[2:4], "weight_decay": 0.0, "lars_exclude": False,
               "trust_coefficient": 0.02, "momentum": 0.5},
              {"params": params[4:], "weight_decay": 0.3, "lars_exclude": True}]
    opt = LARS(groups, lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.001)
    of = [0, 0, 1, 1, 2]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    for step in range(6):
        lr = get_lr(step, 0.5, 3, 6)
        grads = []
        for i, p in enumerate(params):
            g = torch.randn_like(p)
            if (step, i) in ((1, 2), (2, 3)):
                g = torch.zeros_like(p)  # zero gradient (and zero update where wd = 0)
            if (step, i) == (3, 1):
                g = None                 # no gradient: skipped, buffer kept
            p.grad = None if g is None else g.clone()
            grads.append(g)
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.step()
        for i in range(5):
            ref[i], bufs[i] = _ref_step(ref[i], grads[i], bufs[i], opt.param_groups[of[i]])
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-13, atol=1e-15)
    assert params[3].detach().abs().sum() > 0


@pytest.mark.parametrize("setting, value, exc", [
    ("weight_decay", -1.0, ValueError), ("momentum", 1.0, ValueError),
    ("momentum", float("nan"), ValueError), ("lr", -0.1, ValueError),
    ("lr", float("inf"), ValueError), ("trust_coefficient", -1e-3, ValueError),
    ("lars_exclude", "yes", TypeError)])
def test_lars_checks_each_groups_own_settings(setting, value, exc):
    p = nn.Parameter(torch.ones(2, 2))
    with pytest.raises(exc, match=rf"param_groups\[1\]\['{setting}'\]"):
        LARS([{"params": [nn.Parameter(torch.ones(2))]}, {"params": [p], setting: value}],
             lr=0.1)
    opt = LARS([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(exc, match=setting):
        opt.add_param_group({"params": [p], setting: value})
    assert len(opt.param_groups) == 1


def test_lars_param_groups_checks_weight_decay_and_model():
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups_for_lars(nn.Linear(2, 2), weight_decay=-1e-6)
    with pytest.raises(TypeError, match="model"):
        param_groups_for_lars([nn.Parameter(torch.ones(2))])
