"""In-memory (tensor) pretraining/eval loaders: Fashion-MNIST and CIFAR-10 sources."""
import os
import pickle

import numpy as np
import pytest
import torch

from nac_fast.data import build_eval_loader, build_pretrain_loader
from nac_fast.data.sources import fashion_mnist
from nac_fast.data.augment import Recipe

FMNIST = fashion_mnist.find_dir()
needs_fmnist = pytest.mark.skipif(FMNIST is None, reason="Fashion-MNIST not installed "
                                  "(apt-get install dataset-fashion-mnist)")


def _denorm(x, mean, std):
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return x.float() * s + m


@pytest.fixture(scope="module")
def fm():
    if FMNIST is None:
        pytest.skip("Fashion-MNIST not installed")
    return build_pretrain_loader("fashion-mnist", batch_size=256, seed=3)


@needs_fmnist
def test_shapes_dtypes_ranges_and_views_differ(fm):
    assert (fm.num_images, fm.in_channels, fm.image_size, fm.num_classes) == (60000, 1, 28, 10)
    assert len(fm) == 60000 // 256
    fm.set_epoch(0)
    threads = torch.get_num_threads()
    v1, v2 = next(iter(fm))
    assert torch.get_num_threads() == threads        # the 1-thread augmentation restores it
    for v in (v1, v2):
        assert v.shape == (256, 1, 28, 28) and v.dtype == torch.float32
        assert v.is_contiguous()
        d = _denorm(v, fashion_mnist.MEAN, fashion_mnist.STD)
        assert d.min() >= -1e-5 and d.max() <= 1 + 1e-5
        assert d.max() > 0.9 and d.min() < 0.05          # real images, not a constant
    # two independent augmentations: every pair differs somewhere
    assert ((v1 - v2).abs().flatten(1).amax(1) > 1e-3).all()


@needs_fmnist
def test_deterministic_and_seed_epoch_dependent(fm):
    other = build_pretrain_loader("fashion-mnist", batch_size=256, seed=3)
    fm.set_epoch(2)
    other.set_epoch(2)
    a, b = next(iter(fm)), next(iter(other))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other.set_epoch(3)
    c = next(iter(other))
    assert not torch.equal(a[0], c[0])
    diff_seed = build_pretrain_loader("fashion-mnist", batch_size=256, seed=4)
    diff_seed.set_epoch(2)
    assert not torch.equal(a[0], next(iter(diff_seed))[0])


@needs_fmnist
def test_augmentation_is_per_image_not_per_batch():
    """The view of an image depends on (seed, epoch, index, view) only: two batches of 64 are
    exactly one batch of 128 (same order, same augmentations)."""
    small = build_pretrain_loader("fashion-mnist", batch_size=64, seed=1)
    big = build_pretrain_loader("fashion-mnist", batch_size=128, seed=1)
    small.set_epoch(5)
    big.set_epoch(5)
    it = iter(small)
    s0, s1 = next(it), next(it)
    b0 = next(iter(big))
    assert torch.equal(torch.cat([s0[0], s1[0]]), b0[0])
    assert torch.equal(torch.cat([s0[1], s1[1]]), b0[1])


@needs_fmnist
def test_shards_disjoint_cover_epoch_equal_length():
    B, W = 100, 3
    loaders = [build_pretrain_loader("fashion-mnist", batch_size=B, rank=r, world_size=W, seed=0)
               for r in range(W)]
    assert len({len(x) for x in loaders}) == 1 and len(loaders[0]) == 60000 // (B * W)
    for x in loaders:
        x.set_epoch(1)
    idx = [x.batch_indices() for x in loaders]
    flat = np.concatenate([i.ravel() for i in idx])
    assert len(np.unique(flat)) == len(flat) == len(loaders[0]) * B * W   # disjoint
    # 60000 = 200 global batches of 300: the epoch is covered exactly
    assert set(flat.tolist()) == set(range(60000))
    # next epoch reshuffles
    loaders[0].set_epoch(2)
    assert not np.array_equal(loaders[0].batch_indices(), idx[0])


@needs_fmnist
def test_start_batch_resumes_exactly(fm):
    fm.set_epoch(7)
    it = iter(fm)
    full = [next(it) for _ in range(4)]
    fm.set_epoch(7, start_batch=2)
    resumed = iter(fm)
    for k in (2, 3):
        r = next(resumed)
        assert torch.equal(r[0], full[k][0]) and torch.equal(r[1], full[k][1])
    assert len(fm.batch_indices()) == len(fm) - 2     # the resumed epoch ends where it would


