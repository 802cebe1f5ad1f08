"""Compile-only GPU check, run on a CPU: every Triton kernel configuration the launchers can
choose, compiled for sm_80 and sm_90, with its shared memory, registers, spills and tensor-core
instructions; plus the CUDA kernels' resource usage (nvcc).

    python tools/compile_check.py --csv bench/results/compile_check.csv     # the full table
    python tools/compile_check.py --reuse bench/results/compile_check.csv --verify 64 --csv X.csv
                                                                   # what CI runs (minutes)
    python tools/compile_check.py --archs 90 --dtypes bfloat16 --D 128       # one slice
    python tools/compile_check.py --check-keys bench/results/compile_check.csv  # current? (s)

The Triton part builds each op's launch plan (kernels/launch.py) from meta tensors for each
target, exactly as the op builds it for real tensors on that GPU, so the check covers the
configurations the launchers pick and nothing else: the built-in tables (nac_triton.CONFIGS) and
every autotune candidate (nac_triton.CANDIDATES, on the archs it applies to: the configurations a
tuned table, kernels/tuning.py, may name), forced into the same plans; the CSV's `source` column
says which (built-in, candidate or both).  The matrix kernels are planned with each row's own key
left out too (self_key "exclude", docs/math.md [M:self-key], the kernels' constexpr SELF): column
`modes` says `inbatch-self` / `queue-self` for those launches (built-in tables with
nac_triton.SELF_CONFIGS in place: they read no tuned table, so no candidate runs with SELF).  Each distinct launch (kernel,
specialised signature, constexprs, warps, stages, arch) is compiled once with ``triton.compile`` in a pool of
processes; the ``ptxas -v`` that Triton runs to build the cubin (its log, so that Triton
version's own flags) reports registers and spills, Triton's
metadata the shared memory, and ``cuobjdump -sass`` the matrix instructions (HGMMA/HMMA).

Each row carries its launch's `key` (`launch_key`): the sha256 of what decides the compiled code
-- the kernel's source text and that of everything it calls, with the values of the globals they
read, but no line number, comment or blank line (`source_digest`, `code_text`; Triton's own cache
key holds the starting line, so an edit that only moves a kernel changed it), the specialised signature, constexprs, warps, stages,
the arch, the Triton version and its compile-changing environment -- and of this file's measuring
code.  ``--reuse CSV`` takes the compiled figures (registers, spills,
shared memory, MMA count, compile seconds) of every launch whose key is in CSV instead of
compiling it again, as Triton's cache would; everything derived
from a plan (limits, occupancy, problems) is computed afresh.  ``--verify N`` compiles N of the
reused launches anyway (one of every kernel and arch, the rest drawn at random; the seed is
printed) and reports a problem where a fresh figure differs from the reused one.  Column
`checked` says which (compiled, reused, verified).  ``--check-keys CSV`` compiles nothing: it
lists the launches whose key is not in CSV (seconds; exit 1 if any).  CI reuses the committed
table, so a change
to a kernel recompiles that kernel's launches and nothing else.

It fails (exit 1, a line per problem) when
  - a kernel's shared memory exceeds the arch's opt-in limit (sm_80 163 KB, sm_90 227 KB);
  - a bf16/fp16, tf32-family (tf32, tf32x3), bf16x6 or fp16x3 (fp32 in 16-bit parts)
    configuration spills registers, except a kernel with a row-wise tail folded in (column
    `folded`: the forward with its finish, the keys' backward's OUT_MODE 3), which a plan on a
    GPU does not launch where it spills (kernels/launch.py `Target.clean`: it runs the tail as
    a launch of its own, the unfolded plans this check also compiles); column `note` says so;
  - those paths' matrix kernels (fwd, bwd_keys) have no tensor-core instruction;
  - the Hamming top-k's int8 filter (hamming_topk_mma) has no integer tensor-core instruction
    (IMMA, IGMMA: counted by `_compile_int_mma`) or spills;
  - one kernel takes more than --max-compile-s (20 s) to compile;
  - a CUDA kernel of a 16-bit path spills, any CUDA kernel's shared memory exceeds the limit, or
    a bf16/fp16 CUDA matrix kernel has no HMMA/HGMMA (tools/cuda_resources.py's problems()).
``--fail-on DTYPES`` fails on those dtypes' problems only and counts the others'; the last line
is the verdict (``--verdict-out FILE`` writes it there too: the GPU suite's test stage).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DTYPES = ("bfloat16", "float16", "float32", "float64")
DS = (16, 64, 128, 256, 512)
MODES = ("inbatch", "queue")
FP32_MODES = ("tf32x3", "tf32", "ieee", "bf16x6", "fp16x3")  # NAC_FAST_FP32_DOT: default first
FIELDS = ["kernel", "arch", "dtype", "D", "modes", "precision", "blocks", "warps", "stages",
          "smem_bytes", "smem_estimate", "smem_limit", "registers", "spill_store_bytes",
          "spill_load_bytes", "mma_instr", "mma_count", "blocks_per_sm", "compile_s", "problems",
          "source", "folded", "note", "key", "checked"]
# the compiled figures a reused row supplies (--reuse), and --verify compares (not compile_s)
COMPILED = ("registers", "spill_store_bytes", "spill_load_bytes", "smem_bytes", "mma_instr",
            "mma_count", "compile_s")
# The matrix kernels' launch tags: the forward, and the keys' backward in its four output modes
# (fp32 split shares; one split: the keys' gradient, or the rows' backward fused in; several
# splits with the rows' backward folded in).
MATRIX_KERNELS = ("fwd", "bwd_keys", "bwd_keys_out1", "bwd_keys_out2", "bwd_keys_out3")


def config_kernel(tag: str) -> str:
    """The CONFIGS kernel of a launch tag (the keys' backward's modes share one table)."""
    return "bwd_keys" if tag.startswith("bwd_keys") else tag


def _triton_bin(tool: str) -> str:
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise RuntimeError(f"{tool} not found in Triton's wheel ({path})")
    return path


def _signature(launch):
    """The specialised signature, constexprs and divisibility attributes of a launch, as
    Triton's JIT derives them from the arguments (kernels are launched with 16-byte aligned
    tensors: fresh allocations or rows of contiguous ones)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import MockTensor, native_specialize_impl
    import torch

    fn = launch.kernel
    sig, consts, attrs = {}, dict(launch.constexprs), {}
    runtime = [p for p in fn.params if not p.is_constexpr]
    if len(runtime) != len(launch.args):
        raise RuntimeError(f"{fn.__name__}: {len(launch.args)} arguments for {len(runtime)} "
                           "runtime parameters")
    for p, arg in zip(runtime, launch.args):
        if isinstance(arg, torch.Tensor):
            arg = MockTensor(arg.dtype)
        ty, key = native_specialize_impl(BaseBackend, arg, False, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            consts[p.name] = key
        else:
            sig[p.name] = ty
            if key == "D":
                attrs[(p.num,)] = [["tt.divisibility", 16]]
    for name in consts:
        sig[name] = "constexpr"
    return sig, consts, attrs


def _key(launch, arch):
    sig, consts, attrs = _signature(launch)
    return (launch.kernel.__name__, arch, tuple(sorted(sig.items())),
            tuple(sorted((k, str(v)) for k, v in consts.items())),
            tuple(sorted(attrs)), launch.num_warps, launch.num_stages)


def _fp32_modes(dtypes, fp32_modes):
    """(dtype name, NAC_FAST_FP32_DOT value or None) pairs: fp32 once per product mode."""
    for dname in dtypes:
        for mode in (fp32_modes if dname == "float32" else (None,)):
            yield dname, mode


def _saved_codes(a, r, noise, keys, target):
    """(q, k) the backward plans read, as the op hands them on from its forward (nac_triton
    `fwd`): the forward plan's codes (bf16x6, fp16x3: their 16-bit parts); with given keys, k is
    empty (the keys themselves are read) except in bf16x6 (which fp16x3 runs there), where it is
    their (3, N, D) parts."""
    import torch
    from nac_fast.kernels import nac_triton
    _, (_, _, _, q, k, _) = nac_triton.fwd_plan(a, r, noise, keys, 1.1, 0.1, True, target)
    if keys is not None and k.dim() != 3:
        k = torch.empty((0,), dtype=a.dtype, device=a.device)
    return q, k


def _split_targets(target):
    """`target`, and the same arch with 1 SM and with 65536: a backward plan's split then is the
    target's, one (the fused output modes) and many (the split shares and their sums)."""
    return (target, dataclasses.replace(target, sms=1, occupancy=None),
            dataclasses.replace(target, sms=1 << 16, occupancy=None))


def _loss_plans(target, dname, ds, modes, n, N, meta):
    """(case, launch) of the loss's forward and backward plans in `dname` at each D and mode
    (`_plans`), fp32 in the environment's product mode."""
    import torch
    from nac_fast.kernels import nac_triton

    dtype = getattr(torch, dname)
    for D in ds:
        a = torch.empty((n, D), dtype=dtype, **meta)
        r, noise = torch.empty_like(a), torch.empty_like(a)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        lse, g = torch.empty(n, dtype=acc, **meta), torch.empty(n, dtype=acc, **meta)
        for mode in modes:
            keys = None if mode == "inbatch" else torch.empty((N, D), dtype=dtype, **meta)
            case = dict(dtype=dname, D=D, mode=mode)
            for grad in (True, False):
                launches, _ = nac_triton.fwd_plan(a, r, noise, keys, 1.1, 0.1, grad, target)
                for L in launches:
                    yield case, L
            # the kernel that draws the noise from a seed (the eager calls' with noise=None:
            # the prologue in-batch, the forward kernel with given keys), the seed in a
            # tensor (drawn on the device: graph capture) or drawn on the host (an int)
            for seed in (torch.empty(1, dtype=torch.int64, **meta), 3 << 61):
                launches, _ = nac_triton.fwd_plan(a, r, None, keys, 1.1, 0.1, True, target,
                                                  seed=seed, p=0.1)
                for L in launches:
                    if L.constexprs.get("SEEDED"):
                        yield case, L
            # the finish that reduces the rows itself (eager calls, reduction mean/sum): the
            # forward's own (folded) or its own launch
            launches, _ = nac_triton.fwd_plan(a, r, noise, keys, 1.1, 0.1, True, target,
                                              reduction="mean")
            for L in launches:
                if L.tag in ("fwd", "finish"):
                    yield case, L
            if keys is not None:  # NACMQLoss: the inference term in the finish and bwd_rows
                launches, _ = nac_triton.fwd_plan(a, r, noise, keys, 1.1, 0.1, True, target,
                                                  rv=r)
                for L in launches:
                    if L.tag in ("fwd", "finish"):
                        yield case, L
            # the backward with everything needed (training: a, r; gathered keys: keys too),
            # with the target's split, with one split (the fused output modes) and with many
            # (the split shares and their sums): other batch sizes reach each of them
            ga = torch.empty((n, D), dtype=acc, **meta)
            q, k = _saved_codes(a, r, noise, keys, target)
            for t in _split_targets(target):
                launches, _ = nac_triton.bwd_plan(a, r, noise, keys, lse, ga, g, q, k, 1.1,
                                                  True, True, keys is not None, t)
                for L in launches:
                    yield case, L
            if keys is not None:  # NAC-MQ's backward with the inference term's d/dr
                launches, _ = nac_triton.bwd_plan(a, r, noise, keys, lse, ga, g, q, k, 1.1,
                                                  True, False, False, target, rv=r,
                                                  need_rv=True)
                for L in launches:
                    yield case, L
            yield from _self_key_plans(target, case, a, r, noise, keys, lse, ga, g)


def _self_offset_of(n, keys):
    """The self_offset of a self-key case: the own keys at the start (in-batch) or at the end of
    the given keys (a gathering rank's place; any offset compiles alike: it is not specialised)."""
    return 0 if keys is None else keys.shape[0] - n


def _self_key_plans(target, case, a, r, noise, keys, lse, ga, g):
    """(case, launch) of the matrix kernels that leave each row's own key out (self_key
    "exclude", docs/math.md [M:self-key]: their constexpr SELF), case mode `<mode>-self`: the
    training call's forward (the noise drawn from a host seed, the mean reduced by the finish),
    the registered op's (the noise given, the rows), and the backward with the target's split,
    one split and many.  The row-wise kernels of these plans are the paper's own (no SELF) and
    are left to `_loss_plans`."""
    from nac_fast.kernels import nac_triton

    own = _self_offset_of(a.shape[0], keys)
    case = dict(case, mode=case["mode"] + "-self")
    plans = [nac_triton.fwd_plan(a, r, None, keys, 1.1, 0.0, True, target, seed=3 << 61, p=0.1,
                                 reduction="mean", self_offset=own)[0],
             nac_triton.fwd_plan(a, r, noise, keys, 1.1, 0.0, True, target, self_offset=own)[0]]
    q, k = _saved_codes(a, r, noise, keys, target)
    for t in _split_targets(target):
        plans.append(nac_triton.bwd_plan(a, r, noise, keys, lse, ga, g, q, k, 1.1, True, True,
                                         keys is not None, t, self_offset=own)[0])
    for launches in plans:
        for L in launches:
            if L.constexprs.get("SELF"):
                yield case, L


def _plans(target, dtypes, ds, modes, fp32_modes=FP32_MODES):
    """(case, launch) for every launch of every op at every case of the grid on `target`."""
    import torch
    from nac_fast.kernels import hamming_triton, nac_noise_triton, nac_triton, queue_triton

    meta = dict(device="meta")
    n, N = 8192, 65536
    for dname, fp32_mode in _fp32_modes(dtypes, fp32_modes):
        # both plans: the row-wise tails folded into the matrix kernels (the default) and their
        # own launches (NAC_FAST_FOLD=0); each restored after: the caller's settings stay
        for folded in (True, False):
            with nac_triton.fp32_dot(fp32_mode), nac_triton.fold(folded):
                yield from _loss_plans(target, dname, ds, modes, n, N, meta)
    out = torch.empty((4096, 128), dtype=torch.float32, **meta)
    seed = torch.empty(1, dtype=torch.int64, **meta)
    for L in nac_noise_triton.noise_plan(out, seed, 0.1):
        yield dict(dtype="float32", D="", mode=""), L
    # the momentum queue's enqueue (kernels/queue_triton.py): pre-activations in each dtype the
    # loss runs in, written into a queue of that dtype (bf16 and fp16 keys into bf16 too: AMP)
    ptr = torch.empty((), dtype=torch.int64, **meta)
    count = torch.empty(1, dtype=torch.int32, **meta)
    for dname in dtypes:
        dtype = getattr(torch, dname)
        for D in ds:
            x = torch.empty((256, D), dtype=dtype, **meta)
            for qdt in dict.fromkeys((dtype, torch.bfloat16 if dtype != torch.float64
                                      else dtype)):
                codes = torch.empty((65536, D), dtype=qdt, **meta)
                for L in queue_triton.enqueue_plan(codes, ptr, count, x, x[:0]):
                    yield dict(dtype=dname, D=D, mode="queue"), L
    for bits in ds:
        W = -(-bits // 64)
        qw = torch.empty((1000, W), dtype=torch.int64, **meta)
        gw = torch.empty((50000, W), dtype=torch.int64, **meta)
        dist = torch.empty((1000, 50000), dtype=torch.int32, **meta)
        ap = torch.empty(1000, dtype=torch.float64, **meta)
        nrel = torch.empty(1000, dtype=torch.int64, **meta)
        case = dict(dtype="int64", D=bits, mode="")
        for L in hamming_triton.cdist_plan(qw, gw, dist):
            yield case, L
        # the top-k's filter pass (HashIndex.search on a GPU): 1,000 queries, top 10
        t = torch.empty(1000, dtype=torch.int32, **meta)
        for L in hamming_triton.topk_plan(qw, gw, t, 10, 1.0)[0]:
            yield case, L
        # its tensor-core filter (int8 products of +-1 codes; method "mma")
        for L in hamming_triton.topk_mma_plan(qw, gw, t, 10, 1.0, bits)[0]:
            yield case, L
        for multi in (False, True):
            ql = torch.empty((1000, 1) if multi else (1000,), dtype=torch.int64, **meta)
            gl = torch.empty((50000, 1) if multi else (50000,), dtype=torch.int64, **meta)
            for L in hamming_triton.ap_plan(qw, gw, ql, gl, bits, ap, nrel):
                yield case, L


def _candidate_plans(target, dtypes):
    """(case, launch) for every launch of every autotune candidate (nac_triton.CANDIDATES: the
    configurations a tuned table may name, kernels/tuning.py), forced into the same plans as
    `_plans` builds: forward with and without the rows' gradient, in-batch and given keys; the
    backward with the target's split, one split and many.  A candidate's waves change only the
    split, so each distinct compiled configuration is planned once."""
    import torch
    from nac_fast.kernels import nac_triton, tuning

    meta = dict(device="meta")
    n, N = 8192, 65536
    for (kernel, name, bd), cands in sorted(nac_triton.CANDIDATES.items()):
        # "float32:bf16x6": fp32 in that product mode (kernels/tuning.py candidate_dtype); a
        # plain name: that dtype, fp32 in its default tf32x3
        dname, fp32_mode = tuning.split_candidate_dtype(name)
        if dname not in dtypes:
            continue
        plan_mode = fp32_mode or (nac_triton.FP32_PRECISIONS[0] if dname == "float32" else None)
        dtype = getattr(torch, dname)
        D = bd
        a = torch.empty((n, D), dtype=dtype, **meta)
        acc = torch.float32
        lse, g = torch.empty(n, dtype=acc, **meta), torch.empty(n, dtype=acc, **meta)
        ga = torch.empty((n, D), dtype=acc, **meta)
        seen = set()
        for c in cands:
            if not c.applies(target.arch) or (c.BLOCK_M, c.BLOCK_N, c.num_warps,
                                              c.num_stages) in seen:
                continue
            seen.add((c.BLOCK_M, c.BLOCK_N, c.num_warps, c.num_stages))
            for mode in MODES:
                if fp32_mode == "fp16x3" and mode != "inbatch":
                    continue  # given keys run bf16x6 (nac_triton._given_keys_mode)
                keys = None if mode == "inbatch" else torch.empty((N, D), dtype=dtype, **meta)
                case = dict(dtype=dname, D=D, mode=mode, source="candidate")
                # folded and not (NAC_FAST_FOLD=0: the forward without its finish, the keys'
                # backward's split shares); fp32_dot and fold restore the caller's settings
                for folded in (True, False):
                    with (tuning.forced(**{kernel: c}), nac_triton.fp32_dot(plan_mode),
                          nac_triton.fold(folded)):
                        if kernel == "fwd":
                            for grad in (True, False):
                                launches, _ = nac_triton.fwd_plan(a, a, a, keys, 1.1, 0.1, grad,
                                                                  target)
                                for L in launches:
                                    if L.tag == "fwd":
                                        yield case, L
                            continue
                        # (no SELF launches: the own key left out reads no tuned table,
                        # nac_triton.config; _self_key_plans covers its configurations)
                        q, k = _saved_codes(a, a, a, keys, target)
                        for t in _split_targets(target):
                            launches, _ = nac_triton.bwd_plan(a, a, a, keys, lse, ga, g, q, k,
                                                              1.1, True, True, keys is not None,
                                                              t)
                            for L in launches:
                                if L.tag.startswith("bwd_keys"):
                                    yield case, L


def compile_only(job):
    """Worker of the autotune stage (tools/autotune.py): compile one launch with triton.compile
    into Triton's cache, where the JIT finds it when the launch first runs; returns seconds."""
    module, kernel_name, arch, sig, consts, attrs, warps, stages = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel_name)
    t0 = time.perf_counter()
    triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                   options=dict(num_warps=warps, num_stages=stages))
    return time.perf_counter() - t0


