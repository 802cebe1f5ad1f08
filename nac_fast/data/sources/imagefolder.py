"""ImageFolder sources (ImageNet layout): the file list, how a file becomes an image, and what
happens to a file that does not.

Layout: root/train/<class>/<image> and root/val/<class>/<image> (or test/).  A root made of class
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
place is not noticed.

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

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HOW_TO_GET = ("pass a folder of class folders (<root>/<class>/<image>; a part of each class is "
              "held out as its test split), or <root>/train/<class>/ and <root>/val/<class>/ "
              "(ImageNet: download ILSVRC2012 from image-net.org and sort val/ into class "
              "folders)")
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

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_root(cls, root, split="train"):
        root = os.path.abspath(root)
        train = os.path.join(root, "train")
        if not os.path.isdir(train):
            return cls._bare(root, split)
        sub = "train" if split == "train" else next(
            (s for s in ("val", "test") if os.path.isdir(os.path.join(root, s))), None)
        if sub is None:
            raise FileNotFoundError(f"data: {root} has train/ but no val/ (or test/) for the "
                                    f"{split!r} split; {HOW_TO_GET}")
        d = os.path.join(root, sub)
        labels_from = train if sub != "train" else None  # test labels: the training classes
        key = (os.path.realpath(d),) + ((os.path.realpath(labels_from),) if labels_from else ())
        if key not in _scan_cache or not _unchanged(_scan_cache[key].stamp):
            _scan_cache.pop(key, None)
            before = _stamp([labels_from]) if labels_from else ()   # its class names are read
            src = cls._scan(d, cls._class_names(labels_from) if labels_from else None)
            _scan_cache[key] = replace(src, stamp=(src.stamp[0], src.stamp[1] + before))
        return _scan_cache[key]

    @classmethod
    def _bare(cls, root, split):
        """A bare folder of classes: its training or test split (holdout_split).  A folder too
        small to hold any image out (every class a single image) trains on all of them and has
        no test split."""
        key = (os.path.realpath(root), "bare")
        if key not in _scan_cache or not _unchanged(_scan_cache[key]["train"].stamp):
            _scan_cache.pop(key, None)
            whole = replace(cls._scan(root), name=os.path.basename(root.rstrip(os.sep)) or root)
            test = holdout_split(whole.files, whole.labels, root)

            def take(keep, **kw):
                idx = np.flatnonzero(keep)
                return replace(whole, files=[whole.files[i] for i in idx],
                               labels=whole.labels[idx], **kw)
            _scan_cache[key] = {"train": take(~test, held_out=int(test.sum())),
                                "test": take(test)}
        part = _scan_cache[key]
        if split != "train" and not part["test"].files:
            raise ValueError(f"data: {root} is a folder of classes too small to hold any image "
                             f"out for its {split!r} split (a class needs at least 2 images); "
                             f"{HOW_TO_GET}")
        return part["train" if split == "train" else "test"]

    @staticmethod
    def _class_names(d):
        classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise ValueError(f"data: {d} contains no class folders; {HOW_TO_GET}")
        return classes

    @classmethod
    def _scan(cls, d, train_classes=None):
        """The class folders of ``d``; with ``train_classes`` (a test split) each must be one of
        the training split's, and its label is that class's index there."""
        start = time.time_ns()
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
                          stacklevel=2)
        loose = sorted(e.name for e in os.scandir(d) if e.is_file() and not
                       e.name.startswith(".") and e.name.lower().endswith(IMAGE_EXTENSIONS))
        if loose:
            warnings.warn(f"nac_fast.data: {len(loose)} image file(s) directly in {d} are not "
                          "in a class folder and are not used (a class's images go in "
                          f"<root>/<class>/): {_names([os.path.join(d, n) for n in loose], '')}",
                          RuntimeWarning, stacklevel=2)
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
                   classes=classes, bad_files=bad, natural_size=natural_side(files),
                   stamp=(start, stamp))


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
