"""Triton kernels of the NAC losses (backend="triton"), installed as `nac_fast.kernels.nac_triton`.

Same contract as the C++/CUDA ops (csrc/nac_cpu.cpp, csrc/nac_math.h):

    q_i = s m_i tanh(a_i)                       k_j = keys_j (or tanh(a_j) for the in-batch keys)
    lse_i  = log sum_j exp(q_i . k_j)
    loss_i = lse_i - log N - 1/2 sum_d [z~ r + log sig(r) + log sig(-r)] + l2 ||z_i||^2
    fwd -> (loss_i, lse_i, ga_i = d loss_i / d a_i through row i's own terms)
    bwd -> gradients of sum_i g_i loss_i; keys: sum_i g_i P_ij q_i, P_ij = exp(q_i . k_j - lse_i)

Kernels:
  _fwd_kernel      grid (query blocks, key splits): q tile in registers, loop over key tiles, online
                   logsumexp in base 2 (s * log2(e) folded into q, exp2), and when gradients are
                   wanted acc += P k in the same loop (flash-attention forward; keys need no
                   second pass for the rows' gradient).  Key splits keep every SM busy when there
                   are few query blocks (n = 8192 with 128-row blocks is 64 programs for 132 SMs).
  _finish_kernel   merges the splits' (max, sum, acc) and writes loss, lse and ga.
  _bwd_keys_kernel grid (key blocks, query splits): column-parallel, each program owns its keys'
                   gradient (no atomics; splits summed in a fixed order: deterministic).
  _bwd_rows_kernel d/dr and d/da = g ga [+ dK (1 - z^2) for the self keys], elementwise.
The logits never exist in memory: one (BLOCK_M x BLOCK_N) tile lives in registers.

The interpreter (TRITON_INTERPRET=1, CPU tensors, what CI runs) has no tanh: _tanh below is the
same polynomial/exp formula as csrc/nac_math.h, on the GPU too, so CI checks the math the GPU runs.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from nac_fast.reference import acc_dtype

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    # The nac_math.h formula (the interpreter has no tanh): Cephes' odd polynomial below 0.625,
    # 1 - 2 / (exp(2|x|) + 1) above.  2 sigmoid(2x) - 1 alone loses all relative precision near 0
    # (measured: 5e-4 relative error in the keys' gradient for codes of size 1e-4).
    ax = tl.abs(x)
    # where, not tl.minimum: minimum(NaN, 40) is 40 on the GPU (minnum), which turned a NaN into +1
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
def _dot(x, y, PRECISION: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr):
    # Triton 3.8's interpreter multiplies bf16 tiles as raw bits (measured: errors of 1e10 on a
    # 16x16 product), so there the bf16 operands are widened to fp32 first.  bf16 x bf16 products
    # are exact in fp32, so this is the tensor cores' arithmetic up to the order of the fp32 sums.
    if UPCAST:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee", out_dtype=ACC)
    return tl.dot(x, y, input_precision=PRECISION, out_dtype=ACC)


@triton.jit
def _sigmoid(r):
    # nac_math.h's stable form: exp(-|r|) never overflows (tl.sigmoid(r) evaluates exp(-r)).
    e = tl.exp(-tl.abs(r))
    inv = 1.0 / (1.0 + e)
    return tl.where(r >= 0, inv, e * inv)


@triton.jit(do_not_specialize=["n", "N"])
def _fwd_kernel(A, NOISE, K, PM, PL, PACC, n, N, D, stride_a, stride_k, scale2, tiles_per_split,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                GRAD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    sp = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n
    dmask = cols < D
    tile_mask = rmask[:, None] & dmask[None, :]
    a = tl.load(A + rows[:, None] * stride_a + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
    m = tl.load(NOISE + rows[:, None] * stride_a + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
    q = (m * _tanh(a) * scale2).to(K.dtype.element_ty)  # log2 units: exp2 below

    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    start = sp * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, N)
    for j0 in range(start, end, BLOCK_N):
        kc = j0 + tl.arange(0, BLOCK_N)
        kmask = kc < end
        k = tl.load(K + kc[:, None] * stride_k + cols[None, :],
                    mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, ACC, UPCAST)
        s = tl.where(kmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if GRAD:
            acc = acc * alpha[:, None] + _dot(p.to(k.dtype), k, PRECISION, ACC, UPCAST)
        m_i = m_new
    tl.store(PM + sp * n + rows, m_i, mask=rmask)
    tl.store(PL + sp * n + rows, l_i, mask=rmask)
    if GRAD:
        tl.store(PACC + (sp * n + rows[:, None]) * BLOCK_D + cols[None, :], acc, mask=tile_mask)


@triton.jit(do_not_specialize=["n"])
def _finish_kernel(A, R, NOISE, PM, PL, PACC, LOSS, LSE, GA, n, D, stride_a, s, l2, log_n_keys,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   GRAD: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n
    dmask = cols < D
    tile_mask = rmask[:, None] & dmask[None, :]
    offs = rows[:, None] * stride_a + cols[None, :]
    a = tl.load(A + offs, mask=tile_mask, other=0.0).to(ACC)
    r = tl.load(R + offs, mask=tile_mask, other=0.0).to(ACC)
    m = tl.load(NOISE + offs, mask=tile_mask, other=0.0).to(ACC)
    z = _tanh(a)
    zt = m * z

    mx = tl.full([BLOCK_M], float("-inf"), ACC)
    for sp in tl.static_range(SPLIT):
        mx = tl.maximum(mx, tl.load(PM + sp * n + rows, mask=rmask, other=float("-inf")))
    big_l = tl.zeros([BLOCK_M], ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    for sp in tl.static_range(SPLIT):
        l_s = tl.load(PL + sp * n + rows, mask=rmask, other=0.0)
        # != 0, not > 0: a split whose sum is NaN must poison the row, not drop out of it
        w = tl.where(l_s != 0, tl.exp2(tl.load(PM + sp * n + rows, mask=rmask, other=0.0) - mx),
                     0.0)
        big_l += w * l_s
        if GRAD:
            acc += w[:, None] * tl.load(PACC + (sp * n + rows[:, None]) * BLOCK_D + cols[None, :],
                                        mask=tile_mask, other=0.0)
    big_l = tl.where(rmask, big_l, 1.0)
    lse = (mx + tl.log2(big_l)) * 0.6931471805599453
    ar = tl.abs(r)
    log_sig_pair = -ar - 2.0 * tl.log(1.0 + tl.exp(-ar))
    bern2 = tl.sum(tl.where(tile_mask, zt * r + log_sig_pair, 0.0), 1)
    zz = tl.sum(z * z, 1)
    loss = lse - log_n_keys - 0.5 * bern2 + l2 * zz
    tl.store(LOSS + rows, loss, mask=rmask)
    tl.store(LSE + rows, lse, mask=rmask)
    if GRAD:
        mean_key = acc / big_l[:, None]
        ga = (m * (s * mean_key - 0.5 * r) + 2.0 * l2 * z) * (1.0 - z * z)
        tl.store(GA + rows[:, None] * D + cols[None, :], ga, mask=tile_mask)


@triton.jit(do_not_specialize=["n", "N"])
def _bwd_keys_kernel(A, NOISE, K, LSE, G, PDK, n, N, D, stride_a, stride_k, scale2, s,
                     blocks_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    sp = tl.program_id(1)
    kc = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    kmask = kc < N
    dmask = cols < D
    k = tl.load(K + kc[:, None] * stride_k + cols[None, :], mask=kmask[:, None] & dmask[None, :],
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], ACC)
    start = sp * blocks_per_split * BLOCK_M
    end = tl.minimum(start + blocks_per_split * BLOCK_M, n)
    for i0 in range(start, end, BLOCK_M):
        rows = i0 + tl.arange(0, BLOCK_M)
        rmask = rows < end
        tile_mask = rmask[:, None] & dmask[None, :]
        a = tl.load(A + rows[:, None] * stride_a + cols[None, :], mask=tile_mask, other=0.0).to(ACC)
        m = tl.load(NOISE + rows[:, None] * stride_a + cols[None, :], mask=tile_mask,
                    other=0.0).to(ACC)
        zt = m * _tanh(a)
        lse2 = tl.load(LSE + rows, mask=rmask, other=float("inf")).to(ACC) * 1.4426950408889634
        g = tl.load(G + rows, mask=rmask, other=0.0).to(ACC)
        sc = _dot((zt * scale2).to(k.dtype), tl.trans(k), PRECISION, ACC, UPCAST)
        p = tl.exp2(sc - lse2[:, None]) * g[:, None]
        dk += _dot(tl.trans(p.to(k.dtype)), (zt * s).to(k.dtype), PRECISION, ACC, UPCAST)
    tl.store(PDK + (sp * N + kc[:, None]) * BLOCK_D + cols[None, :], dk,
             mask=kmask[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["n"])
def _bwd_rows_kernel(A, R, NOISE, GA, G, DK, GRAD_A, GRAD_R, n, D, stride_a, stride_dk,
                     NEED_A: tl.constexpr, NEED_R: tl.constexpr, SELF_KEYS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    # d/dr = g (sig(r) - (1 + z~)/2);  d/da = g ga [+ dK (1 - z^2) for the self keys tanh(a)]
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < n
    tile_mask = rmask[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * stride_a + cols[None, :]
    out = rows[:, None] * D + cols[None, :]
    g = tl.load(G + rows, mask=rmask, other=0.0).to(ACC)
    z = _tanh(tl.load(A + offs, mask=tile_mask, other=0.0).to(ACC))
    if NEED_R:
        r = tl.load(R + offs, mask=tile_mask, other=0.0).to(ACC)
        zt = tl.load(NOISE + offs, mask=tile_mask, other=0.0).to(ACC) * z
        tl.store(GRAD_R + out, g[:, None] * (_sigmoid(r) - 0.5 * (1.0 + zt)), mask=tile_mask)
    if NEED_A:
        ga = g[:, None] * tl.load(GA + out, mask=tile_mask, other=0.0)
        if SELF_KEYS:
            dk = tl.load(DK + rows[:, None] * stride_dk + cols[None, :], mask=tile_mask, other=0.0)
            ga += dk * (1.0 - z * z)
        tl.store(GRAD_A + out, ga, mask=tile_mask)


# ---------------------------------------------------------------------------------------------
# Launch configuration
# ---------------------------------------------------------------------------------------------

def _tl_acc(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _precision(dtype):
    # fp32 inputs: exact IEEE products by default (TF32 would cost ~3e-4 relative error, over the
    # 1e-5 budget of the tests); NAC_FAST_TF32=1 opts in.
    if dtype == torch.float32 and os.environ.get("NAC_FAST_TF32", "0") == "1":
        return "tf32"
    return "ieee"


def _config(device: torch.device, D: int):
    """Block sizes.  GPU: 128-row query blocks (the queue is re-read once per 128 queries);
    interpreter: bigger key tiles, because each loop iteration is a numpy call."""
    block_d = max(16, triton.next_power_of_2(D))
    if device.type == "cuda":
        block_n = 64 if block_d <= 128 else 32
        return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=8, num_stages=2)
    return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_D=block_d, num_warps=4, num_stages=1)


def _upcast(a: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.dtype == torch.bfloat16  # interpreter only, see _dot


def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return int(os.environ.get("NAC_FAST_TRITON_CPU_PROGRAMS", "4"))  # exercises the splits in CI


def _split(n_blocks: int, n_tiles: int, device) -> int:
    """How many ways to split the other dimension so ~2 programs per SM exist; a power of two
    (the finish kernel is specialised on it), at most the number of tiles."""
    want = max(1, -(-_num_programs_target(device) // n_blocks))
    split = 1
    while split * 2 <= min(want, n_tiles, 64):
        split *= 2
    return split


def _keys_of(a, keys):
    return torch.tanh(a) if keys is None else keys


def _plan(a, N, split_keys: bool):
    """Block sizes, grid extents and the split of the inner dimension for a launch over `a`'s rows
    and N keys: split_keys splits the keys (forward), else the queries (keys' backward)."""
    n, D = a.shape
    cfg = _config(a.device, D)
    q_blocks, k_blocks = triton.cdiv(n, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"])
    outer, inner = (q_blocks, k_blocks) if split_keys else (k_blocks, q_blocks)
    split = _split(outer, inner, a.device)
    launch = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_D"],
                  ACC=_tl_acc(a.dtype), PRECISION=_precision(a.dtype), UPCAST=_upcast(a),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return launch, outer, split, triton.cdiv(inner, split)


@triton_op("nac_fast::nac_fwd_triton", mutates_args=())
def nac_fwd_triton(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor,
                   keys: Optional[torch.Tensor], s: float, l2: float,
                   grad_rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = a.contiguous()
    r = r.contiguous()
    noise = noise.to(a.dtype).contiguous()
    k = _keys_of(a, keys).to(a.dtype).contiguous()
    n, D = a.shape
    N = k.shape[0]
    acc = acc_dtype(a.dtype)
    launch, q_blocks, split, tiles_per_split = _plan(a, N, split_keys=True)
    bd = launch["BLOCK_D"]
    pm = torch.empty((split, n), device=a.device, dtype=acc)
    pl = torch.empty((split, n), device=a.device, dtype=acc)
    pacc = torch.empty((split, n, bd) if grad_rows else (1,), device=a.device, dtype=acc)
    wrap_triton(_fwd_kernel)[(q_blocks, split)](
        a, noise, k, pm, pl, pacc, n, N, D, a.stride(0), k.stride(0), s * LOG2E, tiles_per_split,
        GRAD=grad_rows, **launch)
    loss = torch.empty((n,), device=a.device, dtype=acc)
    lse = torch.empty((n,), device=a.device, dtype=acc)
    ga = torch.empty((n, D) if grad_rows else (0,), device=a.device, dtype=acc)
    fin_m = 32
    wrap_triton(_finish_kernel)[(triton.cdiv(n, fin_m),)](
        a, r, noise, pm, pl, pacc, loss, lse, ga, n, D, a.stride(0), s, l2, math.log(N),
        SPLIT=split, BLOCK_M=fin_m, BLOCK_D=bd, GRAD=grad_rows, ACC=_tl_acc(a.dtype),
        num_warps=4)
    return loss, lse, ga


def _keys_grad(a, noise, k, lse, g, s):
    """sum_i g_i P_ij q_i (N x D, accumulation dtype) for the keys k."""
    n, D = a.shape
    N = k.shape[0]
    acc = acc_dtype(a.dtype)
    launch, k_blocks, split, blocks_per_split = _plan(a, N, split_keys=False)
    pdk = torch.empty((split, N, launch["BLOCK_D"]), device=a.device, dtype=acc)
    wrap_triton(_bwd_keys_kernel)[(k_blocks, split)](
        a, noise, k, lse.to(acc).contiguous(), g, pdk, n, N, D, a.stride(0), k.stride(0),
        s * LOG2E, s, blocks_per_split, **launch)
    return (pdk[0] if split == 1 else pdk.sum(0))[:, :D]  # fixed-order sum: deterministic


@triton_op("nac_fast::nac_bwd_triton", mutates_args=())
def nac_bwd_triton(a: torch.Tensor, r: torch.Tensor, noise: torch.Tensor,
                   keys: Optional[torch.Tensor], lse: torch.Tensor, ga: torch.Tensor,
                   g: torch.Tensor, s: float, need_a: bool, need_r: bool,
                   need_keys: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = a.contiguous()
    r = r.contiguous()
    noise = noise.to(a.dtype).contiguous()
    n, D = a.shape
    acc = acc_dtype(a.dtype)
    g = g.to(acc).contiguous()

    def empty():  # outputs must not alias each other: one fresh (0,) tensor each
        return torch.empty((0,), device=a.device, dtype=acc)

    self_keys = keys is None
    dk = empty()
    if (need_a and self_keys) or (need_keys and not self_keys):
        k = _keys_of(a, keys).to(a.dtype).contiguous()
        dk = _keys_grad(a, noise, k, lse, g, s)
    grad_a = torch.empty((n, D), device=a.device, dtype=acc) if need_a else empty()
    grad_r = torch.empty((n, D), device=a.device, dtype=acc) if need_r else empty()
    if need_a or need_r:
        bd = _config(a.device, D)["BLOCK_D"]
        wrap_triton(_bwd_rows_kernel)[(triton.cdiv(n, 32),)](
            a, r, noise, ga, g, dk, grad_a, grad_r, n, D, a.stride(0),
            dk.stride(0) if dk.dim() == 2 else 0, NEED_A=need_a, NEED_R=need_r,
            SELF_KEYS=self_keys, BLOCK_M=32, BLOCK_D=bd, ACC=_tl_acc(a.dtype), num_warps=4)
    grad_k = dk.contiguous() if need_keys and not self_keys else empty()
    return grad_a, grad_r, grad_k
