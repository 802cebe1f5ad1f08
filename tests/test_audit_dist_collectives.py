"""Audit: nac_fast.ops.collectives under 2 gloo processes, with inputs test_train_ddp.py does not
use: ranks whose batches differ in size (the last batch of an epoch) get a ValueError naming the
argument on every rank (before: gloo aborted one process, "Received data size doesn't match
expected size"), a generic float64 loss over all_gather_with_grad gives, after DDP's averaging,
the one-process gradient of the global mean, batch shuffle of an odd batch (n = 3) is one
permutation on every rank and is inverted exactly, and batch_unshuffle refuses a y whose rows do
not match the permutation.
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nac_fast.ops import collectives as C

WORLD, N, D = 2, 3, 4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(WORLD * N, D, dtype=torch.float64, generator=g), \
        torch.randn(D, D, dtype=torch.float64, generator=g)


def _loss(q, keys, w):
    """A contrastive-style mean over this process's query rows, keys used nonlinearly."""
    z = torch.tanh(q @ w)
    k = torch.tanh(keys @ w)
    return (torch.logsumexp(z @ k.t(), dim=1) + (z ** 2).sum(1)).mean()


def _expect_value_error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    res = {}
    try:
        x, w0 = _data()
        # gradient of a rank's weights through the gathered keys, DDP-style averaged
        w = w0.clone().requires_grad_()
        q = x[rank * N:(rank + 1) * N]
        _loss(q, C.all_gather_with_grad(q @ torch.eye(D, dtype=torch.float64)), w).backward()
        g = w.grad.clone()
        dist.all_reduce(g)
        res["grad"] = g / WORLD
        # gradient reaching the rows themselves (each rank's slice gets every rank's part)
        xr = x[rank * N:(rank + 1) * N].clone().requires_grad_()
        _loss(xr, C.all_gather_with_grad(xr), w0).backward()
        res["xgrad"] = xr.grad / WORLD  # DDP's average
        # uneven rows: every rank refuses, naming the argument
        n = N if rank == 0 else N - 1
        t = torch.randn(n, D, dtype=torch.float64, requires_grad=True)
        res["uneven_grad"] = _expect_value_error(lambda: C.all_gather_with_grad(t))
        res["uneven_nograd"] = _expect_value_error(lambda: C.all_gather_nograd(t.detach()))
        res["uneven_shuffle"] = _expect_value_error(lambda: C.batch_shuffle(t.detach()))
        tt = torch.randn(N, D, dtype=torch.float32 if rank else torch.float64)
        res["dtype"] = _expect_value_error(lambda: C.all_gather_nograd(tt))
        # still usable after the refusals: the group is not broken
        y = C.all_gather_nograd(torch.full((N, 2), float(rank)))
        res["after"] = y[:, 0].tolist()
        # batch shuffle of an odd batch: one permutation, exact inverse
        torch.manual_seed(100 + rank)  # only rank 0 draws: the ranks' RNGs differ on purpose
        xb = torch.arange(N * 2, dtype=torch.float64).view(N, 2) + 100 * rank
        xs, plan = C.batch_shuffle(xb)
        res["idx"] = plan.idx_unshuffle.clone()
        res["xs"] = xs.clone()
        res["back"] = torch.equal(C.batch_unshuffle(xs, plan), xb)
        res["bad_idx"] = _expect_value_error(lambda: C.batch_unshuffle(xs[:2], plan))
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("audit_coll")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def test_gathered_gradient_equals_one_process_over_the_global_batch(results):
    x, w0 = _data()
    w = w0.clone().requires_grad_()
    _loss(x, x, w).backward()
    xg = x.clone().requires_grad_()
    _loss(xg, xg, w0).backward()
    for r in range(WORLD):
        torch.testing.assert_close(results[r]["grad"], w.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(results[r]["xgrad"], xg.grad[r * N:(r + 1) * N],
                                   rtol=1e-12, atol=1e-14)


def test_uneven_batches_are_refused_on_every_rank(results):
    for r in range(WORLD):
        for key in ("uneven_grad", "uneven_nograd", "uneven_shuffle"):
            msg = results[r][key]
            assert msg is not None, (r, key)
            assert msg.startswith("x must have the same shape") and "rank 0: (3, 4)" in msg \
                and "rank 1: (2, 4)" in msg and "drop_last" in msg, msg
        assert results[r]["dtype"] is not None and "dtype" in results[r]["dtype"]
        assert results[r]["after"] == [0.0] * N + [1.0] * N


def test_batch_shuffle_odd_batch_one_permutation_exact_inverse(results):
    assert torch.equal(results[0]["idx"], results[1]["idx"])
    perm = torch.argsort(results[0]["idx"])
    assert sorted(perm.tolist()) == list(range(WORLD * N))
    glob = torch.cat([torch.arange(N * 2, dtype=torch.float64).view(N, 2) + 100 * r
                      for r in range(WORLD)])
    for r in range(WORLD):
        assert results[r]["back"]
        assert torch.equal(results[r]["xs"], glob[perm[r * N:(r + 1) * N]])
        msg = results[r]["bad_idx"]
        assert msg is not None and msg.startswith("y must have as many rows as batch_shuffle's x"), \
            msg