def _ptxas_log(compile_fn):
    """(result of compile_fn(), the log of the ``ptxas -v`` that Triton ran inside it, or None
    when it ran none: a cache hit).  Triton prints that log when knobs.nvidia.dump_ptxas_log is
    set (Triton 3.6 and 3.8): these are the figures of the very cubin Triton built, with the
    flags of that Triton version."""
    import contextlib
    import io

    from triton import knobs
    buf = io.StringIO()
    prev = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(buf):
            out = compile_fn()
    finally:
        knobs.nvidia.dump_ptxas_log = prev
    log = buf.getvalue()
    return out, (log if re.search(r"Used \d+ registers", log) else None)


def _compile_one(job):
    """Worker: compile one launch for one arch; returns measured figures."""
    module, kernel_name, arch, sig, consts, attrs, warps, stages = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = importlib.import_module(module)
    fn = getattr(mod, kernel_name)
    t0 = time.perf_counter()
    compiled, log = _ptxas_log(lambda: triton.compile(
        ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages)))
    dt = time.perf_counter() - t0
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        cubin = os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        if log is None:  # a cache hit (--keep-cache): ptxas again, with Triton 3.8's flags
            run = subprocess.run([_triton_bin("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2",
                                  f"--gpu-name={gpu}", ptx, "-o", os.path.join(tmp, "v.cubin")],
                                 capture_output=True, text=True)
            if run.returncode:
                raise RuntimeError(f"ptxas failed on {kernel_name}: {run.stderr[-2000:]}")
            log = run.stderr
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    mma = {m: len(re.findall(rf"\b{m}\b", sass)) for m in ("HGMMA", "HMMA", "DMMA")}
    used = [m for m, c in mma.items() if c]
    return dict(registers=int(regs.group(1)) if regs else -1,
                spill_store_bytes=int(spill.group(1)) if spill else 0,
                spill_load_bytes=int(spill.group(2)) if spill else 0,
                smem_bytes=int(compiled.metadata.shared),
                mma_instr="+".join(used), mma_count=sum(mma.values()), compile_s=round(dt, 2))


# Kernels whose products are int8 on the tensor cores: their SASS is searched for the integer
# matrix instructions too (IMMA: mma.sync on s8, sm_80 and sm_90; IGMMA: wgmma on s8, sm_90a),
# by `_compile_int_mma` (kept apart from `_compile_one`, whose source keys every other launch).
INT_MMA_KERNELS = ("hamming_topk_mma",)
INT_MMA_INSTRS = ("IGMMA", "IMMA")


def _compile_int_mma(job):
    """`_compile_one`, and the integer matrix instructions (INT_MMA_INSTRS) of the same cubin
    (Triton's cache returns it: the compile `_compile_one` just ran) added to mma_instr and
    mma_count."""
    row = _compile_one(job)
    module, kernel_name, arch, sig, consts, attrs, warps, stages = job
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), kernel_name)
    compiled = triton.compile(ASTSource(fn, sig, consts, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_triton_bin("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    ints = {m: len(re.findall(rf"\b{m}(?=[.\s])", sass)) for m in INT_MMA_INSTRS}
    used = [m for m in str(row["mma_instr"]).split("+") if m] + [m for m, c in ints.items() if c]
    row.update(mma_instr="+".join(used), mma_count=row["mma_count"] + sum(ints.values()))
    return row


def _job(launch, arch):
    sig, consts, attrs = _signature(launch)
    return (launch.kernel.__module__, launch.kernel.__name__, arch, sig, consts, attrs,
            launch.num_warps, launch.num_stages)


@functools.lru_cache(maxsize=None)
def _measuring_code_digest() -> str:
    """What the figures of a compiled launch also depend on: the code that measures them."""
    import inspect
    text = "".join(inspect.getsource(f) for f in (_compile_one, _ptxas_log))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _int_mma_digest() -> str:
    import inspect
    return hashlib.sha256(inspect.getsource(_compile_int_mma).encode()).hexdigest()


# 1: the sha256 of Triton's compile-cache key (which holds source line numbers); 2: source_digest
# of the source text with its comments and blank lines; 3: without them (code_text)
KEY_FORMAT = 3


def code_text(src: str) -> str:
    """`src` without its comments, trailing whitespace and blank lines: what of a function's text
    reaches the compiler.  The COMMENT tokens are cut out of the raw text where tokenize finds them
    (a comment runs to the end of its line, so it is cut by its length from the line's end, not by
    a column offset); no token is re-rendered, so the text is the same under every Python version
    whose tokenizer finds the same comments (3.11, 3.12, 3.13 do for kernels/).  ValueError when
    `src` does not tokenize."""
    import io
    import tokenize

    lines = io.StringIO(src).readlines()  # the lines tokenize reads, numbered as it numbers them
    try:
        comments = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
                    if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError) as exc:
        raise ValueError(f"src: does not tokenize: {exc}") from exc
    for t in comments:
        row = t.start[0] - 1
        line, text = lines[row].rstrip(), t.string.rstrip()
        if not line.endswith(text):
            raise ValueError(f"src: line {row + 1}'s comment {text!r} does not end the line")
        lines[row] = line[:len(line) - len(text)]
    return "\n".join(x.rstrip() for x in lines if x.strip())


def _is_jit(v) -> bool:
    from triton.runtime.jit import JITFunction
    return isinstance(v, JITFunction)


def _jit_source(fn) -> str:
    """A Triton function's source text (decorators included, no line numbers)."""
    import inspect
    import textwrap
    src = getattr(fn, "src", None)
    return src if isinstance(src, str) else textwrap.dedent(inspect.getsource(fn.fn))


@functools.lru_cache(maxsize=None)
def source_digest(fn) -> str:
    """The sha256 of what a kernel's compiled code follows from in this repository: its source
    text without comments and blank lines (`code_text`) and that of every Triton function it calls (transitively, by name through its module's
    globals, or `module.name`), and the values of the globals they read (tl.constexpr and plain
    numbers), each under its qualified name.  Unlike Triton's own cache key it holds no line
    number (those reach the binary only as debug line info, none of the figures), so an edit that
    moves a kernel, or only edits its comments, keeps its key; Triton's own functions (tl.*) are covered
    by the Triton version in `launch_key`."""
    import ast
    import types

    import triton.language as tl
    parts, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop()
        name = f"{f.fn.__module__}.{f.fn.__qualname__}"
        if name in seen:
            continue
        seen.add(name)
        src = _jit_source(f)
        parts.append(f"fn {name}\n{code_text(src)}")
        glob = f.fn.__globals__
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name):
                ref, v = node.id, glob.get(node.id, None)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and isinstance(glob.get(node.value.id), types.ModuleType)):
                mod = glob[node.value.id]
                if mod.__name__.split(".")[0] == "triton":
                    continue  # tl.*: Triton's, its version is keyed
                ref, v = f"{mod.__name__}.{node.attr}", getattr(mod, node.attr, None)
            else:
                continue
            if _is_jit(v):
                if v.fn.__module__.split(".")[0] != "triton":
                    todo.append(v)
            elif isinstance(v, tl.constexpr):
                parts.append(f"const {name}:{ref}={v.value!r}")
            elif isinstance(v, (bool, int, float, str)) and not isinstance(node.ctx, ast.Store):
                parts.append(f"value {name}:{ref}={v!r}")
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()


