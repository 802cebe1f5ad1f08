// Hamming engine of nac_fast (CPU): exact Hamming distances [M:hamming], top-k / full ranking with
// ties by gallery index [M:rank], and retrieval AP over the whole ranking [M:ap] by counting sort
// [M:ap-count], on packed binary codes (labels: docs/math.md).
//
// Codes arrive packed by nac_fast.ops.codes.pack_codes (PackedCodes, [M:hamming]): (n, W) int64,
// padding bits 0 (so they never add to a distance).
//
// Distances are computed tile by tile (AVX-512 VPOPCNTDQ when the CPU has it, chosen at run time;
// the build itself targets plain x86-64).  For AP, one pass per query in gallery-index order keeps
// a per-distance count and records (d, running count) for the relevant items only; the counts
// become prefix sums after the pass [M:ap-count].  AP is exact, in O(G) time per query and memory
// for the relevant items' records, with no sort and no float Q x G matrix.
//
// Timings per simd level and of the paper-size protocol: bench/results/cpu_micro.md ("Hamming
// engine") and bench/results/hamming_cpu.csv (python bench/bench_hamming.py).
//
// Ops (schemas below, CPU kernels only; a GPU kernel can register under the CUDA key later):
//   hamming_cdist(query, gallery, simd)                               -> int32 (Q, G)
//   hamming_topk(query, gallery, k, simd)                             -> (int32 (Q,k), int64 (Q,k))
//   hamming_average_precision(query, gallery, qlab, glab, simd)       -> (float64 (Q,), int64 (Q,))
//   hamming_retrieval(query, gallery, qlab, glab, cuts, hist, simd)   -> AP@all, R, and per cut N
//       (Q, C): the relevant items in the top N and the sum of their precisions [M:ap-at-k],
//       [M:precision-at-n]; with hist, the (Q, D + 1) per-distance counts of all and of relevant
//       items [M:radius], [M:pr-curve]
//   hamming_simd_level()                                              -> 2 | 1 | 0
//
// Blocking [M:rank]: top-k with k <= kSmallK and the retrieval pass take a block of queries at a
// time and walk the gallery tile by tile (a tile is transposed word-major into a thread-local
// buffer that stays in cache), so the gallery streams from memory once per query block instead
// of once per query.  Top-k keeps each query's k best (distance, index) pairs sorted and rejects
// a candidate with one vector compare against the current k-th distance; strict "<" keeps the
// earlier (smaller-index) item on a tie.
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
              " must be packed int64 words (nac_fast.pack_codes), got ",
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

// One query at a time (the full gallery's distances, then a counting sort): for k > kSmallK, e.g.
// the full ranking k = G.
std::tuple<at::Tensor, at::Tensor> topk_counting(const at::Tensor& query_in,
                                                 const at::Tensor& gallery_in, int64_t k,
                                                 int64_t simd) {
  const int64_t Q = query_in.size(0), G = gallery_in.size(0), W = query_in.size(1);
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
// AVX-512 version, per 64 items.  The histogram is kept as kSubMax (4) interleaved copies (cnt + s * nbp
// counts the items u with u % 4 == s), so that consecutive items of the same distance do not
// wait on each other's store (one histogram: ~10x the distance time at 128 bits).  A relevant
// item's position among the items of its distance is the sum of the copies at the chunk start plus
// the items of that distance before it in the chunk (two 32-lane compares and a popcount).  d must
// be readable for 64 items from every multiple of 64 below n (the tile buffer's length is a
// multiple of 64; lanes at or past n are masked out of the count).  finalize sums the copies.
__attribute__((target("avx512f,avx512bw,popcnt"))) int64_t accumulate_avx512(
    const uint16_t* d, const u64* m, int64_t n, uint32_t* cnt, int64_t nbp, uint16_t* rec_d,
    uint32_t* rec_p, int64_t nrel) {
  uint32_t* c1 = cnt + nbp;
  uint32_t* c2 = cnt + 2 * nbp;
  uint32_t* c3 = cnt + 3 * nbp;
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cn = std::min<int64_t>(64, n - c0);
    u64 bits = m[c0 >> 6];
    const uint16_t* dc = d + c0;
    if (bits) {
      const __m512i lo = _mm512_loadu_si512(dc), hi = _mm512_loadu_si512(dc + 32);
      while (bits) {
        const int k = __builtin_ctzll(bits);
        bits &= bits - 1;
        const uint16_t x = dc[k];
        const __m512i xv = _mm512_set1_epi16(static_cast<short>(x));
        const u64 eq = static_cast<u64>(_mm512_cmpeq_epi16_mask(lo, xv)) |
                       (static_cast<u64>(_mm512_cmpeq_epi16_mask(hi, xv)) << 32);
        rec_d[nrel] = x;
        rec_p[nrel] = cnt[x] + c1[x] + c2[x] + c3[x] +
                      static_cast<uint32_t>(__builtin_popcountll(eq & ((u64{1} << k) - 1)));
        ++nrel;
      }
    }
    int64_t u = 0;
    for (; u + 4 <= cn; u += 4) {
      ++cnt[dc[u]];
      ++c1[dc[u + 1]];
      ++c2[dc[u + 2]];
      ++c3[dc[u + 3]];
    }
    for (; u < cn; ++u) ++cnt[dc[u]];
  }
  return nrel;
}
#endif

