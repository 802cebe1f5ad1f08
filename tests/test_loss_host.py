"""The host path of the fused loss (issue 37): cached launch plans, direct launches, and the
autograd.Function that replaces the registered ops' dispatch outside tracing.

Under TRITON_INTERPRET=1 the Triton kernels run on CPU tensors, so the cached plans' binding is
checked here against the path every call took before (the registered torch.library ops with a plan
built per call): the same launches on the same data give the same bits.  The GPU's direct launches
(the compiled kernel's launcher) are checked with a recording stand-in for that launcher.
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

import nac_fast
from nac_fast.ops import dispatch, nac, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/gpu_suite.sh runs this file with NAC_FAST_TEST_DEVICE=cuda: the cached plans and the
# direct launches for real
DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")

pytestmark = pytest.mark.skipif(
    "triton" not in nac_fast.available_backends(DEVICE),
    reason=f"the Triton backend on {DEVICE} tensors (CPU: needs triton and TRITON_INTERPRET=1)")


@pytest.fixture
def kernels():
    from nac_fast.kernels import launch, nac_noise_triton, nac_triton
    for c in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS, nac_noise_triton.PLANS):
        c.clear()
    return launch, nac_triton, nac_noise_triton


@contextlib.contextmanager
def op_path():
    """The path of every eager call before the plan cache: the registered ops (torch.library
    dispatch and autograd) with each call's plan built afresh and launched through `run`."""
    from nac_fast.kernels import nac_noise_triton, nac_triton
    from nac_fast.ops import noise
    mods = (nac, nac_triton, nac_noise_triton, noise)
    names = ("_eager_real", "eager_real", "eager_real", "eager_real")
    saved = [getattr(m, nm) for m, nm in zip(mods, names)]
    for m, nm in zip(mods, names):
        setattr(m, nm, lambda t: False)
    try:
        yield
    finally:
        for m, nm, v in zip(mods, names, saved):
            setattr(m, nm, v)


def _run(kind, dtype, *, p=0.1, strided=False, keys_grad=False, need_r=True, seed=0,
         reduction="mean", own=None):
    """own: None, every key; an int, each row's own key left out at that self_offset
    (self_key="exclude", docs/math.md [M:self-key]; kinds inbatch and keys)."""
    g = torch.Generator().manual_seed(seed)
    ex = {} if own is None else dict(self_key="exclude", self_offset=own)
    n, N, D = 37, 53, 24
    big = torch.randn(n, 2 * D, generator=g, dtype=torch.float64).to(DEVICE)
    a = (big[:, ::2] if strided else big[:, :D]).to(dtype).detach().requires_grad_()
    r = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(need_r)
    noise = nac_fast.draw_noise((n, D), p, generator=g, dtype=dtype).to(DEVICE)
    w = torch.randn(n, generator=g, dtype=torch.float64).to(DEVICE, reference.acc_dtype(dtype))
    if kind == "inbatch":
        out = nac_fast.nac_loss(a, r, p, noise=noise, backend="triton", reduction="none", **ex)
    else:
        keys = torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
        keys.requires_grad_(keys_grad)
        out = nac_fast.nac_loss(a, r, p, keys=keys, noise=noise, backend="triton",
                                reduction="none", **ex) if keys_grad or ex else \
            nac_fast.nac_mq_loss(a, r, keys, p, noise=noise, backend="triton", reduction="none")
    loss = (out * w).sum() if reduction == "none" else out.mean()
    leaves = [t for t in (a, r) if t.requires_grad]
    if kind != "inbatch" and keys_grad:
        leaves.append(keys)
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), grads


CASES = [("inbatch", torch.float32, {}), ("inbatch", torch.bfloat16, {}),
         ("inbatch", torch.float64, {"strided": True}), ("keys", torch.float32, {"keys_grad": True}),
         ("mq", torch.bfloat16, {"need_r": False}), ("mq", torch.float32, {"reduction": "none"}),
         # each row's own key left out ([M:self-key]): in-batch, and in given keys at an offset
         ("inbatch", torch.float32, {"own": 0}),
         ("keys", torch.bfloat16, {"keys_grad": True, "own": 16, "reduction": "none"})]


@pytest.mark.parametrize("kind,dtype,kw", CASES)
def test_cached_plans_give_the_op_paths_bits(kernels, kind, dtype, kw):
    """Twice through the eager path (recorded, then bound from the cache) and once through the
    registered ops with a fresh plan: the same losses and gradients, bit for bit."""
    first = _run(kind, dtype, **kw)
    second = _run(kind, dtype, **kw)
    with op_path():
        old = _run(kind, dtype, **kw)
    for got in (first, second):
        assert torch.equal(got[0], old[0])
        for x, y in zip(got[1], old[1]):
            assert torch.equal(x, y)


