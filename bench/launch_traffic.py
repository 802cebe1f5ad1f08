"""Kernel launches and HBM bytes of one forward + backward of the Triton NAC loss, from its launch
plan, for an H100 (sm_90, 132 SMs), with no GPU.

    python bench/launch_traffic.py                      # in-batch 8192 x 128 and queue 8192 x 65536 x 128, bf16
    python bench/launch_traffic.py --n 4096 --dtype float16 --json

How: the real op runs on CPU tensors (the Triton backend under TRITON_INTERPRET=1) with the
Triton launches *recorded, not run* (nac_fast.kernels.nac_triton's `run` is replaced by a
recorder, its `target_of` returns sm_90) and every ATen op the op and its autograd glue run
recorded by a TorchDispatchMode (casts, copies, split sums, the reduction and its backward).  So
the count is that of the code as it is, whatever its plans do.  The values computed are
meaningless (the kernels do not run); only shapes and dtypes matter.

What is counted, per launch (a Triton kernel or an ATen op that runs a kernel: views,
allocations and metadata ops are not launches):
  hbm_bytes   every distinct tensor the launch is handed (or an ATen op reads or writes), counted
              once: the compulsory traffic, re-reads of an operand served from L2 (in-batch K/Q:
              2 MB, the 65536 x 128 bf16 queue: 16 MB, both under the H100's 50 MB L2).  A tensor
              a flag leaves unread is still counted (an over-estimate of a few KB: the dummy
              (0,)/(1,) buffers).
  l2_bytes    for the matrix kernels (fwd, bwd_keys): the streamed operand's bytes times the
              resident blocks that stream it (grid[0]): what the SMs pull through L2.
The split plans use each configuration's resident blocks per SM as the compile check measured
them (bench/results/compile_check.csv, column blocks_per_sm) when the plan asks for it.
Figures are recorded in bench/gpu_notes.md ("Launches and HBM bytes").
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors reach the Triton op's Python body

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# ATen ops that launch no kernel: views, allocations, metadata.
_NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
              "narrow", "as_strided", "detach", "alias", "empty", "empty_like", "empty_strided",
              "new_empty", "new_empty_strided", "unsqueeze", "squeeze", "reshape", "_to_copy_noop",
              "lift_fresh", "is_same_size", "_reshape_alias", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "_local_scalar_dense", "set_", "resize_",
              "split", "unbind", "clone_noop", "_has_compatible_shallow_copy_type"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _distinct_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key not in seen:
            seen.add(key)
            total += _nbytes(t)
    return total


class Recorder(TorchDispatchMode):
    """Records the ATen ops that launch a kernel, with the bytes they touch."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        # custom ops (the Triton ops themselves) are containers: their launches are recorded
        if func.namespace == "aten" and name not in _NO_KERNEL:
            ins = list(_tensors(args)) + list(_tensors(kwargs))
            self.log.append(dict(kind="aten", tag=f"aten.{name}", grid="",
                                 hbm_bytes=_distinct_bytes(ins + list(_tensors(out))),
                                 l2_bytes=0))
        return out


def occupancy_table(path: str):
    """(kernel tag, arch, dtype, D, blocks, warps, stages) -> blocks_per_sm of the Triton rows of
    the compile check's CSV, or {} when it has no such column (an older CSV).  Rows the key does
    not tell apart (the forward with and without the rows' gradient) give their smaller figure:
    the heavier variant, the one a training step runs."""
    table = {}
    if not os.path.exists(path):
        return table
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("blocks_per_sm") and not r["kernel"].startswith("cuda:"):
                key = (r["kernel"], int(r["arch"]), r["dtype"], str(r["D"]), r["blocks"],
                       int(r["warps"]), int(r["stages"]))
                table[key] = min(table.get(key, 1 << 30), int(r["blocks_per_sm"]))
    return table


def _launch_tensors(L):
    """The tensors a launch reads or writes.  One rule for an argument a flag leaves untouched:
    the prologue of a plan with given keys (an older tree passed the keys themselves as its K
    output, which it does not write when write_k = 0)."""
    ts = [a for a in L.args]
    if L.tag == "prologue" and len(ts) == 10 and ts[9] == 0:
        ts[3] = None
    return [t for t in ts if isinstance(t, torch.Tensor)]


def _matrix_l2_bytes(L) -> int:
    """Streamed-operand bytes through L2 of a matrix launch: K (fwd) or Q (bwd_keys) once per
    resident block."""
    if L.tag == "fwd":
        streamed = L.args[1]   # K
    elif L.tag.startswith("bwd_keys"):
        streamed = L.args[0]   # Q
    else:
        return 0
    return _nbytes(streamed) * L.grid[0]


