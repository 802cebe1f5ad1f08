"""2-process gloo DDP equals 1 process over the global batch (loss and gradients), for nac,
nac-mq and simclr; under DDP the trainer's steps on the public criteria (NACLoss with
gather_distributed, NACMQ) equal 0.1.0's hand-written formula bit for bit; MoCo's batch
shuffle/unshuffle is exact.

The encoder here has no BatchNorm: with BN each rank normalises with its own batch statistics,
which legitimately differs from one big batch (SyncBN is the option that removes that).  With
explicit noise tensors both runs see the same channel sample.
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from nac_fast import NACMQ, CodeQueue
from nac_fast.ops import collectives as nd
from nac_fast.ops.momentum import make_momentum_copy
from nac_fast.train.distributed import all_reduce_mean
from nac_fast.train.methods import nac_mq_step, nac_step, simclr_step
from nac_fast.train.models import build_model

from _old_steps import old_nac_mq_step, old_nac_step

WORLD, K, D, P = 2, 6, 16, 0.2   # K images per rank, 2K rows per rank


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(method):
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 1, 8, code_dim=D, inference_net=method != "simclr")
    # no-BN encoder (see module docstring); output width = the head's input width
    m.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, m.feature_dim), nn.Tanh())
    return m.double()


def _global_data():
    g = torch.Generator().manual_seed(1)
    v1 = torch.randn(WORLD * K, 1, 8, 8, generator=g, dtype=torch.float64)
    v2 = v1 + 0.3 * torch.randn(WORLD * K, 1, 8, 8, generator=g, dtype=torch.float64)
    n1 = torch.where(torch.rand(WORLD * K, D, generator=g) < P, -1.0, 1.0).double()
    n2 = torch.where(torch.rand(WORLD * K, D, generator=g) < P, -1.0, 1.0).double()
    return v1, v2, n1, n2


def _mq(model):
    """NACMQ around `model` (its queue: 8 global batches of float64 codes)."""
    return NACMQ(model, queue_size=8 * WORLD * K, p=P, l2=0.1, queue_dtype=torch.float64)


def _run(method, model, x, noise):
    """model: the NAC or SimCLR model, or (nac-mq) the NACMQ; any of them under DDP."""
    if method == "nac":
        return nac_step(model, x, P, noise=noise)[0]
    if method == "nac-mq":
        return nac_mq_step(model, x, noise=noise)[0]
    return simclr_step(model, x, 0.5)[0]


def _new_vs_old(method, x, path):
    """Loss, gradients and queue of one DDP step along `path` ("new": the trainer's step on the
    public criteria; "old": tests/_old_steps.py), with the channel noise drawn inside from one
    seed, and the momentum branch's batch shuffle on (its permutation drawn on rank 0)."""
    model = _model(method)
    torch.manual_seed(7 + dist.get_rank())  # each rank its own noise, as train.py seeds it
    if path == "new":
        net = nn.parallel.DistributedDataParallel(model if method == "nac" else _mq(model))
        loss = (nac_step(net, x, P) if method == "nac" else nac_mq_step(net, x))[0]
        queue = None if method == "nac" else net.module.queue
    else:
        net = nn.parallel.DistributedDataParallel(model)
        if method == "nac":
            loss, queue = old_nac_step(net, x, P)[0], None
        else:
            queue = CodeQueue(8 * WORLD * K, D, dtype=torch.float64)
            loss = old_nac_mq_step(net, make_momentum_copy(model), queue, x, P, 0.1)[0]
    loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad.clone() for p in model.parameters()],
            "queue": None if queue is None else queue.codes.clone()}


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        v1, v2, n1, n2 = _global_data()
        sl = slice(rank * K, (rank + 1) * K)
        x = torch.cat([v1[sl], v2[sl]])
        noise = torch.cat([n1[sl], n2[sl]])
        res = {}
        for method in ("nac", "nac-mq", "simclr"):
            model = _model(method)
            mq = _mq(model) if method == "nac-mq" else None
            queue = mq.queue if mq is not None else None
            ddp = nn.parallel.DistributedDataParallel(model if mq is None else mq)  # MoCo's way
            loss = _run(method, ddp, x, noise)
            loss.backward()
            res[method] = {"loss": all_reduce_mean(loss.detach()),
                           "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                           "queue": None if queue is None else queue.codes.clone(),
                           "ptr": None if queue is None else queue.ptr}
            if method != "simclr":  # the same step by 0.1.0's formula, noise drawn inside
                res[method]["new"] = _new_vs_old(method, x, "new")
                res[method]["old"] = _new_vs_old(method, x, "old")

        # batch shuffle / unshuffle: exact inverse, per-sample function commutes, rows really
        # move between ranks
        torch.manual_seed(123)
        xs, idx = nd.batch_shuffle(x)
        f = lambda t: t * 2.0 + t.pow(2).sum(dim=(1, 2, 3), keepdim=True)  # per-sample function
        back = nd.batch_unshuffle(f(xs), idx)
        res["shuffle"] = {"exact": bool(torch.equal(back, f(x))),
                          "ident": bool(torch.equal(nd.batch_unshuffle(xs, idx), x)),
                          "moved": not torch.equal(xs, x)}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["nac", "nac-mq", "simclr"])
