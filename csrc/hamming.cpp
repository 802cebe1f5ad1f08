// Hamming engine of nac_fast (CPU): exact Hamming distances [M:hamming], top-k / full ranking with
// ties by gallery index [M:rank], and retrieval AP over the whole ranking [M:ap] by counting sort
// [M:ap-count], on packed binary codes (labels: docs/math.md).
//
// Codes arrive packed by nac_fast.ops.codes.pack_codes (PackedCodes, [M:hamming]): (n, W) int64,
// padding bits 0 (so they never add to a distance).
//
// Distances are computed tile by tile by one of five instruction-set levels, the best the CPU has
// chosen at run time (the build itself targets plain x86-64), or a lower one on request:
//   4 avx512vpopcnt  AVX-512 F/BW + VPOPCNTDQ (Ice Lake and later, Zen 4 and later): word-major
//                    tiles, 8 items per vector, VPOPCNTQ;
//   3 avx512bw       AVX-512 F/BW without VPOPCNTDQ (Skylake-X, Cascade Lake): nibble planes,
//                    64 items per VPSHUFB (below);
//   2 avx2           AVX2 (Haswell and later, Zen 1-3): nibble planes, 32 items per VPSHUFB;
//   1 scalar         the POPCNT instruction, one word at a time, word-major tiles;
//   0 portable       plain C++ (what non-x86 machines run: __builtin_popcountll, which GCC and
//                    Clang compile to NEON CNT on AArch64).  -DNAC_HAMMING_PORTABLE_ONLY builds
//                    this level alone, without an x86 intrinsic (the compile check of the
//                    non-x86 path on an x86 machine).
// Nibble planes (levels 2 and 3): a gallery tile is stored byte-sliced, one plane per code
// nibble: plane 2b holds the low nibble of byte b of every item of the tile, plane 2b+1 its high
// nibble, one byte per item.  A query becomes one 16-entry table per plane, tab[p][v] =
// popcount(query nibble p ^ v), so a distance is the sum over planes of VPSHUFB(tab[p], plane p):
// one shuffle and one byte add per 32 (or 64) items and nibble, no XOR, no shift, no horizontal
// sum; the byte sums are widened to 16 bits every kPlaneChunk planes (codes wider than 192 bits).
// Every level returns the same integers (tests/test_hashing.py forces each one).
// For AP, one pass per query in gallery-index order keeps
// a per-distance count and records (d, running count) for the relevant items only (4 bytes each
// when they fit: put_record), and the x86 levels count the relevant items per distance in the
// same pass; the counts become prefix sums after the pass [M:ap-count].  AP is exact, in O(G) time
// per query and memory for the relevant items' records, with no sort and no float Q x G matrix.
//
// Timings per simd level and of the paper-size protocol: bench/results/cpu_micro.md ("Hamming
// engine"), bench/results/hamming_cpu.csv (python bench/bench_hamming.py) and
// bench/results/index_cpu.csv (python bench/bench_index.py, its --isa flag forces a level).
//
// Ops (schemas below, CPU kernels only; a GPU kernel can register under the CUDA key later):
//   hamming_cdist(query, gallery, simd)                               -> int32 (Q, G)
//   hamming_topk(query, gallery, k, simd)                             -> (int32 (Q,k), int64 (Q,k))
//   hamming_average_precision(query, gallery, qlab, glab, simd)       -> (float64 (Q,), int64 (Q,))
//   hamming_retrieval(query, gallery, qlab, glab, cuts, hist, simd)   -> AP@all, R, and per cut N
//       (Q, C): the relevant items in the top N and the sum of their precisions [M:ap-at-k],
//       [M:precision-at-n]; with hist, the (Q, D + 1) per-distance counts of all and of relevant
//       items [M:radius], [M:pr-curve]
//   hamming_simd_level()                                              -> 4 | 3 | 2 | 1 | 0
//
// Blocking [M:rank]: top-k with k <= kSmallK and the retrieval pass take a block of queries at a
// time and walk the gallery tile by tile (a tile is transposed word-major, or split into nibble
// planes, into a thread-local buffer that stays in cache), so the gallery streams from memory once
// per query block instead of once per query.  Top-k keeps each query's k best (distance, index)
// pairs sorted and rejects a candidate with one vector compare against the current k-th
// distance; strict "<" keeps the earlier (smaller-index) item on a tie.  cdist and the full
// ranking (k > kSmallK) prepare the whole gallery once in the level's layout (word-major: 8 bytes
// per word and item; nibble planes: 16).
// simd: -1 = best available, else the level number above; a level the CPU lacks is an error
// (nac_fast/ops/search.py maps the NAC_FAST_HAMMING_ISA environment variable to it).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(NAC_HAMMING_PORTABLE_ONLY)
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

// The largest gallery the retrieval pass prepares whole in a nibble layout (retrieval_loop).
constexpr int64_t kPreparedGalleryBytes = int64_t{1} << 28;

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

// A level's distance kernel: query q in the level's prepared form (Engine::prep_query), gallery g
// in its layout with S items per word or plane (Engine::prep_gallery), items [j0, j0 + n) ->
// out[0, n).  Nibble levels write out[0, round_up(n, 64)) and read g up to that many items.
using DistFn = void (*)(const void* q, const void* g, int64_t S, int64_t W, int64_t j0,
                        int64_t n, uint16_t* out);

// Portable: without -mpopcnt, __builtin_popcountll is a libgcc bit-trick routine.
void dist_block_generic(const void* qv, const void* gv, int64_t G, int64_t W, int64_t j0,
                        int64_t n, uint16_t* out) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* gT = static_cast<const u64*>(gv);
  if (W == 2) return dist_block_body<2>(q, gT, G, W, j0, n, out);
  dist_block_body<0>(q, gT, G, W, j0, n, out);
}

#if NAC_HAMMING_X86
// Scalar POPCNT instruction (every x86-64 CPU since 2008 has it, but the baseline ABI does not).
__attribute__((target("popcnt"))) void dist_block_popcnt(const void* qv, const void* gv,
                                                         int64_t G, int64_t W, int64_t j0,
                                                         int64_t n, uint16_t* out) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* gT = static_cast<const u64*>(gv);
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
    const void* qv, const void* gv, int64_t G, int64_t W, int64_t j0, int64_t n, uint16_t* out) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* gT = static_cast<const u64*>(gv);
  if (W == 2) return dist_block_avx512_body<2>(q, gT, G, W, j0, n, out);
  if (W == 1) return dist_block_avx512_body<1>(q, gT, G, W, j0, n, out);
  dist_block_avx512_body<0>(q, gT, G, W, j0, n, out);
}
#endif

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
// Average precision over the whole ranking
// ---------------------------------------------------------------------------------------------

#if NAC_HAMMING_X86
// The byte masks of two 32-byte compares as one 64-bit mask (lo's bytes first).
__attribute__((target("avx2"))) inline u64 movemask64(__m256i lo, __m256i hi) {
  return static_cast<uint32_t>(_mm256_movemask_epi8(lo)) |
         (static_cast<u64>(static_cast<uint32_t>(_mm256_movemask_epi8(hi))) << 32);
}
#endif