def measure(kind: str, n: int, N: int, D: int, dtype: torch.dtype, csv_path: str):
    import nac_fast
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton
    from nac_fast.ops import loss as loss_mod

    table = occupancy_table(csv_path)
    dname = str(dtype).replace("torch.", "")

    def occupancy(L):
        c = L.constexprs
        blocks = "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D") if k in c)
        key = (L.tag, 90, dname, str(D), blocks, L.num_warps, L.num_stages)
        if key not in table:
            raise KeyError(f"{key} is not in {csv_path}: run bench/compile_check.py --csv first")
        return table[key]

    if "occupancy" in getattr(KL.Target, "__dataclass_fields__", {}):
        import dataclasses
        target = dataclasses.replace(KL.SM90, occupancy=occupancy if table else None)
    else:  # the plan of an older tree (Target.programs = 2 x SMs)
        target = KL.SM90
    log: list = []

    def record(launches):
        for L in launches:
            if all(g > 0 for g in L.grid):
                log.append(dict(kind="triton", tag=L.tag, grid="x".join(map(str, L.grid)),
                                hbm_bytes=_distinct_bytes(_launch_tensors(L)),
                                l2_bytes=_matrix_l2_bytes(L)))

    saved = nac_triton.run, nac_triton.target_of
    nac_triton.run = record
    nac_triton.target_of = lambda device: target
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, D, generator=g).to(dtype).requires_grad_()
        # NAC-MQ's r_hat is the momentum network's: no gradient (in-batch r: one)
        r = torch.randn(n, D, generator=g).to(dtype).requires_grad_(kind != "queue")
        noise = torch.ones(n, D, dtype=dtype)
        queue = torch.randn(N, D, generator=g).to(dtype) if kind == "queue" else None
        with loss_mod.value_checks(False):
            with Recorder(log):
                if kind == "queue":
                    out = nac_fast.nac_mq_loss(a, r, queue, 0.1, noise=noise, backend="triton")
                else:
                    out = nac_fast.nac_loss(a, r, 0.1, noise=noise, backend="triton")
                fwd_count = len(log)
                out.backward()
    finally:
        nac_triton.run, nac_triton.target_of = saved
    for i, e in enumerate(log):
        e["pass"] = "fwd" if i < fwd_count else "bwd"
    return log


def summarise(log):
    out = {}
    for p in ("fwd", "bwd"):
        rows = [e for e in log if e["pass"] == p]
        out[p] = dict(launches=len(rows), triton=sum(e["kind"] == "triton" for e in rows),
                      aten=sum(e["kind"] == "aten" for e in rows),
                      hbm_bytes=sum(e["hbm_bytes"] for e in rows),
                      l2_bytes=sum(e["l2_bytes"] for e in rows))
    out["total"] = {k: out["fwd"][k] + out["bwd"][k] for k in out["fwd"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--queue", type=int, default=65536, help="queue size M of the queue case")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--csv", default=os.path.join(ROOT, "bench", "results", "compile_check.csv"),
                    help="the compile check's CSV (blocks_per_sm per configuration)")
    ap.add_argument("--json", action="store_true", help="also print the launches as JSON")
    args = ap.parse_args(argv)
    for flag in ("--n", "--queue", "--D"):
        if getattr(args, flag[2:]) < 1:
            ap.error(f"{flag} must be >= 1, got {getattr(args, flag[2:])}")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        ap.error(f"--dtype: {args.dtype!r} is not a floating-point torch dtype")
    result = {}
    for kind, N in (("inbatch", args.n), ("queue", args.queue)):
        log = measure(kind, args.n, N, args.D, dtype, args.csv)
        s = summarise(log)
        result[kind] = dict(log=log, summary=s)
        print(f"\n{kind}: n={args.n} N={N} D={args.D} {args.dtype}, sm_90 (132 SMs)")
        print(f"  {'pass':4s} {'launch':22s} {'grid':>10s} {'HBM MB':>9s} {'L2 MB':>9s}")
        for e in log:
            print(f"  {e['pass']:4s} {e['tag']:22s} {e['grid']:>10s} {e['hbm_bytes'] / 1e6:9.3f} "
                  f"{e['l2_bytes'] / 1e6:9.1f}")
        for p in ("fwd", "bwd", "total"):
            x = s[p]
            print(f"  {p:5s}: {x['launches']} launches ({x['triton']} Triton, {x['aten']} ATen), "
                  f"HBM {x['hbm_bytes'] / 1e6:.2f} MB, L2 streamed {x['l2_bytes'] / 1e6:.1f} MB")
    if args.json:
        print(json.dumps({k: v["summary"] for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
