// CUDA kernels of the NAC losses: the CUDA dispatch key of the ops nac_fast::nac_fwd and
// nac_fast::nac_bwd (schemas and the CPU kernel in nac_cpu.cpp; per-element math shared through
// nac_math.h, so what CI checks on the CPU is the math these kernels run).  The function is
// docs/math.md [M:rows]; the passes and what is saved between them [M:passes]; the forward's
// online logsumexp and split merge [M:lse-online]; ga [M:ga]; the keys' gradient [M:grad-keys];
// d/dr [M:grad-r] and d/da [M:grad-a].  lse is saved in natural log (the op's contract, shared
// with the CPU kernel).  self_offset >= 0 leaves row i's own key (key self_offset + i) out of its
// logsumexp [M:self-key]: the matrix kernels skip that entry before the max and the exps (its
// probability is exactly 0 in the forward and in the keys' backward) and the finish subtracts
// log(N - 1); -1 (every key) leaves every kernel's arithmetic as it was.
//
// Two paths, one plan (grid (resident tiles, splits) so small batches still fill the GPU; key
// splits merged by finish_kernel; keys' gradient column-parallel, no atomics, query splits summed
// in a fixed order: deterministic; then bwd_rows_kernel, elementwise):
//   - bf16/fp16: tensor cores (mma.sync, fp32 accumulation), nac_cuda_mma.cu through
//     nac_cuda_mma.h: codes in the input dtype, loops in base 2 as kernels/nac_triton.py; the
//     finish converts lse to natural log and the keys' backward reads it back.
//   - fp32/fp64: the portable SIMT kernels below, fp32 (fp64) FMAs from shared-memory tiles, the
//     natural base throughout.  The logits never leave registers/shared memory.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>
#include <ATen/AccumulateType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "nac_checks.h"
#include "nac_cuda_mma.h"
#include "nac_math.h"

namespace {

constexpr int kThreads = 256;  // 16 x 16
constexpr int kDChunk = 32;    // D columns staged in shared memory at a time

template <typename acc_t> struct Tile;
template <> struct Tile<float> { static constexpr int kT = 64; };   // 64 x 64 logits per block
template <> struct Tile<double> { static constexpr int kT = 32; };  // keeps fp64 smem < 48 KiB

template <typename acc_t>
__device__ __forceinline__ acc_t neg_inf() { return -std::numeric_limits<acc_t>::infinity(); }

// Reduce over the 16 threads of a half-warp that share a row group (lanes differ in bits 0-3).
template <typename acc_t>
__device__ __forceinline__ acc_t half_warp_max(acc_t v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o, 16));
  return v;
}
template <typename acc_t>
__device__ __forceinline__ acc_t half_warp_sum(acc_t v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o, 16);
  return v;
}

// Store a register tile v[u][c] (rows row0 + ty + 16 u < row_end, columns tx + 16 c < D) to
// out[(out_row0 + row) * D + column].
template <typename acc_t, int R, int C>
__device__ __forceinline__ void store_tile(acc_t* __restrict__ out, const acc_t (&v)[R][C],
                                           int64_t row0, int64_t row_end, int64_t out_row0,
                                           int D) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t row = row0 + ty + 16 * u;
    if (row >= row_end) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int d = tx + 16 * c;
      if (d < D) out[(out_row0 + row) * D + d] = v[u][c];
    }
  }
}

// q = s m tanh(a) and z = tanh(a) in the accumulation dtype (O(nD) prologue).
template <typename scalar_t, typename acc_t>
__global__ void prologue_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ noise,
                                acc_t* __restrict__ q, acc_t* __restrict__ z, int64_t total,
                                acc_t s) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const acc_t zz = nac::tanh_(static_cast<acc_t>(a[k]));
    z[k] = zz;
    q[k] = s * static_cast<acc_t>(noise[k]) * zz;
  }
}

// docs/math.md [M:self-key] in a SIMT tile: thread (ty, tx) holds rows i0 + ty + 16 u and columns
// (keys) j0 + tx + 16 v; row i's own key, key self_offset + i, is its column v exactly when
// 16 (v - u) == self_offset + i0 + ty - (j0 + tx).  Returns that difference, or 1 (never a multiple
// of 16: no own key here) for self_offset -1 or a difference beyond +-256 (no u, v < R = 4 reach
// it): one int per tile, which each of the R x R tests compares with a constant (an int64 own
// key per row cost the fp32 DPAD 256 keys' backward a 16-byte stack frame on sm_80).
__device__ __forceinline__ int own_delta(int64_t self_offset, int64_t i0_ty_minus_j0_tx) {
  if (self_offset < 0) return 1;
  const int64_t d = self_offset + i0_ty_minus_j0_tx;
  return d >= -256 && d <= 256 ? static_cast<int>(d) : 1;
}

