// Fused CPU kernels of the NAC losses (docs/math.md [M:rows], [M:passes]): nac_fwd (loss rows,
// lse and, when asked, ga [M:ga], by the online logsumexp [M:lse-online]) and nac_bwd (d/dr
// [M:grad-r], the keys' tile pass [M:grad-keys], [M:grad-self-keys], and d/da [M:grad-a]).
// Per-element helpers: nac_math.h.  self_offset >= 0 leaves row i's own key (key self_offset + i)
// out of its logsumexp, [M:self-key]: the tiles that hold it skip it in the max and the exps
// (own_column, row_max_but, exp_shift_but below), so its probability is exactly 0 in the
// forward's sums and in the keys' backward, and the constant is log(N - 1).
//
// Never materialises the n x N logits: each worker holds one (BQ x BK) tile of them.  Tiles are
// sized to stay in a core's L2 cache (a 128 x 512 fp32 tile is 256 KiB), where MKL's sgemm runs
// well above the rate of the reference's n x N product, which streams its whole result to memory
// (figures: bench/results/cpu_micro.md, "GEMM in L2 tiles").  The GEMMs go through at::mm_out on
// tile views (MKL), the softmax work through vectorised loops (fast_expf below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "nac_checks.h"
#include "nac_math.h"

namespace {

constexpr int64_t kBQ = 128;  // query rows per tile
constexpr int64_t kBK = 512;  // keys per tile: a 128 x 512 fp32 tile is 256 KiB

// ---------------------------------------------------------------------------------------------
// Row operations on a logits tile.  One build runs on any x86-64: the AVX-512 intrinsics path is
// picked at load time where the CPU has it, else GCC's target_clones versions (AVX2 / baseline).
// ---------------------------------------------------------------------------------------------

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NAC_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define NAC_MULTIVERSION
#endif

constexpr int kLanes = 16;

NAC_MULTIVERSION
static float row_max_f(const float* __restrict x, int64_t n) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = x[c + l] > lanes[l] ? x[c + l] : lanes[l];
  float m = lanes[0];
  for (int l = 1; l < kLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; c < n; ++c) m = x[c] > m ? x[c] : m;
  return m;
}

// x <- exp(x - shift) * mult, returns the sum of the exps (before mult).  Two simple loops: GCC
// vectorises each (checked with -fopt-info-vec), but not the fused loop.
NAC_MULTIVERSION
static float exp_shift_f(float* __restrict x, int64_t n, float shift, float mult) {
  for (int64_t c = 0; c < n; ++c) x[c] = nac::exp_(x[c] - shift);
  float lanes[kLanes] = {0};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      lanes[l] += x[c + l];
      x[c + l] *= mult;
    }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += lanes[l];
  for (; c < n; ++c) {
    s += x[c];
    x[c] *= mult;
  }
  return s;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define NAC_AVX512_PATH 1
// GCC 12's avx512fintrin.h trips -W(maybe-)uninitialized inside its reduce/mask intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// The AVX-512 path is written with intrinsics: vscalefps does the 2^k scaling (no integer
// round trip) and masked loads handle row tails, so the whole softmax step of a tile row is one
// pass of ~20 vector instructions per 16 logits.
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
  // operands in this order: vmaxps returns its second operand when one is NaN, so NaN stays NaN
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, k);
}

__attribute__((target("avx512f"))) static float row_max_avx512(const float* x, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + c));
  if (c < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - c)) - 1u);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, mask, x + c));
  }
  return _mm512_reduce_max_ps(m);
}

__attribute__((target("avx512f"))) static float exp_shift_avx512(float* x, int64_t n, float shift,
                                                                 float mult) {
  const __m512 sh = _mm512_set1_ps(shift), mu = _mm512_set1_ps(mult);
  __m512 sum = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + c), sh));
    sum = _mm512_add_ps(sum, e);
    _mm512_storeu_ps(x + c, _mm512_mul_ps(e, mu));
  }
  if (c < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - c)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                          mask, x + c);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(v, sh)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(x + c, mask, _mm512_mul_ps(e, mu));
  }
  return _mm512_reduce_add_ps(sum);
}

