"""Triton kernels of the NAC losses (backend="triton"), installed as `nac_fast.kernels.nac_triton`.

Same function and contract as the C++/CUDA ops (csrc/nac_cpu.cpp, csrc/nac_math.h): the rows of
docs/math.md [M:rows], the fwd/bwd pair of [M:passes] (fwd -> loss_i, lse2_i = lse_i / ln 2, ga_i
[M:ga]; bwd -> the gradients of sum_i g_i loss_i, keys' part [M:grad-keys]), the loops in base 2
[M:lse-online].

Kernels (one call's plan: `fwd_plan`, `bwd_plan`; launch configurations: `CONFIGS`,
`FUSED_CONFIGS`; every plan runs under its tensors' device, kernels/launch.py `run`):
  _prologue_kernel  O(nD), once per in-batch forward: Q = s log2(e) m tanh(a) in the compute
                    dtype (log2 units, so the loops use exp2) and the keys K = tanh(a); the
                    forward returns them and the backward reads them (no second prologue).  The
                    inner loops below are matrix products plus exp2: no tanh per tile.  With
                    given keys there is no prologue: _fwd_kernel makes its Q tile itself.
                    noise=None: the kernel that makes Q draws the noise from a seed.
  _fwd_kernel       grid (query blocks, key splits): Q tile resident, loop over key tiles,
                    S = Q K^T on tensor cores (bf16/fp16; fp32 through tf32x3 by default), online
                    logsumexp, and when gradients are wanted acc += P K in the same loop
                    (flash-attention forward).  Key splits keep every SM busy when there are few
                    query blocks.
  the finish        (_finish_rows) merges the splits' (max, sum, acc) with a run-time loop and
                    writes loss, the logsumexp in base 2 (what the backward's exp2 reads back,
                    with no round trip through ln: that cost ~3e-6 in the keys' gradient) and
                    ga.  Folded into _fwd_kernel (FINISH, `folding`): the last split program of a
                    query block to arrive (an int32 counter per block) runs it for the block;
                    NAC_FAST_FOLD=0: _finish_kernel, a launch of its own.
  _bwd_keys_kernel  grid (key blocks, query splits): each program owns its keys, S^T = K Q^T,
                    P^T = exp2(S^T - lse) g, dK += P^T Q; no atomics, splits summed in a fixed
                    order: deterministic.  fp16: g times a power of two, undone at the store
                    ([M:grad-scale]: P g underflowed fp16).  One split: it writes the keys'
                    gradient in their dtype, or (in-batch keys) runs the rows' backward as its
                    epilogue; several splits with the in-batch keys (folded, OUT_MODE 3): the
                    last split program of a key block to arrive sums the shares and runs the
                    rows' backward for the block.
  _bwd_rows_kernel  (_rows_bwd) d/dr [M:grad-r] and d/da [M:grad-a], elementwise, in a's dtype:
                    with given keys, and in-batch with NAC_FAST_FOLD=0.
  _sum_splits_kernel  the given keys' gradient from the query splits' fp32 shares.
  _parts_kernel     fp32 in bf16x6 with given keys: their (3, N, D) bf16 parts, once a call.
Split counts fill one wave: the SMs times the resident blocks per SM of the kernel as compiled
(kernels/launch.py `Target.programs`, `compiled_occupancy`).
The logits never exist in memory: one (BLOCK_M x BLOCK_N) tile lives in registers.
self_offset >= 0 (docs/math.md [M:self-key], the kernels' constexpr SELF): row i's own key, key
self_offset + i, is left out of its logsumexp: _fwd_kernel and _bwd_keys_kernel set its logit to
-inf before the max and the exp2 (`_own_key`: a compare and select in every tile, no branch), so
its probability is exactly 0, and the finish subtracts log(N - 1); without SELF the kernels are
the paper's, as compiled before it existed.

Precision (docs/kernels.md "Precision"): bf16/fp16 inputs multiply on tensor cores with fp32 accumulation;
max, logsumexp, the Bernoulli term and every reduction are fp32.  fp32 inputs use tf32x3 (three
TF32 products, fp32-level accuracy on tensor cores) unless NAC_FAST_FP32_DOT=ieee (exact FMA),
=tf32, =bf16x6 (D <= 128: each operand three bf16 parts, six bf16 products, `parts_mode`; the
prologue / _parts_kernel store the parts, so the loops run the 16-bit tilings) or =fp16x3 (D <=
128, in-batch: two fp16 parts of fixed power-of-two scalings, three fp16 products, H_Q / H_K;
given keys run bf16x6); with it unset, the mode the GPU's tuned table timed fastest at the call's
shape (`call_fp32_mode`).  fp64 is the correctness path (FMA, fp64 throughout).

The interpreter (TRITON_INTERPRET=1, CPU tensors, what CI runs) has no tanh: _tanh below is the
same polynomial/exp formula as csrc/nac_math.h, on the GPU too, so CI checks the math the GPU runs.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from nac_fast._tensors import acc_dtype

from . import tuning
from .configs import (  # noqa: F401  (CONFIGS, CANDIDATES, ... read from here too)
    CANDIDATES,
    CONFIGS,
    FP32_PRECISIONS,
    FUSED_CONFIGS,
    SELF_CONFIGS,
    SELF_FUSED_CONFIGS,
    H,
    PART_MODES,
    TF32_MAX_D,
    _CALL_FP32,
    _C,
    _INTERP,
    _family,
    _waves,
    block_d,
    fp32_precision,
    parts_mode,
    parts_of,
    precision,
    smem_estimate,
)
from .nac_noise_triton import host_seed_value, seed_args, seed_operand, seed_sign
from .launch import (Config, Launch, PlanCache, Target, buffer, cdiv, eager_real, pick,
                     run, split_count, target_of, INT32_ROWS_MAX)

LOG2E = 1.4426950408889634
REDUCE_BLOCK = tl.constexpr(128)  # partial sums the finish's reduction adds per step
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    # The nac_math.h formula, docs/math.md [M:stable] (the interpreter has no tanh): Cephes' odd
    # polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above.  2 sigmoid(2x) - 1 alone loses all
    # relative precision near 0
    # (measured: 5e-4 relative error in the keys' gradient for codes of size 1e-4).
    ax = tl.abs(x)
    # where, not tl.minimum: minimum(NaN, 40) is 40 on the GPU (minnum), turning a NaN into +1
    big = 1.0 - 2.0 / (tl.exp(2.0 * tl.where(ax > 40.0, 40.0, ax)) + 1.0)
    if x.dtype == tl.float64:  # float64 keeps ~1e-12 relative near 0 with the exp form alone
        return tl.where(x < 0, -big, big)
    z = x * x
    p = -5.70498872745e-3 * z + 2.06390887954e-2
    p = p * z - 5.37397155531e-2
    p = p * z + 1.33314422036e-1
    p = p * z - 3.33332819422e-1
    small = p * z * x + x
    return tl.where(ax < 0.625, small, tl.where(x < 0, -big, big))


@triton.jit
def _round_tf32(x):
    # fp32 -> the nearest TF32 value (10 explicit mantissa bits), ties away from zero, kept in
    # fp32 (what cvt.rna.tf32.f32 gives): add half a unit of the 13 dropped bits to the magnitude
    # (the sign is a separate bit), then clear them.  Plain integer ops: the interpreter runs it.
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _rne_bf16(x):
    # float32 -> the nearest bfloat16 value, ties to even, kept in float32: what torch's cast and
    # the GPU's cvt.rn.bf16.f32 give.  Triton's interpreter truncates in its bf16 cast (measured:
    # 1 + 2^-8 + 2^-10 -> 1.0), so the cast after this is exact on both.  NaN stays NaN.
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _rn(x, dtype: tl.constexpr, RNE: tl.constexpr):
    # x (fp32) cast to `dtype`, rounded to nearest even.  The GPU's cast rounds so; the
    # interpreter's bf16 cast (and a store that converts) truncates, which biased every bf16 code,
    # probability tile and gradient of the interpreted kernels towards zero (a bf16 in-batch loss
    # at D = 512 came out 4e-3 off, three times the bf16 reference's error): RNE (the
    # interpreter) rounds the bits first, as _bf16 does.  Every down-cast to a 16-bit dtype in
    # these kernels goes through here.
    if RNE:
        if dtype == tl.bfloat16:
            x = _rne_bf16(x)
    return x.to(dtype)


@triton.jit
def _bf16(x, RNE: tl.constexpr):
    # fp32 -> bf16, rounded to nearest even (the GPU's cast; RNE: the interpreter, which
    # truncates, rounds the bits first: the same bf16 value either way)
    if RNE:
        x = _rne_bf16(x)
    return x.to(tl.bfloat16)


@triton.jit
def _parts3(x, RNE: tl.constexpr):
    # bf16x6's operand split (docs/kernels.md "Precision"): x = x0 + x1 + x2 + e, each part the
    # bf16 rounding of what the ones before it leave (both differences are exact in fp32), |e| <=
    # 2^-27 |x|: 24 bits and more, fp32's own 24.  An infinite x gives NaN parts (inf - inf), as
    # tf32x3's split does.
    x0 = _bf16(x, RNE)
    rest = x - x0.to(tl.float32)
    x1 = _bf16(rest, RNE)
    return x0, x1, _bf16(rest - x1.to(tl.float32), RNE)


@triton.jit
def _dot16(x, y, acc, UPCAST: tl.constexpr):
    # acc + x y for bf16 tiles, fp32 accumulation (UPCAST: the interpreter's widened product,
    # exact, as in _dot)
    if UPCAST:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, y, acc, out_dtype=tl.float32)


@triton.jit
def _dot6(x0, x1, x2, y0, y1, y2, acc, UPCAST: tl.constexpr):
    # acc + x y in bf16x6 (fp32 inputs, NAC_FAST_FP32_DOT=bf16x6): the six products xi yj with
    # i + j <= 2 of the parts of _parts3, smallest first; the three dropped are each <= 2^-27
    # |x| |y| (x1 y2, x2 y1; x2 y2 less).  Six bf16 tensor-core products cost what tf32x3's
    # three TF32 ones do at the H100's rates, but the operands are 16-bit tiles: the 16-bit
    # kernels' HGMMA tilings instead of tf32x3's 32-row HMMA ones (docs/gpu.md "fp32 in
    # bf16x6").
    acc = _dot16(x2, y0, acc, UPCAST)
    acc = _dot16(x0, y2, acc, UPCAST)
    acc = _dot16(x1, y1, acc, UPCAST)
    acc = _dot16(x1, y0, acc, UPCAST)
    acc = _dot16(x0, y1, acc, UPCAST)
    return _dot16(x0, y0, acc, UPCAST)


# fp16x3's fixed power-of-two scales (NAC_FAST_FP32_DOT=fp16x3, in-batch): the parts of Q (|Q| <=
# s log2 e < 74 for any fp32 p) times 2^9, of the keys z = tanh(a) (|z| <= 1) and of P (<= 1)
# times 2^14: at most 2^15 < fp16's 65504, and the residual parts stay normal (full precision)
# down to |Q| >= 2^-12, |z|, P >= 2^-17; below, their absolute error is under 2^-34.  The logits
# come out times 2^23, P K times 2^28: undone exactly in fp32 (split_emulation.py, since removed,
# docs/kernels.md: the same error as tf32x3 on each of the kernels' products).  The keys' backward's P^T g is lifted by
# the fp16 path's per-split power of two (_pow2_scale, GSCALE).
H_Q = tl.constexpr(512.0)
H_K = tl.constexpr(16384.0)
H_S = tl.constexpr(1.0 / 8388608.0)        # 1 / (H_Q H_K)
H_PK = tl.constexpr(1.0 / 268435456.0)     # 1 / (H_K H_K)
H_QINV = tl.constexpr(1.0 / 512.0)


@triton.jit
def _parts2h(x):
    # fp16x3's operand split of a scaled fp32 tile (H_Q / H_K above): x = x0 + x1 + e with x0 =
    # fp16(x), x1 = fp16(x - x0) (the difference exact in fp32), |e| <= 2^-22 |x| where x1 is a
    # normal number: TF32's split precision, on fp16's tensor cores (bf16's rate, twice TF32's)
    x0 = x.to(tl.float16)
    return x0, (x - x0.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot3h(x0, x1, y0, y1, acc, UPCAST: tl.constexpr):
    # acc + x y in fp16x3: x0 y0 + x0 y1 + x1 y0 of _parts2h's parts, smallest first; the dropped
    # x1 y1 is <= 2^-22 |x| |y| (as tf32x3's)
    acc = _dot16(x1, y0, acc, UPCAST)
    acc = _dot16(x0, y1, acc, UPCAST)
    return _dot16(x0, y0, acc, UPCAST)


@triton.jit
def _dot(x, y, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Accumulates in fp32 (fp64 for fp64 operands).  Triton 3.8's interpreter multiplies bf16
    # tiles as raw bits (measured: errors of 1e10 on a 16x16 product), so there the operands are
    # widened to fp32 first: bf16 x bf16 products are exact in fp32, so this is the tensor cores'
    # arithmetic up to the order of the fp32 sums.
    # fp32 operands: the TF32 splits are made here, in the operands' own layout, and each product
    # is a "tf32" dot of values that TF32 holds exactly: x y ~ xb yb + xb ys + xs yb (tf32x3, the
    # dropped xs ys is ~2^-22 relative), or xb yb alone (tf32).  Triton's own tf32x3 splits inside
    # the dot-operand layout, which holds whole split tiles in registers and spilled at every D
    # (tools/compile_check.py); and written out like this the interpreter computes exactly what
    # the tensor cores do, so CI measures the GPU's fp32 error, not an exact product.
    if UPCAST:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    if x.dtype == tl.float64:
        return tl.dot(x, y, input_precision="ieee", out_dtype=tl.float64)
    if x.dtype == tl.float32:
        if PRECISION == "ieee":
            return tl.dot(x, y, input_precision="ieee")
        xb = _round_tf32(x)
        yb = _round_tf32(y)
        out = tl.dot(xb, yb, input_precision="tf32")
        if PRECISION == "tf32x3":
            # an infinite operand's small part is inf - inf = NaN: with tf32x3 an infinite key
            # gives a NaN logit, not +-inf (a select here spilled registers: compile check)
            out = tl.dot(xb, _round_tf32(y - yb), out, input_precision="tf32")
            out = tl.dot(_round_tf32(x - xb), yb, out, input_precision="tf32")
        return out
    return tl.dot(x, y, out_dtype=tl.float32)


@triton.jit
def _grad_r(r, zt):
    # d loss / d r = sig(r) - (1 + zt) / 2 written as (tanh(r / 2) - zt) / 2 (docs/math.md
    # [M:grad-r], [M:stable]): sig(r) - 1/2 cancels for small |r|, and with the GPU's ex2.approx
    # (2 ulp) the difference lost 2.6e-4 of its relative precision at |r| ~ 1e-3 (measured,
    # tests/test_loss_numerics.py); _tanh's polynomial keeps it.
    return 0.5 * (_tanh(0.5 * r) - zt)


# The per-row quantities below (lse_i, bern_i, loss_i) are those of docs/math.md [M:rows], [M:bern].
@triton.jit
def _noise_and_tanh(A, NOISE, SEED, seed_val, rows64, cols, mask, D, stride_a, stride_m, p,
                    write_noise, ACC: tl.constexpr, SEEDED: tl.constexpr):
    # (m, z = tanh(a)) of a row tile, in ACC.  SEEDED (kernels/nac_noise_triton.py seed_args):
    # the channel noise is drawn here from the seed at SEED (1) or seed_val (2: drawn on the
    # host) (docs/math.md [M:philox]: element e = row * D + col of the (n, D) noise, the bits of
    # kernels/nac_noise_triton.py) and, when write_noise, written to NOISE (contiguous,
    # stride_m = D) for the finish and the backward: one launch and one round trip of the noise
    # fewer than drawing it first.  Else (0) NOISE is read.
    a = tl.load(A + rows64[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(ACC)
    noise_at = NOISE + rows64[:, None] * stride_m + cols[None, :]
    if SEEDED != 0:
        m = seed_sign(rows64[:, None] * D + cols[None, :], SEED, seed_val, p, SEEDED)
        if write_noise:
            tl.store(noise_at, m.to(NOISE.dtype.element_ty), mask=mask)
        m = m.to(ACC)
    else:
        m = tl.load(noise_at, mask=mask, other=0.0).to(ACC)
    return m, _tanh(a)


@triton.jit
def _store3(P, off, x0, x1, x2, mask, part, NP: tl.constexpr = 3):
    # the NP part tiles (bf16x6: 3, fp16x3: 2, x2 unused) at P + off, P + part + off, ... (an
    # (NP, rows, D) tensor: `part` = rows x D)
    tl.store(P + off, x0, mask=mask)
    tl.store(P + part + off, x1, mask=mask)
    if NP == 3:
        tl.store(P + 2 * part + off, x2, mask=mask)


@triton.jit
def _load3(P, off, mask, part, NP: tl.constexpr = 3):
    # the part tiles _store3 wrote (zeros where masked); NP = 2: (x0, x1, x1)
    x0 = tl.load(P + off, mask=mask, other=0.0)
    x1 = tl.load(P + part + off, mask=mask, other=0.0)
    x2 = x1
    if NP == 3:
        x2 = tl.load(P + 2 * part + off, mask=mask, other=0.0)
    return x0, x1, x2


@triton.jit
def _store_parts(P, off, x, mask, part, RNE: tl.constexpr, NP: tl.constexpr = 3):
    # the parts of the fp32 tile x, stored by _store3: bf16x6's (_parts3), or (NP = 2) fp16x3's
    # of x as given (scaled by the caller: H_Q, H_K)
    if NP == 3:
        x0, x1, x2 = _parts3(x, RNE)
        _store3(P, off, x0, x1, x2, mask, part)
    else:
        x0, x1 = _parts2h(x)
        _store3(P, off, x0, x1, x1, mask, part, 2)


@triton.jit(do_not_specialize=["n", "write_k", "seed_val"])
def _prologue_kernel(A, NOISE, Q, K, SEED, seed_val, n, D, stride_a, stride_m, scale2, write_k, p,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                     SEEDED: tl.constexpr, PARTS: tl.constexpr, RNE: tl.constexpr):
    # The in-batch forward's codes: Q = s log2(e) m z and the keys K = z (with given keys the
    # forward kernel makes its own Q tile: no prologue, `fwd_plan`).  PARTS 3 (fp32 in bf16x6):
    # Q and K are (3, n, D) bf16, the parts of _parts3; PARTS 2 (fp16x3): (2, n, D) fp16, the
    # parts of Q H_Q and K H_K (_parts2h).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    m, z = _noise_and_tanh(A, NOISE, SEED, seed_val, rows64, cols, mask, D, stride_a, stride_m,
                           p, True, ACC, SEEDED)
    out = rows64[:, None] * D + cols[None, :]
    if PARTS != 0:
        part = n.to(tl.int64) * D
        QH: tl.constexpr = H_Q if PARTS == 2 else 1.0  # fp16x3's fixed scales
        KH: tl.constexpr = H_K if PARTS == 2 else 1.0
        _store_parts(Q, out, m * z * (scale2 * QH), mask, part, RNE, PARTS)
        if write_k != 0:
            _store_parts(K, out, z * KH, mask, part, RNE, PARTS)
    else:
        tl.store(Q + out, _rn(m * z * scale2, Q.dtype.element_ty, RNE), mask=mask)
        if write_k != 0:
            tl.store(K + out, _rn(z, K.dtype.element_ty, RNE), mask=mask)


@triton.jit(do_not_specialize=["N"])
def _parts_kernel(X, OUT, N, D, stride_x, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                  RNE: tl.constexpr):
    # Given fp32 keys in bf16x6: their (3, N, D) parts for the forward and the keys' backward
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    _store_parts(OUT, rows64[:, None] * D + cols[None, :], x, mask, N.to(tl.int64) * D, RNE)


@triton.jit
def _own_key(s, d, KEY_ROWS: tl.constexpr):
    # docs/math.md [M:self-key]: the logits tile s with each query's own key set to -inf, its
    # probability 0.  Query rows (KEY_ROWS False: s is queries x keys, the forward's) or query
    # columns (KEY_ROWS: keys x queries, the keys' backward's): query c of the tile has its own
    # key at key c + d of the tile, d = (the first query + self_offset) - the first key.  Every
    # tile runs the compare and select, branch-free: a branch taken only by the tiles that hold
    # an own key kept both versions of the tile live, and the fp32 (tf32x3) 32 x 32 x 128
    # configurations spilled 300 to 600 B on sm_80 and sm_90 (tools/compile_check.py).
    R: tl.constexpr = s.shape[0]
    C: tl.constexpr = s.shape[1]
    if KEY_ROWS:
        own = tl.arange(0, R)[:, None] - d == tl.arange(0, C)[None, :]
    else:
        own = tl.arange(0, C)[None, :] - d == tl.arange(0, R)[:, None]
    return tl.where(own, float("-inf"), s)


@triton.jit
def _lse_step(s, kmask, j0, end, m_i, l_i, BLOCK_N: tl.constexpr, SELF: tl.constexpr = False):
    # One key tile of the online base-2 logsumexp [M:lse-online]: the logits S of keys past `end`
    # set to -inf only in a tile that crosses it; returns (new max, alpha = exp2(old - new max),
    # P = exp2(S - new max), the new running sum).  SELF (the own key left out, [M:self-key]): a
    # row whose keys so far are all -inf (its own the only one) has max -inf, and its exps are
    # taken from 0 instead (exp2(-inf - 0) = 0, not NaN).
    if j0 + BLOCK_N > end:
        s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SELF:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fwd_tile(q, kp, j0, end, offs, dmask, m_i, l_i, acc, own0, BLOCK_N: tl.constexpr,
              GRAD: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              SELF: tl.constexpr = False):
    # One key tile of the forward's loop: S = Q K^T, online base-2 logsumexp, acc += P K.  kp:
    # the tile's first key row (a 64-bit pointer the loop advances), offs: 32-bit offsets within
    # the tile.  Keys past `end` are masked at the load, and their logits set to -inf only in a
    # tile that crosses `end` (a branch uniform over the program: no select per logit in the
    # split's whole tiles).  SELF: the query rows' own keys left out (_own_key), own0 = the
    # program's first row + self_offset.
    kmask = j0 + tl.arange(0, BLOCK_N) < end
    k = tl.load(kp + offs, mask=kmask[:, None] & dmask[None, :], other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST)
    if SELF:
        s = _own_key(s, own0 - j0, False)
    m_new, alpha, p, l_i = _lse_step(s, kmask, j0, end, m_i, l_i, BLOCK_N, SELF)
    if GRAD:
        acc = acc * alpha[:, None] + _dot(_rn(p, k.dtype, UPCAST), k, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _fwd_tile3(q0, q1, q2, kp, part, j0, end, offs, dmask, m_i, l_i, acc, own0,
               BLOCK_N: tl.constexpr, GRAD: tl.constexpr, UPCAST: tl.constexpr,
               NP: tl.constexpr = 3, SELF: tl.constexpr = False):
    # _fwd_tile in bf16x6 (fp32 inputs): the key tile's three parts at kp, kp + part, kp + 2 part;
    # S and P K in _dot6, P split in registers (_parts3).  NP = 2, fp16x3: two fp16 parts, S and
    # P K in _dot3h (acc in units of H_K^2: the kernel undoes it at the store)
    kmask = j0 + tl.arange(0, BLOCK_N) < end
    k0, k1, k2 = _load3(kp, offs, kmask[:, None] & dmask[None, :], part, NP)
    if NP == 3:
        s = _dot6(q0, q1, q2, tl.trans(k0), tl.trans(k1), tl.trans(k2),
                  tl.zeros([q0.shape[0], BLOCK_N], tl.float32), UPCAST)
    else:
        s = _dot3h(q0, q1, tl.trans(k0), tl.trans(k1),
                   tl.zeros([q0.shape[0], BLOCK_N], tl.float32), UPCAST) * H_S
    if SELF:  # the query rows' own keys left out (_fwd_tile's)
        s = _own_key(s, own0 - j0, False)
    m_new, alpha, p, l_i = _lse_step(s, kmask, j0, end, m_i, l_i, BLOCK_N, SELF)
    if GRAD:
        if NP == 3:
            p0, p1, p2 = _parts3(p, UPCAST)
            acc = _dot6(p0, p1, p2, k0, k1, k2, acc * alpha[:, None], UPCAST)
        else:
            p0, p1 = _parts2h(p * H_K)
            acc = _dot3h(p0, p1, k0, k1, acc * alpha[:, None], UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["n", "N", "tiles_per_split", "seed_val", "red_n", "self_offset"])
def _fwd_kernel(Q, K, PM, PL, PACC, A, NOISE, SEED, seed_val, R, RV, LOSS, LSE, GA, PART, COUNT,
                OUT, ROWCNT, n, N, D, stride_k, stride_a, stride_m, stride_r, stride_rv,
                tiles_per_split, scale2, flip_p, s_fin, l2, log_n_keys, red_n, self_offset,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                GRAD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, Q_FROM_A: tl.constexpr, SEEDED: tl.constexpr,
                FINISH: tl.constexpr, VI: tl.constexpr, REDUCE: tl.constexpr,
                FIN_M: tl.constexpr, SELF: tl.constexpr):
    # Q_FROM_A (given keys: no prologue): the program makes its own Q tile from a and the noise
    # (_noise_and_tanh, the prologue's arithmetic: the same bits) and the first split's programs
    # write it (and a seeded noise) for the backward and the finish.  Else Q is the prologue's.
    # FINISH (the finish folded in; NAC_FAST_FOLD=0: _finish_kernel's own launch): the split
    # programs of a query block count themselves in at ROWCNT[block]; the last to arrive runs
    # _finish_rows over the block, FIN_M rows at a time (`_fin_rows`; REDUCE: a partial sum per
    # chunk, and the last block to finish adds them), with R, RV, LOSS, LSE, GA, PART, COUNT,
    # OUT, s_fin, l2, log_n_keys, red_n, VI and REDUCE as _finish_kernel's.
    # SELF (self_offset >= 0, docs/math.md [M:self-key]): row i's own key, key self_offset + i,
    # left out of its logsumexp (_own_key in the tiles that hold it; log_n_keys is then
    # log(N - 1)); without it self_offset is not read and the kernel is the paper's.
    pid_m = tl.program_id(0)
    sp = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n
    dmask = cols < D
    rows64 = rows.to(tl.int64)
    q_at = Q + rows64[:, None] * D + cols[None, :]
    qmask = rmask[:, None] & dmask[None, :]
    if PRECISION == "bf16x6":
        # fp32 in bf16x6: Q and K are (3, rows, D) bf16 parts (the prologue's, or _parts_kernel's
        # for given keys; with Q_FROM_A made here), the loop as the 16-bit one below
        qpart = n.to(tl.int64) * D
        if Q_FROM_A:
            m, z = _noise_and_tanh(A, NOISE, SEED, seed_val, rows64, cols, qmask, D, stride_a,
                                   stride_m, flip_p, sp == 0, ACC, SEEDED)
            q0, q1, q2 = _parts3(m * z * scale2, UPCAST)
            if sp == 0:
                _store3(q_at, 0, q0, q1, q2, qmask, qpart)
        else:
            q0, q1, q2 = _load3(q_at, 0, qmask, qpart)
    elif PRECISION == "fp16x3":
        # fp32 in fp16x3 (in-batch only: the prologue's (2, n, D) fp16 parts; given keys run
        # bf16x6, `fwd_plan`)
        tl.static_assert(not Q_FROM_A, "fp16x3 takes the prologue's Q")
        q0, q1, q2 = _load3(q_at, 0, qmask, n.to(tl.int64) * D, 2)
    elif Q_FROM_A:
        m, z = _noise_and_tanh(A, NOISE, SEED, seed_val, rows64, cols, qmask, D, stride_a,
                               stride_m, flip_p, sp == 0, ACC, SEEDED)
        q = _rn(m * z * scale2, Q.dtype.element_ty, UPCAST)
        if sp == 0:
            tl.store(q_at, q, mask=qmask)
    else:
        q = tl.load(q_at, mask=qmask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    start = sp * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, N)
    own0 = pid_m * BLOCK_M + self_offset  # the own key of the block's first row (SELF)
    if PRECISION == "bf16x6" or PRECISION == "fp16x3":
        # fp32 in 16-bit parts: three bf16 (bf16x6) or two fp16 (fp16x3) part tiles per key tile
        NP: tl.constexpr = 3 if PRECISION == "bf16x6" else 2
        kpart = N.to(tl.int64) * D
        offs = tl.arange(0, BLOCK_N)[:, None] * D + cols[None, :]
        kp = K + start.to(tl.int64) * D
        for j0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _fwd_tile3(q0, q1, q2, kp, kpart, j0, end, offs, dmask, m_i, l_i, acc,
                                       own0, BLOCK_N, GRAD, UPCAST, NP, SELF)
            kp += BLOCK_N * D
        if NP == 2:
            acc = acc * H_PK  # fp16x3's P K came out in units of H_K^2
    elif BLOCK_D == 128 and (q.dtype == tl.bfloat16 or q.dtype == tl.float16):
        # the tuned 16-bit paths (CANDIDATES): pointers advanced by the loop, the key mask's
        # select only in a tile that crosses the split's end (_fwd_tile).  Elsewhere this cost
        # registers or spilled (fp32 tf32x3, fp64, other D; tools/compile_check.py, 2026-11-27):
        # there the loop stays as it was.
        offs = tl.arange(0, BLOCK_N)[:, None] * stride_k + cols[None, :]
        kp = K + start.to(tl.int64) * stride_k
        for j0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _fwd_tile(q, kp, j0, end, offs, dmask, m_i, l_i, acc, own0, BLOCK_N,
                                      GRAD, PRECISION, UPCAST, SELF)
            kp += BLOCK_N * stride_k
    else:
        for j0 in range(start, end, BLOCK_N):
            kc = j0 + tl.arange(0, BLOCK_N)
            kmask = kc < end
            k = tl.load(K + kc.to(tl.int64)[:, None] * stride_k + cols[None, :],
                        mask=kmask[:, None] & dmask[None, :], other=0.0)
            s = _dot(q, tl.trans(k), PRECISION, UPCAST)
            s = tl.where(kmask[None, :], s, float("-inf"))
            if SELF:  # the own keys left out, and a row with none left here: _lse_step's
                s = _own_key(s, own0 - j0, False)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_sub)
                p = tl.exp2(s - m_sub[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if GRAD:
                acc = acc * alpha[:, None] + _dot(_rn(p, k.dtype, UPCAST), k, PRECISION,
                                                  UPCAST)
            m_i = m_new
    part = sp.to(tl.int64) * n + rows64
    tl.store(PM + part, m_i, mask=rmask)
    tl.store(PL + part, l_i, mask=rmask)
    if GRAD:
        tl.store(PACC + part[:, None] * D + cols[None, :], acc,
                 mask=rmask[:, None] & dmask[None, :])
    if FINISH:
        if _last_of(ROWCNT + pid_m, tl.num_programs(1)):
            tl.atomic_xchg(ROWCNT + pid_m, 0, sem="relaxed")
            row0 = pid_m * BLOCK_M
            for c0 in range(row0, tl.minimum(row0 + BLOCK_M, n), FIN_M):
                tot = _finish_rows(c0 + tl.arange(0, FIN_M), cols, n, D, A, R, NOISE, PM, PL,
                                   PACC, LOSS, LSE, GA, RV, stride_a, stride_r, stride_m,
                                   stride_rv, tl.num_programs(1), GRAD, s_fin, l2, log_n_keys,
                                   FIN_M, BLOCK_D, ACC, VI, REDUCE, True)
                if REDUCE:
                    tl.store(PART + c0 // FIN_M, tot)
            if REDUCE:
                _sum_parts(PART, tl.cdiv(n, FIN_M), COUNT, OUT, red_n, ACC)


@triton.jit
def _bern2(zt, r, mask):
    # 2 bern_i [M:bern]: sum_d z~ r + log sig(r) + log sig(-r), over the row tile's mask
    ar = tl.abs(r)
    log_sig_pair = -ar - 2.0 * tl.log(1.0 + tl.exp(-ar))  # log sig(r) + log sig(-r)
    return tl.sum(tl.where(mask, zt * r + log_sig_pair, 0.0), 1)


@triton.jit
def _last_of(COUNT, total):
    # Whether this program is the last of `total` programs to count itself in at COUNT (an int32,
    # zero before the launch; the last program zeroes it again for the next call,
    # tl.atomic_xchg(COUNT, 0)).  The count is one thread's scalar atomic (acq_rel): the barrier
    # before it orders every thread's earlier memory accesses of this program before the count,
    # so the last program sees all the others' stores (it reads them with volatile loads: no
    # stale L1 line), and its own writes come after all their reads (without it a late warp's
    # read could follow the last program's write: the PTX had no barrier before the atomic).
    tl.debug_barrier()
    return tl.atomic_add(COUNT, 1, sem="acq_rel") == total - 1


@triton.jit
def last_to_arrive(COUNT):
    # `_last_of` over the grid's first axis.  The finish's reduction and the queue's enqueue
    # (kernels/queue_triton.py) use it.
    return _last_of(COUNT, tl.num_programs(0))


@triton.jit
def _sum_parts(PART, nparts, COUNT, OUT, red_n, ACC: tl.constexpr):
    # The finish's reduction: the last program of the grid's first axis to arrive at COUNT
    # (`last_to_arrive`) sums PART[0:nparts] in program order (REDUCE_BLOCK at a time), writes
    # the sum divided by red_n to OUT, and zeroes COUNT for the next call.
    if last_to_arrive(COUNT):
        tot = tl.zeros([REDUCE_BLOCK], ACC)
        for i in range(0, nparts, REDUCE_BLOCK):
            idx = i + tl.arange(0, REDUCE_BLOCK)
            tot += tl.load(PART + idx, mask=idx < nparts, other=0.0, volatile=True)
        tl.store(OUT, tl.sum(tot, 0) / red_n.to(ACC))
        tl.atomic_xchg(COUNT, 0, sem="relaxed")


@triton.jit
def _finish_rows(rows, cols, n, D, A, R, NOISE, PM, PL, PACC, LOSS, LSE, GA, RV, stride_a,
                 stride_r, stride_m, stride_rv, split, grad, s, l2, log_n_keys,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                 VI: tl.constexpr, REDUCE: tl.constexpr, VOLATILE: tl.constexpr):
    # The finish of the BLOCK_M rows `rows` [M:rows]: the key splits' (max, sum, acc) merged, then loss
    # (LOSS; REDUCE: returned as the rows' sum instead), the logsumexp in base 2 (LSE) and ga
    # (GA, when grad).  VOLATILE: the splits' partials (and a seeded noise) were written by other
    # programs of the same launch (the finish folded into _fwd_kernel).
    rmask = rows < n
    tile_mask = rmask[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    a = tl.load(A + rows64[:, None] * stride_a + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
    r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
    m = tl.load(NOISE + rows64[:, None] * stride_m + cols[None, :], mask=tile_mask,
                other=0.0, volatile=VOLATILE).to(ACC)
    z = _tanh(a)
    zt = m * z

    # merge the key splits: a run-time loop (a static one unrolls up to 64 copies)
    mx = tl.full([BLOCK_M], float("-inf"), ACC)
    for sp in range(0, split):
        mx = tl.maximum(mx, tl.load(PM + sp * n + rows64, mask=rmask, other=float("-inf"),
                                    volatile=VOLATILE))
    big_l = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for sp in range(0, split):
        part = sp * n + rows64
        l_s = tl.load(PL + part, mask=rmask, other=0.0, volatile=VOLATILE)
        # an empty split (l_s = 0) weighs nothing; a NaN one poisons the row
        w = tl.where(l_s != 0, tl.exp2(tl.load(PM + part, mask=rmask, other=0.0,
                                               volatile=VOLATILE) - mx), 0.0)
        big_l += w * l_s
        if grad != 0:
            acc += w[:, None] * tl.load(PACC + part[:, None] * D + cols[None, :], mask=tile_mask,
                                        other=0.0, volatile=VOLATILE)
    big_l = tl.where(rmask, big_l, 1.0)
    lse2 = mx + tl.log2(big_l)  # base 2, saved as is: a round trip through ln would cost ~1e-6
    lse = lse2 * 0.6931471805599453
    bern2 = _bern2(zt, r, tile_mask)
    zz = tl.sum(z * z, 1)
    loss = lse - log_n_keys - 0.5 * bern2 + l2 * zz
    if VI:
        rv = tl.load(RV + rows64[:, None] * stride_rv + cols[None, :], mask=tile_mask,
                     other=0.0).to(ACC)
        loss -= 0.5 * _bern2(zt, rv, tile_mask)
    if not REDUCE:
        tl.store(LOSS + rows64, loss, mask=rmask)
    tl.store(LSE + rows64, lse2, mask=rmask)
    if grad != 0:
        mean_key = acc / big_l[:, None]
        ga = (m * (s * mean_key - 0.5 * r) + 2.0 * l2 * z) * (1.0 - z * z)
        tl.store(GA + rows64[:, None] * D + cols[None, :], ga, mask=tile_mask)
    return tl.sum(tl.where(rmask, loss, 0.0), 0)


@triton.jit(do_not_specialize=["n", "split", "grad", "red_n"])
def _finish_kernel(A, R, NOISE, PM, PL, PACC, LOSS, LSE, GA, RV, PART, COUNT, OUT, n, D,
                   stride_a, stride_r, stride_m, stride_rv, split, grad, s, l2, log_n_keys,
                   red_n, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                   VI: tl.constexpr, REDUCE: tl.constexpr):
    # The finish as its own launch (NAC_FAST_FOLD=0; else it is _fwd_kernel's FINISH).
    # VI: NAC-MQ's inference term [M:vi] added to each row, -bern_i(z~, r_vi) with the logits RV
    # of the online inference network and the same z~ = m z (a constant of that term).
    # REDUCE (reduction "mean"/"sum"): no per-row LOSS; OUT = the sum of the rows' losses divided
    # by red_n (n for the mean, 1 for the sum) in ACC, each program's partial sum to
    # PART, and the program that finishes last (COUNT, zero before the launch and left zero)
    # adding them in program order: deterministic, and one launch (torch's mean) fewer.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tot = _finish_rows(rows, tl.arange(0, BLOCK_D), n, D, A, R, NOISE, PM, PL, PACC, LOSS, LSE,
                       GA, RV, stride_a, stride_r, stride_m, stride_rv, split, grad, s, l2,
                       log_n_keys, BLOCK_M, BLOCK_D, ACC, VI, REDUCE, False)
    if REDUCE:
        tl.store(PART + tl.program_id(0), tot)
        _sum_parts(PART, tl.num_programs(0), COUNT, OUT, red_n, ACC)


@triton.jit
def _pow2_scale(gmax):
    # (2^k, 2^-k) with gmax * 2^k in [2^13, 2^14): the power of two that lifts the keys'
    # backward's P^T g products (P <= 1) to the top of fp16's range before they are rounded to
    # fp16 for the tensor cores, and its exact inverse, applied to the fp32 accumulator at the
    # store (docs/math.md [M:grad-scale]).  From the exponent bits of gmax (plain integer ops: the
    # interpreter runs them; exact, no lg2.approx), clamped so both are normal fp32 numbers
    # (gmax = 0: 2^126; inf/NaN: 2^-115, which keeps them inf/NaN).  The same function as
    # csrc/nac_math.h's nac::pow2_scale (the CUDA kernel's).
    e = (gmax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    b = tl.minimum(tl.maximum(267 - e, 2), 253)
    return (b << 23).to(tl.float32, bitcast=True), ((254 - b) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bwd_tile(k, qp, lp, gp, i0, end, offs, dmask, stride_g, g_scale, gscale, dk, own0,
              BLOCK_M: tl.constexpr,
              ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              SELF: tl.constexpr = False):
    # One query tile of the keys' backward: S^T = K Q^T, P^T = exp2(S^T - lse) g, dK += P^T Q.
    # qp, lp, gp: the tile's first row of Q, LSE, G (pointers the loop advances); rows past `end`
    # load lse = inf, so their P is 0.  SELF: each query's own key left out (_own_key: S^T = -inf,
    # P = 0), own0 = self_offset - the program's first key.
    r = tl.arange(0, BLOCK_M)
    rmask = i0 + r < end
    q = tl.load(qp + offs, mask=rmask[:, None] & dmask[None, :], other=0.0)
    lse2 = tl.load(lp + r, mask=rmask, other=float("inf")).to(ACC)  # base 2
    st = _dot(k, tl.trans(q), PRECISION, UPCAST)                   # S^T: keys x queries
    if SELF:
        st = _own_key(st, i0 + own0, True)
    # g loaded after the product: loaded before it, its (BLOCK_M,) vector was live across the
    # product and Triton 3.6 spilled 32 B at 128 x 64, 4 warps (the tuned in-batch winner;
    # tools/compile_check.py under the device's Triton, docs/gpu.md)
    g = tl.load(gp + r * stride_g, mask=rmask, other=0.0).to(ACC) * g_scale * gscale
    pt = tl.exp2(st - lse2[None, :]) * g[None, :]
    return dk + _dot(_rn(pt, q.dtype, UPCAST), q, PRECISION, UPCAST)  # P^T Q (log2 units)


@triton.jit
def _bwd_tile3(k0, k1, k2, qp, part, lp, gp, i0, end, offs, dmask, stride_g, g_scale, dk, own0,
               BLOCK_M: tl.constexpr, UPCAST: tl.constexpr, NP: tl.constexpr, gscale,
               SELF: tl.constexpr = False):
    # _bwd_tile in bf16x6 (fp32 inputs): the query tile's three parts at qp, qp + part,
    # qp + 2 part; S^T and P^T Q in _dot6, P^T split in registers (_parts3).  NP = 2, fp16x3: two
    # fp16 parts, P^T g lifted by gscale (GSCALE), dK in units of gscale H_Q (undone at the end)
    r = tl.arange(0, BLOCK_M)
    rmask = i0 + r < end
    q0, q1, q2 = _load3(qp, offs, rmask[:, None] & dmask[None, :], part, NP)
    lse2 = tl.load(lp + r, mask=rmask, other=float("inf"))  # base 2
    if NP == 3:
        st = _dot6(k0, k1, k2, tl.trans(q0), tl.trans(q1), tl.trans(q2),
                   tl.zeros([k0.shape[0], BLOCK_M], tl.float32), UPCAST)
        if SELF:  # the queries' own keys left out (_bwd_tile's)
            st = _own_key(st, i0 + own0, True)
        g = tl.load(gp + r * stride_g, mask=rmask, other=0.0) * g_scale
        p0, p1, p2 = _parts3(tl.exp2(st - lse2[None, :]) * g[None, :], UPCAST)
        dk = _dot6(p0, p1, p2, q0, q1, q2, dk, UPCAST)       # P^T Q (log2 units)
    else:
        st = _dot3h(k0, k1, tl.trans(q0), tl.trans(q1),
                    tl.zeros([k0.shape[0], BLOCK_M], tl.float32), UPCAST) * H_S
        if SELF:
            st = _own_key(st, i0 + own0, True)
        g = tl.load(gp + r * stride_g, mask=rmask, other=0.0) * g_scale * gscale
        p0, p1 = _parts2h(tl.exp2(st - lse2[None, :]) * g[None, :])
        dk = _dot3h(p0, p1, q0, q1, dk, UPCAST)
    return dk


@triton.jit(do_not_specialize=["n", "N", "blocks_per_split", "need_r", "stride_g",
                              "self_offset"])
def _bwd_keys_kernel(Q, K, LSE, G, OUT, A, R, NOISE, GA, GRAD_R, GRAD_A, COUNT, n, N, D,
                     stride_k, stride_g, stride_a, stride_r, stride_m, blocks_per_split, need_r,
                     g_scale, self_offset,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                     GSCALE: tl.constexpr, OUT_MODE: tl.constexpr, FIN_M: tl.constexpr,
                     SELF: tl.constexpr):
    # Row i's weight is g_i * g_scale (an fp32 number): 1, or fl32(1/n) for reduction="mean"
    # (nac_fast/ops/nac.py _FusedNAC: no MeanBackward launch; autograd's own g / n on a GPU is
    # g * fl32(1/n) too).  _bwd_rows_kernel's likewise.
    # OUT_MODE 0: this query split's share of dK, fp32, at OUT[sp, key, :] (summed later in a
    #             fixed order: deterministic);
    #          1: (one split) the keys' gradient itself, in OUT's dtype (the keys');
    #          2: (one split, self keys: key j is row j) the rows' backward fused in: OUT = d/da
    #             [M:grad-a] + [M:grad-self-keys], GRAD_R = d/dr [M:grad-r] when need_r, in
    #             their dtype (a's), as _bwd_rows_kernel computes them.
    #          3: (several splits, self keys) the rows' backward folded in: each split's share
    #             as in mode 0, then the last split program of a key block to arrive at
    #             COUNT[block] runs _bwd_rows_kernel's rows' backward (_rows_bwd) over the block,
    #             FIN_M rows at a time: GRAD_A = d/da, GRAD_R = d/dr when need_r, the same bits.
    #             (NAC_FAST_FOLD=0: mode 0 and a _bwd_rows_kernel launch.)
    # SELF (self_offset >= 0, docs/math.md [M:self-key]): query i's own key, key self_offset + i,
    # has P = 0 (_own_key in the tiles that hold one), as in the forward.
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    kc = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    kmask = kc < N
    dmask = cols < D
    tile_mask = kmask[:, None] & dmask[None, :]
    kc64 = kc.to(tl.int64)
    if PRECISION != "bf16x6" and PRECISION != "fp16x3":  # (they load their key parts below)
        k = tl.load(K + kc64[:, None] * stride_k + cols[None, :], mask=tile_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    start = sp * blocks_per_split * BLOCK_M
    end = tl.minimum(start + blocks_per_split * BLOCK_M, n)
    own0 = self_offset - pid_n * BLOCK_N  # (SELF) + a query's index: its own key in this block
    if GSCALE:  # fp16: g scaled by a power of two from this split's max |g| (one pass over g)
        gvec = tl.zeros([BLOCK_M], tl.float32)
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            gvec = tl.maximum(gvec, tl.abs(tl.load(G + rows.to(tl.int64) * stride_g,
                                                   mask=rows < end, other=0.0) * g_scale))
        gscale, ginv = _pow2_scale(tl.max(gvec, 0))
    else:
        gscale = 1.0
    if PRECISION == "bf16x6" or PRECISION == "fp16x3":
        # fp32 in 16-bit parts: K and Q are (3, rows, D) bf16 (bf16x6) or (2, rows, D) fp16
        # (fp16x3, GSCALE: the plan sets it) parts, the loop as the 16-bit one below
        NP: tl.constexpr = 3 if PRECISION == "bf16x6" else 2
        k0, k1, k2 = _load3(K, kc64[:, None] * D + cols[None, :], tile_mask, N.to(tl.int64) * D,
                            NP)
        offs = tl.arange(0, BLOCK_M)[:, None] * D + cols[None, :]
        start64 = start.to(tl.int64)
        qp = Q + start64 * D
        lp = LSE + start64
        gp = G + start64 * stride_g
        qpart = n.to(tl.int64) * D
        for i0 in range(start, end, BLOCK_M):
            dk = _bwd_tile3(k0, k1, k2, qp, qpart, lp, gp, i0, end, offs, dmask, stride_g,
                            g_scale, dk, own0, BLOCK_M, UPCAST, NP, gscale, SELF)
            qp += BLOCK_M * D
            lp += BLOCK_M
            gp += BLOCK_M * stride_g
        if NP == 2:
            dk = dk * H_QINV  # fp16x3's Q parts were Q H_Q
    elif BLOCK_D == 128 and (k.dtype == tl.bfloat16 or k.dtype == tl.float16):
        # the tuned 16-bit paths: pointers advanced by the loop (_bwd_tile); elsewhere the loop
        # stays as it was (as in _fwd_kernel)
        offs = tl.arange(0, BLOCK_M)[:, None] * D + cols[None, :]
        start64 = start.to(tl.int64)
        qp = Q + start64 * D
        lp = LSE + start64
        gp = G + start64 * stride_g
        for i0 in range(start, end, BLOCK_M):
            dk = _bwd_tile(k, qp, lp, gp, i0, end, offs, dmask, stride_g, g_scale, gscale, dk,
                           own0, BLOCK_M,
                           ACC, PRECISION, UPCAST, SELF)
            qp += BLOCK_M * D
            lp += BLOCK_M
            gp += BLOCK_M * stride_g
    else:
        for i0 in range(start, end, BLOCK_M):
            rows = i0 + tl.arange(0, BLOCK_M)
            rmask = rows < end
            rows64 = rows.to(tl.int64)
            q = tl.load(Q + rows64[:, None] * D + cols[None, :],
                        mask=rmask[:, None] & dmask[None, :], other=0.0)
            lse2 = tl.load(LSE + rows64, mask=rmask, other=float("inf")).to(ACC)  # base 2
            g = tl.load(G + rows64 * stride_g, mask=rmask, other=0.0).to(ACC) * g_scale * gscale
            st = _dot(k, tl.trans(q), PRECISION, UPCAST)                   # S^T: keys x queries
            if SELF:
                st = _own_key(st, i0 + own0, True)
            pt = tl.exp2(st - lse2[None, :]) * g[None, :]
            dk += _dot(_rn(pt, q.dtype, UPCAST), q, PRECISION, UPCAST)     # P^T Q (log2 units)
    if GSCALE:
        dk = dk * (0.6931471805599453 * ginv)
    else:  # ln 2 as a literal, in the accumulator's dtype: fp64's is not rounded to fp32 (an
        # assigned 1.0 factor would be an fp32 scalar and take ln 2 to fp32 with it)
        dk = dk * 0.6931471805599453
    if OUT_MODE == 0 or OUT_MODE == 3:
        tl.store(OUT + (sp.to(tl.int64) * N + kc64[:, None]) * D + cols[None, :], dk,
                 mask=tile_mask)
        if OUT_MODE == 3:
            if _last_of(COUNT + pid_n, tl.num_programs(1)):
                tl.atomic_xchg(COUNT + pid_n, 0, sem="relaxed")
                key0 = pid_n * BLOCK_N
                for c0 in range(key0, tl.minimum(key0 + BLOCK_N, N), FIN_M):
                    _rows_bwd(c0 + tl.arange(0, FIN_M), cols, A, R, NOISE, GA, G, OUT, GRAD_A,
                              GRAD_R, A, A, n, D, stride_a, stride_r, stride_m, 0, stride_g, 1,
                              need_r, 0, 1, tl.num_programs(1), g_scale, FIN_M, BLOCK_D, ACC,
                              True, UPCAST)
    elif OUT_MODE == 1:
        tl.store(OUT + kc64[:, None] * D + cols[None, :], _rn(dk, OUT.dtype.element_ty, UPCAST),
                 mask=tile_mask)
    else:
        # in an order that keeps few (BLOCK_N x BLOCK_D) tiles live at once (a spill otherwise):
        # dK (1 - z^2), then d/dr (z's last use), then + g ga
        g = tl.load(G + kc64 * stride_g, mask=kmask, other=0.0).to(ACC) * g_scale
        z = _tanh(tl.load(A + kc64[:, None] * stride_a + cols[None, :], mask=tile_mask,
                          other=0.0).to(ACC))
        dk = dk * (1.0 - z * z)
        if need_r != 0:
            r = tl.load(R + kc64[:, None] * stride_r + cols[None, :], mask=tile_mask,
                        other=0.0).to(ACC)
            zt = tl.load(NOISE + kc64[:, None] * stride_m + cols[None, :], mask=tile_mask,
                         other=0.0).to(ACC) * z
            tl.store(GRAD_R + kc64[:, None] * D + cols[None, :],
                     _rn(g[:, None] * _grad_r(r, zt), GRAD_R.dtype.element_ty, UPCAST),
                     mask=tile_mask)
        out = kc64[:, None] * D + cols[None, :]
        dk += g[:, None] * tl.load(GA + out, mask=tile_mask, other=0.0)
        tl.store(OUT + out, _rn(dk, OUT.dtype.element_ty, UPCAST), mask=tile_mask)


@triton.jit
def _rows_bwd(rows, cols, A, R, NOISE, GA, G, PDK, GRAD_A, GRAD_R, RV, GRAD_RV, n, D, stride_a,
              stride_r, stride_m, stride_rv, stride_g, need_a, need_r, need_rv, self_keys, split,
              g_scale, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
              VOLATILE: tl.constexpr, RNE: tl.constexpr):
    # d/dr = g times docs/math.md [M:grad-r]; d/da as in [M:grad-a] (+ [M:grad-self-keys]), dK
    # summed over the keys' backward's query splits in a fixed order (deterministic); all
    # written in their own dtype (a's).  need_rv: the inference term's d/dr_vi [M:vi], the same
    # formula as d/dr with r_vi (z~ is a constant of that term: nothing of it reaches a).
    # VOLATILE: the split shares PDK were written by other programs of the same launch (the keys'
    # backward's OUT_MODE 3).
    rmask = rows < n
    tile_mask = rmask[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    out = rows64[:, None] * D + cols[None, :]
    g = tl.load(G + rows64 * stride_g, mask=rmask, other=0.0).to(ACC) * g_scale
    z = _tanh(tl.load(A + rows64[:, None] * stride_a + cols[None, :], mask=tile_mask,
                      other=0.0).to(ACC))
    if need_r != 0 or need_rv != 0:
        zt = tl.load(NOISE + rows64[:, None] * stride_m + cols[None, :], mask=tile_mask,
                     other=0.0).to(ACC) * z
        if need_r != 0:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=tile_mask,
                        other=0.0).to(ACC)
            tl.store(GRAD_R + out, _rn(g[:, None] * _grad_r(r, zt), GRAD_R.dtype.element_ty, RNE),
                     mask=tile_mask)
        if need_rv != 0:
            rv = tl.load(RV + rows64[:, None] * stride_rv + cols[None, :], mask=tile_mask,
                         other=0.0).to(ACC)
            tl.store(GRAD_RV + out, _rn(g[:, None] * _grad_r(rv, zt), GRAD_RV.dtype.element_ty,
                                        RNE), mask=tile_mask)
    if need_a != 0:
        ga = g[:, None] * tl.load(GA + out, mask=tile_mask, other=0.0)
        if self_keys != 0:
            dk = tl.zeros([BLOCK_M, BLOCK_D], ACC)
            part = PDK + out
            for _ in range(0, split):
                dk += tl.load(part, mask=tile_mask, other=0.0, volatile=VOLATILE)
                part += n * D  # a 64-bit pointer step: split x n x D may pass 2^31
            ga += dk * (1.0 - z * z)
        tl.store(GRAD_A + out, _rn(ga, GRAD_A.dtype.element_ty, RNE), mask=tile_mask)


@triton.jit(do_not_specialize=["n", "need_a", "need_r", "need_rv", "self_keys", "split",
                              "stride_g"])
def _bwd_rows_kernel(A, R, NOISE, GA, G, PDK, GRAD_A, GRAD_R, RV, GRAD_RV, n, D, stride_a,
                     stride_r, stride_m, stride_rv, stride_g, need_a, need_r, need_rv, self_keys,
                     split, g_scale,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
                     RNE: tl.constexpr):
    # The rows' backward (_rows_bwd) of BLOCK_M rows a program (RNE: the interpreter, _rn).
    _rows_bwd(tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D), A, R,
              NOISE, GA, G, PDK, GRAD_A, GRAD_R, RV, GRAD_RV, n, D, stride_a, stride_r, stride_m,
              stride_rv, stride_g, need_a, need_r, need_rv, self_keys, split, g_scale, BLOCK_M,
              BLOCK_D, ACC, False, RNE)


@triton.jit(do_not_specialize=["numel", "split"])
def _sum_splits_kernel(PDK, OUT, numel, split, BLOCK: tl.constexpr):
    # The keys' gradient from the query splits' fp32 shares, summed in a fixed order
    # (deterministic), written in the keys' dtype.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], PDK.dtype.element_ty)
    part = PDK + offs
    for _ in range(0, split):
        acc += tl.load(part, mask=mask, other=0.0)
        part += numel  # a 64-bit pointer step: split x numel may pass 2^31
    # rounded to nearest on every target (_rn: the GPU's own cast gives the same bits; the
    # interpreter's truncated)
    tl.store(OUT + offs, _rn(acc, OUT.dtype.element_ty, True), mask=mask)


MAX_D = 512
# The most rows of a and of the keys (n, N) the kernels take: their row and key indices are int32
# (program ids, tile loops, a split's end sp T B + T B clamped to N), and those run past the last
# row by up to (64 splits + 1) blocks of <= 128 (split_count's cap; CONFIGS, CANDIDATES): 2^16
# rows of room below 2^31.  At N = 2^31 - 1 the last split's end wrapped negative and its keys were
# skipped (tests/test_loss_numerics.py).  Byte and element offsets are int64 throughout.
MAX_ROWS = INT32_ROWS_MAX
# The widest row stride (elements) of the operands the kernels step through with 32-bit offsets
# in a tile (given keys in the 16-bit forward's loop, _fwd_tile; g in the keys' backward,
# _bwd_tile): a (<= 1024)-row tile then spans under 2^31.  `fwd` / `bwd` copy rows farther apart.
MAX_ROW_STRIDE = 1 << 20


ROW_TILE = 4096  # elements per program of the row-wise kernels (fp64: 1024); `row_tile` sets it


def check_rows(n: int, N: int) -> None:
    """ValueError unless n (a's rows) and N (the keys') are at most MAX_ROWS."""
    for name, rows in (("a", n), ("keys", N)):
        if rows > MAX_ROWS:
            raise ValueError(f"{name} has {rows:,} rows; the Triton NAC kernels take at most "
                             f"{MAX_ROWS:,} (2^31 - 2^16: their row indices are int32)")


def check_self_offset(self_offset, n: int, N: int) -> int:
    """self_offset of n rows against N keys (docs/math.md [M:self-key]), as the compiled ops'
    nac_checks.h check_self_offset: -1 (every key) or o in [0, N - n] with N >= 2 (row i's own
    key, key o + i, left out).  TypeError / ValueError naming self_offset."""
    if isinstance(self_offset, bool) or not isinstance(self_offset, int):
        raise TypeError(f"self_offset must be an int, got {type(self_offset).__name__}")
    if self_offset < -1:
        raise ValueError(f"self_offset must be -1 (every key) or >= 0 (row i's own key is key "
                         f"self_offset + i, left out), got {self_offset}")
    if self_offset >= 0:
        if self_offset > N - n:
            raise ValueError(f"self_offset must lie in [0, N - n] = [0, {N - n}] (row i's own "
                             f"key is key self_offset + i; n = {n}, N = {N}), got {self_offset}")
        if N < 2:
            raise ValueError("self_offset >= 0 needs at least 2 keys (the row's own and one "
                             f"other), got N = {N}")
    return self_offset


def _far_rows(t: torch.Tensor) -> bool:
    """Whether the rows of t lie more than MAX_ROW_STRIDE elements apart (two rows or more)."""
    return t.shape[0] > 1 and t.stride(0) > MAX_ROW_STRIDE


def _check_stride(name: str, t: torch.Tensor) -> None:
    if _far_rows(t):
        raise ValueError(f"{name} has rows {t.stride(0):,} elements apart; the Triton NAC plans "
                         f"take at most {MAX_ROW_STRIDE:,} (32-bit offsets in a tile): pass a "
                         f"contiguous copy (the op does)")


def _rows_block(D: int, dtype: torch.dtype) -> int:
    """Rows per program of the row-wise kernels (prologue, finish, bwd_rows): tiles of ROW_TILE
    elements (1024 in fp64, whose 8-byte values spilled at 4096)."""
    elems = 1024 if dtype == torch.float64 else ROW_TILE
    return max(1, min(64, elems // block_d(D)))


@contextlib.contextmanager
def row_tile(elems: int):
    """ROW_TILE = elems inside the block (tools/autotune.py --rows-sweep times the plans built
    there); the cached plans are dropped on the way in and out, so none outlives its setting."""
    global ROW_TILE
    if elems < 16 or elems & (elems - 1):
        raise ValueError(f"row tile must be a power of two >= 16 elements, got {elems}")
    old = ROW_TILE
    FWD_PLANS.clear()
    BWD_PLANS.clear()
    ROW_TILE = elems
    try:
        yield
    finally:
        ROW_TILE = old
        FWD_PLANS.clear()
        BWD_PLANS.clear()


def config(kernel: str, dtype: torch.dtype, D: int, target: Target, kind: Optional[str] = None,
           n: Optional[int] = None, N: Optional[int] = None,
           device: Optional[torch.device] = None, own: bool = False) -> Config:
    """The block configuration of `kernel` ("fwd", "bwd_keys") for a call: a configuration
    forced by kernels/tuning.py `forced` (the autotune stage, the compile check); else, on a GPU,
    the tuned table's entry for the call's kind ("inbatch" / "queue"), n query rows and N keys
    (kernels/tuning.py `lookup`; not without them); else the first of CONFIGS that fits.  own:
    the kernel leaves each row's own key out (SELF): no tuned table, SELF_CONFIGS in place."""
    if D > MAX_D:
        raise ValueError(f"a must have at most D = {MAX_D} columns (code bits) for the Triton NAC "
                         f"kernels, got D={D}; use backend='reference' or 'cpu'")
    cfg = tuning.forced_config(kernel)
    if cfg is not None:
        return cfg
    if not own:
        cfg = tuning.lookup(kernel, dtype, D, target, kind, n, N, device)
        if cfg is not None:
            return cfg
    return builtin_config(kernel, dtype, D, target, own)