@needs_fmnist
def test_dtype_channels_last_and_size():
    ld = build_pretrain_loader("fashion-mnist", batch_size=32, dtype=torch.bfloat16,
                               channels_last=True, image_size=32, recipe="imagenet")
    v1, v2 = next(iter(ld))
    assert v1.shape == (32, 1, 32, 32) and v1.dtype == torch.bfloat16
    assert v1.is_contiguous(memory_format=torch.channels_last)
    assert ld.recipe.blur_p == 0.5 and ld.image_size == 32


@needs_fmnist
def test_identity_recipe_reproduces_the_image():
    """scale=(1,1) forces torchvision's whole-image fallback; with no jitter, flip or grayscale the
    view is the normalised image itself; with flip p=1, its mirror."""
    ident = Recipe("id", scale=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, gray_p=0.0)
    ld = build_pretrain_loader("fashion-mnist", batch_size=16, recipe=ident)
    ld.set_epoch(0)
    idx = ld.batch_indices()[0]
    v1, _ = next(iter(ld))
    ref = ld.source.images[torch.as_tensor(idx)].float() / 255
    torch.testing.assert_close(_denorm(v1, fashion_mnist.MEAN, fashion_mnist.STD), ref,
                               atol=1e-5, rtol=0)
    flipped = Recipe("flip", scale=(1.0, 1.0), flip_p=1.0, jitter_p=0.0, gray_p=0.0)
    ld2 = build_pretrain_loader("fashion-mnist", batch_size=16, recipe=flipped)
    v1f, _ = next(iter(ld2))
    torch.testing.assert_close(_denorm(v1f, fashion_mnist.MEAN, fashion_mnist.STD),
                               ref.flip(-1), atol=1e-5, rtol=0)


@needs_fmnist
def test_eval_loader():
    ev = build_eval_loader("fashion-mnist", split="test", batch_size=3000, rank=1, world_size=2)
    assert ev.num_images == 5000 and len(ev) == 2
    batches = list(ev)
    x, y = batches[0]
    assert x.shape == (3000, 1, 28, 28) and y.dtype == torch.int64
    assert sum(len(b[1]) for b in batches) == 5000
    src = ev.source
    torch.testing.assert_close(_denorm(x[:4], fashion_mnist.MEAN, fashion_mnist.STD),
                               src.images[1:8:2].float() / 255, atol=1e-5, rtol=0)
    assert torch.equal(y, src.labels[1:6000:2])


def _write_cifar(d, n=40):
    rng = np.random.default_rng(0)
    os.makedirs(d, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(os.path.join(d, name), "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": rng.integers(0, 10, n).tolist()}, f)


def test_cifar_python_batches(tmp_path):
    _write_cifar(str(tmp_path / "cifar-10-batches-py"))
    ld = build_pretrain_loader(str(tmp_path), batch_size=50, seed=0)
    assert (ld.num_images, ld.in_channels, ld.image_size, len(ld)) == (200, 3, 32, 4)
    assert ld.recipe.name == "small" and ld.recipe.blur_p == 0
    v1, v2 = next(iter(ld))
    assert v1.shape == v2.shape == (50, 3, 32, 32)
    assert not torch.equal(v1, v2)
    ev = build_eval_loader(str(tmp_path), split="test", batch_size=64)
    x, y = next(iter(ev))
    assert x.shape == (40, 3, 32, 32) and y.shape == (40,)


def test_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="data"):
        build_pretrain_loader(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="CIFAR-10"):
        build_pretrain_loader("cifar10")
    with pytest.raises(TypeError, match="data"):
        build_pretrain_loader(3)
    with pytest.raises(ValueError, match="batch_size"):
        build_pretrain_loader("fashion-mnist", batch_size=0)
    with pytest.raises(TypeError, match="dtype"):
        build_pretrain_loader("fashion-mnist", dtype=torch.int32)
    with pytest.raises(ValueError, match="image_size"):
        build_pretrain_loader("fashion-mnist", image_size=3)
    if FMNIST is not None:
        with pytest.raises(ValueError, match="rank"):
            build_pretrain_loader("fashion-mnist", rank=2, world_size=2)
        with pytest.raises(ValueError, match="loader"):
            build_pretrain_loader("fashion-mnist", loader="fast")
        with pytest.raises(ValueError, match="in-memory"):
            build_pretrain_loader("fashion-mnist", loader="dali-cpu")
        with pytest.raises(ValueError, match="recipe"):
            build_pretrain_loader("fashion-mnist", recipe="cifar")
        with pytest.raises(ValueError, match="scale"):
            build_pretrain_loader("fashion-mnist", scale=(0.5, 0.2))
        with pytest.raises(ValueError, match="batch_size"):
            build_pretrain_loader("fashion-mnist", batch_size=70000)
        ld = build_pretrain_loader("fashion-mnist", batch_size=1000)
        with pytest.raises(ValueError, match="start_batch"):
            ld.set_epoch(0, start_batch=61)