static const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
#endif

static double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t c = 0; c < n; ++c) m = std::max(m, x[c]);
  return m;
}
static float row_max(const float* x, int64_t n) {
#ifdef NAC_AVX512_PATH
  if (kHaveAvx512) return row_max_avx512(x, n);
#endif
  return row_max_f(x, n);
}

static double exp_shift(double* x, int64_t n, double shift, double mult) {
  double s = 0.0;
  for (int64_t c = 0; c < n; ++c) {
    const double e = std::exp(x[c] - shift);
    s += e;
    x[c] = e * mult;
  }
  return s;
}
static float exp_shift(float* x, int64_t n, float shift, float mult) {
#ifdef NAC_AVX512_PATH
  if (kHaveAvx512) return exp_shift_avx512(x, n, shift, mult);
#endif
  return exp_shift_f(x, n, shift, mult);
}

// The row's own key, docs/math.md [M:self-key]: its column in a tile of bk keys from key j0, for
// row `row` (of a) with self_offset o >= 0 (its own key is key o + row), or -1 when that key is
// not in the tile or every key counts (o = -1).
static inline int64_t own_column(int64_t self_offset, int64_t row, int64_t j0, int64_t bk) {
  if (self_offset < 0) return -1;
  const int64_t c = self_offset + row - j0;
  return c >= 0 && c < bk ? c : -1;
}

// One tile row's max with column `own` left out (own = -1: every column).
template <typename T>
static inline T row_max_but(const T* x, int64_t n, int64_t own) {
  if (own < 0) return row_max(x, n);
  return std::max(row_max(x, own), row_max(x + own + 1, n - own - 1));
}

// exp_shift over the row with column `own` left out: that entry is set to exactly 0 and adds
// nothing to the returned sum (own = -1: exp_shift itself).  The two segments are the row's keys
// before and after its own; no -inf is written (the vectorised exps clamp their argument at
// -87, so exp(-inf) would be 1.6e-38, not 0).
template <typename T>
static inline T exp_shift_but(T* x, int64_t n, T shift, T mult, int64_t own) {
  if (own < 0) return exp_shift(x, n, shift, mult);
  const T left = exp_shift(x, own, shift, mult);
  const T right = exp_shift(x + own + 1, n - own - 1, shift, mult);
  x[own] = T(0);
  return left + right;
}

// ---------------------------------------------------------------------------------------------
// Elementwise row work (O(nD)), in float compiled per ISA so the nac_math.h formulas vectorise.
// ---------------------------------------------------------------------------------------------

NAC_MULTIVERSION
static void tanh_array(const float* __restrict x, float* __restrict y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = nac::tanh_(x[k]);
}
static void tanh_array(const double* x, double* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = nac::tanh_(x[k]);
}

// One finished row: returns 2 * bern_i and ||z_i||^2; writes ga [M:ga] from A = sum_j e_ij k_j
// scaled by a_scale = s / sum_j e_ij (sA of [M:grad-query]).
template <typename T>
static inline void finish_row_impl(const T* __restrict z, const T* __restrict m,
                                   const T* __restrict r, const T* __restrict A, T a_scale, T lam,
                                   T* __restrict ga, int64_t D, T* bern2_out, T* zz_out) {
  T bern2 = 0, zz = 0;
#pragma omp simd reduction(+ : bern2, zz)
  for (int64_t d = 0; d < D; ++d) {
    bern2 += nac::bern2_elem(m[d] * z[d], r[d]);
    zz += z[d] * z[d];
  }
  if (ga != nullptr) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ga[d] = nac::grad_a_elem(m[d], z[d], a_scale * A[d], r[d], lam);
  }
  *bern2_out = bern2;
  *zz_out = zz;
}
NAC_MULTIVERSION
static void finish_row(const float* z, const float* m, const float* r, const float* A,
                       float a_scale, float lam, float* ga, int64_t D, float* b, float* q) {
  finish_row_impl(z, m, r, A, a_scale, lam, ga, D, b, q);
}
static void finish_row(const double* z, const double* m, const double* r, const double* A,
                       double a_scale, double lam, double* ga, int64_t D, double* b, double* q) {
  finish_row_impl(z, m, r, A, a_scale, lam, ga, D, b, q);
}