def builtin_config(kernel: str, dtype: torch.dtype, D: int, target: Target,
                   own: bool = False) -> Config:
    """The built-in configuration (the first of CONFIGS that fits the target; the interpreter's
    _INTERP), whatever a tuned table says: the autotune stage's baseline.  own: SELF's
    (SELF_CONFIGS where it has the key)."""
    key = (kernel, _family(dtype, D), block_d(D))
    table = SELF_CONFIGS.get(key) if own else None
    return pick(table or CONFIGS[key], target,
                lambda c: smem_estimate(kernel, c, dtype, D), _INTERP[kernel])


ENV_FOLD = "NAC_FAST_FOLD"


def folding() -> bool:
    """Whether plans fold the row-wise tails into the matrix kernels: the finish into the
    forward (_fwd_kernel FINISH) and the rows' backward into the in-batch keys' backward of
    several splits (_bwd_keys_kernel OUT_MODE 3), two launches fewer a fwd+bwd, the same bits
    but a reduced loss's order of additions (its partial sums by FIN_M-row chunks).
    NAC_FAST_FOLD=0 keeps them separate launches (the benches time both); 1 or unset folds."""
    v = os.environ.get(ENV_FOLD)
    if v is None or v == "1":
        return True
    if v == "0":
        return False
    raise ValueError(f"{ENV_FOLD} must be 0 or 1, got {v!r}")