// S tile (T x T) = Q[rows] . K[cols]^T, accumulated over D in chunks through shared memory.
// Thread (ty, tx) holds rows ty + 16 u and columns tx + 16 v, u, v < T/16.
template <typename key_t, typename acc_t, int T>
__device__ __forceinline__ void score_tile(const acc_t* __restrict__ Q, const key_t* __restrict__ K,
                                           int64_t i0, int64_t n, int64_t j0, int64_t jend,
                                           int D, acc_t (*Qs)[kDChunk + 1],
                                           acc_t (*Ks)[kDChunk + 1], acc_t (&S)[T / 16][T / 16]) {
  constexpr int R = T / 16;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int u = 0; u < R; ++u)
#pragma unroll
    for (int v = 0; v < R; ++v) S[u][v] = 0;
  for (int d0 = 0; d0 < D; d0 += kDChunk) {
    for (int e = threadIdx.x; e < T * kDChunk; e += kThreads) {
      const int rr = e / kDChunk, dd = e % kDChunk;
      const bool din = d0 + dd < D;
      Qs[rr][dd] = (din && i0 + rr < n) ? Q[(i0 + rr) * D + d0 + dd] : acc_t(0);
      Ks[rr][dd] = (din && j0 + rr < jend) ? static_cast<acc_t>(K[(j0 + rr) * D + d0 + dd])
                                           : acc_t(0);
    }
    __syncthreads();
#pragma unroll 8
    for (int dd = 0; dd < kDChunk; ++dd) {
      acc_t qv[R], kv[R];
#pragma unroll
      for (int u = 0; u < R; ++u) qv[u] = Qs[ty + 16 * u][dd];
#pragma unroll
      for (int v = 0; v < R; ++v) kv[v] = Ks[tx + 16 * v][dd];
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int v = 0; v < R; ++v) S[u][v] += qv[u] * kv[v];
    }
    __syncthreads();
  }
}

// Blocks per SM the forward kernel promises ptxas (__launch_bounds__' second argument), i.e. a
// budget of 65536 / (kThreads * blocks) registers per thread: 128, and 255 for DPAD = 256.
// Without it ptxas aims at the occupancy the static shared memory allows (33.5 KiB per block
// for fp32), caps the registers at 48-128 and spilled on sm_80 and sm_90 for DPAD = 32 and 256
// (every dtype; fp32 and fp64 at other widths too).  bench/cuda_resources.py reports registers
// and spills per instantiation; its problems() flags any spill on a bf16/fp16/fp32 path.
template <int DPAD>
constexpr int fwd_min_blocks() { return DPAD >= 256 ? 1 : 2; }

