// Hamming engine of nac_fast (CPU): exact Hamming distances [M:hamming], top-k / full ranking with
// ties by gallery index [M:rank], and retrieval AP over the whole ranking [M:ap] by counting sort
// [M:ap-count], on packed binary codes (labels: docs/math.md).
//
// Codes arrive packed by nac_fast.ops.hamming.pack_codes (PackedCodes, [M:hamming]): (n, W) int64,
// padding bits 0 (so they never add to a distance).
//
// For one query the G distances are computed block by block (AVX-512 VPOPCNTDQ when the CPU has
// it, chosen at run time; the build itself targets plain x86-64), and one pass in gallery-index
// order keeps a per-distance count and records (d, running count) for the relevant items only;
// the counts become prefix sums after the pass [M:ap-count].  AP is exact, in O(G) time and O(G)
// memory per thread, with no sort and no float Q x G matrix.
//
// Timings per simd level and of the paper-size protocol: bench/results/cpu_micro.md ("Hamming
// engine") and bench/results/hamming_cpu.csv (python bench/bench_hamming.py).
//
// Ops (schemas below, CPU kernels only; a GPU kernel can register under the CUDA key later):
//   hamming_cdist(query, gallery, simd)                               -> int32 (Q, G)
//   hamming_topk(query, gallery, k, simd)                             -> (int32 (Q,k), int64 (Q,k))
//   hamming_average_precision(query, gallery, qlab, glab, simd)       -> (float64 (Q,), int64 (Q,))
//   hamming_simd_level()                                              -> 2 | 1 | 0
// simd: -1 = best available, 2 = AVX-512 (F, BW, VPOPCNTDQ), 1 = scalar POPCNT, 0 = portable C++.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define NAC_HAMMING_X86 1
#else
#define NAC_HAMMING_X86 0
#endif

namespace {

using u64 = uint64_t;

// Gallery items per block: the distance block (uint16) and relevance bits of 2048 items take
// 4.25 KiB, well inside L1 next to the histogram (129 x 4 bytes for 128 bits).
constexpr int64_t kBlock = 2048;

// ---------------------------------------------------------------------------------------------
// Distance of one query to gallery items [j0, j0 + n), gallery stored word-major (gT[w * G + j]).
// ---------------------------------------------------------------------------------------------

template <int WC>
__attribute__((always_inline)) inline void dist_block_body(const u64* q, const u64* gT, int64_t G,
                                                           int64_t Wrt, int64_t j0, int64_t n,
                                                           uint16_t* out) {
  const int64_t W = WC > 0 ? WC : Wrt;
  for (int64_t j = 0; j < n; ++j) {
    unsigned acc = 0;
    for (int64_t w = 0; w < W; ++w) acc += __builtin_popcountll(q[w] ^ gT[w * G + j0 + j]);
    out[j] = static_cast<uint16_t>(acc);
  }
}

using DistFn = void (*)(const u64*, const u64*, int64_t, int64_t, int64_t, int64_t, uint16_t*);

// Portable: without -mpopcnt, __builtin_popcountll is a libgcc bit-trick routine.
void dist_block_generic(const u64* q, const u64* gT, int64_t G, int64_t W, int64_t j0, int64_t n,
                        uint16_t* out) {
  if (W == 2) return dist_block_body<2>(q, gT, G, W, j0, n, out);
  dist_block_body<0>(q, gT, G, W, j0, n, out);
}

#if NAC_HAMMING_X86
// Scalar POPCNT instruction (every x86-64 CPU since 2008 has it, but the baseline ABI does not).
__attribute__((target("popcnt"))) void dist_block_popcnt(const u64* q, const u64* gT, int64_t G,
                                                         int64_t W, int64_t j0, int64_t n,
                                                         uint16_t* out) {
  if (W == 2) return dist_block_body<2>(q, gT, G, W, j0, n, out);
  if (W == 1) return dist_block_body<1>(q, gT, G, W, j0, n, out);
  dist_block_body<0>(q, gT, G, W, j0, n, out);
}

// AVX-512: 8 gallery items per vector, 4 vectors per iteration for instruction-level parallelism;
// the 64-bit counts are narrowed to uint16 with VPMOVQW on the way out.
template <int WC>
__attribute__((target("avx512f,avx512vpopcntdq"), always_inline)) inline void dist_block_avx512_body(
    const u64* q, const u64* gT, int64_t G, int64_t Wrt, int64_t j0, int64_t n, uint16_t* out) {
  const int64_t W = WC > 0 ? WC : Wrt;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t w = 0; w < W; ++w) {
      const __m512i qw = _mm512_set1_epi64(static_cast<long long>(q[w]));
      const u64* p = gT + w * G + j0 + j;
      a0 = _mm512_add_epi64(a0, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p))));
      a1 = _mm512_add_epi64(a1, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 8))));
      a2 = _mm512_add_epi64(a2, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 16))));
      a3 = _mm512_add_epi64(a3, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 24))));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi64_epi16(a0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 8), _mm512_cvtepi64_epi16(a1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 16), _mm512_cvtepi64_epi16(a2));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 24), _mm512_cvtepi64_epi16(a3));
  }
  for (; j < n; j += 8) {  // tail: masked loads and stores, never touching memory past the end
    const int64_t m = std::min<int64_t>(8, n - j);
    const __mmask8 mask = static_cast<__mmask8>((1u << m) - 1u);
    __m512i a = _mm512_setzero_si512();
    for (int64_t w = 0; w < W; ++w) {
      const __m512i qw = _mm512_set1_epi64(static_cast<long long>(q[w]));
      const __m512i g = _mm512_maskz_loadu_epi64(mask, gT + w * G + j0 + j);
      a = _mm512_add_epi64(a, _mm512_popcnt_epi64(_mm512_xor_si512(qw, g)));
    }
    _mm512_mask_cvtepi64_storeu_epi16(out + j, mask, a);
  }
}