def call_fp32_mode(dtype: torch.dtype, D: int, kind: str, n: int, N: int,
                   device: torch.device) -> Optional[str]:
    """The fp32 product mode a forward call of `kind` ("inbatch"/"queue") with n rows and N keys
    on `device` takes from the tuned table (kernels/tuning.py `fp32_choice`: the fastest of
    tf32x3, bf16x6 and (in-batch) fp16x3 in the autotune stage's figures at the call's size
    class), or None: not fp32, D above TF32_MAX_D, NAC_FAST_FP32_DOT set (it decides), not a GPU,
    or no such choice in the table (tf32x3 then).  Read when a plan is built, never per cached
    call."""
    if (dtype != torch.float32 or block_d(D) > TF32_MAX_D or device.type != "cuda"
            or os.environ.get("NAC_FAST_FP32_DOT") is not None):
        return None
    return tuning.fp32_choice(block_d(D), kind, n, N, target_of(device), device)


def _given_keys_mode(mode: str) -> str:
    """The mode a call with given keys runs for `mode`: fp16x3's fixed scales hold codes in
    [-1, 1] (the in-batch keys tanh(a)), not any given keys, which run bf16x6 (its parts keep
    fp32's range; its error is the smaller)."""
    return "bf16x6" if mode == "fp16x3" else mode


