"""The pieces of feature extraction that python -m nac_fast.eval (cli.py) builds on: the network
it runs (batch norm folded into the convolutions, channels-last), the loader workers it starts by
default, and, under torchrun, each rank's shard of a split and the gather of the shards' features
to rank 0 in the split's order.

Why these choices (bench/results/eval_extract_cpu.md has the figures, on the 2-core development
machine, resnet-tiny on Fashion-MNIST): the loader is not the cost there (the in-memory loader
gives ~400,000 images/s), the convolutions are (83% of the time; batch norm 12%).  Folding each
BatchNorm2d into the convolution before it removes the norm's passes; channels-last lets oneDNN
run the convolutions without reordering activations; and on the CPU the network sees at most
CPU_MICRO_BATCH images at a time, whose activations stay in cache (a 256-image batch of 16 x 28 x
28 activations is 12.8 MB).  Together 1.65x the images/s of the eager network on whole
batches (1.56x per CPU-second; old and new interleaved in one run, bench/eval_extract.py),
features equal to 4.8e-7 (float32 rounding of the folded weights).
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data.augment import one_cpu_thread
from .features import FeatureBuffer, FeatureRangeError

# Images the CPU network sees at a time (a loader batch is split into chunks of this size).
CPU_MICRO_BATCH = 64
# At most this many bytes per rank and collective when the features are gathered (NCCL gathers
# on the GPU: the rank-0 side holds world_size times this).
GATHER_CHUNK_BYTES = 1 << 26
# The default of --workers: one loader worker per CPU core of this process's share of the node,
# at most this many.
MAX_DEFAULT_WORKERS = 8
# How the probe's and kNN's features h are stored (features.FeatureBuffer): 16 bits, half of
# float32's memory (1.28M x 2048: 5.2 GB instead of 10.5 GB).  The head's pre-activations a stay
# float32: a tiny negative a rounds to -0 in float16, whose sign bit the code rule would read as
# a +1 ([M:code]: sgn(a) with 0 -> +1), and a is small (code_dim wide).
H_DTYPE = torch.float16


def default_workers() -> int:
    """--workers when not given: the CPU cores this process may run on (its affinity mask),
    divided by the processes torchrun started on this node (LOCAL_WORLD_SIZE, 1 outside
    torchrun), at most MAX_DEFAULT_WORKERS; 0 (decode in the main process) when the node has fewer
    cores than processes."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS): all the cores
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local = 1
    return min(MAX_DEFAULT_WORKERS, cores // local)


def fold_batch_norm(module: nn.Module) -> nn.Module:
    """A copy of `module` (eval mode) in which every BatchNorm2d that follows a Conv2d whose
    output nothing else reads is folded into that convolution (torch.nn.utils.fusion
    .fuse_conv_bn_eval: the same function up to float32 rounding), traced with torch.fx.  A
    module with no such pair comes back as an equal copy."""
    import torch.fx as fx
    from torch.nn.utils.fusion import fuse_conv_bn_eval
    gm = fx.symbolic_trace(copy.deepcopy(module).eval())
    mods = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(mods.get(node.target), nn.BatchNorm2d):
            continue
        prev = node.args[0] if node.args else None
        if not (isinstance(prev, fx.Node) and prev.op == "call_module" and len(prev.users) == 1
                and isinstance(mods.get(prev.target), nn.Conv2d)):
            continue
        bn = mods[node.target]
        if not bn.track_running_stats or bn.running_mean is None:
            continue  # batch statistics even in eval mode: nothing to fold
        fused = fuse_conv_bn_eval(mods[prev.target], bn)
        parent, _, name = prev.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, fused)
        mods[prev.target] = fused
        node.replace_all_uses_with(prev)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