// In place: zio holds z_i on entry and g * d loss_i / d r_i on return (the backward keeps z in
// the d/dr output buffer, so d/dr costs no memory of its own).
template <typename T>
static inline void grad_r_row_inplace_impl(T* __restrict zio, const T* __restrict m,
                                           const T* __restrict r, T g, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) zio[d] = g * nac::grad_r_elem(m[d] * zio[d], r[d]);
}
NAC_MULTIVERSION
static void grad_r_row_inplace(float* zio, const float* m, const float* r, float g, int64_t D) {
  grad_r_row_inplace_impl(zio, m, r, g, D);
}
static void grad_r_row_inplace(double* zio, const double* m, const double* r, double g,
                               int64_t D) {
  grad_r_row_inplace_impl(zio, m, r, g, D);
}

// ---------------------------------------------------------------------------------------------
// Shared set-up.  Extra memory is kept to the outputs, z = tanh(a) (n x D) and one workspace per
// worker: the queries q = s m z of a block are formed per work item (BQ x D), the row-gradient
// accumulator is the forward's ga output itself, and the backward keeps z in its d/dr output.
// The forward's z and the workspaces are OS scratch (os_scratch below), returned at once.  Peak
// RSS against the reference: python bench/cpu_memory.py, bench/results/cpu_memory.csv.
// ---------------------------------------------------------------------------------------------

struct Operands {
  at::Tensor a;     // (n, D) acc dtype, contiguous
  at::Tensor m;     // (n, D) noise, acc dtype, contiguous
  at::Tensor z;     // (n, D) tanh(a)
  at::Tensor keys;  // (N, D) contiguous: z itself when keys=None; given keys in their own dtype
  bool convert_keys() const { return keys.scalar_type() != z.scalar_type(); }
  // A key tile in the accumulation dtype: a view of `keys`, or (bf16/fp16 keys) the worker's
  // (kBK, D) `buf` filled from it.  Converting tile by tile keeps extra memory at one tile per
  // worker: a whole-queue fp32 copy would be M x D x 4 bytes (32 MiB for a 65536 x 128 queue),
  // many times the fp32 path's peak.
  at::Tensor key_tile(int64_t j0, int64_t bk, const at::Tensor& buf) const {
    const at::Tensor k = keys.narrow(0, j0, bk);
    if (!convert_keys()) return k;
    return buf.narrow(0, 0, bk).copy_(k);
  }
};

// A scratch tensor whose pages come straight from the OS and go back to it when the tensor dies.
// The ops' temporaries (the forward's z, each worker's workspace) are taken so.  From malloc,
// glibc keeps a freed chunk in its heap once its mmap threshold has grown (any freed 2 MiB tensor
// makes it grow), small allocations split it, and the backward's outputs then took fresh pages:
// the forward's 2 MiB z stayed resident through the backward at 4096 x 128 fp32 (traced with
// bench/cpu_memory.py's protocol).  One mmap with MAP_POPULATE costs microseconds, nothing next
// to a pass; below 64 KiB the heap's recycling is the better deal.
static at::Tensor os_scratch(at::IntArrayRef sizes, const at::TensorOptions& opts) {
#if defined(__linux__)
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * opts.dtype().itemsize();
  if (bytes >= (size_t{64} << 10)) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);  // one call, no page faults
    TORCH_CHECK(p != MAP_FAILED, "nac_fast: mmap of ", bytes, " bytes of scratch failed");
    // Tell the profiler, as the CPU allocator does, so profiler-based memory counts
    // (bench/bench_loss.py) still see the scratch.
    const c10::Device cpu(c10::DeviceType::CPU);
    const auto nb = static_cast<int64_t>(bytes);
    if (c10::memoryProfilingEnabled()) c10::reportMemoryUsageToProfiler(p, nb, 0, 0, cpu);
    return at::from_blob(p, sizes, [bytes, nb, cpu](void* q) {
      munmap(q, bytes);
      if (c10::memoryProfilingEnabled()) c10::reportMemoryUsageToProfiler(q, -nb, 0, 0, cpu);
    }, opts);
  }
