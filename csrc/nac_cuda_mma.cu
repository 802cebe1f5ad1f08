// bf16/fp16 matrix kernels of the NAC losses on tensor cores (mma.sync m16n8k16, fp32
// accumulation), FlashAttention-2 style: the two tile loops of docs/math.md [M:passes], called by
// nac_cuda.cu (which plans the call, merges the splits and writes loss/lse/ga and the gradients;
// interface: nac_cuda_mma.h).  Same algorithm, units and roundings as kernels/nac_triton.py, which
// CI runs under the interpreter:
//   prologue_mma_kernel   Q2 = s log2(e) m tanh(a) and, for the in-batch keys, K = tanh(a), in
//                         the input dtype, once per call (O(nD); tanh: nac_math.h).
//   fwd_mma_kernel        grid (query tiles, key splits): S2 = Q2 K^T, online logsumexp in base 2
//                         [M:lse-online], acc += P K when the rows' gradient is wanted [M:ga];
//                         self_offset >= 0: row i's own key, key self_offset + i, set to -inf
//                         before the max in a tile that holds it (probability 0) [M:self-key].
//   bwd_keys_mma_kernel   grid (key tiles, query splits): S2^T = K Q2^T,
//                         P^T = exp2(S2^T - log2(e) lse) g, dK += P^T Q2, times ln 2 at the store
//                         [M:grad-keys]; no atomics, splits summed in a fixed order by the caller;
//                         fp16: g times a power of two, undone at the store [M:grad-scale];
//                         self_offset >= 0: P of a query's own key set to 0 [M:self-key].
// The logits never leave registers: one 16 x kStream tile per warp.
//
// Layout of one block (kWarps = 8 warps, 256 threads):
//   - the resident operand (forward: 128 query rows; keys' backward: 128 keys), 16 rows per warp,
//     lives in registers as mma A fragments for the whole loop, loaded once straight from global
//     memory (no shared-memory staging);
//   - the streamed operand (keys / queries) comes in tiles of kStream rows x DPAD columns through
//     shared memory: cp.async 16-byte copies (zero-fill outside the matrix), two buffers (the
//     next tile loads while the current one is multiplied), rows padded by 16 bytes so that
//     ldmatrix's eight 16-byte row reads hit distinct banks;
//   - S = R T^T: ldmatrix (non-transposed: a key's D values are contiguous, the .col B layout);
//     P T: the S accumulators become P's A fragments in registers (C -> A reuse: the m16n8 C
//     layout of two adjacent n-tiles is the m16k16 A layout), T through ldmatrix.trans.
//   - row max and sum: each row lives in one quad (4 lanes), reduced by two xor-shuffles.
//   DPAD 32/64: kStream 128; 128: 64; 256: 16.  Shared memory 16.5-38 KB, static (< 48 KB: no
//   opt-in attribute needed).  Registers: bench/cuda_resources.py (136-255, no spills on
//   sm_80/sm_90; DPAD 256 is at the 255 limit: a change there must re-check the spills).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// lane = 4 g + t (g = groupID 0..7, t = threadID_in_group 0..3); each .b32 register holds two
// 16-bit values, the lower column (or k) index in the low half:
//   A (16 x 16, row-major): a0 = (row g, cols 2t, 2t+1), a1 = (row g+8, cols 2t, 2t+1),
//                           a2 = (row g, cols 2t+8, 2t+9), a3 = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, "col"):      b0 = (k 2t, 2t+1; col g),     b1 = (k 2t+8, 2t+9; col g)
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// ldmatrix.m8n8.x4: lanes 8i..8i+7 give the row addresses of 8 x 8 matrix i; register i of
// lane (4 g + t) receives (row g, cols 2t, 2t+1) of matrix i, or with .trans (rows 2t, 2t+1;
// col g).  The address helpers below say which 8 x 8 blocks make each fragment.
// Checked on the CPU: tests/test_cuda_mma_layout.py reads the index expressions of the helpers
// and kernels below out of this file and runs them on a one-warp emulation of ldmatrix/mma.sync
// built from the PTX tables (tile products = numpy matmuls, one warp's forward and keys'
// backward = the float64 formulas); editing an index expression here fails that test until it
// has been re-derived there.
//
// Why inline PTX and not CUTLASS/CuTe (nvidia-cutlass on PyPI, header-only):
//   - build dependency: none here (nvcc alone); CUTLASS would be a pinned header package whose
//     releases track nvcc versions (this project builds with nvcc 13.0 here and 12.x elsewhere);
//   - build time: this file has no ATen and no template library: its host side compiles in
//     seconds and its device side is 16 small instantiations; CuTe's layout algebra is resolved
//     by the compiler at every instantiation, the reason FlashAttention-2's builds take tens of
//     minutes per architecture;
//   - control: the loop needs five instructions (cp.async, ldmatrix, ldmatrix.trans, mma.sync,
//     cvt.rn.{bf16x2,f16x2}.f32) and one register-level trick (C -> A reuse) that CuTe expresses
//     through a layout conversion we would have to check in the SASS anyway; here each index is
//     one commented line.
//   What CUTLASS would give that this file lacks: Hopper's wgmma/TMA path (sm_90a); not written
//   (bench/gpu_notes.md: the expected gap to Triton's HGMMA kernels).
//
// No ATen: plain pointers (nac_cuda_mma.h); nac_cuda.cu checks launch errors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>

