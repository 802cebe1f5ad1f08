"""The tensor-core kernels' index math (csrc/nac_cuda_mma.cu), checked on the CPU.

The kernels cannot run without a GPU, but what decides whether they multiply the right numbers
is integer arithmetic on lane ids: which element each lane loads into which register, which
shared-memory row each lane hands ldmatrix, which fragment register mma.sync reads.  This file
emulates one warp (32 lanes) with numpy:

  * the hardware, from the PTX ISA's tables (independent of the kernel): ldmatrix.m8n8.x4[.trans]
    .b16 (lanes 8i..8i+7 address the rows of 8 x 8 matrix i; register i of lane 4g+t gets row g,
    columns 2t, 2t+1, or with .trans rows 2t, 2t+1 of column g) and mma.m16n8k16.row.col with
    16-bit inputs and fp32 accumulators ("Matrix Fragments for mma.m16n8k16 with floating point
    type"), cvt.rn.{bf16x2,f16x2}.f32 (first source to the high half);
  * the kernel, from its own source: each index expression the kernel uses (load_resident,
    load_tile, score_tile, accumulate_pt, store_acc, the forward's key mask, the keys' backward's
    query column, pack's operand order) is read out of nac_cuda_mma.cu and evaluated here, so
    an edit to the kernel's index math is what gets tested (an expression no longer found fails
    the test, naming the snippet to re-check against the PTX tables).

Then the emulated tile products are compared with numpy matmuls: S = R T^T (score_tile), acc += P T
with P taken straight from S's accumulators (the C -> A register reuse of accumulate_pt), one
warp's whole forward (online base-2 logsumexp over several key tiles with a partial last tile,
[M:lse-online]; acc = sum_j 2^(S2_ij - m) k_j, [M:ga]) and the keys' backward [M:grad-keys],
for every code width (DPAD 32, 64, 128, 256) and D not a multiple of 8 or 16.  Also: the padded
shared-memory rows make each ldmatrix phase (8 rows of 16 bytes) conflict-free, the block's
cp.async copies cover the tile exactly once, and the grid (blocks x warps x 16 rows; the host's
split plan and each split's [start, end) and tile count) covers every row once.

What this cannot check (needs a GPU): the PTX wrappers' register constraints and asm semantics
beyond the tables, cp.async/barrier ordering, and the numerics of ex2.approx.
"""
import math
import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC_PATH = os.path.join(ROOT, "csrc", "nac_cuda_mma.cu")
with open(SRC_PATH) as fh:
    SRC = fh.read()

