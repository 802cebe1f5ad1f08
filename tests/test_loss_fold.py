"""The row-wise tails folded into the Triton matrix kernels (kernels/nac_triton.py `folding`):
the finish into the forward (_fwd_kernel FINISH: the last split program of each query block to
arrive runs it) and the in-batch rows' backward into the keys' backward of several splits
(_bwd_keys_kernel OUT_MODE 3).  Two launches fewer a fwd+bwd in-batch, one with given keys, and
the same bits as the separate launches (NAC_FAST_FOLD=0; a reduced loss within a few ulps,
`_same`) in every mode: in-batch and given keys,
reductions, the NAC-MQ inference term, a seeded noise, d/dr not wanted, every dtype and fp32
product mode, one split and many; the counters are left zero for the next call.  Against
float64 the folded path is what tests/test_loss_backends.py checks (it is the default).  The GPU
suite runs this file on CUDA tensors, where the programs really run concurrently.
"""
import os

import pytest
import torch

import nac_fast

from _loss_helpers import fused_backends

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif("triton" not in fused_backends(DEVICE),
                                reason="the Triton backend does not run here")


def _call(fold, monkeypatch, n, D, dtype, N=None, reduction="none", seeded=False, vi=False,
          need_r=True, seed=0):
    """One fwd+bwd of the Triton backend with NAC_FAST_FOLD = fold: (loss, grads...)."""
    monkeypatch.setenv("NAC_FAST_FOLD", "1" if fold else "0")
    g = torch.Generator().manual_seed(seed + 31 * n + D)
    a = (torch.randn(n, D, generator=g, dtype=torch.float64) * 1.5).to(dtype)
    r = (torch.randn(n, D, generator=g, dtype=torch.float64) * 2).to(dtype)
    rv = torch.randn(n, D, generator=g, dtype=torch.float64).to(dtype)
    keys = (None if N is None else
            torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64)).to(dtype))
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g).to(dtype)
    w = torch.randn(n, generator=g, dtype=torch.float64)
    a, r, rv = (t.to(DEVICE).requires_grad_(grad) for t, grad in ((a, True), (r, need_r),
                                                                   (rv, True)))
    keys = None if keys is None else keys.to(DEVICE)
    noise = None if seeded else noise.to(DEVICE)
    if seeded:  # the noise drawn by the kernel that makes Q, from the generator's seed
        torch.manual_seed(1234)
        if DEVICE == "cuda":
            torch.cuda.manual_seed(1234)
    if vi:  # NACMQLoss's one fused call: the inference term in the finish, d/drv in the rows'
        from nac_fast.ops.loss import _mq_and_vi_fused
        loss = _mq_and_vi_fused(a, r, rv, keys, 0.1, 0.1, noise, reduction, "triton", "dot")
        assert loss is not None
    elif keys is None:
        loss = nac_fast.nac_loss(a, r, 0.1, noise=noise, reduction=reduction, backend="triton")
    else:
        loss = nac_fast.nac_mq_loss(a, r, keys, 0.1, noise=noise, reduction=reduction,
                                    backend="triton")
    (loss * (w.to(DEVICE, loss.dtype) if loss.dim() else 1.0)).sum().backward()
    return [loss.detach()] + [t.grad for t in (a, r, rv) if t.grad is not None]


def _same(x, y):
    """The same bits; a reduced (0-dim) loss within a few ulps: its partial sums are grouped by
    the folded finish's chunk (FIN_M rows, the forward's query block where that is smaller than
    the finish kernel's row tile: the interpreter's 32-row blocks at D < 128), which changes the
    order of the additions, not what is added.  Every row's value and gradient is bitwise."""
    if len(x) != len(y):
        return False
    for u, v in zip(x, y):
        if u.dim() == 0:
            eps = torch.finfo(u.dtype).eps
            if not torch.allclose(u, v, rtol=8 * eps, atol=0.0):
                return False
        elif not torch.equal(u, v):
            return False
    return True


# The interpreter: every dtype at the awkward sizes, with 1, 4 and 64 "SMs" (one split or many).
# A GPU (the suite's test stage, where each new specialisation compiles for seconds): bf16 and
# fp32 at D = 128, where in-batch 97 runs the keys' backward in many splits and 8192 the forward
# in two; its own SMs.
GPU = DEVICE != "cpu"
DTYPES = ([torch.float32, torch.bfloat16] if GPU else
          [torch.float32, torch.bfloat16, torch.float16, torch.float64])