// Relevance of gallery items [j0, j0+n) to one query [M:relevance]: portable, as 0/1 bytes (the
// scalar path was slower with relevance bits: bench/results/cpu_micro.md); AVX-512, as a bit mask
// (bit j % 64 of word j / 64, bits past n are 0), 8 items per compare.
struct SingleLabel {  // class ids: relevant = same class
  const int64_t* gl;
  const int64_t* ql;
  // The gallery's ids as int32 when every id fits (hamming_retrieval_cpu), else null: the AVX2
  // mask then compares 8 ids per instruction instead of 4.
  const int32_t* gl32 = nullptr;
  // The gallery's ids minus gl8_lo as bytes when they span at most 255 values (class ids), else
  // null: the masks then compare 32 (AVX2) or 64 (AVX-512BW) ids per instruction.  A query id
  // outside [gl8_lo, gl8_lo + 254] has no relevant item.
  const uint8_t* gl8 = nullptr;
  int64_t gl8_lo = 0;
  // The mask of n items none of which is relevant.
  static void no_relevant(int64_t n, u64* out) {
    std::memset(out, 0, static_cast<size_t>((n + 63) / 64) * sizeof(u64));
  }
  // The query's id as a gl8 byte, or -1 when no gallery id can equal it.
  int query_byte(int64_t i) const {
    const uint64_t v = static_cast<uint64_t>(ql[i]) - static_cast<uint64_t>(gl8_lo);  // exact when >= 0
    return ql[i] >= gl8_lo && v <= 254 ? static_cast<int>(v) : -1;
  }
  void bytes(int64_t i, int64_t j0, int64_t n, uint8_t* out) const {
    const int64_t c = ql[i];
    const int64_t* g = gl + j0;
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint8_t>(g[j] == c);
  }
#if NAC_HAMMING_X86
  __attribute__((target("avx512f,avx512bw"))) void mask_avx512(int64_t i, int64_t j0, int64_t n,
                                                                u64* out) const {
    if (gl8) {
      const int qb = query_byte(i);
      if (qb < 0) return no_relevant(n, out);
      const __m512i c8 = _mm512_set1_epi8(static_cast<char>(qb));
      const uint8_t* g = gl8 + j0;
      for (int64_t w = 0; w * 64 < n; ++w) {
        const int64_t left = n - w * 64;
        const __mmask64 valid = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
        const __m512i v = _mm512_maskz_loadu_epi8(valid, g + w * 64);
        out[w] = _mm512_mask_cmpeq_epi8_mask(valid, v, c8);
      }
      return;
    }
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
  __attribute__((target("avx2"))) void mask_avx2(int64_t i, int64_t j0, int64_t n, u64* out) const {
    if (gl8) {
      const int qb = query_byte(i);
      if (qb < 0) return no_relevant(n, out);
      const __m256i c8 = _mm256_set1_epi8(static_cast<char>(qb));
      const uint8_t* g = gl8 + j0;
      int64_t j = 0;
      for (; j + 64 <= n; j += 64) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j + 32));
        out[j >> 6] = movemask64(_mm256_cmpeq_epi8(a, c8), _mm256_cmpeq_epi8(b, c8));
      }
      if (j < n) {
        u64 bits = 0;
        for (int64_t u = j; u < n; ++u) bits |= static_cast<u64>(g[u] == qb) << (u - j);
        out[j >> 6] = bits;
      }
      return;
    }
    if (gl32 && ql[i] >= INT32_MIN && ql[i] <= INT32_MAX) {
      const __m256i c32 = _mm256_set1_epi32(static_cast<int32_t>(ql[i]));
      const int32_t* g = gl32 + j0;
      for (int64_t w = 0; w * 64 < n; ++w) {
        const int64_t jb = w * 64, je = std::min<int64_t>(n, jb + 64);
        u64 bits = 0;
        int64_t j = jb;
        for (; j + 8 <= je; j += 8) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
          bits |= static_cast<u64>(static_cast<uint32_t>(
                      _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(v, c32)))))
                  << (j - jb);
        }
        for (; j < je; ++j) bits |= static_cast<u64>(g[j] == ql[i]) << (j - jb);
        out[w] = bits;
      }
      return;
    }
    const __m256i c = _mm256_set1_epi64x(ql[i]);
    const int64_t* g = gl + j0;
    for (int64_t w = 0; w * 64 < n; ++w) {
      const int64_t jb = w * 64, je = std::min<int64_t>(n, jb + 64);
      u64 bits = 0;
      int64_t j = jb;
      for (; j + 4 <= je; j += 4) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + j));
        bits |= static_cast<u64>(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(v, c))))
                << (j - jb);
      }
      for (; j < je; ++j) bits |= static_cast<u64>(g[j] == ql[i]) << (j - jb);
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
  __attribute__((target("avx2"))) void mask_avx2(int64_t i, int64_t j0, int64_t n, u64* out) const {
    const u64* q = ql + i * L;
    for (int64_t w = 0; w * 64 < n; ++w) {
      const int64_t jb = w * 64, je = std::min<int64_t>(n, jb + 64);
      u64 bits = 0;
      int64_t j = jb;
      for (; j + 4 <= je; j += 4) {
        __m256i hit = _mm256_setzero_si256();
        for (int64_t l = 0; l < L; ++l) {
          const __m256i qw = _mm256_set1_epi64x(static_cast<long long>(q[l]));
          hit = _mm256_or_si256(hit, _mm256_and_si256(qw, _mm256_loadu_si256(
                                                              reinterpret_cast<const __m256i*>(glT + l * G + j0 + j))));
        }
        const int none = _mm256_movemask_pd(
            _mm256_castsi256_pd(_mm256_cmpeq_epi64(hit, _mm256_setzero_si256())));
        bits |= static_cast<u64>(~none & 0xF) << (j - jb);
      }
      for (; j < je; ++j) {
        u64 hit = 0;
        for (int64_t l = 0; l < L; ++l) hit |= glT[l * G + j0 + j] & q[l];
        bits |= static_cast<u64>(hit != 0) << (j - jb);
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
//
// Records (put_record): packed, one uint32 (position << xb | distance) in rec_p, when every
// distance fits in xb bits and every position in 32 - xb (4 bytes per relevant item instead of
// 6: the records of a 64-query block are tens of MB at 1M items, written in the pass and read
// back once in finalize_query); else the distance in rec_d and the position in rec_p.
template <bool kPacked>
inline void put_record(uint16_t* rec_d, uint32_t* rec_p, int64_t r, uint32_t x, uint32_t pos,
                       int xb) {
  if constexpr (kPacked) {
    rec_p[r] = (pos << xb) | x;
  } else {
    rec_d[r] = static_cast<uint16_t>(x);
    rec_p[r] = pos;
  }
}

template <bool kPacked>
int64_t accumulate_scalar(const uint16_t* d, const uint8_t* r, int64_t n, uint32_t* cnt,
                          uint16_t* rec_d, uint32_t* rec_p, int64_t nrel, int xb) {
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t x = d[j];
    const uint32_t p = cnt[x];
    cnt[x] = p + 1;
    put_record<kPacked>(rec_d, rec_p, nrel, x, p, xb);
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
// The fifth block of nbp counters (cnt + 4 nbp) counts the relevant items per distance.
template <bool kPacked>
__attribute__((target("avx512f,avx512bw,popcnt"))) int64_t accumulate_avx512(
    const uint16_t* d, const u64* m, int64_t n, uint32_t* cnt, int64_t nbp, uint16_t* rec_d,
    uint32_t* rec_p, int64_t nrel, int xb) {
  uint32_t* c1 = cnt + nbp;
  uint32_t* c2 = cnt + 2 * nbp;
  uint32_t* c3 = cnt + 3 * nbp;
  uint32_t* rl = cnt + 4 * nbp;
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
        put_record<kPacked>(rec_d, rec_p, nrel, x,
                            cnt[x] + c1[x] + c2[x] + c3[x] +
                                static_cast<uint32_t>(__builtin_popcountll(eq & ((u64{1} << k) - 1))),
                            xb);
        ++rl[x];
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

// 32 uint16 lanes (a, b) -> 32 bytes in item order (packs works per 128-bit lane: items 0-7,
// 16-23, 8-15, 24-31 -> 0xD8 puts them in order); unsigned saturation for distances, signed for
// the 0 / -1 compare results.
template <bool kSigned>
__attribute__((target("avx2"))) inline __m256i pack_words(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(kSigned ? _mm256_packs_epi16(a, b) : _mm256_packus_epi16(a, b),
                                  0xD8);
}

// AVX2 version of accumulate_avx512, in the same groups of 64 items and the same four histogram
// copies: one loop over a group's relevant items (per 16 items it was four loops, and their exits
// are what the branch predictor misses on ~10%-relevant data).  A relevant item's position among
// the group's items of its distance comes from a 64-lane equality mask (movemask64).
// kBytes, distances below 256 (codes of at most 192 bits: 64 W <= 255): the group's distances
// packed to bytes once (two vectors), two 32-lane byte compares per relevant item; otherwise four
// 16-lane word compares packed to bytes.  d must be readable for 64 items from every multiple of
// 64 below n (lanes at or past n come after every relevant item of the group, so they never count).
template <bool kPacked, bool kBytes>
__attribute__((target("avx2,popcnt"))) int64_t accumulate_avx2(
    const uint16_t* d, const u64* m, int64_t n, uint32_t* cnt, int64_t nbp, uint16_t* rec_d,
    uint32_t* rec_p, int64_t nrel, int xb) {
  uint32_t* c1 = cnt + nbp;
  uint32_t* c2 = cnt + 2 * nbp;
  uint32_t* c3 = cnt + 3 * nbp;
  uint32_t* rl = cnt + 4 * nbp;
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    const int64_t cn = std::min<int64_t>(64, n - c0);
    u64 bits = m[c0 >> 6];
    const uint16_t* dc = d + c0;
    if (bits) {
      const __m256i* dv = reinterpret_cast<const __m256i*>(dc);
      const __m256i v0 = _mm256_loadu_si256(dv), v1 = _mm256_loadu_si256(dv + 1);
      const __m256i v2 = _mm256_loadu_si256(dv + 2), v3 = _mm256_loadu_si256(dv + 3);
      // kBytes: the group's distances as bytes (unused lanes of the word path: compiled away)
      const __m256i lo = kBytes ? pack_words<false>(v0, v1) : v0;
      const __m256i hi = kBytes ? pack_words<false>(v2, v3) : v2;
      do {
        const int k = __builtin_ctzll(bits);
        bits &= bits - 1;
        const uint32_t x = dc[k];
        u64 eq;
        if constexpr (kBytes) {
          const __m256i xv = _mm256_set1_epi8(static_cast<char>(x));
          eq = movemask64(_mm256_cmpeq_epi8(lo, xv), _mm256_cmpeq_epi8(hi, xv));
        } else {
          const __m256i xv = _mm256_set1_epi16(static_cast<short>(x));
          eq = movemask64(pack_words<true>(_mm256_cmpeq_epi16(v0, xv), _mm256_cmpeq_epi16(v1, xv)),
                          pack_words<true>(_mm256_cmpeq_epi16(v2, xv), _mm256_cmpeq_epi16(v3, xv)));
        }
        put_record<kPacked>(rec_d, rec_p, nrel, x,
                            cnt[x] + c1[x] + c2[x] + c3[x] +
                                static_cast<uint32_t>(__builtin_popcountll(eq & ((u64{1} << k) - 1))),
                            xb);
        ++rl[x];
        ++nrel;
      } while (bits);
    }
    if (cn == 64) {
      for (int u = 0; u < 64; u += 4) {
        ++cnt[dc[u]];
        ++c1[dc[u + 1]];
        ++c2[dc[u + 2]];
        ++c3[dc[u + 3]];
      }
    } else {
      for (int64_t u = 0; u < cn; ++u) ++cnt[dc[u]];
    }
  }
  return nrel;
}
#endif

// Histogram copies per query in the retrieval pass (see accumulate_avx512), and the relevant
// items' histogram after them.
constexpr int64_t kSubMax = 4;

// ---------------------------------------------------------------------------------------------
// Blocking helpers: query blocks x gallery tiles
// ---------------------------------------------------------------------------------------------

// (Engine::tile_items and Engine::prep_gallery, below, with the instruction-set levels.)

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

// A level's top-k scan of one tile: query q prepared, tile tT in the level's layout with T items
// per word or plane, its first n items being gallery items j0, j0 + 1, ...
using ScanFn = void (*)(const void* q, const void* tT, int64_t T, int64_t W, int64_t n,
                        int64_t j0, TopList&);

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

void scan_topk_generic(const void* qv, const void* tv, int64_t T, int64_t W, int64_t n,
                       int64_t j0, TopList& s) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* tT = static_cast<const u64*>(tv);
  if (W == 2) return scan_topk_body<2>(q, tT, T, W, n, j0, s);
  scan_topk_body<0>(q, tT, T, W, n, j0, s);
}

#if NAC_HAMMING_X86
__attribute__((target("popcnt"))) void scan_topk_popcnt(const void* qv, const void* tv,
                                                        int64_t T, int64_t W, int64_t n,
                                                        int64_t j0, TopList& s) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* tT = static_cast<const u64*>(tv);
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
    const void* qv, const void* tv, int64_t T, int64_t W, int64_t n, int64_t j0, TopList& s) {
  const u64* q = static_cast<const u64*>(qv);
  const u64* tT = static_cast<const u64*>(tv);
  if (W == 2) return scan_topk_avx512_body<2>(q, tT, T, W, n, j0, s);
  if (W == 1) return scan_topk_avx512_body<1>(q, tT, T, W, n, j0, s);
  scan_topk_avx512_body<0>(q, tT, T, W, n, j0, s);
}
#endif

#if NAC_HAMMING_X86  // the nibble levels are x86 only (little-endian bytes of the words)
// ---------------------------------------------------------------------------------------------
// Nibble planes (levels 2 = AVX2 and 3 = AVX-512BW): gallery tile byte-sliced into 16 W planes
// of nibbles, query as 16 W tables of 16 nibble distances (the header comment)
// ---------------------------------------------------------------------------------------------

// Nibble counts (<= 4 each) are summed in bytes over at most this many planes (62 * 4 = 248
// < 256), then widened to 16 bits: one chunk for codes up to 192 bits (48 planes).
constexpr int64_t kPlaneChunk = 62;

constexpr uint8_t kNibblePopcount[16] = {0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4};

// The query's tables: out[16 p + v] = popcount(nibble p of the code ^ v), nibble 2b = the low
// nibble of byte b (little-endian bytes of the words), 2b + 1 its high nibble; 256 W bytes.
void prep_tables(const u64* q, int64_t W, uint8_t* out) {
  for (int64_t b = 0; b < 8 * W; ++b) {
    const unsigned byte = static_cast<unsigned>((q[b / 8] >> (8 * (b % 8))) & 0xFF);
    const unsigned lo = byte & 15u, hi = byte >> 4;
    for (unsigned v = 0; v < 16; ++v) {
      out[32 * b + v] = kNibblePopcount[lo ^ v];
      out[32 * b + 16 + v] = kNibblePopcount[hi ^ v];
    }
  }
}

// Gallery rows [j0, j0 + n) of the row-major (G, W) codes -> nibble planes out[p * S + col + j].
void prep_nibbles(const u64* gp, int64_t W, int64_t j0, int64_t n, int64_t S, void* outv,
                  int64_t col) {
  uint8_t* out = static_cast<uint8_t*>(outv) + col;
  for (int64_t w = 0; w < W; ++w) {
    for (int64_t bb = 0; bb < 8; ++bb) {
      const int64_t b = 8 * w + bb;
      uint8_t* lo = out + (2 * b) * S;
      uint8_t* hi = out + (2 * b + 1) * S;
      const int shift = static_cast<int>(8 * bb);
      for (int64_t j = 0; j < n; ++j) {
        const unsigned byte = static_cast<unsigned>((gp[(j0 + j) * W + w] >> shift) & 0xFF);
        lo[j] = static_cast<uint8_t>(byte & 15u);
        hi[j] = static_cast<uint8_t>(byte >> 4);
      }
    }
  }
}
#endif

// Word-major layouts (levels 0, 1, 4): the query as its words; gallery rows [j0, j0 + n) ->
// out[w * S + col + j].
void prep_words_query(const u64* q, int64_t W, uint8_t* out) {
  std::memcpy(out, q, static_cast<size_t>(W) * sizeof(u64));
}

void prep_words(const u64* gp, int64_t W, int64_t j0, int64_t n, int64_t S, void* outv,
                int64_t col) {
  u64* out = static_cast<u64*>(outv) + col;
  if (W == 1) {
    std::memcpy(out, gp + j0, static_cast<size_t>(n) * sizeof(u64));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const u64* row = gp + (j0 + j) * W;
    for (int64_t w = 0; w < W; ++w) out[w * S + j] = row[w];
  }
}

#if NAC_HAMMING_X86
// prep_nibbles with SSE2 byte transposes: 16 items x one 16-byte group of their codes (the last
// group 8 bytes when W is odd) -> 16 columns, byte b of the 16 items each, in four rounds of
// PUNPCKL/HBW; then each column's low and high nibbles are two 16-byte plane stores.
template <bool HALF>
__attribute__((target("avx2"), always_inline)) inline void prep_group16(const u64* src, int64_t W,
                                                                        uint8_t* out, int64_t S) {
  const __m128i m4 = _mm_set1_epi8(15);
  __m128i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    r[i] = HALF ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i * W))
                : _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * W));