#endif
  return at::empty(sizes, opts);
}

// One worker's buffers, in one scratch block: the logits tile (bq x bk, row stride ld = bk), the
// queries of a block (bq x D) and, for bf16/fp16 keys, a converted key tile (bk x D).  bq and bk
// are the largest blocks the call uses (kBQ and kBK at most): a small call's workspace is small,
// so it comes from the heap (os_scratch) instead of a 260 KiB mmap per call, which cost a call
// at n = 4 about 80 us of its ~100 (bench/host_overhead.py's cpu rows).
struct Workspace {
  at::Tensor block, tile, qbuf, kbuf;
  int64_t ld;  // the tile's row stride
  Workspace(const Operands& op, int64_t D, int64_t bq, int64_t bk) : ld(bk) {
    const int64_t kn = op.convert_keys() ? bk * D : 0;
    block = os_scratch({bq * bk + bq * D + kn}, op.z.options());
    tile = block.narrow(0, 0, bq * bk).view({bq, bk});
    qbuf = block.narrow(0, bq * bk, bq * D).view({bq, D});
    if (kn) kbuf = block.narrow(0, bq * bk + bq * D, kn).view({bk, D});
  }
};

// z goes into `zbuf` when given (an (n, D) contiguous acc-dtype buffer the caller will reuse).
template <typename acc_t>
Operands make_operands(const at::Tensor& a, const at::Tensor& noise,
                       const c10::optional<at::Tensor>& keys, at::Tensor zbuf = at::Tensor()) {
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  Operands op;
  op.a = a.detach().to(acc).contiguous();
  op.m = noise.detach().to(acc).contiguous();
  op.z = zbuf.defined() ? zbuf : at::empty_like(op.a);
  const acc_t* pa = op.a.data_ptr<acc_t>();
  acc_t* pz = op.z.data_ptr<acc_t>();
  at::parallel_for(0, op.a.numel(), 16384, [&](int64_t b, int64_t e) {
    tanh_array(pa + b, pz + b, e - b);
  });
  op.keys = keys.has_value() ? keys->detach().contiguous() : op.z;
  return op;
}

// q rows [i0, i0 + bq) into `out` (bq x D, contiguous).
template <typename acc_t>
void fill_queries(const Operands& op, int64_t i0, int64_t bq, acc_t s, acc_t* out) {
  const int64_t D = op.z.size(1);
  const acc_t* pz = op.z.data_ptr<acc_t>() + i0 * D;
  const acc_t* pm = op.m.data_ptr<acc_t>() + i0 * D;
  for (int64_t k = 0; k < bq * D; ++k) out[k] = s * pm[k] * pz[k];
}

// Split `ntiles` tiles into `parts` contiguous ranges; range number p.
static inline std::pair<int64_t, int64_t> tile_range(int64_t ntiles, int64_t parts, int64_t p) {
  const int64_t per = ntiles / parts, rem = ntiles % parts;
  const int64_t b = p * per + std::min(p, rem);
  return {b, b + per + (p < rem ? 1 : 0)};
}

// ---------------------------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------------------------