// Forward: per (query tile, key split) the online softmax state (m, l) and acc = sum e k.
template <typename key_t, typename acc_t, int DPAD>
__global__ void __launch_bounds__(kThreads, fwd_min_blocks<DPAD>())
fwd_kernel(const acc_t* __restrict__ Q, const key_t* __restrict__ K, acc_t* __restrict__ pm,
           acc_t* __restrict__ pl, acc_t* __restrict__ pacc, int64_t n, int64_t N, int D,
           int64_t tiles_per_split, bool grad, int64_t self_offset) {
  constexpr int T = Tile<acc_t>::kT, R = T / 16, C = DPAD / 16;
  __shared__ acc_t Qs[T][kDChunk + 1];
  __shared__ acc_t Ks[T][kDChunk + 1];
  __shared__ acc_t Ps[T][T + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t i0 = int64_t(blockIdx.x) * T, sp = blockIdx.y;
  const int64_t jstart = sp * tiles_per_split * T;
  const int64_t jend = N < jstart + tiles_per_split * T ? N : jstart + tiles_per_split * T;

  acc_t m_run[R], l_run[R], acc[R][C];
#pragma unroll
  for (int u = 0; u < R; ++u) {
    m_run[u] = neg_inf<acc_t>();
    l_run[u] = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) acc[u][c] = 0;
  }
  acc_t S[R][R];
  for (int64_t j0 = jstart; j0 < jend; j0 += T) {
    score_tile<key_t, acc_t, T>(Q, K, i0, n, j0, jend, D, Qs, Ks, S);
    // the rows' own keys [M:self-key] (own_delta), skipped like keys past jend: out of the max,
    // probability 0
    const int own_d = own_delta(self_offset, i0 + ty - j0 - tx);
#pragma unroll
    for (int u = 0; u < R; ++u) {
      acc_t mx = neg_inf<acc_t>();
#pragma unroll
      for (int v = 0; v < R; ++v)
        if (j0 + tx + 16 * v < jend && 16 * (v - u) != own_d) mx = max(mx, S[u][v]);
      mx = half_warp_max(mx);
      const acc_t m_new = max(m_run[u], mx);
      const acc_t alpha = l_run[u] > 0 ? nac::exp_(m_run[u] - m_new) : acc_t(0);
      acc_t sum = 0;
#pragma unroll
      for (int v = 0; v < R; ++v) {
        const acc_t p = (j0 + tx + 16 * v < jend && 16 * (v - u) != own_d)
                            ? nac::exp_(S[u][v] - m_new) : acc_t(0);
        Ps[ty + 16 * u][tx + 16 * v] = p;
        sum += p;
      }
      l_run[u] = l_run[u] * alpha + half_warp_sum(sum);
      m_run[u] = m_new;
#pragma unroll
      for (int c = 0; c < C; ++c) acc[u][c] *= alpha;
    }
    if (grad) {
      // acc[rows, D] += P[rows, keys] . K[keys, D], D staged in chunks (Ks reused).  Unrolled
      // so that acc's column index is a compile-time constant (registers, not local memory).
#pragma unroll
      for (int d0 = 0; d0 < DPAD; d0 += kDChunk) {
        __syncthreads();  // Ps written; Ks free
        for (int e = threadIdx.x; e < T * kDChunk; e += kThreads) {
          const int rr = e / kDChunk, dd = e % kDChunk;
          Ks[rr][dd] = (d0 + dd < D && j0 + rr < jend)
                           ? static_cast<acc_t>(K[(j0 + rr) * D + d0 + dd]) : acc_t(0);
        }
        __syncthreads();
        // thread owns columns tx and tx + 16 of this chunk: c = d0/16 + {0, 1}
#pragma unroll
        for (int h = 0; h < kDChunk / 16; ++h) {
          const int c = d0 / 16 + h;
          if (c >= C) break;
#pragma unroll 8
          for (int j = 0; j < T; ++j) {
            const acc_t kv = Ks[j][tx + 16 * h];
#pragma unroll
            for (int u = 0; u < R; ++u) acc[u][c] += Ps[ty + 16 * u][j] * kv;
          }
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < R; ++u) {
    const int64_t i = i0 + ty + 16 * u;
    if (i < n && tx == 0) {
      pm[sp * n + i] = m_run[u];
      pl[sp * n + i] = l_run[u];
    }
  }
  if (grad) store_tile(pacc, acc, i0, n, sp * n, D);
}

// exp of a split's max offset: natural base (SIMT partials) or base 2 (tensor-core partials).
template <bool kLog2, typename acc_t>
__device__ __forceinline__ acc_t split_weight(acc_t x) {
  if constexpr (kLog2) return exp2(x);
  else return nac::exp_(x);
}

// One block per row: merge the splits [M:lse-online], then loss, lse (natural log) and ga [M:ga]
// (nac_math.h).  kLog2: the partials' max is in log2 units (the tensor-core path).
template <typename scalar_t, typename acc_t, bool kLog2>
__global__ void finish_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ r,
                              const scalar_t* __restrict__ noise, const acc_t* __restrict__ pm,
                              const acc_t* __restrict__ pl, const acc_t* __restrict__ pacc,
                              acc_t* __restrict__ loss, acc_t* __restrict__ lse,
                              acc_t* __restrict__ ga, int64_t n, int D, int nsplit, acc_t s,
                              acc_t l2, acc_t log_n_keys, bool grad) {
  const int64_t i = blockIdx.x;
  __shared__ acc_t red[2][32];
  acc_t M = neg_inf<acc_t>();
  for (int p = 0; p < nsplit; ++p) M = max(M, pm[p * n + i]);
  acc_t L = 0;
  for (int p = 0; p < nsplit; ++p)  // != 0, not > 0: a NaN split poisons the row (no drop)
    if (pl[p * n + i] != 0) L += split_weight<kLog2>(pm[p * n + i] - M) * pl[p * n + i];
  const acc_t lse_i = kLog2 ? (M + log2(L)) * acc_t(0.6931471805599453) : M + log(L);
  acc_t bern2 = 0, zz = 0;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    const int64_t k = i * D + d;
    const acc_t z = nac::tanh_(static_cast<acc_t>(a[k]));
    const acc_t m = static_cast<acc_t>(noise[k]);
    const acc_t rv = static_cast<acc_t>(r[k]);
    bern2 += nac::bern2_elem(m * z, rv);
    zz += z * z;
    if (grad) {
      acc_t A = 0;
      for (int p = 0; p < nsplit; ++p)
        if (pl[p * n + i] != 0)
          A += split_weight<kLog2>(pm[p * n + i] - M) * pacc[(p * n + i) * D + d];
      ga[k] = nac::grad_a_elem(m, z, s * A / L, rv, l2);
    }
  }
  // block reduction of (bern2, zz)
  for (int o = 16; o > 0; o >>= 1) {
    bern2 += __shfl_xor_sync(0xffffffffu, bern2, o);
    zz += __shfl_xor_sync(0xffffffffu, zz, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    red[0][warp] = bern2;
    red[1][warp] = zz;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    acc_t b = 0, q = 0;
    for (int w = 0; w < nwarps; ++w) {
      b += red[0][w];
      q += red[1][w];
    }
    lse[i] = lse_i;
    loss[i] = lse_i - log_n_keys - acc_t(0.5) * b + l2 * q;
  }
}

// Keys' gradient, docs/math.md [M:grad-keys]: per (key tile, query split), the split's share of dK.
template <typename key_t, typename acc_t, int DPAD>
__global__ void __launch_bounds__(kThreads)
bwd_keys_kernel(const acc_t* __restrict__ Q, const key_t* __restrict__ K,
                const acc_t* __restrict__ lse, const acc_t* __restrict__ g,
                acc_t* __restrict__ pdk, int64_t n, int64_t N, int D, int64_t blocks_per_split,
                int64_t self_offset) {
  constexpr int T = Tile<acc_t>::kT, R = T / 16, C = DPAD / 16;
  __shared__ acc_t Qs[T][kDChunk + 1];
  __shared__ acc_t Ks[T][kDChunk + 1];
  __shared__ acc_t Ps[T][T + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t j0 = int64_t(blockIdx.x) * T, sp = blockIdx.y;
  const int64_t istart = sp * blocks_per_split * T;
  const int64_t iend = n < istart + blocks_per_split * T ? n : istart + blocks_per_split * T;
  const int64_t jend = N < j0 + T ? N : j0 + T;
  acc_t dk[R][C];  // keys ty + 16 u, columns tx + 16 c
#pragma unroll
  for (int u = 0; u < R; ++u)
#pragma unroll
    for (int c = 0; c < C; ++c) dk[u][c] = 0;
  acc_t S[R][R];
  for (int64_t i0 = istart; i0 < iend; i0 += T) {
    score_tile<key_t, acc_t, T>(Q, K, i0, iend, j0, jend, D, Qs, Ks, S);  // rows: queries
    const int own_d = own_delta(self_offset, i0 + ty - j0 - tx);  // [M:self-key]: P_i,own = 0
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int64_t i = i0 + ty + 16 * u;
      const acc_t li = i < iend ? lse[i] : acc_t(0), gi = i < iend ? g[i] : acc_t(0);
#pragma unroll
      for (int v = 0; v < R; ++v) {
        const bool ok = i < iend && j0 + tx + 16 * v < jend && 16 * (v - u) != own_d;
        Ps[ty + 16 * u][tx + 16 * v] = ok ? nac::exp_(S[u][v] - li) * gi : acc_t(0);
      }
    }
#pragma unroll
    for (int d0 = 0; d0 < DPAD; d0 += kDChunk) {
      __syncthreads();
      for (int e = threadIdx.x; e < T * kDChunk; e += kThreads) {
        const int rr = e / kDChunk, dd = e % kDChunk;
        Qs[rr][dd] = (d0 + dd < D && i0 + rr < iend) ? Q[(i0 + rr) * D + d0 + dd] : acc_t(0);
      }
      __syncthreads();
#pragma unroll
      for (int h = 0; h < kDChunk / 16; ++h) {
        const int c = d0 / 16 + h;
        if (c >= C) break;
#pragma unroll 8
        for (int ii = 0; ii < T; ++ii) {
          const acc_t qv = Qs[ii][tx + 16 * h];
#pragma unroll
          for (int u = 0; u < R; ++u) dk[u][c] += Ps[ii][ty + 16 * u] * qv;
        }
      }
    }
    __syncthreads();
  }
  store_tile(pdk, dk, j0, jend, sp * N, D);
}

// d/dr = g times [M:grad-r]; d/da as in docs/math.md [M:grad-a] (+ [M:grad-self-keys]).
template <typename scalar_t, typename acc_t>
__global__ void bwd_rows_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ r,
                                const scalar_t* __restrict__ noise, const acc_t* __restrict__ ga,
                                const acc_t* __restrict__ g, const acc_t* __restrict__ dk,
                                acc_t* __restrict__ grad_a, acc_t* __restrict__ grad_r, int64_t n,
                                int D, bool need_a, bool need_r, bool self_keys) {
  const int64_t total = n * D;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const acc_t gi = g[k / D];
    const acc_t z = nac::tanh_(static_cast<acc_t>(a[k]));
    if (need_r)
      grad_r[k] = gi * nac::grad_r_elem(static_cast<acc_t>(noise[k]) * z,
                                        static_cast<acc_t>(r[k]));
    if (need_a) grad_a[k] = gi * ga[k] + (self_keys ? dk[k] * (acc_t(1) - z * z) : acc_t(0));
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------

int blocks_for(int64_t total, int threads = 256) {
  return static_cast<int>(std::min<int64_t>((total + threads - 1) / threads, 65535));
}

// The split of a matrix kernel's inner loop: about one wave of blocks, i.e. the SMs times the
// resident blocks per SM of that kernel as compiled (blocks_per_sm: cudaOccupancyMaxActive-
// BlocksPerMultiprocessor, from its registers, shared memory and threads; the bf16 kernels use
// 190-255 registers x 256 threads: one block per SM, where a fixed 2 per SM made two waves and
// twice the partials' traffic), a power of two, at most the tiles and 64.  The same rule as
// kernels/launch.py's split_count with Target.programs.
int64_t split_for(int64_t programs, int64_t tiles, int blocks_per_sm) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t want = (int64_t(sms) * std::max(blocks_per_sm, 1) + programs - 1) / programs, split = 1;
  while (split * 2 <= std::min<int64_t>({want, tiles, 64})) split *= 2;
  return split;
}

// Resident blocks per SM of `kernel` launched with `threads` threads and no dynamic shared memory.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads) {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  return blocks;
}