def launch_key(job, int_mma: bool = False, triton_version: Optional[str] = None) -> str:
    """The content key of one compiled launch: what decides the compiled code -- the kernel's
    `source_digest` (no line numbers), the specialised signature, constexprs and divisibility
    attributes, warps, stages, the arch, the Triton version (its compiler and bundled ptxas) and
    the Triton settings in the environment that change a compile -- and the measuring code's
    digest (with `_compile_int_mma`'s for an int8 tensor-core kernel, `int_mma`), hashed.
    `triton_version`: the Triton a table was compiled under (default: the one imported here)."""
    module, kernel_name, arch, sig, consts, attrs, warps, stages = job
    import importlib
    import json

    fn = getattr(importlib.import_module(module), kernel_name)
    if triton_version is None:
        import triton
        triton_version = triton.__version__
    env = {}
    try:
        from triton.compiler import compiler as TC
        env = {k: v for k, v in TC.get_cache_invalidating_env_vars().items() if v}
    except (ImportError, AttributeError):
        pass
    what = dict(format=KEY_FORMAT, kernel=kernel_name, source=source_digest(fn),
                signature=sorted(sig.items()), constexprs=sorted((k, repr(v)) for k, v in
                                                                 consts.items()),
                attrs=sorted((repr(k), repr(v)) for k, v in attrs.items()), num_warps=warps,
                num_stages=stages, arch=arch, triton=triton_version, env=sorted(env.items()),
                measuring=_measuring_code_digest() + ("-" + _int_mma_digest() if int_mma else ""))
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def read_reusable(path) -> dict:
    """key -> the compiled figures of a previous check's CSV (rows with a key; CUDA rows have
    none).  ValueError naming `path` when it is not such a CSV."""
    if not os.path.isfile(path):
        raise ValueError(f"--reuse: {path} is not a file")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "key" not in rows[0]:
        raise ValueError(f"--reuse: {path} has no `key` column (not a compile check table of "
                         "this version: regenerate it without --reuse)")
    out = {}
    for i, r in enumerate(rows, start=2):
        try:
            if not r["key"] or r["problems"].startswith("compile failed"):
                continue
            out[r["key"]] = {k: (r[k] if k == "mma_instr" else
                                 float(r[k]) if k == "compile_s" else int(r[k]))
                             for k in COMPILED}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"--reuse: {path} line {i} is not a compile check row: "
                             f"{exc!r}") from exc
    return out


