"""ImageFolder sources (ImageNet layout): the file list, how a file becomes an image, and what
happens to a file that does not.

Layout: root/train/<class>/<image> and root/val/<class>/<image> (or test/), or ILSVRC2012's val/
as distributed: flat, labelled by LOC_val_solution.csv or the devkit's ground truth (ilsvrc.py;
read in the order of the same images sorted into class folders).  A root made of class
folders alone (a "bare" folder) is split in two: HOLDOUT_FRACTION of each class's images, chosen
by a hash of their path inside the class folder, are its test split and the rest its training
split, so that train.py never sees the images the evaluation scores; the split depends on the
file names alone, not on the scan order or where the folder lies (`holdout_split`).  A class's
images may sit in sub-folders of its folder (as torchvision's ImageFolder reads them); a test
split's labels are the training split's class indices.  The scan validates every file's magic
bytes once (16 bytes read, threaded), so DALI's decoders never meet a non-image; a split in which
no file passes is a ValueError naming the folder (not "0 images" later).  Classes are sorted by
name and files by path, whatever order the file system lists them in.

A folder is scanned once per process (`_scan_cache`) and scanned again when one of the folders
read has changed since (its mtime: a file or folder added, removed or renamed in it; or it was
changed less than RACY_NS before the scan), so a data set edited between two calls in one process
(a notebook, train.main then eval.main) is not read from a stale file list; a file overwritten in
place is not noticed.  With a `Listing` (listing.py) one process of a run scans and the others
receive its list, and the scan is cached on disk between runs under the same rule.

Bad files, one policy for every ImageFolder loader (`on_bad_file`, train.py --on-bad-file):
  "warn" (default): skip the file and count it.  A file that fails the scan (not an image, or a
      corrupt header) is left out of the data set; a file that passes the scan but fails to
      decode later (e.g. a truncated JPEG) is replaced, wherever the epoch order puts it, by the
      next decodable file of the data set (so every batch stays full and every rank runs the same
      number of steps).  Every skipped file is counted and listed in the loader's
      `skipped_files`; a RuntimeWarning gives the count and names the first MAX_NAMED of them
      (a file already reported by this process is not reported again), and a loader warns at
      most MAX_WARNINGS times (its last warning says so).
  "error": stop with a ValueError naming the file(s): at loader construction for the scan, at the
      batch that meets the file for a decode failure.
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from . import ilsvrc
from .listing import Listing, check_listing, read_cache, shared

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HOW_TO_GET = ("pass a folder of class folders (<root>/<class>/<image>; a part of each class is "
              "held out as its test split), or <root>/train/<class>/ and <root>/val/<class>/ "
              "(ImageNet: ILSVRC2012 from image-net.org as distributed, its flat val/ labelled "
              "by LOC_val_solution.csv or the devkit's ground truth)")
HOLDOUT_FRACTION = 0.2  # a bare folder of classes: this part of each class is its test split
BAD_FILE_POLICIES = ("warn", "error")
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"BM", b"II*\x00", b"MM\x00*")
NATURAL_MAX = 224      # ImageNet's crop: larger images are resized to 256 and cropped to this
SIZE_SAMPLE = 32       # images whose headers set a folder's natural size
_scan_cache: dict = {}
_warned: set = set()          # files already reported in a warning by this process
MAX_NAMED = 5                 # file names in one warning (the count is always given)
MAX_WARNINGS = 5              # bad-file warnings per loader; later skips are only counted
RACY_NS = 2_000_000_000       # a scan is cached only for folders unchanged this long before it


def _is_image_header(head: bytes) -> bool:
    return head.startswith(_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _read_head(path):
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return b""


def _mtime(path):
    """`path`'s mtime in ns (the link's target's), None when it cannot be read."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _stamp(dirs) -> tuple:
    """((folder, mtime), ...) of the folders a scan read: what `_unchanged` compares."""
    return tuple((d, _mtime(d)) for d in dirs)