#include "nac_cuda_mma.h"
#include "nac_math.h"

// mma.sync with bf16 and cp.async need sm_80.  A build that also targets an older arch (e.g.
// TORCH_CUDA_ARCH_LIST="7.5;8.0") compiles the two matrix kernels there as a trap; the host
// (nac_cuda.cu) refuses bf16/fp16 on such a device with an error before launching.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define NAC_MMA_TRAP_BELOW_SM80 1
#endif

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kResident = 16 * kWarps;  // resident rows per block: 16 per warp
[[maybe_unused]] constexpr float kLog2e = 1.4426950408889634f;
[[maybe_unused]] constexpr float kLn2 = 0.6931471805599453f;

template <int DPAD>
struct Cfg {
  static_assert(DPAD == 32 || DPAD == 64 || DPAD == 128 || DPAD == 256, "DPAD");
  static constexpr int kStream = DPAD <= 64 ? 128 : (DPAD == 128 ? 64 : 16);  // rows per tile
  static constexpr int kLd = DPAD + 8;           // smem row stride (elements): +16 bytes
  static constexpr int kChunks = DPAD / 8;       // 16-byte chunks per row
  static constexpr int kTileElems = kStream * kLd;
  static constexpr int kKSteps = DPAD / 16;      // k-steps of S = R T^T
  static constexpr int kNTiles = kStream / 8;    // n-tiles of S (8 streamed rows each)
  static constexpr int kDTiles = DPAD / 8;       // n-tiles of acc (8 columns each)
  static_assert((kStream * kChunks) % kThreads == 0, "tile copy: whole passes of the block");
  static_assert(2 * kTileElems * 2 + 4 * kStream * 4 <= 48 * 1024, "static smem <= 48 KB");
};