#pragma GCC unroll 4
  for (int st = 0; st < 4; ++st) {
    __m128i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm_unpacklo_epi8(r[i], r[i + 8]);
      t[2 * i + 1] = _mm_unpackhi_epi8(r[i], r[i + 8]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
#pragma GCC unroll 16
  for (int b = 0; b < (HALF ? 8 : 16); ++b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * b) * S), _mm_and_si128(r[b], m4));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * b + 1) * S),
                     _mm_and_si128(_mm_srli_epi16(r[b], 4), m4));
  }
}

__attribute__((target("avx2"))) void prep_nibbles_x86(const u64* gp, int64_t W, int64_t j0,
                                                      int64_t n, int64_t S, void* outv,
                                                      int64_t col) {
  uint8_t* out = static_cast<uint8_t*>(outv) + col;
  const int64_t n16 = n / 16 * 16;
  for (int64_t c = 0; 2 * c < W; ++c) {  // byte group c: bytes 16 c ... of every code
    uint8_t* oc = out + 32 * c * S;        // plane 2 * (16 c)
    for (int64_t j = 0; j < n16; j += 16) {
      const u64* src = gp + (j0 + j) * W + 2 * c;
      if (2 * c + 1 == W)
        prep_group16<true>(src, W, oc + j, S);
      else
        prep_group16<false>(src, W, oc + j, S);
    }
  }
  if (n16 < n) prep_nibbles(gp, W, j0 + n16, n - n16, S, outv, col + n16);
}