def _verify_sample(reused, n, seed):
    """n reused launches to compile anyway: one per (kernel, arch) first, then at random."""
    import random
    rng = random.Random(seed)
    groups: dict = {}
    for k in sorted(reused):
        u = reused[k]
        groups.setdefault((u["launch"].tag, u["arch"]), []).append(k)
    picked = [rng.choice(ks) for _, ks in sorted(groups.items())][:n]
    rest = sorted(set(reused) - set(picked))
    rng.shuffle(rest)
    return set(picked + rest[:max(0, n - len(picked))])


class _PlainProgress:
    """A progress line with an ETA every tenth of the work, where tqdm is not installed (the
    GPU machine need not have it)."""

    def __init__(self, total):
        self.total, self.n, self.t0, self.next = total, 0, time.perf_counter(), total / 10

    def update(self, k):
        self.n += k
        if self.n >= self.next or self.n == self.total:
            el = time.perf_counter() - self.t0
            eta = el / self.n * (self.total - self.n)
            print(f"compile check: {self.n}/{self.total} launches, {el:.0f} s, ETA {eta:.0f} s",
                  file=sys.stderr, flush=True)
            self.next += self.total / 10

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(total):
    """tqdm's bar over `total` launches to compile (stderr), or a plain line without tqdm."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, desc="compile check", unit="launch", file=sys.stderr,
                disable=not total)


def unique_launches(archs, dtypes, ds, modes, fp32_modes=FP32_MODES, candidates=True) -> dict:
    """The distinct Triton launches of the grid: `_key` -> dict(launch, arch, cases)."""
    from nac_fast.kernels import launch as KL

    targets = {t.arch: t for t in KL.CHECKED_TARGETS}
    unique: dict = {}
    for arch in archs:
        target = targets[arch]
        plans = list(_plans(target, dtypes, ds, modes, fp32_modes))
        if candidates:
            plans += list(_candidate_plans(target, dtypes))
        for case, L in plans:
            k = _key(L, arch)
            if k not in unique:
                unique[k] = dict(launch=L, arch=arch, cases=[])
            unique[k]["cases"].append(case)
    return unique


def keyed(u) -> str:
    """`launch_key` of one of `unique_launches`' values."""
    return launch_key(_job(u["launch"], u["arch"]), int_mma=u["launch"].tag in INT_MMA_KERNELS)