// ---- 16-bit type traits: the mma instruction and the fp32 -> 2 x 16-bit pack ----------------
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // (lo, hi) -> one register, lo in the low half (cvt puts its first source in the high half)
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(uint16_t x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {  // round to nearest even
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float to_float(uint16_t x) {
    return __half2float(__ushort_as_half(x));
  }
  static __device__ __forceinline__ uint16_t from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

// Which 16-bit type scales g in the keys' backward (fp16: its exponent range is too narrow for
// P^T g; bf16 has fp32's).
template <typename T> struct kScaleG { static constexpr bool value = false; };
template <> struct kScaleG<__half> { static constexpr bool value = true; };

// ---- PTX wrappers -----------------------------------------------------------------------------
#ifndef NAC_MMA_TRAP_BELOW_SM80  // (unused below sm_80: see NAC_MMA_TRAP_BELOW_SM80)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; src_bytes = 0 zero-fills (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most one group (the newest: the tile being prefetched) is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_one() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// 2^x on the special-function unit (ex2.approx.ftz.f32: what Triton's tl.exp2 and FA2 use;
// relative error ~2^-22, results below 2^-126 flush to 0, which no softmax sum can notice).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

#endif  // NAC_MMA_TRAP_BELOW_SM80

// ---- Fragment index helpers (lane = 4 g + t) ----------------------------------------------------

// The resident operand's A fragments for this warp's 16 rows [row0, row0 + 16), all DPAD / 16
// k-steps, straight from global memory: a[kk] = {(g, c), (g+8, c), (g, c+8), (g+8, c+8)} with
// c = 16 kk + 2t, each a 4-byte load of two adjacent values (ld even, base 16-byte aligned).
// Rows >= rows_end and columns >= 8 chunks read as 0.
template <int DPAD>
__device__ __forceinline__ void load_resident(uint32_t (&a)[DPAD / 16][4],
                                              const uint16_t* __restrict__ src, int64_t row0,
                                              int64_t rows_end, int64_t ld, int chunks) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t r_lo = row0 + g, r_hi = row0 + g + 8;
  const int cols = chunks * 8;
#pragma unroll
  for (int kk = 0; kk < DPAD / 16; ++kk) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t row = (q & 1) ? r_hi : r_lo;
      const int col = 16 * kk + 2 * t + ((q & 2) ? 8 : 0);
      a[kk][q] = (row < rows_end && col < cols)
                     ? __ldg(reinterpret_cast<const unsigned int*>(src + row * ld + col)) : 0u;
    }
  }
}

// Issue the cp.async copies of streamed rows [row0, row0 + kStream) into one smem buffer
// (kStream x kLd); rows >= rows_end and chunks >= `chunks` are zero-filled.
template <int DPAD>
__device__ __forceinline__ void load_tile(uint16_t* buf, const uint16_t* __restrict__ src,
                                          int64_t row0, int64_t rows_end, int64_t ld,
                                          int chunks) {
  using C = Cfg<DPAD>;
#pragma unroll
  for (int pass = 0; pass < C::kStream * C::kChunks / kThreads; ++pass) {
    const int e = threadIdx.x + pass * kThreads;
    const int r = e / C::kChunks, c = e % C::kChunks;
    const bool valid = row0 + r < rows_end && c < chunks;
    const uint16_t* p = valid ? src + (row0 + r) * ld + 8 * c : src;
    cp_async16(smem_addr(buf + r * C::kLd + 8 * c), p, valid);
  }
}

// S (16 x kStream, this warp's rows) = A . T^T over DPAD.  ldmatrix.x4 (non-trans) at k-step kk
// for streamed rows 16 j .. 16 j + 15 loads four 8 x 8 blocks, (rows, cols) of the tile:
//   0: (16j + 0..7,  16kk + 0..7) = b0 of n-tile 2j      1: (16j + 0..7,  16kk + 8..15) = b1 of 2j
//   2: (16j + 8..15, 16kk + 0..7) = b0 of n-tile 2j + 1  3: (16j + 8..15, 16kk + 8..15) = b1
// (B[k][n] = T[n][k]: the .col layout is T's rows as stored).  Lane l addresses block l / 8 row
// l % 8: tile row 16j + (l & 7) + 8 (l >> 4), column 16kk + 8 ((l >> 3) & 1).
template <typename T, int DPAD>
__device__ __forceinline__ void score_tile(float (&s)[Cfg<DPAD>::kNTiles][4],
                                           const uint32_t (&a)[DPAD / 16][4], const uint16_t* buf) {
  using C = Cfg<DPAD>;
  const int lane = threadIdx.x % 32;
  const uint32_t base =
      smem_addr(buf + ((lane & 7) + 8 * (lane >> 4)) * C::kLd + 8 * ((lane >> 3) & 1));
#pragma unroll
  for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) s[nt][q] = 0.f;