template <typename acc_t>
std::vector<at::Tensor> nac_fwd_impl(const at::Tensor& a, const at::Tensor& r,
                                     const at::Tensor& noise, const c10::optional<at::Tensor>& keys,
                                     double s, double l2, bool grad_rows, int64_t self_offset) {
  const int64_t n = a.size(0), D = a.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  const Operands op =
      make_operands<acc_t>(a, noise, keys, os_scratch({n, D}, a.options().dtype(acc)));
  const int64_t N = op.keys.size(0);
  const auto opts = op.z.options();
  const acc_t sc = static_cast<acc_t>(s), lam = static_cast<acc_t>(l2);

  // Work items: query blocks x key splits.  With fewer query blocks than threads (MQ: n = 512 is
  // 4 blocks; n = 1 is one) the keys are split too and the partial softmax states merged, so every
  // core has work.
  const int64_t nthreads = at::get_num_threads();
  const int64_t qblocks = (n + kBQ - 1) / kBQ;
  const int64_t ktiles = (N + kBK - 1) / kBK;
  const int64_t nsplit = std::max<int64_t>(1, std::min(ktiles, (nthreads + qblocks - 1) / qblocks));
  at::Tensor pm = at::empty({nsplit, n}, opts);  // running max
  at::Tensor pl = at::empty({nsplit, n}, opts);  // running sum
  // sum_j e_ij k_j.  Unsplit, it accumulates straight in the d/da output, finished in place below.
  at::Tensor ga = grad_rows ? at::empty({n, D}, opts) : at::empty({0}, opts);
  at::Tensor pacc = !grad_rows ? at::Tensor() : nsplit == 1 ? ga.view({1, n, D})
                                                            : at::empty({nsplit, n, D}, opts);

  at::parallel_for(0, qblocks * nsplit, 1, [&](int64_t wb, int64_t we) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // OpenMP workers start without the TLS
    const Workspace ws(op, D, std::min(kBQ, n), std::min(kBK, N));
    const at::Tensor &tile = ws.tile, &qbuf = ws.qbuf, &kbuf = ws.kbuf;
    acc_t* S = tile.data_ptr<acc_t>();
    const int64_t ld = ws.ld;
    for (int64_t w = wb; w < we; ++w) {
      const int64_t qb = w / nsplit, sp = w % nsplit;
      const int64_t i0 = qb * kBQ, bq = std::min(kBQ, n - i0);
      const auto kr = tile_range(ktiles, nsplit, sp);
      acc_t* mrun = pm.data_ptr<acc_t>() + sp * n + i0;
      acc_t* lrun = pl.data_ptr<acc_t>() + sp * n + i0;
      for (int64_t i = 0; i < bq; ++i) {
        mrun[i] = -std::numeric_limits<acc_t>::infinity();
        lrun[i] = 0;
      }
      at::Tensor acc;
      acc_t* accp = nullptr;
      if (grad_rows) {
        acc = pacc[sp].narrow(0, i0, bq);
        acc.zero_();
        accp = acc.data_ptr<acc_t>();
      }
      fill_queries<acc_t>(op, i0, bq, sc, qbuf.data_ptr<acc_t>());
      const at::Tensor qI = qbuf.narrow(0, 0, bq);
      for (int64_t kt = kr.first; kt < kr.second; ++kt) {
        const int64_t j0 = kt * kBK, bk = std::min(kBK, N - j0);
        at::Tensor St = tile.narrow(0, 0, bq).narrow(1, 0, bk);  // row stride ld
        const at::Tensor kJ = op.key_tile(j0, bk, kbuf);
        at::mm_out(St, qI, kJ.t());
        for (int64_t i = 0; i < bq; ++i) {
          acc_t* Si = S + i * ld;
          const int64_t own = own_column(self_offset, i0 + i, j0, bk);  // -1: none here
          const acc_t tmax = row_max_but(Si, bk, own);
          if (own >= 0 && tmax == -std::numeric_limits<acc_t>::infinity()) {
            // the row's own key the only one of the tile (its last key): nothing to add
            std::fill(Si, Si + bk, acc_t(0));
            continue;
          }
          const acc_t mnew = std::max(mrun[i], tmax);
          if (mnew > mrun[i] && lrun[i] > 0) {  // rescale the running state to the new max
            const acc_t f = std::exp(mrun[i] - mnew);
            lrun[i] *= f;
            if (grad_rows)
              for (int64_t d = 0; d < D; ++d) accp[i * D + d] *= f;
          }
          mrun[i] = mnew;
          lrun[i] += exp_shift_but(Si, bk, mnew, acc_t(1), own);
        }
        if (grad_rows) acc.addmm_(St, kJ);
      }
    }
  });

  // Merge the splits and finish every row: lse, loss, per-row gradients.
  at::Tensor loss = at::empty({n}, opts), lse = at::empty({n}, opts);
  const at::Tensor r_ = r.detach().to(op.z.scalar_type()).contiguous();
  const acc_t* pz = op.z.data_ptr<acc_t>();
  const acc_t* pr = r_.data_ptr<acc_t>();
  const acc_t* pmn = op.m.data_ptr<acc_t>();
  const acc_t* pmax = pm.data_ptr<acc_t>();
  const acc_t* psum = pl.data_ptr<acc_t>();
  const acc_t* pac = grad_rows ? pacc.data_ptr<acc_t>() : nullptr;
  acc_t* ploss = loss.data_ptr<acc_t>();
  acc_t* plse = lse.data_ptr<acc_t>();
  acc_t* pga = grad_rows ? ga.data_ptr<acc_t>() : nullptr;
  // log N, or log(N - 1) with the row's own key left out ([M:self-key])
  const acc_t logN = std::log(static_cast<acc_t>(self_offset >= 0 ? N - 1 : N));
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    std::vector<acc_t> w(nsplit), arow(grad_rows ? D : 0);
    for (int64_t i = b; i < e; ++i) {
      acc_t M = -std::numeric_limits<acc_t>::infinity();
      for (int64_t p = 0; p < nsplit; ++p) M = std::max(M, pmax[p * n + i]);
      acc_t L = 0;
      for (int64_t p = 0; p < nsplit; ++p) {
        // != 0, not > 0: a split whose sum is NaN must poison the row, not drop out of it
        w[p] = psum[p * n + i] != 0 ? std::exp(pmax[p * n + i] - M) : acc_t(0);
        L += w[p] * psum[p * n + i];
      }
      plse[i] = M + std::log(L);
      if (grad_rows) {  // A_i = sum_p w_p acc_p, into a row buffer (unsplit, acc aliases ga)
        for (int64_t d = 0; d < D; ++d) arow[d] = w[0] * pac[i * D + d];
        for (int64_t p = 1; p < nsplit; ++p)
          for (int64_t d = 0; d < D; ++d) arow[d] += w[p] * pac[(p * n + i) * D + d];
      }
      acc_t bern2, zz;
      finish_row(pz + i * D, pmn + i * D, pr + i * D, grad_rows ? arow.data() : nullptr, sc / L,
                 lam, grad_rows ? pga + i * D : nullptr, D, &bern2, &zz);
      ploss[i] = plse[i] - logN - acc_t(0.5) * bern2 + lam * zz;
    }
  });
  return {loss, lse, ga};
}

