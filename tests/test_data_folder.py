"""ImageFolder sources and the torchvision (PIL worker) loader, on synthetic JPEG folders.

User image folders an audit found broken (small PIL folders in tmp_path): folders of
non-images, folders edited within one process, the file system's listing order, file names that
are not UTF-8."""
import os
import time
import warnings

import numpy as np
import pytest
import torch

from nac_fast.data import build_eval_loader, build_pretrain_loader, dali_available
from nac_fast.data.sources import imagefolder, resolve_source
from nac_fast.data.sources.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from nac_fast.data.sources.synthetic import write_jpeg_folder

from _images import random_image as _img

S = 48       # small views keep the suite fast; the code path is the one used at 224


def _denorm(x):
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return x.float() * s + m


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = str(tmp_path_factory.mktemp("imagefolder"))
    write_jpeg_folder(os.path.join(r, "train"), num_classes=3, per_class=8, size_range=(60, 110))
    write_jpeg_folder(os.path.join(r, "val"), num_classes=3, per_class=3, size_range=(60, 110), seed=1)
    return r


def _tv(root, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("image_size", S)
    return build_pretrain_loader(root, loader="torchvision", **kw)


def test_batch_format_and_views(root):
    ld = _tv(root, seed=1)
    assert (ld.num_images, ld.in_channels, ld.num_classes, len(ld)) == (24, 3, 3, 6)
    assert ld.kind == "torchvision" and ld.recipe.name == "small"     # auto: < 96 px
    v1, v2 = next(iter(ld))
    for v in (v1, v2):
        assert v.shape == (4, 3, S, S) and v.dtype == torch.float32 and v.is_contiguous()
        d = _denorm(v)
        assert d.min() >= -1e-4 and d.max() <= 1 + 1e-4 and d.std() > 0.05
    assert ((v1 - v2).abs().flatten(1).amax(1) > 1e-2).all()
    # no --image-size: the folder's own scale, the median short side of its images (60-110 px)
    from nac_fast.data.sources.imagefolder import natural_side
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "train"))
                   for f in fs)
    want = natural_side(files)
    assert 60 <= want <= 110
    assert build_pretrain_loader(root, loader="torchvision", batch_size=2).image_size == want


def test_workers_do_not_change_the_batches(root):
    a = _tv(root, seed=2, num_workers=0, recipe="imagenet")
    b = _tv(root, seed=2, num_workers=2, recipe="imagenet", channels_last=True, dtype=torch.bfloat16)
    a.set_epoch(3)
    b.set_epoch(3)
    for (x1, x2), (y1, y2) in zip(a, b):
        assert y1.dtype == torch.bfloat16 and y1.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y1.float(), x1, atol=0.05, rtol=0.01)   # bf16 rounding only
        torch.testing.assert_close(y2.float(), x2, atol=0.05, rtol=0.01)


def test_shards_and_resume(root):
    r0, r1 = _tv(root, rank=0, world_size=2, batch_size=5), _tv(root, rank=1, world_size=2, batch_size=5)
    assert len(r0) == len(r1) == 24 // 10
    i0, i1 = r0.batch_indices(), r1.batch_indices()
    assert not set(i0.ravel()) & set(i1.ravel()) and len(set(i0.ravel()) | set(i1.ravel())) == 20
    full = list(r1)
    r1.set_epoch(0, start_batch=1)
    resumed = list(r1)
    assert len(resumed) == 1
    assert torch.equal(resumed[0][0], full[1][0]) and torch.equal(resumed[0][1], full[1][1])


def test_eval_loader(root):
    ev = build_eval_loader(root, split="test", batch_size=4, image_size=S)
    batches = list(ev)
    assert [len(y) for _, y in batches] == [4, 4, 1]
    x, y = batches[0]
    assert x.shape == (4, 3, S, S) and y.tolist() == [0, 0, 0, 1]
    again = next(iter(build_eval_loader(root, split="val", batch_size=4, image_size=S)))
    assert torch.equal(again[0], x)
    tr = build_eval_loader(root, split="train", batch_size=100, rank=1, world_size=2, image_size=S)
    assert tr.num_images == 12 and next(iter(tr))[1].tolist() == [0] * 4 + [1] * 4 + [2] * 4