def fp32_mode_of(D: int, kind: str, n: int, N: int, device) -> str:
    """The fp32 product mode a forward call of `kind` with n rows and N keys on `device` runs in
    (`call_fp32_mode`, else `fp32_precision`; given keys: `_given_keys_mode`): what the benches
    record and bound an fp32 row by."""
    device = torch.device(device)
    with _plan_fp32(call_fp32_mode(torch.float32, D, kind, n, N, device)):
        mode = fp32_precision(D)
    return _given_keys_mode(mode) if kind == "queue" else mode


@contextlib.contextmanager
def _plan_fp32(mode: Optional[str], over_env: bool = False):
    """The plans built inside run fp32 products in `mode` (None: as fp32_precision says)."""
    if mode is None:
        yield
        return
    token = _CALL_FP32.set((mode, over_env))
    try:
        yield
    finally:
        _CALL_FP32.reset(token)


def saved_parts(a: torch.Tensor, keys: Optional[torch.Tensor]) -> tuple:
    """(parts, part dtype) of the codes the forward of (a, keys) saves (`parts_of`: (3, bf16)
    in bf16x6, (2, fp16) in fp16x3, (0, None) as (rows, D) codes in a's dtype): the fake
    forward's shapes must be the real one's."""
    if a.dtype != torch.float32:
        return 0, None
    n, D = a.shape
    N = n if keys is None else keys.shape[0]
    mode = fp32_mode_of(D, "inbatch" if keys is None else "queue", n, N, a.device)
    return PART_MODES.get(mode, (0, None))