LANES = np.arange(32)
DPADS = (32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------
# Reading the kernel's index expressions
# ---------------------------------------------------------------------------------------------

def body(name: str) -> str:
    """The body (braces included) of the device function / kernel `name` in nac_cuda_mma.cu."""
    for m in re.finditer(r"\b" + re.escape(name) + r"\s*\(", SRC):
        head_end = SRC.find("{", m.end())
        if ";" in SRC[m.end():head_end]:  # a call or a declaration, not the definition
            continue
        depth = 0
        for i in range(head_end, len(SRC)):
            depth += {"{": 1, "}": -1}.get(SRC[i], 0)
            if depth == 0:
                return SRC[head_end:i + 1]
    raise AssertionError(f"no definition of {name} in {SRC_PATH}")


def kernel_expr(where: str, snippet: str):
    """`snippet`, an expression of the kernel (must occur verbatim in `where`'s body), as a Python
    function of its variables (lane, t, g, kk, j, nt, e, C's constants...)."""
    assert snippet in body(where), (
        f"{where} in csrc/nac_cuda_mma.cu no longer contains `{snippet}`: its index math changed; "
        "re-derive it against the PTX fragment tables and update this test")
    py = snippet.replace("C::", "").replace(" / ", " // ").replace("&&", "and")
    py = py.replace("||", "or").replace("const int64_t ", "").replace("const int ", "")
    # C's `(cond) ? x : y` (one level, as the kernel writes it) -> Python's conditional
    py = re.sub(r"(\([^()]*\))\s*\?\s*(\w+)\s*:\s*(\w+)", r"(\2 if \1 else \3)", py)
    if " ? " in py and " : " in py:  # a whole-snippet `cond ? x : y`
        cond, rest = py.split(" ? ", 1)
        x, y = rest.rsplit(" : ", 1)
        py = f"(({x}) if ({cond}) else ({y}))"
    try:
        code = compile(py, f"<{where}>", "eval")
    except SyntaxError:  # a statement: checked for presence only
        code = None

    def run(**env):
        assert code is not None, f"`{snippet}` is a statement, not an expression"
        return eval(code, {}, env)
    return run


def cfg(dpad: int) -> dict:
    """Cfg<DPAD>'s constants, as nac_cuda_mma.cu defines them."""
    decl = "kStream = DPAD <= 64 ? 128 : (DPAD == 128 ? 64 : 16)"
    assert decl in SRC, "Cfg<DPAD>::kStream changed: update cfg() in this test"
    assert "kLd = DPAD + 8;" in SRC and "kChunks = DPAD / 8;" in SRC
    assert "constexpr int kWarps = 8;" in SRC
    stream = 128 if dpad <= 64 else (64 if dpad == 128 else 16)
    return dict(DPAD=dpad, kStream=stream, kLd=dpad + 8, kChunks=dpad // 8,
                kKSteps=dpad // 16, kNTiles=stream // 8, kDTiles=dpad // 8, kThreads=256)


# ---------------------------------------------------------------------------------------------
# The hardware, per the PTX ISA (independent of the kernel)
# ---------------------------------------------------------------------------------------------

def ldmatrix_x4(smem: np.ndarray, addr, trans: bool) -> np.ndarray:
    """ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16.  smem: flat 16-bit array; addr[lane]:
    the element offset lane supplies (lanes 8i..8i+7: rows 0..7 of matrix i).  Returns
    regs[lane, i, half] (half 0 = low 16 bits)."""
    addr = np.asarray(addr)
    assert addr.shape == (32,) and all(a % 8 == 0 for a in addr), "rows must be 16-byte aligned"
    mats = np.stack([np.stack([smem[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])
                     for i in range(4)])  # (4, 8 rows, 8 cols)
    regs = np.empty((32, 4, 2), smem.dtype)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            for h in range(2):
                regs[lane, i, h] = mats[i, 2 * t + h, g] if trans else mats[i, g, 2 * t + h]
    return regs


def mma_m16n8k16(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: c[lane, 4] (fp32 C), a[lane, 4, 2]
    (registers a0..a3 as (low, high) halves = elements a0..a7), b[lane, 2, 2].  Returns D."""
    A = np.full((16, 16), np.nan)
    B = np.full((16, 8), np.nan)
    Cm = np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # A element ai: register i // 2, half i % 2
            row = g if (i < 2 or 4 <= i < 6) else g + 8
            col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
            A[row, col] = a[lane, i // 2, i % 2]
        for i in range(4):  # B element bi
            B[2 * t + (i & 1) + (8 if i >= 2 else 0), g] = b[lane, i // 2, i % 2]
        for i in range(4):  # C element ci
            Cm[g + (8 if i >= 2 else 0), 2 * t + (i & 1)] = c[lane, i]
    assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(Cm).any()), "fragment gap"
    Dm = A.astype(np.float64) @ B.astype(np.float64) + Cm
    out = np.empty((32, 4))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            out[lane, i] = Dm[g + (8 if i >= 2 else 0), 2 * t + (i & 1)]
    return out


def c_layout(lane: int, e: int) -> tuple:
    """(row, col) of fp32 accumulator element c_e of `lane` in a 16 x 8 tile (PTX table)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (e >= 2), 2 * t + (e & 1)


def round16(x, dtype: str):
    """Round to the 16-bit type (nearest even), as cvt.rn / __float2*_rn do; returns float64."""
    x = np.asarray(x, np.float64)
    if dtype == "fp16":
        return x.astype(np.float16).astype(np.float64)
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def cvt_pack(src1: float, src2: float, dtype: str) -> tuple:
    """cvt.rn.{f16x2,bf16x2}.f32 d, src1, src2: src1 -> high half, src2 -> low half.
    Returns (low, high)."""
    return round16(src2, dtype), round16(src1, dtype)


# ---------------------------------------------------------------------------------------------
# The kernel's helpers, from its source, on one warp
# ---------------------------------------------------------------------------------------------

def emu_load_resident(src: np.ndarray, row0: int, rows_end: int, chunks: int, C: dict):
    """load_resident: a[lane, kk, q, half] (register q of k-step kk) from global memory."""
    kernel_expr("load_resident", "r_lo = row0 + g, r_hi = row0 + g + 8")
    row_of = kernel_expr("load_resident", "(q & 1) ? r_hi : r_lo")
    col_of = kernel_expr("load_resident", "16 * kk + 2 * t + ((q & 2) ? 8 : 0)")
    inside = kernel_expr("load_resident", "row < rows_end && col < cols")
    cols = chunks * 8
    a = np.zeros((32, C["kKSteps"], 4, 2))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for kk in range(C["kKSteps"]):
            for q in range(4):
                row = row_of(q=q, r_lo=row0 + g, r_hi=row0 + g + 8)
                col = col_of(kk=kk, t=t, q=q)
                if inside(row=row, rows_end=rows_end, col=col, cols=cols):
                    a[lane, kk, q] = src[row, col:col + 2]  # 4-byte load, low half = col
    return a


def emu_load_tile(rows: np.ndarray, row0: int, rows_end: int, chunks: int, C: dict) -> np.ndarray:
    """load_tile: the block's cp.async copies into one (kStream x kLd) buffer, flat; asserts each
    destination chunk is written exactly once and pad columns are never written."""
    r_of = kernel_expr("load_tile", "e / C::kChunks")
    c_of = kernel_expr("load_tile", "e % C::kChunks")
    dst_of = kernel_expr("load_tile", "r * C::kLd + 8 * c")
    passes = kernel_expr("load_tile", "C::kStream * C::kChunks / kThreads")(**C)
    kernel_expr("load_tile", "threadIdx.x + pass * kThreads")
    kernel_expr("load_tile", "row0 + r < rows_end && c < chunks")
    buf = np.full(C["kStream"] * C["kLd"], np.nan)
    written = np.zeros(C["kStream"] * C["kLd"], int)
    for p in range(passes):
        for tid in range(C["kThreads"]):
            e = tid + p * C["kThreads"]
            r, c = r_of(e=e, **C), c_of(e=e, **C)
            dst = dst_of(r=r, c=c, **C)
            valid = row0 + r < rows_end and c < chunks
            buf[dst:dst + 8] = rows[row0 + r, 8 * c:8 * c + 8] if valid else 0.0
            written[dst:dst + 8] += 1
    ld = C["kLd"]
    w = written.reshape(C["kStream"], ld)
    assert (w[:, :C["DPAD"]] == 1).all() and (w[:, C["DPAD"]:] == 0).all()
    return buf


def emu_score_tile(a: np.ndarray, buf: np.ndarray, C: dict, dtype: str) -> np.ndarray:
    """score_tile: s[lane, nt, e] = (this warp's 16 rows) . (the tile's rows)^T."""
    base_of = kernel_expr("score_tile",
                          "((lane & 7) + 8 * (lane >> 4)) * C::kLd + 8 * ((lane >> 3) & 1)")
    off_of = kernel_expr("score_tile", "16 * j * C::kLd + 16 * kk")
    kernel_expr("score_tile", "ldmatrix_x4(b, base + 2 * (16 * j * C::kLd + 16 * kk));")
    kernel_expr("score_tile", "Mma<T>::run(s[2 * j], a[kk], b[0], b[1]);")
    kernel_expr("score_tile", "Mma<T>::run(s[2 * j + 1], a[kk], b[2], b[3]);")
    base = np.array([base_of(lane=lane, **C) for lane in LANES])
    check_bank_conflicts(base, C)
    s = np.zeros((32, C["kNTiles"], 4))
    for kk in range(C["kKSteps"]):
        for j in range(C["kNTiles"] // 2):
            b = ldmatrix_x4(buf, base + off_of(j=j, kk=kk, **C), trans=False)
            s[:, 2 * j] = mma_m16n8k16(s[:, 2 * j], a[:, kk], b[:, 0:2])
            s[:, 2 * j + 1] = mma_m16n8k16(s[:, 2 * j + 1], a[:, kk], b[:, 2:4])
    return s


def emu_accumulate_pt(acc: np.ndarray, s: np.ndarray, buf: np.ndarray, C: dict,
                      dtype: str) -> np.ndarray:
    """accumulate_pt: acc[lane, dt, e] += P . T, P packed from s's C fragments."""
    base_of = kernel_expr("accumulate_pt", "(lane & 15) * C::kLd + 8 * (lane >> 4)")
    off_of = kernel_expr("accumulate_pt", "16 * kk * C::kLd + 16 * j")
    kernel_expr("accumulate_pt", "ldmatrix_x4_trans(b, base + 2 * (16 * kk * C::kLd + 16 * j));")
    kernel_expr("accumulate_pt", "Mma<T>::run(acc[2 * j], p, b[0], b[1]);")
    kernel_expr("accumulate_pt", "Mma<T>::run(acc[2 * j + 1], p, b[2], b[3]);")
    packs = re.findall(r"Mma<T>::pack\(s\[([^\]]+)\]\[(\d)\], s\[([^\]]+)\]\[(\d)\]\)",
                       body("accumulate_pt"))
    assert len(packs) == 4, packs
    # pack(lo, hi): its asm hands cvt (hi, lo), i.e. hi -> high half
    pack_asm = '"=r"(r) : "f"(hi), "f"(lo)'
    assert SRC.count(pack_asm) == 2 and "pack(float lo, float hi)" in SRC, "pack's operand order"
    base = np.array([base_of(lane=lane, **C) for lane in LANES])
    check_bank_conflicts(base, C)
    acc = acc.copy()
    for kk in range(C["kNTiles"] // 2):
        p = np.empty((32, 4, 2))
        for q, (nt_lo, e_lo, nt_hi, e_hi) in enumerate(packs):
            nl = eval(nt_lo, {}, {"kk": kk})
            nh = eval(nt_hi, {}, {"kk": kk})
            for lane in range(32):
                p[lane, q] = cvt_pack(s[lane, nh, int(e_hi)], s[lane, nl, int(e_lo)], dtype)
        for j in range(C["kDTiles"] // 2):
            b = ldmatrix_x4(buf, base + off_of(j=j, kk=kk, **C), trans=True)
            acc[:, 2 * j] = mma_m16n8k16(acc[:, 2 * j], p, b[:, 0:2])
            acc[:, 2 * j + 1] = mma_m16n8k16(acc[:, 2 * j + 1], p, b[:, 2:4])
    return acc


def emu_store_acc(acc: np.ndarray, row0: int, rows_end: int, D: int, C: dict) -> dict:
    """store_acc: {(row, col): value} of what the warp writes."""
    row_of = kernel_expr("store_acc", "row0 + g + 8 * h")
    col_of = kernel_expr("store_acc", "8 * dt + 2 * t + e")
    kernel_expr("store_acc", "o[col] = acc[dt][2 * h + e] * scale")
    out = {}
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            row = row_of(row0=row0, g=g, h=h)
            if row >= rows_end:
                continue
            for dt in range(C["kDTiles"]):
                for e in range(2):
                    col = col_of(dt=dt, t=t, e=e)
                    if col < D:
                        assert (row, col) not in out
                        out[(row, col)] = acc[lane, dt, 2 * h + e]
    return out


def check_bank_conflicts(base: np.ndarray, C: dict):
    """Each 8-lane phase of ldmatrix reads eight 16-byte rows: with rows padded to kLd elements
    they fall in eight distinct 16-byte bank groups (of 128 bytes), for any tile offset that is a
    multiple of 16 elements (what the kernel adds)."""
    for i in range(4):
        groups = {(2 * int(base[8 * i + r]) % 128) // 16 for r in range(8)}
        assert len(groups) == 8, (C["DPAD"], i, sorted(groups))


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def _ints(rng, shape, lo=-3, hi=4):
    """Small integers: exact in fp16 and bf16, and their products' sums exact in float64."""
    return rng.integers(lo, hi, size=shape).astype(np.float64)


def _tile_case(dpad, D, rng):
    C = cfg(dpad)
    chunks = -(-D // 8)
    R = _ints(rng, (40, dpad))
    R[:, D:] = 7.0  # columns >= D must read as zero: a nonzero here would show
    T = _ints(rng, (C["kStream"] + 5, dpad))
    T[:, chunks * 8:] = 9.0  # past the operand's chunks: zero-filled by load_tile
    return C, chunks, R, T


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_score_tile_is_R_times_T_transposed(dpad, dtype):
    rng = np.random.default_rng(dpad)
    D = dpad - 3 if dpad > 32 else 29
    C, _, R, T = _tile_case(dpad, D, rng)
    chunks_r = -(-D // 8)
    R[:, chunks_r * 8:] = 0.0  # the prologue's zero columns (Q2 is (n, dpad), zeros >= D)
    row0, rows_end = 24, 35  # a warp whose last 5 rows are past the operand
    tile_row0, tile_end = 3, 3 + C["kStream"] - 2  # two rows past the end: zero-filled
    a = emu_load_resident(R, row0, rows_end, chunks_r, C)
    buf = emu_load_tile(T, tile_row0, tile_end, chunks_r, C)
    s = emu_score_tile(a, buf, C, dtype)
    Rv = np.where(np.arange(40)[:, None] < rows_end, R, 0)[row0:row0 + 16, :chunks_r * 8]
    Tv = T[tile_row0:tile_row0 + C["kStream"]].copy()
    Tv[tile_end - tile_row0:] = 0
    expect = Rv @ Tv[:, :chunks_r * 8].T  # (16, kStream)
    for lane in range(32):
        for nt in range(C["kNTiles"]):
            for e in range(4):
                r, c = c_layout(lane, e)
                assert s[lane, nt, e] == expect[r, 8 * nt + c], (lane, nt, e)


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_accumulate_pt_reuses_the_accumulators_as_A(dpad, dtype):
    rng = np.random.default_rng(100 + dpad)
    C = cfg(dpad)
    D = dpad - 5
    chunks = -(-D // 8)
    T = _ints(rng, (C["kStream"], dpad))
    buf = emu_load_tile(T, 0, C["kStream"], chunks, C)
    s = _ints(rng, (32, C["kNTiles"], 4), -2, 3) / 4  # exact in 16 bits
    acc0 = _ints(rng, (32, C["kDTiles"], 4))
    acc = emu_accumulate_pt(acc0, s, buf, C, dtype)
    P = np.empty((16, C["kStream"]))
    A0 = np.empty((16, dpad))
    for lane in range(32):
        for e in range(4):
            r, c = c_layout(lane, e)
            for nt in range(C["kNTiles"]):
                P[r, 8 * nt + c] = s[lane, nt, e]
            for dt in range(C["kDTiles"]):
                A0[r, 8 * dt + c] = acc0[lane, dt, e]
    Tz = T.copy()
    Tz[:, chunks * 8:] = 0
    expect = A0 + P @ Tz
    got = emu_store_acc(acc, 0, 16, dpad, C)
    assert len(got) == 16 * dpad
    for (r, c), v in got.items():
        assert v == expect[r, c], (r, c)


def _emu_forward_warp(Q2, K, row0, n, jstart, jend, C, dtype):
    """fwd_mma_kernel for one warp: (m, l) per row (log2 units) and acc (16 x DPAD)."""
    mask = kernel_expr("fwd_mma_kernel", "j0 + 8 * nt + 2 * t + (e & 1) >= jend")
    kernel_expr("fwd_mma_kernel", "mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));")
    kernel_expr("fwd_mma_kernel", "exp2_approx(s[nt][2 * h + e] - m_new)")
    kernel_expr("fwd_mma_kernel", "acc[dt][2 * h] *= alpha;")
    kernel_expr("fwd_mma_kernel", "acc[dt][2 * h + 1] *= alpha;")
    kernel_expr("fwd_mma_kernel", "const int64_t row = row0 + g + 8 * h;")
    chunks = C["kChunks"]
    a = emu_load_resident(Q2, row0, n, chunks, C)
    m_run = np.full((32, 2), -np.inf)
    l_run = np.zeros((32, 2))
    acc = np.zeros((32, C["kDTiles"], 4))
    ntiles = -(-(jend - jstart) // C["kStream"])
    for it in range(ntiles):
        j0 = jstart + it * C["kStream"]
        buf = emu_load_tile(K, j0, jend, chunks, C)
        s = emu_score_tile(a, buf, C, dtype)
        if j0 + C["kStream"] > jend:
            for lane in range(32):
                t = lane % 4
                for nt in range(C["kNTiles"]):
                    for e in range(4):
                        if mask(j0=j0, nt=nt, t=t, e=e, jend=jend):
                            s[lane, nt, e] = -np.inf
        for h in range(2):
            mx = np.max(s[:, :, 2 * h:2 * h + 2], axis=(1, 2))
            # quad_max: xor-shuffles 1 and 2 reduce over lanes 4g..4g+3
            mx = np.maximum.reduce([mx[LANES ^ x] for x in (0, 1, 2, 3)])
            m_new = np.maximum(m_run[:, h], mx)
            alpha = np.where(m_run[:, h] == -np.inf, 0.0, np.exp2(m_run[:, h] - m_new))
            p = np.exp2(s[:, :, 2 * h:2 * h + 2] - m_new[:, None, None])
            s[:, :, 2 * h:2 * h + 2] = p
            l_run[:, h] = l_run[:, h] * alpha + p.sum(axis=(1, 2))
            m_run[:, h] = m_new
            acc[:, :, 2 * h:2 * h + 2] *= alpha[:, None, None]
        acc = emu_accumulate_pt(acc, s, buf, C, dtype)
    l_tot = sum(l_run[LANES ^ x] for x in (0, 1, 2, 3))  # quad_sum (xor 1, then 2)
    return m_run, l_tot, acc


@pytest.mark.parametrize("dpad,D", [(32, 20), (64, 64), (128, 100), (256, 250)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_warp_online_logsumexp(dpad, D, dtype):
    """One warp's forward over a key split of 2+ tiles with a partial last tile: m + log2 l is the
    base-2 logsumexp of S2 = Q2 K^T over the split's keys, acc / l is softmax(S2) K."""
    rng = np.random.default_rng(dpad + D)
    C = cfg(dpad)
    n, N = 21, 2 * C["kStream"] + 11
    z = np.tanh(rng.standard_normal((max(n, N), D)))
    m = rng.choice([-1.0, 1.0], size=(n, D))
    Q2 = np.zeros((n, dpad))
    # a small scale keeps S2 near 0: an unmasked zero-filled key (S2 = 0) would move lse visibly
    Q2[:, :D] = round16(0.1 * math.log2(math.e) * m * z[:n], dtype)
    K = np.zeros((N, dpad))
    K[:, :D] = round16(z[:N], dtype)
    row0, jstart, jend = 16, 4, N - 3  # rows 16..20 valid, 21..31 past n; keys [4, N-3)
    m_run, l_tot, acc = _emu_forward_warp(Q2, K, row0, n, jstart, jend, C, dtype)
    S2 = Q2[row0:n] @ K[jstart:jend].T
    lse2 = np.log2(np.exp2(S2 - S2.max(1, keepdims=True)).sum(1)) + S2.max(1)
    P = np.exp2(S2 - lse2[:, None])
    ga = P @ K[jstart:jend, :D]
    got = emu_store_acc(acc, row0, n, D, C)
    for lane in range(32):
        g = lane // 4
        for h in range(2):
            r = row0 + g + 8 * h
            if r >= n:
                continue
            i = r - row0
            got_lse = m_run[lane, h] + math.log2(l_tot[lane, h])
            assert abs(got_lse - lse2[i]) < 1e-9 * max(1, abs(lse2[i]))
            for c in range(D):
                # P rounded to 16 bits before P K: relative error <= 2^-8 (bf16) per term
                unit = 2 ** -8 if dtype == "bf16" else 2 ** -11
                tol = unit * (np.abs(P[i]) @ np.abs(K[jstart:jend, c]))
                assert abs(got[(r, c)] / l_tot[lane, h] - ga[i, c]) <= tol + 1e-12, (r, c)


@pytest.mark.parametrize("dpad,D", [(32, 32), (64, 57), (128, 128), (256, 193)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_keys_backward_warp(dpad, D, dtype):
    """One warp of bwd_keys_mma_kernel: dK_j = ln 2 sum_i g_i 2^(S2_ij - log2(e) lse_i) Q2_i over
    a query split with a partial last tile (zero-filled queries: lse = g = 0, contribute 0)."""
    qcol = kernel_expr("bwd_keys_mma_kernel", "8 * nt + 2 * t + (e & 1)")
    kernel_expr("bwd_keys_mma_kernel",
                "s[nt][e] = exp2_approx(fmaf(s_lse[b][i], -kLog2e, s[nt][e])) * (s_g[b][i] * gscale);")
    kernel_expr("bwd_keys_mma_kernel",
                "store_acc<DPAD>(pdk, dk, key0, N, sp * N, D, kLn2 * ginv);")
    rng = np.random.default_rng(7 * dpad + D)
    C = cfg(dpad)
    n, N = 2 * C["kStream"] + 9, 19
    z = np.tanh(rng.standard_normal((max(n, N), D)))
    Q2 = np.zeros((n, dpad))
    Q2[:, :D] = round16(2.0 * math.log2(math.e) * rng.choice([-1.0, 1.0], (n, D)) * z[:n], dtype)
    K = np.zeros((N, dpad))
    K[:, :D] = round16(z[:N], dtype)
    S = (Q2 @ K.T) / math.log2(math.e)  # natural-log logits
    lse = np.log(np.exp(S).sum(1)) + rng.uniform(-0.1, 0.1, n)  # any saved lse
    g = rng.uniform(0.5, 1.5, n)
    key0, istart, iend = 0, 2, n - 1
    # fp16: g times nac::pow2_scale of the split's max |g| (tests/test_cuda_mma_numerics.py)
    from test_cuda_mma_numerics import pow2_scale
    gscale, ginv = (float(x) for x in pow2_scale(np.float32(np.abs(g[istart:iend]).max()))) \
        if dtype == "fp16" else (1.0, 1.0)
    a = emu_load_resident(K, key0, N, C["kChunks"], C)
    dk = np.zeros((32, C["kDTiles"], 4))
    for it in range(-(-(iend - istart) // C["kStream"])):
        i0 = istart + it * C["kStream"]
        buf = emu_load_tile(Q2, i0, iend, C["kChunks"], C)
        s_lse = np.array([lse[i0 + e] if i0 + e < iend else 0.0 for e in range(C["kStream"])])
        s_g = np.array([g[i0 + e] if i0 + e < iend else 0.0 for e in range(C["kStream"])])
        s = emu_score_tile(a, buf, C, dtype)
        for lane in range(32):
            t = lane % 4
            for nt in range(C["kNTiles"]):
                for e in range(4):
                    i = qcol(nt=nt, t=t, e=e)
                    assert i == 8 * nt + c_layout(lane, e)[1]
                    s[lane, nt, e] = (np.exp2(s[lane, nt, e] - math.log2(math.e) * s_lse[i])
                                      * (s_g[i] * gscale))
        dk = emu_accumulate_pt(dk, s, buf, C, dtype)
    got = emu_store_acc(dk * (math.log(2) * ginv), key0, N, D, C)
    P = np.exp(S[istart:iend] - lse[istart:iend, None]) * g[istart:iend, None]  # (queries, keys)
    expect = (P.T @ Q2[istart:iend, :D]) * math.log(2)
    bound = np.abs(P.T) @ np.abs(Q2[istart:iend, :D]) * math.log(2)
    tol = 2 ** -8 if dtype == "bf16" else 2 ** -11
    assert len(got) == N * D if N <= 16 else len(got) == 16 * D
    for (r, c), v in got.items():
        assert abs(v - expect[r, c]) <= tol * bound[r, c] + 1e-12, (r, c)


def test_bank_conflict_check_catches_unpadded_rows():
    """The padding check is not vacuous: without the +8 elements, rows alias the same banks."""
    C = dict(cfg(64), kLd=64)
    base = np.array([((lane & 7) + 8 * (lane >> 4)) * 64 + 8 * ((lane >> 3) & 1) for lane in LANES])
    with pytest.raises(AssertionError):
        check_bank_conflicts(base, C)


def test_kernel_expr_fails_on_a_changed_expression():
    with pytest.raises(AssertionError, match="index math changed"):
        kernel_expr("score_tile", "16 * j * C::kLd + 8 * kk")


def _host():
    with open(os.path.join(ROOT, "csrc", "nac_cuda.cu")) as fh:
        return fh.read()


def _plan(rows, tiles_stream, stream, programs, sms=132, blocks_per_sm=1):
    """nac_cuda.cu's split_for and tiles_per_split for `rows` streamed rows (host side)."""
    host = _host()
    assert ("int64_t want = (int64_t(sms) * std::max(blocks_per_sm, 1) + programs - 1) / programs"
            in host)
    assert "while (split * 2 <= std::min<int64_t>({want, tiles, 64})) split *= 2;" in host
    assert "const int64_t tiles_per_split = (ktiles + nsplit - 1) / nsplit;" in host  # fwd
    assert "const int64_t per = (qtiles + nsplit - 1) / nsplit;" in host  # keys' backward
    want, split = -(-sms * max(blocks_per_sm, 1) // programs), 1
    while split * 2 <= min(want, tiles_stream, 64):
        split *= 2
    return split, -(-tiles_stream // split)


@pytest.mark.parametrize("dpad", DPADS)
@pytest.mark.parametrize("n,N", [(1, 1), (97, 4099), (1000, 131), (8192, 65536), (129, 128)])
@pytest.mark.parametrize("kernel", ["fwd_mma_kernel", "bwd_keys_mma_kernel"])
def test_grid_covers_every_row_and_splits_partition_the_stream(kernel, n, N, dpad):
    """Each resident row belongs to exactly one (block, warp); the splits' [start, end) ranges
    partition the streamed rows, each split's tiles cover its range (empty splits: 0 tiles)."""
    C = cfg(dpad)
    fwd = kernel == "fwd_mma_kernel"
    res_rows, st_rows = (n, N) if fwd else (N, n)
    kernel_expr(kernel, "= int64_t(blockIdx.x) * kResident + 16 * warp;")  # row0 / key0 below
    assert "constexpr int kResident = 16 * kWarps;" in SRC
    s, e = ("jstart", "jend") if fwd else ("istart", "iend")
    total = "N" if fwd else "n"
    start_of = kernel_expr(kernel, "sp * tiles_per_split * C::kStream")
    kernel_expr(kernel, f"{e} = std::min<int64_t>({total}, {s} + tiles_per_split * C::kStream);")
    ntiles_of = kernel_expr(kernel, f"{e} > {s} ? ({e} - {s} + C::kStream - 1) / C::kStream : 0")
    blocks = -(-res_rows // 128)
    seen = np.zeros(res_rows, int)
    for bx in range(blocks):
        for warp in range(8):
            row0 = bx * 128 + 16 * warp
            for r in range(row0, min(row0 + 16, res_rows)):
                seen[r] += 1
    assert (seen == 1).all()
    tiles = -(-st_rows // C["kStream"])
    nsplit, per = _plan(st_rows, tiles, C["kStream"], blocks)
    covered = np.zeros(st_rows, int)
    for sp in range(nsplit):
        start = start_of(sp=sp, tiles_per_split=per, **C)
        end = min(st_rows, start + per * C["kStream"])
        nt = ntiles_of(**{s: start, e: end}, **C)
        length = max(end - start, 0)
        assert nt * C["kStream"] >= length and (nt - 1) * C["kStream"] < max(length, 1)
        covered[start:end] += 1
    assert (covered == 1).all()


def test_host_split_plans_use_each_kernels_occupancy():
    """Issue 23, item 3: every split plan of the host (SIMT and tensor-core, forward and keys'
    backward) asks the occupancy of the kernel it launches, not a fixed 2 blocks per SM."""
    host = _host()
    assert "2 * sms" not in host
    for call in ("split_for(qtiles, ktiles, occupancy)", "split_for(ktiles, qtiles, occupancy)",
                 "split_for(qtiles, ktiles, nac_mma::fwd_blocks_per_sm(p.dt, p.dpad))",
                 "split_for(ktiles, qtiles, nac_mma::bwd_blocks_per_sm(p.dt, p.dpad))",
                 "blocks_per_sm(fwd_kernel<acc_t, acc_t, DPAD>, kThreads)",
                 "blocks_per_sm(bwd_keys_kernel<acc_t, acc_t, DPAD>, kThreads)"):
        assert call in host, call
    for kernel in ("fwd_mma_kernel", "bwd_keys_mma_kernel"):
        for dpad in DPADS:
            assert f"occupancy({kernel}<T, {dpad}>)" in SRC, (kernel, dpad)
    # one block per SM (the bf16 kernels' 190-255 registers x 256 threads) halves the split of a
    # fixed 2 per SM: at n = N = 8192 (64 resident tiles of 128) on 132 SMs, 2 splits, not 4
    assert _plan(8192, 128, 64, 64, blocks_per_sm=1)[0] == 2
    assert _plan(8192, 128, 64, 64, blocks_per_sm=2)[0] == 4
