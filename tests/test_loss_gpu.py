"""What runs only on a GPU, or differs between the Triton interpreter and compiled GPU code.
The same CUDA kernels checked without a GPU (build, layouts, numerics): tests/test_loss_cuda.py.

The tensor-core kernels on a GPU (csrc/nac_cuda_mma.cu): both 16-bit dtypes, every loss and code
width, against the float64 reference; each row's own key left out (self_offset, [M:self-key]) on
the CUDA and Triton kernels.  Skips without a GPU; bench/gpu_suite.sh's test stage runs it.

Interpreter vs GPU: where the Triton interpreter (CI: CPU tensors, TRITON_INTERPRET=1) and the
compiled GPU code would compute different things for the same call, the guards that keep the
kernels' inputs out of those ranges (host seeds; CUDA tensors are not the interpreter's).  Runs
on CUDA tensors on a GPU machine, else on CPU tensors under the interpreter.
(The Hamming reference engine's chunk memory and a GPU index's workspace check, tested on the
CPU: tests/test_hashing.py, tests/test_index.py.)
"""
from __future__ import annotations

import os

import pytest
import torch

import nac_fast

from _loss_helpers import rel_err, run_loss

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")

needs_cuda_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or "cuda" not in nac_fast.available_backends("cuda"),
    reason="needs a GPU and the extension built with its CUDA kernels")
needs_triton = pytest.mark.skipif(
    "triton" not in nac_fast.available_backends(DEVICE),
    reason=f"the Triton backend on {DEVICE} tensors (CPU: needs triton and TRITON_INTERPRET=1)")


# ---------------------------------------------------------------------------------------------
# The tensor-core kernels on a GPU
# ---------------------------------------------------------------------------------------------

SHAPES = [  # (n, N, D): DPAD 32, 64, 128, 256; splits; partial tiles; D % 8 != 0
    (300, 300, 20), (129, 1031, 64), (97, 517, 100), (64, 300, 250), (1000, 4099, 128),
    (33, 17, 7), (2048, 8192, 256)]


def _inputs(n, N, D, dtype, seed, keys_given, p=0.1):
    g = torch.Generator().manual_seed(seed)
    t = {"a": torch.randn(n, D, generator=g) * 1.5, "r": torch.randn(n, D, generator=g) * 2}
    if keys_given:
        t["keys"] = torch.tanh(torch.randn(N, D, generator=g) * 1.5)
    noise = nac_fast.draw_noise((n, D), p, generator=g)
    return ({k: v.to("cuda", dtype).requires_grad_() for k, v in t.items()},
            noise.to("cuda", dtype))


def _fn(kind):
    if kind == "mq":
        return lambda a, r, keys, **kw: nac_fast.nac_mq_loss(a, r, keys.detach(), kw.pop("p"),
                                                             l2=0.1, **kw)
    return lambda a, r, keys=None, **kw: nac_fast.nac_loss(a, r, kw.pop("p"), keys=keys, **kw)


