"""User image folders as training / evaluation data: the cases an audit found broken (elongated
images, folders of non-images, folders edited within one process, file-system listing order,
file names that are not UTF-8).  Small PIL folders in tmp_path; each test takes a few seconds."""
import os
import time

import numpy as np
import pytest
import torch
from PIL import Image

from nac_fast.data import build_eval_loader, build_pretrain_loader, dali_available
from nac_fast.data.augment import pil_center_crop, to_uint8_chw
from nac_fast.data.sources import imagefolder, resolve_source


def _img(w=40, h=30, seed=0):
    a = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(a)


def _folder(root, classes=("a", "b"), per_class=5):
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            _img(seed=i).save(os.path.join(root, c, f"{i}.png"))
    return str(root)


def _age(root, seconds=60):
    """Every folder under `root` made `seconds` old (a folder scanned long after it was written)."""
    t = time.time() - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))


def test_center_crop_of_a_very_elongated_image_makes_no_huge_intermediate(monkeypatch):
    """A 2 x 4000 strip was resized whole to 256 x 512000 pixels before the crop (a 2 x 60000
    one took 8.7 GB and 42 s); the crop is now resized from the source in one step."""
    real = Image.Image.resize
    made = []

    def resize(self, size, *a, **kw):
        made.append(size[0] * size[1])
        if size[0] * size[1] > 4 * 224 * 224:
            raise AssertionError(f"an intermediate image of {size} pixels")
        return real(self, size, *a, **kw)

    monkeypatch.setattr(Image.Image, "resize", resize)
    x = pil_center_crop(Image.new("RGB", (2, 4000), (10, 20, 30)), 224)
    assert x.shape == (3, 224, 224) and x.dtype == torch.uint8
    assert (x[:, 100, 100].tolist() == [10, 20, 30]) and max(made) == 224 * 224
    monkeypatch.setattr(Image.Image, "resize", real)
    # the same view as resizing the short side to size / 0.875 and cropping the centre
    # (an ordinary image exactly; one elongated past 16 crops, from the source, within a level)
    for w, h, size, tol in ((90, 60, 48, 0), (61, 97, 32, 0), (300, 41, 24, 0),
                            (700, 20, 24, 1), (13, 900, 32, 1)):
        im = _img(w, h)
        short = round(size / 0.875)
        s = short / min(w, h)
        W, H = max(size, round(w * s)), max(size, round(h * s))
        big = im.resize((W, H), Image.BILINEAR)
        left, top = (W - size) // 2, (H - size) // 2
        want = to_uint8_chw(big.crop((left, top, left + size, top + size))).int()
        assert (pil_center_crop(im, size).int() - want).abs().max() <= tol, (w, h, size)


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
    _age(root)
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
    _age(str(r2))
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
