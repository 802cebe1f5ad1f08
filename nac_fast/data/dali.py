"""NVIDIA DALI two-view pipeline for ImageFolders: "dali-gpu" (nvJPEG via device="mixed", all
augmentation on the GPU) and "dali-cpu" (device_id=None, CPU decoder and ops; CI, GPU-less hosts).

Design (why):
  * fn.readers.file is sharded by the GLOBAL rank (shard_id=rank, num_shards=world_size); with
    local ranks, two nodes would read the same shard and the epoch lengths would disagree.  The
    file list is ours: each epoch's permutation (sampling.ShardedOrder), laid out so that the
    reader's contiguous shard r is exactly rank r's batches, starting at `start_batch`.  The
    pipeline is rebuilt per epoch (first batch after 0.9 s for 640 files, 1.4 s for 200k,
    dali-cpu here; ImageNet's 1.28M adds seconds to a multi-minute epoch) instead of using DALI's
    buffered random_shuffle, whose order is not a permutation of the epoch and cannot be resumed
    mid-epoch.
  * Every random number comes from augment.view_params via fn.external_source — the very
    parameters the torchvision loader uses — so augmentations are a function of
    (seed, epoch, image index, view), independent of threads, prefetching and resumption.  The
    crop window (torchvision's 10-attempt RandomResizedCrop) is evaluated inside the graph from
    fn.peek_image_shape, because the image size is only known there.
  * Decode once (nvJPEG with device="mixed"), then two branches: resize with a float ROI
    (flip = reversed x ROI), brightness and contrast about the view's grayscale mean
    (torchvision's contrast), hue and saturation in one fn.hsv, grayscale as a second
    (saturation 0 = luma, exact in DALI's YIQ colour model), Gaussian blur (imagenet recipe), and
    normalise to NHWC float16/float32 (channels-last: what the model eats without a transpose).
Deviation from the torchvision loader: DALI's hue rotates in the YIQ linear model, torchvision
shifts HSV hue exactly; over the full recipe the views differ by 0.10-0.19 (mean |diff|,
normalised units, at 224-48 px) against ~0.007 with hue off, where the two loaders agree to ~1
uint8 level (tested).
Not run on a GPU yet: the dali-gpu graph is the dali-cpu graph (tested) with the mixed decoder,
GPU ops, and the contrast by arithmetic (also tested on the CPU).
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from .augment import CROP_ATTEMPTS, Recipe, view_params
from .folder import FolderSource, check_policy, report_bad
from .sampling import EpochLoaderMixin, ShardedOrder

_DECODE_ERROR = re.compile(r"Failed to decode sample #\d+ : ([^\n]+)")


def _import_dali():
    try:
        from nvidia import dali
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as e:           # pragma: no cover - exercised only without DALI
        raise ValueError("loader='dali-*' needs NVIDIA DALI: pip install nvidia-dali-cuda130 "
                         "(nvidia-dali-cuda120 for CUDA 12 drivers)") from e
    return dali, DALIGenericIterator, LastBatchPolicy


_PARAMS = ("area", "ratio", "ux", "uy", "flip", "brightness", "contrast", "saturation", "hue",
           "jitter", "gray", "sigma", "window")


def _param_batch(recipe, seed, epoch, idx, view, size):
    """External-source arrays for one view of one batch: for each name in _PARAMS, a list of one
    numpy array per sample (float32; the flags bool, the blur window int32)."""
    p = view_params(recipe, seed, epoch, idx, view)
    p["jitter"] = ((p["brightness"] != 1) | (p["contrast"] != 1) | (p["saturation"] != 1)
                   | (p["hue"] != 0))
    p["hue"] = p["hue"] * np.float32(360.0)                 # DALI takes degrees
    p["flip"] = p["flip"].astype(np.float32)
    p["window"] = np.minimum(2 * np.ceil(3 * p["sigma"]) + 1,
                             recipe.blur_kernel(size)).astype(np.int32)
    return [[np.ascontiguousarray(p[k][i]).reshape(np.shape(p[k][i]) or (1,))
             for i in range(len(idx))] for k in _PARAMS]


def _build_pipeline(dali, files, labels, rank, world_size, batch_size, num_threads, device_id,
                    gpu, size, recipe, mean, std, out_dtype, nhwc, source_cb, seed,
                    arithmetic_contrast):
    fn, types, dmath = dali.fn, dali.types, dali.math
    rmin, rmax = (float(v) for v in recipe.ratio)
    order = np.arange(CROP_ATTEMPTS, 0, -1, dtype=np.float32)    # attempt k scores K - k

    def on_dev(x):            # a per-sample CPU scalar as an operand of GPU image arithmetic
        return x.gpu() if gpu else x

    @dali.pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                       seed=seed & 0x7FFFFFFF, prefetch_queue_depth=2,
                       enable_conditionals=True)
    def pipe():
        jpegs, index = fn.readers.file(files=files, labels=labels, shard_id=rank,
                                       num_shards=world_size, random_shuffle=False,
                                       pad_last_batch=False, name="Reader")
        hw = fn.cast(fn.peek_image_shape(jpegs), dtype=types.FLOAT)
        H, W = hw[0], hw[1]
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        outs = []
        n = len(_PARAMS)
        params = fn.external_source(source=source_cb, num_outputs=2 * n, batch=True, batch_info=True)
        for view in (0, 1):
            (area, ratio, ux, uy, flip, bright, contr, sat, hue, jitter, gray, sigma,
             window) = params[n * view:n * view + n]
            blur = sigma > 0
            # torchvision RandomResizedCrop: first fitting attempt, else clamped whole image
            a = H * W * area
            w = dmath.sqrt(a * ratio)
            h = dmath.sqrt(a / ratio)
            valid = (w <= W) & (h <= H)
            score = valid * types.Constant(order)
            best = fn.reductions.max(score)
            first = (score == best) & valid
            anyv = best > 0
            wc = anyv * fn.reductions.sum(w * first) + (1 - anyv) * dmath.min(W, H * rmax)
            hc = anyv * fn.reductions.sum(h * first) + (1 - anyv) * dmath.min(H, W / rmin)
            y0 = uy[0] * (H - hc)
            x0 = ux[0] * (W - wc)
            f = flip[0]
            roi_start = fn.stack(y0, x0 + f * wc)
            roi_end = fn.stack(y0 + hc, x0 + (1 - f) * wc)
            v = fn.resize(images, size=[size, size], roi_start=roi_start, roi_end=roi_end,
                          interp_type=types.INTERP_LINEAR, antialias=True)
            # Conditionals (per-sample `if`): the 20% of views without jitter, the 80% without
            # grayscale and the 50% without blur skip those ops; fn.hsv is the costliest CPU op
            # here (two hsv passes took dali-cpu from 346 to 176 images/s in isolation).
            if jitter[0]:
                # torchvision: brightness, clamp, then contrast toward the grayscale mean of the
                # brightened view (that clamp matters for bright images: without it the p99
                # difference to torchvision was 0.25 normalised units, with it ~1 uint8 level)
                v = fn.brightness_contrast(v, brightness=bright[0])
                m = fn.reductions.mean(fn.cast(v, dtype=types.FLOAT), axes=[0, 1])
                gray_mean = 0.299 * m[0] + 0.587 * m[1] + 0.114 * m[2]
                if arithmetic_contrast:
                    # on the GPU the mean is a GPU value, and argument inputs (contrast_center)
                    # must live on the CPU: blend by arithmetic there
                    c = on_dev(contr[0])
                    v = fn.cast(dmath.clamp(c * v + (1.0 - c) * gray_mean, 0.0, 255.0),
                                dtype=types.UINT8)          # cast rounds to nearest
                else:   # ~2 ms/image less CPU than the arithmetic (10.5 vs 8.3 ms, measured here)
                    v = fn.brightness_contrast(v, contrast=contr[0], contrast_center=gray_mean)
                v = fn.hsv(v, hue=hue[0], saturation=sat[0])
            if gray[0]:
                # its own op, after the jitter's clamp to [0, 255] as in torchvision (folding it
                # into the jitter's saturation left 0.12 p99 differences); saturation 0 = luma
                v = fn.hsv(v, saturation=0.0)
            if blur[0]:
                # window min(torchvision's ~10% kernel, 2*ceil(3 sigma)+1): 3..13 taps at 224 px
                # instead of 23; the dropped taps weigh < 0.3%
                v = fn.gaussian_blur(v, sigma=sigma[0], window_size=window[0])
            v = fn.crop_mirror_normalize(
                v, dtype=out_dtype, output_layout="HWC" if nhwc else "CHW",
                mean=[255.0 * x for x in mean], std=[255.0 * x for x in std])
            outs.append(v)
        return outs[0], outs[1], index

    return pipe()


class DaliPretrainLoader(EpochLoaderMixin):
    """Two-view DALI loader (same contract as the other pretraining loaders)."""

    def __init__(self, source: FolderSource, batch_size, rank, world_size, seed, image_size,
                 recipe: Recipe, device, channels_last, dtype, num_workers, on_bad_file, gpu):
        check_policy(on_bad_file)
        self._dali, self._Iterator, self._Policy = _import_dali()
        report_bad(source.bad_files, on_bad_file, "non-image or corrupt files")
        self.kind = "dali-gpu" if gpu else "dali-cpu"
        self.source, self.gpu = source, gpu
        self.order = ShardedOrder(len(source.files), batch_size, rank, world_size, seed)
        self.batch_size, self.seed, self.recipe, self.image_size = batch_size, seed, recipe, image_size
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if gpu:
            if self.device.type != "cuda":
                raise ValueError(f"loader='dali-gpu' needs device='cuda[:local_rank]', got device={device!r}")
            idx = self.device.index
            self.device_id = idx if idx is not None else torch.cuda.current_device()
        else:
            self.device_id = None
        self.channels_last, self.dtype = channels_last, dtype
        # DALI emits float16 natively; bfloat16 is not a DALI type, so it costs one cast here
        self._out_dtype = self._dali.types.FLOAT16 if dtype == torch.float16 else self._dali.types.FLOAT
        self.num_threads = num_workers if num_workers > 0 else max(1, len(os.sched_getaffinity(0)))
        self.on_bad_file = on_bad_file
        self._arithmetic_contrast = gpu      # the GPU graph's contrast; tests force it on the CPU
        self._file_index = {f: i for i, f in enumerate(source.files)}
        self._excluded: set = set()

    num_images = property(lambda self: len(self.source.files))
    in_channels = property(lambda self: 3)
    num_classes = property(lambda self: self.source.num_classes)

    def __iter__(self):
        done = 0                                  # batches of this iteration already yielded
        while True:
            try:
                for views in self._run(self.start_batch + done):
                    yield views
                    done += 1
                return
            except RuntimeError as e:
                # A file whose header passed the scan but whose data does not decode (e.g. a
                # truncated JPEG) kills the DALI pipeline; DALI's message names it.  Report it
                # once, substitute the next image (as the torchvision loader does) and rebuild
                # the pipeline at the first batch not yet yielded.
                m = _DECODE_ERROR.search(str(e))
                bad = self._file_index.get(m.group(1).strip()) if m else None
                if bad is None or bad in self._excluded:
                    raise
                report_bad([self.source.files[bad]], self.on_bad_file, "undecodable files")
                self._excluded.add(bad)

    def _substitute(self, i):
        n = len(self.source.files)
        for k in range(n):
            if (i + k) % n not in self._excluded:
                return self.source.files[(i + k) % n]
        raise ValueError(f"data: none of the {n} files could be decoded")

    def _run(self, start_batch):
        everyone = self.order.all_rank_indices(self.epoch, start_batch)   # (W, n, B)
        mine = everyone[self.rank]
        if len(mine) == 0:
            return
        flat = everyone.reshape(-1)            # reader shard r = rank r's remaining batches
        files = [self._substitute(i) if i in self._excluded else self.source.files[i] for i in flat]
        recipe, seed, epoch, size = self.recipe, self.seed, self.epoch, self.image_size

        def source_cb(info):
            k = info.iteration
            if k >= len(mine):
                raise StopIteration
            return (_param_batch(recipe, seed, epoch, mine[k], 0, size)
                    + _param_batch(recipe, seed, epoch, mine[k], 1, size))

        pipe = _build_pipeline(self._dali, files, flat.tolist(), self.rank, self.world_size,
                               self.batch_size, self.num_threads, self.device_id, self.gpu,
                               self.image_size, self.recipe, self.source.mean, self.source.std,
                               self._out_dtype, self.channels_last, source_cb,
                               hash((self.seed, self.epoch)), self._arithmetic_contrast)
        pipe.build()
        it = self._Iterator(pipe, ["v1", "v2", "index"], reader_name="Reader",
                            last_batch_policy=self._Policy.DROP, auto_reset=False)
        try:
            for k, out in enumerate(it):
                d = out[0]
                got = d["index"].view(-1).cpu().numpy()
                if not np.array_equal(got, mine[k]):     # the reader and the params must agree
                    raise AssertionError(f"DALI reader order diverged at batch {k}")
                yield tuple(self._finish(d[v]) for v in ("v1", "v2"))
        finally:
            del it, pipe

    def _finish(self, x):
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)     # NHWC storage = channels_last (B,C,H,W): no copy
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if x.device != self.device:
            x = x.to(self.device)
        return x
