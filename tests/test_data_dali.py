"""DALI loaders in CPU mode (device_id=None); skipped when DALI is not installed."""
import os
import warnings

import pytest
import torch

pytest.importorskip("nvidia.dali")

from nac_fast.data import Recipe, build_pretrain_loader  # noqa: E402
from nac_fast.data.sources.synthetic import write_jpeg_folder  # noqa: E402

S = 48


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("dali_folder"))
    write_jpeg_folder(os.path.join(r, "train"), num_classes=3, per_class=8, size_range=(60, 110))
    return r


def _ld(root, loader="dali-cpu", **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("image_size", S)
    kw.setdefault("num_workers", 2)
    return build_pretrain_loader(root, loader=loader, **kw)


def test_dali_cpu_batch_format_matches_torchvision(root):
    for channels_last, dtype in ((False, torch.float32), (True, torch.float16), (True, torch.bfloat16)):
        d = _ld(root, channels_last=channels_last, dtype=dtype, recipe="imagenet")
        t = _ld(root, loader="torchvision", channels_last=channels_last, dtype=dtype, recipe="imagenet")
        assert d.kind == "dali-cpu" and len(d) == len(t) == 6
        (d1, d2), (t1, t2) = next(iter(d)), next(iter(t))
        for a, b in ((d1, t1), (d2, t2)):
            assert a.shape == b.shape == (4, 3, S, S)
            assert a.dtype == b.dtype == dtype and a.device == b.device
            assert a.is_contiguous(memory_format=torch.channels_last) == channels_last
            assert b.is_contiguous(memory_format=torch.channels_last) == channels_last
            assert a.float().abs().max() < 3.0          # normalised: |x| <= 0.485/0.229 + 1/0.225
        assert ((d1 - d2).float().abs().flatten(1).amax(1) > 1e-2).all()


@pytest.mark.parametrize("gpu_contrast", [False, True])
def test_dali_cpu_equals_torchvision_up_to_rounding(root, gpu_contrast):
    """Same parameters in, same views out: with every op but DALI's (YIQ) hue, dali-cpu and the
    PIL/torch loader agree to ~1 uint8 level.  This fails if either loader got a crop window,
    flip, jitter factor, grayscale flag or blur wrong.  gpu_contrast runs the dali-gpu graph's
    arithmetic contrast on the CPU."""
    rec = Recipe("nohue", hue=0.0, blur_p=0.5)
    d = _ld(root, recipe=rec, seed=5)
    d._arithmetic_contrast = gpu_contrast
    t = _ld(root, loader="torchvision", recipe=rec, seed=5)
    d.set_epoch(1)
    t.set_epoch(1)
    for (d1, d2), (t1, t2) in zip(d, t):
        for a, b in ((d1, t1), (d2, t2)):
            diff = (a - b).abs()       # measured: mean <= 0.0085, p99 <= 0.037
            assert diff.mean() < 0.012 and diff.flatten().quantile(0.99) < 0.05, diff.mean()
            # no bias: half a uint8 level everywhere (a rounding slip) would be 0.0087 here
            assert abs((a - b).mean()) < 0.003, (a - b).mean()


def test_dali_deterministic_resume_and_shards(root):
    a = _ld(root, seed=3, world_size=2, rank=1, batch_size=3)
    b = _ld(root, seed=3, world_size=2, rank=1, batch_size=3, num_workers=1)
    assert len(a) == 24 // 6
    a.set_epoch(2)
    b.set_epoch(2)
    full_a, full_b = list(a), list(b)      # the loader asserts the reader read this rank's shard
    assert len(full_a) == 4
    for x, y in zip(full_a, full_b):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    a.set_epoch(2, start_batch=3)
    resumed = list(a)
    assert len(resumed) == 1 and torch.equal(resumed[0][0], full_a[3][0])
    assert torch.equal(resumed[0][1], full_a[3][1])
    r0 = _ld(root, seed=3, world_size=2, rank=0, batch_size=3)
    r0.set_epoch(2)
    i0, i1 = r0.batch_indices(), a.order.rank_indices(2)
    assert not set(i0.ravel()) & set(i1.ravel()) and len(set(i0.ravel()) | set(i1.ravel())) == 24
    assert not torch.equal(next(iter(r0))[0], full_a[0][0])


def test_dali_truncated_file_warns_and_continues(tmp_path):
    r = str(tmp_path / "d")  # train/ only: every image is in the training split
    write_jpeg_folder(os.path.join(r, "train"), num_classes=2, per_class=5, size_range=(60, 90))
    good = open(os.path.join(r, "train", "class_00", "00001.jpg"), "rb").read()
    trunc = os.path.join(r, "train", "class_00", "00002.jpg")
    open(trunc, "wb").write(good[: len(good) // 4])
    ld = _ld(r, batch_size=5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        batches = list(ld)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(batches) == 2 and all(v.shape == (5, 3, S, S) for b in batches for v in b)
    assert msgs == [f"nac_fast.data: skipping 1 undecodable files: {trunc}"]
    # same substitution rule as the torchvision loader: the same batches come out
    t = _ld(r, loader="torchvision", batch_size=5, recipe=Recipe("nohue", hue=0.0))
    d = _ld(r, batch_size=5, recipe=Recipe("nohue", hue=0.0))
    for (a, _), (b, _) in zip(d, t):
        assert (a - b).abs().mean() < 0.015
    with pytest.raises(ValueError, match="00002.jpg"):
        r2 = str(tmp_path / "e")
        write_jpeg_folder(os.path.join(r2, "train"), num_classes=1, per_class=4,
                          size_range=(60, 90))
        open(os.path.join(r2, "train", "class_00", "00002.jpg"), "wb").write(
            good[: len(good) // 4])
        list(_ld(r2, batch_size=4, on_bad_file="error"))


def test_dali_gpu_needs_a_cuda_device(root):
    with pytest.raises(ValueError, match="device"):
        _ld(root, loader="dali-gpu", device="cpu")


def _one_bit_tiffs(r, n=4):
    """class a: n one-bit TIFFs (PIL reads them, DALI's decoder does not); class b: n PNGs."""
    from PIL import Image
    for c in ("a", "b"):
        os.makedirs(os.path.join(r, "train", c), exist_ok=True)
    for i in range(n):
        Image.new("1", (24, 24), i % 2).save(os.path.join(r, "train", "a", f"{i}.tif"))
        Image.new("RGB", (24, 24), (40 * i, 80, 120)).save(os.path.join(r, "train", "b",
                                                                          f"{i}.png"))


def test_files_dali_cannot_decode_follow_on_bad_file(tmp_path):
    r = str(tmp_path / "tif1")
    _one_bit_tiffs(r)
    tifs = [os.path.join(r, "train", "a", f"{i}.tif") for i in range(4)]
    ld = _ld(r, batch_size=2, image_size=16)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        batches = list(ld)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(batches) == 4 and sorted(ld.skipped_files) == tifs
    assert msgs and all("DALI cannot decode" in m for m in msgs), msgs
    with pytest.raises(ValueError, match=r"DALI cannot decode.*\.tif"):
        list(_ld(str(tmp_path / "tif1"), batch_size=2, image_size=16, on_bad_file="error"))


def test_train_records_a_dali_decode_failure_in_status_json(tmp_path, capsys):
    import json
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train
    r = str(tmp_path / "tif2")
    _one_bit_tiffs(r)
    out = str(tmp_path / "o")
    status = train.main(["--data", r, "--loader", "dali-cpu", "--image-size", "16",
                         "--batch-size", "4", "--max-steps", "1", "--on-bad-file", "error",
                         "--no-progress", "--out", out])
    err = capsys.readouterr().err
    assert status == 2, err
    assert ".tif" in err and "DALI cannot decode" in err, err
    st = json.load(open(os.path.join(out, "status.json")))
    assert st["status"] == 2 and st["meaning"] != "running", st