// ---------------------------------------------------------------------------------------------
// Keys' backward, docs/math.md [M:grad-keys] (P recomputed from the saved lse).  Column-parallel
// over key tiles (each key's gradient is written by one worker: deterministic, no atomics); with fewer
// key tiles than threads the queries are split too and the partial sums added in a fixed order.
// ---------------------------------------------------------------------------------------------

template <typename acc_t>
at::Tensor keys_backward(const Operands& op, const c10::optional<at::Tensor>& keys,
                         const acc_t* plse, const acc_t* pg, double s, int64_t self_offset) {
  const int64_t n = op.z.size(0), D = op.z.size(1);
  const int64_t N = op.keys.size(0);
  const auto opts = op.z.options();
  const acc_t sc = static_cast<acc_t>(s);

  const int64_t nthreads = at::get_num_threads();
  const int64_t ktiles = (N + kBK - 1) / kBK, qblocks = (n + kBQ - 1) / kBQ;
  const int64_t nsplit = std::max<int64_t>(1, std::min(qblocks, (nthreads + ktiles - 1) / ktiles));
  at::Tensor part = at::zeros({nsplit, N, D}, opts);

  at::parallel_for(0, ktiles * nsplit, 1, [&](int64_t wb, int64_t we) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const Workspace ws(op, D, std::min(kBQ, n), std::min(kBK, N));
    const at::Tensor &tile = ws.tile, &qbuf = ws.qbuf, &kbuf = ws.kbuf;
    acc_t* S = tile.data_ptr<acc_t>();
    const int64_t ld = ws.ld;
    for (int64_t w = wb; w < we; ++w) {
      const int64_t kt = w / nsplit, sp = w % nsplit;
      const int64_t j0 = kt * kBK, bk = std::min(kBK, N - j0);
      const auto qr = tile_range(qblocks, nsplit, sp);
      const at::Tensor kJ = op.key_tile(j0, bk, kbuf);
      at::Tensor dK = part[sp].narrow(0, j0, bk);
      for (int64_t qb = qr.first; qb < qr.second; ++qb) {
        const int64_t i0 = qb * kBQ, bq = std::min(kBQ, n - i0);
        at::Tensor St = tile.narrow(0, 0, bq).narrow(1, 0, bk);
        fill_queries<acc_t>(op, i0, bq, sc, qbuf.data_ptr<acc_t>());
        const at::Tensor qI = qbuf.narrow(0, 0, bq);
        at::mm_out(St, qI, kJ.t());
        for (int64_t i = 0; i < bq; ++i)  // P g, the row's own key's entry 0 ([M:self-key])
          exp_shift_but(S + i * ld, bk, plse[i0 + i], pg[i0 + i],
                        own_column(self_offset, i0 + i, j0, bk));
        dK.addmm_(St.t(), qI);
      }
    }
  });
  at::Tensor dK = part[0];
  for (int64_t p = 1; p < nsplit; ++p) dK.add_(part[p]);
  if (!keys.has_value()) {  // keys = tanh(a): chain rule through tanh, in place
    acc_t* pd = dK.data_ptr<acc_t>();
    const acc_t* pz = op.z.data_ptr<acc_t>();
    at::parallel_for(0, dK.numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) pd[k] *= acc_t(1) - pz[k] * pz[k];
    });
  }
  return dK;
}