// Histogram copies per query in the retrieval pass (see accumulate_avx512).
constexpr int64_t kSubMax = 4;

// ---------------------------------------------------------------------------------------------
// Blocking helpers: query blocks x gallery tiles
// ---------------------------------------------------------------------------------------------

// Items per gallery tile, a multiple of 64 (accumulate_avx512 reads 64 distances from every
// multiple of 64): about 64 KiB of codes, so the tile stays in L2 while a block of queries scans it.
int64_t tile_items(int64_t W) {
  const int64_t t = (int64_t{1} << 16) / (8 * W);
  return std::max<int64_t>(256, (t / 64) * 64);
}

// Gallery rows [j0, j0 + n) of the row-major (G, W) codes -> word-major tile out[w * T + j].
void transpose_tile(const u64* gp, int64_t W, int64_t j0, int64_t n, int64_t T, u64* out) {
  if (W == 1) {
    std::memcpy(out, gp + j0, static_cast<size_t>(n) * sizeof(u64));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const u64* row = gp + (j0 + j) * W;
    for (int64_t w = 0; w < W; ++w) out[w * T + j] = row[w];
  }
}

// ---------------------------------------------------------------------------------------------
// top-k for small k: query blocks x gallery tiles, a sorted list of k per query
// ---------------------------------------------------------------------------------------------

constexpr int64_t kSmallK = 128;   // above this the counting-sort path below is used
constexpr int64_t kTopkQueryBlock = 256;

struct TopList {  // the k best (distance, gallery index) of one query, sorted, ties by index
  uint16_t* d;
  int64_t* id;
  int64_t k, n;
  u64 thr;  // a candidate enters iff its distance < thr (all-ones until the list is full)
  inline void insert(u64 x, int64_t j) {
    int64_t p = n < k ? n : k - 1;  // the free slot, or the k-th (dropped) one
    while (p > 0 && d[p - 1] > x) {  // equal distances stay before: they have smaller indices
      d[p] = d[p - 1];
      id[p] = id[p - 1];
      --p;
    }
    d[p] = static_cast<uint16_t>(x);
    id[p] = j;
    if (n < k) ++n;
    if (n == k) thr = d[k - 1];
  }
};

using ScanFn = void (*)(const u64*, const u64*, int64_t, int64_t, int64_t, int64_t, TopList&);

template <int WC>
__attribute__((always_inline)) inline void scan_topk_body(const u64* q, const u64* tT, int64_t T,
                                                          int64_t Wrt, int64_t n, int64_t j0,
                                                          TopList& s) {
  const int64_t W = WC > 0 ? WC : Wrt;
  for (int64_t j = 0; j < n; ++j) {
    unsigned acc = 0;
    for (int64_t w = 0; w < W; ++w) acc += __builtin_popcountll(q[w] ^ tT[w * T + j]);
    if (acc < s.thr) s.insert(acc, j0 + j);
  }
}

void scan_topk_generic(const u64* q, const u64* tT, int64_t T, int64_t W, int64_t n, int64_t j0,
                       TopList& s) {
  if (W == 2) return scan_topk_body<2>(q, tT, T, W, n, j0, s);
  scan_topk_body<0>(q, tT, T, W, n, j0, s);
}