__attribute__((target("avx512f,avx512vpopcntdq"))) void dist_block_avx512(
    const u64* q, const u64* gT, int64_t G, int64_t W, int64_t j0, int64_t n, uint16_t* out) {
  if (W == 2) return dist_block_avx512_body<2>(q, gT, G, W, j0, n, out);
  if (W == 1) return dist_block_avx512_body<1>(q, gT, G, W, j0, n, out);
  dist_block_avx512_body<0>(q, gT, G, W, j0, n, out);
}
#endif

int detected_level() {
#if NAC_HAMMING_X86
  __builtin_cpu_init();
  // libgcc also checks that the OS saves the zmm state (XCR0) before reporting AVX-512 features.
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vpopcntdq"))
    return 2;
  if (__builtin_cpu_supports("popcnt")) return 1;
#endif
  return 0;
}

int simd_level() {
  static const int level = detected_level();
  return level;
}

int pick_level(int64_t simd) {
  const int best = simd_level();
  TORCH_CHECK(simd >= -1 && simd <= 2, "hamming: simd must be -1 (auto), 0, 1 or 2, got ", simd);
  TORCH_CHECK(simd <= best, "hamming: simd level ", simd, " requested but this CPU supports only ",
              best, " (2 = AVX-512 VPOPCNTDQ, 1 = POPCNT, 0 = portable)");
  return simd < 0 ? best : static_cast<int>(simd);
}

DistFn pick_dist(int64_t simd) {
  const int level = pick_level(simd);
#if NAC_HAMMING_X86
  if (level == 2) return dist_block_avx512;
  if (level == 1) return dist_block_popcnt;
#endif
  return dist_block_generic;
}

// ---------------------------------------------------------------------------------------------
// Argument checks (the Python layer gives friendlier messages; these keep the op safe on its own)
// ---------------------------------------------------------------------------------------------

void check_codes(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "hamming: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kLong, "hamming: ", name,
              " must be packed int64 words (nac_fast.ops.hamming.pack_codes), got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2, "hamming: ", name, " must be 2-D (n, words), got ", t.dim(), "-D");
  TORCH_CHECK(t.size(1) >= 1, "hamming: ", name, " must have at least one word per code");
  // Distances are stored as uint16: at most 65535 bits, i.e. 1023 words.
  TORCH_CHECK(t.size(1) <= 1023, "hamming: at most 1023 words (65472 bits) per code, ", name,
              " has ", t.size(1));
}

void check_pair(const at::Tensor& q, const at::Tensor& g) {
  check_codes(q, "query");
  check_codes(g, "gallery");
  TORCH_CHECK(q.size(1) == g.size(1), "hamming: query has ", q.size(1), " words per code but gallery has ",
              g.size(1));
}

// Word-major copy of the gallery (W, G) so that one vector load reads 8 items' word w.
at::Tensor word_major(const at::Tensor& g) { return g.t().contiguous(); }