// AVX2: a[r] += VPSHUFB(table p, plane p's 32 items 32 r ...) over planes [p0, p1), bytes.
// (Named accumulators and a loop unrolled twice: GCC spills or copies an array of vectors.)
template <int R>
__attribute__((target("avx2"), always_inline)) inline void nib_sums_avx2(
    const uint8_t* tabs, const uint8_t* g, int64_t S, int64_t p0, int64_t p1, __m256i (&a)[R]) {
  static_assert(R == 1 || R == 2 || R == 4 || R == 8, "R");
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const uint8_t* row = g + p0 * S;
  const uint8_t* tp = tabs + 16 * p0;
#pragma GCC unroll 2
  for (int64_t p = p0; p < p1; ++p, row += S, tp += 16) {
    const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tp)));
    a0 = _mm256_add_epi8(a0, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))));
    if (R > 1)
      a1 = _mm256_add_epi8(a1, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32))));
    if (R > 2) {
      a2 = _mm256_add_epi8(a2, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 64))));
      a3 = _mm256_add_epi8(a3, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 96))));
    }
    if (R > 4) {
      a4 = _mm256_add_epi8(a4, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 128))));
      a5 = _mm256_add_epi8(a5, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 160))));
      a6 = _mm256_add_epi8(a6, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 192))));
      a7 = _mm256_add_epi8(a7, _mm256_shuffle_epi8(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 224))));
    }
  }
  a[0] = a0;
  if (R > 1) a[1] = a1;
  if (R > 2) {
    a[2] = a2;
    a[3] = a3;
  }
  if (R > 4) {
    a[4] = a4;
    a[5] = a5;
    a[6] = a6;
    a[7] = a7;
  }
}

// Distances of the 32 R items at g (P planes) as uint16 into out[0, 32 R).
template <int R>
__attribute__((target("avx2"), always_inline)) inline void nib_dist_avx2(
    const uint8_t* tabs, const uint8_t* g, int64_t S, int64_t P, uint16_t* out) {
  __m256i a[R];
  if (P <= kPlaneChunk) {
    nib_sums_avx2<R>(tabs, g, S, 0, P, a);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * r),
                          _mm256_cvtepu8_epi16(_mm256_castsi256_si128(a[r])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * r + 16),
                          _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a[r], 1)));
    }
    return;
  }
  __m256i wsum[2 * R];
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r) wsum[r] = _mm256_setzero_si256();
  for (int64_t p0 = 0; p0 < P; p0 += kPlaneChunk) {
    nib_sums_avx2<R>(tabs, g, S, p0, std::min(P, p0 + kPlaneChunk), a);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wsum[2 * r] = _mm256_add_epi16(wsum[2 * r], _mm256_cvtepu8_epi16(_mm256_castsi256_si128(a[r])));
      wsum[2 * r + 1] =
          _mm256_add_epi16(wsum[2 * r + 1], _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a[r], 1)));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * r), wsum[r]);
}

template <int WC>
__attribute__((target("avx2"), always_inline)) inline void dist_nib_avx2_body(
    const void* qv, const void* gv, int64_t S, int64_t Wrt, int64_t j0, int64_t n, uint16_t* out) {
  const int64_t P = 16 * (WC > 0 ? WC : Wrt);
  const uint8_t* tabs = static_cast<const uint8_t*>(qv);
  const uint8_t* g = static_cast<const uint8_t*>(gv) + j0;
  const int64_t nr = (n + 63) / 64 * 64;
  int64_t j = 0;
  for (; j + 128 <= nr; j += 128) nib_dist_avx2<4>(tabs, g + j, S, P, out + j);
  if (j < nr) nib_dist_avx2<2>(tabs, g + j, S, P, out + j);
}

__attribute__((target("avx2"))) void dist_nib_avx2(const void* q, const void* g, int64_t S,
                                                   int64_t W, int64_t j0, int64_t n,
                                                   uint16_t* out) {
  if (W == 2) return dist_nib_avx2_body<2>(q, g, S, W, j0, n, out);
  if (W == 1) return dist_nib_avx2_body<1>(q, g, S, W, j0, n, out);
  dist_nib_avx2_body<0>(q, g, S, W, j0, n, out);
}

// The k-th distance bound as "d <= lim" (thr > 0: a candidate enters iff d < thr).
inline uint64_t bound_minus_one(u64 thr, u64 cap) { return std::min<u64>(thr, cap) - 1; }

// Candidates of one chunk in lane order (= gallery order): bits of `mask`, distances in lanes.
template <typename D>
inline void insert_lanes(u64 mask, const D* lanes, int64_t base, TopList& s) {
  for (; mask; mask &= mask - 1) {
    const int l = __builtin_ctzll(mask);
    if (lanes[l] < s.thr) s.insert(lanes[l], base + l);
  }
}

inline u64 first_bits(int64_t c) {
  return c >= 64 ? ~u64{0} : c <= 0 ? u64{0} : (u64{1} << c) - 1;
}

// One step of the AVX2 top-k scan: the 32 R items at g (c of them valid, c > 0, gallery index
// base + lane).  Codes up to 192 bits (three words: P <= kPlaneChunk) compare their byte sums with one
// VPMINUB + VPCMPEQB per 32 items, 256 items a step (R = 8: each plane's table is loaded once
// for eight vectors; on Zen 1, whose 256-bit loads take both load ports for a cycle, the scan is
// bound by its loads, and R = 8 against 4 was 5-8% faster at one thread, 1k x 1M 128-bit codes:
// bench/results/hamming_isa_cpu.md); wider codes go through 16-bit distances, R <= 4.
template <int R>
__attribute__((target("avx2"), always_inline)) inline void scan_nib_avx2_step(
    const uint8_t* tabs, const uint8_t* g, int64_t T, int64_t P, int64_t c, int64_t base,
    TopList& s, uint8_t* lanes8, uint16_t* lanes16) {
  constexpr int M = R > 2 ? R / 2 : 1;  // 64-item masks
  u64 m[M > 2 ? M : 2] = {};
  if (R > 4 || P <= kPlaneChunk) {  // R = 8 only with byte sums (the caller's choice)
    const __m256i lim = _mm256_set1_epi8(static_cast<char>(bound_minus_one(s.thr, 256)));
    __m256i a[R];
    nib_sums_avx2<R>(tabs, g, T, 0, P, a);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const u64 mr = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(a[r], lim), a[r])));
      m[r / 2] |= mr << (32 * (r % 2));
    }
    u64 any = 0;