def test_a_second_call_rebuilds_no_plan(kernels):
    _, nac_triton, noise_triton = kernels
    _run("inbatch", torch.float32)
    rec = (nac_triton.FWD_PLANS.recorded, nac_triton.BWD_PLANS.recorded, noise_triton.PLANS.recorded)
    assert rec == (1, 1, 0)  # the noise here is given: its op is not called
    for seed in (1, 2, 3):  # other data, same shapes
        _run("inbatch", torch.float32, seed=seed)
    assert (nac_triton.FWD_PLANS.recorded, nac_triton.BWD_PLANS.recorded) == rec[:2]
    _run("inbatch", torch.bfloat16)  # another dtype: another plan
    assert nac_triton.FWD_PLANS.recorded == 2


def test_a_changed_self_offset_records_a_new_plan(kernels):
    """self_offset is part of a plan's key (it is baked into the launches' arguments): each
    offset its own plan, and a second call with one records none."""
    _, nac_triton, _ = kernels
    _run("keys", torch.float32, keys_grad=True)
    for own in (0, 16, 0):
        _run("keys", torch.float32, keys_grad=True, own=own)
    assert (nac_triton.FWD_PLANS.recorded, nac_triton.BWD_PLANS.recorded) == (3, 3)


def test_a_plan_allocates_only_the_buffers_its_launches_use(kernels):
    """Per call a plan allocates the buffers its launches or outputs use, nothing else (the
    split's probe stand-ins are not allocated) and no empty one (those are made once)."""
    _, nac_triton, _ = kernels
    for kind in ("inbatch", "mq"):
        _run(kind, torch.float32)
    for cache in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS):
        for plan in cache.plans.values():
            used = {i for *_, dyn, _, _ in plan.launches for _, src, i in dyn if src == 1}
            used |= {i for src, i in plan.outputs if src == 1}
            assert used == set(range(plan.nbuf))
            assert all(0 not in shape for shape, _, _ in plan.buffers)


@pytest.fixture
def kept_scratch(kernels, monkeypatch):
    """Scratch kept as on a GPU outside graph capture, on CPU tensors too; `streams` picks the
    current stream's key (kernels/launch.py SCRATCH_PLAN_MAX)."""
    launch = kernels[0]
    launch.release_scratch()
    streams = {"now": 0}
    monkeypatch.setattr(launch, "_keeps_scratch", lambda device: launch.KEEP_SCRATCH)
    monkeypatch.setattr(launch, "_stream_key", lambda device: streams["now"])
    yield launch, streams
    launch.release_scratch()


def _scratch_ptrs(nac_triton):
    return {(cache.name, stream): sorted(t.data_ptr() for t in held.values())
            for cache in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS)
            for plan in cache.plans.values() for stream, held in plan.scratch.items()}


@pytest.mark.parametrize("kind,dtype,kw", CASES)
def test_kept_scratch_gives_the_same_bits(kept_scratch, kernels, monkeypatch, kind, dtype, kw):
    """Calls that reuse a plan's scratch (split partials) compute what calls with fresh buffers
    do, bit for bit, and an earlier call's outputs are not touched by a later call."""
    launch, _ = kept_scratch
    _, nac_triton, _ = kernels
    first = _run(kind, dtype, **kw)
    second = _run(kind, dtype, **kw)   # the plans' first calls: their scratch is made
    held = _scratch_ptrs(nac_triton)
    third = _run(kind, dtype, **dict(kw, seed=1))
    assert _scratch_ptrs(nac_triton) == held  # reused, not reallocated
    monkeypatch.setattr(launch, "KEEP_SCRATCH", False)
    fresh = _run(kind, dtype, **dict(kw, seed=1))
    for got, want in ((second, first), (third, fresh)):
        assert torch.equal(got[0], want[0])
        for x, y in zip(got[1], want[1]):
            assert torch.equal(x, y)
    again = _run(kind, dtype, **kw)
    assert torch.equal(second[0], again[0])  # `second`'s outputs survived two later calls


def test_kept_scratch_is_per_stream_and_within_budget(kept_scratch, kernels, monkeypatch):
    launch, streams = kept_scratch
    _, nac_triton, _ = kernels
    for _ in range(2):
        _run("inbatch", torch.float32)
    held = launch._SCRATCH_HELD[0]
    plans = [p for c in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS) for p in c.plans.values()]
    assert held == sum(p.scratch_bytes for p in plans) > 0
    assert all(set(p.scratch) == {0} for p in plans if p.scratch_bytes)
    streams["now"] = 7  # another stream: scratch of its own
    _run("inbatch", torch.float32)
    assert launch._SCRATCH_HELD[0] == 2 * held
    ptrs = _scratch_ptrs(nac_triton)
    for (name, stream), p in ptrs.items():
        if stream == 7:
            assert not set(p) & set(ptrs[(name, 0)])
    # over the per-plan budget: allocated per call, nothing more held
    launch.release_scratch()
    assert launch._SCRATCH_HELD[0] == 0 and not _scratch_ptrs(nac_triton)
    monkeypatch.setattr(launch, "SCRATCH_PLAN_MAX", 16)
    for _ in range(2):
        _run("inbatch", torch.float32)
    assert launch._SCRATCH_HELD[0] == 0 and not any(_scratch_ptrs(nac_triton).values())
    # a cleared cache (or a plan dropped from it) gives its scratch back
    monkeypatch.setattr(launch, "SCRATCH_PLAN_MAX", 32 << 20)
    launch.release_scratch()
    for _ in range(2):
        _run("inbatch", torch.float32)
    assert launch._SCRATCH_HELD[0] == held
    nac_triton.FWD_PLANS.clear()
    nac_triton.BWD_PLANS.clear()
    assert launch._SCRATCH_HELD[0] == 0