#define NAC_DISPATCH_DPAD(D, ...)                                              \
  [&] {                                                                        \
    if ((D) <= 32) { constexpr int DPAD = 32; return __VA_ARGS__(); }          \
    if ((D) <= 64) { constexpr int DPAD = 64; return __VA_ARGS__(); }          \
    if ((D) <= 128) { constexpr int DPAD = 128; return __VA_ARGS__(); }        \
    constexpr int DPAD = 256; return __VA_ARGS__();                            \
  }()

// ---- fp32/fp64: the SIMT kernels -------------------------------------------------------------

struct Prep {
  at::Tensor q, z, keys;  // q, z: acc dtype; keys: input dtype, contiguous (z when self keys)
};

template <typename scalar_t, typename acc_t>
Prep prologue(const at::Tensor& a, const at::Tensor& noise, const c10::optional<at::Tensor>& keys,
              double s) {
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  Prep p;
  p.q = at::empty(a.sizes(), a.options().dtype(acc));
  p.z = at::empty(a.sizes(), a.options().dtype(acc));
  auto stream = at::cuda::getCurrentCUDAStream();
  prologue_kernel<scalar_t, acc_t><<<blocks_for(a.numel()), 256, 0, stream>>>(
      a.data_ptr<scalar_t>(), noise.data_ptr<scalar_t>(), p.q.data_ptr<acc_t>(),
      p.z.data_ptr<acc_t>(), a.numel(), static_cast<acc_t>(s));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  p.keys = keys.has_value() ? keys->detach().to(a.scalar_type()).contiguous() : at::Tensor();
  return p;
}