@needs_cuda_kernels
@pytest.mark.parametrize("n,N,D", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("kind", ["inbatch", "keys", "mq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_path_against_float64(dtype, kind, n, N, D):
    """bf16 and fp16 inputs, both losses (in-batch keys, given keys, the queue loss), every code
    width the kernels are built for (DPAD 32, 64, 128, 256, with D below, at and between them;
    given keys read in place when D % 8 == 0, else through the padded copy), shapes with several
    key / query splits and partial tiles; forward value and every gradient against the float64
    reference, within twice the error of the reference computed in the same 16-bit dtype (the
    bf16 rule of the loss's numerics tests), and the backward bit-for-bit deterministic.  It
    passed on an H100 (bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27_run3/), which took 'cuda'
    out of nac_fast.ops.dispatch.EXPERIMENTAL."""
    t, noise = _inputs(n, N, D, dtype, seed=n + N + D, keys_given=kind != "inbatch")
    w = torch.randn(n, generator=torch.Generator().manual_seed(3)).to("cuda")
    fn = _fn(kind)
    kw = dict(p=0.1, reduction="none")
    exact = {k: x.detach().double().requires_grad_() for k, x in t.items()}
    v64, g64 = run_loss(fn, exact, w, backend="reference", noise=noise.double(), **kw)
    vref, gref = run_loss(fn, t, w, backend="reference", noise=noise, **kw)
    v, g = run_loss(fn, t, w, backend="cuda", noise=noise, **kw)
    assert torch.isfinite(v).all()
    assert rel_err(v, v64) <= 2 * rel_err(vref, v64) + 1e-7, (rel_err(v, v64), rel_err(vref, v64))
    for name in g64:
        if kind == "mq" and name == "keys":
            continue
        assert g[name].dtype == dtype and torch.isfinite(g[name]).all(), name
        e, eref = rel_err(g[name], g64[name]), rel_err(gref[name], g64[name])
        assert e <= 2 * eref + 1e-7, (name, e, eref)
    _, g2 = run_loss(fn, t, w, backend="cuda", noise=noise, **kw)
    for name in g:
        if g[name] is None:  # the queue's keys take no gradient (they are detached)
            assert g2[name] is None, name
            continue
        assert torch.equal(g[name], g2[name]), f"{name}: backward not deterministic"


# (n, N, D, self_offset): N None = the batch's own codes (offset 0); the own codes inside the
# given keys at the start, the middle and the end; DPAD 32 to 256; a row whose own key is alone
# in the last key split (n = 1, N = 129)
SELF_SHAPES = [(300, None, 20, 0), (129, 1031, 64, 900), (97, 517, 100, 3), (64, 300, 250, 236),
               (1000, None, 128, 0), (33, 40, 7, 7), (2048, 8192, 256, 4096), (1, 129, 64, 128)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n,N,D,offset", SELF_SHAPES,
                         ids=["-".join(map(str, s)) for s in SELF_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_self_key_against_float64(backend, dtype, n, N, D, offset):
    """Each row's own key left out (self_key="exclude", the ops' self_offset, docs/math.md
    [M:self-key]) on the GPU kernels: the tensor-core paths (bf16, fp16: within twice the error of
    the reference computed in the same dtype) and fp32 (CUDA's SIMT kernels, Triton's tf32x3:
    1e-5 on the value, 1e-4 on the gradients), value and every gradient against the float64
    reference, the backward deterministic."""
    if backend not in nac_fast.available_backends("cuda"):
        pytest.skip(f"no {backend} backend on this GPU machine")
    g = torch.Generator().manual_seed(n + D + offset)
    t = {"a": torch.randn(n, D, generator=g, dtype=torch.float64) * 1.5,
         "r": torch.randn(n, D, generator=g, dtype=torch.float64) * 2}
    if N is not None:
        t["keys"] = torch.tanh(torch.randn(N, D, generator=g, dtype=torch.float64) * 1.5)
        t["keys"][offset:offset + n] = torch.tanh(t["a"])  # the rows' own codes, as gathered
    noise = nac_fast.draw_noise((n, D), 0.1, generator=g).to("cuda", dtype)
    t = {k: v.to("cuda", dtype).requires_grad_() for k, v in t.items()}
    w = torch.randn(n, generator=torch.Generator().manual_seed(3)).to("cuda")

    def fn(a, r, keys=None, **kw):
        return nac_fast.nac_loss(a, r, 0.1, keys=keys, self_key="exclude", self_offset=offset,
                                 reduction="none", **kw)
    exact = {k: x.detach().double().requires_grad_() for k, x in t.items()}
    v64, g64 = run_loss(fn, exact, w, backend="reference", noise=noise.double())
    vref, gref = run_loss(fn, t, w, backend="reference", noise=noise)
    v, gg = run_loss(fn, t, w, backend=backend, noise=noise)
    assert torch.isfinite(v).all()
    if dtype == torch.float32:
        assert rel_err(v, v64) <= 1e-5, rel_err(v, v64)
    else:
        assert rel_err(v, v64) <= 2 * rel_err(vref, v64) + 1e-7, (rel_err(v, v64),
                                                                   rel_err(vref, v64))
    for name in g64:
        assert gg[name].dtype == dtype and torch.isfinite(gg[name]).all(), name
        e, eref = rel_err(gg[name], g64[name]), rel_err(gref[name], g64[name])
        assert e <= (1e-4 if dtype == torch.float32 else 2 * eref + 1e-7), (name, e, eref)
    _, g2 = run_loss(fn, t, w, backend=backend, noise=noise)
    for name in gg:
        assert torch.equal(gg[name], g2[name]), f"{name}: backward not deterministic"


# ---------------------------------------------------------------------------------------------
# Interpreter vs GPU: host seeds, and the devices the interpreter takes
# ---------------------------------------------------------------------------------------------

# ints the kernels cannot take as an int64 seed_val: int32-typed, or (interpreter) uint32 data
GAP_SEEDS = (0, 5, -5, -(1 << 31), (1 << 31) - 1, 1 << 31, 3_000_000_000, (1 << 32) - 1)
# int64 seeds outside the gap, at its edges and the ends of the int64 range
GOOD_SEEDS = (1 << 32, -(1 << 31) - 1, (3 << 61) + 123456789, (1 << 63) - 1, -(1 << 63))


@pytest.fixture
def kernels():
    from nac_fast.kernels import nac_noise_triton, nac_triton
    for c in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS, nac_noise_triton.PLANS):
        c.clear()
    yield nac_triton, nac_noise_triton
    for c in (nac_triton.FWD_PLANS, nac_triton.BWD_PLANS, nac_noise_triton.PLANS):
        c.clear()


def _want(like, seed, p):
    from nac_fast.ops.noise import noise_from_seed
    return noise_from_seed(like, torch.tensor([seed], dtype=torch.int64, device=like.device), p,
                           backend="reference")


@needs_triton
@pytest.mark.parametrize("seed", GAP_SEEDS)
def test_noise_op_refuses_a_host_seed_the_kernels_cannot_take_as_int64(kernels, seed):
    """Host seeds (kernels/nac_noise_triton.py host_seed_value): an int seed is the kernels'
    seed_val argument, typed by its value.  In [-2^31, 2^31) Triton types it int32, and
    philox_sign_of's 64-bit split of it does not compile (on the GPU either); in [2^31, 2^32) the
    GPU types it int64 (the right noise) while the interpreter passes uint32 data under an int64
    type, whose arithmetic shift `seed >> 32` it reads as negative: the key's high word
    0xFFFFFFFF instead of 0, the noise of another seed, and a CPU test of that seed would disagree
    with the GPU.  Such seeds are refused with a ValueError on every device, on a plan's first
    call and on the cached plan's later ones; the range host_seed draws in, [2^62, 2^63), and
    every other int64 keep working, bit for bit.

    Before the guard: 0 .. 2^31 - 1 and the negatives down to -2^31 failed to compile
    (InterpreterError / CompilationError, not a ValueError); 2^31 .. 2^32 - 1 gave, under the
    interpreter, the noise of another seed (key high word 0xFFFFFFFF), not the reference's."""
    _, N = kernels
    like = torch.empty(33, 8, device=DEVICE)
    with pytest.raises(ValueError, match="host seed"):
        N.noise(like, seed, 0.3)


@needs_triton
@pytest.mark.parametrize("seed", (1 << 31, 3_000_000_000, 7))
def test_a_cached_plan_checks_each_calls_host_seed(kernels, seed):
    """A later call binds its seed to the first call's plan (kernels/launch.py Plan scalars):
    the check runs there too (the noise op and the loss's forward, in-batch and given keys)."""
    nac_triton, N = kernels
    like = torch.empty(33, 8, device=DEVICE)
    good = GOOD_SEEDS[2]
    assert torch.equal(N.noise(like, good, 0.3), _want(like, good, 0.3))
    with pytest.raises(ValueError, match="host seed"):
        N.noise(like, seed, 0.3)
    a, r = torch.randn(29, 16, device=DEVICE), torch.randn(29, 16, device=DEVICE)
    for keys in (None, torch.tanh(torch.randn(40, 16, device=DEVICE))):
        out = nac_triton.fwd(a, r, None, keys, 1.0, 0.0, True, good, 0.2)
        assert torch.equal(out[5], _want(a, good, 0.2))
        with pytest.raises(ValueError, match="host seed"):
            nac_triton.fwd(a, r, None, keys, 1.0, 0.0, True, seed, 0.2)


@needs_triton
@pytest.mark.parametrize("seed", GOOD_SEEDS)
def test_int64_host_seeds_outside_the_gap_give_the_reference_noise(kernels, seed):
    """Every int64 outside [-2^31, 2^32), the edges included, is the kernels' int64 argument on
    both the GPU and the interpreter: the noise of that seed, bit for bit."""
    _, N = kernels
    like = torch.empty(33, 8, device=DEVICE)
    assert torch.equal(N.noise(like, seed, 0.3), _want(like, seed, 0.3))


@needs_triton
def test_host_seed_value_bounds():
    from nac_fast.kernels.nac_noise_triton import host_seed_value
    for s in GOOD_SEEDS:
        assert host_seed_value(s) == s
    for s in GAP_SEEDS + (1 << 63, -(1 << 63) - 1, True, 2.0 ** 40):
        with pytest.raises(ValueError, match="host seed"):
            host_seed_value(s)


@needs_triton
def test_the_interpreter_does_not_take_cuda_tensors(monkeypatch):
    """The kernels choose their arithmetic by the tensors' device: on CPU tensors the
    interpreter's (rounding casts emulated, no inline PTX), on CUDA tensors the GPU's.  So with
    TRITON_INTERPRET=1 on a machine with a GPU, CUDA tensors are not Triton's (an interpreted
    run of them would truncate bf16 casts and fail on the inline PTX); CPU tensors are."""
    from nac_fast.ops import dispatch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dispatch.triton_runs_on("cuda")
    assert dispatch.triton_runs_on("cpu") and dispatch.triton_runs_on("any")
    assert "TRITON_INTERPRET unset" in dispatch._reason("triton", "cuda", "nac")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.triton_runs_on("cuda") and not dispatch.triton_runs_on("cpu")