#pragma unroll
  for (int kk = 0; kk < C::kKSteps; ++kk) {
#pragma unroll
    for (int j = 0; j < C::kNTiles / 2; ++j) {
      uint32_t b[4];
      ldmatrix_x4(b, base + 2 * (16 * j * C::kLd + 16 * kk));
      Mma<T>::run(s[2 * j], a[kk], b[0], b[1]);
      Mma<T>::run(s[2 * j + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc (16 x DPAD) += P (16 x kStream, in s as fp32 C fragments) . T (kStream x DPAD).
// P's A fragment for k-step kk (streamed rows 16kk .. 16kk + 15) is the C fragments of n-tiles
// 2kk and 2kk + 1, packed to 16 bits: a0 = (g; 2t, 2t+1) = s[2kk][0..1], a1 = (g+8; ...) =
// s[2kk][2..3], a2 = (g; 2t+8, 2t+9) = s[2kk+1][0..1], a3 = s[2kk+1][2..3].
// B[k][n] = T[k][n] with k along the streamed rows: ldmatrix.x4.trans at k-step kk for columns
// 16 j .. 16 j + 15 loads blocks (rows, cols) of the tile
//   0: (16kk + 0..7,  16j + 0..7) = b0 of d-tile 2j      1: (16kk + 8..15, 16j + 0..7) = b1 of 2j
//   2: (16kk + 0..7,  16j + 8..15) = b0 of d-tile 2j+1   3: (16kk + 8..15, 16j + 8..15) = b1
// Lane l addresses tile row 16kk + (l & 15), column 16j + 8 (l >> 4).
template <typename T, int DPAD>
__device__ __forceinline__ void accumulate_pt(float (&acc)[Cfg<DPAD>::kDTiles][4],
                                              const float (&s)[Cfg<DPAD>::kNTiles][4],
                                              const uint16_t* buf) {
  using C = Cfg<DPAD>;
  const int lane = threadIdx.x % 32;
  const uint32_t base = smem_addr(buf + (lane & 15) * C::kLd + 8 * (lane >> 4));
#pragma unroll
  for (int kk = 0; kk < C::kNTiles / 2; ++kk) {
    const uint32_t p[4] = {Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                           Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                           Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int j = 0; j < C::kDTiles / 2; ++j) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, base + 2 * (16 * kk * C::kLd + 16 * j));
      Mma<T>::run(acc[2 * j], p, b[0], b[1]);
      Mma<T>::run(acc[2 * j + 1], p, b[2], b[3]);
    }
  }
}

// Store acc (this warp's 16 rows x DPAD, C layout) * scale to out[(out_row0 + row) * D + col]
// for rows < rows_end, cols < D.
template <int DPAD>
__device__ __forceinline__ void store_acc(float* __restrict__ out,
                                          const float (&acc)[Cfg<DPAD>::kDTiles][4], int64_t row0,
                                          int64_t rows_end, int64_t out_row0, int D, float scale) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + g + 8 * h;
    if (row >= rows_end) continue;
    float* o = out + (out_row0 + row) * D;
#pragma unroll
    for (int dt = 0; dt < Cfg<DPAD>::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * dt + 2 * t + e;
        if (col < D) o[col] = acc[dt][2 * h + e] * scale;
      }
  }
}

// ---- Kernels ------------------------------------------------------------------------------------

// [M:rows]: Q2 = s log2(e) m z and K = z = tanh(a) (nac_math.h's tanh_: tanhf on the device,
// as the SIMT kernels), in fp32 as Triton's prologue (m z, times s log2(e)), then rounded once to
// the 16-bit type; (n, DPAD) with zero columns >= D.
template <typename T>
__global__ void prologue_mma_kernel(const uint16_t* __restrict__ a,
                                    const uint16_t* __restrict__ noise, uint16_t* __restrict__ q,
                                    uint16_t* __restrict__ k, int64_t n, int D, int dpad,
                                    float scale2) {
  const int64_t total = n * dpad;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / dpad;
    const int col = static_cast<int>(e - row * dpad);
    uint16_t qv = 0, kv = 0;
    if (col < D) {
      const int64_t src = row * D + col;
      const float z = nac::tanh_(Mma<T>::to_float(a[src]));
      qv = Mma<T>::from_float(Mma<T>::to_float(noise[src]) * z * scale2);
      kv = Mma<T>::from_float(z);
    }
    q[e] = qv;
    if (k != nullptr) k[e] = kv;
  }
}

