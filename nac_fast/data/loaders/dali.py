"""NVIDIA DALI two-view loader for ImageFolders: "dali-gpu" (nvJPEG via device="mixed", all
augmentation on the GPU) and "dali-cpu" (device_id=None, CPU decoder and ops; CI, GPU-less hosts).

sources -> order -> augment -> LOADERS.  A batch: ShardedOrder gives every rank's dataset indices
for the rest of the epoch; fn.readers.file reads this rank's files, fn.decoders.image decodes
them, fn.external_source feeds augment.dali_param_batch's parameters for the same indices, and
augment.dali_views makes the two views in the graph.

Design (why):
  * fn.readers.file is sharded by the GLOBAL rank (shard_id=rank, num_shards=world_size); with
    local ranks, two nodes would read the same shard and the epoch lengths would disagree.  The
    file list is ours: each epoch's permutation (order.ShardedOrder), laid out so that the
    reader's contiguous shard r is exactly rank r's batches, starting at `start_batch`, and every
    batch checks that the reader delivered exactly this rank's indices.  The pipeline is rebuilt
    per epoch (a second or so before the first batch: bench/results/data_timings.md) instead of
    using DALI's buffered random_shuffle, whose order is not a permutation of the epoch and
    cannot be resumed mid-epoch.
  * Every random number comes from augment.view_params via fn.external_source — the very
    parameters the torchvision loader uses — so augmentations are a function of
    (seed, epoch, image index, view), independent of threads, prefetching and resumption.
  * Bad files (sources.imagefolder's policy): the scan keeps non-images out of the reader; a file
    that passes the scan but does not decode kills the pipeline.  The file is the one DALI's
    message names or, when it names none (some parser errors), the one of the batches in flight
    that PIL cannot decode either; when PIL decodes them all (a format DALI does not support,
    e.g. 1-bit or 32-bit integer TIFFs), the ones DALI fails on decoded one by one.  Under
    "warn" it is counted, replaced by the next decodable file (the torchvision loader's rule)
    and the pipeline rebuilt at the first batch not yet yielded; under "error" it stops the run
    with a ValueError naming it.
  * ILSVRC2012's quirks (scripts/make_ilsvrc_tree.py --quirks): greyscale, CMYK and PNG bytes
    named .JPEG decode to the RGB image load_rgb gives; an EXIF-rotated file is decoded upright
    and its shape read upright (adjust_orientation, said explicitly), as load_rgb does; a
    truncated file follows the bad-file rule above.  tests/test_data_dali.py checks each on the
    CPU decoder, file by file and through both loaders.
Not run on a GPU yet: the dali-gpu graph is the dali-cpu graph (tested) with the mixed decoder,
GPU ops, and the contrast by arithmetic (also tested on the CPU).
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from ..augment import DALI_PARAMS, Recipe, dali_param_batch, dali_views
from ..order import EpochLoaderMixin, ShardedOrder
from ..sources.imagefolder import BadFiles, FolderSource, load_rgb

_DECODE_ERROR = re.compile(r"Failed to decode sample #\d+ : ([^\n]+)")
_PREFETCH = 2                  # the pipeline's prefetch_queue_depth: batches decoded ahead


def _import_dali():
    try:
        from nvidia import dali
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    except ImportError as e:           # pragma: no cover - exercised only without DALI
        raise ValueError("loader='dali-*' needs NVIDIA DALI: pip install nvidia-dali-cuda130 "
                         "(nvidia-dali-cuda120 for CUDA 12 drivers)") from e
    return dali, DALIGenericIterator, LastBatchPolicy


def _build_pipeline(dali, files, labels, rank, world_size, batch_size, num_threads, device_id,
                    gpu, source_cb, seed, views):
    """Reader (this rank's shard of `files`) -> decoder -> views(images, hw, params)."""
    fn, types = dali.fn, dali.types

    @dali.pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                       seed=seed & 0x7FFFFFFF, prefetch_queue_depth=_PREFETCH,
                       enable_conditionals=True)
    def pipe():
        jpegs, index = fn.readers.file(files=files, labels=labels, shard_id=rank,
                                       num_shards=world_size, random_shuffle=False,
                                       pad_last_batch=False, name="Reader")
        # EXIF orientation applied to the shape (the crop windows' input) and to the pixels, as
        # load_rgb does (ImageOps.exif_transpose): said here, not left to DALI's defaults
        hw = fn.cast(fn.peek_image_shape(jpegs, adjust_orientation=True), dtype=types.FLOAT)
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                   adjust_orientation=True)
        params = fn.external_source(source=source_cb, num_outputs=2 * len(DALI_PARAMS), batch=True,
                                    batch_info=True)
        v1, v2 = views(images, hw, params)
        return v1, v2, index

    return pipe()


