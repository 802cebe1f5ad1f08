"""Audit of the optimisation side (one process): LARS against a float64 reference over several
steps with a changing lr, zero weights, zero and missing gradients and three groups; LARS's
per-group settings checked like the constructor's; the schedule's step and base_lr checked; the
EMA's wrapper detection and parameter matching; the steps' x of both views; the queue's
wrap-around at a size that is not a multiple of the batch and its state-dict round trip; the
process group's environment checked."""
import pytest
import torch
import torch.nn as nn

from nac_fast.ops.momentum import ema_update_, make_momentum_copy, unwrap
from nac_fast.ops.queue import CodeQueue
from nac_fast.train.distributed import init_distributed
from nac_fast.train.lars import LARS, param_groups_for_lars
from nac_fast.train.methods import nac_mq_step, nac_step, simclr_step
from nac_fast.train.schedule import WarmupCosine, get_lr


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


def test_schedule_edges_and_bad_step():
    f = WarmupCosine(3, 10)
    assert f(0) == pytest.approx(1 / 3) and f(2) == 1.0 and f(3) == 1.0
    assert 0 < f(9) < 0.05 and f(10) == 0.0 and f(10**6) == 0.0
    assert WarmupCosine(0, 5)(0) == 1.0 and WarmupCosine(5, 5)(4) == 1.0
    assert all(get_lr(s, 2.0, 3, 10) == 2.0 * f(s) for s in range(12))  # a function of the step
    for bad in (-1, 2.5, True, float("nan")):
        with pytest.raises(ValueError, match="step"):
            f(bad)
        with pytest.raises(ValueError, match="step"):
            get_lr(bad, 1.0, 3, 10)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="base_lr"):
            get_lr(0, bad, 3, 10)
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(4, 3)


class _Net(nn.Module):
    """A model with a submodule that happens to be named `module`, and parameters of its own."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)


def test_ema_of_a_model_with_a_submodule_named_module():
    online = _Net()
    mom = make_momentum_copy(online)
    before = [p.detach().clone() for p in mom.parameters()]
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    ema_update_(mom, online, 0.75)   # before: ValueError "momentum model has 4 parameters, ..."
    for b, m, o in zip(before, mom.parameters(), online.parameters()):
        torch.testing.assert_close(m, 0.75 * b + 0.25 * o.detach())
    assert unwrap(online) is online
    assert unwrap(torch.compile(online)) is online   # before: online.module (its Linear)
    ema_update_(mom, torch.compile(online), 0.5)


def test_ema_refuses_parameters_of_other_shapes():
    mom, online = nn.Linear(3, 3), nn.Linear(3, 3)
    online.weight = nn.Parameter(torch.ones(3, 1))   # broadcastable: lerp took it silently
    with pytest.raises(ValueError, match="parameter 0"):
        ema_update_(mom, online, 0.5)
    online = nn.Linear(3, 3).double()
    with pytest.raises(ValueError, match="float64"):
        ema_update_(nn.Linear(3, 3), online, 0.5)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_steps_refuse_an_x_that_is_not_two_views(rows):
    from nac_fast.train.models import build_model
    x = torch.randn(rows, 1, 8, 8)
    torch.manual_seed(0)
    simclr = build_model("resnet-tiny", 1, 8, code_dim=8, inference_net=False)
    nac = build_model("resnet-tiny", 1, 8, code_dim=8, inference_net=True)
    with pytest.raises(ValueError, match="x must be cat"):
        simclr_step(simclr, x)   # before: a loss with the wrong positives
    with pytest.raises(ValueError, match="x must be cat"):
        nac_step(nac, x, 0.1)
    with pytest.raises(ValueError, match="x must be cat"):
        nac_mq_step(None, x)


def test_queue_wraps_at_a_size_that_is_not_a_multiple_and_round_trips():
    q = CodeQueue(7, 2, dtype=torch.float64)
    rows = []
    for i in range(5):
        k = torch.arange(6, dtype=torch.float64).view(3, 2) + 10 * i
        q.enqueue(k)
        rows.extend(k.unbind(0))
    assert int(q.ptr) == 15 % 7
    want = torch.stack(rows[-7:])        # the 7 newest, at their ring positions
    order = [(15 - 7 + j) % 7 for j in range(7)]
    assert torch.equal(q.codes[order], want)
    q2 = CodeQueue(7, 2, dtype=torch.float64)
    q2.load_state_dict(q.state_dict())
    assert torch.equal(q2.codes, q.codes) and int(q2.ptr) == int(q.ptr)
    q.enqueue(torch.ones(3, 2, dtype=torch.float64))
    q2.enqueue(torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(q2.codes, q.codes) and int(q2.ptr) == int(q.ptr) == 4
    with pytest.raises(ValueError, match="queue-size"):
        CodeQueue(8, 2).load_state_dict(q.state_dict())


@pytest.mark.parametrize("env, match", [({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
                                        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
                                        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK")])
def test_init_distributed_checks_the_environment(monkeypatch, env, match):
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        init_distributed("cpu", timeout_s=5.0)


def test_init_distributed_checks_timeout(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed("cpu", timeout_s=-1)