def test_scratch_is_kept_on_a_gpu_only_outside_graph_capture(kernels, monkeypatch):
    launch = kernels[0]
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert launch._keeps_scratch(cuda) and not launch._keeps_scratch(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not launch._keeps_scratch(cuda)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "KEEP_SCRATCH", False)
    assert not launch._keeps_scratch(cuda)


def test_a_changed_environment_setting_records_a_new_plan(kernels, monkeypatch):
    """NAC_FAST_FP32_DOT is read at each call (into the plan's key): set between two calls, the
    second records a plan with the new product mode."""
    _, nac_triton, _ = kernels
    _run("inbatch", torch.float32)
    _run("inbatch", torch.float32)
    assert nac_triton.FWD_PLANS.recorded == 1
    monkeypatch.setenv("NAC_FAST_FP32_DOT", "ieee")
    _run("inbatch", torch.float32)
    assert nac_triton.FWD_PLANS.recorded == 2
    modes = {L.constexprs["PRECISION"] for p in nac_triton.FWD_PLANS.plans.values()
             for L, *_ in p.launches if L.tag == "fwd"}
    assert modes == {"tf32x3", "ieee"}


def test_the_noise_op_caches_its_plan_and_writes_the_dtype(kernels):
    _, _, noise_triton = kernels
    from nac_fast.ops.noise import noise_from_seed
    seed = torch.tensor([12345], dtype=torch.int64, device=DEVICE)
    like = torch.empty(5, 7, dtype=torch.bfloat16, device=DEVICE)
    m1 = noise_from_seed(like, seed, 0.2, backend="triton")
    m2 = noise_from_seed(like, seed, 0.3, backend="triton")
    assert noise_triton.PLANS.recorded == 1 and m1.dtype == torch.bfloat16
    for p, m in ((0.2, m1), (0.3, m2)):  # p is recomputed per call, not the recorded one
        ref = noise_from_seed(like.float(), seed, p, backend="reference")
        assert torch.equal(m.float(), ref)