// The forward's per-split partials (max, sum, acc) [M:lse-online], read by finish_kernel.
struct Partials {
  at::Tensor pm, pl, pacc;
  int64_t N, nsplit;
};

template <typename scalar_t, typename acc_t>
Partials fwd_partials_simt(const at::Tensor& a, const at::Tensor& noise,
                           const c10::optional<at::Tensor>& keys, double s, bool grad,
                           int64_t self_offset) {
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  const Prep p = prologue<scalar_t, acc_t>(a, noise, keys, s);
  const bool self_keys = !keys.has_value();
  const int64_t N = self_keys ? n : p.keys.size(0);
  constexpr int T = Tile<acc_t>::kT;
  const int64_t qtiles = (n + T - 1) / T, ktiles = (N + T - 1) / T;
  int occupancy = 0;
  NAC_DISPATCH_DPAD(D, [&] { occupancy = blocks_per_sm(fwd_kernel<acc_t, acc_t, DPAD>, kThreads); });
  const int64_t nsplit = split_for(qtiles, ktiles, occupancy);
  const int64_t tiles_per_split = (ktiles + nsplit - 1) / nsplit;
  const auto opts = p.q.options();
  Partials out{at::empty({nsplit, n}, opts), at::empty({nsplit, n}, opts),
               grad ? at::empty({nsplit, n, D}, opts) : at::empty({1}, opts), N, nsplit};
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(qtiles), static_cast<unsigned>(nsplit));
  NAC_DISPATCH_DPAD(D, [&] {
    // scalar_t == acc_t here (fp32/fp64): queue keys and self keys share one instantiation
    const acc_t* kp = self_keys ? p.z.data_ptr<acc_t>() : p.keys.data_ptr<acc_t>();
    fwd_kernel<acc_t, acc_t, DPAD><<<grid, kThreads, 0, stream>>>(
        p.q.data_ptr<acc_t>(), kp, out.pm.data_ptr<acc_t>(), out.pl.data_ptr<acc_t>(),
        out.pacc.data_ptr<acc_t>(), n, N, D, tiles_per_split, grad, self_offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// dK [M:grad-keys] (natural units, acc dtype), the query splits summed in a fixed order.
template <typename scalar_t, typename acc_t>
at::Tensor keys_grad_simt(const at::Tensor& a, const at::Tensor& noise,
                          const c10::optional<at::Tensor>& keys, const at::Tensor& lse,
                          const at::Tensor& g, double s, int64_t self_offset) {
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  const Prep p = prologue<scalar_t, acc_t>(a, noise, keys, s);
  const bool self_keys = !keys.has_value();
  const int64_t N = self_keys ? n : p.keys.size(0);
  constexpr int T = Tile<acc_t>::kT;
  const int64_t ktiles = (N + T - 1) / T, qtiles = (n + T - 1) / T;
  int occupancy = 0;
  NAC_DISPATCH_DPAD(D, [&] {
    occupancy = blocks_per_sm(bwd_keys_kernel<acc_t, acc_t, DPAD>, kThreads);
  });
  const int64_t nsplit = split_for(ktiles, qtiles, occupancy);
  const int64_t per = (qtiles + nsplit - 1) / nsplit;
  at::Tensor pdk = at::empty({nsplit, N, D}, p.q.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(ktiles), static_cast<unsigned>(nsplit));
  NAC_DISPATCH_DPAD(D, [&] {
    const acc_t* kp = self_keys ? p.z.data_ptr<acc_t>() : p.keys.data_ptr<acc_t>();
    bwd_keys_kernel<acc_t, acc_t, DPAD><<<grid, kThreads, 0, stream>>>(
        p.q.data_ptr<acc_t>(), kp, lse.data_ptr<acc_t>(), g.data_ptr<acc_t>(),
        pdk.data_ptr<acc_t>(), n, N, D, per, self_offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return nsplit == 1 ? pdk[0] : pdk.sum(0);  // fixed-order sum of the splits: deterministic
}

// ---- bf16/fp16: the tensor-core kernels (nac_cuda_mma.cu) ----------------------------------

template <typename scalar_t>
constexpr bool is_16bit() {
  return std::is_same<scalar_t, at::BFloat16>::value || std::is_same<scalar_t, at::Half>::value;
}

int dpad_for(int64_t D) { return D <= 32 ? 32 : D <= 64 ? 64 : D <= 128 ? 128 : 256; }

// Q2 = s log2(e) m tanh(a) (n, dpad) and the keys as an mma operand: K = tanh(a) (n, dpad) for
// the self keys; the given keys in a's dtype, read in place when D % 8 == 0 and the base is
// 16-byte aligned (cp.async copies 16 bytes), else copied into a zero-padded (N, dpad) buffer.
struct MmaPrep {
  at::Tensor q, k;
  nac_mma::Operand qop, kop;
  nac_mma::Dtype dt;
  int dpad;
};

template <typename scalar_t>
MmaPrep mma_prologue(const at::Tensor& a, const at::Tensor& noise,
                     const c10::optional<at::Tensor>& keys, double s) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major >= 8, "nac_fast cuda backend: bf16/fp16 inputs run on tensor cores "
              "(mma.sync, cp.async) and need compute capability 8.0 or newer; this GPU is ",
              prop->major, ".", prop->minor, ". Use float32 inputs or backend='triton'");
  const int64_t n = a.size(0), D = a.size(1);
  MmaPrep p;
  p.dt = std::is_same<scalar_t, at::BFloat16>::value ? nac_mma::Dtype::kBF16
                                                     : nac_mma::Dtype::kF16;
  p.dpad = dpad_for(D);
  p.q = at::empty({n, p.dpad}, a.options());
  const bool self_keys = !keys.has_value();
  if (self_keys) p.k = at::empty({n, p.dpad}, a.options());
  nac_mma::prologue(p.dt, a.data_ptr(), noise.data_ptr(), p.q.data_ptr(),
                    self_keys ? p.k.data_ptr() : nullptr, n, static_cast<int>(D), p.dpad,
                    static_cast<float>(s * 1.4426950408889634), at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  p.qop = {p.q.data_ptr(), n, p.dpad, p.dpad / 8};
  if (self_keys) {
    p.kop = {p.k.data_ptr(), n, p.dpad, p.dpad / 8};
  } else {
    at::Tensor kk = keys->detach().to(a.scalar_type()).contiguous();
    const int64_t N = kk.size(0);
    if (D % 8 == 0 && reinterpret_cast<uintptr_t>(kk.data_ptr()) % 16 == 0) {
      p.k = kk;
      p.kop = {p.k.data_ptr(), N, D, static_cast<int>(D / 8)};
    } else {
      p.k = at::zeros({N, p.dpad}, a.options());
      p.k.narrow(1, 0, D).copy_(kk);
      p.kop = {p.k.data_ptr(), N, p.dpad, p.dpad / 8};
    }
  }
  return p;
}

template <typename scalar_t>
Partials fwd_partials_mma(const at::Tensor& a, const at::Tensor& noise,
                          const c10::optional<at::Tensor>& keys, double s, bool grad,
                          int64_t self_offset) {
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  const MmaPrep p = mma_prologue<scalar_t>(a, noise, keys, s);
  const int64_t N = p.kop.rows;
  const nac_mma::Tiles t = nac_mma::tiles(p.dpad);
  const int64_t qtiles = (n + t.resident - 1) / t.resident, ktiles = (N + t.stream - 1) / t.stream;
  const int64_t nsplit = split_for(qtiles, ktiles, nac_mma::fwd_blocks_per_sm(p.dt, p.dpad));
  const int64_t tiles_per_split = (ktiles + nsplit - 1) / nsplit;
  const auto opts = a.options().dtype(at::kFloat);
  Partials out{at::empty({nsplit, n}, opts), at::empty({nsplit, n}, opts),
               grad ? at::empty({nsplit, n, D}, opts) : at::empty({1}, opts), N, nsplit};
  nac_mma::fwd(p.dt, p.dpad, p.qop, p.kop, out.pm.data_ptr<float>(), out.pl.data_ptr<float>(),
               out.pacc.data_ptr<float>(), D, tiles_per_split, static_cast<int>(nsplit), grad,
               self_offset, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

template <typename scalar_t>
at::Tensor keys_grad_mma(const at::Tensor& a, const at::Tensor& noise,
                         const c10::optional<at::Tensor>& keys, const at::Tensor& lse,
                         const at::Tensor& g, double s, int64_t self_offset) {
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  const MmaPrep p = mma_prologue<scalar_t>(a, noise, keys, s);
  const int64_t N = p.kop.rows;
  const nac_mma::Tiles t = nac_mma::tiles(p.dpad);
  const int64_t ktiles = (N + t.resident - 1) / t.resident, qtiles = (n + t.stream - 1) / t.stream;
  const int64_t nsplit = split_for(ktiles, qtiles, nac_mma::bwd_blocks_per_sm(p.dt, p.dpad));
  const int64_t per = (qtiles + nsplit - 1) / nsplit;
  at::Tensor pdk = at::empty({nsplit, N, D}, a.options().dtype(at::kFloat));
  nac_mma::bwd_keys(p.dt, p.dpad, p.qop, p.kop, lse.data_ptr<float>(), g.data_ptr<float>(),
                    pdk.data_ptr<float>(), D, per, static_cast<int>(nsplit), self_offset,
                    at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return nsplit == 1 ? pdk[0] : pdk.sum(0);  // fixed-order sum of the splits: deterministic
}

// ---- The ops' two halves, either path ------------------------------------------------------

template <typename scalar_t, typename acc_t>
std::vector<at::Tensor> fwd_impl(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                                 const c10::optional<at::Tensor>& keys, double s, double l2,
                                 bool grad, int64_t self_offset) {
  constexpr bool kMma = is_16bit<scalar_t>();
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  Partials p;
  if constexpr (kMma) p = fwd_partials_mma<scalar_t>(a, noise, keys, s, grad, self_offset);
  else p = fwd_partials_simt<scalar_t, acc_t>(a, noise, keys, s, grad, self_offset);
  // log N, or log(N - 1) with the row's own key left out ([M:self-key])
  const int64_t n_keys = self_offset >= 0 ? p.N - 1 : p.N;
  const auto opts = a.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
  at::Tensor loss = at::empty({n}, opts), lse = at::empty({n}, opts);
  at::Tensor ga = grad ? at::empty({n, D}, opts) : at::empty({0}, opts);
  finish_kernel<scalar_t, acc_t, kMma><<<static_cast<unsigned>(n), 128, 0,
                                         at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), noise.data_ptr<scalar_t>(),
      p.pm.data_ptr<acc_t>(), p.pl.data_ptr<acc_t>(), p.pacc.data_ptr<acc_t>(),
      loss.data_ptr<acc_t>(), lse.data_ptr<acc_t>(), grad ? ga.data_ptr<acc_t>() : nullptr, n, D,
      static_cast<int>(p.nsplit), static_cast<acc_t>(s), static_cast<acc_t>(l2),
      static_cast<acc_t>(std::log(static_cast<double>(n_keys))), grad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {loss, lse, ga};
}

template <typename scalar_t, typename acc_t>
std::vector<at::Tensor> bwd_impl(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                                 const c10::optional<at::Tensor>& keys, const at::Tensor& lse_in,
                                 const at::Tensor& ga_in, const at::Tensor& g_in, double s,
                                 bool need_a, bool need_r, bool need_keys, int64_t self_offset) {
  const int64_t n = a.size(0);
  const int D = static_cast<int>(a.size(1));
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const auto opts = a.options().dtype(acc);
  const at::Tensor g = g_in.detach().to(acc).contiguous();
  const bool self_keys = !keys.has_value();
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor dk = at::empty({0}, opts);
  if ((need_a && self_keys) || (need_keys && !self_keys)) {
    const at::Tensor lse = lse_in.detach().to(acc).contiguous();
    if constexpr (is_16bit<scalar_t>())
      dk = keys_grad_mma<scalar_t>(a, noise, keys, lse, g, s, self_offset);
    else
      dk = keys_grad_simt<scalar_t, acc_t>(a, noise, keys, lse, g, s, self_offset);
  }
  at::Tensor grad_a = need_a ? at::empty({n, D}, opts) : at::empty({0}, opts);
  at::Tensor grad_r = need_r ? at::empty({n, D}, opts) : at::empty({0}, opts);
  if (need_a || need_r) {
    const at::Tensor ga = need_a ? ga_in.detach().to(acc).contiguous() : at::empty({0}, opts);
    bwd_rows_kernel<scalar_t, acc_t><<<blocks_for(n * D), 256, 0, stream>>>(
        a.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), noise.data_ptr<scalar_t>(),
        need_a ? ga.data_ptr<acc_t>() : nullptr, g.data_ptr<acc_t>(),
        (need_a && self_keys) ? dk.data_ptr<acc_t>() : nullptr,
        need_a ? grad_a.data_ptr<acc_t>() : nullptr, need_r ? grad_r.data_ptr<acc_t>() : nullptr,
        n, D, need_a, need_r, self_keys);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor grad_k = (need_keys && !self_keys) ? dk : at::empty({0}, opts);
  return {grad_a, grad_r, grad_k};
}

// Limits of this kernel beyond the shared checks (nac_checks.h): D <= 256 (the DPAD variants) and
// n < 2^31 (finish_kernel's grid has one block per row).
void check_cuda_limits(const at::Tensor& a) {
  TORCH_CHECK(a.size(1) <= 256, "nac_fast cuda backend: D <= 256 (got ", a.size(1),
              "); use backend='triton' for wider codes");
  TORCH_CHECK(a.size(0) <= std::numeric_limits<int32_t>::max(),
              "nac_fast cuda backend: a must have fewer than 2^31 rows, got ", a.size(0));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_fwd_cuda(
    const at::Tensor& a_in, const at::Tensor& r_in, const at::Tensor& noise_in,
    const c10::optional<at::Tensor>& keys, double s, double l2, bool grad_rows,
    int64_t self_offset) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  nac::check_fwd_args(a_in, r_in, noise_in, keys, self_offset);
  check_cuda_limits(a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  // Strided inputs are made contiguous here (and lse, ga, g in bwd_impl), not rejected.
  const at::Tensor a = a_in.detach().contiguous();
  const at::Tensor r = r_in.detach().to(a.scalar_type()).contiguous();
  const at::Tensor noise = noise_in.detach().to(a.scalar_type()).contiguous();
  std::vector<at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "nac_fwd", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;  // double for double, else float
    out = fwd_impl<scalar_t, acc_t>(a, r, noise, keys, s, l2, grad_rows, self_offset);
  });
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_bwd_cuda(
    const at::Tensor& a_in, const at::Tensor& r_in, const at::Tensor& noise_in,
    const c10::optional<at::Tensor>& keys, const at::Tensor& lse, const at::Tensor& ga,
    const at::Tensor& g, double s, bool need_a, bool need_r, bool need_keys,
    int64_t self_offset) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  nac::check_bwd_args(a_in, r_in, noise_in, keys, lse, ga, g, need_a, self_offset);
  check_cuda_limits(a_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  // Strided inputs are made contiguous here (and lse, ga, g in bwd_impl), not rejected.
  const at::Tensor a = a_in.detach().contiguous();
  const at::Tensor r = r_in.detach().to(a.scalar_type()).contiguous();
  const at::Tensor noise = noise_in.detach().to(a.scalar_type()).contiguous();
  std::vector<at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "nac_bwd", [&] {
    using acc_t = at::acc_type<scalar_t, /*is_cuda=*/true>;
    out = bwd_impl<scalar_t, acc_t>(a, r, noise, keys, lse, ga, g, s, need_a, need_r, need_keys,
                                    self_offset);
  });
  return {out[0], out[1], out[2]};
}

// nac_fast::nac_noise (schema and CPU version: nac_noise.cpp): one thread per element, the seed
// read from device memory so the caller never waits for the host.
__global__ void noise_kernel(float* __restrict__ out, const int64_t* __restrict__ seed, float p,
                             int64_t numel) {
  const uint64_t s = static_cast<uint64_t>(*seed);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < numel;
       i += (int64_t)gridDim.x * blockDim.x) {
    out[i] = nac::noise_sign(s, static_cast<uint64_t>(i), p);
  }
}

at::Tensor nac_noise_cuda(const at::Tensor& like, const at::Tensor& seed, double p) {
  nac::check_noise_args(like, seed, p);
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor out = at::empty(like.sizes(), like.options().dtype(at::kFloat)
                                               .memory_format(at::MemoryFormat::Contiguous));
  const int64_t numel = out.numel();
  if (numel > 0) {
    const int threads = 256;
    const int64_t blocks = std::min<int64_t>((numel + threads - 1) / threads, 65535);
    noise_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        out.data_ptr<float>(), seed.data_ptr<int64_t>(), static_cast<float>(p), numel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return like.scalar_type() == at::kFloat ? out : out.to(like.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(nac_fast, CUDA, m) {
  m.impl("nac_fwd", &nac_fwd_cuda);
  m.impl("nac_bwd", &nac_bwd_cuda);
  m.impl("nac_noise", &nac_noise_cuda);
}