SIZES = [(97, 128), (8192, 128)] if GPU else [(1, 1), (3, 7), (97, 128), (130, 16), (1031, 32)]
PROGRAMS = ["its own"] if GPU else ["1", "4", "64"]


def _programs(monkeypatch, programs):
    """The interpreter's "SMs" (kernels/launch.py target_of), which pick the splits there."""
    if not GPU:
        monkeypatch.setenv("NAC_FAST_TRITON_CPU_PROGRAMS", programs)
KEYS = ([(97, 1031, 128), (256, 65536, 128)] if GPU else
        [(1, 1, 1), (3, 97, 7), (40, 131, 32), (97, 1031, 128)])


# (1031 rows, 33 row blocks, with 64 "SMs" only: the keys' backward in splits; the others cost
# the interpreter a minute and add nothing)
IN_BATCH = [(n, D, pr) for n, D in SIZES for pr in PROGRAMS if GPU or n < 1000 or pr == "64"]


@pytest.mark.parametrize("n,D,programs", IN_BATCH, ids=[f"{n}-{D}-{p}" for n, D, p in IN_BATCH])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_in_batch_gives_the_separate_launches_bits(monkeypatch, dtype, n, D, programs):
    _programs(monkeypatch, programs)
    for red in ("none", "mean"):
        want = _call(False, monkeypatch, n, D, dtype, reduction=red)
        got = _call(True, monkeypatch, n, D, dtype, reduction=red)
        assert _same(got, want), (red, [float((u.double() - v.double()).abs().max())
                                        for u, v in zip(got, want)])