// Forward [M:lse-online], base 2 as kernels/nac_triton.py's _fwd_kernel: per (query tile,
// key split) the running max m (log2 units), sum l and, when grad, acc = sum_j 2^(S2_ij - m) k_j.
// Each thread holds two rows of its warp's 16 (g and g + 8: h = 0, 1); l is kept per thread
// (its columns' share) and summed over the quad at the end: alpha is the same on all 4 lanes.
template <typename T, int DPAD>
__global__ void __launch_bounds__(kThreads, 1)
fwd_mma_kernel(nac_mma::Operand q, nac_mma::Operand k, float* __restrict__ pm,
               float* __restrict__ pl, float* __restrict__ pacc, int D, int64_t tiles_per_split,
               bool grad, int64_t self_offset) {
#ifdef NAC_MMA_TRAP_BELOW_SM80
  __trap();
#else
  using C = Cfg<DPAD>;
  __shared__ __align__(128) uint16_t smem[2 * C::kTileElems];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t n = q.rows, N = k.rows;
  const int64_t row0 = int64_t(blockIdx.x) * kResident + 16 * warp;
  const int64_t sp = blockIdx.y;
  const int64_t jstart = sp * tiles_per_split * C::kStream;
  const int64_t jend = std::min<int64_t>(N, jstart + tiles_per_split * C::kStream);
  const int64_t ntiles = jend > jstart ? (jend - jstart + C::kStream - 1) / C::kStream : 0;
  const uint16_t* kp = static_cast<const uint16_t*>(k.ptr);

  if (ntiles > 0) load_tile<DPAD>(smem, kp, jstart, jend, k.ld, k.chunks);
  cp_async_commit();
  uint32_t qa[DPAD / 16][4];
  load_resident<DPAD>(qa, static_cast<const uint16_t*>(q.ptr), row0, n, q.ld, q.chunks);

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float acc[C::kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < C::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[dt][e] = 0.f;

  for (int64_t it = 0; it < ntiles; ++it) {
    const int64_t j0 = jstart + it * C::kStream;
    if (it + 1 < ntiles)
      load_tile<DPAD>(smem + ((it + 1) & 1) * C::kTileElems, kp, j0 + C::kStream, jend, k.ld,
                      k.chunks);
    cp_async_commit();
    cp_async_wait_all_but_one();
    __syncthreads();
    const uint16_t* buf = smem + (it & 1) * C::kTileElems;

    float s[C::kNTiles][4];
    score_tile<T, DPAD>(s, qa, buf);
    if (j0 + C::kStream > jend) {  // the split's last tile: keys >= jend are not this split's
#pragma unroll
      for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j0 + 8 * nt + 2 * t + (e & 1) >= jend) s[nt][e] = -INFINITY;
    }
    if (self_offset >= 0) {
      // [M:self-key]: row row0 + r's own key is key self_offset + row0 + r, tile column
      // d + r (d: the warp's first row's); -inf where the tile holds it (a branch uniform over
      // the warp, taken in the tiles of the diagonal band only)
      const int64_t d = self_offset + row0 - j0;
      if (d > -16 && d < C::kStream) {
        const int dd = static_cast<int>(d);
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (8 * nt + 2 * t + (e & 1) == dd + g + 8 * (e >> 1)) s[nt][e] = -INFINITY;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < C::kNTiles; ++nt)
        mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      const float m_new = fmaxf(m_run[h], quad_max(mx));
      // 0 on the first tile (l = 0, m = -inf): no exp2(-inf - -inf)
      const float alpha = m_run[h] == -INFINITY ? 0.f : exp2_approx(m_run[h] - m_new);
      // a row whose keys so far are only its own (left out): m_new = -inf, its p are 0
      const float m_sub = self_offset >= 0 && m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2_approx(s[nt][2 * h + e] - m_sub);
          s[nt][2 * h + e] = p;
          sum += p;
        }
      l_run[h] = l_run[h] * alpha + sum;
      m_run[h] = m_new;
      if (grad) {
#pragma unroll
        for (int dt = 0; dt < C::kDTiles; ++dt) {
          acc[dt][2 * h] *= alpha;
          acc[dt][2 * h + 1] *= alpha;
        }
      }
    }
    if (grad) accumulate_pt<T, DPAD>(acc, s, buf);
    __syncthreads();  // every warp is done with buf before the next iteration refills it
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = quad_sum(l_run[h]);
    const int64_t row = row0 + g + 8 * h;
    if (t == 0 && row < n) {
      pm[sp * n + row] = m_run[h];
      pl[sp * n + row] = l;
    }
  }
  if (grad) store_acc<DPAD>(pacc, acc, row0, n, sp * n, D, 1.f);