#if NAC_HAMMING_X86
__attribute__((target("popcnt"))) void scan_topk_popcnt(const u64* q, const u64* tT, int64_t T,
                                                        int64_t W, int64_t n, int64_t j0,
                                                        TopList& s) {
  if (W == 2) return scan_topk_body<2>(q, tT, T, W, n, j0, s);
  if (W == 1) return scan_topk_body<1>(q, tT, T, W, n, j0, s);
  scan_topk_body<0>(q, tT, T, W, n, j0, s);
}

// 32 items per iteration: four vectors of 8 distances, one unsigned compare each against the
// k-th distance so far, and one branch on the OR of the four masks (almost never taken once the
// list is full).  The rare candidates are inserted in lane order (= gallery order).
template <int WC>
__attribute__((target("avx512f,avx512vpopcntdq"), always_inline)) inline void scan_topk_avx512_body(
    const u64* q, const u64* tT, int64_t T, int64_t Wrt, int64_t n, int64_t j0, TopList& s) {
  const int64_t W = WC > 0 ? WC : Wrt;
  alignas(64) u64 lanes[32];
  __m512i thr = _mm512_set1_epi64(static_cast<long long>(s.thr));
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t w = 0; w < W; ++w) {
      const __m512i qw = _mm512_set1_epi64(static_cast<long long>(q[w]));
      const u64* p = tT + w * T + j;
      a0 = _mm512_add_epi64(a0, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p))));
      a1 = _mm512_add_epi64(a1, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 8))));
      a2 = _mm512_add_epi64(a2, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 16))));
      a3 = _mm512_add_epi64(a3, _mm512_popcnt_epi64(_mm512_xor_si512(qw, _mm512_loadu_si512(p + 24))));
    }
    const uint32_t m = static_cast<uint32_t>(_mm512_cmplt_epu64_mask(a0, thr)) |
                       (static_cast<uint32_t>(_mm512_cmplt_epu64_mask(a1, thr)) << 8) |
                       (static_cast<uint32_t>(_mm512_cmplt_epu64_mask(a2, thr)) << 16) |
                       (static_cast<uint32_t>(_mm512_cmplt_epu64_mask(a3, thr)) << 24);
    if (__builtin_expect(m == 0, 1)) continue;
    _mm512_store_si512(lanes, a0);
    _mm512_store_si512(lanes + 8, a1);
    _mm512_store_si512(lanes + 16, a2);
    _mm512_store_si512(lanes + 24, a3);
    for (uint32_t bits = m; bits; bits &= bits - 1) {
      const int l = __builtin_ctz(bits);
      if (lanes[l] < s.thr) s.insert(lanes[l], j0 + j + l);
    }
    thr = _mm512_set1_epi64(static_cast<long long>(s.thr));
  }
  for (; j < n; j += 8) {  // tail: masked loads, never past the tile's n items
    const int64_t c = std::min<int64_t>(8, n - j);
    const __mmask8 valid = static_cast<__mmask8>((1u << c) - 1u);
    __m512i a = _mm512_setzero_si512();
    for (int64_t w = 0; w < W; ++w) {
      const __m512i qw = _mm512_set1_epi64(static_cast<long long>(q[w]));
      a = _mm512_add_epi64(a, _mm512_popcnt_epi64(
                                  _mm512_xor_si512(qw, _mm512_maskz_loadu_epi64(valid, tT + w * T + j))));
    }
    const uint32_t m = _mm512_mask_cmplt_epu64_mask(valid, a, thr);
    if (!m) continue;
    _mm512_store_si512(lanes, a);
    for (uint32_t bits = m; bits; bits &= bits - 1) {
      const int l = __builtin_ctz(bits);
      if (lanes[l] < s.thr) s.insert(lanes[l], j0 + j + l);
    }
    thr = _mm512_set1_epi64(static_cast<long long>(s.thr));
  }
}

__attribute__((target("avx512f,avx512vpopcntdq"))) void scan_topk_avx512(
    const u64* q, const u64* tT, int64_t T, int64_t W, int64_t n, int64_t j0, TopList& s) {
  if (W == 2) return scan_topk_avx512_body<2>(q, tT, T, W, n, j0, s);
  if (W == 1) return scan_topk_avx512_body<1>(q, tT, T, W, n, j0, s);
  scan_topk_avx512_body<0>(q, tT, T, W, n, j0, s);
}
#endif