def _seeded_vs_given(kind, dtype, n, D, p=0.15, seed=7):
    """(noise=None drawn by the Triton prologue, noise drawn first by draw_noise) from the same
    torch seed: each ((rows), grads)."""
    g = torch.Generator().manual_seed(seed)
    a0 = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    r0 = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    keys = torch.tanh(torch.randn(2 * n + 3, D, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    out = []
    for given in (False, True):
        a, r = a0.clone().requires_grad_(), r0.clone().requires_grad_()
        k = keys.clone().requires_grad_(kind == "keys")
        torch.manual_seed(seed)
        noise = nac_fast.draw_noise((n, D), p, device=DEVICE, dtype=dtype) if given else None
        if kind == "inbatch":
            rows = nac_fast.nac_loss(a, r, p, noise=noise, backend="triton", reduction="none")
        elif kind == "keys":  # gathered keys with a gradient (DDP's NACLoss)
            rows = nac_fast.nac_loss(a, r, p, keys=k, noise=noise, backend="triton",
                                     reduction="none")
        else:
            rows = nac_fast.nac_mq_loss(a, r, k, p, noise=noise, backend="triton",
                                        reduction="none")
        w = torch.linspace(-1, 1, n, dtype=rows.dtype, device=DEVICE)
        leaves = (a, r, k) if kind == "keys" else (a, r)
        out.append((rows.detach(), torch.autograd.grad((rows * w).sum(), leaves)))
    return out


@pytest.mark.parametrize("kind,dtype,n,D", [("inbatch", torch.float32, 37, 24),
                                            ("inbatch", torch.bfloat16, 1, 8),
                                            ("mq", torch.float16, 97, 16),
                                            ("mq", torch.float64, 3, 5),
                                            ("keys", torch.bfloat16, 29, 24)])
def test_the_prologue_draws_the_noise_draw_noise_draws(kernels, kind, dtype, n, D):
    """noise=None: the Triton forward's prologue draws the channel noise from the seed it is
    given (no noise kernel, no noise op); the same bits as draw_noise's from the same torch seed,
    so the same loss and gradients, bit for bit."""
    _, _, noise_triton = kernels
    (rows, grads), (rows_m, grads_m) = _seeded_vs_given(kind, dtype, n, D)
    assert torch.equal(rows, rows_m)
    for x, y in zip(grads, grads_m):
        assert torch.equal(x, y)


def test_the_seeded_forward_returns_its_noise(kernels):
    _, nac_triton, _ = kernels
    from nac_fast.ops.noise import noise_from_seed
    a, r = torch.randn(13, 8).to(DEVICE), torch.randn(13, 8).to(DEVICE)
    seed = torch.tensor([987654321012], dtype=torch.int64, device=DEVICE)
    for p in (0.1, 0.4):  # one plan, p per call
        m = nac_triton.fwd(a, r, None, None, 1.0, 0.0, True, seed, p)[5]
        assert torch.equal(m, noise_from_seed(a, seed, p, backend="reference"))
    assert nac_triton.FWD_PLANS.recorded == 1
    with pytest.raises(ValueError, match="seed"):
        nac_triton.fwd(a, r, None, None, 1.0, 0.0, True)


@pytest.mark.parametrize("n,dtype", [(1, torch.float32), (37, torch.bfloat16),
                                     pytest.param(4099, torch.float32, marks=pytest.mark.slow),
                                     (300, torch.float64)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_finish_reduces_the_rows(kernels, n, dtype, reduction):
    """The Triton finish's own reduction (reduction "mean"/"sum"): the rows' float64 sum within
    the rounding of n additions, and no per-row tensor; 4099 rows: more partial sums than one
    step of the last program's loop adds (REDUCE_BLOCK)."""
    _, nac_triton, _ = kernels
    g = torch.Generator().manual_seed(n)
    a = torch.randn(n, 8, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    r = torch.randn(n, 8, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    keys = torch.tanh(torch.randn(16, 8, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    noise = nac_fast.draw_noise((n, 8), 0.1, generator=g, dtype=dtype).to(DEVICE)
    rows = nac_triton.fwd(a, r, noise, keys, 1.3, 0.01, False)[0]
    out = nac_triton.fwd(a, r, noise, keys, 1.3, 0.01, False, reduction=reduction)[0]
    assert out.dim() == 0 and out.dtype == rows.dtype
    want = rows.double().sum() / (n if reduction == "mean" else 1)
    bound = n * torch.finfo(rows.dtype).eps * rows.double().abs().sum() / (
        n if reduction == "mean" else 1)
    assert abs(out.double() - want) <= bound
    if n > 1:  # the order of the additions is the kernel's: a fixed one
        assert torch.equal(out, nac_triton.fwd(a, r, noise, keys, 1.3, 0.01, False,
                                               reduction=reduction)[0])


def test_the_finish_leaves_its_counter_zero(kept_scratch, kernels):
    """The reduction's counter (and, the finish folded into the forward, the query blocks'
    counters), kept as scratch, is left zero by the program that finishes last: call after call
    (kept: zeroed once) gives what fresh buffers give."""
    launch, _ = kept_scratch
    _, nac_triton, _ = kernels
    g = torch.Generator().manual_seed(3)
    a, r = torch.randn(97, 8, generator=g).to(DEVICE), torch.randn(97, 8, generator=g).to(DEVICE)
    noise = nac_fast.draw_noise((97, 8), 0.1, generator=g).to(DEVICE)
    outs = [nac_triton.fwd(a, r, noise, None, 1.0, 0.0, False, reduction="mean")[0]
            for _ in range(4)]
    (plan,) = nac_triton.FWD_PLANS.plans.values()
    assert plan.scratch and any(plan.zeroed)
    (held,) = plan.scratch.values()
    counters = [held[i] for i in held if plan.zeroed[i]]
    assert len(counters) == (2 if nac_triton.folding() else 1)
    for counter in counters:
        assert counter.dtype == torch.int32 and not counter.any()
    assert all(torch.equal(o, outs[0]) for o in outs)


HOST_SEED = (3 << 61) + 123456789  # an int64 of the range host_seed draws in


@pytest.mark.parametrize("keys_n", [None, 50])
def test_a_host_seed_gives_the_noise_of_that_seed(kernels, keys_n):
    """A seed drawn on the host (an int: the kernel's argument, no device draw) gives the noise
    noise_from_seed gives for that value in a tensor, bit for bit: in the prologue (in-batch),
    the forward kernel (given keys) and the noise op; a later call binds its own seed and p to
    the same plan, and a tensor seed takes a plan of its own."""
    _, nac_triton, noise_triton = kernels
    from nac_fast.ops.noise import noise_from_seed
    a, r = torch.randn(29, 16).to(DEVICE), torch.randn(29, 16).to(DEVICE)
    keys = None if keys_n is None else torch.tanh(torch.randn(keys_n, 16)).to(DEVICE)
    for seed, p in ((HOST_SEED, 0.1), (HOST_SEED + 7, 0.3)):
        t = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
        want = noise_from_seed(a, t, p, backend="reference")
        out = nac_triton.fwd(a, r, None, keys, 1.0, 0.0, True, seed, p)
        assert torch.equal(out[5], want)
        ref = nac_triton.fwd(a, r, None, keys, 1.0, 0.0, True, t, p)  # the tensor seed's plan
        for x, y in zip(out, ref):
            assert torch.equal(x, y)
        assert torch.equal(noise_triton.noise(a, seed, p), want)
    assert nac_triton.FWD_PLANS.recorded == 2 and noise_triton.PLANS.recorded == 1


def test_host_seed_draws_from_the_cuda_generator_outside_capture(monkeypatch):
    """host_seed: a function of the CUDA generator's (seed, offset), the offset advanced by 4; None
    for a CPU tensor, under graph capture, or for another device's generator."""
    from nac_fast.ops import noise as N

    class Gen:
        def __init__(self, device):
            self.device, self.offset = torch.device(device), 8

        def initial_seed(self):
            return 2 ** 64 - 5

        def get_offset(self):
            return self.offset

        def set_offset(self, off):
            assert off % 4 == 0
            self.offset = off

    gens = (Gen("cuda:0"), Gen("cuda:1"))
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert N.host_seed(torch.device("cpu")) is None
    first = N.host_seed(torch.device("cuda"))  # the current device's generator
    assert first == N.mix_seed(2 ** 64 - 5, 8) and gens[1].offset == 12 and gens[0].offset == 8
    second = N.host_seed(torch.device("cuda", 1))
    assert second == N.mix_seed(2 ** 64 - 5, 12) != first
    assert N.host_seed(torch.device("cuda", 0), generator=gens[0]) == N.mix_seed(2 ** 64 - 5, 8)
    assert N.host_seed(torch.device("cuda", 0), generator=gens[1]) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert N.host_seed(torch.device("cuda", 1)) is None and gens[1].offset == 16
    for s, off in ((0, 0), (2 ** 64 - 1, 2 ** 40), (12345, 4)):
        assert 2 ** 62 <= N.mix_seed(s, off) < 2 ** 63  # passed to the kernels as an int64
    assert len({N.mix_seed(1, 4 * i) for i in range(1000)}) == 1000


def test_the_loss_passes_a_host_seed_to_its_kernel(kernels, monkeypatch):
    """nac_loss(noise=None) with a host seed (as on a GPU outside capture, forced here): the
    loss and gradients of the noise of that seed, given explicitly, bit for bit."""
    from nac_fast.ops import loss as loss_mod
    from nac_fast.ops.noise import noise_from_seed
    monkeypatch.setattr(loss_mod, "host_seed", lambda device: HOST_SEED)
    g = torch.Generator().manual_seed(5)
    a0, r0 = torch.randn(23, 12, generator=g).to(DEVICE), torch.randn(23, 12, generator=g).to(DEVICE)
    noise = noise_from_seed(a0, torch.tensor([HOST_SEED], device=DEVICE), 0.2)
    out = []
    for m in (None, noise):
        a, r = a0.clone().requires_grad_(), r0.clone().requires_grad_()
        loss = nac_fast.nac_loss(a, r, 0.2, noise=m, backend="triton")
        out.append((loss.detach(), *torch.autograd.grad(loss, (a, r))))
    for x, y in zip(*out):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("kind,dtype", [("inbatch", torch.float32), ("keys", torch.float16),
                                        ("mq", torch.bfloat16), ("inbatch", torch.float64)])
@pytest.mark.parametrize("reduction,n", [("mean", 37), ("mean", 32), ("sum", 37)])
def test_the_folded_reductions_give_autograds_figures(kernels, backend, kind, dtype, reduction, n):
    """reduction="mean"/"sum" are the fused Function's own: the backward's g is expanded and
    (Triton, 16/32-bit) the mean's 1/n applied inside the backward as g * fl32(1/n), with no
    MeanBackward launch; the Triton forward's finish reduces the rows itself.  Against
    reduction="none" reduced by torch outside: the same loss (Triton: within the rounding of
    another order of the additions); the
    same gradients bit for bit where the weights are the same numbers (sum; n a power of 2; the
    compiled ops and float64, which divide first), else within the one ulp by which
    fl32(fl32(1/n) g) may differ from a CPU's exact g / n, carried through the backward."""
    if backend not in nac_fast.available_backends(DEVICE):
        pytest.skip(f"no {backend} backend on {DEVICE}")
    g = torch.Generator().manual_seed(2)
    N, D = 41, 24
    a0 = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    r0 = torch.randn(n, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)
    k0 = torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64)).to(DEVICE, dtype)
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g, dtype=dtype).to(DEVICE)
    got = []
    for red in (reduction, "none"):
        a, r = a0.clone().requires_grad_(), r0.clone().requires_grad_()
        keys = k0.clone().requires_grad_(kind == "keys")
        if kind == "mq":
            out = nac_fast.nac_mq_loss(a, r, keys, 0.1, noise=noise, backend=backend,
                                       reduction=red)
        else:
            out = nac_fast.nac_loss(a, r, 0.1, keys=None if kind == "inbatch" else keys,
                                    noise=noise, backend=backend, reduction=red)
        if red == "none":
            out = out.mean() if reduction == "mean" else out.sum()
        leaves = (a, r, keys) if kind == "keys" else (a, r)
        got.append((out.detach(), torch.autograd.grad(out * 3.0, leaves)))
    (loss, grads), (loss_t, grads_t) = got
    if backend == "triton":  # the finish adds the rows itself, in its own order
        eps = torch.finfo(loss.dtype).eps
        torch.testing.assert_close(loss, loss_t, rtol=n * eps, atol=0)
    else:
        assert torch.equal(loss, loss_t)
    exact = (reduction == "sum" or n & (n - 1) == 0 or backend != "triton"
             or dtype == torch.float64 or DEVICE != "cpu")
    for x, y in zip(grads, grads_t):
        if exact:
            assert torch.equal(x, y)
        else:
            # rounding differences of a few ulps of the gradient's scale (its terms cancel)
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(x, y, rtol=eps, atol=4 * eps * y.abs().max().item())


def test_a_changed_p_is_used_by_a_cached_plan(kernels):
    """s and lambda are the plan's per-call scalars: a p schedule changes them every step."""
    g = torch.Generator().manual_seed(3)
    a, r = torch.randn(20, 16, generator=g).to(DEVICE), torch.randn(20, 16, generator=g).to(DEVICE)
    q = torch.tanh(torch.randn(40, 16, generator=g)).to(DEVICE)
    noise = nac_fast.draw_noise((20, 16), 0.1, generator=g).to(DEVICE)
    for p, l2 in ((0.1, 0.1), (0.3, 0.0), (0.05, 0.5)):
        got = nac_fast.nac_mq_loss(a, r, q, p, l2=l2, noise=noise, backend="triton")
        want = nac_fast.nac_mq_loss(a, r, q, p, l2=l2, noise=noise, backend="reference")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _, nac_triton, _ = kernels
    assert nac_triton.FWD_PLANS.recorded == 1


def test_aliased_inputs_are_not_cached_and_stay_right(kernels):
    """One tensor passed as both a and r: the recorded plan could not tell a later call's two
    tensors apart, so nothing is cached; a later call with two tensors is right."""
    _, nac_triton, _ = kernels
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 8, generator=g).to(DEVICE)
    noise = nac_fast.draw_noise((9, 8), 0.1, generator=g).to(DEVICE)
    got = nac_fast.nac_loss(x, x, 0.1, noise=noise, backend="triton", reduction="none")
    want = nac_fast.nac_loss(x, x, 0.1, noise=noise, backend="reference", reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not nac_triton.FWD_PLANS.plans
    y = torch.randn(9, 8, generator=g).to(DEVICE)
    got = nac_fast.nac_loss(x, y, 0.1, noise=noise, backend="triton", reduction="none")
    want = nac_fast.nac_loss(x, y, 0.1, noise=noise, backend="reference", reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_plan_refuses_a_tensor_it_cannot_bind(kernels):
    launch, nac_triton, _ = kernels
    x, y = torch.empty(4), torch.empty(4)
    L = launch.Launch(nac_triton._sum_splits_kernel, (1,), (x, y, 4, 1), dict(BLOCK=4), 4, 1, "t")
    with pytest.raises(RuntimeError, match="neither an input"):
        launch.Plan([L], (), (x,), [])


class FakeLauncher:
    """Stands in for the compiled kernels' launchers: records (grid, args) of each direct launch
    and of each first launch through triton's own path."""

    def __init__(self):
        self.direct, self.first = [], []

    def first_launch(self, L):
        self.first.append(L)
        return (lambda *a: self.direct.append(a)), object(), object()


@pytest.fixture
def direct(kernels, monkeypatch):
    launch, nac_triton, _ = kernels
    fake = FakeLauncher()
    monkeypatch.setattr(launch, "direct_launches", lambda device: True)
    monkeypatch.setattr(launch, "_first_launch", fake.first_launch)
    monkeypatch.setattr(launch, "_stream", lambda index: 7)
    monkeypatch.setattr(nac_triton, "target_of", lambda device: launch.SM90)
    return fake


def test_direct_launches_bind_each_calls_tensors_and_scalars(direct, kernels):
    launch, nac_triton, _ = kernels
    n, D = 30, 32
    ins = [tuple(torch.randn(n, D) for _ in range(3)) for _ in range(2)]
    out1 = nac_triton.fwd(*ins[0], None, 1.25, 0.5, True)
    assert len(direct.first) >= 2 and not direct.direct  # recorded: triton's own path
    first = list(direct.first)
    out2 = nac_triton.fwd(*ins[1], None, 2.5, 0.25, True)
    assert len(direct.direct) == len(first)
    for L, call in zip(first, direct.direct):
        grid = tuple(L.grid) + (1,) * (3 - len(L.grid))
        assert call[:3] == grid and call[3] == 7
        args = call[9:]
        names = L.kernel.arg_names
        assert len(args) == len(names)
        for i, name in enumerate(names):
            if name in L.constexprs:
                assert args[i] == L.constexprs[name]
        # the second call's own tensors, never the recorded call's
        ptrs = {t.data_ptr() for t in args if isinstance(t, torch.Tensor)}
        assert not ptrs & {t.data_ptr() for t in ins[0]}
        assert not ptrs & {t.data_ptr() for t in out1 if t.numel()}
        if L.tag == "prologue":
            assert args[names.index("scale2")] == pytest.approx(2.5 * nac_triton.LOG2E)
            assert args[0] is ins[1][0]
        if L.tag == "finish":
            assert args[names.index("s")] == 2.5 and args[names.index("l2")] == 0.25
            assert args[names.index("LOSS")] is out2[0]
        if L.tag == "fwd":  # the finish folded in (NAC_FAST_FOLD unset): its scalars too
            assert L.constexprs["FINISH"] == nac_triton.folding()
            assert args[names.index("s_fin")] == 2.5 and args[names.index("l2")] == 0.25
            assert args[names.index("LOSS")] is out2[0]


def test_direct_launches_bind_each_calls_seed_and_p(direct, kernels):
    """noise=None: the kernel that makes Q draws the noise from the call's own seed tensor with
    the call's own p (in-batch: the prologue; given keys: the forward kernel), never the
    recorded call's."""
    _, nac_triton, _ = kernels
    n, D = 30, 32
    for keys in (None, torch.randn(50, D)):
        direct.first.clear()
        direct.direct.clear()
        a, r = torch.randn(n, D), torch.randn(n, D)
        seeds = [torch.tensor([s], dtype=torch.int64) for s in (11, 22)]
        nac_triton.fwd(a, r, None, keys, 1.0, 0.1, True, seeds[0], 0.1)
        out = nac_triton.fwd(a, r, None, keys, 1.0, 0.1, True, seeds[1], 0.3)
        tag = "prologue" if keys is None else "fwd"
        (L,) = [L for L in direct.first if L.tag == tag]
        (call,) = [c for Lf, c in zip(direct.first, direct.direct) if Lf.tag == tag]
        names = L.kernel.arg_names
        args = call[9:]
        assert args[names.index("SEED")].data_ptr() == seeds[1].data_ptr()  # a view of it
        assert args[names.index("p" if keys is None else "flip_p")] == 0.3
        assert args[names.index("NOISE")] is out[5]  # the noise it draws is the one returned


def test_a_misaligned_input_gets_its_own_compiled_kernels(direct, kernels):
    """triton specialises pointers on 16-byte alignment: an input at an odd offset must not run a
    kernel compiled for aligned ones."""
    _, nac_triton, _ = kernels
    n, D = 30, 32
    a, r, m = (torch.randn(n * D + 1)[1:].view(n, D) for _ in range(3))  # 4-byte offsets
    b = [torch.randn(n, D) for _ in range(3)]
    nac_triton.fwd(*b, None, 1.0, 0.0, False)
    k = len(direct.first)
    nac_triton.fwd(*b, None, 1.0, 0.0, False)
    assert len(direct.first) == k
    assert a.data_ptr() % 16
    nac_triton.fwd(a, r, m, None, 1.0, 0.0, False)
    assert len(direct.first) == 2 * k  # a new alignment signature: triton's own path again
    nac_triton.fwd(a, r, m, None, 1.0, 0.0, False)
    assert len(direct.first) == 2 * k


def test_misaligned_inputs_compute_the_same(kernels):
    """Inputs at a 4-byte offset (a view into a larger buffer) after aligned ones of the same
    shapes: a new alignment signature, the same values as contiguous copies."""
    g = torch.Generator().manual_seed(11)
    n, D = 29, 16
    src = [torch.randn(n * D + 1, generator=g).to(DEVICE) for _ in range(2)]
    a, r = (t[1:].view(n, D) for t in src)
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g).to(DEVICE)
    assert a.data_ptr() % 16
    aligned = nac_fast.nac_loss(a.clone(), r.clone(), 0.1, noise=noise, backend="triton",
                                reduction="none")
    shifted = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="triton", reduction="none")
    assert torch.equal(aligned, shifted)


def test_the_registered_ops_still_serve_tracing(kernels):
    """Fake tensors (what torch.compile traces with) take the registered ops: a fresh plan, no
    cache entry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    _, nac_triton, _ = kernels
    with FakeTensorMode():
        a = torch.empty(8, 16, requires_grad=True)
        r = torch.empty(8, 16)
        noise = torch.empty(8, 16)
        out = nac.nac_fused("triton", a, r, noise, None, 1.0, 0.0, "none")
        assert out.shape == (8,)
    assert not nac_triton.FWD_PLANS.plans


@pytest.mark.slow
def test_eager_calls_take_the_fast_path_from_the_source_tree():
    """As on the GPU machine: nac_fast imported from the checkout with no install (its kernels
    mapped by nac_fast/__init__.py), an eager call's autograd node is _FusedNAC's, not the
    registered op's (the first GPU run of this path took the op path: the fast path's import
    failed there and was swallowed)."""
    code = (
        "import sys\n"
        "sys.meta_path = [f for f in sys.meta_path if '__editable__' not in "
        "(getattr(f, '__module__', '') or '') and '__editable__' not in "
        "(getattr(type(f), '__module__', '') or '')]\n"
        "import torch, nac_fast\n"
        "from nac_fast.ops import nac\n"
        "assert nac_fast.__file__.startswith(sys.argv[1]), nac_fast.__file__\n"
        "a = torch.randn(6, 8, requires_grad=True)\n"
        "out = nac.nac_fused(sys.argv[2], a, torch.randn(6, 8), torch.ones(6, 8), None, 1.0, 0.0, 'mean')\n"
        "print(type(out.grad_fn).__name__)\n")  # the mean is the Function's own
    backend = "cpu" if "cpu" in nac_fast.available_backends("cpu") else "triton"
    res = subprocess.run([sys.executable, "-c", code, ROOT, backend], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), cwd="/", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip().splitlines()[-1] == "_FusedNACBackward", res.stdout


def _criterion_mq(dtype, reduction, *, fused, noise=False, l2=0.1, seed=1):
    """NACMQLoss on the Triton backend, its VI term fused into the loss (fused) or the two calls
    (the fused path switched off): (loss, grads of the four online outputs)."""
    from nac_fast.ops import loss as loss_mod
    K, D, N = 19, 24, 53
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(K, D, generator=g, dtype=torch.float64).to(DEVICE, dtype)  # noqa: E731
    outs = [(mk().requires_grad_(), mk().requires_grad_()) for _ in range(2)]
    mom = [(mk(), mk()) for _ in range(2)]
    q = nac_fast.CodeQueue(N, D, device=DEVICE, dtype=dtype)
    q.enqueue(torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64)).to(DEVICE, dtype))
    m = nac_fast.draw_noise((2 * K, D), 0.15, generator=g, dtype=dtype).to(DEVICE) if noise else None
    crit = nac_fast.NACMQLoss(0.15, l2=l2, backend="triton", reduction=reduction)
    saved = loss_mod._mq_and_vi_fused
    if not fused:
        loss_mod._mq_and_vi_fused = lambda *a, **k: None
    try:
        torch.manual_seed(seed)
        loss = crit(outs[0], outs[1], mom[0], mom[1], q, noise=m)
    finally:
        loss_mod._mq_and_vi_fused = saved
    w = torch.linspace(-1, 1, loss.numel(), dtype=loss.dtype, device=DEVICE).reshape(loss.shape)
    return loss.detach(), torch.autograd.grad((loss * w).sum(), [t for o in outs for t in o])


@pytest.mark.parametrize("dtype,reduction,noise,l2", [
    (torch.float32, "mean", False, 0.1), (torch.float32, "none", True, "auto"),
    (torch.bfloat16, "mean", False, 0.1), (torch.float64, "sum", True, 0.0)])
def test_the_criterions_vi_term_is_fused_and_right(kernels, dtype, reduction, noise, l2):
    """NACMQLoss on the Triton backend computes its inference term inside the fused loss (the
    finish adds it to each row, the rows' backward gives d/dr; one channel sample, drawn by the
    forward when not given): the same loss and gradients as its two calls, nac_mq_loss +
    nac_vi_loss, within the rounding of fp32 sums in another order (the gradients of a: bit
    for bit; of r: within one ulp of the dtype, the VI gradient's formula being the kernels')."""
    _, nac_triton, _ = kernels
    loss, grads = _criterion_mq(dtype, reduction, fused=True, noise=noise, l2=l2)
    assert any(L.constexprs.get("VI") for p in nac_triton.FWD_PLANS.plans.values()
               for L, *_ in p.launches)  # the fused path ran
    want, want_g = _criterion_mq(dtype, reduction, fused=False, noise=noise, l2=l2)
    eps = torch.finfo(loss.dtype).eps
    torch.testing.assert_close(loss, want, rtol=8 * eps, atol=8 * eps * want.abs().max().item())
    for i, (x, y) in enumerate(zip(grads, want_g)):
        if i % 2 == 0:  # a0, a1: the VI term gives them nothing
            assert torch.equal(x, y)
        else:           # r1, r0
            e = torch.finfo(dtype).eps
            torch.testing.assert_close(x, y, rtol=e, atol=e * y.abs().max().item())