#endif
}

// Keys' backward [M:grad-keys], as kernels/nac_triton.py's _bwd_keys_kernel: per (key tile,
// query split) dK = sum_i g_i 2^(S2_ij - log2(e) lse_i) Q2_i, times ln 2 at the store.  The
// query tile's lse and g come through shared memory with it (cp.async, zero-filled past the
// split: a zero-filled query has Q2 = 0, lse = 0, g = 0, so P = 2^0 * 0 = 0).
template <typename T, int DPAD>
__global__ void __launch_bounds__(kThreads, 1)
bwd_keys_mma_kernel(nac_mma::Operand q, nac_mma::Operand k, const float* __restrict__ lse,
                    const float* __restrict__ g, float* __restrict__ pdk, int D,
                    int64_t tiles_per_split, int64_t self_offset) {
#ifdef NAC_MMA_TRAP_BELOW_SM80
  __trap();
#else
  using C = Cfg<DPAD>;
  __shared__ __align__(128) uint16_t smem[2 * C::kTileElems];
  __shared__ float s_lse[2][C::kStream], s_g[2][C::kStream];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t n = q.rows, N = k.rows;
  const int64_t key0 = int64_t(blockIdx.x) * kResident + 16 * warp;
  const int64_t sp = blockIdx.y;
  const int64_t istart = sp * tiles_per_split * C::kStream;
  const int64_t iend = std::min<int64_t>(n, istart + tiles_per_split * C::kStream);
  const int64_t ntiles = iend > istart ? (iend - istart + C::kStream - 1) / C::kStream : 0;
  const uint16_t* qp = static_cast<const uint16_t*>(q.ptr);

  // fp16: g scaled by the power of two nac::pow2_scale gives for this split's max |g| (one pass
  // over g, a block-wide max), undone at the store: P^T g fell below fp16's smallest subnormal
  // (g = 1/n, P ~ 1/N) when packed to fp16 for the second product, docs/math.md [M:grad-scale].
  float gscale = 1.f, ginv = 1.f;
  if (kScaleG<T>::value) {
    __shared__ float s_gmax[kWarps];
    float gm = 0.f;
    for (int64_t i = istart + threadIdx.x; i < iend; i += kThreads) gm = fmaxf(gm, fabsf(g[i]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, o));
    if (lane == 0) s_gmax[warp] = gm;
    __syncthreads();
    gm = s_gmax[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) gm = fmaxf(gm, s_gmax[w]);
    const nac::Pow2Scale ps = nac::pow2_scale(gm);
    gscale = ps.scale;
    ginv = ps.inv;
  }

  auto load = [&](int64_t i0, int b) {
    load_tile<DPAD>(smem + b * C::kTileElems, qp, i0, iend, q.ld, q.chunks);
    const int e = threadIdx.x;
    if (e < C::kStream) {
      cp_async4(smem_addr(&s_lse[b][e]), i0 + e < iend ? lse + i0 + e : lse, i0 + e < iend);
    } else if (e < 2 * C::kStream) {
      const int f = e - C::kStream;
      cp_async4(smem_addr(&s_g[b][f]), i0 + f < iend ? g + i0 + f : g, i0 + f < iend);
    }
  };
  if (ntiles > 0) load(istart, 0);
  cp_async_commit();
  uint32_t ka[DPAD / 16][4];
  load_resident<DPAD>(ka, static_cast<const uint16_t*>(k.ptr), key0, N, k.ld, k.chunks);

  float dk[C::kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < C::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = 0.f;

  for (int64_t it = 0; it < ntiles; ++it) {
    if (it + 1 < ntiles) load(istart + (it + 1) * C::kStream, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait_all_but_one();
    __syncthreads();
    const int b = it & 1;
    const uint16_t* buf = smem + b * C::kTileElems;

    float s[C::kNTiles][4];  // S2^T: this warp's 16 keys x kStream queries
    score_tile<T, DPAD>(s, ka, buf);
#pragma unroll
    for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 8 * nt + 2 * t + (e & 1);  // the query (column) of C element e
        s[nt][e] = exp2_approx(fmaf(s_lse[b][i], -kLog2e, s[nt][e])) * (s_g[b][i] * gscale);
      }
    if (self_offset >= 0) {
      // [M:self-key]: query i0 + c's own key is key self_offset + i0 + c, resident row
      // c - d (d: the warp's first key's offset back from it); P = 0 there, in the tiles of the
      // diagonal band only (a branch uniform over the warp)
      const int64_t d = key0 - self_offset - (istart + it * C::kStream);
      if (d > -16 && d < C::kStream) {
        const int dd = static_cast<int>(d), g8 = lane / 4;
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (8 * nt + 2 * t + (e & 1) == dd + g8 + 8 * (e >> 1)) s[nt][e] = 0.f;
      }
    }
    accumulate_pt<T, DPAD>(dk, s, buf);
    __syncthreads();
  }
  store_acc<DPAD>(pdk, dk, key0, N, sp * N, D, kLn2 * ginv);
#endif
}

template <typename T, int DPAD>
void launch_fwd(nac_mma::Operand q, nac_mma::Operand k, float* pm, float* pl, float* pacc, int D,
                int64_t tiles_per_split, int nsplit, bool grad, int64_t self_offset,
                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((q.rows + kResident - 1) / kResident),
                  static_cast<unsigned>(nsplit));
  fwd_mma_kernel<T, DPAD><<<grid, kThreads, 0, stream>>>(q, k, pm, pl, pacc, D,
                                                         tiles_per_split, grad, self_offset);
}

