"""The channel noise drawn from a seed (Philox4x32-10): every implementation gives the same bits
(torch reference, C++ op, CUDA op on a GPU, Triton kernel), the generator is Philox as published
(Random123's known answer, Triton's own tl.rand), and draws are reproducible under a seed."""
import math
import os

import pytest
import torch

import nac_fast
from nac_fast.ops import reference as R
from nac_fast.ops.noise import noise_from_seed

DEVICE = os.environ.get("NAC_FAST_TEST_DEVICE", "cpu")
SHAPES = [(1, 1), (3, 5), (97, 128), (1031, 3), (4099, 1)]
SEEDS = [0, 1, 12345, 2 ** 62 + 7, 2 ** 63 - 2, -1, -(2 ** 63)]


def _backends():
    return [b for b in nac_fast.available_backends(DEVICE) if b in ("cpu", "cuda", "triton")]


def test_philox_known_answer():
    """Random123's kat_vectors: philox4x32_10 with counter 0 and key 0 -> first word 6627e8d5."""
    zero = torch.zeros(1, dtype=torch.int64)
    assert int(R.philox_first_word(zero, zero)) == 0x6627E8D5


def test_philox_matches_triton_rand_including_64_bit_counters():
    """tl.rand(seed, offset) is Philox4x32-10 with counter (offset lo, offset hi, 0, 0) and the
    same uniform map: an independent implementation of the function we define."""
    if "triton" not in nac_fast.available_backends(DEVICE):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    import triton
    import triton.language as tl

    @triton.jit
    def rand_kernel(out_ptr, offs_ptr, seed, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        offs = tl.load(offs_ptr + i, mask=i < n, other=0)
        tl.store(out_ptr + i, tl.rand(seed, offs), mask=i < n)

    offs = torch.tensor([0, 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 32 + 5, 2 ** 40 + 3, 2 ** 62],
                        dtype=torch.int64)
    for seed in (0, 777, 2 ** 40 + 11):
        out = torch.empty(len(offs), device=DEVICE)
        rand_kernel[(1,)](out, offs.to(DEVICE), seed, len(offs), BLOCK=8)
        want = R.philox_uniform(R.philox_first_word(offs, torch.tensor([seed])))
        assert torch.equal(out.cpu(), want), seed


@pytest.mark.parametrize("shape", SHAPES)
def test_all_backends_draw_the_same_bits(shape):
    backends = _backends()
    if not backends:
        pytest.skip("no fused backend here")
    like = torch.empty(shape, device=DEVICE)
    for seed in SEEDS:
        s = torch.tensor([seed], device=DEVICE)
        want = noise_from_seed(like, s, 0.3, backend="reference")
        for b in backends:
            got = noise_from_seed(like, s, 0.3, backend=b)
            assert got.shape == like.shape and got.dtype == like.dtype and got.device == like.device
            assert torch.equal(got, want), (b, seed, shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_noise_dtypes(dtype):
    like = torch.empty(40, 7, device=DEVICE, dtype=dtype)
    s = torch.tensor([99], device=DEVICE)
    want = noise_from_seed(like.float(), s, 0.2, backend="reference")
    for b in ["reference"] + _backends():
        got = noise_from_seed(like, s, 0.2, backend=b)
        assert got.dtype == dtype and torch.equal(got.float(), want), b


@pytest.mark.parametrize("p", [0.05, 0.4])
def test_flip_frequency_and_independence(p):
    """Fraction of -1 within 4 sigma of p; neighbouring elements uncorrelated (counter-based
    generators are where a bad mixing function would show)."""
    n = 1 << 20
    m = noise_from_seed(torch.empty(n, device=DEVICE), torch.tensor([3], device=DEVICE), p).cpu()
    flips = (m == -1).double()
    assert abs(flips.mean().item() - p) <= 4 * math.sqrt(p * (1 - p) / n)
    x = m.double() - m.double().mean()
    corr = (x[1:] * x[:-1]).mean() / x.var()
    assert abs(corr.item()) <= 4 / math.sqrt(n)


def test_draw_noise_reproducible_under_manual_seed():
    torch.manual_seed(5)
    a = nac_fast.draw_noise((64, 32), 0.1, device=DEVICE)
    b = nac_fast.draw_noise((64, 32), 0.1, device=DEVICE)
    torch.manual_seed(5)
    assert torch.equal(nac_fast.draw_noise((64, 32), 0.1, device=DEVICE), a)
    assert not torch.equal(a, b)  # the next draw has a new seed
    g1, g2 = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    assert torch.equal(nac_fast.draw_noise((9, 4), 0.2, generator=g1),
                       nac_fast.draw_noise((9, 4), 0.2, generator=g2))
    assert nac_fast.draw_noise((3, 2), 0.2, dtype=torch.int8).dtype == torch.int8
    # an integer dtype holds the same +-1 draw as float32 (same generator state)
    i8 = nac_fast.draw_noise((30, 20), 0.2, dtype=torch.int8,
                             generator=torch.Generator().manual_seed(4))
    f32 = nac_fast.draw_noise((30, 20), 0.2, generator=torch.Generator().manual_seed(4))
    assert (f32 == -1).any() and torch.equal(i8.float(), f32)


def test_noise_from_seed_bad_inputs():
    like, s = torch.empty(4, 4), torch.tensor([1])
    with pytest.raises(TypeError, match="like"):
        noise_from_seed(torch.empty(4, 4, dtype=torch.int32), s, 0.1)
    with pytest.raises(TypeError, match="seed"):
        noise_from_seed(like, torch.tensor([1.0]), 0.1)
    with pytest.raises(TypeError, match="seed"):
        noise_from_seed(like, torch.tensor([1, 2]), 0.1)
    with pytest.raises(ValueError, match="p"):
        noise_from_seed(like, s, 0.5)
    with pytest.raises(ValueError, match="backend"):
        noise_from_seed(like, s, 0.1, backend="gpu")
    with pytest.raises(ValueError, match="shape"):
        nac_fast.draw_noise((3, -1), 0.1)
    with pytest.raises(ValueError, match="shape"):
        nac_fast.draw_noise("ab", 0.1)
    with pytest.raises(TypeError, match="dtype"):
        nac_fast.draw_noise((2, 2), 0.1, dtype="float32")
    with pytest.raises(TypeError, match="generator"):
        nac_fast.draw_noise((2, 2), 0.1, generator=3)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="seed is on"):
            noise_from_seed(like, s.cuda(), 0.1)