@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("n,N,D", KEYS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
def test_given_keys_give_the_separate_launches_bits(monkeypatch, dtype, n, N, D, programs):
    _programs(monkeypatch, programs)
    for red, vi in (("none", False), ("sum", False), ("mean", True)):
        want = _call(False, monkeypatch, n, D, dtype, N=N, reduction=red, vi=vi)
        got = _call(True, monkeypatch, n, D, dtype, N=N, reduction=red, vi=vi)
        assert _same(got, want), (red, vi)


@pytest.mark.parametrize("mode", ["bf16x6", "fp16x3", "tf32x3"])
@pytest.mark.parametrize("keys_n", [None, 97])
def test_fp32_product_modes(monkeypatch, mode, keys_n):
    monkeypatch.setenv("NAC_FAST_FP32_DOT", mode)
    _programs(monkeypatch, "4")
    want = _call(False, monkeypatch, 97, 64, torch.float32, N=keys_n, reduction="mean")
    got = _call(True, monkeypatch, 97, 64, torch.float32, N=keys_n, reduction="mean")
    assert _same(got, want)


@pytest.mark.parametrize("keys_n", [None, 50])
def test_seeded_noise_and_no_grad_r(monkeypatch, keys_n):
    """The noise drawn by the kernel that makes Q (the finish reads what another program of the
    same launch wrote, with given keys) and the rows' backward without d/dr."""
    _programs(monkeypatch, "4")
    for kw in (dict(seeded=True), dict(need_r=False), dict(seeded=True, need_r=False)):
        want = _call(False, monkeypatch, 97, 16, torch.float32, N=keys_n, **kw)
        got = _call(True, monkeypatch, 97, 16, torch.float32, N=keys_n, **kw)
        assert _same(got, want), kw


def _plans(monkeypatch, fold, n, N, D=128, programs="4"):
    from nac_fast.kernels import nac_triton as NT
    from nac_fast.kernels.launch import target_of
    monkeypatch.setenv("NAC_FAST_FOLD", "1" if fold else "0")
    monkeypatch.setenv("NAC_FAST_TRITON_CPU_PROGRAMS", programs)
    a = torch.randn(n, D, device=DEVICE)
    keys = None if N is None else torch.randn(N, D, device=DEVICE)
    target = target_of(a.device)
    fl, (_, lse, ga, q, k, noise) = NT.fwd_plan(a, a, a, keys, 1.1, 0.1, True, target)
    g = torch.ones(n, device=DEVICE)
    bl, _ = NT.bwd_plan(a, a, noise, keys, lse, ga, g, q, k if keys is None else keys, 1.1,
                        True, True, False, target)
    return [L.tag for L in fl], [L.tag for L in bl]


def test_launches_a_fwd_bwd(monkeypatch):
    """In-batch with several query splits: prologue, forward, keys' backward (folded) against
    prologue, forward, finish, keys' backward, rows' backward; given keys: forward and rows'
    backward against forward, finish and rows' backward."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's programs setting picks the splits")
    assert _plans(monkeypatch, True, 97, None) == (["prologue", "fwd"], ["bwd_keys_out3"])
    assert _plans(monkeypatch, False, 97, None) == (["prologue", "fwd", "finish"],
                                                    ["bwd_keys", "bwd_rows"])
    # one split: the rows' backward fused as before (OUT_MODE 2), folded or not
    assert _plans(monkeypatch, True, 97, None, programs="1")[1] == ["bwd_keys_out2"]
    assert _plans(monkeypatch, True, 40, 131) == (["fwd"], ["bwd_rows"])
    assert _plans(monkeypatch, False, 40, 131) == (["fwd", "finish"], ["bwd_rows"])


def test_counters_are_left_zero_and_calls_repeat(monkeypatch):
    """The query blocks' and key blocks' counters, kept by the plans as scratch, are zero after
    every call, and call after call gives the same bits."""
    from nac_fast.kernels import launch
    from nac_fast.kernels import nac_triton as NT
    _programs(monkeypatch, "4")
    # scratch kept as on a GPU outside graph capture, on CPU tensors too
    launch.release_scratch()
    monkeypatch.setattr(launch, "_keeps_scratch", lambda device: launch.KEEP_SCRATCH)
    monkeypatch.setattr(launch, "_stream_key", lambda device: 0)
    NT.FWD_PLANS.clear()
    NT.BWD_PLANS.clear()
    try:
        outs = [_call(True, monkeypatch, 97, 32, torch.float32, reduction="mean")
                for _ in range(3)]
        assert all(_same(o, outs[0]) for o in outs)
        counters = [t for cache in (NT.FWD_PLANS, NT.BWD_PLANS)
                    for plan in cache.plans.values() for held in plan.scratch.values()
                    for i, t in held.items() if plan.zeroed[i]]
        # the reduction's, the query blocks', the key blocks' (a GPU folds only kernels that
        # compile clean there: Target.clean)
        assert len(counters) == 3 if not GPU else 1 <= len(counters) <= 3
        assert all(t.dtype == torch.int32 and not t.any() for t in counters)
    finally:
        launch.release_scratch()


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("NAC_FAST_FOLD", "yes")
    a = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="NAC_FAST_FOLD"):
        nac_fast.nac_loss(a, torch.randn(4, 8, device=DEVICE), 0.1, backend="triton")


def test_a_folded_kernel_that_spills_is_not_launched(monkeypatch):
    """On a GPU the plans fold a tail only where the folded kernel compiles without spills
    (kernels/launch.py Target.clean, from the compiled figure); elsewhere the tail is a launch of
    its own (the compile check's `folded` rows that spill are these).  An sm_90 target whose
    compiler reports spills for the folded kernels, planned on meta tensors."""
    import dataclasses
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton as NT
    monkeypatch.delenv("NAC_FAST_FOLD", raising=False)

    def folded(L):
        return L.tag == "bwd_keys_out3" or (L.tag == "fwd" and bool(L.constexprs["FINISH"]))

    a = torch.empty((512, 128), dtype=torch.bfloat16, device="meta")
    for spills in (False, True):
        target = dataclasses.replace(KL.SM90, spills=lambda L: 8 if spills and folded(L) else 0)
        fl, (_, lse, ga, q, k, noise) = NT.fwd_plan(a, a, a, None, 1.1, 0.1, True, target)
        bl, _ = NT.bwd_plan(a, a, noise, None, lse, ga, lse, q, k, 1.1, True, True, False,
                            target)
        tags = ([L.tag for L in fl], [L.tag for L in bl])
        if spills:
            assert tags == (["prologue", "fwd", "finish"], ["bwd_keys", "bwd_rows"])
        else:
            assert tags == (["prologue", "fwd"], ["bwd_keys_out3"])
        assert [folded(L) for L in fl + bl] == ([False] * 5 if spills else [False, True, True])