template <typename T, int DPAD>
void launch_bwd(nac_mma::Operand q, nac_mma::Operand k, const float* lse, const float* g,
                float* pdk, int D, int64_t tiles_per_split, int nsplit, int64_t self_offset,
                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((k.rows + kResident - 1) / kResident),
                  static_cast<unsigned>(nsplit));
  bwd_keys_mma_kernel<T, DPAD><<<grid, kThreads, 0, stream>>>(q, k, lse, g, pdk, D,
                                                              tiles_per_split, self_offset);
}

// dtype x DPAD -> the 2 x 4 instantiations of each kernel (plain switches: this file must also
// build as C++17, torch < 2.12's default).
template <typename T>
void fwd_t(int dpad, nac_mma::Operand q, nac_mma::Operand k, float* pm, float* pl, float* pacc,
           int D, int64_t tps, int nsplit, bool grad, int64_t so, cudaStream_t st) {
  switch (dpad) {
    case 32: launch_fwd<T, 32>(q, k, pm, pl, pacc, D, tps, nsplit, grad, so, st); break;
    case 64: launch_fwd<T, 64>(q, k, pm, pl, pacc, D, tps, nsplit, grad, so, st); break;
    case 128: launch_fwd<T, 128>(q, k, pm, pl, pacc, D, tps, nsplit, grad, so, st); break;
    default: launch_fwd<T, 256>(q, k, pm, pl, pacc, D, tps, nsplit, grad, so, st); break;
  }
}

template <typename T>
void bwd_t(int dpad, nac_mma::Operand q, nac_mma::Operand k, const float* lse, const float* g,
           float* pdk, int D, int64_t tps, int nsplit, int64_t so, cudaStream_t st) {
  switch (dpad) {
    case 32: launch_bwd<T, 32>(q, k, lse, g, pdk, D, tps, nsplit, so, st); break;
    case 64: launch_bwd<T, 64>(q, k, lse, g, pdk, D, tps, nsplit, so, st); break;
    case 128: launch_bwd<T, 128>(q, k, lse, g, pdk, D, tps, nsplit, so, st); break;
    default: launch_bwd<T, 256>(q, k, lse, g, pdk, D, tps, nsplit, so, st); break;
  }
}

}  // namespace