@contextlib.contextmanager
def fp32_dot(mode: Optional[str]):
    """NAC_FAST_FP32_DOT = mode inside the block (None: the environment as it is), restored on the
    way out: plans, candidates and estimates made inside follow that fp32 product mode (the
    tools that sweep it: tools/autotune.py, tools/compile_check.py)."""
    if mode is None:
        yield
        return
    if mode not in FP32_PRECISIONS:
        raise ValueError(f"fp32_dot: mode must be one of {', '.join(FP32_PRECISIONS)}, "
                         f"got {mode!r}")
    with _env_set("NAC_FAST_FP32_DOT", mode):
        yield


@contextlib.contextmanager
def fold(on: bool):
    """NAC_FAST_FOLD = 1 / 0 inside the block, restored on the way out: plans made inside fold
    the row-wise tails into the matrix kernels or not (`folding`; tools/compile_check.py plans
    both, the benches time both)."""
    with _env_set(ENV_FOLD, "1" if on else "0"):
        yield


@contextlib.contextmanager
def _env_set(name: str, value: str):
    """os.environ[name] = value inside the block; the caller's value (or its absence) restored
    on the way out."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _dot_consts(dtype: torch.dtype, D: int, device: torch.device) -> dict:
    # UPCAST: the interpreter's widened 16-bit products (bf16x6's and fp16x3's part tiles too)
    return dict(PRECISION=precision(dtype, D),
                UPCAST=device.type == "cpu" and (dtype in (torch.bfloat16, torch.float16)
                                                 or parts_mode(dtype, D)))


def _tl_acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# ---------------------------------------------------------------------------------------------
# Plans: the launches of one call, built from (possibly meta) tensors.
# ---------------------------------------------------------------------------------------------

# The per-call scalars of a forward plan, as functions of (s, l2, p) (kernels/launch.py Plan;
# p: the channel's flip probability, read by a prologue that draws the noise).
def _scale2(s, l2, p, seed=0):
    return s * LOG2E


def _s(s, l2, p, seed=0):
    return float(s)


def _l2(s, l2, p, seed=0):
    return float(l2)


def _p(s, l2, p, seed=0):
    return float(p)


def _seed_val(s, l2, p, seed=0):  # a cached plan's later calls: their host seeds checked too
    return host_seed_value(seed)


def _seed_args(seed):
    """(SEEDED, the SEED tensor or None, seed_val, its Launch.scalars entry): how the kernel that
    makes Q gets the noise (kernels/nac_noise_triton.py seed_args)."""
    seeded, seed_t, seed_val = seed_args(seed)
    scalar = (("seed_val", _seed_val),) if isinstance(seed, int) else ()
    return seeded, seed_t, seed_val, scalar


def _prologue(a, noise, s, launches, seed=None, p=0.0):
    """The in-batch forward's Q (log2 units) and keys K = tanh(a): (n, D) in a's dtype, or in
    bf16x6 (parts_mode) their (3, n, D) bf16 parts.  seed (a one-element int64 tensor or a host
    seed, an int; noise None): the prologue draws the noise of `seed` and `p` into a buffer it
    returns as the noise; else `noise` is read and returned."""
    n, D = a.shape
    parts, pdt = parts_of(a.dtype, D)
    shape, cdt = ((parts, n, D), pdt) if parts else ((n, D), a.dtype)
    q, k = buffer(shape, cdt, a), buffer(shape, cdt, a)
    if seed is not None:
        noise = buffer((n, D), a.dtype, a)
    seeded, seed_t, seed_val, seed_scalar = _seed_args(seed)
    bm = _rows_block(D, a.dtype)
    launches.append(Launch(_prologue_kernel, (cdiv(n, bm),),
                           (a, noise, q, k, a if seed_t is None else seed_t, seed_val, n, D,
                            a.stride(0), noise.stride(0), s * LOG2E, 1, float(p)),
                           dict(BLOCK_M=bm, BLOCK_D=block_d(D), ACC=_tl_acc(a.dtype),
                                SEEDED=seeded, PARTS=parts, RNE=a.device.type == "cpu"), 4, 1,
                           "prologue",
                           (("scale2", _scale2), ("p", _p)) + seed_scalar))
    return q, k, noise


FOLD_ELEMS = 8  # elements a thread holds per tile of a folded tail's chunk (FIN_M rows)


def _fin_rows(bm: int, block: int, num_warps: int, bd: int) -> int:
    """Rows per chunk of a tail folded into a matrix kernel (FIN_M): the row-wise kernel's own
    rows per program (bm), at most the matrix kernel's block, and at most FOLD_ELEMS elements a
    thread per (rows x BLOCK_D) tile at its warps: the tail's tiles and their 64-bit addresses
    add to the kernel's registers (sm_90, bf16, D = 128, tools/compile_check.py: with 4 warps
    the given keys' forward with the inference term at 64 x 128 spilled 120 B in 32-row chunks,
    the keys' backward at 128 x 64, 3 stages, 8 B in 32-row and 4 B in 16-row ones; 8-row
    chunks spill nowhere)."""
    return max(1, min(bm, block, FOLD_ELEMS * 32 * num_warps // bd))


def _split(make, outer_blocks: int, inner_tiles: int, target: Target, waves: int = 1) -> int:
    """The split of a matrix kernel's inner loop for `target`: about `waves` (the configuration's
    Config.waves) waves of programs, a wave being the target's SMs times the resident blocks per
    SM of the kernel as compiled (`Target.programs`, asked of the launch `make(1, probe=True)`:
    the same kernel and specialisation, with one-element stand-ins for the buffers whose size
    depends on the split)."""
    return split_count(outer_blocks, inner_tiles, target.programs(make(1, probe=True)),
                       waves=waves)


def fwd_plan(a, r, noise, keys, s: float, l2: float, grad_rows: bool, target: Target,
             seed=None, p: float = 0.0, rv=None, reduction: str = "none",
             fold: Optional[bool] = None, *, self_offset: int = -1):
    """(launches, (loss, lse, ga, q, k, noise)) of one forward call; loss: the (n,) rows, or with
    reduction "mean"/"sum" their mean/sum, a 0-dim tensor reduced by the finish.  a, r, noise:
    (n, D) with unit column stride, noise in a's dtype; keys: None or (N, D) in a's dtype with unit column
    stride.  q, k: the prologue's codes (k is `keys` when given), which the backward reuses; with
    given keys the forward kernel makes q itself (Q_FROM_A) and there is no prologue.  In bf16x6
    (parts_mode) q and k are (3, rows, D) bf16 parts; given keys' parts come from a
    _parts_kernel launch before the forward, and k is those parts.  seed, p:
    noise None, drawn from this seed by the kernel that makes q, and returned.  rv: None, or the
    (n, D) logits of NAC-MQ's online inference network (a's dtype, unit column stride): each
    row's loss then includes the inference term [M:vi] (the finish's VI).  fold: the finish
    inside the forward (FINISH) or its own launch; None: `folding()`, and a folded forward that
    spills on the target (`Target.clean`) is planned unfolded.  self_offset: -1, every key in
    each row's logsumexp; o >= 0, row i's own key (key o + i) left out and log(N - 1) for log N
    (docs/math.md [M:self-key]; the kernel's SELF)."""
    n, D = a.shape
    check_rows(n, n if keys is None else keys.shape[0])
    check_self_offset(self_offset, n, n if keys is None else keys.shape[0])
    if keys is not None:
        _check_stride("keys", keys)
    if keys is not None and a.dtype == torch.float32 and fp32_precision(D) == "fp16x3":
        with _plan_fp32(_given_keys_mode("fp16x3"), over_env=True):
            return fwd_plan(a, r, noise, keys, s, l2, grad_rows, target, seed, p, rv, reduction,
                            fold, self_offset=self_offset)
    launches: list = []
    parts = parts_mode(a.dtype, D)  # fp32 in bf16x6: q, k are (3, rows, D) bf16 parts
    q_from_a = keys is not None  # given keys: the forward kernel makes its own Q, no prologue
    if q_from_a:
        N = keys.shape[0]
        if parts:  # the keys' parts, made once for the forward and the keys' backward (bf16x6)
            np_, pdt = parts_of(a.dtype, D)
            q, k = buffer((np_, n, D), pdt, a), buffer((np_, N, D), pdt, a)
            bm = _rows_block(D, a.dtype)
            launches.append(Launch(_parts_kernel, (cdiv(N, bm),), (keys, k, N, D, keys.stride(0)),
                                   dict(BLOCK_M=bm, BLOCK_D=block_d(D),
                                        RNE=a.device.type == "cpu"), 4, 1, "parts"))
        else:
            q, k = buffer((n, D), a.dtype, a), keys
        if seed is not None:
            noise = buffer((n, D), a.dtype, a)
    else:
        q, k, noise = _prologue(a, noise, s, launches, seed, p)
        N = n
    stride_k = D if parts else k.stride(0)
    acc = acc_dtype(a.dtype)
    own = self_offset >= 0  # [M:self-key]: the own key left out, log(N - 1)
    cfg = config("fwd", a.dtype, D, target, kind="inbatch" if keys is None else "queue", n=n,
                 N=N, device=a.device, own=own)
    q_blocks, k_tiles = cdiv(n, cfg.BLOCK_M), cdiv(N, cfg.BLOCK_N)
    bd = block_d(D)
    log_n_keys = math.log(N - 1 if own else N)

    seeded, seed_t, seed_val, seed_scalar = _seed_args(seed if q_from_a else None)

    # the finish: folded into the forward (FINISH: the last split program of each query block,
    # fin_m rows at a time), or (NAC_FAST_FOLD=0, or a folded kernel that spills) its own launch
    # of bm rows a program
    fold = folding() if fold is None else fold
    bm = _rows_block(D, a.dtype)
    fin_m = _fin_rows(bm, cfg.BLOCK_M, cfg.num_warps, bd) if fold else bm
    reduce = reduction != "none"
    lse = buffer((n,), acc, a)
    if reduce:  # the finish reduces: partial sums, the last program's counter, the result
        part = buffer((cdiv(n, fin_m),), acc, a)
        count = buffer((1,), torch.int32, a, zero=True)
        loss = out = buffer((), acc, a)
        rows = lse  # not written
    else:
        part = count = out = lse  # not read
        loss = rows = buffer((n,), acc, a)
    ga = buffer((n, D) if grad_rows else (0,), acc, a)
    red_n = n if reduction == "mean" else 1
    rv_ = r if rv is None else rv
    rowcnt = buffer((q_blocks,), torch.int32, a, zero=True) if fold else lse  # lse: not read

    def make(split, probe=False):
        pm, pl = buffer((1,) if probe else (split, n), acc, a), buffer((1,) if probe else
                                                                        (split, n), acc, a)
        pacc = buffer((split, n, D) if grad_rows and not probe else (1,), acc, a)
        return Launch(_fwd_kernel, (q_blocks, split),
                      (q, k, pm, pl, pacc, a, noise, a if seed_t is None else seed_t, seed_val,
                       r, rv_, rows, lse, ga, part, count, out, rowcnt,
                       n, N, D, stride_k, a.stride(0), noise.stride(0), r.stride(0),
                       rv_.stride(0), cdiv(k_tiles, split), s * LOG2E, float(p), float(s),
                       float(l2), log_n_keys, red_n, int(self_offset)),
                      dict(BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=bd,
                           GRAD=bool(grad_rows), ACC=_tl_acc(a.dtype),
                           **_dot_consts(a.dtype, D, a.device), Q_FROM_A=q_from_a,
                           SEEDED=seeded, FINISH=fold, VI=rv is not None, REDUCE=reduce,
                           FIN_M=fin_m, SELF=own),
                      cfg.num_warps, cfg.num_stages, "fwd",
                      (("scale2", _scale2), ("flip_p", _p), ("s_fin", _s), ("l2", _l2))
                      + seed_scalar)

    split = _split(make, q_blocks, k_tiles, target, cfg.waves)
    fwd = make(split)
    if fold and not target.clean(fwd):
        return fwd_plan(a, r, noise, keys, s, l2, grad_rows, target, seed, p, rv, reduction,
                        fold=False, self_offset=self_offset)
    launches.append(fwd)
    if fold:
        return launches, (loss, lse, ga, q, k, noise)
    pm, pl, pacc = fwd.args[2], fwd.args[3], fwd.args[4]
    launches.append(Launch(_finish_kernel, (cdiv(n, bm),),
                           (a, r, noise, pm, pl, pacc, rows, lse, ga, r if rv is None else rv,
                            part, count, out, n, D, a.stride(0), r.stride(0), noise.stride(0),
                            r.stride(0) if rv is None else rv.stride(0), split, int(grad_rows),
                            float(s), float(l2), log_n_keys, red_n),
                           dict(BLOCK_M=bm, BLOCK_D=bd, ACC=_tl_acc(a.dtype), VI=rv is not None,
                                REDUCE=reduce),
                           4, 1, "finish", (("s", _s), ("l2", _l2))))
    return launches, (loss, lse, ga, q, k, noise)


SUM_BLOCK = 1024  # elements per program of _sum_splits_kernel


def _g_scale_arg(g_scale):  # the backward plan's one per-call scalar (kernels/launch.py Plan)
    return float(g_scale)


def bwd_plan(a, r, noise, keys, lse, ga, g, q, k, s: float, need_a: bool, need_r: bool,
             need_keys: bool, target: Target, g_scale: float = 1.0, rv=None,
             need_rv: bool = False, *, self_offset: int = -1):
    """(launches, (grad_a, grad_r, grad_k)) of one backward call, each gradient in its input's
    dtype (an empty (0,) tensor when not asked for; all inputs share a's dtype): the gradients
    of sum_i (g_i g_scale) loss_i (g_scale: an fp32 number; fl32(1/n) folds reduction="mean"
    in, nac_fast/ops/nac.py _FusedNAC).  rv, need_rv: the inference term's logits (fwd_plan's
    rv) and whether its gradient is wanted: then a fourth output, d/drv, in rv's dtype.  q, k: the forward's codes (fwd_plan; k is
    the keys when they are given); g: (n,) float, any stride (an expanded scalar too).  Nothing
    of the forward's O(nD) prologue runs again.

    Launches: the keys' backward (when d/da needs the self keys' part, or the given keys need a
    gradient), then
      - one query split: nothing more with the self keys (the rows' backward is fused into the
        keys' kernel: _bwd_keys_kernel OUT_MODE 2, FUSED_CONFIGS; not where that table says
        None); with given keys, the keys' gradient is written by the keys' kernel (OUT_MODE 1)
        and _bwd_rows_kernel gives d/da, d/dr;
      - several splits: fp32 shares per split, summed in a fixed order by _bwd_rows_kernel (self
        keys) or _sum_splits_kernel (given keys).
    self_offset: the forward's (fwd_plan): the keys' backward leaves each query's own key out."""
    n, D = a.shape
    check_rows(n, n if keys is None else keys.shape[0])
    check_self_offset(self_offset, n, n if keys is None else keys.shape[0])
    _check_stride("g", g)
    if a.dtype == torch.float32:
        # the mode the forward saved its codes in: bf16x6's (3, rows, D) bf16 or fp16x3's (2,
        # rows, D) fp16 parts, else one whose codes are (rows, D) in a's dtype (the
        # environment's; tf32x3 where it names a parts mode), whatever NAC_FAST_FP32_DOT says now
        now = fp32_precision(D)
        want = ({torch.bfloat16: "bf16x6", torch.float16: "fp16x3"}[q.dtype] if q.dim() == 3
                else FP32_PRECISIONS[0] if now in PART_MODES else None)
        if want is not None and now != want:
            with _plan_fp32(want, over_env=True):
                return bwd_plan(a, r, noise, keys, lse, ga, g, q, k, s, need_a, need_r,
                                need_keys, target, g_scale, rv, need_rv, self_offset=self_offset)
    acc = acc_dtype(a.dtype)
    launches: list = []
    self_keys = keys is None
    parts = parts_mode(a.dtype, D)  # bf16x6 / fp16x3: q, k are the forward's parts
    kk = k if self_keys or parts else keys
    N = n if self_keys else keys.shape[0]
    stride_k = D if parts else kk.stride(0)
    bd = block_d(D)
    empty = lambda: buffer((0,), a.dtype, a)  # noqa: E731
    grad_a = buffer((n, D), a.dtype, a) if need_a else empty()
    grad_r = buffer((n, D), a.dtype, a) if need_r else empty()
    grad_k = buffer((N, D), a.dtype, a) if need_keys and not self_keys else empty()
    pdk, split = None, 0
    if (need_a and self_keys) or (need_keys and not self_keys):
        own = self_offset >= 0
        cfg = config("bwd_keys", a.dtype, D, target, kind="inbatch" if self_keys else "queue",
                     n=n, N=N, device=a.device, own=own)
        k_blocks, q_blocks = cdiv(N, cfg.BLOCK_N), cdiv(n, cfg.BLOCK_M)

        # the fused rows' epilogue holds more tiles: its own table where one is given (the
        # split is decided with OUT_MODE 0's: one split there is one with fewer keys per block)
        # (SELF: SELF_FUSED_CONFIGS' entry in place of FUSED_CONFIGS' where it has one)
        fkey = (_family(a.dtype, D), bd)
        fcfg = FUSED_CONFIGS.get(fkey, cfg)
        if own:
            fcfg = SELF_FUSED_CONFIGS.get(fkey, fcfg)
        if not target.arch:
            fcfg = cfg
        fuse = self_keys and fcfg is not None
        # several splits, self keys: the rows' backward folded in (OUT_MODE 3), its counters
        # (with self keys the keys' backward runs for d/da alone: need_a)
        fold = self_keys and folding()
        kcount = buffer((k_blocks,), torch.int32, a, zero=True) if fold else None

        def make(split, mode=0, probe=False):
            c = fcfg if mode == 2 else cfg
            out = (buffer((1,) if probe else (split, N, D), acc, a) if mode in (0, 3) else
                   grad_k if mode == 1 else grad_a)
            # the rows' operands only where the kernel reads them (OUT_MODE 2, 3); else
            # stand-ins
            rows = ((a, r if need_r else a, noise if need_r else a, ga, grad_r if need_r else out)
                    if mode in (2, 3) else (out,) * 5)
            return Launch(_bwd_keys_kernel, (cdiv(N, c.BLOCK_N), split),
                          (q, kk, lse, g, out, *rows, grad_a if mode == 3 else out,
                           kcount if mode == 3 else out, n, N, D, stride_k, g.stride(0),
                           a.stride(0), r.stride(0), noise.stride(0), cdiv(n, c.BLOCK_M * split)
                           if split == 1 else cdiv(q_blocks, split),
                           int(need_r and mode in (2, 3)), float(g_scale), int(self_offset)),
                          dict(BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_D=bd,
                               # fp16 operand tiles (fp16, fp32 in fp16x3): P^T g lifted
                               ACC=_tl_acc(a.dtype), GSCALE=torch.float16 in (
                                   a.dtype, parts_of(a.dtype, D)[1]),
                               OUT_MODE=mode, **_dot_consts(a.dtype, D, a.device),
                               FIN_M=_fin_rows(_rows_block(D, a.dtype), c.BLOCK_N,
                                               c.num_warps, bd), SELF=self_offset >= 0),
                          c.num_warps, c.num_stages,
                          "bwd_keys" if mode == 0 else f"bwd_keys_out{mode}",
                          (("g_scale", _g_scale_arg),))

        # the split from the occupancy of the kernel the plan launches with several splits; a
        # folded kernel that spills on the target (`Target.clean`) is not launched: the split
        # shares and the rows' backward of their own instead
        split = _split(lambda sp, probe=False: make(sp, 3 if fold else 0, probe),
                       k_blocks, q_blocks, target, cfg.waves)
        folded = None
        if fold and not (split == 1 and fuse):
            folded = make(split, 3)
            if not target.clean(folded):
                folded = None
                split = _split(make, k_blocks, q_blocks, target, cfg.waves)
        if split == 1 and (fuse or not self_keys):
            launches.append(make(1, 2 if self_keys else 1))
            if self_keys:
                return launches, (grad_a, grad_r, grad_k)
        elif folded is not None:
            launches.append(folded)
            return launches, (grad_a, grad_r, grad_k)
        else:
            launches.append(make(split))
            pdk = launches[-1].args[4]
            if not self_keys:
                numel = N * D
                launches.append(Launch(_sum_splits_kernel, (cdiv(numel, SUM_BLOCK),),
                                       (pdk, grad_k, numel, split), dict(BLOCK=SUM_BLOCK), 4, 1,
                                       "sum_splits"))
    need_rv = bool(need_rv and rv is not None)
    grad_rv = buffer((n, D), rv.dtype, a) if need_rv else None
    if need_a or need_r or need_rv:
        bm = _rows_block(D, a.dtype)
        self_dk = need_a and self_keys
        # stand-in for the operands a flag leaves unread
        out = grad_a if need_a else grad_r if need_r else grad_rv
        launches.append(Launch(
            _bwd_rows_kernel, (cdiv(n, bm),),
            (a, r if need_r else out, noise if need_r or need_rv else out,
             ga if need_a else out, g, pdk if self_dk else out, grad_a, grad_r,
             rv if need_rv else out, grad_rv if need_rv else out, n, D, a.stride(0),
             r.stride(0), noise.stride(0), rv.stride(0) if need_rv else 0, g.stride(0),
             int(need_a), int(need_r), int(need_rv), int(self_dk), split if self_dk else 0,
             float(g_scale)),
            dict(BLOCK_M=bm, BLOCK_D=bd, ACC=_tl_acc(a.dtype), RNE=a.device.type == "cpu"), 4, 1,
            "bwd_rows",
            (("g_scale", _g_scale_arg),)))
    if rv is not None:
        return launches, (grad_a, grad_r, grad_k, grad_rv if need_rv else empty())
    return launches, (grad_a, grad_r, grad_k)


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------

def _rows_operand(t, dtype):
    """t in `dtype` with unit column stride (rows may be strided)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


# One cache per op: a plan is recorded once per key and bound to every later call with that key
# (kernels/launch.py Plan): shapes, row strides, dtype, device, flags, and what else the plan
# reads (NAC_FAST_FP32_DOT and the tuning settings: kernels/tuning.py plan_key).  Tracing (torch.compile, fake tensors) builds the plan afresh.
FWD_PLANS = PlanCache("nac_fwd_triton")
BWD_PLANS = PlanCache("nac_bwd_triton")


def _launcher(launches):
    run(launches)  # the module's `run`, looked up at each call (a caller may swap it)


def fwd(a, r, noise, keys, s: float, l2: float, grad_rows: bool, seed=None, p: float = 0.0,
        rv=None, reduction: str = "none", self_offset: int = -1):
    """The forward op's body (nac_fwd_triton): (loss, lse2, ga, q, k, noise) with k empty when
    keys are given (the backward reads the keys themselves; in bf16x6, k is their parts).  noise
    None: `seed` (a one-element int64 tensor on a's device, or an int drawn on the host: the
    kernel's argument) and `p` give
    it, drawn by the kernel that makes q; either way the noise used is returned last (the
    backward's).  rv: fwd_plan's (the rows then include NAC-MQ's inference term).  reduction
    "mean"/"sum" (eager calls): loss is the rows' mean/sum, reduced by the finish.  self_offset:
    fwd_plan's (-1: every key; o >= 0: row i's own key, key o + i, left out, [M:self-key])."""
    check_self_offset(self_offset, a.shape[0], a.shape[0] if keys is None else keys.shape[0])
    dt = a.dtype
    a = _rows_operand(a, dt)
    r = _rows_operand(r, dt)
    rv = None if rv is None else _rows_operand(rv, dt)
    if noise is None:
        if seed is None:
            raise ValueError("fwd needs the noise or a seed to draw it from")
        if not isinstance(seed, int):
            seed = seed_operand(seed)
    else:
        noise = _rows_operand(noise, dt)
        seed = None
    given = None if keys is None else _rows_operand(keys, dt)
    if given is not None and _far_rows(given):
        given = given.contiguous()  # rows too far apart for the tile's 32-bit offsets

    def build():
        n, D = a.shape
        mode = call_fp32_mode(dt, D, "inbatch" if given is None else "queue", n,
                              n if given is None else given.shape[0], a.device)
        with _plan_fp32(mode):
            launches, (loss, lse, ga, q, k, m) = fwd_plan(a, r, noise, given, s, l2, grad_rows,
                                                          target_of(a.device), seed, p, rv,
                                                          reduction, self_offset=self_offset)
        # given keys: the backward reads the keys themselves, or (in bf16x6) their parts, k
        keep_k = keys is None or k.dim() == 3
        return launches, (loss, lse, ga, q, k if keep_k else buffer((0,), dt, a), m)

    key = (a.shape, a.stride(0), r.stride(0), None if noise is None else noise.stride(0), dt,
           a.device, None if given is None else (given.shape[0], given.stride(0)),
           None if rv is None else rv.stride(0), bool(grad_rows), isinstance(seed, int),
           reduction, self_offset, tuning.plan_key()) if eager_real(a) else None
    host = isinstance(seed, int)
    return FWD_PLANS(key, build, (a, r, noise, given, None if host else seed, rv),
                     (s, l2, p, seed if host else 0), _launcher)


def bwd(a, r, noise, keys, lse, ga, g, q, k, s: float, need_a: bool, need_r: bool,
        need_keys: bool, g_scale: float = 1.0, rv=None, need_rv: bool = False,
        self_offset: int = -1):
    """The backward op's body (nac_bwd_triton): (d/da, d/dr, d/dkeys) of sum_i (g_i g_scale)
    loss_i in the inputs' dtype (g_scale: `bwd_plan`'s); with rv (the forward's), d/drv too.
    self_offset: the forward's."""
    check_self_offset(self_offset, a.shape[0], a.shape[0] if keys is None else keys.shape[0])
    dt = a.dtype
    acc = acc_dtype(dt)
    a = _rows_operand(a, dt)
    r = _rows_operand(r, dt)
    rv = None if rv is None else _rows_operand(rv, dt)
    noise = _rows_operand(noise, dt)
    given = None if keys is None else _rows_operand(keys, dt)
    lse = lse if lse.dtype == acc and lse.is_contiguous() else lse.to(acc).contiguous()
    ga = ga if ga.dtype == acc and ga.is_contiguous() else ga.to(acc).contiguous()
    g = g if g.dtype == acc else g.to(acc)
    if _far_rows(g):
        g = g.contiguous()  # rows too far apart for the tile's 32-bit offsets

    def build():
        return bwd_plan(a, r, noise, given, lse, ga, g, q, k, s, need_a, need_r, need_keys,
                        target_of(a.device), g_scale, rv, need_rv, self_offset=self_offset)

    key = (a.shape, a.stride(0), r.stride(0), noise.stride(0), dt, a.device,
           None if given is None else (given.shape[0], given.stride(0)), g.shape, g.stride(),
           ga.shape, q.shape, q.stride(0), k.shape, k.stride(0) if k.dim() == 2 else 0,
           None if rv is None else rv.stride(0), bool(need_a), bool(need_r), bool(need_keys),
           bool(need_rv), self_offset, tuning.plan_key()) if eager_real(a) else None
    return BWD_PLANS(key, build, (a, r, noise, given, lse, ga, g, q, k, rv), (g_scale,),
                     _launcher)


@triton_op("nac_fast::nac_fwd_triton", mutates_args=())
def nac_fwd_triton(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor,
                   keys: Optional[torch.Tensor], s: float, l2: float, grad_rows: bool,
                   self_offset: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    return fwd(a, r, noise, keys, s, l2, grad_rows, self_offset=self_offset)[:5]


@triton_op("nac_fast::nac_bwd_triton", mutates_args=())
def nac_bwd_triton(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor,
                   keys: Optional[torch.Tensor], lse: torch.Tensor, ga: torch.Tensor,
                   g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, s: float, need_a: bool,
                   need_r: bool, need_keys: bool, self_offset: int = -1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return bwd(a, r, noise, keys, lse, ga, g, q, k, s, need_a, need_r, need_keys,
               self_offset=self_offset)