#pragma GCC unroll 4
    for (int h = 0; h < M; ++h) any |= (m[h] &= first_bits(c - 64 * h));
    if (__builtin_expect(any == 0, 1)) return;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes8 + 32 * r), a[r]);
    for (int h = 0; h < M; ++h) insert_lanes(m[h], lanes8 + 64 * h, base + 64 * h, s);
    return;
  }
  if constexpr (R <= 4) {
    nib_dist_avx2<R>(tabs, g, T, P, lanes16);
    const __m256i lim = _mm256_set1_epi16(static_cast<short>(bound_minus_one(s.thr, 65536)));
#pragma GCC unroll 8
    for (int v = 0; v < 2 * R; v += 2) {  // 32 items: two 16-bit compares packed to bytes in order
      const __m256i x0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes16 + 16 * v));
      const __m256i x1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes16 + 16 * v + 16));
      const __m256i e0 = _mm256_cmpeq_epi16(_mm256_min_epu16(x0, lim), x0);
      const __m256i e1 = _mm256_cmpeq_epi16(_mm256_min_epu16(x1, lim), x1);
      const u64 mm = static_cast<uint32_t>(_mm256_movemask_epi8(
          _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8)));
      m[v / 4] |= mm << (16 * (v % 4));
    }
    m[0] &= first_bits(c);
    m[1] &= first_bits(c - 64);
    insert_lanes(m[0], lanes16, base, s);
    insert_lanes(m[1], lanes16 + 64, base + 64, s);
  }
}

template <int WC>
__attribute__((target("avx2"), always_inline)) inline void scan_nib_avx2_body(
    const void* qv, const void* tv, int64_t T, int64_t Wrt, int64_t n, int64_t j0, TopList& s) {
  const int64_t P = 16 * (WC > 0 ? WC : Wrt);
  const uint8_t* tabs = static_cast<const uint8_t*>(qv);
  const uint8_t* g = static_cast<const uint8_t*>(tv);
  const int64_t nr = (n + 63) / 64 * 64;
  alignas(32) uint8_t lanes8[256];
  alignas(32) uint16_t lanes16[128];
  int64_t j = 0;
  if (P <= kPlaneChunk)  // byte sums: 256 items a step, each plane's table loaded once for all
    for (; j + 256 <= nr; j += 256) {
      if (s.thr == 0) return;  // k items at distance 0: nothing can enter
      scan_nib_avx2_step<8>(tabs, g + j, T, P, n - j, j0 + j, s, lanes8, lanes16);
    }
  for (; j + 128 <= nr; j += 128) {
    if (s.thr == 0) return;  // k items at distance 0: nothing can enter
    scan_nib_avx2_step<4>(tabs, g + j, T, P, n - j, j0 + j, s, lanes8, lanes16);
  }
  if (j < nr && s.thr != 0) scan_nib_avx2_step<2>(tabs, g + j, T, P, n - j, j0 + j, s, lanes8, lanes16);
}

__attribute__((target("avx2"))) void scan_nib_avx2(const void* q, const void* t, int64_t T,
                                                   int64_t W, int64_t n, int64_t j0, TopList& s) {
  if (W == 2) return scan_nib_avx2_body<2>(q, t, T, W, n, j0, s);
  if (W == 1) return scan_nib_avx2_body<1>(q, t, T, W, n, j0, s);
  scan_nib_avx2_body<0>(q, t, T, W, n, j0, s);
}

// AVX-512BW without VPOPCNTDQ: the same with 64 items per VPSHUFB; 256 items per step.
template <int R>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void nib_sums_avx512(
    const uint8_t* tabs, const uint8_t* g, int64_t S, int64_t p0, int64_t p1, __m512i (&a)[R]) {
  static_assert(R == 1 || R == 2 || R == 4, "R");
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  const uint8_t* row = g + p0 * S;
  const uint8_t* tp = tabs + 16 * p0;
#pragma GCC unroll 2
  for (int64_t p = p0; p < p1; ++p, row += S, tp += 16) {
    const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tp)));
    a0 = _mm512_add_epi8(a0, _mm512_shuffle_epi8(t, _mm512_loadu_si512(row)));
    if (R > 1) a1 = _mm512_add_epi8(a1, _mm512_shuffle_epi8(t, _mm512_loadu_si512(row + 64)));
    if (R > 2) {
      a2 = _mm512_add_epi8(a2, _mm512_shuffle_epi8(t, _mm512_loadu_si512(row + 128)));
      a3 = _mm512_add_epi8(a3, _mm512_shuffle_epi8(t, _mm512_loadu_si512(row + 192)));
    }
  }
  a[0] = a0;
  if (R > 1) a[1] = a1;
  if (R > 2) {
    a[2] = a2;
    a[3] = a3;
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void nib_dist_avx512(
    const uint8_t* tabs, const uint8_t* g, int64_t S, int64_t P, uint16_t* out) {
  __m512i a[R];
  if (P <= kPlaneChunk) {
    nib_sums_avx512<R>(tabs, g, S, 0, P, a);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_si512(out + 64 * r, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(a[r])));
      _mm512_storeu_si512(out + 64 * r + 32, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(a[r], 1)));
    }
    return;
  }
  __m512i wsum[2 * R];
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r) wsum[r] = _mm512_setzero_si512();
  for (int64_t p0 = 0; p0 < P; p0 += kPlaneChunk) {
    nib_sums_avx512<R>(tabs, g, S, p0, std::min(P, p0 + kPlaneChunk), a);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      wsum[2 * r] = _mm512_add_epi16(wsum[2 * r], _mm512_cvtepu8_epi16(_mm512_castsi512_si256(a[r])));
      wsum[2 * r + 1] = _mm512_add_epi16(wsum[2 * r + 1],
                                         _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(a[r], 1)));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < 2 * R; ++r) _mm512_storeu_si512(out + 32 * r, wsum[r]);
}

template <int WC>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void dist_nib_avx512_body(
    const void* qv, const void* gv, int64_t S, int64_t Wrt, int64_t j0, int64_t n, uint16_t* out) {
  const int64_t P = 16 * (WC > 0 ? WC : Wrt);
  const uint8_t* tabs = static_cast<const uint8_t*>(qv);
  const uint8_t* g = static_cast<const uint8_t*>(gv) + j0;
  const int64_t nr = (n + 63) / 64 * 64;
  int64_t j = 0;
  for (; j + 256 <= nr; j += 256) nib_dist_avx512<4>(tabs, g + j, S, P, out + j);
  for (; j < nr; j += 64) nib_dist_avx512<1>(tabs, g + j, S, P, out + j);
}

__attribute__((target("avx512f,avx512bw"))) void dist_nib_avx512(const void* q, const void* g,
                                                                 int64_t S, int64_t W, int64_t j0,
                                                                 int64_t n, uint16_t* out) {
  if (W == 2) return dist_nib_avx512_body<2>(q, g, S, W, j0, n, out);
  if (W == 1) return dist_nib_avx512_body<1>(q, g, S, W, j0, n, out);
  dist_nib_avx512_body<0>(q, g, S, W, j0, n, out);
}