def stale_launches(path, archs, dtypes, ds, modes, fp32_modes=FP32_MODES, candidates=True):
    """The launches of the grid whose key is not in the table at `path` (nothing compiled: a
    table is current when this is empty), as (tag, arch, key) triples."""
    have = read_reusable(path)
    out = []
    for u in unique_launches(archs, dtypes, ds, modes, fp32_modes, candidates).values():
        k = keyed(u)
        if k not in have:
            out.append((u["launch"].tag, u["arch"], k))
    return out


def describe(u, target) -> dict:
    """The columns of a launch's row that say what it is (kernel .. folded, no figures)."""
    L, cases = u["launch"], u["cases"]
    tag, c = L.tag, L.constexprs
    dtype, D = cases[0]["dtype"], cases[0]["D"]
    prec = c.get("PRECISION", "")
    if tag in MATRIX_KERNELS and dtype == "float64":
        prec = "ieee-fp64"
    return dict(kernel=tag, arch=u["arch"], dtype=dtype, D=D,
                modes="+".join(sorted({x["mode"] for x in cases if x["mode"]})),
                precision=prec,
                blocks="x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_Q",
                                                     "BLOCK_G", "NB", "BLOCK") if k in c),
                warps=L.num_warps, stages=L.num_stages, smem_limit=target.smem,
                smem_estimate=(_smem_estimate(tag, c, L, dtype, D, prec)
                               if tag in MATRIX_KERNELS else ""),
                source="+".join(sorted({x.get("source", "built-in") for x in cases})),
                folded=int(bool(tag == "bwd_keys_out3" or (tag == "fwd" and c.get("FINISH")))))