int64_t grain_for(int64_t G) {
  // Enough queries per task that a task costs >~ 1e5 pair evaluations, so at::parallel_for's
  // per-task overhead is negligible next to the work.
  return std::max<int64_t>(1, 100000 / std::max<int64_t>(G, 1));
}

// ---------------------------------------------------------------------------------------------
// cdist
// ---------------------------------------------------------------------------------------------

at::Tensor hamming_cdist_cpu(const at::Tensor& query_in, const at::Tensor& gallery_in, int64_t simd) {
  check_pair(query_in, gallery_in);
  const DistFn dist = pick_dist(simd);
  const at::Tensor query = query_in.contiguous();
  const at::Tensor gT = word_major(gallery_in);
  const int64_t Q = query.size(0), G = gallery_in.size(0), W = query.size(1);
  at::Tensor out = at::empty({Q, G}, query.options().dtype(at::kInt));
  if (Q == 0 || G == 0) return out;
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const u64* gp = reinterpret_cast<const u64*>(gT.data_ptr<int64_t>());
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, Q, grain_for(G), [&](int64_t b, int64_t e) {
    std::vector<uint16_t> buf(kBlock);
    for (int64_t i = b; i < e; ++i) {
      for (int64_t j0 = 0; j0 < G; j0 += kBlock) {
        const int64_t n = std::min(kBlock, G - j0);
        dist(qp + i * W, gp, G, W, j0, n, buf.data());
        int32_t* row = op + i * G + j0;
        for (int64_t j = 0; j < n; ++j) row[j] = buf[j];
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// top-k (k = G gives the full ranking): counting sort on distance, stable in gallery index
// ---------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> hamming_topk_cpu(const at::Tensor& query_in,
                                                    const at::Tensor& gallery_in, int64_t k,
                                                    int64_t simd) {
  check_pair(query_in, gallery_in);
  const int64_t Q = query_in.size(0), G = gallery_in.size(0), W = query_in.size(1);
  TORCH_CHECK(k >= 0 && k <= G, "hamming_topk: k must be in [0, ", G, "], got ", k);
  const DistFn dist = pick_dist(simd);
  const at::Tensor query = query_in.contiguous();
  const at::Tensor gT = word_major(gallery_in);
  at::Tensor od = at::empty({Q, k}, query.options().dtype(at::kInt));
  at::Tensor oi = at::empty({Q, k}, query.options().dtype(at::kLong));
  if (Q == 0 || k == 0) return {od, oi};
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const u64* gp = reinterpret_cast<const u64*>(gT.data_ptr<int64_t>());
  int32_t* odp = od.data_ptr<int32_t>();
  int64_t* oip = oi.data_ptr<int64_t>();
  const int64_t nb = W * 64 + 1;
  at::parallel_for(0, Q, grain_for(G), [&](int64_t b, int64_t e) {
    std::vector<uint16_t> d(G);
    std::vector<int64_t> cnt(nb);
    for (int64_t i = b; i < e; ++i) {
      for (int64_t j0 = 0; j0 < G; j0 += kBlock)
        dist(qp + i * W, gp, G, W, j0, std::min(kBlock, G - j0), d.data() + j0);
      std::fill(cnt.begin(), cnt.end(), 0);
      for (int64_t j = 0; j < G; ++j) ++cnt[d[j]];
      // Threshold t: the distance at which the k-th item lies; items at d < t all go in, items at
      // d == t go in by increasing gallery index until k are placed.
      int64_t t = 0, acc = 0;
      for (; t < nb; ++t) {
        if (acc + cnt[t] >= k) break;
        acc += cnt[t];
      }
      for (int64_t x = 0, s = 0; x <= t; ++x) {  // exclusive prefix sums = first slot per distance
        const int64_t c = cnt[x];
        cnt[x] = s;
        s += c;
      }
      int32_t* rd = odp + i * k;
      int64_t* ri = oip + i * k;
      for (int64_t j = 0; j < G; ++j) {
        const int64_t x = d[j];
        if (x > t) continue;
        const int64_t slot = cnt[x];
        if (slot >= k) continue;  // only possible at x == t, once the k slots are full
        cnt[x] = slot + 1;
        rd[slot] = static_cast<int32_t>(x);
        ri[slot] = j;
      }
    }
  });
  return {od, oi};
}

// ---------------------------------------------------------------------------------------------
// Average precision over the whole ranking
// ---------------------------------------------------------------------------------------------

// Relevance of gallery items [j0, j0+n) to one query [M:relevance]: portable, as 0/1 bytes (the
// scalar path was slower with relevance bits: bench/results/cpu_micro.md); AVX-512, as a bit mask
// (bit j % 64 of word j / 64, bits past n are 0), 8 items per compare.
struct SingleLabel {  // class ids: relevant = same class
  const int64_t* gl;
  const int64_t* ql;
  void bytes(int64_t i, int64_t j0, int64_t n, uint8_t* out) const {
    const int64_t c = ql[i];
    const int64_t* g = gl + j0;
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint8_t>(g[j] == c);
  }
#if NAC_HAMMING_X86
  __attribute__((target("avx512f"))) void mask_avx512(int64_t i, int64_t j0, int64_t n,
                                                      u64* out) const {
    const __m512i c = _mm512_set1_epi64(ql[i]);
    const int64_t* g = gl + j0;
    for (int64_t w = 0; w * 64 < n; ++w) {
      u64 bits = 0;
      for (int64_t s = 0; s < 8; ++s) {
        const int64_t j = w * 64 + s * 8;
        if (j >= n) break;
        const __mmask8 valid = static_cast<__mmask8>(n - j >= 8 ? 0xFF : (1u << (n - j)) - 1u);
        const __m512i v = _mm512_maskz_loadu_epi64(valid, g + j);
        bits |= static_cast<u64>(_mm512_mask_cmpeq_epi64_mask(valid, v, c)) << (s * 8);
      }
      out[w] = bits;
    }
  }
#endif
};

struct MultiLabel {  // packed multi-hot words: relevant = shares at least one label
  const u64* glT;    // word-major (L, G)
  const u64* ql;     // (Q, L)
  int64_t L, G;
  void bytes(int64_t i, int64_t j0, int64_t n, uint8_t* out) const {
    const u64* q = ql + i * L;
    std::memset(out, 0, static_cast<size_t>(n));
    for (int64_t l = 0; l < L; ++l) {
      const u64 qw = q[l];
      if (qw == 0) continue;
      const u64* g = glT + l * G + j0;
      for (int64_t j = 0; j < n; ++j) out[j] |= static_cast<uint8_t>((g[j] & qw) != 0);
    }
  }
#if NAC_HAMMING_X86
  __attribute__((target("avx512f"))) void mask_avx512(int64_t i, int64_t j0, int64_t n,
                                                      u64* out) const {
    const u64* q = ql + i * L;
    for (int64_t w = 0; w * 64 < n; ++w) {
      u64 bits = 0;
      for (int64_t s = 0; s < 8; ++s) {
        const int64_t j = w * 64 + s * 8;
        if (j >= n) break;
        const __mmask8 valid = static_cast<__mmask8>(n - j >= 8 ? 0xFF : (1u << (n - j)) - 1u);
        __mmask8 hit = 0;
        for (int64_t l = 0; l < L; ++l) {
          const __m512i qw = _mm512_set1_epi64(static_cast<long long>(q[l]));
          const __m512i v = _mm512_maskz_loadu_epi64(valid, glT + l * G + j0 + j);
          hit |= _mm512_mask_test_epi64_mask(valid, v, qw);
        }
        bits |= static_cast<u64>(hit) << (s * 8);
      }
      out[w] = bits;
    }
  }
#endif
};

// One pass over a block of n items (distances d, relevance bits m) in gallery order: count items
// per distance in cnt, and for each relevant item append (distance, #items of that distance seen
// before it) to rec_d / rec_p.  Returns the new number of records.
//
// Portable version.  Branch-free: the record is always written and kept only when the item is
// relevant (a branch mispredicts on ~10%-relevant CIFAR-10-like data; bench/results/cpu_micro.md).
int64_t accumulate_scalar(const uint16_t* d, const uint8_t* r, int64_t n, uint32_t* cnt,
                          uint16_t* rec_d, uint32_t* rec_p, int64_t nrel) {
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t x = d[j];
    const uint32_t p = cnt[x];
    cnt[x] = p + 1;
    rec_d[nrel] = x;
    rec_p[nrel] = p;
    nrel += r[j];
  }
  return nrel;
}

#if NAC_HAMMING_X86
// AVX-512 version, per 64 items: when few are relevant (<= 16), update the histogram with a
// tight loop and find each relevant item's position as cnt[x] at the chunk start plus the items
// of distance x before it in the chunk (two 32-lane compares and a popcount); otherwise fall back
// to the branch-free loop (timings: bench/results/cpu_micro.md).  d must be readable for 64 items
// from every multiple of 64 below n (the block
// buffer is kBlock long, a multiple of 64; lanes at or past n are masked out of the count).
__attribute__((target("avx512f,avx512bw,popcnt"))) int64_t accumulate_avx512(
    const uint16_t* d, const u64* m, int64_t n, uint32_t* cnt, uint16_t* rec_d, uint32_t* rec_p,
    int64_t nrel) {
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cn = std::min<int64_t>(64, n - c0);
    u64 bits = m[c0 >> 6];
    const uint16_t* dc = d + c0;
    if (__builtin_popcountll(bits) > 16) {  // branch-free, as accumulate_scalar
      for (int64_t u = 0; u < cn; ++u) {
        const uint16_t x = dc[u];
        const uint32_t p = cnt[x];
        cnt[x] = p + 1;
        rec_d[nrel] = x;
        rec_p[nrel] = p;
        nrel += static_cast<int64_t>((bits >> u) & 1u);
      }
      continue;
    }
    const __m512i lo = _mm512_loadu_si512(dc), hi = _mm512_loadu_si512(dc + 32);
    while (bits) {
      const int k = __builtin_ctzll(bits);
      bits &= bits - 1;
      const uint16_t x = dc[k];
      const __m512i xv = _mm512_set1_epi16(static_cast<short>(x));
      const u64 eq = static_cast<u64>(_mm512_cmpeq_epi16_mask(lo, xv)) |
                     (static_cast<u64>(_mm512_cmpeq_epi16_mask(hi, xv)) << 32);
      rec_d[nrel] = x;
      rec_p[nrel] = cnt[x] + static_cast<uint32_t>(__builtin_popcountll(eq & ((u64{1} << k) - 1)));
      ++nrel;
    }
    for (int64_t u = 0; u < cn; ++u) ++cnt[dc[u]];
  }
  return nrel;
}
#endif

template <class Rel>
void ap_loop(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W, DistFn dist,
             bool avx512, const Rel& rel, double* ap, int64_t* nrel_out) {
  static_assert(kBlock % 64 == 0, "accumulate_avx512 reads 64 distances from multiples of 64");
  const int64_t nb = W * 64 + 1;
  at::parallel_for(0, Q, grain_for(G), [&](int64_t b, int64_t e) {
    std::vector<uint16_t> dbuf(kBlock);
    std::vector<u64> mbuf(kBlock / 64);
    std::vector<uint8_t> rbuf(kBlock);
    std::vector<uint32_t> cnt(nb), relcnt(nb);
    std::vector<uint64_t> before(nb), relbefore(nb);
    // Relevant items in gallery order: their distance and their position among the items of that
    // distance (G <= 2^32 - 1 is checked by the caller).
    std::vector<uint16_t> rec_d(G);
    std::vector<uint32_t> rec_p(G);
    for (int64_t i = b; i < e; ++i) {
      std::fill(cnt.begin(), cnt.end(), 0u);
      int64_t nrel = 0;
      for (int64_t j0 = 0; j0 < G; j0 += kBlock) {
        const int64_t n = std::min(kBlock, G - j0);
        dist(qp + i * W, gp, G, W, j0, n, dbuf.data());
#if NAC_HAMMING_X86
        if (avx512) {
          rel.mask_avx512(i, j0, n, mbuf.data());
          nrel = accumulate_avx512(dbuf.data(), mbuf.data(), n, cnt.data(), rec_d.data(),
                                   rec_p.data(), nrel);
          continue;
        }
#endif
        rel.bytes(i, j0, n, rbuf.data());
        nrel = accumulate_scalar(dbuf.data(), rbuf.data(), n, cnt.data(), rec_d.data(),
                                 rec_p.data(), nrel);
      }
      nrel_out[i] = nrel;
      if (nrel == 0) {
        ap[i] = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      std::fill(relcnt.begin(), relcnt.end(), 0u);
      for (int64_t r = 0; r < nrel; ++r) ++relcnt[rec_d[r]];
      uint64_t s = 0, rs = 0;
      for (int64_t x = 0; x < nb; ++x) {
        before[x] = s;
        relbefore[x] = rs;
        s += cnt[x];
        rs += relcnt[x];
        relcnt[x] = 0;  // reused below as "relevant items of distance x seen so far"
      }
      // rank and hits of docs/math.md [M:ap-count]: before[x] and relbefore[x] are the sums over
      // distances e < x, rec_p[r] + 1 and seen count within bucket x; records are in gallery
      // order, the same order as within the bucket.
      double sum = 0.0;
      for (int64_t r = 0; r < nrel; ++r) {
        const uint16_t x = rec_d[r];
        const uint32_t seen = ++relcnt[x];
        sum += static_cast<double>(relbefore[x] + seen) / static_cast<double>(before[x] + rec_p[r] + 1);
      }
      ap[i] = sum / static_cast<double>(nrel);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> hamming_average_precision_cpu(const at::Tensor& query_in,
                                                                 const at::Tensor& gallery_in,
                                                                 const at::Tensor& qlab_in,
                                                                 const at::Tensor& glab_in,
                                                                 int64_t simd) {
  check_pair(query_in, gallery_in);
  const int64_t Q = query_in.size(0), G = gallery_in.size(0), W = query_in.size(1);
  TORCH_CHECK(G < (int64_t{1} << 32), "hamming_average_precision: gallery too large (", G, ")");
  TORCH_CHECK(qlab_in.device().is_cpu() && glab_in.device().is_cpu(),
              "hamming_average_precision: labels must be CPU tensors");
  TORCH_CHECK(qlab_in.scalar_type() == at::kLong && glab_in.scalar_type() == at::kLong,
              "hamming_average_precision: labels must be int64 (class ids or packed multi-hot words)");
  TORCH_CHECK(qlab_in.dim() == glab_in.dim() && (qlab_in.dim() == 1 || qlab_in.dim() == 2),
              "hamming_average_precision: labels must both be 1-D class ids or both 2-D packed words");
  TORCH_CHECK(qlab_in.size(0) == Q && glab_in.size(0) == G,
              "hamming_average_precision: label rows must match code rows");
  if (qlab_in.dim() == 2)
    TORCH_CHECK(qlab_in.size(1) == glab_in.size(1),
                "hamming_average_precision: query and gallery label words differ");
  const DistFn dist = pick_dist(simd);
  const bool avx512 = pick_level(simd) == 2;
  const at::Tensor query = query_in.contiguous();
  const at::Tensor gT = word_major(gallery_in);
  at::Tensor ap = at::empty({Q}, query.options().dtype(at::kDouble));
  at::Tensor nrel = at::empty({Q}, query.options().dtype(at::kLong));
  if (Q == 0) return {ap, nrel};
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const u64* gp = reinterpret_cast<const u64*>(gT.data_ptr<int64_t>());
  if (qlab_in.dim() == 1) {
    const at::Tensor ql = qlab_in.contiguous(), gl = glab_in.contiguous();
    SingleLabel rel{gl.data_ptr<int64_t>(), ql.data_ptr<int64_t>()};
    ap_loop(qp, gp, Q, G, W, dist, avx512, rel, ap.data_ptr<double>(), nrel.data_ptr<int64_t>());
  } else {
    const at::Tensor ql = qlab_in.contiguous(), glT = word_major(glab_in);
    MultiLabel rel{reinterpret_cast<const u64*>(glT.data_ptr<int64_t>()),
                   reinterpret_cast<const u64*>(ql.data_ptr<int64_t>()), qlab_in.size(1), G};
    ap_loop(qp, gp, Q, G, W, dist, avx512, rel, ap.data_ptr<double>(), nrel.data_ptr<int64_t>());
  }
  return {ap, nrel};
}

int64_t hamming_simd_level_op() { return simd_level(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(nac_fast, m) {
  m.def("hamming_cdist(Tensor query, Tensor gallery, int simd=-1) -> Tensor");
  m.def("hamming_topk(Tensor query, Tensor gallery, int k, int simd=-1) -> (Tensor, Tensor)");
  m.def("hamming_average_precision(Tensor query, Tensor gallery, Tensor query_labels, "
        "Tensor gallery_labels, int simd=-1) -> (Tensor, Tensor)");
  m.def("hamming_simd_level() -> int", &hamming_simd_level_op);
}

TORCH_LIBRARY_IMPL(nac_fast, CPU, m) {
  m.impl("hamming_cdist", &hamming_cdist_cpu);
  m.impl("hamming_topk", &hamming_topk_cpu);
  m.impl("hamming_average_precision", &hamming_average_precision_cpu);
}