template <int R>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void scan_nib_avx512_step(
    const uint8_t* tabs, const uint8_t* g, int64_t T, int64_t P, int64_t c, int64_t base,
    TopList& s, uint8_t* lanes8, uint16_t* lanes16) {
  u64 m[R];
  if (P <= kPlaneChunk) {
    const __m512i lim = _mm512_set1_epi8(static_cast<char>(bound_minus_one(s.thr, 256)));
    __m512i a[R];
    nib_sums_avx512<R>(tabs, g, T, 0, P, a);
    u64 any = 0;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      m[r] = static_cast<u64>(_mm512_cmple_epu8_mask(a[r], lim)) & first_bits(c - 64 * r);
      any |= m[r];
    }
    if (__builtin_expect(any == 0, 1)) return;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_store_si512(lanes8 + 64 * r, a[r]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) insert_lanes(m[r], lanes8 + 64 * r, base + 64 * r, s);
    return;
  }
  nib_dist_avx512<R>(tabs, g, T, P, lanes16);
  const __m512i lim = _mm512_set1_epi16(static_cast<short>(bound_minus_one(s.thr, 65536)));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const u64 lo = _mm512_cmple_epu16_mask(_mm512_load_si512(lanes16 + 64 * r), lim);
    const u64 hi = _mm512_cmple_epu16_mask(_mm512_load_si512(lanes16 + 64 * r + 32), lim);
    m[r] = (lo | (hi << 32)) & first_bits(c - 64 * r);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) insert_lanes(m[r], lanes16 + 64 * r, base + 64 * r, s);
}

template <int WC>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void scan_nib_avx512_body(
    const void* qv, const void* tv, int64_t T, int64_t Wrt, int64_t n, int64_t j0, TopList& s) {
  const int64_t P = 16 * (WC > 0 ? WC : Wrt);
  const uint8_t* tabs = static_cast<const uint8_t*>(qv);
  const uint8_t* g = static_cast<const uint8_t*>(tv);
  const int64_t nr = (n + 63) / 64 * 64;
  alignas(64) uint8_t lanes8[256];
  alignas(64) uint16_t lanes16[256];
  int64_t j = 0;
  for (; j + 256 <= nr; j += 256) {
    if (s.thr == 0) return;
    scan_nib_avx512_step<4>(tabs, g + j, T, P, n - j, j0 + j, s, lanes8, lanes16);
  }
  for (; j < nr; j += 64) {
    if (s.thr == 0) return;
    scan_nib_avx512_step<1>(tabs, g + j, T, P, n - j, j0 + j, s, lanes8, lanes16);
  }
}

__attribute__((target("avx512f,avx512bw"))) void scan_nib_avx512(const void* q, const void* t,
                                                                 int64_t T, int64_t W, int64_t n,
                                                                 int64_t j0, TopList& s) {
  if (W == 2) return scan_nib_avx512_body<2>(q, t, T, W, n, j0, s);
  if (W == 1) return scan_nib_avx512_body<1>(q, t, T, W, n, j0, s);
  scan_nib_avx512_body<0>(q, t, T, W, n, j0, s);
}
#endif  // NAC_HAMMING_X86

// ---------------------------------------------------------------------------------------------
// Instruction-set levels and the engine of each
// ---------------------------------------------------------------------------------------------

enum Level : int { kPortable = 0, kScalar = 1, kAvx2 = 2, kAvx512bw = 3, kAvx512vpopcnt = 4 };
constexpr int kTopLevel = kAvx512vpopcnt;
const char* const kLevelNames[] = {"portable", "scalar", "avx2", "avx512bw", "avx512vpopcnt"};

// Each level needs the ones below it (every AVX-512BW CPU has AVX2 and POPCNT).
int detected_level() {
#if NAC_HAMMING_X86
  __builtin_cpu_init();
  // libgcc also checks that the OS saves the ymm / zmm state (XCR0) before reporting AVX features.
  if (!__builtin_cpu_supports("popcnt")) return kPortable;
  if (!__builtin_cpu_supports("avx2")) return kScalar;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))) return kAvx2;
  if (!__builtin_cpu_supports("avx512vpopcntdq")) return kAvx512bw;
  return kAvx512vpopcnt;
#else
  return kPortable;
#endif
}

int simd_level() {
  static const int level = detected_level();
  return level;
}

int pick_level(int64_t simd) {
  const int best = simd_level();
  TORCH_CHECK(simd >= -1 && simd <= kTopLevel,
              "hamming: simd must be -1 (auto) or a level 0-4 (0 portable, 1 scalar, 2 avx2, "
              "3 avx512bw, 4 avx512vpopcnt), got ", simd);
  TORCH_CHECK(simd <= best, "hamming: simd level ", simd, " (", kLevelNames[simd],
              ") requested but this CPU supports at most ", best, " (", kLevelNames[best], ")");
  return simd < 0 ? best : static_cast<int>(simd);
}

using PrepQueryFn = void (*)(const u64* q, int64_t W, uint8_t* out);
using PrepGalleryFn = void (*)(const u64* gp, int64_t W, int64_t j0, int64_t n, int64_t S,
                               void* out, int64_t col);

struct Engine {
  int level;
  bool nibble;          // nibble planes (levels 2, 3), else word-major words
  PrepQueryFn prep_query;
  PrepGalleryFn prep_gallery;
  DistFn dist;
  ScanFn scan;
  // Prepared bytes per query and per gallery item.
  int64_t query_bytes(int64_t W) const { return nibble ? 256 * W : 8 * W; }
  int64_t item_bytes(int64_t W) const { return nibble ? 16 * W : 8 * W; }
  // Items per gallery tile, a multiple of 128 (accumulate_avx512 reads 64 distances from every
  // multiple of 64, the nibble kernels 64 items): word-major, about 64 KiB of codes, in L2 while
  // a block of queries scans it; nibble planes, 16 KiB, in L1 (their scan loads a plane byte per
  // item and nibble, twice the code's bytes).
  int64_t tile_items(int64_t W) const {
    const int64_t t = (nibble ? int64_t{1} << 14 : int64_t{1} << 16) / item_bytes(W);
    return std::max<int64_t>(nibble ? 128 : 256, t / 128 * 128);
  }
};

Engine pick_engine(int64_t simd) {
  const int level = pick_level(simd);
  Engine e{level, false, prep_words_query, prep_words, dist_block_generic, scan_topk_generic};
#if NAC_HAMMING_X86
  if (level == kScalar) {
    e.dist = dist_block_popcnt;
    e.scan = scan_topk_popcnt;
  } else if (level == kAvx2 || level == kAvx512bw) {
    e.nibble = true;
    e.prep_query = prep_tables;
    e.prep_gallery = prep_nibbles_x86;
    e.dist = level == kAvx2 ? dist_nib_avx2 : dist_nib_avx512;
    e.scan = level == kAvx2 ? scan_nib_avx2 : scan_nib_avx512;
  } else if (level == kAvx512vpopcnt) {
    e.dist = dist_block_avx512;
    e.scan = scan_topk_avx512;
  }
#endif
  return e;
}

// A prepared buffer (query tables or gallery tile) as 64-byte-aligned storage.
struct Prepared {
  std::vector<u64> buf;
  void resize(int64_t bytes) { buf.assign(static_cast<size_t>((bytes + 63) / 64 * 8), 0); }
  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(buf.data()); }
};

// The whole gallery in the engine's layout, S items per word or plane (padding zero), prepared
// in parallel.  S is G rounded up to 4096, plus 576: plane (or word) p then starts 64 (9 p mod 64)
// bytes into a 4 KiB page, so the rows of a tile's planes spread over the L1 sets (S a multiple
// of 4 KiB would put every plane's row in the same sets).
struct PreparedGallery {
  std::vector<u64> buf;
  int64_t S = 0;
  PreparedGallery(const Engine& e, const u64* gp, int64_t G, int64_t W) {
    S = (G + 4095) / 4096 * 4096 + 576;
    buf.assign(static_cast<size_t>(e.item_bytes(W) * S / 8), 0);
    void* out = buf.data();
    at::parallel_for(0, (G + kBlock - 1) / kBlock, 1, [&](int64_t b, int64_t en) {
      for (int64_t blk = b; blk < en; ++blk) {
        const int64_t j0 = blk * kBlock;
        e.prep_gallery(gp, W, j0, std::min(kBlock, G - j0), S, out, j0);
      }
    });
  }
};

// ---------------------------------------------------------------------------------------------
// cdist
// ---------------------------------------------------------------------------------------------

