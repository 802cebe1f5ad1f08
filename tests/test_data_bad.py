"""Bad data: the bad-file policy of the ImageFolder loaders (skip and count, or stop naming the
file), data sets smaller than one global batch, and DALI sharding by the global rank."""
import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch

from nac_fast.data import build_eval_loader, build_pretrain_loader
from nac_fast.data.sources.synthetic import write_jpeg_folder
from nac_fast.train.config import parse
from nac_fast.train.distributed import DistInfo
from nac_fast.train.run import build_loader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = 40
HAS_DALI = True
try:
    import nvidia.dali  # noqa: F401
except ImportError:
    HAS_DALI = False
needs_dali = pytest.mark.skipif(not HAS_DALI, reason="NVIDIA DALI is not installed")


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn(*a, **kw)
    return out, [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]


def _folder(tmp_path, name, per_class=6, classes=2):
    """An ImageFolder root whose train/ holds every image (a bare folder of classes would hold a
    part of each class out of training)."""
    r = str(tmp_path / name)
    write_jpeg_folder(os.path.join(r, "train"), num_classes=classes, per_class=per_class,
                      size_range=(50, 80))
    return r


def _truncate(path, like):
    good = open(like, "rb").read()
    open(path, "wb").write(good[: len(good) // 4])       # the header passes the scan


def _bad_folder(tmp_path, name="bad", scan_bad=True):
    """2 classes x 6 good JPEGs, plus: a text file and a garbage .jpg (caught by the scan; not
    with scan_bad=False) and a truncated JPEG, the last file of class_00 (caught only when
    decoded).  (A folder's scan is cached per process: each case gets its own folder.)"""
    r = _folder(tmp_path, name)
    notes = os.path.join(r, "train", "class_00", "notes.txt")
    garbage = os.path.join(r, "train", "class_01", "garbage.jpg")
    trunc = os.path.join(r, "train", "class_00", "zz_truncated.jpg")
    if scan_bad:
        open(notes, "w").write("not an image")
        open(garbage, "wb").write(b"\x00" * 100)
    _truncate(trunc, os.path.join(r, "train", "class_01", "00000.jpg"))
    return r, notes, garbage, trunc


@pytest.mark.parametrize("loader", ["torchvision", pytest.param("dali-cpu", marks=needs_dali)])
def test_skip_policy_counts_and_training_data_continues(tmp_path, loader):
    r, notes, garbage, trunc = _bad_folder(tmp_path, loader)
    ld, msgs = _quiet(build_pretrain_loader, r, loader=loader, batch_size=13, image_size=S,
                      num_workers=1)
    assert ld.num_images == 13                    # 12 good + the truncated one
    assert ld.skipped_files == (notes, garbage)   # counted as soon as the scan drops them
    assert len(msgs) == 1 and notes in msgs[0] and garbage in msgs[0]
    for epoch in range(2):
        ld.set_epoch(epoch)
        batches, msgs = _quiet(list, ld)
        assert len(batches) == 1 and all(v.shape == (13, 3, S, S) for v in batches[0])
        assert all(torch.isfinite(v).all() for v in batches[0])
        assert ld.skipped_files == (notes, garbage, trunc)      # each file counted once
        assert msgs == ([f"nac_fast.data: skipping 1 undecodable files: {trunc}"] if epoch == 0
                        else [])


@pytest.mark.parametrize("loader", ["torchvision", pytest.param("dali-cpu", marks=needs_dali)])
def test_stop_policy_names_the_file(tmp_path, loader):
    r, notes, garbage, trunc = _bad_folder(tmp_path, loader)
    with pytest.raises(ValueError, match="garbage.jpg") as e:       # at construction: the scan
        build_pretrain_loader(r, loader=loader, batch_size=4, image_size=S, on_bad_file="error")
    assert notes in str(e.value) and "--on-bad-file warn" in str(e.value)
    r, _, _, trunc = _bad_folder(tmp_path, loader + "_decode", scan_bad=False)
    ld = build_pretrain_loader(r, loader=loader, batch_size=13, image_size=S, on_bad_file="error",
                               num_workers=1)
    with pytest.raises(ValueError, match="zz_truncated.jpg") as e:  # the batch that meets it
        list(ld)
    assert "undecodable" in str(e.value) and ld.skipped_files == ()


def test_eval_loader_skips_with_the_substitutes_label(tmp_path):
    r, notes, garbage, trunc = _bad_folder(tmp_path)
    ev, _ = _quiet(build_eval_loader, r, split="train", batch_size=64, image_size=S)
    (x, y), = _quiet(list, ev)[0]
    assert ev.skipped_files == (notes, garbage, trunc)
    i = ev.source.files.index(trunc)              # the last file of class 0 ...
    assert ev.source.labels[i] == 0 and ev.source.labels[i + 1] == 1
    assert y[i] == 1 and torch.equal(x[i], x[i + 1])   # ... replaced by class 1's first, label 1
    r, _, _, trunc = _bad_folder(tmp_path, "decode", scan_bad=False)
    ev = build_eval_loader(r, split="train", batch_size=64, image_size=S, on_bad_file="error")
    with pytest.raises(ValueError, match="zz_truncated.jpg"):
        list(ev)


def test_policy_argument_is_checked_for_every_source(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d / name, "wb") as f:
            pickle.dump({b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8),
                         b"labels": [0] * 8}, f)
    with pytest.raises(ValueError, match="on_bad_file"):
        build_pretrain_loader(str(tmp_path), batch_size=4, on_bad_file="skip")
    with pytest.raises(ValueError, match="on_bad_file"):
        build_eval_loader(str(tmp_path), on_bad_file="stop")
    assert build_pretrain_loader(str(tmp_path), batch_size=4).skipped_files == ()


@pytest.mark.parametrize("loader", ["torchvision", pytest.param("dali-cpu", marks=needs_dali)])
def test_data_set_smaller_than_a_global_batch(tmp_path, loader):
    r = _folder(tmp_path, "five", per_class=5, classes=1)
    # one rank: 5 images, batch 6
    with pytest.raises(ValueError, match="batch_size=6 per rank x world_size=1") as e:
        build_pretrain_loader(r, loader=loader, batch_size=6, image_size=S)
    assert "exceeds the 5 images" in str(e.value)
    # two ranks of 3: each rank's shard of 5 images would hold 2 or 3, the global batch is 6
    for rank in (0, 1):
        with pytest.raises(ValueError, match="global batch of 6 images") as e:
            build_pretrain_loader(r, loader=loader, batch_size=3, rank=rank, world_size=2,
                                  image_size=S)
        assert "exceeds the 5 images" in str(e.value)
    assert len(build_pretrain_loader(r, loader=loader, batch_size=2, rank=1, world_size=2,
                                     image_size=S)) == 1


def test_training_names_the_flag_and_the_numbers(tmp_path, capsys):
    """Before any training: through the train.py entry point (one process) and through its
    loader builder as rank 1 of 2 (global batch 8 = 2 ranks x 4 > 5 images)."""
    r = _folder(tmp_path, "five", per_class=5, classes=1)
    args = parse(["--data", r, "--batch-size", "8", "--loader", "torchvision", "--image-size",
                  "32", "--out", str(tmp_path / "o")])
    di = DistInfo(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError) as e:
        build_loader(args, di, channels_last=False)
    msg = str(e.value)
    for part in ("--data", "--batch-size", "batch_size=4 per rank x world_size=2",
                 "global batch of 8", "the 5 images"):
        assert part in msg, msg
    sys.path.insert(0, ROOT)
    import train
    status = train.main(["--data", r, "--batch-size", "8", "--loader", "torchvision",
                         "--image-size", "32", "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and "--batch-size" in err and "the 5 images" in err, err
    assert not (tmp_path / "o" / "last.pt").exists()


def test_on_bad_file_flag_reaches_the_loader(tmp_path, capsys):
    r, notes, garbage, trunc = _bad_folder(tmp_path)
    assert parse(["--data", r]).on_bad_file == "warn"
    args = parse(["--data", r, "--on-bad-file", "error", "--batch-size", "4", "--loader",
                  "torchvision"])
    di = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="garbage.jpg"):
        build_loader(args, di, channels_last=False)
    args.on_bad_file = "warn"
    ld, _ = _quiet(build_loader, args, di, False)
    assert ld.skipped_files == (notes, garbage)
    sys.path.insert(0, ROOT)
    import train
    status = train.main(["--data", r, "--on-bad-file", "error", "--batch-size", "4", "--out",
                         str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and garbage in err, err


@needs_dali
def test_dali_shards_by_the_global_rank(tmp_path):
    """Rank r of 2 reads rank r's shard: the DALI loader checks every batch's indices against
    the order, and its views match the torchvision loader's for the same rank up to rounding.
    Through train's loader builder, global rank 1 on a node where it is local rank 0 (two nodes
    of one process) reads shard 1, not shard 0."""
    from nac_fast.data import Recipe
    r = _folder(tmp_path, "d", per_class=8, classes=3)
    rec = Recipe("nohue", hue=0.0)
    got = {}
    for rank in (0, 1):
        d = build_pretrain_loader(r, loader="dali-cpu", batch_size=3, rank=rank, world_size=2,
                                  seed=4, image_size=S, recipe=rec, num_workers=1)
        t = build_pretrain_loader(r, loader="torchvision", batch_size=3, rank=rank, world_size=2,
                                  seed=4, image_size=S, recipe=rec)
        d.set_epoch(1)
        t.set_epoch(1)
        assert len(d) == len(t) == 4
        got[rank] = (d.batch_indices(), list(d))
        for (a, _), (b, _) in zip(got[rank][1], t):
            assert (a - b).abs().mean() < 0.015
    i0, i1 = got[0][0].ravel(), got[1][0].ravel()
    assert not set(i0) & set(i1) and len(set(i0) | set(i1)) == 24
    args = parse(["--data", r, "--batch-size", "6", "--loader", "dali-cpu", "--image-size",
                  str(S), "--seed", "4", "--workers", "1"])
    di = DistInfo(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"))
    ld = build_loader(args, di, channels_last=False)
    assert (ld.rank, ld.world_size, ld.kind) == (1, 2, "dali-cpu")
    ld.set_epoch(1)
    assert np.array_equal(ld.batch_indices(), got[1][0])


@pytest.mark.slow
def test_a_folder_of_twenty_non_images_warns_once_with_a_capped_list(tmp_path):
    """train.py on a folder holding 20 non-image files: one warning giving the count and naming
    the first 5, not 20 names (a subprocess: what a user runs and reads)."""
    import subprocess
    r = _folder(tmp_path, "twenty", per_class=8)
    for i in range(20):
        open(os.path.join(r, "train", "class_00", f"notes{i:02d}.txt"), "w").write("not an image")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--data", r,
                        "--image-size", "32", "--batch-size", "8", "--max-steps", "1",
                        "--loader", "torchvision", "--workers", "0", "--no-progress",
                        "--out", str(tmp_path / "o")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if "nac_fast.data: skipping" in ln]
    assert len(warn) == 1, p.stderr
    assert "skipping 20 non-image or corrupt files" in warn[0]
    assert warn[0].count("notes") == 5 and "and 15 more" in warn[0], warn[0]
    assert "20 unreadable files skipped" in p.stdout          # the run's last lines count them


def test_a_loader_warns_at_most_five_times(tmp_path):
    """Undecodable files met batch after batch: a warning per batch up to the fifth, which says
    that later ones are only counted; every file is counted."""
    from nac_fast.data.sources import imagefolder
    b = imagefolder.BadFiles("warn")
    msgs = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(8):
            b.report([str(tmp_path / f"bad{i}.jpg")], "undecodable files")
        msgs = [str(w.message) for w in rec]
    assert len(msgs) == imagefolder.MAX_WARNINGS == 5 and len(b.skipped) == 8
    assert "further skipped files are only counted" in msgs[-1]
    assert all("further" not in m for m in msgs[:-1])