class DaliPretrainLoader(EpochLoaderMixin):
    """Two-view DALI loader (same contract as the other pretraining loaders)."""

    def __init__(self, source: FolderSource, batch_size, rank, world_size, seed, image_size,
                 recipe: Recipe, device, channels_last, dtype, num_workers, on_bad_file, gpu):
        self._bad = BadFiles(on_bad_file)
        self._dali, self._Iterator, self._Policy = _import_dali()
        self._bad.report(source.bad_files, "non-image or corrupt files")
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
    skipped_files = property(lambda self: tuple(self._bad.skipped))

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
                # truncated JPEG) kills the DALI pipeline.  Find it, report it (skip and count,
                # or stop), substitute the next decodable file (the torchvision loader's rule)
                # and rebuild the pipeline at the first batch not yet yielded.
                bad = self._undecodable(str(e), self.start_batch + done)
                why = "undecodable files"
                if not bad:
                    # PIL reads them all: a file DALI's decoder does not support (a 1-bit or
                    # 32-bit integer TIFF...), found by decoding the batches in flight one by one
                    bad = self._dali_rejects(self.start_batch + done)
                    why = ("files DALI cannot decode (PIL can: --loader torchvision reads "
                           "them)")
                if not bad:
                    raise
                self._bad.report([self.source.files[i] for i in bad], why)
                self._excluded.update(bad)

    def _undecodable(self, message, batch):
        """Indices of the not yet excluded files behind a pipeline error: the one DALI's message
        names, else (e.g. "nvImageCodec failure", "Invalid marker": no file named) those of the
        batches in flight, from `batch` on, that PIL cannot decode either."""
        m = _DECODE_ERROR.search(message)
        if m:
            i = self._file_index.get(m.group(1).strip())
            return [] if i is None or i in self._excluded else [i]
        rows = self.order.rank_indices(self.epoch, batch)[:_PREFETCH + 2]
        read = dict.fromkeys(self._substitute(i) for i in rows.ravel().tolist())
        bad = []
        for j in read:
            try:
                load_rgb(self.source.files[j])
            except Exception:          # PIL raises OSError, SyntaxError, ValueError... on bad data
                bad.append(j)
        return bad

    def _dali_rejects(self, batch):
        """Indices of the not yet excluded files of the batches in flight, from `batch` on, that
        DALI's decoder fails on, each decoded alone (one small synchronous pipeline per run of
        good files)."""
        rows = self.order.rank_indices(self.epoch, batch)[:_PREFETCH + 2]
        todo = list(dict.fromkeys(self._substitute(i) for i in rows.ravel().tolist()))
        dali, fn, types = self._dali, self._dali.fn, self._dali.types
        bad = []
        while todo:
            files = [self.source.files[j] for j in todo]

            @dali.pipeline_def(batch_size=1, num_threads=1, device_id=self.device_id,
                               exec_async=False, exec_pipelined=False, prefetch_queue_depth=1)
            def probe():
                data, _ = fn.readers.file(files=files, random_shuffle=False, name="Reader")
                return fn.decoders.image(data, device="mixed" if self.gpu else "cpu",
                                         output_type=types.RGB, adjust_orientation=True)

            pipe = probe()
            k = 0
            try:
                pipe.build()
                for k in range(len(files)):
                    pipe.run()
                todo = []
            except RuntimeError:
                bad.append(todo[k])
                todo = todo[k + 1:]
            finally:
                del pipe
        return bad

    def _substitute(self, i):
        """The index of the file read in place of dataset index i: i, or if i was excluded the
        next file that was not."""
        n = len(self.source.files)
        for k in range(n):
            if (i + k) % n not in self._excluded:
                return (i + k) % n
        raise ValueError(f"data: none of the {n} files could be decoded")

    def _run(self, start_batch):
        everyone = self.order.all_rank_indices(self.epoch, start_batch)   # (W, n, B)
        mine = everyone[self.rank]
        if len(mine) == 0:
            return
        flat = everyone.reshape(-1)            # reader shard r = rank r's remaining batches
        files = [self.source.files[self._substitute(i)] for i in flat]
        recipe, seed, epoch, size = self.recipe, self.seed, self.epoch, self.image_size

        def source_cb(info):
            k = info.iteration
            if k >= len(mine):
                raise StopIteration
            return (dali_param_batch(recipe, seed, epoch, mine[k], 0, size)
                    + dali_param_batch(recipe, seed, epoch, mine[k], 1, size))

        def views(images, hw, params):
            return dali_views(self._dali, images, hw, params, recipe, size, self.source.mean,
                              self.source.std, self._out_dtype, self.channels_last, self.gpu,
                              self._arithmetic_contrast)

        pipe = _build_pipeline(self._dali, files, flat.tolist(), self.rank, self.world_size,
                               self.batch_size, self.num_threads, self.device_id, self.gpu,
                               source_cb, hash((self.seed, self.epoch)), views)
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