class _Folded(nn.Module):
    """model.encode with the encoder folded (fold_batch_norm, channels-last) and, on the CPU,
    the head on one thread: the head's matrix products (MKL) round differently with another
    thread count (3.7e-8 in a, resnet-tiny), and one thread makes the features independent of
    it (the convolutions' are: oneDNN splits their outputs over the threads, not their sums), so
    the ranks of a torchrun job (one thread each by default) give what one process gives.  The
    head is a few small matrix products, ~1% of the network's time."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.net = copy.deepcopy(model).eval()
        self.net.encoder = fold_batch_norm(self.net.encoder)
        self.net.to(memory_format=torch.channels_last)

    def encode(self, x):
        h = self.net.encoder(x)
        with one_cpu_thread(h.device):
            return h, self.net._codes(h)


def extraction_network(model: nn.Module, eager: bool = False) -> nn.Module:
    """The network feature extraction runs: with `eager`, `model` itself (as trained, NCHW);
    else a copy (_Folded) whose encoder has its batch norms folded into its convolutions
    (fold_batch_norm), in channels-last memory format, whose head runs on one CPU thread.  Its
    encode(x) gives (h, a) as model.encode does."""
    return model if eager else _Folded(model)


def shard_bounds(n: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi): the images of a split of `n` (in the order one process extracts them) that rank
    `rank` of `world_size` extracts: a contiguous run of whole batches of `batch_size` (rank r:
    batches ceil(r B / W) .. ceil((r + 1) B / W) - 1 of the B = ceil(n / batch_size)), so every
    batch the network sees is one that a single process would have seen (identical features,
    not just close), and the ranks' shards, concatenated in rank order, are the split.  Rank 0's
    shard is a largest one (its progress bar is the job's); a rank can get none (fewer batches
    than ranks)."""
    batches = -(-n // batch_size)
    lo = -(-rank * batches // world_size) * batch_size
    hi = -(-(rank + 1) * batches // world_size) * batch_size
    return min(lo, n), min(hi, n)


def gather_rows(t: torch.Tensor | None, counts: list[int], width: tuple, dtype: torch.dtype,
                device: torch.device, put=None) -> torch.Tensor | None:
    """Every rank's rows concatenated in rank order, on rank 0 (on the CPU), None on the others.
    `t`: this rank's (counts[rank], *width) rows (None when it has none); `counts`: every rank's
    row count.  Sent in chunks of at most GATHER_CHUNK_BYTES per rank (padded to the longest
    shard) through `device`: the CPU under gloo, the rank's GPU under NCCL.  With `put`, rank 0
    allocates nothing: its own rows are already where they belong (e.g. extracted into
    SplitFeatures of the whole split), and every other rank's chunk goes to put(start, rows)
    as it arrives (rows: its position in the split, so no list of chunks is concatenated);
    then None is returned on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    row_bytes = max(1, torch.empty((), dtype=dtype).element_size() * int(torch.Size(width).numel()))
    chunk = max(1, GATHER_CHUNK_BYTES // row_bytes)
    starts = [sum(counts[:r]) for r in range(world)]
    out = torch.empty((sum(counts), *width), dtype=dtype) if rank == 0 and put is None else None
    for s in range(0, max(counts), chunk):
        e = min(s + chunk, max(counts))
        buf = torch.zeros((e - s, *width), dtype=dtype, device=device)
        mine = min(e, counts[rank]) - s
        if mine > 0:
            buf[:mine] = t[s:s + mine].to(device)
        parts = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
        dist.gather(buf, parts, dst=0)
        if rank == 0:
            for r, part in enumerate(parts):
                k = min(e, counts[r]) - s
                if k > 0 and put is None:
                    out[starts[r] + s:starts[r] + s + k] = part[:k].cpu()
                elif k > 0 and r != 0:
                    put(starts[r] + s, part[:k].cpu())
    return out


class SplitFeatures:
    """A split's features as extraction fills them, each allocated once at the split's `rows`
    (no list of batches concatenated at the end, so no second copy): h in a
    features.FeatureBuffer of H_DTYPE (a finite value beyond its range is a FeatureRangeError
    naming the row; NaN and inf are kept for the CLI's check that names the checkpoint), a in
    float32, the labels in int64.  h and a are allocated when the first batch gives their widths.
    :meth:`write` stores the next rows, :meth:`put` the rows [start, start + m) (a rank's
    gathered share); :meth:`commit` gives {"h", "a", "labels"}, every row written."""

    def __init__(self, rows: int, name: str):
        self.rows, self.name, self.filled = int(rows), name, 0
        self.h = self.a = None
        self.labels = torch.empty(self.rows, dtype=torch.int64)

    def _alloc(self, h_dim: int, a_dim: int) -> None:
        with torch.inference_mode(False):  # normal tensors: the gather writes them afterwards
            self._alloc_now(h_dim, a_dim)

    def _alloc_now(self, h_dim: int, a_dim: int) -> None:
        self.h = FeatureBuffer(self.rows, h_dim, H_DTYPE, name=f"{self.name}: h",
                               nonfinite="keep")
        self.a = torch.empty(self.rows, a_dim, dtype=torch.float32)

    def put(self, start: int, key: str, values: torch.Tensor) -> None:
        """Store `values` (any device) as the rows [start, start + m) of `key` ("h", "a" or
        "labels"); h and a once :meth:`write` has allocated them."""
        if key == "labels":
            self.labels[start:start + values.shape[0]].copy_(values)
        elif self.h is None:
            raise ValueError(f"{self.name}: {key} is put before any row was written")
        elif key == "h":
            self.h.write(values, rows=torch.arange(start, start + values.shape[0]))
        else:
            self.a[start:start + values.shape[0]].copy_(values)

    def write(self, h, a) -> None:
        """Store h and a as the next rows (the first call allocates them)."""
        if self.h is None:
            self._alloc(h.shape[1], a.shape[1])
        self.h.write(h)
        self.a[self.filled:self.filled + a.shape[0]].copy_(a)
        self.filled += h.shape[0]

    def commit(self) -> dict:
        if self.h is None:
            raise ValueError(f"{self.name}: no row was extracted")
        return {"h": self.h.commit(), "a": self.a, "labels": self.labels}