def _bad_folder(tmp_path):
    r = str(tmp_path / "data")  # train/ only: every image is in the training split
    d = os.path.join(r, "train")
    write_jpeg_folder(d, num_classes=2, per_class=6, size_range=(60, 90))
    notes = os.path.join(d, "class_00", "notes.txt")
    garbage = os.path.join(d, "class_01", "garbage.jpg")
    open(notes, "w").write("not an image")
    open(garbage, "wb").write(b"\x00" * 100)
    good = open(os.path.join(d, "class_01", "00000.jpg"), "rb").read()
    trunc = os.path.join(d, "class_01", "00003_truncated.jpg")
    open(trunc, "wb").write(good[: len(good) // 4])
    return r, notes, garbage, trunc


def test_corrupt_files_warn_once_and_are_skipped(tmp_path):
    r, notes, garbage, trunc = _bad_folder(tmp_path)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ld = _tv(r, batch_size=13)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and notes in msgs[0] and garbage in msgs[0]
    assert ld.num_images == 13                    # 12 good + the truncated one (its header is fine)
    for epoch in range(2):
        ld.set_epoch(epoch)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            batches = list(ld)
        msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
        assert len(batches) == 1 and batches[0][0].shape == (13, 3, S, S)
        assert msgs == ([f"nac_fast.data: skipping 1 undecodable files: {trunc}"] if epoch == 0 else [])


def test_corrupt_files_error_by_flag(tmp_path):
    r, notes, garbage, trunc = _bad_folder(tmp_path)
    with pytest.raises(ValueError, match="garbage.jpg"):
        _tv(r, on_bad_file="error")
    with pytest.raises(ValueError, match="on_bad_file"):
        _tv(r, on_bad_file="ignore")


def test_layout_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data"):
        _tv(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no class folders"):
        _tv(str(empty))
    r = str(tmp_path / "withempty")
    write_jpeg_folder(os.path.join(r, "train"), num_classes=2, per_class=3, size_range=(40, 60))
    os.makedirs(os.path.join(r, "train", "zz_empty"))
    with pytest.raises(ValueError, match="zz_empty"):
        _tv(r)
    with pytest.raises(FileNotFoundError, match="val"):  # train/ without val/: no test split
        build_eval_loader(r, split="test")
    bare = str(tmp_path / "bare")  # class folders alone: one image of each class held out
    write_jpeg_folder(bare, num_classes=2, per_class=3, size_range=(40, 60))
    assert np.array_equal(_tv(bare, batch_size=2).source.labels, [0, 0, 1, 1])


def test_a_class_reads_its_sub_folders_as_imagefolder_does(tmp_path):
    """Images in sub-folders of a class folder belong to that class (torchvision's ImageFolder
    and python -m nac_fast.index read them too); hidden files and folders are skipped; a class
    whose images all sit in sub-folders is not empty."""
    import shutil
    from nac_fast.data.sources.imagefolder import FolderSource
    r = str(tmp_path / "nested")  # train/ only: every image is in the training split
    write_jpeg_folder(os.path.join(r, "train"), num_classes=2, per_class=4, size_range=(40, 60))
    c0, c1 = (os.path.join(r, "train", c) for c in sorted(os.listdir(os.path.join(r, "train"))))
    os.makedirs(os.path.join(c0, "more", "deeper"))
    shutil.copy(os.path.join(c1, "00000.jpg"), os.path.join(c0, "more", "a.jpg"))
    shutil.copy(os.path.join(c1, "00001.jpg"), os.path.join(c0, "more", "deeper", "b.jpg"))
    os.makedirs(os.path.join(c0, ".hidden"))
    shutil.copy(os.path.join(c1, "00002.jpg"), os.path.join(c0, ".hidden", "c.jpg"))
    shutil.copy(os.path.join(c1, "00002.jpg"), os.path.join(c0, ".d.jpg"))
    os.makedirs(os.path.join(c1, "sub"))
    for f in sorted(os.listdir(c1)):
        if f.endswith(".jpg"):
            shutil.move(os.path.join(c1, f), os.path.join(c1, "sub", f))
    src = FolderSource.from_root(r)
    assert len(src.files) == 6 + 4 and src.bad_files == []
    assert src.files[:6] == sorted(src.files[:6]) and src.files[6:] == sorted(src.files[6:])
    top = sorted(os.path.join(c0, f) for f in os.listdir(c0) if f.endswith(".jpg")
                 and not f.startswith("."))
    assert src.files[:6] == sorted(top + [os.path.join(c0, "more", "a.jpg"),
                                          os.path.join(c0, "more", "deeper", "b.jpg")])
    assert all(f.startswith(os.path.join(c1, "sub") + os.sep) for f in src.files[6:])
    assert list(src.labels) == [0] * 6 + [1] * 4
    assert _tv(r, batch_size=5).num_images == 10


def test_a_test_split_labels_its_images_by_the_training_classes(tmp_path):
    """val/ with fewer classes than train/ keeps each class's training label (its images are
    not relabelled by their position among val/'s folders); a val/ class train/ lacks is
    refused, naming it."""
    import shutil
    from nac_fast.data.sources.imagefolder import FolderSource
    r = tmp_path / "split"
    write_jpeg_folder(str(r / "train"), num_classes=3, per_class=2, size_range=(40, 60))
    names = sorted(os.listdir(r / "train"))
    for c in (names[0], names[2]):
        shutil.copytree(r / "train" / c, r / "val" / c)
    src = FolderSource.from_root(str(r), split="test")
    assert src.classes == names and src.num_classes == 3
    assert list(src.labels) == [0, 0, 2, 2]
    assert all(os.sep + names[2] + os.sep in f for f in src.files[2:])
    ld = build_eval_loader(str(r), split="test", batch_size=4)
    assert sorted(torch.cat([y for _, y in ld]).tolist()) == [0, 0, 2, 2]
    r2 = tmp_path / "extra"
    write_jpeg_folder(str(r2 / "train"), num_classes=2, per_class=2, size_range=(40, 60))
    shutil.copytree(r2 / "train", r2 / "val")
    shutil.copytree(r2 / "val" / sorted(os.listdir(r2 / "val"))[0], r2 / "val" / "zz_new")
    with pytest.raises(ValueError, match="zz_new"):
        FolderSource.from_root(str(r2), split="test")


def test_a_bare_folder_holds_part_of_each_class_out_as_its_test_split(tmp_path):
    """Class folders without train/ and val/: a fifth of each class (at least one image in a class
    of two or more, none in a class of one) is the test split, disjoint from the training split;
    the split depends on the file names alone (a copy elsewhere splits the same way); the training
    split says how many images were held out, and the evaluation loader reads the test split."""
    import shutil
    from nac_fast.data.sources.imagefolder import FolderSource, holdout_split
    r = str(tmp_path / "bare")
    write_jpeg_folder(r, num_classes=3, per_class=10, size_range=(40, 60))
    shutil.rmtree(os.path.join(r, "class_02"))
    write_jpeg_folder(str(tmp_path / "one"), num_classes=1, per_class=1, size_range=(40, 60))
    shutil.copytree(tmp_path / "one" / "class_00", os.path.join(r, "class_02"))
    os.makedirs(os.path.join(r, "class_03"))
    for i in range(7):
        shutil.copy(os.path.join(r, "class_00", f"{i:05d}.jpg"),
                    os.path.join(r, "class_03", f"x{i}.jpg"))
    train, test = FolderSource.from_root(r), FolderSource.from_root(r, split="test")
    assert not set(train.files) & set(test.files)
    assert sorted(train.files + test.files) == sorted(FolderSource._scan(r).files)
    count = lambda src: np.bincount(src.labels, minlength=4).tolist()  # noqa: E731
    assert count(test) == [2, 2, 0, 1] and count(train) == [8, 8, 1, 6]
    assert train.held_out == 5 and test.held_out == 0
    assert train.classes == test.classes == ["class_00", "class_01", "class_02", "class_03"]
    assert all(f.split(os.sep)[-2] == test.classes[k] for f, k in zip(test.files, test.labels))
    # the same names elsewhere, scanned in another order: the same split
    r2 = str(tmp_path / "moved" / "copy")
    shutil.copytree(r, r2)
    test2 = FolderSource.from_root(r2, split="test")
    assert [os.path.relpath(f, r2) for f in test2.files] == [os.path.relpath(f, r)
                                                             for f in test.files]
    perm = np.random.default_rng(0).permutation(len(test2.files) + len(train.files))
    whole = FolderSource._scan(r2)
    files, labels = [whole.files[i] for i in perm], whole.labels[perm]
    mask = holdout_split(files, labels, r2)
    with pytest.raises(ValueError, match="labels must hold one label per file"):
        holdout_split(files, labels[:-1], r2)
    assert sorted(f for f, m in zip(files, mask) if m) == sorted(test2.files)
    ld = build_eval_loader(r, split="test", batch_size=4)
    assert sorted(torch.cat([y for _, y in ld]).tolist()) == [0, 0, 1, 1, 3]
    assert _tv(r, batch_size=4).num_images == 23


def test_a_bare_folder_too_small_to_hold_out_trains_on_everything(tmp_path):
    """Every class a single image: nothing can be held out; training takes every image, and the
    test split is refused, saying why."""
    from nac_fast.data.sources.imagefolder import FolderSource
    r = str(tmp_path / "singles")
    write_jpeg_folder(r, num_classes=3, per_class=1, size_range=(40, 60))
    assert len(FolderSource.from_root(r).files) == 3
    with pytest.raises(ValueError, match="too small to hold any image out"):
        FolderSource.from_root(r, split="test")


# ---- audit regressions: symlink loops, loose root images, 16-bit images, EXIF orientation ----

def _png_classes(root, classes=("a", "b"), n=4, size=(20, 20)):
    from PIL import Image
    for k, c in enumerate(classes):
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(n):
            Image.new("RGB", size, (30 * i, 100 * k, 50)).save(os.path.join(root, c, f"{i}.png"))


def test_symlink_loop_is_scanned_once_with_a_warning(tmp_path):
    from nac_fast.data.sources.imagefolder import FolderSource
    r = str(tmp_path / "loop")
    _png_classes(r)
    for c in ("a", "b"):
        os.symlink("..", os.path.join(r, c, "all"))      # each class folder links to the root
    os.symlink(os.path.join(r, "a", "0.png"), os.path.join(r, "b", "linked.png"))  # a file link
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        src = FolderSource._scan(r)
    msgs = [str(w.message) for w in rec]
    assert any("symlink loop" in m and os.path.join(r, "a", "all") in m for m in msgs), msgs
    assert len(src.files) == 9 and np.bincount(src.labels).tolist() == [4, 5]
    assert os.path.join(r, "b", "linked.png") in src.files


def test_images_loose_in_the_root_are_counted_in_a_warning(tmp_path):
    from PIL import Image
    from nac_fast.data.sources.imagefolder import FolderSource
    r = str(tmp_path / "loose")
    _png_classes(r)
    for i in range(3):
        Image.new("RGB", (20, 20)).save(os.path.join(r, f"stray{i}.png"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        src = FolderSource._scan(r)
    msgs = [str(w.message) for w in rec]
    assert any("3 image file(s) directly in" in m and "not used" in m for m in msgs), msgs
    assert len(src.files) == 8


@pytest.mark.parametrize("mode", ["I;16", "F"])
def test_high_depth_images_are_scaled_not_clipped(tmp_path, mode):
    """A 16-bit PNG (/257) and a float TIFF in [0, 1] (x 255) decode to their 8-bit values, the
    way DALI decodes them, not to white/black."""
    from PIL import Image
    from nac_fast.data.preprocess import load_image
    from nac_fast.data.sources.imagefolder import load_rgb
    ramp = np.tile(np.linspace(0, 1, 16), (16, 1))
    if mode == "I;16":
        p = str(tmp_path / "g16.png")
        Image.fromarray((ramp * 65535).astype(np.uint16)).save(p)
    else:
        p = str(tmp_path / "f.tif")
        Image.fromarray(ramp.astype(np.float32)).save(p)
    assert Image.open(p).mode.startswith(mode[0])
    a = np.asarray(load_rgb(p)).astype(float)
    assert a.shape == (16, 16, 3)
    assert np.abs(a[..., 0] - ramp * 255).max() <= 1, a[0, :, 0]
    prep = {"in_channels": 3, "image_size": 16, "resize": "center-crop", "mean": [0.0] * 3,
            "std": [1.0] * 3}
    x = load_image(p, prep)
    assert 0.4 < float(x.mean()) < 0.6


def test_exif_orientation_is_applied(tmp_path):
    from PIL import Image
    from nac_fast.data.sources.imagefolder import load_rgb
    p = str(tmp_path / "phone.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6                                   # rotate 90 degrees to display
    Image.new("RGB", (60, 20), (200, 10, 10)).save(p, exif=exif)
    assert load_rgb(p).size == (20, 60)


# ---- ILSVRC2012's tree as distributed: the flat val/ and its labels files --------------------

def _ilsvrc(out, *extra):
    """A tree of scripts/make_ilsvrc_tree.py (its folders' mtimes set 10 s back, so that a scan
    of it may be cached at once: imagefolder.RACY_NS)."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import make_ilsvrc_tree
    assert make_ilsvrc_tree.main(["--out", str(out), "--classes", "4", "--train-per-class", "5",
                                  "--val-per-class", "3", "--size", "16", "--workers", "1",
                                  "--no-progress", *extra]) == 0
    _age(out)
    return str(out)


def _age(root, seconds=10):
    t = os.stat(root).st_mtime - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))


def _sorted_copy(tree, dst):
    """`tree` with its flat val/ sorted into class folders (by LOC_val_solution.csv), as users
    do with a script from elsewhere."""
    import csv
    import shutil
    shutil.copytree(os.path.join(tree, "train"), os.path.join(dst, "train"))
    with open(os.path.join(tree, "LOC_val_solution.csv")) as f:
        for row in csv.DictReader(f):
            d = os.path.join(dst, "val", row["PredictionString"].split()[0])
            os.makedirs(d, exist_ok=True)
            shutil.copy(os.path.join(tree, "val", row["ImageId"] + ".JPEG"), d)
    _age(dst)
    return str(dst)


def _same_images(a, b):
    """Same classes, same images (by name and bytes) in the same order, same labels."""
    assert a.classes == b.classes
    assert [os.path.basename(p) for p in a.files] == [os.path.basename(p) for p in b.files]
    assert np.array_equal(a.labels, b.labels)
    for p, q in zip(a.files, b.files):
        with open(p, "rb") as f, open(q, "rb") as g:
            assert f.read() == g.read()


def test_a_flat_val_loads_as_the_same_images_sorted_into_class_folders(tmp_path):
    """ILSVRC's val/ as distributed (flat, LOC_val_solution.csv at the root, or the devkit's
    ground truth with its synset order) gives the files, order and labels of the same images
    sorted into class folders, so any evaluation of the two is identical."""
    from nac_fast.data.sources import resolve_source
    tree = _ilsvrc(tmp_path / "tree", "--devkit")
    flat = resolve_source(tree, "test")
    assert all(os.path.dirname(p) == os.path.join(tree, "val") for p in flat.files)
    assert len(flat.files) == 12 and sorted(np.bincount(flat.labels)) == [3, 3, 3, 3]
    _same_images(flat, resolve_source(_sorted_copy(tree, tmp_path / "sorted"), "test"))
    gt = os.path.join(tree, "ILSVRC2012_devkit_t12", "data",
                      "ILSVRC2012_validation_ground_truth.txt")
    _same_images(flat, resolve_source(tree, "test", val_labels=gt))
    # the labels file found in the tree's parent (Kaggle's layout puts the tree lower down)
    os.rename(os.path.join(tree, "LOC_val_solution.csv"), tmp_path / "LOC_val_solution.csv")
    os.rename(os.path.join(tree, "ILSVRC2012_devkit_t12"), tmp_path / "devkit")
    _same_images(flat, resolve_source(tree, "test"))
    # the eval loader's batches: same images, same labels
    ld = build_eval_loader(tree, "val", batch_size=5, image_size=16)
    lbl = torch.cat([y for _, y in ld])
    assert lbl.tolist() == flat.labels.tolist()


def test_flat_val_labels_file_errors_name_the_file_and_the_row(tmp_path):
    from nac_fast.data.sources import resolve_source
    from nac_fast.data.sources import imagefolder
    tree = _ilsvrc(tmp_path / "tree", "--devkit")
    csv = os.path.join(tree, "LOC_val_solution.csv")
    good = open(csv).read().splitlines()

    def check(lines, match, **kw):
        p = tmp_path / "labels.csv"
        p.write_text("\n".join(lines) + "\n")
        imagefolder._scan_cache.clear()
        with pytest.raises(ValueError, match=match):
            resolve_source(tree, "test", val_labels=str(p), **kw)

    first = good[1].split(",")[0]
    check(good[:1] + good[2:], f"--val-labels: data: labels file .*labels.csv has no row for "
          f"the val image .*{first}.JPEG")
    check(good[:1] + [good[1].replace(good[1].split(",")[1][:9], "n99999999")] + good[2:],
          "labels.csv row 2: class n99999999 of image .* is not a class folder of train/")
    check(["ImageId,Label"] + good[1:], "labels.csv row 1: expected the header")
    check(good[:3] + [first + ",n01"] + good[3:], "labels.csv row 4: expected 'ImageId,wnid")
    check(good[:3] + [good[1]] + good[3:], f"labels.csv row 4: image {first} has a second row")
    check(good[:2] + [good[2].split(",")[0] + ",n1 1 2 x 4"] + good[3:],
          "labels.csv row 3: a box coordinate is not an integer")
    w = good[1].split(",")[1].split()[0]
    check(good[:2] + [good[2].split(",")[0] + f",{w} 1 2 3 4 n2 1 2 3 4"] + good[3:],
          "row 3: image .* has boxes of several classes")
    gt = os.path.join(tree, "ILSVRC2012_devkit_t12", "data",
                      "ILSVRC2012_validation_ground_truth.txt")
    with open(gt, "a") as f:
        f.write("9\n")
    imagefolder._scan_cache.clear()
    with pytest.raises(ValueError, match=r"ground_truth.txt row 13: expected an ILSVRC2012_ID in "
                                         r"1\.\.4"):
        resolve_source(tree, "test", val_labels=gt)
    os.unlink(os.path.join(os.path.dirname(gt), "synsets.txt"))
    with pytest.raises(ValueError, match="synsets.txt .*which is missing"):
        resolve_source(tree, "test", val_labels=gt)
    # no labels file anywhere: the flag is named; a sorted val/ refuses a labels file
    os.unlink(csv)
    os.rename(os.path.dirname(os.path.dirname(gt)), tmp_path / "away")
    imagefolder._scan_cache.clear()
    with pytest.raises(ValueError, match="is a flat folder of images .* --val-labels FILE"):
        resolve_source(tree, "test")


def test_a_sorted_val_refuses_a_labels_file_and_other_data_refuses_one_too(tmp_path):
    from nac_fast.data.sources import resolve_source
    tree = _ilsvrc(tmp_path / "tree")
    srt = _sorted_copy(tree, tmp_path / "sorted")
    csv = os.path.join(tree, "LOC_val_solution.csv")
    with pytest.raises(ValueError, match="--val-labels: .*sorted into class folders"):
        resolve_source(srt, "test", val_labels=csv)
    with pytest.raises(ValueError, match="val_labels labels the flat val/ of an ImageFolder"):
        resolve_source("fashion-mnist", "test", val_labels=csv)
    with pytest.raises(FileNotFoundError, match="val_labels .*nope.csv.*: no such file"):
        resolve_source(tree, "test", val_labels=str(tmp_path / "nope.csv"))


# ---- listed once per run: the cache between runs and the broadcast within one ---------------

class _Opens:
    """Counts the files and folders opened under `root` (audit events open, os.scandir,
    os.listdir) while active."""

    def __init__(self, root):
        self.root, self.n, self.on = os.path.realpath(root) + os.sep, 0, False

    def hook(self, event, args):
        if self.on and event in ("open", "os.scandir", "os.listdir") and args and isinstance(
                args[0], (str, bytes, os.PathLike)):
            if os.path.realpath(os.fsdecode(args[0])).startswith(self.root):
                self.n += 1


@pytest.fixture(scope="module")
def _opens_hook():
    import sys
    box = []                      # an audit hook cannot be removed: one for the module
    sys.addaudithook(lambda e, a: box and box[-1].hook(e, a))
    return box


def test_the_cache_is_reused_while_the_folder_is_unchanged(tmp_path, _opens_hook):
    from nac_fast.data.sources import Listing, data_scale, resolve_source
    from nac_fast.data.sources import imagefolder, listing
    tree = _ilsvrc(tmp_path / "tree")
    cache = str(tmp_path / "out")
    lst = Listing(cache_dir=cache)
    ops = _Opens(tree)
    _opens_hook.append(ops)
    ops.on = True
    first = resolve_source(tree, "train", listing=lst)
    assert ops.n >= len(first.files) == 20
    (name,) = os.listdir(cache)
    assert name.startswith(listing.CACHE_PREFIX) and name.endswith(".json.gz")
    imagefolder._scan_cache.clear()                       # a new process: a restart
    ops.n = 0
    again = resolve_source(tree, "train", listing=lst)
    assert data_scale(tree, listing=lst) == (20, 16)
    assert ops.n == 0                                     # nothing under the tree opened
    assert again.files == first.files and np.array_equal(again.labels, first.labels)
    assert again.classes == first.classes and again.natural_size == first.natural_size
    # a file added: the class folder's mtime changes, the cache no longer holds
    cls = os.path.join(tree, "train", first.classes[0])
    with open(first.files[0], "rb") as f, open(os.path.join(cls, "zz_new.JPEG"), "wb") as g:
        g.write(f.read())
    _age(tree)
    imagefolder._scan_cache.clear()
    ops.n = 0
    assert data_scale(tree, listing=lst) == (21, 16)      # a walk: the cache no longer holds
    third = resolve_source(tree, "train", listing=lst)
    ops.on = False
    assert len(third.files) == 21 and ops.n >= 21
    assert len(os.listdir(cache)) == 1                     # the same key, rewritten


def test_one_process_scans_and_the_others_receive_its_list(tmp_path, _opens_hook):
    """The first process's scan (or its error) is what the others get; they open nothing."""
    from nac_fast.data.sources import Listing, resolve_source
    from nac_fast.data.sources import imagefolder
    tree = _ilsvrc(tmp_path / "tree", "--quirks", "png=0.1,truncated=0.1")
    sent = []

    def first_bcast(obj):
        sent.append(obj)
        return obj
    ops = _Opens(tree)
    _opens_hook.append(ops)
    ops.on = True
    mine = resolve_source(tree, "test", listing=Listing(first=True, broadcast=first_bcast))
    assert ops.n > 12 and len(sent) == 1 and sent[0][0] == "ok"
    imagefolder._scan_cache.clear()
    ops.n = 0
    theirs = resolve_source(tree, "test", listing=Listing(first=False,
                                                          broadcast=lambda obj: sent[0]))
    ops.on = False
    assert ops.n == 0
    assert theirs.files == mine.files and np.array_equal(theirs.labels, mine.labels)
    assert theirs.bad_files == mine.bad_files and theirs.classes == mine.classes
    # an error on the first process is raised on every process, with its message
    os.unlink(os.path.join(tree, "LOC_val_solution.csv"))
    imagefolder._scan_cache.clear()
    sent.clear()
    with pytest.raises(ValueError, match="is a flat folder of images"):
        resolve_source(tree, "test", listing=Listing(first=True, broadcast=first_bcast))
    with pytest.raises(ValueError, match="is a flat folder of images"):
        resolve_source(tree, "test", listing=Listing(first=False, broadcast=lambda o: sent[0]))
    with pytest.raises(TypeError, match="listing must be None or a Listing"):
        resolve_source(tree, "train", listing="cache")


OPEN_COUNTER = """import json, os, sys
sys.path.insert(0, {root!r})
DATA = os.path.realpath({data!r}) + os.sep
counts = {{"listing": 0, "decoding": 0}}


def hook(event, args):
    # files and folders opened under the data root: by the listing and checks, or by the
    # decoding of the images a step trains on (load_rgb / open_image, counted apart)
    if event not in ("open", "os.scandir", "os.listdir") or not args:
        return
    if not isinstance(args[0], (str, bytes)) or not os.path.realpath(
            os.fsdecode(args[0])).startswith(DATA):
        return
    f = sys._getframe(1)
    while f is not None and f.f_code.co_name not in ("load_rgb", "open_image"):
        f = f.f_back
    counts["listing" if f is None else "decoding"] += 1


sys.addaudithook(hook)
import train
rc = train.main()
with open(os.path.join({logs!r}, f"opens.{{os.environ['RANK']}}.json"), "w") as f:
    json.dump(counts, f)
sys.exit(rc)
"""


@pytest.mark.slow
def test_a_run_lists_the_tree_once_and_a_restart_not_at_all(tmp_path):
    """Files (and folders) opened under the data root by 3 gloo ranks of train.py, all ranks
    together, besides the images decoded: at most 1.2 N + 1,000 on a first start (rank 0 checks
    every header, the others only walk the folders to choose the recipe) and at most 1,000 on a
    restart (the list rank 0 cached in --out); every rank checking every file, as before,
    opened 3 x 600 (+ the walks) > 1.2 N + 1,000."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = os.path.realpath(str(tmp_path / "tree"))
    sys.path.insert(0, os.path.join(root, "scripts"))
    import make_ilsvrc_tree
    assert make_ilsvrc_tree.main(["--out", tree, "--classes", "20", "--train-per-class", "30",
                                  "--val-per-class", "2", "--size", "16", "--workers", "1",
                                  "--no-progress"]) == 0
    _age(tree)
    n = sum(len(fs) for _, _, fs in os.walk(tree))
    out, logs = str(tmp_path / "run"), str(tmp_path / "logs")
    script = tmp_path / "count_opens.py"
    script.write_text(OPEN_COUNTER.format(root=root, data=tree, logs=logs))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    opened = []
    for extra in (["--max-steps", "1"], ["--max-steps", "2", "--resume", "auto"]):
        os.makedirs(logs, exist_ok=True)
        for f in os.listdir(logs):
            os.unlink(os.path.join(logs, f))
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node=3", "--local_addr=127.0.0.1", str(script),
                            "--data", tree, "--image-size", "16", "--batch-size", "15",
                            "--loader", "torchvision", "--workers", "0", "--no-progress",
                            "--save-every", "1", "--out", out, *extra],
                           env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        counts = [json.load(open(os.path.join(logs, f"opens.{k}.json"))) for k in range(3)]
        assert all(c["decoding"] > 0 for c in counts)          # the ranks did train
        opened.append([c["listing"] for c in counts])
    first, restart = opened
    print(f"files opened under the data root by the listing, per rank: first start {first}, "
          f"restart {restart} ({n} files)")
    assert n == 643          # 600 train/, 40 val/, 3 labels and meta files
    assert sum(first) <= 1.2 * n + 1000 < 3 * 600, first
    assert 600 <= first[0] <= 700 and max(first[1:]) <= 100, first  # rank 0 checks (one walk),
    # the others walk to choose the recipe
    assert sum(restart) <= 1000 and sum(restart) == 0, restart


def test_evaluating_a_flat_val_gives_the_report_of_the_same_images_sorted(tmp_path, capsys):
    """End to end: train.py on the tree (its train/; the flat val/ beside it), then python -m
    nac_fast.eval on the flat val/ and on the same images sorted into class folders: the same
    results.  A labels file naming an unknown class: status 2, one line naming file and row."""
    import json
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    import train
    from nac_fast.eval import cli as nac_eval
    tree = _ilsvrc(tmp_path / "tree")
    srt = _sorted_copy(tree, tmp_path / "sorted")
    run = tmp_path / "run"
    assert train.main(["--data", tree, "--max-steps", "1", "--batch-size", "8", "--code-dim",
                       "16", "--image-size", "16", "--out", str(run), "--no-progress",
                       "--device", "cpu", "--loader", "torchvision", "--workers", "0"]) == 0
    reports = []
    for data, out in ((tree, "ev_flat"), (srt, "ev_sorted")):
        assert nac_eval.main(["--checkpoint", str(run / "last.pt"), "--data", data, "--out",
                              str(tmp_path / out), "--tasks", "knn,hash", "--bits", "8,16",
                              "--device", "cpu", "--no-progress"]) == 0
        reports.append(json.load(open(tmp_path / out / "report.json")))
    for r in reports:                     # (the paths of its curve files: in each --out)
        r["results"]["hash"].pop("files")
    assert reports[0]["results"] == reports[1]["results"]
    assert reports[0]["splits"] == reports[1]["splits"]
    for name in ("hash_pr_curve.csv", "hash_precision_at_n.csv"):
        assert ((tmp_path / "ev_flat" / name).read_text()
                == (tmp_path / "ev_sorted" / name).read_text())
    bad = tmp_path / "bad.csv"
    lines = open(os.path.join(tree, "LOC_val_solution.csv")).read().splitlines()
    w = lines[3].split(",")[1].split()[0]
    bad.write_text("\n".join(lines[:3] + [lines[3].replace(w, "n00000001")] + lines[4:]) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:          # argparse's error: status 2, one line
        nac_eval.main(["--checkpoint", str(run / "last.pt"), "--data", tree, "--out",
                       str(tmp_path / "ev_bad"), "--tasks", "knn", "--val-labels", str(bad),
                       "--device", "cpu", "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--val-labels: data: labels file " in err and "bad.csv row 4: class n00000001" in err
    assert train.main(["--data", tree, "--val-labels", str(tmp_path / "nope.csv"), "--out",
                       str(tmp_path / "run2"), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--val-labels " in err and "nope.csv': no such file" in err, err
    assert not (tmp_path / "run2").exists()


def test_a_damaged_or_unwritable_cache_is_reported_and_the_folder_scanned(tmp_path):
    from nac_fast.data.sources import Listing, resolve_source
    from nac_fast.data.sources import imagefolder
    tree = _ilsvrc(tmp_path / "tree")
    cache = tmp_path / "out"
    want = resolve_source(tree, "train", listing=Listing(cache_dir=str(cache)))
    (name,) = os.listdir(cache)
    (cache / name).write_bytes(b"\x1f\x8b not gzip")
    imagefolder._scan_cache.clear()
    with pytest.warns(RuntimeWarning, match=f"the data list cache .*{name} cannot be read"):
        got = resolve_source(tree, "train", listing=Listing(cache_dir=str(cache)))
    assert got.files == want.files
    imagefolder._scan_cache.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # rewritten: read without a warning
        assert resolve_source(tree, "train", listing=Listing(cache_dir=str(cache))).files \
            == want.files
    (tmp_path / "afile").write_text("")
    imagefolder._scan_cache.clear()
    with pytest.warns(RuntimeWarning, match="the data list cache cannot be written in .*afile"):
        got = resolve_source(tree, "train", listing=Listing(cache_dir=str(tmp_path / "afile")))
    assert got.files == want.files
    for bad, match in (({"cache_dir": 3}, "cache_dir must be None or a path"),
                       ({"first": 1}, "first must be a bool"),
                       ({"broadcast": "all"}, "broadcast must be None or callable")):
        with pytest.raises(TypeError, match=match):
            Listing(**bad)


def _gloo_listing_worker(rank, port, trees, out):
    """One of 2 gloo ranks: for each tree, build a pretraining loader with the run's Listing
    (rank 0 scans, torch.distributed broadcasts); write what this rank got (its file list, or
    its error).  A rank left waiting fails after 60 s (the group's timeout), not never."""
    import datetime
    import json
    import torch.distributed as dist
    from nac_fast.data.sources import Listing
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    got = []
    try:
        for tree in trees:
            try:
                ld = build_pretrain_loader(tree, batch_size=2, rank=rank, world_size=2,
                                           image_size=16, loader="torchvision",
                                           listing=Listing(first=rank == 0, broadcast=broadcast))
                got.append({"files": ld.source.files})
            except ValueError as exc:
                got.append({"error": str(exc)})
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


@pytest.mark.slow
def test_rank_0s_list_or_its_error_reaches_every_rank_over_gloo(tmp_path):
    """Over torch.distributed (2 gloo ranks, no launcher to stop the others): every rank gets
    rank 0's file list, or, when no file of the tree is an image (only rank 0 checks the
    headers), rank 0's error with its message, instead of waiting for a list that never comes."""
    import json
    import socket
    import torch.multiprocessing as mp
    tree = _ilsvrc(tmp_path / "tree")
    bad = tmp_path / "bad"
    for c in ("n01", "n02"):
        os.makedirs(bad / "train" / c)
        for i in range(4):
            (bad / "train" / c / f"{c}_{i}.JPEG").write_bytes(b"not an image")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    mp.spawn(_gloo_listing_worker, args=(port, [tree, str(bad)], str(tmp_path)), nprocs=2,
             join=True)
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert r0 == r1
    assert len(r0[0]["files"]) == 20
    assert "none of the 8 image file(s)" in r0[1]["error"]


# ---- user folders an audit found broken: non-images, edits, listing order, non-UTF-8 names ----

def _folder(root, classes=("a", "b"), per_class=5):
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            _img(seed=i).save(os.path.join(root, c, f"{i}.png"))
    return str(root)


def _aged(root, seconds=60):
    """Every folder under `root` made `seconds` old (a folder scanned long after it was written)."""
    t = time.time() - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))


def test_a_folder_of_non_images_is_an_error_naming_them(tmp_path):
    """Every image-named file fails the header check: one ValueError naming the folder and the
    files (it was "a global batch of 4 exceeds the 0 images of the data set")."""
    for c in ("a", "b"):
        os.makedirs(tmp_path / "d" / c)
        for i in range(3):
            (tmp_path / "d" / c / f"{i}.JPG").write_bytes(b"not an image at all")
    with pytest.raises(ValueError, match=r"none of the 6 image file\(s\) under .*0\.JPG"):
        resolve_source(str(tmp_path / "d"), "train")
    with pytest.raises(ValueError, match="is an image"):
        build_pretrain_loader(str(tmp_path / "d"), loader="torchvision", batch_size=4,
                              image_size=16)


def test_a_folder_edited_in_one_process_is_scanned_again(tmp_path):
    """The scan is cached per process; it used to be kept after files were added or removed,
    so a second call (train.main then eval.main, a notebook) read a stale file list."""
    root = _folder(tmp_path / "bare", per_class=6)
    _aged(root)
    first = resolve_source(root, "train")
    assert resolve_source(root, "train") is first          # unchanged: the cache is used
    n = len(first.files) + len(resolve_source(root, "test").files)
    assert n == 12
    for i in range(6, 11):
        _img(seed=i).save(os.path.join(root, "a", f"{i}.png"))
    os.remove(os.path.join(root, "b", "0.png"))
    tr, te = resolve_source(root, "train"), resolve_source(root, "test")
    assert len(tr.files) + len(te.files) == 16
    assert not any(f.endswith(os.path.join("b", "0.png")) for f in tr.files + te.files)
    # a train/ + val/ root: a class added to val/ is seen
    r2 = tmp_path / "split"
    _folder(r2 / "train", per_class=3)
    _folder(r2 / "val", classes=("a",), per_class=2)
    _aged(str(r2))
    assert build_eval_loader(str(r2), split="val", batch_size=2, image_size=16).num_images == 2
    _folder(r2 / "val", classes=("b",), per_class=2)
    ev = build_eval_loader(str(r2), split="val", batch_size=2, image_size=16)
    assert ev.num_images == 4 and [int(y) for _, ys in ev for y in ys] == [0, 0, 1, 1]


def test_which_link_to_a_folder_is_read_does_not_depend_on_the_listing_order(tmp_path,
                                                                               monkeypatch):
    """Two sub-folders of a class that are one folder (x and a link y -> x): the one read was
    the one the file system listed first; now the first by name."""
    root = _folder(tmp_path / "d", per_class=2)
    os.makedirs(os.path.join(root, "a", "x"))
    _img(seed=9).save(os.path.join(root, "a", "x", "deep.png"))
    os.symlink(os.path.join(root, "a", "x"), os.path.join(root, "a", "y"))
    real = os.scandir

    class Reversed:
        """os.scandir listing its entries in reverse name order (another file system's)."""

        def __init__(self, path="."):
            self._it = real(path)
            self._entries = iter(sorted(self._it, key=lambda e: e.name, reverse=True))

        def __iter__(self):
            return self

        def __next__(self):
            return next(self._entries)

        def close(self):
            self._it.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    seen = []
    for scandir in (real, Reversed):
        monkeypatch.setattr(os, "scandir", scandir)
        imagefolder._scan_cache.clear()
        with pytest.warns(RuntimeWarning, match="not following 1 symlinked folder"):
            src = imagefolder.FolderSource._scan(root)
        seen.append([os.path.relpath(f, root) for f in src.files])
    monkeypatch.setattr(os, "scandir", real)
    assert seen[0] == seen[1]
    assert os.path.join("a", "x", "deep.png") in seen[0]


def _latin1_folder(tmp_path):
    root = _folder(tmp_path / "latin", per_class=5)
    odd = os.fsencode(os.path.join(root, "a")) + b"/caf\xe9.png"
    try:
        os.rename(os.path.join(root, "a", "0.png"), odd)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses file names that are not UTF-8")
    return root


def test_a_file_name_that_is_not_utf8(tmp_path):
    """A Latin-1 file name (an old archive's): the bare folder's hold-out split raised
    UnicodeEncodeError, and DALI's reader (the default loader where DALI is installed) crashed
    with "Unsupported argument type with name files"."""
    root = _latin1_folder(tmp_path)
    tr, te = resolve_source(root, "train"), resolve_source(root, "test")
    assert len(tr.files) + len(te.files) == 10
    # the split of UTF-8 names is the one str.encode gave
    assert imagefolder.holdout_split(["r/a/n.png"], [0], "r").tolist() == [False]
    ld = build_pretrain_loader(root, loader="auto", batch_size=4, image_size=16)
    assert ld.kind == "torchvision"
    assert all(v.shape == (4, 3, 16, 16) for v in next(iter(ld)))
    ev = build_eval_loader(root, split="test", batch_size=4, image_size=16)
    assert sum(len(y) for _, y in ev) == len(te.files)
    if dali_available():
        with pytest.raises(ValueError, match=r"not UTF-8: .*caf\\xe9\.png.*loader='torchvision'"):
            build_pretrain_loader(root, loader="dali-cpu", batch_size=4, image_size=16)
