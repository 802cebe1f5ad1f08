"""EMA of the momentum model, the code queue's wrap-around, and the lr schedule.

The optimisation side's edges (an audit): the EMA's wrapper detection (a submodule that happens
to be named `module`, torch.compile's wrapper) and its parameter matching (shapes, dtypes); the
queue's wrap-around at a size that is not a multiple of the batch and its state-dict round trip;
the schedule's step and base_lr checked."""
import json
import math

import pytest
import torch
import torch.nn as nn

from nac_fast.ops.momentum import ema_update_, make_momentum_copy, unwrap
from nac_fast.ops.queue import CodeQueue
from nac_fast.train.schedule import WarmupCosine, get_lr


def test_ema_update_all_parameters_not_buffers():
    torch.manual_seed(0)
    online = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    mom = make_momentum_copy(online)
    assert all(not p.requires_grad for p in mom.parameters())
    with torch.no_grad():
        for p in online.parameters():
            p.add_(torch.randn_like(p))
        online[1].running_mean.fill_(5.0)
    before = [p.clone() for p in mom.parameters()]
    ema_update_(mom, online, 0.9)
    for b, m, o in zip(before, mom.parameters(), online.parameters()):
        torch.testing.assert_close(m, 0.9 * b + 0.1 * o.detach())
    assert torch.equal(mom[1].running_mean, torch.zeros(4))  # buffers are the momentum model's own
    ema_update_(mom, online, 0.0)  # decay 0 copies
    for m, o in zip(mom.parameters(), online.parameters()):
        torch.testing.assert_close(m, o.detach())


def test_ema_through_wrappers_and_bad_decay():
    online = nn.Linear(2, 2)
    mom = make_momentum_copy(online)

    class Wrap(nn.Module):  # stands in for DDP's .module
        def __init__(self, m):
            super().__init__()
            self.module = m
    assert unwrap(Wrap(online)) is online
    before = mom.weight.detach().clone()
    with torch.no_grad():
        online.weight.fill_(1.0)
    ema_update_(mom, Wrap(online), 0.5)
    torch.testing.assert_close(mom.weight, 0.5 * before + 0.5)
    with pytest.raises(ValueError):
        ema_update_(mom, online, 1.5)
    with pytest.raises(ValueError):
        ema_update_(mom, nn.Linear(3, 3, bias=False), 0.5)


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