namespace nac_mma {

Tiles tiles(int dpad) {
  switch (dpad) {
    case 32: return {kResident, Cfg<32>::kStream};
    case 64: return {kResident, Cfg<64>::kStream};
    case 128: return {kResident, Cfg<128>::kStream};
    default: return {kResident, Cfg<256>::kStream};
  }
}

template <typename Kernel>
int occupancy(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0) != cudaSuccess)
    return 0;  // nac_cuda.cu's split plan counts 0 as 1; the launch reports the error
  return blocks;
}

template <typename T>
int fwd_occ(int dpad) {
  switch (dpad) {
    case 32: return occupancy(fwd_mma_kernel<T, 32>);
    case 64: return occupancy(fwd_mma_kernel<T, 64>);
    case 128: return occupancy(fwd_mma_kernel<T, 128>);
    default: return occupancy(fwd_mma_kernel<T, 256>);
  }
}

template <typename T>
int bwd_occ(int dpad) {
  switch (dpad) {
    case 32: return occupancy(bwd_keys_mma_kernel<T, 32>);
    case 64: return occupancy(bwd_keys_mma_kernel<T, 64>);
    case 128: return occupancy(bwd_keys_mma_kernel<T, 128>);
    default: return occupancy(bwd_keys_mma_kernel<T, 256>);
  }
}

int fwd_blocks_per_sm(Dtype dt, int dpad) {
  return dt == Dtype::kBF16 ? fwd_occ<__nv_bfloat16>(dpad) : fwd_occ<__half>(dpad);
}

int bwd_blocks_per_sm(Dtype dt, int dpad) {
  return dt == Dtype::kBF16 ? bwd_occ<__nv_bfloat16>(dpad) : bwd_occ<__half>(dpad);
}

void prologue(Dtype dt, const void* a, const void* noise, void* q, void* k, int64_t n, int D,
              int dpad, float scale2, cudaStream_t stream) {
  const int64_t total = n * dpad;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65535));
  const auto* a16 = static_cast<const uint16_t*>(a);
  const auto* m16 = static_cast<const uint16_t*>(noise);
  auto* q16 = static_cast<uint16_t*>(q);
  auto* k16 = static_cast<uint16_t*>(k);
  if (dt == Dtype::kBF16)
    prologue_mma_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a16, m16, q16, k16, n, D, dpad,
                                                                   scale2);
  else
    prologue_mma_kernel<__half><<<blocks, 256, 0, stream>>>(a16, m16, q16, k16, n, D, dpad,
                                                            scale2);
}

void fwd(Dtype dt, int dpad, Operand q, Operand k, float* pm, float* pl, float* pacc, int D,
         int64_t tiles_per_split, int nsplit, bool grad, int64_t self_offset,
         cudaStream_t stream) {
  if (dt == Dtype::kBF16)
    fwd_t<__nv_bfloat16>(dpad, q, k, pm, pl, pacc, D, tiles_per_split, nsplit, grad,
                         self_offset, stream);
  else
    fwd_t<__half>(dpad, q, k, pm, pl, pacc, D, tiles_per_split, nsplit, grad, self_offset,
                  stream);
}

void bwd_keys(Dtype dt, int dpad, Operand q, Operand k, const float* lse, const float* g,
              float* pdk, int D, int64_t tiles_per_split, int nsplit, int64_t self_offset,
              cudaStream_t stream) {
  if (dt == Dtype::kBF16)
    bwd_t<__nv_bfloat16>(dpad, q, k, lse, g, pdk, D, tiles_per_split, nsplit, self_offset,
                         stream);
  else
    bwd_t<__half>(dpad, q, k, lse, g, pdk, D, tiles_per_split, nsplit, self_offset, stream);
}

}  // namespace nac_mma
