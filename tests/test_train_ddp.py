"""2-process gloo DDP equals 1 process over the global batch (loss and gradients), for nac,
nac-mq and simclr, for nac averaged over 3 channel draws (the keys gathered once, [M:draws]),
and for nac with each row's own code left out of its keys (NACLoss finds it
at this rank's place in the gathered keys, [M:self-key]) on every backend here: "auto" (the fused
CPU kernel, its self_offset the rank's place), the reference, and Triton where it runs (the
interpreter); under DDP the trainer's steps on the public criteria (NACLoss with
gather_distributed, NACMQ) equal 0.1.0's hand-written formula bit for bit; MoCo's batch
shuffle/unshuffle is exact.  The shuffle's all-to-all (issue 54) gives the old all-gather's rows
bit for bit at 2 and 4 ranks, in the input's dtype, and a byte-counting wrapper of
torch.distributed measures what it delivers per rank; NACMQ's momentum_bn="sync" skips it.

nac_fast.ops.collectives with inputs the runs above do not use (an audit, 2 gloo processes):
ranks whose batches differ in size (the last batch of an epoch) get a ValueError naming the
argument on every rank (before: gloo aborted one process, "Received data size doesn't match
expected size"), a generic float64 loss over all_gather_with_grad gives, after DDP's averaging,
the one-process gradient of the global mean, batch shuffle of an odd batch (n = 3) is one
permutation on every rank and is inverted exactly, and batch_unshuffle refuses a y whose rows do
not match the permutation.

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

from nac_fast import NACMQ, CodeQueue, available_backends
from nac_fast.ops import collectives as nd
from nac_fast.ops.momentum import make_momentum_copy
from nac_fast.train.distributed import all_reduce_mean
from nac_fast.train.methods import nac_mq_step, nac_step, simclr_step
from nac_fast.train.models import build_model

from _old_steps import old_nac_mq_step, old_nac_step

WORLD, K, D, P = 2, 6, 16, 0.2   # K images per rank, 2K rows per rank
# in-batch NAC with each row's own code left out ([M:self-key]), per loss backend: "auto" (the
# fused CPU kernel where it is built), the reference, and Triton where it runs here
EXCLUDE = {"nac-exclude": "auto", "nac-exclude-reference": "reference"}
if "triton" in available_backends("cpu"):
    EXCLUDE["nac-exclude-triton"] = "triton"
METHODS = ("nac", "nac-mq", "simclr", *EXCLUDE, "nac-draws")


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
    """model: the NAC or SimCLR model, or (nac-mq) the NACMQ; any of them under DDP.
    EXCLUDE's methods: in-batch NAC with each row's own code left out of its keys
    ([M:self-key]) on that loss backend."""
    if method == "nac":
        return nac_step(model, x, P, noise=noise)[0]
    if method in EXCLUDE:
        return nac_step(model, x, P, noise=noise, backend=EXCLUDE[method], self_key="exclude")[0]
    if method == "nac-draws":  # 3 channel draws ([M:draws]), each row's own sign patterns
        draws = torch.stack([noise, -noise, noise.roll(1, dims=1)])
        return nac_step(model, x, P, noise=draws, self_key="exclude", noise_draws=3)[0]
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
        for method in METHODS:
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
            if method in ("nac", "nac-mq"):  # the same step by 0.1.0's formula, noise inside
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
@pytest.mark.parametrize("method", METHODS)
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


# --- shuffle BN by all-to-all (issue 54, point 1) ---------------------------------------------
# Under 2 and 4 gloo ranks: batch_shuffle / batch_unshuffle equal the old all-gather version
# (tests/_old_steps.py old_batch_shuffle) bit for bit for the same permutation, in the input's
# dtype and memory format; an NACMQ step with them equals the step with the old ones; and a
# byte-counting wrapper of torch.distributed measures what the shuffle delivers per rank.

SH_K, SH_D, SH_PX = 2, 16, 32  # images per rank, code width, image side of the NACMQ step


class _ByteCounter:
    """Wraps torch.distributed's all_to_all_single, all_gather and broadcast (the collectives the
    shuffle and check_same_shape call) and, while `on`, adds up per call the bytes the collective
    delivers into this rank's buffers: an all-to-all's and an all-gather's whole output (this
    rank's own block included: an upper bound of what crosses the network), a broadcast's tensor
    on the ranks other than its source."""

    def __init__(self):
        self.on, self.calls, self.saved = False, [], {}

    def _wrap(self, name, count):
        orig = self.saved[name] = getattr(dist, name)

        def wrapper(*args, **kwargs):
            if self.on:
                self.calls.append((name, count(*args, **kwargs)))
            return orig(*args, **kwargs)
        setattr(dist, name, wrapper)

    def __enter__(self):
        nbytes = lambda t: t.numel() * t.element_size()
        self._wrap("all_to_all_single", lambda out, *a, **k: nbytes(out))
        self._wrap("all_gather", lambda outs, *a, **k: sum(nbytes(t) for t in outs))
        self._wrap("broadcast", lambda t, src=0, *a, **k: 0 if dist.get_rank() == src
                   else nbytes(t))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def counting(self, fn):
        def wrapper(*args, **kwargs):
            self.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.on = False
        return wrapper

    @property
    def total(self):
        return sum(b for _, b in self.calls)


def _bn_model(bn=True):
    """resnet-tiny on 3 x SH_PX x SH_PX images (BatchNorm in the encoder), or with bn=False its
    encoder replaced by a linear layer without BatchNorm."""
    torch.manual_seed(0)
    m = build_model("resnet-tiny", 3, SH_PX, code_dim=SH_D)
    if not bn:
        m.encoder = nn.Sequential(nn.Flatten(), nn.Linear(3 * SH_PX ** 2, m.feature_dim),
                                  nn.Tanh())
    return m


def _mq_step(shuffle, unshuffle, x, **mq_kw):
    """One NACMQ call on this rank's x with the momentum branch's (un)shuffle replaced by the
    given functions, counted: (loss, queue codes, byte counter)."""
    import nac_fast.ops.momentum as M
    mq = NACMQ(_bn_model(not mq_kw.pop("no_bn", False)), queue_size=8 * dist.get_world_size() * SH_K, p=P, l2=0.1, **mq_kw)
    saved = M.batch_shuffle, M.batch_unshuffle
    torch.manual_seed(7 + dist.get_rank())  # the noise (every rank its own) and rank 0's perm
    with _ByteCounter() as bc:
        M.batch_shuffle, M.batch_unshuffle = bc.counting(shuffle), bc.counting(unshuffle)
        try:
            loss = mq(x[:SH_K], x[SH_K:]).loss
        finally:
            M.batch_shuffle, M.batch_unshuffle = saved
    return loss.detach(), mq.queue.codes.clone(), bc


def _shuffle_part(rank, world):
    from _old_steps import old_batch_shuffle, old_batch_unshuffle
    res = {"cases": {}}
    base = torch.arange(3 * 3 * 8 * 8, dtype=torch.float32).view(3, 3, 8, 8) / 7 + rank * 1000
    cases = {"fp32 odd n": base, "bf16": base[:2].bfloat16(),
             "uint8": (base[:2] % 251).to(torch.uint8),
             "channels-last": base[:2].contiguous(memory_format=torch.channels_last),
             "codes fp64": torch.randn(5, 7, dtype=torch.float64) + rank}
    f = lambda t: t * 2 + 1  # a per-row function: what the momentum encoder stands for
    for name, x in cases.items():
        torch.manual_seed(11)  # only rank 0 draws: the same permutation both times
        new, plan = nd.batch_shuffle(x)
        torch.manual_seed(11)
        old, idx = old_batch_shuffle(x)
        g = lambda s: torch.Generator().manual_seed(s)
        new_g, _ = nd.batch_shuffle(x, generator=g(5))
        old_g, _ = old_batch_shuffle(x, generator=g(5))
        y = f(new.double()).to(x.dtype) if x.dtype != torch.uint8 else new + 1
        y_old = f(old.double()).to(x.dtype) if x.dtype != torch.uint8 else old + 1
        back, back_old = nd.batch_unshuffle(y, plan), old_batch_unshuffle(y_old, idx)
        res["cases"][name] = {
            "equal": torch.equal(new, old) and torch.equal(new_g, old_g),
            "dtype": new.dtype == x.dtype and back.dtype == x.dtype,
            "cl": new.is_contiguous(memory_format=torch.channels_last),
            "idx": torch.equal(plan.idx_unshuffle, idx),
            "back": torch.equal(back, back_old),
            "ident": torch.equal(nd.batch_unshuffle(new, plan), x),
            "moved": not torch.equal(new, x)}
    x = torch.randn(2 * SH_K, 3, SH_PX, SH_PX, generator=torch.Generator().manual_seed(rank))
    res["own_fp32"] = x.numel() * 4
    loss, codes, bc = _mq_step(nd.batch_shuffle, nd.batch_unshuffle, x)
    loss_o, codes_o, bc_o = _mq_step(old_batch_shuffle, old_batch_unshuffle, x)
    res["step_equal"] = torch.equal(loss, loss_o) and torch.equal(codes, codes_o)
    res["new_calls"], res["old_calls"] = bc.calls, bc_o.calls
    # momentum_bn="sync" never shuffles (a model without BN: gloo's CPU has no SyncBN), and
    # its step equals the unshuffled one
    loss_s, codes_s, bc_s = _mq_step(nd.batch_shuffle, nd.batch_unshuffle, x, no_bn=True,
                                     momentum_bn="sync")
    loss_u, codes_u, _ = _mq_step(nd.batch_shuffle, nd.batch_unshuffle, x, no_bn=True,
                                  shuffle_bn=False)
    res["sync_calls"] = bc_s.calls
    res["sync_equal"] = torch.equal(loss_s, loss_u) and torch.equal(codes_s, codes_u)
    return res


def _in_group(rank, world, port, out_dir, parts):
    """One gloo group of `world` ranks on loopback running each of `parts` (names of the *_part
    functions below) in turn: a spawn and a group per fixture, not per subject."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        res = {}
        run = {"shuffle": lambda: _shuffle_part(rank, world),
               "collectives": lambda: _collectives_part(rank)}
        for part in parts:
            res[part] = run[part]()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path_factory, world, parts):
    d = tmp_path_factory.mktemp("gloo" + str(world))
    mp.spawn(_in_group, args=(world, _free_port(), str(d), parts), nprocs=world, join=True)
    return [torch.load(d / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    """The shuffle's and the collectives' checks at WORLD = 2 ranks, in one group."""
    return _spawn(tmp_path_factory, WORLD, ("shuffle", "collectives"))


@pytest.fixture(scope="module")
def shuffle_results(tmp_path_factory, gloo2):
    """{world size: [rank 0's results, ...]} at 2 and 4 gloo ranks."""
    return {2: [r["shuffle"] for r in gloo2],
            4: [r["shuffle"] for r in _spawn(tmp_path_factory, 4, ("shuffle",))]}


@pytest.mark.slow
def test_batch_shuffle_all_to_all_equals_the_all_gather_version(shuffle_results):
    for world, ranks in shuffle_results.items():
        for r, res in enumerate(ranks):
            for name, c in res["cases"].items():
                assert c["equal"] and c["idx"] and c["back"] and c["ident"], (world, r, name, c)
                assert c["dtype"], (world, r, name)  # bf16 / uint8 stay so, both ways
                assert c["cl"] == (name == "channels-last"), (world, r, name)
            # rows really move between ranks (every rank's first case is changed)
            assert any(c["moved"] for c in res["cases"].values()), (world, r)
            # the NACMQ step (BatchNorm in the momentum encoder) equals the old shuffle's
            assert res["step_equal"], (world, r)


def _shuffle_bytes(calls):
    return sum(b for _, b in calls)


def test_batch_shuffle_bytes_per_rank_at_most_1_5x_own_views_and_flat_in_world_size(
        shuffle_results):
    ratios = {}
    for world, ranks in shuffle_results.items():
        for r, res in enumerate(ranks):
            own = res["own_fp32"]
            new, old = _shuffle_bytes(res["new_calls"]), _shuffle_bytes(res["old_calls"])
            ratios[world, r] = (new / own, old / own)
            # the images: ONE all-to-all delivering exactly this rank's 2K rows (fp32 here)
            a2a = [b for name, b in res["new_calls"] if name == "all_to_all_single"]
            assert len(a2a) == 3 and a2a[0] == own, (world, r, res["new_calls"])  # + h, a back
            assert new <= 1.5 * own, (world, r, new / own)
            assert old >= world * own  # the all-gather of the global batch
            assert res["sync_calls"] == [] and res["sync_equal"], (world, r)
    print("shuffle bytes received per rank per step / own two views in fp32 (new, old):",
          {k: (round(a, 4), round(b, 4)) for k, (a, b) in ratios.items()})
    for r in range(2):
        n2 = [b for name, b in shuffle_results[2][r]["new_calls"] if name == "all_to_all_single"]
        n4 = [b for name, b in shuffle_results[4][r]["new_calls"] if name == "all_to_all_single"]
        assert n2 == n4  # what moves the rows does not grow with the ranks
        # the rest (the broadcast permutation, 8 bytes a global row, and the shape check) grows
        # by less than 1% of the views here
        assert ratios[4, r][0] - ratios[2, r][0] < 0.01, ratios
        assert ratios[4, r][1] - ratios[2, r][1] > 1.9, ratios  # the old one: + 1x per rank


def test_momentum_bn_sync_converts_the_momentum_copy_only():
    mq = NACMQ(_bn_model(), queue_size=16, momentum_bn="sync")
    kinds = lambda m: {type(x).__name__ for x in m.modules() if "BatchNorm" in type(x).__name__}
    assert kinds(mq.momentum_model) == {"SyncBatchNorm"} and kinds(mq.model) == {"BatchNorm2d"}
    assert not mq.shuffle_bn and "momentum_bn=sync" in repr(mq)
    ref = NACMQ(_bn_model(), queue_size=16)  # shuffle: plain BatchNorm, the same state
    assert ref.shuffle_bn and kinds(ref.momentum_model) == {"BatchNorm2d"}
    sd, sd_ref = mq.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    # one process: SyncBatchNorm is BatchNorm, so both give the same step
    x = torch.randn(2 * SH_K, 3, SH_PX, SH_PX, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    loss = mq(x[:SH_K], x[SH_K:]).loss
    torch.manual_seed(3)
    assert torch.equal(loss, ref(x[:SH_K], x[SH_K:]).loss)
    assert NACMQ(_bn_model(), queue_size=16, shuffle_bn=False).shuffle_bn is False


@pytest.mark.parametrize("kw, err, match", [
    (dict(momentum_bn="local"), ValueError, "momentum_bn must be one of shuffle, sync"),
    (dict(momentum_bn="sync", shuffle_bn=True), ValueError, "shuffle_bn=True contradicts"),
    (dict(shuffle_bn="yes"), TypeError, "shuffle_bn must be a bool")])
def test_momentum_bn_bad_values(kw, err, match):
    with pytest.raises(err, match=match):
        NACMQ(_bn_model(), queue_size=16, **kw)


def test_momentum_bn_flag(monkeypatch):
    from nac_fast.train.config import UsageError, parse
    base = ["--data", "synthetic:64", "--batch-size", "16", "--max-steps", "2", "--method",
            "nac-mq"]
    assert parse(base).momentum_bn == "shuffle"
    with pytest.raises(UsageError, match="--momentum-bn sync needs several processes"):
        parse(base + ["--momentum-bn", "sync"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--momentum-bn sync needs CUDA"):
            parse(base + ["--momentum-bn", "sync"])
    else:
        assert parse(base + ["--momentum-bn", "sync"]).momentum_bn == "sync"
    assert parse(base + ["--method", "nac", "--momentum-bn", "sync"]).momentum_bn == "sync"
    with pytest.raises(UsageError, match="--momentum-bn: invalid choice: 'local'"):
        parse(base + ["--momentum-bn", "local"])


# ---- the collectives on inputs the runs above do not use: uneven and odd batches ----------------

CN, CD = 3, 4   # rows per rank and their width, for the collectives' checks


def _coll_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(WORLD * CN, CD, dtype=torch.float64, generator=g), \
        torch.randn(CD, CD, dtype=torch.float64, generator=g)


def _coll_loss(q, keys, w):
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


def _collectives_part(rank):
    res = {}
    x, w0 = _coll_data()
    # gradient of a rank's weights through the gathered keys, DDP-style averaged
    w = w0.clone().requires_grad_()
    q = x[rank * CN:(rank + 1) * CN]
    _coll_loss(q, nd.all_gather_with_grad(q @ torch.eye(CD, dtype=torch.float64)),
               w).backward()
    g = w.grad.clone()
    dist.all_reduce(g)
    res["grad"] = g / WORLD
    # gradient reaching the rows themselves (each rank's slice gets every rank's part)
    xr = x[rank * CN:(rank + 1) * CN].clone().requires_grad_()
    _coll_loss(xr, nd.all_gather_with_grad(xr), w0).backward()
    res["xgrad"] = xr.grad / WORLD  # DDP's average
    # uneven rows: every rank refuses, naming the argument
    n = CN if rank == 0 else CN - 1
    t = torch.randn(n, CD, dtype=torch.float64, requires_grad=True)
    res["uneven_grad"] = _expect_value_error(lambda: nd.all_gather_with_grad(t))
    res["uneven_nograd"] = _expect_value_error(lambda: nd.all_gather_nograd(t.detach()))
    res["uneven_shuffle"] = _expect_value_error(lambda: nd.batch_shuffle(t.detach()))
    tt = torch.randn(CN, CD, dtype=torch.float32 if rank else torch.float64)
    res["dtype"] = _expect_value_error(lambda: nd.all_gather_nograd(tt))
    # still usable after the refusals: the group is not broken
    y = nd.all_gather_nograd(torch.full((CN, 2), float(rank)))
    res["after"] = y[:, 0].tolist()
    # batch shuffle of an odd batch: one permutation, exact inverse
    torch.manual_seed(100 + rank)  # only rank 0 draws: the ranks' RNGs differ on purpose
    xb = torch.arange(CN * 2, dtype=torch.float64).view(CN, 2) + 100 * rank
    xs, plan = nd.batch_shuffle(xb)
    res["idx"] = plan.idx_unshuffle.clone()
    res["xs"] = xs.clone()
    res["back"] = torch.equal(nd.batch_unshuffle(xs, plan), xb)
    res["bad_idx"] = _expect_value_error(lambda: nd.batch_unshuffle(xs[:2], plan))
    return res


@pytest.fixture(scope="module")
def collectives_results(gloo2):
    return [r["collectives"] for r in gloo2]


@pytest.mark.slow
def test_gathered_gradient_equals_one_process_over_the_global_batch(collectives_results):
    results = collectives_results
    x, w0 = _coll_data()
    w = w0.clone().requires_grad_()
    _coll_loss(x, x, w).backward()
    xg = x.clone().requires_grad_()
    _coll_loss(xg, xg, w0).backward()
    for r in range(WORLD):
        torch.testing.assert_close(results[r]["grad"], w.grad, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(results[r]["xgrad"], xg.grad[r * CN:(r + 1) * CN],
                                   rtol=1e-12, atol=1e-14)


def test_uneven_batches_are_refused_on_every_rank(collectives_results):
    results = collectives_results
    for r in range(WORLD):
        for key in ("uneven_grad", "uneven_nograd", "uneven_shuffle"):
            msg = results[r][key]
            assert msg is not None, (r, key)
            assert msg.startswith("x must have the same shape") and "rank 0: (3, 4)" in msg \
                and "rank 1: (2, 4)" in msg and "drop_last" in msg, msg
        assert results[r]["dtype"] is not None and "dtype" in results[r]["dtype"]
        assert results[r]["after"] == [0.0] * CN + [1.0] * CN


def test_batch_shuffle_odd_batch_one_permutation_exact_inverse(collectives_results):
    results = collectives_results
    assert torch.equal(results[0]["idx"], results[1]["idx"])
    perm = torch.argsort(results[0]["idx"])
    assert sorted(perm.tolist()) == list(range(WORLD * CN))
    glob = torch.cat([torch.arange(CN * 2, dtype=torch.float64).view(CN, 2) + 100 * r
                      for r in range(WORLD)])
    for r in range(WORLD):
        assert results[r]["back"]
        assert torch.equal(results[r]["xs"], glob[perm[r * CN:(r + 1) * CN]])
        msg = results[r]["bad_idx"]
        assert msg is not None, msg
        assert msg.startswith("y must have as many rows as batch_shuffle's x"), msg