// The whole backward: d/dr (elementwise, from nac_math.h), d/dkeys (the tile pass above) and
// d/da as in docs/math.md [M:grad-a] (the self keys' part accumulated in place).
template <typename acc_t>
std::vector<at::Tensor> nac_bwd_impl(const at::Tensor& a, const at::Tensor& r,
                                     const at::Tensor& noise, const c10::optional<at::Tensor>& keys,
                                     const at::Tensor& lse_in, const at::Tensor& ga,
                                     const at::Tensor& g_in, double s, bool need_a, bool need_r,
                                     bool need_keys, int64_t self_offset) {
  const int64_t n = a.size(0), D = a.size(1);
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  // z = tanh(a) lives in the d/dr output until d/dr is due (last), so the backward's memory is
  // its outputs plus one key tile per worker.
  at::Tensor grad_r = need_r ? at::empty({n, D}, a.options().dtype(acc))
                             : at::empty({0}, a.options().dtype(acc));
  const Operands op = make_operands<acc_t>(a, noise, keys, need_r ? grad_r : at::Tensor());
  const auto opts = op.z.options();
  const at::Tensor g = g_in.detach().to(op.z.scalar_type()).contiguous();
  const acc_t* pg = g.data_ptr<acc_t>();
  const acc_t* pm = op.m.data_ptr<acc_t>();
  at::Tensor grad_a = at::empty({0}, opts), grad_k = at::empty({0}, opts);
  const bool self_keys = !keys.has_value();
  at::Tensor dk;
  if ((need_a && self_keys) || (need_keys && !self_keys)) {
    const at::Tensor lse = lse_in.detach().to(op.z.scalar_type()).contiguous();
    dk = keys_backward<acc_t>(op, keys, lse.data_ptr<acc_t>(), pg, s, self_offset);
  }
  if (need_a) {
    TORCH_CHECK(ga.dim() == 2 && ga.size(0) == n && ga.size(1) == D,
                "nac_fast: ga must be the (n, D) row gradient returned by nac_fwd");
    const at::Tensor ga_ = ga.detach().to(op.z.scalar_type()).contiguous();
    const acc_t* pga = ga_.data_ptr<acc_t>();
    grad_a = self_keys ? dk : at::zeros({n, D}, opts);
    acc_t* po = grad_a.data_ptr<acc_t>();
    at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t d = 0; d < D; ++d) po[i * D + d] += pg[i] * pga[i * D + d];
    });
  }
  if (need_keys && !self_keys) grad_k = dk;
  if (need_r) {  // last: overwrites z
    const at::Tensor r_ = r.detach().to(op.z.scalar_type()).contiguous();
    const acc_t* pr = r_.data_ptr<acc_t>();
    acc_t* po = grad_r.data_ptr<acc_t>();
    at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        grad_r_row_inplace(po + i * D, pm + i * D, pr + i * D, pg[i], D);
    });
  }
  return {grad_a, grad_r, grad_k};
}