def test_ddp_loss_and_grads_equal_one_process(ddp_results, method):
    v1, v2, n1, n2 = _global_data()
    model = _model(method)
    mq = _mq(model) if method == "nac-mq" else None
    queue = mq.queue if mq is not None else None
    # one process, global batch: rows ordered [all view-1; all view-2] as train.py does
    loss = _run(method, model if mq is None else mq, torch.cat([v1, v2]), torch.cat([n1, n2]))
    loss.backward()
    for r in range(WORLD):
        got = ddp_results[r][method]
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-10, atol=1e-12)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"{method} rank {r} grad {name}: {m}")
    if method == "nac-mq":
        # the queue received the codes of the whole global batch on every rank (same set of
        # rows; the order within one enqueue is rank-major there, view-major here)
        for r in range(WORLD):
            got = ddp_results[r][method]
            assert got["ptr"] == queue.ptr == 2 * WORLD * K
            a = got["queue"][: 2 * WORLD * K]
            b = queue.codes[: 2 * WORLD * K]
            assert torch.allclose(a.sum(0), b.sum(0), atol=1e-12)
            assert torch.allclose(torch.sort(a[:, 0]).values, torch.sort(b[:, 0]).values,
                                  atol=1e-12)
        assert torch.equal(ddp_results[0][method]["queue"], ddp_results[1][method]["queue"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["nac", "nac-mq"])
def test_ddp_steps_on_the_public_criteria_equal_the_old_formula(ddp_results, method):
    for r in range(WORLD):
        new, old = ddp_results[r][method]["new"], ddp_results[r][method]["old"]
        assert torch.equal(new["loss"], old["loss"]), (r, new["loss"], old["loss"])
        assert len(new["grads"]) == len(old["grads"])
        for i, (gn, go) in enumerate(zip(new["grads"], old["grads"])):
            assert torch.equal(gn, go), (method, r, i)
        if method == "nac-mq":
            assert torch.equal(new["queue"], old["queue"])
    # the ranks' losses differ (own rows, own noise): the comparison is per rank
    assert not torch.equal(ddp_results[0][method]["new"]["loss"],
                           ddp_results[1][method]["new"]["loss"])


@pytest.mark.slow
def test_batch_shuffle_unshuffle_exact(ddp_results):
    for r in range(WORLD):
        s = ddp_results[r]["shuffle"]
        assert s["ident"] and s["exact"]
        assert s["moved"]


def test_all_gather_with_grad_is_identity_in_one_process():
    x = torch.randn(3, 4, requires_grad=True)
    assert nd.all_gather_with_grad(x) is x
    y, idx = nd.batch_shuffle(x)
    assert y is x and idx is None and nd.batch_unshuffle(y, idx) is y