def _unchanged(stamp) -> bool:
    """Whether a cached scan may be reused: `stamp` is (the scan's start, ns since the epoch,
    ((folder, mtime), ...)), and every folder still has its mtime (nothing added, removed or
    renamed in it since), an mtime at least RACY_NS older than the scan (a file system stamps
    mtimes coarsely, a few ms on ext4, 2 s on FAT: a folder changed again within that tick of
    the scan keeps its mtime, so a folder that recent is scanned again; git's "racy" rule)."""
    if not stamp:
        return False
    start, dirs = stamp
    return all(t is not None and t < start - RACY_NS and _mtime(d) == t for d, t in dirs)


def walk_following_links(folder, seen, looped=None):
    """``(folder, file names)`` of `folder` and every folder under it, hidden ones skipped, as
    os.walk(followlinks=True) visits them, sub-folders in name order (so which of two links to
    one folder is followed does not depend on the order the file system lists them in).  A
    sub-folder whose real path is in `seen` (a loop back to an ancestor, a second link to one
    folder) is not entered: its path is appended to `looped` when given.  `seen` (a set of real
    paths) grows with every folder entered; the caller adds `folder`'s own."""
    for d, subdirs, names in os.walk(folder, followlinks=True):
        keep = []
        for s in sorted(subdirs):
            if s.startswith("."):
                continue
            p = os.path.join(d, s)
            real = os.path.realpath(p)
            if real in seen:
                if looped is not None:
                    looped.append(p)
                continue
            seen.add(real)
            keep.append(s)
        subdirs[:] = keep
        yield d, names


def _class_files(folder, seen=None, looped=None, walked=None):
    """Every file under a class folder, its sub-folders included (torchvision's ImageFolder
    reads them too, and so does python -m nac_fast.index), hidden files and folders skipped;
    sorted by path.  Symlinked files are read; a symlinked folder is followed only when its real
    path has not been read yet (`seen`: the real paths of the folders read, shared by the classes
    of one scan), so a link to an ancestor (a loop) or to a folder read elsewhere is not
    followed: it is appended to `looped` (the scan warns once) instead.  Sub-folders are visited
    in sorted order, so which of two links to one folder is followed does not depend on the
    order the file system lists them in.  `walked` (a list) receives every folder read."""
    seen = set() if seen is None else seen
    looped = [] if looped is None else looped
    walked = [] if walked is None else walked
    seen.add(os.path.realpath(folder))
    out = []
    for d, names in walk_following_links(folder, seen, looped):
        walked.append(d)
        out += [os.path.join(d, n) for n in names if not n.startswith(".")]
    return sorted(out)