ScanFn pick_scan(int64_t simd) {
  const int level = pick_level(simd);
#if NAC_HAMMING_X86
  if (level == 2) return scan_topk_avx512;
  if (level == 1) return scan_topk_popcnt;
#endif
  return scan_topk_generic;
}

void topk_small(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W, int64_t k,
                ScanFn scan, int32_t* odp, int64_t* oip) {
  const int64_t T = tile_items(W);
  // Split the queries finely enough that every thread gets work, in whole query blocks when
  // there are enough of them.
  const int64_t threads = at::get_num_threads();
  const int64_t qb = std::max<int64_t>(1, std::min<int64_t>(kTopkQueryBlock, (Q + threads - 1) / threads));
  const int64_t nb = (Q + qb - 1) / qb;
  at::parallel_for(0, nb, 1, [&](int64_t b, int64_t e) {
    std::vector<u64> tile(static_cast<size_t>(W * T));
    std::vector<uint16_t> dl(static_cast<size_t>(qb * k));
    std::vector<TopList> lists(static_cast<size_t>(qb));
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t i0 = blk * qb, i1 = std::min(Q, i0 + qb);
      for (int64_t i = i0; i < i1; ++i)
        lists[i - i0] = TopList{dl.data() + (i - i0) * k, oip + i * k, k, 0, ~u64{0}};
      for (int64_t j0 = 0; j0 < G; j0 += T) {
        const int64_t n = std::min(T, G - j0);
        transpose_tile(gp, W, j0, n, T, tile.data());
        for (int64_t i = i0; i < i1; ++i) scan(qp + i * W, tile.data(), T, W, n, j0, lists[i - i0]);
      }
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t r = 0; r < k; ++r) odp[i * k + r] = dl[(i - i0) * k + r];
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Retrieval pass: AP@all plus, per cut N, hits and precision sums within the top N, and the
// per-distance histograms (query blocks x gallery tiles) [M:ap-count]
// ---------------------------------------------------------------------------------------------

// Growable record buffers without initialisation (the accumulate loops write one slot past the
// last record on every item, so the capacity stays >= nrel + tile items).
struct Records {
  uint16_t* d = nullptr;
  uint32_t* p = nullptr;
  int64_t cap = 0;
  void reserve(int64_t need) {
    if (need <= cap) return;
    const int64_t nc = std::max<int64_t>(need, 2 * cap);
    auto* nd = static_cast<uint16_t*>(std::realloc(d, static_cast<size_t>(nc) * sizeof(uint16_t)));
    if (nd) d = nd;
    auto* np = static_cast<uint32_t*>(std::realloc(p, static_cast<size_t>(nc) * sizeof(uint32_t)));
    if (np) p = np;
    TORCH_CHECK(nd && np, "hamming_retrieval: out of memory for ", nc, " relevance records");
    cap = nc;
  }
  Records() = default;
  Records(const Records&) = delete;
  Records& operator=(const Records&) = delete;
  ~Records() {
    std::free(d);
    std::free(p);
  }
};

struct RetrievalOut {
  double* ap;
  int64_t* nrel;
  const int64_t* cuts;  // C rank cut-offs N >= 1
  int64_t C;
  int64_t* hits;        // (Q, C) relevant items ranked <= N
  double* psum;         // (Q, C) sum of hits_r / rank_r over those items
  int64_t* hist;        // (Q, nb) or null
  int64_t* relhist;     // (Q, nb) or null
};

// Everything after a query's pass: cnt[x] items and the relevant items' records (distance,
// position among the items of that distance, in gallery order).
void finalize_query(int64_t i, int64_t G, int64_t nb, const uint32_t* cnt, const Records& rec,
                    int64_t nrel, const RetrievalOut& o, std::vector<uint32_t>& relcnt,
                    std::vector<uint64_t>& before, std::vector<uint64_t>& relbefore,
                    std::vector<double>& bucket_sum, std::vector<int64_t>& cut_x,
                    std::vector<int64_t>& cut_m, std::vector<uint8_t>& is_cut) {
  o.nrel[i] = nrel;
  std::fill(relcnt.begin(), relcnt.end(), 0u);
  for (int64_t r = 0; r < nrel; ++r) ++relcnt[rec.d[r]];
  uint64_t s = 0, rs = 0;
  for (int64_t x = 0; x < nb; ++x) {
    before[x] = s;
    relbefore[x] = rs;
    s += cnt[x];
    rs += relcnt[x];
  }
  if (o.hist) {
    for (int64_t x = 0; x < nb; ++x) {
      o.hist[i * nb + x] = cnt[x];
      o.relhist[i * nb + x] = relcnt[x];
    }
  }
  // A cut N ends in bucket x_N (the distance of the N-th ranked item) after its first m_N items.
  for (int64_t c = 0; c < o.C; ++c) {
    const int64_t N = std::min<int64_t>(o.cuts[c], G);
    int64_t x = 0;
    while (static_cast<int64_t>(before[x] + cnt[x]) < N) ++x;
    cut_x[c] = x;
    cut_m[c] = N - static_cast<int64_t>(before[x]);
    is_cut[x] = 1;
    o.hits[i * o.C + c] = static_cast<int64_t>(relbefore[x]);  // + the partial bucket, below
    o.psum[i * o.C + c] = 0.0;
  }
  if (nrel == 0) {
    o.ap[i] = std::numeric_limits<double>::quiet_NaN();
  } else {
    std::fill(relcnt.begin(), relcnt.end(), 0u);  // now: relevant items of distance x seen so far
    std::fill(bucket_sum.begin(), bucket_sum.end(), 0.0);
    double sum = 0.0;
    for (int64_t r = 0; r < nrel; ++r) {
      const uint16_t x = rec.d[r];
      const uint32_t seen = ++relcnt[x];
      const double v = static_cast<double>(relbefore[x] + seen) /
                       static_cast<double>(before[x] + rec.p[r] + 1);
      sum += v;
      bucket_sum[x] += v;
      if (is_cut[x]) {
        for (int64_t c = 0; c < o.C; ++c) {
          if (cut_x[c] == x && static_cast<int64_t>(rec.p[r]) < cut_m[c]) {
            ++o.hits[i * o.C + c];
            o.psum[i * o.C + c] += v;
          }
        }
      }
    }
    o.ap[i] = sum / static_cast<double>(nrel);
    for (int64_t c = 0; c < o.C; ++c) {
      double full = 0.0;  // whole buckets before the cut's bucket
      for (int64_t x = 0; x < cut_x[c]; ++x) full += bucket_sum[x];
      o.psum[i * o.C + c] += full;
    }
  }
  for (int64_t c = 0; c < o.C; ++c) is_cut[cut_x[c]] = 0;
}

template <class Rel>
void retrieval_loop(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W, DistFn dist,
                    bool avx512, const Rel& rel, const RetrievalOut& o) {
  const int64_t T = tile_items(W);
  const int64_t nb = W * 64 + 1;
  // Queries per block: each holds up to 6 bytes of records per relevant gallery item, so the
  // block shrinks as the gallery grows (<= 2^24 item slots, ~96 MiB per thread if all relevant).
  const int64_t threads = at::get_num_threads();
  int64_t qb = std::max<int64_t>(1, std::min<int64_t>(64, (int64_t{1} << 24) / std::max<int64_t>(G, 1)));
  qb = std::max<int64_t>(1, std::min(qb, (Q + threads - 1) / threads));
  const int64_t nblk = (Q + qb - 1) / qb;
  at::parallel_for(0, nblk, 1, [&](int64_t b, int64_t e) {
    std::vector<u64> tile(static_cast<size_t>(W * T));
    std::vector<uint16_t> dbuf(static_cast<size_t>(T));
    std::vector<u64> mbuf(static_cast<size_t>(T / 64));
    std::vector<uint8_t> rbuf(static_cast<size_t>(T));
    // per query: kSubMax interleaved histogram copies of nbp counters (accumulate_avx512); the
    // portable path uses the first copy only
    const int64_t nbp = (nb + 15) / 16 * 16, per_q = kSubMax * nbp;
    std::vector<uint32_t> cnt(static_cast<size_t>(qb * per_q));
    std::vector<uint32_t> total(static_cast<size_t>(nb));
    std::vector<Records> recs(static_cast<size_t>(qb));
    std::vector<int64_t> nrel(static_cast<size_t>(qb));
    std::vector<uint32_t> relcnt(nb);
    std::vector<uint64_t> before(nb), relbefore(nb);
    std::vector<double> bucket_sum(nb);
    std::vector<int64_t> cut_x(o.C), cut_m(o.C);
    std::vector<uint8_t> is_cut(nb, 0);
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t i0 = blk * qb, i1 = std::min(Q, i0 + qb);
      std::fill(cnt.begin(), cnt.end(), 0u);
      std::fill(nrel.begin(), nrel.end(), 0);
      for (int64_t j0 = 0; j0 < G; j0 += T) {
        const int64_t n = std::min(T, G - j0);
        transpose_tile(gp, W, j0, n, T, tile.data());
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t li = i - i0;
          uint32_t* c = cnt.data() + li * per_q;
          Records& rc = recs[li];
          rc.reserve(nrel[li] + n + 1);
          dist(qp + i * W, tile.data(), T, W, 0, n, dbuf.data());
#if NAC_HAMMING_X86
          if (avx512) {
            rel.mask_avx512(i, j0, n, mbuf.data());
            nrel[li] = accumulate_avx512(dbuf.data(), mbuf.data(), n, c, nbp, rc.d, rc.p,
                                         nrel[li]);
            continue;
          }
#endif
          rel.bytes(i, j0, n, rbuf.data());
          nrel[li] = accumulate_scalar(dbuf.data(), rbuf.data(), n, c, rc.d, rc.p, nrel[li]);
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        const uint32_t* c = cnt.data() + (i - i0) * per_q;
        for (int64_t x = 0; x < nb; ++x) {
          uint32_t t = 0;
          for (int64_t s = 0; s < kSubMax; ++s) t += c[s * nbp + x];
          total[x] = t;
        }
        finalize_query(i, G, nb, total.data(), recs[i - i0], nrel[i - i0], o, relcnt, before,
                       relbefore, bucket_sum, cut_x, cut_m, is_cut);
      }
    }
  });
}

void check_labels(const at::Tensor& q, const at::Tensor& g, int64_t Q, int64_t G, const char* op) {
  TORCH_CHECK(q.device().is_cpu() && g.device().is_cpu(), op, ": labels must be CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kLong && g.scalar_type() == at::kLong, op,
              ": labels must be int64 (class ids or packed multi-hot words)");
  TORCH_CHECK(q.dim() == g.dim() && (q.dim() == 1 || q.dim() == 2), op,
              ": labels must both be 1-D class ids or both 2-D packed words");
  TORCH_CHECK(q.size(0) == Q && g.size(0) == G, op, ": label rows must match code rows");
  if (q.dim() == 2)
    TORCH_CHECK(q.size(1) == g.size(1), op, ": query and gallery label words differ");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
hamming_retrieval_cpu(const at::Tensor& query_in, const at::Tensor& gallery_in,
                      const at::Tensor& qlab_in, const at::Tensor& glab_in, at::IntArrayRef cuts,
                      bool hist, int64_t simd) {
  check_pair(query_in, gallery_in);
  const int64_t Q = query_in.size(0), G = gallery_in.size(0), W = query_in.size(1);
  TORCH_CHECK(G >= 1, "hamming_retrieval: the gallery is empty");
  TORCH_CHECK(G < (int64_t{1} << 32), "hamming_retrieval: gallery too large (", G, ")");
  check_labels(qlab_in, glab_in, Q, G, "hamming_retrieval");
  for (const int64_t c : cuts) TORCH_CHECK(c >= 1, "hamming_retrieval: cuts must be >= 1, got ", c);
  const DistFn dist = pick_dist(simd);
  const bool avx512 = pick_level(simd) == 2;
  const int64_t C = static_cast<int64_t>(cuts.size()), nb = W * 64 + 1;
  const at::Tensor query = query_in.contiguous(), gallery = gallery_in.contiguous();
  auto opt = query.options();
  at::Tensor ap = at::empty({Q}, opt.dtype(at::kDouble));
  at::Tensor nrel = at::empty({Q}, opt.dtype(at::kLong));
  at::Tensor hits = at::zeros({Q, C}, opt.dtype(at::kLong));
  at::Tensor psum = at::zeros({Q, C}, opt.dtype(at::kDouble));
  at::Tensor h = at::zeros({hist ? Q : 0, nb}, opt.dtype(at::kLong));
  at::Tensor rh = at::zeros({hist ? Q : 0, nb}, opt.dtype(at::kLong));
  if (Q == 0) return {ap, nrel, hits, psum, h, rh};
  std::vector<int64_t> cv(cuts.begin(), cuts.end());
  RetrievalOut o{ap.data_ptr<double>(), nrel.data_ptr<int64_t>(), cv.data(), C,
                 hits.data_ptr<int64_t>(), psum.data_ptr<double>(),
                 hist ? h.data_ptr<int64_t>() : nullptr, hist ? rh.data_ptr<int64_t>() : nullptr};
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const u64* gp = reinterpret_cast<const u64*>(gallery.data_ptr<int64_t>());
  if (qlab_in.dim() == 1) {
    const at::Tensor ql = qlab_in.contiguous(), gl = glab_in.contiguous();
    SingleLabel rel{gl.data_ptr<int64_t>(), ql.data_ptr<int64_t>()};
    retrieval_loop(qp, gp, Q, G, W, dist, avx512, rel, o);
  } else {
    const at::Tensor ql = qlab_in.contiguous(), glT = word_major(glab_in);
    MultiLabel rel{reinterpret_cast<const u64*>(glT.data_ptr<int64_t>()),
                   reinterpret_cast<const u64*>(ql.data_ptr<int64_t>()), qlab_in.size(1), G};
    retrieval_loop(qp, gp, Q, G, W, dist, avx512, rel, o);
  }
  return {ap, nrel, hits, psum, h, rh};
}

std::tuple<at::Tensor, at::Tensor> hamming_topk_cpu(const at::Tensor& query_in,
                                                    const at::Tensor& gallery_in, int64_t k,
                                                    int64_t simd) {
  check_pair(query_in, gallery_in);
  const int64_t Q = query_in.size(0), G = gallery_in.size(0), W = query_in.size(1);
  TORCH_CHECK(k >= 0 && k <= G, "hamming_topk: k must be in [0, ", G, "], got ", k);
  if (k == 0 || k > kSmallK || Q == 0) return topk_counting(query_in, gallery_in, k, simd);
  const ScanFn scan = pick_scan(simd);
  const at::Tensor query = query_in.contiguous(), gallery = gallery_in.contiguous();
  at::Tensor od = at::empty({Q, k}, query.options().dtype(at::kInt));
  at::Tensor oi = at::empty({Q, k}, query.options().dtype(at::kLong));
  topk_small(reinterpret_cast<const u64*>(query.data_ptr<int64_t>()),
             reinterpret_cast<const u64*>(gallery.data_ptr<int64_t>()), Q, G, W, k, scan,
             od.data_ptr<int32_t>(), oi.data_ptr<int64_t>());
  return {od, oi};
}

std::tuple<at::Tensor, at::Tensor> hamming_average_precision_cpu(const at::Tensor& query_in,
                                                                 const at::Tensor& gallery_in,
                                                                 const at::Tensor& qlab_in,
                                                                 const at::Tensor& glab_in,
                                                                 int64_t simd) {
  check_pair(query_in, gallery_in);
  if (gallery_in.size(0) == 0) {  // kept from the one-query version: AP of nothing is NaN
    const int64_t Q = query_in.size(0);
    return {at::full({Q}, std::numeric_limits<double>::quiet_NaN(), query_in.options().dtype(at::kDouble)),
            at::zeros({Q}, query_in.options().dtype(at::kLong))};
  }
  auto r = hamming_retrieval_cpu(query_in, gallery_in, qlab_in, glab_in, {}, false, simd);
  return {std::get<0>(r), std::get<1>(r)};
}

int64_t hamming_simd_level_op() { return simd_level(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(nac_fast, m) {
  m.def("hamming_cdist(Tensor query, Tensor gallery, int simd=-1) -> Tensor");
  m.def("hamming_topk(Tensor query, Tensor gallery, int k, int simd=-1) -> (Tensor, Tensor)");
  m.def("hamming_average_precision(Tensor query, Tensor gallery, Tensor query_labels, "
        "Tensor gallery_labels, int simd=-1) -> (Tensor, Tensor)");
  m.def("hamming_retrieval(Tensor query, Tensor gallery, Tensor query_labels, Tensor gallery_labels, "
        "int[] cuts, bool histograms, int simd=-1) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("hamming_simd_level() -> int", &hamming_simd_level_op);
}

TORCH_LIBRARY_IMPL(nac_fast, CPU, m) {
  m.impl("hamming_cdist", &hamming_cdist_cpu);
  m.impl("hamming_topk", &hamming_topk_cpu);
  m.impl("hamming_average_precision", &hamming_average_precision_cpu);
  m.impl("hamming_retrieval", &hamming_retrieval_cpu);
}