// ---------------------------------------------------------------------------------------------
// Op entry points.  Argument checking with user-facing messages lives in nac_fast/ops/loss.py;
// these TORCH_CHECKs guard direct torch.ops calls.
// ---------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_fwd_cpu(
    const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
    const c10::optional<at::Tensor>& keys, double s, double l2, bool grad_rows,
    int64_t self_offset) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal mm/add must not record graphs
  nac::check_fwd_args(a, r, noise, keys, self_offset);
  std::vector<at::Tensor> out = a.scalar_type() == at::kDouble
      ? nac_fwd_impl<double>(a, r, noise, keys, s, l2, grad_rows, self_offset)
      : nac_fwd_impl<float>(a, r, noise, keys, s, l2, grad_rows, self_offset);
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nac_bwd_cpu(
    const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
    const c10::optional<at::Tensor>& keys, const at::Tensor& lse, const at::Tensor& ga,
    const at::Tensor& g, double s, bool need_a, bool need_r, bool need_keys,
    int64_t self_offset) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  nac::check_bwd_args(a, r, noise, keys, lse, ga, g, need_a, self_offset);
  std::vector<at::Tensor> out = a.scalar_type() == at::kDouble
      ? nac_bwd_impl<double>(a, r, noise, keys, lse, ga, g, s, need_a, need_r, need_keys,
                             self_offset)
      : nac_bwd_impl<float>(a, r, noise, keys, lse, ga, g, s, need_a, need_r, need_keys,
                            self_offset);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nac_fast, m) {
  // The fwd/bwd contract of docs/math.md [M:passes].  fwd: (loss_rows (n,), lse (n,), ga (n, D)
  // [M:ga], empty (0,) unless grad_rows), in the accumulation dtype (float32; float64 for float64
  // inputs).  self_offset: -1, every key in each row's logsumexp (the paper's); o >= 0, row i's
  // own key (key o + i; keys=None: o = 0, key i = tanh(a_i)) left out and log(N - 1) for log N
  // ([M:self-key]); nac_bwd must be given the forward's.
  m.def("nac_fwd(Tensor a, Tensor r, Tensor noise, Tensor? keys, float s, float l2, bool grad_rows,"
        " int self_offset=-1) -> (Tensor, Tensor, Tensor)");
  // Gradients of sum_i g_i loss_i: (d/da, d/dr, d/dkeys), each empty (0,) unless asked for; with
  // keys=None, d/da includes the path through the self keys tanh(a).
  m.def("nac_bwd(Tensor a, Tensor r, Tensor noise, Tensor? keys, Tensor lse, Tensor ga, Tensor g, "
        "float s, bool need_a, bool need_r, bool need_keys, int self_offset=-1) -> (Tensor, Tensor, "
        "Tensor)");
}

TORCH_LIBRARY_IMPL(nac_fast, CPU, m) {
  m.impl("nac_fwd", &nac_fwd_cpu);
  m.impl("nac_bwd", &nac_bwd_cpu);
}