def triton_rows(archs, dtypes, ds, modes, jobs, max_compile_s, fp32_modes=FP32_MODES,
                candidates=True, reuse=None, verify=0, seed=None):
    from nac_fast.kernels import launch as KL

    targets = {t.arch: t for t in KL.CHECKED_TARGETS}
    unique = unique_launches(archs, dtypes, ds, modes, fp32_modes, candidates)
    print(f"compile check: {len(unique)} distinct Triton launches for archs {archs}", flush=True)
    try:
        for u in unique.values():
            u["key"] = keyed(u)
    except Exception as exc:  # noqa: BLE001 - another Triton's internals: keys are optional
        if reuse is not None:
            raise RuntimeError(f"--reuse: the launches cannot be keyed: {exc}") from exc
        print(f"compile check: launches not keyed (column `key` left empty): {exc}", flush=True)
        for u in unique.values():
            u["key"] = ""
    reused = {u["key"]: u for u in unique.values() if reuse and u["key"] and u["key"] in reuse}
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    verified = _verify_sample(reused, verify, seed) if verify else set()
    todo, done = [], []  # to compile; reused as they are (fut None below)
    for u in unique.values():
        (done if u["key"] in reused and u["key"] not in verified else todo).append(u)
    if reuse is not None:
        print(f"compile check: {len(reused)} launches reused by key, {len(verified)} of them "
              f"compiled again to verify (seed {seed}), {len(todo) - len(verified)} to compile",
              flush=True)
    rows = []
    t0 = time.perf_counter()
    import itertools
    with cf.ProcessPoolExecutor(max_workers=jobs) as pool, _progress(len(todo)) as bar:
        futs = {pool.submit(_compile_int_mma if u["launch"].tag in INT_MMA_KERNELS
                            else _compile_one, _job(u["launch"], u["arch"])): u for u in todo}
        for fut, u in itertools.chain(((None, u) for u in done),
                                      ((f, futs[f]) for f in cf.as_completed(futs))):
            if fut is not None:
                bar.update(1)
            L, arch = u["launch"], u["arch"]
            target = targets[arch]
            row = describe(u, target)
            row.update(note="", key=u["key"],
                       checked=("reused" if fut is None else
                                "verified" if u["key"] in verified else "compiled"))
            try:
                row.update(reuse[u["key"]] if fut is None else fut.result())
            except Exception as exc:  # noqa: BLE001 - a failed compile is a finding
                row.update(registers=-1, spill_store_bytes=-1, spill_load_bytes=-1, smem_bytes=-1,
                           mma_instr="", mma_count=0, compile_s=-1, blocks_per_sm=0)
                row["problems"] = "compile failed: " + " | ".join(str(exc).splitlines())[-600:]
                rows.append(row)
                continue
            row["blocks_per_sm"] = KL.blocks_per_sm(row["registers"], row["smem_bytes"],
                                                    L.num_warps, target.smem_per_sm)
            problems = _triton_problems(row, max_compile_s)
            if row["checked"] == "verified":
                differ = [f"{k} {reuse[u['key']][k]} reused, {row[k]} compiled"
                          for k in COMPILED if k != "compile_s" and reuse[u["key"]][k] != row[k]]
                if differ:
                    problems.append("a fresh compile differs from the reused row: "
                                    + ", ".join(differ))
            row["problems"] = "; ".join(problems)
            rows.append(row)
    print(f"compile check: Triton part took {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def _smem_estimate(tag, c, L, dtype, D, prec):
    """nac_triton.smem_estimate of a matrix launch, under the fp32 product mode it was planned
    in (the estimate depends on it: bf16x6's part tiles, ieee's registers)."""
    from nac_fast.kernels import launch as KL
    from nac_fast.kernels import nac_triton
    with nac_triton.fp32_dot(prec if dtype == "float32" else None):
        return nac_triton.smem_estimate(
            config_kernel(tag), KL.Config(c["BLOCK_M"], c["BLOCK_N"], L.num_warps, L.num_stages),
            _torch_dtype(dtype), D)


def _torch_dtype(name):
    import torch
    return getattr(torch, name)


def _triton_problems(row, max_compile_s):
    out = []
    if row["smem_bytes"] > row["smem_limit"]:
        out.append(f"shared memory {row['smem_bytes']} B > {row['smem_limit']} B")
    low = (row["dtype"] in ("bfloat16", "float16")
           or row["precision"] in ("tf32", "tf32x3", "bf16x6", "fp16x3"))
    if low and (row["spill_store_bytes"] or row["spill_load_bytes"]):
        if row.get("folded"):
            # a plan on a GPU launches a folded kernel only where it compiles clean
            # (kernels/launch.py Target.clean): there the tail is a launch of its own, which the
            # check's unfolded plans cover
            row["note"] = ("not launched: it spills, so the plans run this configuration "
                           "unfolded (Target.clean)")
        else:
            out.append(f"spills {row['spill_store_bytes']} B stores / "
                       f"{row['spill_load_bytes']} B loads on a 16-bit/tf32 path")
    if low and row["kernel"] in MATRIX_KERNELS and not row["mma_count"]:
        out.append("no tensor-core instruction (HGMMA/HMMA) in a 16-bit/tf32 matrix kernel")
    if row["kernel"] in INT_MMA_KERNELS:
        if row["spill_store_bytes"] or row["spill_load_bytes"]:
            out.append(f"spills {row['spill_store_bytes']} B stores / "
                       f"{row['spill_load_bytes']} B loads in an int8 tensor-core kernel")
        if not any(m in str(row["mma_instr"]).split("+") for m in INT_MMA_INSTRS):
            out.append("no integer tensor-core instruction (IMMA/IGMMA) in an int8 tensor-core "
                       "kernel")
    if row["compile_s"] > max_compile_s:
        out.append(f"compile took {row['compile_s']} s > {max_compile_s} s")
    if "blocks_per_sm" in row and row["blocks_per_sm"] == 0:
        out.append("no block fits on an SM (registers x threads or shared memory)")
    return out


def cuda_rows(archs, jobs):
    """The .cu files' kernels (tools/cuda_resources.py: nvcc's resource report and the HMMA
    count per arch), or [] with the reason printed when there is no CUDA toolkit here."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import cuda_resources
    t0 = time.perf_counter()
    try:
        rows = cuda_resources.cuda_resource_rows(archs=tuple(archs), jobs=jobs)
    except RuntimeError as exc:
        print(f"compile check: CUDA kernels not checked: {exc}")
        return []
    print(f"compile check: CUDA part took {time.perf_counter() - t0:.0f} s", flush=True)
    from nac_fast.kernels import launch as KL
    smem_sm = {t.arch: t.smem_per_sm for t in KL.CHECKED_TARGETS}

    def occupancy(r):  # what cudaOccupancyMaxActiveBlocksPerMultiprocessor gives on the GPU
        warps = cuda_resources.threads_per_block(r["kernel"]) // 32
        if r["registers"] <= 0:
            return 0
        return KL.blocks_per_sm(r["registers"], r["smem_bytes"], warps, smem_sm[int(r["arch"])])
    return [dict(kernel="cuda:" + r["kernel"], arch=r["arch"], dtype=r["dtype"], D=r["D"],
                 modes="", precision="", blocks="",
                 warps=cuda_resources.threads_per_block(r["kernel"]) // 32, stages="",
                 smem_bytes=r["smem_bytes"], smem_estimate="", smem_limit="",
                 registers=r["registers"], spill_store_bytes=r["spill_store_bytes"],
                 spill_load_bytes=r["spill_load_bytes"], mma_instr=r["mma_instr"],
                 mma_count=r["mma_count"], blocks_per_sm=occupancy(r),
                 compile_s=r["compile_s"], problems="; ".join(cuda_resources.problems([r])))
            for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=None, help="write every row here")
    ap.add_argument("--archs", default="80,90")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--D", default=",".join(map(str, DS)))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--fp32-modes", default=",".join(FP32_MODES),
                    help="NAC_FAST_FP32_DOT values to check for fp32 (tf32x3 is the default)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-compile-s", type=float, default=20.0)
    ap.add_argument("--no-cuda", action="store_true", help="skip the .cu file's check")
    ap.add_argument("--no-candidates", action="store_true",
                    help="skip the autotune candidates (nac_triton.CANDIDATES)")
    ap.add_argument("--reuse", default=None, metavar="CSV",
                    help="take the compiled figures of launches whose key is in CSV (a table this "
                         "script wrote) instead of compiling them again")
    ap.add_argument("--verify", type=int, default=0, metavar="N",
                    help="with --reuse: compile N reused launches anyway and compare (default 0)")
    ap.add_argument("--seed", type=int, default=None,
                    help="the --verify draw's seed (default: a random one, printed)")
    ap.add_argument("--check-keys", default=None, metavar="CSV",
                    help="compile nothing: list the launches of the grid whose key is not in CSV "
                         "and exit 1 if there are any (whether CSV is current)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="reuse Triton's cache (default: a fresh one, so compile times are real)")
    ap.add_argument("--fail-on", default=None, metavar="DTYPES",
                    help="exit 1 only for a problem of these dtypes (some of --dtypes; default: "
                         "any row's); the other rows' problems are counted in the verdict line")
    ap.add_argument("--verdict-out", default=None, metavar="FILE",
                    help="write the verdict line (the output's last) to FILE too")
    args = ap.parse_args(argv)
    if args.verify < 0:
        ap.error(f"--verify: a count >= 0, got {args.verify}")
    if args.verify and args.reuse is None:
        ap.error("--verify needs --reuse")
    if args.csv and args.reuse and os.path.abspath(args.csv) == os.path.abspath(args.reuse):
        ap.error("--csv: the table --reuse reads would be overwritten by a table of reused rows; "
                 "write it elsewhere")
    if args.check_keys and (args.reuse or args.csv or args.fail_on or args.verdict_out):
        ap.error("--check-keys compiles and writes nothing: leave out --reuse, --csv, --fail-on "
                 "and --verdict-out")
    fail_on = args.fail_on.split(",") if args.fail_on is not None else None
    if fail_on is not None and not set(fail_on) <= set(args.dtypes.split(",")):
        ap.error(f"--fail-on: dtypes among --dtypes ({args.dtypes}), got {args.fail_on}")
    if args.verdict_out:
        from nac_fast._files import check_writable
        check_writable("--verdict-out", args.verdict_out, error=ap.error)
    try:
        reuse = read_reusable(args.reuse) if args.reuse else None
        if args.check_keys:
            read_reusable(args.check_keys)
    except ValueError as exc:
        ap.error(str(exc).replace("--reuse:", "--check-keys:" if args.check_keys else "--reuse:"))
    # compile for real (the tests' conftest sets the interpreter); before triton is imported, and
    # only here: importing this module (the tests do) must not change the caller's environment
    os.environ.pop("TRITON_INTERPRET", None)
    archs = [int(x) for x in args.archs.split(",")]
    for a in archs:
        if a not in (80, 90):
            ap.error(f"--archs: only 80 and 90 are checked, got {a}")
    if args.check_keys:
        stale = stale_launches(args.check_keys, archs, args.dtypes.split(","),
                               [int(x) for x in args.D.split(",")], args.modes.split(","),
                               args.fp32_modes.split(","), candidates=not args.no_candidates)
        for tag, arch, key in stale:
            print(f"STALE {tag} sm_{arch} {key}")
        print(f"compile check: {len(stale)} launches without a row in {args.check_keys}")
        return 1 if stale else 0
    tmp_cache = None
    if not args.keep_cache:
        tmp_cache = tempfile.mkdtemp(prefix="nac_triton_cache_")
        os.environ["TRITON_CACHE_DIR"] = tmp_cache
    t0 = time.perf_counter()
    try:
        rows = triton_rows(archs, args.dtypes.split(","), [int(x) for x in args.D.split(",")],
                           args.modes.split(","), args.jobs, args.max_compile_s,
                           args.fp32_modes.split(","), candidates=not args.no_candidates,
                           reuse=reuse, verify=args.verify, seed=args.seed)
        if not args.no_cuda:
            rows += cuda_rows(archs, args.jobs)
    finally:
        if tmp_cache:
            shutil.rmtree(tmp_cache, ignore_errors=True)
    rows.sort(key=lambda r: (str(r["kernel"]), r["arch"], str(r["dtype"]), str(r["D"])))
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        part = args.csv + ".part"  # never a half-written table
        with open(part, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        os.replace(part, args.csv)
    _print_table(rows)
    bad = [r for r in rows if r["problems"]]
    print(f"compile check: {len(rows)} rows, {len(bad)} with problems, "
          f"{time.perf_counter() - t0:.0f} s in all")
    for r in bad:
        print(f"PROBLEM {r['kernel']} sm_{r['arch']} {r['dtype']} D={r['D']} {r['blocks']} "
              f"w{r['warps']} s{r['stages']}: {r['problems']}")
    line, failed = verdict(rows, archs, fail_on)
    print(line)
    if args.verdict_out:
        from nac_fast._files import atomic_write
        atomic_write(args.verdict_out, lambda f: f.write(line + "\n"), mode="w")
    return 1 if failed else 0


def verdict(rows, archs, fail_on=None):
    """(the run's one-line verdict, whether it fails): a problem fails on a dtype of `fail_on`
    (None: on any row); the other rows' problems are counted only (the GPU suite's test stage
    fails on the 16-bit paths and reports fp32's)."""
    import triton
    bad = [r for r in rows if r["problems"]]
    failing = [r for r in bad if fail_on is None or str(r["dtype"]) in fail_on]
    head = f"compile check sm_{'/'.join(map(str, archs))} (triton {triton.__version__}): "
    if fail_on is None:
        return f"{head}{len(bad)} problems", bool(bad)
    return (f"{head}{len(failing)} problems on {'/'.join(fail_on)} paths, "
            f"{len(bad) - len(failing)} on the others' (counted, not failed)", bool(failing))


def _print_table(rows):
    print(f"{'kernel':22s} {'arch':>4s} {'dtype':9s} {'D':>4s} {'blocks':14s} {'w':>2s} {'s':>2s} "
          f"{'smem':>7s} {'regs':>4s} {'spill':>6s} {'mma':12s} {'sec':>5s}")
    for r in rows:
        print(f"{str(r['kernel']):22s} {r['arch']:>4} {str(r['dtype']):9s} {str(r['D']):>4s} "
              f"{str(r['blocks']):14s} {str(r['warps']):>2s} {str(r['stages']):>2s} "
              f"{r['smem_bytes']:>7} {r['registers']:>4} {r['spill_store_bytes']:>6} "
              f"{str(r['mma_instr']) + ':' + str(r['mma_count']):12s} {r['compile_s']:>5}")


if __name__ == "__main__":
    sys.exit(main())