at::Tensor hamming_cdist_cpu(const at::Tensor& query_in, const at::Tensor& gallery_in, int64_t simd) {
  check_pair(query_in, gallery_in);
  const Engine eng = pick_engine(simd);
  const at::Tensor query = query_in.contiguous(), gallery = gallery_in.contiguous();
  const int64_t Q = query.size(0), G = gallery_in.size(0), W = query.size(1);
  at::Tensor out = at::empty({Q, G}, query.options().dtype(at::kInt));
  if (Q == 0 || G == 0) return out;
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const PreparedGallery pg(eng, reinterpret_cast<const u64*>(gallery.data_ptr<int64_t>()), G, W);
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, Q, grain_for(G), [&](int64_t b, int64_t e) {
    std::vector<uint16_t> buf(kBlock);
    Prepared qt;
    qt.resize(eng.query_bytes(W));
    for (int64_t i = b; i < e; ++i) {
      eng.prep_query(qp + i * W, W, qt.bytes());
      for (int64_t j0 = 0; j0 < G; j0 += kBlock) {
        const int64_t n = std::min(kBlock, G - j0);
        eng.dist(qt.bytes(), pg.buf.data(), pg.S, W, j0, n, buf.data());
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
  const Engine eng = pick_engine(simd);
  const at::Tensor query = query_in.contiguous(), gallery = gallery_in.contiguous();
  at::Tensor od = at::empty({Q, k}, query.options().dtype(at::kInt));
  at::Tensor oi = at::empty({Q, k}, query.options().dtype(at::kLong));
  if (Q == 0 || k == 0) return {od, oi};
  const u64* qp = reinterpret_cast<const u64*>(query.data_ptr<int64_t>());
  const PreparedGallery pg(eng, reinterpret_cast<const u64*>(gallery.data_ptr<int64_t>()), G, W);
  int32_t* odp = od.data_ptr<int32_t>();
  int64_t* oip = oi.data_ptr<int64_t>();
  const int64_t nb = W * 64 + 1;
  at::parallel_for(0, Q, grain_for(G), [&](int64_t b, int64_t e) {
    std::vector<uint16_t> d(static_cast<size_t>(pg.S));  // nibble levels write whole 64s
    std::vector<int64_t> cnt(nb);
    Prepared qt;
    qt.resize(eng.query_bytes(W));
    for (int64_t i = b; i < e; ++i) {
      eng.prep_query(qp + i * W, W, qt.bytes());
      for (int64_t j0 = 0; j0 < G; j0 += kBlock)
        eng.dist(qt.bytes(), pg.buf.data(), pg.S, W, j0, std::min(kBlock, G - j0), d.data() + j0);
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


void topk_small(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W, int64_t k,
                const Engine& eng, int32_t* odp, int64_t* oip) {
  const int64_t T = eng.tile_items(W), qbytes = eng.query_bytes(W);
  // Split the queries finely enough that every thread gets work, in whole query blocks when
  // there are enough of them.
  const int64_t threads = at::get_num_threads();
  const int64_t qb = std::max<int64_t>(1, std::min<int64_t>(kTopkQueryBlock, (Q + threads - 1) / threads));
  const int64_t nb = (Q + qb - 1) / qb;
  at::parallel_for(0, nb, 1, [&](int64_t b, int64_t e) {
    Prepared tile, qt;
    tile.resize(eng.item_bytes(W) * T);
    qt.resize(qb * qbytes);
    std::vector<uint16_t> dl(static_cast<size_t>(qb * k));
    std::vector<TopList> lists(static_cast<size_t>(qb));
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t i0 = blk * qb, i1 = std::min(Q, i0 + qb);
      for (int64_t i = i0; i < i1; ++i) {
        lists[i - i0] = TopList{dl.data() + (i - i0) * k, oip + i * k, k, 0, ~u64{0}};
        eng.prep_query(qp + i * W, W, qt.bytes() + (i - i0) * qbytes);
      }
      for (int64_t j0 = 0; j0 < G; j0 += T) {
        const int64_t n = std::min(T, G - j0);
        eng.prep_gallery(gp, W, j0, n, T, tile.bytes(), 0);
        for (int64_t i = i0; i < i1; ++i)
          eng.scan(qt.bytes() + (i - i0) * qbytes, tile.bytes(), T, W, n, j0, lists[i - i0]);
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
// last record on every item, so the capacity stays >= nrel + tile items).  Packed records
// (put_record) use p alone.
struct Records {
  uint16_t* d = nullptr;
  uint32_t* p = nullptr;
  int64_t cap = 0;
  bool packed = false;
  void reserve(int64_t need) {
    if (need <= cap) return;
    const int64_t nc = std::max<int64_t>(need, 2 * cap);
    uint16_t* nd = nullptr;
    if (!packed) {
      nd = static_cast<uint16_t*>(std::realloc(d, static_cast<size_t>(nc) * sizeof(uint16_t)));
      if (nd) d = nd;
    }
    auto* np = static_cast<uint32_t*>(std::realloc(p, static_cast<size_t>(nc) * sizeof(uint32_t)));
    if (np) p = np;
    TORCH_CHECK((packed || nd) && np, "hamming_retrieval: out of memory for ", nc,
                " relevance records");
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

// Everything after a query's pass: cnt[x] items, relin[x] relevant items (null: counted here
// from the records) and the relevant items' records (distance, position among the items of
// that distance, in gallery order; put_record's layout).  The AP sums the precisions in gallery
// order, as [M:ap] lists them.
template <bool kPacked>
void finalize_query(int64_t i, int64_t G, int64_t nb, const uint32_t* cnt, const uint32_t* relin,
                    const Records& rec, int xb, int64_t nrel, const RetrievalOut& o,
                    std::vector<uint32_t>& relcnt, std::vector<uint64_t>& before,
                    std::vector<uint64_t>& relbefore, std::vector<double>& bucket_sum,
                    std::vector<int64_t>& cut_x, std::vector<int64_t>& cut_m,
                    std::vector<uint8_t>& is_cut) {
  const uint32_t xmask = (uint32_t{1} << xb) - 1;
  const auto rec_x = [&](int64_t r) -> uint32_t {
    if constexpr (kPacked) return rec.p[r] & xmask; else return rec.d[r];
  };
  const auto rec_pos = [&](int64_t r) -> uint32_t {
    if constexpr (kPacked) return rec.p[r] >> xb; else return rec.p[r];
  };
  o.nrel[i] = nrel;
  if (relin) {
    std::copy(relin, relin + nb, relcnt.begin());
  } else {
    std::fill(relcnt.begin(), relcnt.end(), 0u);
    for (int64_t r = 0; r < nrel; ++r) ++relcnt[rec_x(r)];
  }
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
  } else if (o.C == 0) {  // AP alone: no per-bucket sums
    std::fill(relcnt.begin(), relcnt.end(), 0u);  // now: relevant items of distance x seen so far
    double sum = 0.0;
    for (int64_t r = 0; r < nrel; ++r) {
      const uint32_t x = rec_x(r);
      const uint32_t seen = ++relcnt[x];
      sum += static_cast<double>(relbefore[x] + seen) /
             static_cast<double>(before[x] + rec_pos(r) + 1);
    }
    o.ap[i] = sum / static_cast<double>(nrel);
  } else {
    std::fill(relcnt.begin(), relcnt.end(), 0u);  // now: relevant items of distance x seen so far
    std::fill(bucket_sum.begin(), bucket_sum.end(), 0.0);
    double sum = 0.0;
    for (int64_t r = 0; r < nrel; ++r) {
      const uint32_t x = rec_x(r), pos = rec_pos(r);
      const uint32_t seen = ++relcnt[x];
      const double v = static_cast<double>(relbefore[x] + seen) /
                       static_cast<double>(before[x] + pos + 1);
      sum += v;
      bucket_sum[x] += v;
      if (is_cut[x]) {
        for (int64_t c = 0; c < o.C; ++c) {
          if (cut_x[c] == static_cast<int64_t>(x) && static_cast<int64_t>(pos) < cut_m[c]) {
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

template <bool kPacked, class Rel>
void retrieval_loop_impl(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W,
                         const Engine& eng, const Rel& rel, const RetrievalOut& o, int64_t maxrel,
                         int xb) {
  const int64_t T = eng.tile_items(W), qbytes = eng.query_bytes(W);
  const int64_t nb = W * 64 + 1;
  // Queries per block: each holds up to 6 bytes (packed: 4) of records per relevant item, at most
  // maxrel of them (the most any query has: G for multi-hot labels), so the block shrinks as
  // that grows (<= 2^24 item slots, ~96 MiB per thread).  A block reads the whole gallery once.
  const int64_t threads = at::get_num_threads();
  int64_t qb = std::max<int64_t>(1, std::min<int64_t>(64, (int64_t{1} << 24) / std::max<int64_t>(maxrel + T, 1)));
  qb = std::max<int64_t>(1, std::min(qb, (Q + threads - 1) / threads));
  const int64_t nblk = (Q + qb - 1) / qb;
  // Nibble planes are prepared once for the whole gallery when there are several query blocks
  // (each would prepare every tile again: a block is only 16 queries at 1M items) and the planes
  // take at most kPreparedGalleryBytes (16 bytes per word and item: 1M 128-bit codes, 32 MiB).
  std::unique_ptr<PreparedGallery> pg;
  if (eng.nibble && nblk > 1 && eng.item_bytes(W) * G <= kPreparedGalleryBytes)
    pg = std::make_unique<PreparedGallery>(eng, gp, G, W);
  at::parallel_for(0, nblk, 1, [&](int64_t b, int64_t e) {
    Prepared tile, qt;
    tile.resize(pg ? 0 : eng.item_bytes(W) * T);
    qt.resize(qb * qbytes);
    std::vector<uint16_t> dbuf(static_cast<size_t>(T));
    std::vector<u64> mbuf(static_cast<size_t>(T / 64));
    std::vector<uint8_t> rbuf(static_cast<size_t>(T));
    // per query: kSubMax interleaved histogram copies of nbp counters and the relevant items'
    // counts (accumulate_avx512); the portable path uses the first copy only
    const int64_t nbp = (nb + 15) / 16 * 16, per_q = (kSubMax + 1) * nbp;
    std::vector<uint32_t> cnt(static_cast<size_t>(qb * per_q));
    std::vector<uint32_t> total(static_cast<size_t>(nb));
    std::vector<Records> recs(static_cast<size_t>(qb));
    for (Records& r : recs) r.packed = kPacked;
    // the x86 accumulate loops count the relevant items (cnt + 4 nbp); the portable one does not
    const bool rel_counted = NAC_HAMMING_X86 && eng.level >= kAvx2;
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
      for (int64_t i = i0; i < i1; ++i)
        eng.prep_query(qp + i * W, W, qt.bytes() + (i - i0) * qbytes);
      for (int64_t j0 = 0; j0 < G; j0 += T) {
        const int64_t n = std::min(T, G - j0);
        if (!pg) eng.prep_gallery(gp, W, j0, n, T, tile.bytes(), 0);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t li = i - i0;
          uint32_t* c = cnt.data() + li * per_q;
          Records& rc = recs[li];
          rc.reserve(nrel[li] + n + 1);
          if (pg)
            eng.dist(qt.bytes() + li * qbytes, pg->buf.data(), pg->S, W, j0, n, dbuf.data());
          else
            eng.dist(qt.bytes() + li * qbytes, tile.bytes(), T, W, 0, n, dbuf.data());
#if NAC_HAMMING_X86
          if (eng.level >= kAvx512bw) {
            rel.mask_avx512(i, j0, n, mbuf.data());
            nrel[li] = accumulate_avx512<kPacked>(dbuf.data(), mbuf.data(), n, c, nbp, rc.d, rc.p,
                                                  nrel[li], xb);
            continue;
          }
          if (eng.level == kAvx2) {
            rel.mask_avx2(i, j0, n, mbuf.data());
            nrel[li] = 64 * W <= 255
                           ? accumulate_avx2<kPacked, true>(dbuf.data(), mbuf.data(), n, c, nbp,
                                                            rc.d, rc.p, nrel[li], xb)
                           : accumulate_avx2<kPacked, false>(dbuf.data(), mbuf.data(), n, c, nbp,
                                                             rc.d, rc.p, nrel[li], xb);
            continue;
          }
#endif
          rel.bytes(i, j0, n, rbuf.data());
          nrel[li] = accumulate_scalar<kPacked>(dbuf.data(), rbuf.data(), n, c, rc.d, rc.p,
                                                nrel[li], xb);
        }
      }
      for (int64_t i = i0; i < i1; ++i) {
        const uint32_t* c = cnt.data() + (i - i0) * per_q;
        for (int64_t x = 0; x < nb; ++x) {
          uint32_t t = 0;
          for (int64_t s = 0; s < kSubMax; ++s) t += c[s * nbp + x];
          total[x] = t;
        }
        finalize_query<kPacked>(i, G, nb, total.data(), rel_counted ? c + kSubMax * nbp : nullptr,
                                recs[i - i0], xb, nrel[i - i0], o, relcnt, before, relbefore,
                                bucket_sum, cut_x, cut_m, is_cut);
      }
    }
  });
}

// Packed records (put_record) when every distance (at most 64 W) fits in xb bits and every
// position (below G) in the other 32 - xb: up to 2^24 items at 128 bits, 2^21 at 1,024.
template <class Rel>
void retrieval_loop(const u64* qp, const u64* gp, int64_t Q, int64_t G, int64_t W,
                    const Engine& eng, const Rel& rel, const RetrievalOut& o, int64_t maxrel) {
  int xb = 1;
  while ((int64_t{1} << xb) <= 64 * W) ++xb;
  if (xb <= 16 && G <= (int64_t{1} << (32 - xb)))
    retrieval_loop_impl<true>(qp, gp, Q, G, W, eng, rel, o, maxrel, xb);
  else
    retrieval_loop_impl<false>(qp, gp, Q, G, W, eng, rel, o, maxrel, 16);
}

// The most gallery items of one class any query asks for (class ids): the records a query of the
// retrieval pass holds at most.
int64_t max_relevant(const at::Tensor& gl, const at::Tensor& ql) {
  const at::Tensor sorted = std::get<0>(gl.sort()).contiguous();
  const int64_t* s = sorted.data_ptr<int64_t>();
  const int64_t* q = ql.data_ptr<int64_t>();
  const int64_t G = sorted.numel(), Q = ql.numel();
  int64_t most = 0;
  for (int64_t i = 0; i < Q; ++i) {
    const auto r = std::equal_range(s, s + G, q[i]);
    most = std::max<int64_t>(most, r.second - r.first);
  }
  return most;
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
  const Engine eng = pick_engine(simd);
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
    at::Tensor gl32, gl8;
    if (eng.level >= kAvx2 && G > 0) {
      const auto mm = at::aminmax(gl);
      const int64_t lo = std::get<0>(mm).item<int64_t>(), hi = std::get<1>(mm).item<int64_t>();
      if (static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) <= 254) {  // hi >= lo: exact
        gl8 = (gl - lo).to(at::kByte);
        rel.gl8 = gl8.data_ptr<uint8_t>();
        rel.gl8_lo = lo;
      } else if (eng.level == kAvx2 && lo >= INT32_MIN && hi <= INT32_MAX) {
        gl32 = gl.to(at::kInt);
        rel.gl32 = gl32.data_ptr<int32_t>();
      }
    }
    retrieval_loop(qp, gp, Q, G, W, eng, rel, o, max_relevant(gl, ql));
  } else {
    const at::Tensor ql = qlab_in.contiguous(), glT = word_major(glab_in);
    MultiLabel rel{reinterpret_cast<const u64*>(glT.data_ptr<int64_t>()),
                   reinterpret_cast<const u64*>(ql.data_ptr<int64_t>()), qlab_in.size(1), G};
    retrieval_loop(qp, gp, Q, G, W, eng, rel, o, G);
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
  const Engine eng = pick_engine(simd);
  const at::Tensor query = query_in.contiguous(), gallery = gallery_in.contiguous();
  at::Tensor od = at::empty({Q, k}, query.options().dtype(at::kInt));
  at::Tensor oi = at::empty({Q, k}, query.options().dtype(at::kLong));
  topk_small(reinterpret_cast<const u64*>(query.data_ptr<int64_t>()),
             reinterpret_cast<const u64*>(gallery.data_ptr<int64_t>()), Q, G, W, k, eng,
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