def test_queue_enqueue_and_wrap_around():
    q = CodeQueue(6, 2)
    assert torch.equal(q.codes, torch.zeros(6, 2)) and q.ptr == 0
    k1 = torch.arange(8.0).view(4, 2)
    q.enqueue(k1)
    assert q.ptr == 4
    assert torch.equal(q.codes[:4], k1) and torch.equal(q.codes[4:], torch.zeros(2, 2))
    k2 = 100 + torch.arange(8.0).view(4, 2)
    q.enqueue(k2)                       # rows 4,5 then wraps to 0,1
    assert q.ptr == 2
    assert torch.equal(q.codes[4:], k2[:2]) and torch.equal(q.codes[:2], k2[2:])
    assert torch.equal(q.codes[2:4], k1[2:])
    q2 = CodeQueue(6, 2)
    q2.load_state_dict(q.state_dict())
    assert q2.ptr == 2 and torch.equal(q2.codes, q.codes)
    with pytest.raises(ValueError):
        q.enqueue(torch.zeros(7, 2))
    with pytest.raises(ValueError):
        q.enqueue(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        CodeQueue(4, 2).load_state_dict(q.state_dict())
    with pytest.raises(ValueError):
        CodeQueue(0, 2)


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


def test_warmup_cosine():
    f = WarmupCosine(4, 14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert math.isclose(f(9), 0.5)           # halfway through the cosine
    assert f(14) == 0.0 and f(100) == 0.0
    assert WarmupCosine(0, 10)(0) == 1.0
    with pytest.raises(ValueError):
        WarmupCosine(11, 10)
    with pytest.raises(ValueError):
        WarmupCosine(0, 0)


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


def test_flip_prob_schedule():
    """[M:p-schedule]: p0 at the first step, p1 at the last, linear between; constant without p1;
    past the end (an extended run's old total) it stays at p1."""
    from nac_fast.train.schedule import flip_prob_at
    assert [flip_prob_at(s, 0.25, None, 5) for s in range(5)] == [0.25] * 5
    ps = [flip_prob_at(s, 0.25, 0.4, 5) for s in range(5)]
    assert ps[0] == 0.25 and ps[-1] == 0.4
    assert all(math.isclose(b - a, 0.15 / 4) for a, b in zip(ps, ps[1:]))
    assert flip_prob_at(9, 0.25, 0.4, 5) == 0.4
    assert flip_prob_at(0, 0.25, 0.4, 1) == 0.25      # a one-step run trains at p0
    assert flip_prob_at(3, 0.3, 0.1, 4) == 0.1          # a falling schedule is allowed too
    for args, name in (((-1, 0.25, 0.4, 5), "step"), ((0, 0.25, 0.4, 0), "total_steps"),
                       ((0, 0.5, 0.4, 5), "p0"), ((0, 0.25, 0.0, 5), "p1")):
        with pytest.raises(ValueError, match=name):
            flip_prob_at(*args)
    with pytest.raises(TypeError, match="p1"):
        flip_prob_at(0, 0.25, "0.4", 5)


RAMP, FLAT = [0.2, 0.25, 0.3, 0.35, 0.4], [0.2] * 5


def test_p_schedule_applies_by_steps_and_images_seen():
    """[M:p-schedule]: the schedule applies where every threshold set holds: steps >= min_steps
    and steps x global batch >= min_images; None is no condition; min_images needs the batch."""
    from nac_fast.train.schedule import p_schedule_applies as on
    assert not on(None, None, 10**6, None, 256)                 # no final p: no schedule
    assert on(0.4, None, 1, None, None)                         # no threshold: every run
    assert on(0.4, 2000, 2000) and not on(0.4, 2000, 1999)
    assert on(0.4, None, 1758, 450_000, 256)                    # 450,048 images seen
    assert not on(0.4, None, 1757, 450_000, 256)                # 449,792
    assert not on(0.4, None, 2400, 450_000, 64)                 # many steps, few images
    assert not on(0.4, 3000, 2400, 100_000, 64) and on(0.4, 2000, 2400, 100_000, 64)
    with pytest.raises(ValueError, match="batch_size"):
        on(0.4, None, 100, 1000, None)
    with pytest.raises(ValueError, match="batch_size"):
        on(0.4, None, 100, 1000, 0)
    from nac_fast.train.schedule import p_schedule_shortfalls as short
    assert short(None, 2400, 450_000, 64) == ["153,600 images seen < 450,000"]
    assert short(3000, 2400, 450_000, 64) == ["153,600 images seen < 450,000", "2400 steps < 3000"]
    assert short(2000, 2400, 100_000, 64) == [] and short(None, 1, None, None) == []
    with pytest.raises(ValueError, match="batch_size"):
        short(None, 100, 1000, None)


@pytest.mark.parametrize("method", ["nac", "nac-mq"])
@pytest.mark.parametrize("min_steps,min_images,expect,shown", [
    ("5", "none", RAMP, "p=0.2->0.4 "),
    ("6", "none", FLAT, "p=0.2 (not rising to 0.4: 5 steps < 6) "),  # too few steps
    ("none", "160", RAMP, "p=0.2->0.4 "),                   # 5 steps x batch 32 = 160 images
    ("none", "161", FLAT, "p=0.2 (not rising to 0.4: 160 images seen < 161) "),
    ("5", "161", FLAT, "p=0.2 (not rising to 0.4: 160 images seen < 161) "),  # both must hold
    ("6", "161", FLAT, "160 images seen < 161, 5 steps < 6) "),
])
def test_train_step_follows_the_flip_prob_schedule(method, min_steps, min_images, expect, shown,
                                                   monkeypatch, tmp_path, capsys):
    """Each optimizer step's loss gets the scheduled p: nac through nac_step's p, nac-mq through
    its NACMQLoss's p (which also draws the noise and weighs the VI term); a run shorter than
    --flip-prob-final-min-steps, or seeing fewer images (steps x global batch) than
    --flip-prob-final-min-images, keeps --flip-prob, and the start line says why."""
    import train
    from nac_fast.ops.loss import NACLoss, NACMQLoss
    seen = []
    cls = NACLoss if method == "nac" else NACMQLoss
    orig = cls.forward

    def record(self, *a, **k):
        seen.append(self.p)
        return orig(self, *a, **k)
    monkeypatch.setattr(cls, "forward", record)
    argv = ["--data", "synthetic:64", "--batch-size", "32", "--image-size", "8",
            "--max-steps", "5", "--method", method, "--flip-prob", "0.2",
            "--flip-prob-final", "0.4", "--flip-prob-final-min-steps", min_steps,
            "--flip-prob-final-min-images", min_images,
            "--log-every", "1", "--out", str(tmp_path), "--no-progress"]
    if method == "nac-mq":
        argv += ["--queue-size", "64"]
    assert train.main(argv) == 0
    assert len(seen) == 5
    assert [round(p, 6) for p in seen] == expect
    logged = [json.loads(x)["flip_prob"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(expect)          # each logged step's p (log.jsonl)
    assert shown in capsys.readouterr().out
