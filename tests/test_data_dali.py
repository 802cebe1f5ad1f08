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


# ---- ILSVRC2012's quirks (scripts/make_ilsvrc_tree.py): greyscale, CMYK, PNG bytes named .JPEG,
# EXIF rotation, truncated files -------------------------------------------------------------

QUIRKS = "grey=0.15,cmyk=0.15,png=0.15,exif=0.15,truncated=0.05"


def _quirky_tree(out, classes=3, per_class=8, size=40):
    """An ILSVRC-shaped tree with every quirk (most files carry one); its quirk_files by kind."""
    import json
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import make_ilsvrc_tree
    assert make_ilsvrc_tree.main(["--out", str(out), "--classes", str(classes),
                                  "--train-per-class", str(per_class), "--val-per-class", "1",
                                  "--size", str(size), "--quirks", QUIRKS, "--workers", "1",
                                  "--no-progress"]) == 0
    meta = json.load(open(os.path.join(out, "make_ilsvrc_tree.json")))
    quirks = {k: [os.path.join(str(out), f) for f in v if f.startswith("train")]
              for k, v in meta["quirk_files"].items()}
    assert all(quirks[k] for k in ("grey", "cmyk", "png", "exif", "truncated")), quirks
    return str(out), quirks


@pytest.fixture(scope="module")
def quirky(tmp_path_factory):
    return _quirky_tree(tmp_path_factory.mktemp("ilsvrc") / "tree")


def test_dali_decoder_reads_every_ilsvrc_quirk_as_the_torchvision_loader_does(quirky):
    """Greyscale, CMYK, PNG-named-.JPEG and EXIF-rotated files: DALI's CPU decoder gives the
    image load_rgb (the torchvision loader's decode) gives: same shape (the EXIF orientation
    applied: a rotated file comes out --size wide and 3/4 --size high), same pixels within a
    uint8 level, and fn.peek_image_shape (the crop windows' input) the oriented shape too."""
    import numpy as np
    from nvidia import dali
    from nvidia.dali import fn, types

    from nac_fast.data.sources.imagefolder import load_rgb
    _, quirks = quirky
    files = [f for k in ("grey", "cmyk", "png", "exif") for f in quirks[k]]

    @dali.pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def probe():
        data, _ = fn.readers.file(files=files, random_shuffle=False)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB), fn.peek_image_shape(data)

    pipe = probe()
    pipe.build()
    for f in files:
        img, shape = pipe.run()
        a, b = np.asarray(img[0]), np.asarray(load_rgb(f))
        assert a.shape == b.shape == tuple(np.asarray(shape[0])), (f, a.shape, b.shape)
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 1.0, f
        if f in quirks["exif"]:
            assert a.shape[1] > a.shape[0], (f, a.shape)     # upright: wider than high


@pytest.mark.parametrize("loader", ["dali-cpu", "dali-gpu"])
def test_dali_matches_torchvision_on_every_quirk(quirky, loader):
    """Both loaders on the quirky tree: the same files skipped (the truncated ones, under
    on_bad_file='warn', the same substitution), and image by image the same views up to
    rounding (no hue: DALI's differs by design), the EXIF-rotated, CMYK, grey and PNG ones
    included.  A loader that did not apply the EXIF orientation would crop another window.
    dali-gpu (the GPU suite's train-jpeg stage runs it): nvJPEG, whose chroma upsampling moves
    the views further from PIL's, within 0.1 a view (an unrotated or miscoloured one: ~1)."""
    if loader == "dali-gpu" and not torch.cuda.is_available():
        pytest.skip("dali-gpu decodes on a CUDA device; none here")
    root, quirks = quirky
    rec = Recipe("nohue", hue=0.0, blur_p=0.5)
    dev = {"device": "cuda"} if loader == "dali-gpu" else {}
    d = _ld(root, loader=loader, recipe=rec, seed=7, batch_size=6, **dev)
    t = _ld(root, loader="torchvision", recipe=rec, seed=7, batch_size=6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bd, bt = list(d), list(t)
    assert len(bd) == len(bt) == 4
    assert sorted(d.skipped_files) == sorted(t.skipped_files) == sorted(quirks["truncated"])
    files = d.source.files
    rows = d.batch_indices()
    seen, most = set(), 0.03 if loader == "dali-cpu" else 0.1
    for k, ((d1, d2), (t1, t2)) in enumerate(zip(bd, bt)):
        for a, b in ((d1, t1), (d2, t2)):
            per_image = (a.float().cpu() - b.float()).abs().flatten(1).mean(1)
            for j, i in enumerate(rows[k]):
                seen.add(files[i])
                assert per_image[j] < most, (files[i], float(per_image[j]))
    for kind in ("grey", "cmyk", "png", "exif"):
        assert set(quirks[kind]) <= seen, kind


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["dali-cpu", "torchvision"])
def test_train_py_two_processes_on_an_ilsvrc_tree_with_every_quirk(tmp_path, quirky, loader):
    """torchrun, 2 processes (gloo on loopback), a few steps past one epoch on the quirky tree:
    exit 0, and each truncated file skipped with a warning naming it."""
    import json
    import subprocess
    import sys
    root, quirks = quirky
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    out = str(tmp_path / loader)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "--local_addr=127.0.0.1", "train.py",
                        "--data", root, "--loader", loader, "--arch", "resnet-tiny",
                        "--method", "nac-mq", "--image-size", "16", "--batch-size", "8",
                        "--queue-size", "32", "--max-steps", "4", "--workers", "1",
                        "--no-compile", "--no-progress", "--out", out],
                       env=env, cwd=repo, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "status.json")))["status"] == 0
    for f in quirks["truncated"]:
        assert f"skipping 1 undecodable files: {f}" in r.stderr, r.stderr[-3000:]
