"""Where the Triton interpreter (CI: CPU tensors, TRITON_INTERPRET=1) and the compiled GPU code
would compute different things for the same call: the guards that keep the kernels' inputs out of
those ranges.

Host seeds (kernels/nac_noise_triton.py host_seed_value): an int seed is the kernels' seed_val
argument, typed by its value.  In [-2^31, 2^31) Triton types it int32, and philox_sign_of's
64-bit split of it does not compile (on the GPU either); in [2^31, 2^32) the GPU types it int64
(the right noise) while the interpreter passes uint32 data under an int64 type, whose arithmetic
shift `seed >> 32` it reads as negative: the key's high word 0xFFFFFFFF instead of 0, the noise
of another seed, and a CPU test of that seed would disagree with the GPU.  Such seeds are refused
with a ValueError on every device, on a plan's first call and on the cached plan's later ones;
the range host_seed draws in, [2^62, 2^63), and every other int64 keep working, bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

import nac_fast

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")

pytestmark = pytest.mark.skipif(
    "triton" not in nac_fast.available_backends(DEVICE),
    reason=f"the Triton backend on {DEVICE} tensors (CPU: needs triton and TRITON_INTERPRET=1)")

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


@pytest.mark.parametrize("seed", GAP_SEEDS)
def test_noise_op_refuses_a_host_seed_the_kernels_cannot_take_as_int64(kernels, seed):
    """Before the guard: 0 .. 2^31 - 1 and the negatives down to -2^31 failed to compile
    (InterpreterError / CompilationError, not a ValueError); 2^31 .. 2^32 - 1 gave, under the
    interpreter, the noise of another seed (key high word 0xFFFFFFFF), not the reference's."""
    _, N = kernels
    like = torch.empty(33, 8, device=DEVICE)
    with pytest.raises(ValueError, match="host seed"):
        N.noise(like, seed, 0.3)


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


@pytest.mark.parametrize("seed", GOOD_SEEDS)
def test_int64_host_seeds_outside_the_gap_give_the_reference_noise(kernels, seed):
    """Every int64 outside [-2^31, 2^32), the edges included, is the kernels' int64 argument on
    both the GPU and the interpreter: the noise of that seed, bit for bit."""
    _, N = kernels
    like = torch.empty(33, 8, device=DEVICE)
    assert torch.equal(N.noise(like, seed, 0.3), _want(like, seed, 0.3))


def test_host_seed_value_bounds():
    from nac_fast.kernels.nac_noise_triton import host_seed_value
    for s in GOOD_SEEDS:
        assert host_seed_value(s) == s
    for s in GAP_SEEDS + (1 << 63, -(1 << 63) - 1, True, 2.0 ** 40):
        with pytest.raises(ValueError, match="host seed"):
            host_seed_value(s)


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
