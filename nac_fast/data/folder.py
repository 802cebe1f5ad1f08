"""ImageFolder sources (ImageNet layout) and the torchvision/PIL loaders for them.

Layout: root/train/<class>/<image> and root/val/<class>/<image>; a root made of class folders is
its own train split.  The scan validates every file's magic bytes once (16 bytes read, threaded):
non-image or corrupt-header files are dropped with ONE warning naming them (or a ValueError with
on_bad_file="error"), so DALI's decoders never meet them.  A file that passes the header check but
fails to decode later (e.g. truncated) is replaced by the next decodable image of the data set and
reported by one warning naming it.

The pretraining loader splits the work: DataLoader workers decode with PIL and do the crop
(PIL resize with a float box = the window of augment.crop_windows, antialiased) and the flip; the
colour stage (jitter, grayscale, blur, normalise) runs batched (augment.colour_blur, the same code
as the in-memory loaders): on the GPU when training there, else in the workers' collate.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from .augment import Recipe, colour_blur, crop_windows, normalize, one_cpu_thread, view_params
from .sampling import EpochLoaderMixin, ShardedOrder

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
HOW_TO_GET = ("pass data=<root> with train/<class>/*.JPEG and val/<class>/*.JPEG (ImageNet: "
              "download ILSVRC2012 from image-net.org and sort val/ into class folders)")
_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"BM", b"II*\x00", b"MM\x00*")
_BAD_POLICIES = ("warn", "error")
_scan_cache: dict = {}
_warned: set = set()


def _is_image_header(head: bytes) -> bool:
    return head.startswith(_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _read_head(path):
    try:
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return b""


def check_policy(on_bad_file):
    if on_bad_file not in _BAD_POLICIES:
        raise ValueError(f"on_bad_file must be one of {_BAD_POLICIES}, got {on_bad_file!r}")


def report_bad(paths, on_bad_file, why):
    """One warning (or error) naming the bad files; each file is reported once per process."""
    new = [p for p in paths if p not in _warned]
    if not new:
        return
    names = ", ".join(new[:20]) + (f" and {len(new) - 20} more" if len(new) > 20 else "")
    if on_bad_file == "error":
        raise ValueError(f"data: {why}: {names} (pass on_bad_file='warn' to skip them)")
    _warned.update(new)
    warnings.warn(f"nac_fast.data: skipping {len(new)} {why}: {names}", RuntimeWarning, stacklevel=3)


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
    natural_size: int = 224
    in_channels: int = 3

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @classmethod
    def from_root(cls, root, split="train"):
        root = os.path.abspath(root)
        if os.path.isdir(os.path.join(root, "train")):
            sub = "train" if split == "train" else next(
                (s for s in ("val", "test") if os.path.isdir(os.path.join(root, s))), None)
            if sub is None:
                raise FileNotFoundError(f"data: {root} has train/ but no val/ (or test/) for the "
                                        f"{split!r} split; {HOW_TO_GET}")
            d = os.path.join(root, sub)
        elif split == "train":
            d = root
        else:
            raise FileNotFoundError(f"data: {root} is a bare folder of classes, it has no val/ "
                                    f"for the {split!r} split; {HOW_TO_GET}")
        key = (os.path.realpath(d),)
        if key not in _scan_cache:
            _scan_cache[key] = cls._scan(d)
        return _scan_cache[key]

    @classmethod
    def _scan(cls, d):
        classes = sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))
        if not classes:
            raise ValueError(f"data: {d} contains no class folders; {HOW_TO_GET}")
        files, labels, odd = [], [], []
        for k, c in enumerate(classes):
            entries = sorted(e.path for e in os.scandir(os.path.join(d, c))
                             if e.is_file() and not e.name.startswith("."))
            imgs = [p for p in entries if p.lower().endswith(IMAGE_EXTENSIONS)]
            odd += [p for p in entries if not p.lower().endswith(IMAGE_EXTENSIONS)]
            if not imgs:
                raise ValueError(f"data: class folder {os.path.join(d, c)} holds no images "
                                 f"({', '.join(IMAGE_EXTENSIONS)}); remove it or add images")
            files += imgs
            labels += [k] * len(imgs)
        # header check: 16 bytes per file, threads because it is I/O-bound (ImageNet: 1.28M files)
        with ThreadPoolExecutor(16) as ex:
            ok = [_is_image_header(h) for h in ex.map(_read_head, files, chunksize=256)]
        bad = odd + [p for p, good in zip(files, ok) if not good]
        keep = np.flatnonzero(ok)
        return cls(name=os.path.basename(os.path.dirname(d.rstrip("/"))) or d, root=d,
                   files=[files[i] for i in keep], labels=np.asarray(labels, np.int64)[keep],
                   classes=classes, bad_files=bad)


def load_rgb(path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


def _to_uint8_chw(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


class _Decoder:
    """Loads dataset index i, falling forward to the next decodable image if it fails."""

    def __init__(self, source: FolderSource):
        self.files = source.files

    def load(self, i):
        bad = []
        for k in range(len(self.files)):
            j = (i + k) % len(self.files)
            try:
                return load_rgb(self.files[j]), bad
            except Exception:          # PIL raises OSError, SyntaxError, ValueError... on bad data
                bad.append(j)
        raise ValueError(f"data: none of the {len(self.files)} files could be decoded")


class _TwoViewCrops(torch.utils.data.Dataset):
    """Worker side: decode once, crop/resize/flip twice (uint8)."""

    def __init__(self, source, recipe, seed, size):
        self.dec, self.recipe, self.seed, self.size = _Decoder(source), recipe, seed, size

    def __len__(self):
        return len(self.dec.files)

    def __getitem__(self, item):
        epoch, i = item
        img, bad = self.dec.load(i)
        views = []
        for view in (0, 1):
            p = view_params(self.recipe, self.seed, epoch, np.array([i]), view)
            x0, y0, w, h = crop_windows(p, img.height, img.width, self.recipe.ratio)[0].tolist()
            v = img.resize((self.size, self.size), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
            if p["flip"][0]:
                v = v.transpose(Image.FLIP_LEFT_RIGHT)
            views.append(_to_uint8_chw(v))
        return views[0], views[1], epoch, i, bad


class _Collate:
    """Stacks the uint8 views; with `finish` (CPU training) it also runs the batched colour stage
    right here, in the worker process.  Why: in the main process the colour stage competes with
    the workers for the same 2 cores, and torch's intra-op threads spin while they wait; in the
    workers it is single-threaded and parallel across workers."""

    def __init__(self, finish=None):
        self.finish = finish

    def __call__(self, items):
        v1, v2, epoch, idx, bad = zip(*items)
        idx = np.array(idx)
        v1, v2 = torch.stack(v1), torch.stack(v2)
        if self.finish is not None:
            v1, v2 = self.finish(v1, epoch[0], idx, 0), self.finish(v2, epoch[0], idx, 1)
        return v1, v2, idx, [b for bs in bad for b in bs]


class _Finish:
    """uint8 view batch -> jittered, grayscaled, blurred, normalised float batch."""

    def __init__(self, recipe, seed, mean, std, dtype, channels_last):
        self.recipe, self.seed, self.mean, self.std = recipe, seed, mean, std
        self.dtype, self.channels_last = dtype, channels_last

    def __call__(self, v_u8, epoch, idx, view):
        p = view_params(self.recipe, self.seed, epoch, idx, view)
        with one_cpu_thread(v_u8.device):         # a no-op in workers (already 1 thread)
            x = colour_blur(v_u8.float().div_(255.0), p, self.recipe)
            return normalize(x, self.mean, self.std, self.dtype, self.channels_last)


class _EpochBatches(torch.utils.data.Sampler):
    def __init__(self, rows, epoch):
        self.rows, self.epoch = rows, epoch

    def __iter__(self):
        return ([(self.epoch, int(i)) for i in row] for row in self.rows)

    def __len__(self):
        return len(self.rows)


class FolderPretrainLoader(EpochLoaderMixin):
    kind = "torchvision"

    def __init__(self, source: FolderSource, batch_size, rank, world_size, seed, image_size,
                 recipe: Recipe, device, channels_last, dtype, num_workers, on_bad_file):
        check_policy(on_bad_file)
        report_bad(source.bad_files, on_bad_file, "non-image or corrupt files")
        self.source, self.on_bad_file = source, on_bad_file
        self.order = ShardedOrder(len(source.files), batch_size, rank, world_size, seed)
        self.batch_size, self.seed, self.recipe, self.image_size = batch_size, seed, recipe, image_size
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.num_workers = num_workers
        self._crops = _TwoViewCrops(source, recipe, seed, image_size)

    num_images = property(lambda self: len(self.source.files))
    in_channels = property(lambda self: 3)
    num_classes = property(lambda self: self.source.num_classes)

    def __iter__(self):
        finish = _Finish(self.recipe, self.seed, self.source.mean, self.source.std, self.dtype,
                         self.channels_last)
        on_cpu = self.device.type == "cpu"        # else the colour stage runs on the GPU
        dl = torch.utils.data.DataLoader(
            self._crops, batch_sampler=_EpochBatches(self.batch_indices(), self.epoch),
            num_workers=self.num_workers, collate_fn=_Collate(finish if on_cpu else None),
            pin_memory=not on_cpu, prefetch_factor=4 if self.num_workers else None)
        for v1, v2, idx, bad in dl:
            if bad:
                report_bad([self.source.files[j] for j in bad], self.on_bad_file, "undecodable files")
            if not on_cpu:
                v1, v2 = (finish(v.to(self.device, non_blocking=True), self.epoch, idx, view)
                          for view, v in ((0, v1), (1, v2)))
            yield v1, v2


class _CenterCrops(torch.utils.data.Dataset):
    def __init__(self, source, size):
        self.dec, self.labels, self.size = _Decoder(source), source.labels, size

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img, bad = self.dec.load(i)
        short = round(self.size / 0.875)          # 256 -> 224, the ImageNet convention
        scale = short / min(img.width, img.height)
        w, h = max(self.size, round(img.width * scale)), max(self.size, round(img.height * scale))
        img = img.resize((w, h), Image.BILINEAR)
        left, top = (w - self.size) // 2, (h - self.size) // 2
        img = img.crop((left, top, left + self.size, top + self.size))
        return _to_uint8_chw(img), int(self.labels[i]), bad


def _collate_eval(items):
    x, y, bad = zip(*items)
    return torch.stack(x), torch.tensor(y, dtype=torch.int64), [b for bs in bad for b in bs]


class FolderEvalLoader:
    kind = "torchvision"

    def __init__(self, source: FolderSource, batch_size, rank, world_size, image_size, device,
                 channels_last, dtype, num_workers, on_bad_file):
        check_policy(on_bad_file)
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) \
                or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        report_bad(source.bad_files, on_bad_file, "non-image or corrupt files")
        self.source, self.batch_size, self.image_size = source, batch_size, image_size
        self.device, self.channels_last, self.dtype = torch.device(device), channels_last, dtype
        self.num_workers, self.on_bad_file = num_workers, on_bad_file
        self.indices = np.arange(rank, len(source.files), world_size)

    num_images = property(lambda self: len(self.indices))
    in_channels = property(lambda self: 3)
    num_classes = property(lambda self: self.source.num_classes)

    def __len__(self):
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self):
        ds = torch.utils.data.Subset(_CenterCrops(self.source, self.image_size), self.indices.tolist())
        dl = torch.utils.data.DataLoader(ds, batch_size=self.batch_size, num_workers=self.num_workers,
                                         collate_fn=_collate_eval, pin_memory=self.device.type == "cuda")
        for x, y, bad in dl:
            if bad:
                report_bad([self.source.files[j] for j in bad], self.on_bad_file, "undecodable files")
            x = x.to(self.device, non_blocking=True).float().div_(255.0)
            yield (normalize(x, self.source.mean, self.source.std, self.dtype, self.channels_last),
                   y.to(self.device))