@dataclass
class FolderSource:
    name: str
    root: str
    files: list           # absolute paths, class-major, sorted
    labels: np.ndarray    # (N,) int64
    classes: list
    bad_files: list       # dropped at scan time
    mean: tuple = IMAGENET_MEAN
    std: tuple = IMAGENET_STD
    natural_size: int = NATURAL_MAX  # the scan sets it from the images (`natural_side`)
    in_channels: int = 3
    held_out: int = 0     # a bare folder's training split: how many images its test split holds
    # (scan start ns, ((folder, mtime), ...)) of the folders the scan read (`_unchanged`)
    stamp: tuple = field(default=(), repr=False, compare=False)
    # (images, side) of the split before the header check: what data_scale reports, so that a
    # listing without the check (train.py's recipe choice) and a cached scan agree
    scale: tuple = field(default=(0, NATURAL_MAX), repr=False, compare=False)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_root(cls, root, split="train", *, val_labels=None, listing=None):
        """The `split` ("train", or the test split: val/ or test/) of the ImageFolder `root`.
        A flat val/ (ILSVRC2012's as distributed) takes its labels from `val_labels` (a
        LOC_val_solution.csv or the devkit's ground truth), else from the one found at the
        tree's root or its parent (ilsvrc.find_labels).  `listing` (a Listing): the folder is
        scanned once per run and cached between runs (listing.py)."""
        check_listing(listing)
        root = os.path.abspath(root)
        train = os.path.join(root, "train")
        if val_labels is not None and not os.path.isfile(val_labels):
            raise FileNotFoundError(f"val_labels {os.fspath(val_labels)!r}: no such file")
        if not os.path.isdir(train):
            if val_labels is not None:
                raise ValueError(f"val_labels: {root} has no train/ and val/ (a folder of classes "
                                 "holds its test split out of each class): a labels file labels "
                                 "a flat val/ beside train/")
            return cls._bare(root, split, listing)
        sub = "train" if split == "train" else next(
            (s for s in ("val", "test") if os.path.isdir(os.path.join(root, s))), None)
        if sub is None:
            raise FileNotFoundError(f"data: {root} has train/ but no val/ (or test/) for the "
                                    f"{split!r} split; {HOW_TO_GET}")
        d = os.path.join(root, sub)
        labels_from = train if sub != "train" else None  # test labels: the training classes
        labels_file = None
        if labels_from:
            labels_file = (os.path.abspath(val_labels) if val_labels is not None
                           else ilsvrc.find_labels(root))
        key = (os.path.realpath(d),) + ((os.path.realpath(labels_from),) if labels_from else ())
        key += (os.path.realpath(labels_file),) if labels_file else ()

        def make():
            before = _stamp([labels_from]) if labels_from else ()   # its class names are read
            src = cls._scan(d, cls._class_names(labels_from) if labels_from else None,
                            labels_file=labels_file, labels_named=val_labels is not None)
            return replace(src, stamp=(src.stamp[0], src.stamp[1] + before))
        return _shared_scan(key, make, listing)

    @classmethod
    def _bare(cls, root, split, listing=None):
        """A bare folder of classes: its training or test split (holdout_split).  A folder too
        small to hold any image out (every class a single image) trains on all of them and has
        no test split."""
        key = (os.path.realpath(root), "bare")
        whole = _shared_scan(key, lambda: replace(
            cls._scan(root, bare=True), name=os.path.basename(root.rstrip(os.sep)) or root),
            listing)
        part = _split_cache.get(key)
        if part is None or part["whole"] is not whole:
            test = holdout_split(whole.files, whole.labels, root)

            def take(keep, **kw):
                idx = np.flatnonzero(keep)
                return replace(whole, files=[whole.files[i] for i in idx],
                               labels=whole.labels[idx], **kw)
            part = _split_cache[key] = {"whole": whole, "train": take(~test,
                                                                     held_out=int(test.sum())),
                                        "test": take(test)}
        if split != "train" and not part["test"].files:
            raise ValueError(f"data: {root} is a folder of classes too small to hold any image "
                             f"out for its {split!r} split (a class needs at least 2 images); "
                             f"{HOW_TO_GET}")
        return part["train" if split == "train" else "test"]

    @classmethod
    def scale_of(cls, root, listing=None) -> tuple:
        """(images, side) of the training split of the ImageFolder `root` before the header
        check (`scale`): from a scan made already (this process's, or the cache of `listing`),
        else from a walk of its folders alone (no file opened but the SIZE_SAMPLE images whose
        headers set the side).  What train.py reads on every rank before the run's processes
        know each other, to choose its recipe and batch."""
        check_listing(listing)
        root = os.path.abspath(root)
        train = os.path.join(root, "train")
        bare = not os.path.isdir(train)
        key = (os.path.realpath(root), "bare") if bare else (os.path.realpath(train),)
        src = _cached_scan(key, listing)
        if src is not None:
            return tuple(src.scale)
        d = root if bare else train
        hit = _walk_cache.get(key)
        if hit is None or not _unchanged(hit["stamp"]):
            start = time.time_ns()
            walk = cls._walk(d)
            hit = _walk_cache[key] = {"walk": walk, "stamp": (start, walk[4]),
                                      "scale": _scale(walk[0], walk[1], d, bare)}
        return hit["scale"]

    @staticmethod
    def _class_names(d):
        classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise ValueError(f"data: {d} contains no class folders; {HOW_TO_GET}")
        return classes

    @classmethod
    def _walk(cls, d, train_classes=None):
        """(image files, labels, classes, other files, stamp) of the class folders of ``d``, no
        file opened; with ``train_classes`` (a test split) each must be one of the training
        split's, and its label is that class's index there."""
        stamp = _stamp([d])              # before the listing: a change during the scan rescans
        found = cls._class_names(d)
        classes = list(train_classes) if train_classes is not None else found
        label = {c: k for k, c in enumerate(classes)}
        extra = [c for c in found if c not in label]
        if extra:
            raise ValueError(f"data: {d} has class folder(s) the training split lacks: "
                             f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; "
                             "a test class must be one of the training classes")
        files, labels, odd = [], [], []
        # every class folder (and d itself) counts as read: a link to one of them is not followed
        seen = {os.path.realpath(d)} | {os.path.realpath(os.path.join(d, c)) for c in found}
        looped: list = []
        walked: list = []
        for c in found:
            k = label[c]
            before = len(walked)
            entries = _class_files(os.path.join(d, c), seen, looped, walked)
            stamp += _stamp(walked[before:])
            imgs = [p for p in entries if p.lower().endswith(IMAGE_EXTENSIONS)]
            odd += [p for p in entries if not p.lower().endswith(IMAGE_EXTENSIONS)]
            if not imgs:
                raise ValueError(f"data: class folder {os.path.join(d, c)} holds no images "
                                 f"({', '.join(IMAGE_EXTENSIONS)}); remove it or add images")
            files += imgs
            labels += [k] * len(imgs)
        if looped:
            warnings.warn(f"nac_fast.data: not following {len(looped)} symlinked folder(s) "
                          "whose real folder is read already (a symlink loop, or a second link "
                          f"to one folder): {_names(sorted(looped), '')}", RuntimeWarning,
                          stacklevel=3)
        loose = sorted(e.name for e in os.scandir(d) if e.is_file() and not
                       e.name.startswith(".") and e.name.lower().endswith(IMAGE_EXTENSIONS))
        if loose:
            warnings.warn(f"nac_fast.data: {len(loose)} image file(s) directly in {d} are not "
                          "in a class folder and are not used (a class's images go in "
                          f"<root>/<class>/): {_names([os.path.join(d, n) for n in loose], '')}",
                          RuntimeWarning, stacklevel=3)
        return files, labels, classes, odd, stamp

    @staticmethod
    def _walk_flat(d, classes, labels_file, labels_named):
        """_walk's answer for a flat val/ (ILSVRC2012's as distributed): its image files with
        the labels of `labels_file`, in the order of the same images sorted into class folders
        (class-major, by name within a class), so that both layouts evaluate alike."""
        stamp = _stamp([d])
        if labels_file is None:
            raise ValueError(f"data: {d} is a flat folder of images (ILSVRC2012's val/ as "
                             f"distributed) and no labels file was found ({ilsvrc.CSV_NAME} at "
                             f"{os.path.dirname(d)} or its parent, or the devkit's "
                             f"{ilsvrc.DEVKIT_NAME} in {ilsvrc.DEVKIT_DIR}); name it with "
                             "--val-labels FILE, or sort val/ into class folders")
        names = sorted(e.name for e in os.scandir(d) if e.is_file() and not e.name.startswith("."))
        files = [os.path.join(d, n) for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
        odd = [os.path.join(d, n) for n in names if not n.lower().endswith(IMAGE_EXTENSIONS)]
        try:
            labels = np.asarray(ilsvrc.flat_labels(files, labels_file, classes), np.int64)
        except ValueError as exc:
            if labels_named:
                raise ValueError(f"--val-labels: {exc}") from None
            raise
        order = np.argsort(labels, kind="stable")
        stamp += _stamp(ilsvrc.label_files(labels_file))
        return [files[i] for i in order], labels[order].tolist(), list(classes), odd, stamp

    @classmethod
    def _scan(cls, d, train_classes=None, *, labels_file=None, labels_named=False, bare=False):
        """The class folders of ``d`` (`_walk`), or with ``train_classes`` a flat ``d`` labelled
        by ``labels_file`` (`_walk_flat`), their files' headers checked."""
        start = time.time_ns()
        walked = (_walk_cache.pop((os.path.realpath(d),) + (("bare",) if bare else ()), None)
                  if train_classes is None else None)
        if walked is not None and _unchanged(walked["stamp"]):   # scale_of's walk, still true
            start = walked["stamp"][0]
            files, labels, classes, odd, stamp = walked["walk"]
        elif train_classes is not None and _is_flat(d):
            files, labels, classes, odd, stamp = cls._walk_flat(d, train_classes, labels_file,
                                                                labels_named)
        else:
            if labels_named:
                raise ValueError(f"--val-labels: {d} is sorted into class folders, which label "
                                 "its images; a labels file labels a flat val/ (leave the flag "
                                 "out)")
            files, labels, classes, odd, stamp = cls._walk(d, train_classes)
        scale = walked["scale"] if walked is not None and start == walked["stamp"][0] else \
            _scale(files, labels, d, bare)
        # header check: 16 bytes per file, threads because it is I/O-bound (ImageNet: 1.28M files)
        with ThreadPoolExecutor(16) as ex:
            ok = [_is_image_header(h) for h in ex.map(_read_head, files, chunksize=256)]
        bad = odd + [p for p, good in zip(files, ok) if not good]
        keep = np.flatnonzero(ok)
        if not len(keep):
            # else the loaders' "a batch exceeds the 0 images of the data set" hides the cause
            raise ValueError(f"data: none of the {len(files)} image file(s) under {d} is an image "
                             f"(their first bytes are no JPEG, PNG, BMP, TIFF or WebP header): "
                             f"{_names(sorted(bad), '')}")
        files = [files[i] for i in keep]
        return cls(name=os.path.basename(os.path.dirname(d.rstrip("/"))) or d, root=d,
                   files=files, labels=np.asarray(labels, np.int64)[keep],
                   classes=classes, bad_files=bad, natural_size=scale[1],
                   stamp=(start, stamp), scale=scale)


def _is_flat(d) -> bool:
    """Whether folder `d` holds image files and no class folder (a flat val/)."""
    subdirs, images = False, False
    for e in os.scandir(d):
        if e.name.startswith("."):
            continue
        if e.is_dir():
            subdirs = True
        elif e.name.lower().endswith(IMAGE_EXTENSIONS):
            images = True
    return images and not subdirs


def _scale(files, labels, root, bare) -> tuple:
    """(images, side) of a split before the header check: `files` (a bare folder: the part
    holdout_split leaves for training) and natural_side of `files`."""
    n = len(files)
    if bare and n:
        n -= int(holdout_split(files, labels, root).sum())
    return n, natural_side(files)


_split_cache: dict = {}   # a bare folder's key: {"whole": its scan, "train": ..., "test": ...}
_walk_cache: dict = {}    # scale_of's walks: key -> {"walk": _walk's answer, "stamp", "scale"};
                          # the scan of the same folder takes it over (one walk, not two)


def _cached_scan(key, listing):
    """A scan of `key` that still holds (`_unchanged`): this process's, else the one in the
    cache of `listing`; None."""
    src = _scan_cache.get(key)
    if src is not None and _unchanged(src.stamp):
        return src
    if listing is not None and listing.cache_dir is not None:
        packed = read_cache(listing.cache_dir, key)
        if packed is not None:
            src = _unpack(packed)
            if _unchanged(src.stamp):
                _scan_cache[key] = src
                return src
    return None


def _shared_scan(key, make, listing: Listing | None):
    """The scan `key`: made by `make()` on the first process of `listing` (or reused from this
    process's scans or from the listing's cache, which a new scan is written to) and received
    by the others (listing.shared)."""
    def produce():
        src = _cached_scan(key, listing)
        if src is None:
            _scan_cache.pop(key, None)
            src = make()
            if listing is not None and listing.cache_dir is not None and listing.first:
                listing.store(key, _pack(src))
        return src
    if listing is None or listing.broadcast is None:
        src = produce()
    else:
        mine: dict = {}

        def make_packed():
            mine["src"] = produce()
            return _pack(mine["src"])
        packed = shared(listing, make_packed)
        src = mine["src"] if "src" in mine else _unpack(packed)
    _scan_cache[key] = src
    return src


def _pack(src) -> dict:
    """A FolderSource as plain data (paths relative to its root): what the first process
    broadcasts and the cache stores."""
    prefix = src.root.rstrip(os.sep) + os.sep

    def rel(paths):
        return [p[len(prefix):] if p.startswith(prefix) else p for p in paths]
    return {"name": src.name, "root": src.root, "files": rel(src.files),
            "labels": np.asarray(src.labels).tolist(), "classes": list(src.classes),
            "bad_files": rel(src.bad_files), "natural_size": int(src.natural_size),
            "in_channels": int(src.in_channels), "held_out": int(src.held_out),
            "stamp": [src.stamp[0], [[d, t] for d, t in src.stamp[1]]] if src.stamp else [],
            "scale": [int(v) for v in src.scale]}


def _unpack(packed) -> FolderSource:
    prefix = packed["root"].rstrip(os.sep) + os.sep

    def absolute(paths):
        return [p if p.startswith(os.sep) else prefix + p for p in paths]
    stamp = packed["stamp"]
    return FolderSource(name=packed["name"], root=packed["root"],
                        files=absolute(packed["files"]),
                        labels=np.asarray(packed["labels"], np.int64).reshape(-1),
                        classes=list(packed["classes"]), bad_files=absolute(packed["bad_files"]),
                        natural_size=packed["natural_size"], in_channels=packed["in_channels"],
                        held_out=packed["held_out"],
                        stamp=(stamp[0], tuple((d, t) for d, t in stamp[1])) if stamp else (),
                        scale=tuple(packed["scale"]))


def holdout_split(files, labels, root) -> np.ndarray:
    """(N,) bool, True for the test split of a bare folder of classes: in each class of n >= 2
    images, the max(1, round(HOLDOUT_FRACTION * n)) whose paths relative to the class folder have
    the smallest MD5 (a class of one image stays in training).  The split depends only on the
    file names within each class folder, not on the order of the scan or the folder's location.
    ValueError when `labels` is not one label per file."""
    labels = np.asarray(labels)
    if labels.shape != (len(files),):
        raise ValueError(f"labels must hold one label per file ({len(files)}), got shape "
                         f"{labels.shape}")
    test = np.zeros(len(files), dtype=bool)
    for k in np.unique(labels):
        idx = np.flatnonzero(labels == k)
        if len(idx) < 2:
            continue
        n_test = max(1, round(HOLDOUT_FRACTION * len(idx)))
        # os.fsencode: a name that is not UTF-8 (a Latin-1 name from an old archive, held as
        # surrogates) hashes as its bytes; str.encode() raised UnicodeEncodeError on it
        keys = [hashlib.md5(os.fsencode(_within_class(files[i], root))).hexdigest() for i in idx]
        test[idx[np.argsort(keys, kind="stable")[:n_test]]] = True
    return test


def _within_class(path, root):
    """A file's path inside its class folder, '/'-separated (root/<class>/<this>)."""
    rel = os.path.relpath(path, root).split(os.sep)
    return "/".join(rel[1:])


def natural_side(files) -> int:
    """The side a folder's images are trained at by default: the median short side of up to
    SIZE_SAMPLE images spread over the file list (PIL reads only their headers), capped at
    NATURAL_MAX; NATURAL_MAX when none can be read (the scan has already checked the headers'
    magic bytes, so that means no file list or an unusual format)."""
    from PIL import Image
    if not files:
        return NATURAL_MAX
    step = max(1, len(files) // SIZE_SAMPLE)
    sides = []
    for path in files[::step][:SIZE_SAMPLE]:
        try:
            with Image.open(path) as im:
                sides.append(min(im.size))
        except Exception:  # a file the scan let through but PIL cannot open: the loaders skip it
            continue
    if not sides:
        return NATURAL_MAX
    return int(min(NATURAL_MAX, sorted(sides)[len(sides) // 2]))


def non_utf8_names(files) -> list:
    """The paths of `files` that are not UTF-8 (a Latin-1 name from an old archive: Python holds
    its odd bytes as surrogates), each with those bytes escaped for a message.  DALI's file
    reader takes UTF-8 names only (it raised "Unsupported argument type with name files")."""
    try:
        "\0".join(files).encode("utf-8")            # the common case: one encode, no list
        return []
    except UnicodeEncodeError:
        pass
    out = []
    for p in files:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            out.append(p.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
    return out


def check_policy(on_bad_file):
    if on_bad_file not in BAD_FILE_POLICIES:
        raise ValueError(f"on_bad_file must be one of {BAD_FILE_POLICIES}, got {on_bad_file!r}")


class BadFiles:
    """One loader's bad-file policy (see the module docstring) and the files it skipped."""

    def __init__(self, on_bad_file):
        check_policy(on_bad_file)
        self.policy = on_bad_file
        self.skipped: list = []           # distinct paths, in the order they were met
        self.warnings = 0                 # warnings given (at most MAX_WARNINGS)

    def report(self, paths, why):
        """Skip `paths` ("warn": count them, one warning naming the ones this process has not
        named yet) or raise naming them ("error")."""
        new = [p for p in dict.fromkeys(paths) if p not in self.skipped]
        if not new:
            return
        if self.policy == "error":
            raise ValueError(f"data: {why}: {_names(new, '')} (on_bad_file='warn', train.py "
                             "--on-bad-file warn, skips and counts them)")
        self.skipped += new
        unwarned = [p for p in new if p not in _warned]
        if unwarned and self.warnings < MAX_WARNINGS:
            _warned.update(unwarned)
            self.warnings += 1
            last = (f" (warning {MAX_WARNINGS} of {MAX_WARNINGS}: further skipped files are "
                    "only counted, in the loader's skipped_files)"
                    if self.warnings == MAX_WARNINGS else "")
            warnings.warn(f"nac_fast.data: skipping {len(unwarned)} {why}: {_names(unwarned)}"
                          f"{last}", RuntimeWarning, stacklevel=3)


def _names(paths, where=" (all of them: the loader's skipped_files)"):
    """The first MAX_NAMED paths, and how many more."""
    more = len(paths) - MAX_NAMED
    return ", ".join(paths[:MAX_NAMED]) + (f" and {more} more{where}" if more > 0 else "")


def to_8bit(im):
    """A PIL image with more than 8 bits per sample as an 8-bit one, its values scaled, not
    clipped (PIL's convert("RGB") clips I;16/I to 255 and F to 0..255: white or black images),
    the way DALI's decoder reads such files:

      I;16 (16-bit PNG/TIFF)   value / 257                (0..65535 -> 0..255)
      I    (32-bit integer)    value / 257 when every value lies in 0..65535 (16-bit data, as
                               PIL opens some 16-bit files), else the image's min..max -> 0..255
      F    (32-bit float)      value * 255 when every value lies in 0..1, else the image's
                               min..max -> 0..255

    Other modes are returned as they are.  NaNs become 0."""
    from PIL import Image
    mode = im.mode
    if not (mode.startswith("I") or mode == "F"):
        return im
    a = np.asarray(im, dtype=np.float64)
    if a.ndim == 3:     # a multi-channel high-depth image (rare): its channels as they are
        a = a[..., :3]
    a = np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
    if mode.startswith("I;16") or (mode == "I" and lo >= 0 and hi <= 65535):
        a = a / 257.0
    elif mode == "F" and lo >= 0 and hi <= 1:
        a = a * 255.0
    else:
        a = (a - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(a)
    u8 = np.clip(np.rint(a), 0, 255).astype(np.uint8)
    return Image.fromarray(u8)          # L (2-D) or RGB (H, W, 3)


def _as_decoded(im):
    """`im` (open) with its EXIF orientation applied and its samples in 8 bits: `im` itself when
    neither changes it."""
    from PIL import ImageOps
    out = ImageOps.exif_transpose(im)
    return to_8bit(out if out is not None else im)


def open_image(path):
    """A file as a PIL image the way every loader decodes it (DALI's decoder too): its EXIF
    orientation applied (PIL.ImageOps.exif_transpose, a phone photo stands upright) and samples
    of more than 8 bits scaled to 8 (`to_8bit`); not yet converted to RGB."""
    from PIL import Image
    with Image.open(path) as im:
        im.load()
        out = _as_decoded(im)
        return out.copy() if out is im else out


def load_rgb(path):
    """A file as an RGB PIL image (PIL imported here: only the ImageFolder loaders need it):
    `open_image`'s, then RGB (one copy: convert makes it)."""
    from PIL import Image
    with Image.open(path) as im:
        return _as_decoded(im).convert("RGB")


def decode_or_next(files, i):
    """(image, j, bad): file i decoded, or if it fails the next decodable file j (cyclically);
    `bad` lists the indices that failed on the way.  The one substitution rule of every loader."""
    bad = []
    for k in range(len(files)):
        j = (i + k) % len(files)
        try:
            return load_rgb(files[j]), j, bad
        except Exception:          # PIL raises OSError, SyntaxError, ValueError... on bad data
            bad.append(j)
    raise ValueError(f"data: none of the {len(files)} files could be decoded")
