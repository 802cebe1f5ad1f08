// One query per lane: the Hamming engine's CUDA kernels (csrc/hamming_cuda.cu) and their CPU
// emulation (csrc/hamming_lanes.cpp, what CI runs) call these same functions, so the CPU tests of
// nac_fast/ops/hamming_cuda.py check the arithmetic, the counters and the indexing the GPU runs.
// What only a GPU runs: each kernel's few lines that turn blockIdx / threadIdx into (query, slice)
// and point the lane at its shared-memory column.
//
// The design (docs/math.md [M:hamming], [M:rank], [M:ap-count]; bench/gpu_notes.md "The CUDA
// Hamming engine"): a lane owns one query and walks a slice of the gallery in index order.  Every
// lane of a warp reads the same gallery code (one broadcast load), so a lane's state is its own:
//   - retrieval pass 1 (ap_hist_lane): the lane's per-distance counters (items, relevant items)
//     live in its own column of shared memory, col[d * stride]; with stride = the block's lanes,
//     the 32 lanes of a warp hit 32 different banks whatever their distances: no conflicts, no
//     atomics.  (The Triton kernels keep these counters in global memory, int64, one uncoalesced
//     read and write per pair.)
//   - retrieval pass 2 (ap_rank_lane): the same column holds the running rank and hit counters,
//     started from the counts of pass 1 (what torch computes between the passes); an item's rank
//     is its distance's counter after the increment, exactly [M:ap-count].
//   - top-k filter (filter_lane): a running count per lane of the items below / at the bound.
// Nothing here synchronises with another lane: a kernel needs no barrier, and a lane past the last
// query returns at once.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define HL_FN __host__ __device__ __forceinline__
#define HL_UNROLL _Pragma("unroll")
#else
#define HL_FN inline
#define HL_UNROLL _Pragma("GCC unroll 16")
#endif

namespace hamming_lanes {

using u64 = uint64_t;
template <int N>
struct IntC { static constexpr int value = N; };

constexpr int kMaxWords = 16;          // 1024-bit codes
constexpr int kLabelRegs = 4;          // multi-hot label words a lane keeps in registers
constexpr int64_t kChunk = 65535;      // pass 1 packs (items, relevant) as 16 | 16 bits
constexpr int kBatch = 4;              // gallery items loaded ahead by pass 2
constexpr int kKeyShift = 40;          // top-k candidate key: distance << 40 | gallery row
constexpr int64_t kEmptyKey = INT64_MAX;

HL_FN int popc64(u64 x) {
#if defined(__CUDA_ARCH__)
  return __popcll(x);
#else
  return __builtin_popcountll(x);
#endif
}

// Read-only global data: the non-coherent cache path on a GPU.
template <typename T>
HL_FN T ld(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// A lane's query code, its first MAXW words in registers (W <= MAXW words are real; the
// unrolled loops below index qr with constants only, so it never spills to local memory).
template <int MAXW>
struct Query {
  u64 qr[MAXW];
  int W;
  HL_FN void load(const int64_t* q, int64_t row, int W_) {
    W = W_;
HL_UNROLL
    for (int w = 0; w < MAXW; ++w) qr[w] = w < W ? static_cast<u64>(ld(q + row * W + w)) : 0;
  }
  // Hamming distance to the gallery code at g (W words) [M:hamming]
  HL_FN int dist(const int64_t* g) const {
    int d = 0;
HL_UNROLL
    for (int w = 0; w < MAXW; ++w)
      if (w < W) d += popc64(qr[w] ^ static_cast<u64>(ld(g + w)));
    return d;
  }
};

// A lane's query labels and the relevance test [M:relevance]: one class id per item (MULTI
// false), or LW packed multi-hot words per item, relevant when they share a label.
template <bool MULTI>
struct Labels;

template <>
struct Labels<false> {
  int64_t l;
  HL_FN void load(const int64_t* ql, int64_t row, int) { l = ld(ql + row); }
  HL_FN bool rel(const int64_t* gl, int64_t g) const { return ld(gl + g) == l; }
};

template <>
struct Labels<true> {
  u64 lr[kLabelRegs];
  const int64_t* qrow;
  int LW;
  HL_FN void load(const int64_t* ql, int64_t row, int LW_) {
    LW = LW_;
    qrow = ql + row * LW;
HL_UNROLL
    for (int w = 0; w < kLabelRegs; ++w) lr[w] = w < LW ? static_cast<u64>(ld(qrow + w)) : 0;
  }
  HL_FN bool rel(const int64_t* gl, int64_t g) const {
    const int64_t* grow = gl + g * LW;
    u64 hit = 0;
HL_UNROLL
    for (int w = 0; w < kLabelRegs; ++w)
      if (w < LW) hit |= lr[w] & static_cast<u64>(ld(grow + w));
    for (int w = kLabelRegs; w < LW; ++w) hit |= static_cast<u64>(ld(qrow + w) & ld(grow + w));
    return hit != 0;
  }
};

struct RetrievalArgs {
  const int64_t* q;     // (Q, W) packed query codes
  const int64_t* g;     // (G, W) packed gallery codes, contiguous
  const int64_t* ql;    // (Q,) class ids or (Q, LW) packed multi-hot words
  const int64_t* gl;    // (G,) or (G, LW)
  int64_t Q, G, L;      // queries, gallery rows, rows per slice (slice s: [s L, s L + L) & [0, G))
  int W, LW, NB;        // words per code, label words, distance bins (bits + 1)
  int64_t* hist;        // pass 1: (S, NB, Q) items + (relevant << 32) per slice and distance,
                        //   zeroed
  const int64_t* start; // pass 2: (S, NB, Q) the same packing: ranked before the slice's first
                        //   item of that distance (torch, between the passes)
  double* psum;         // pass 2: (S, Q) sum over the relevant items of hits / rank [M:ap]
  const int64_t* cuts;  // pass 2: (C,) rank cut-offs, ascending, distinct
  int ncut;
  double* cps;          // pass 2: (S, C, Q) zeroed; bucket c: the relevant items whose first cut-off
  int64_t* chit;        //   >= their rank is cuts[c] (their hits / rank, their count); a cumulative
                        //   sum over c gives each cut-off's sums [M:ap-at-k] [M:precision-at-n]
};

// A retrieval lane: its query's code and labels, and slice s's rows [begin, end).
template <int MAXW, bool MULTI>
struct RetrievalLane {
  Query<MAXW> q;
  Labels<MULTI> lab;
  int64_t begin, end;
  HL_FN RetrievalLane(const RetrievalArgs& a, int64_t qi, int64_t s) {
    q.load(a.q, qi, a.W);
    lab.load(a.ql, qi, a.LW);
    begin = s * a.L;
    end = begin + a.L < a.G ? begin + a.L : a.G;
  }
  HL_FN int dist(const RetrievalArgs& a, int64_t gi) const { return q.dist(a.g + gi * a.W); }
  HL_FN bool rel(const RetrievalArgs& a, int64_t gi) const { return lab.rel(a.gl, gi); }
};

// Pass 1 for query `qi` and slice `s`: col[d * stride] (uint32, the lane's own) counts the slice's
// items (low 16 bits) and relevant items (high 16) of distance d, chunk by chunk (a chunk of at
// most kChunk rows cannot overflow them), each chunk added to hist.
template <int MAXW, bool MULTI>
HL_FN void ap_hist_lane(const RetrievalArgs& a, int64_t qi, int64_t s, uint32_t* col, int stride) {
  if (qi >= a.Q) return;
  const RetrievalLane<MAXW, MULTI> ln(a, qi, s);
  for (int64_t c0 = ln.begin; c0 < ln.end; c0 += kChunk) {
    const int64_t c1 = c0 + kChunk < ln.end ? c0 + kChunk : ln.end;
    for (int d = 0; d < a.NB; ++d) col[d * stride] = 0u;
    for (int64_t gi = c0; gi < c1; ++gi)
      col[ln.dist(a, gi) * stride] += 1u + (static_cast<uint32_t>(ln.rel(a, gi)) << 16);
    int64_t* h = a.hist + s * a.NB * a.Q + qi;
    for (int d = 0; d < a.NB; ++d) {
      const uint32_t v = col[d * stride];
      if (v) h[d * a.Q] += static_cast<int64_t>(v & 0xFFFFu) + (static_cast<int64_t>(v >> 16) << 32);
    }
  }
}

// Pass 2 for query `qi` and slice `s`: col[d * stride] and col[(NB + d) * stride] (uint32, the
// lane's own) are the items and the relevant items ranked so far at or before distance d; walking
// the slice in index order, an item's rank is its distance's item counter after the increment,
// and a relevant item's hits its relevant counter after the increment [M:ap-count].
template <int MAXW, bool MULTI>
HL_FN void ap_rank_lane(const RetrievalArgs& a, int64_t qi, int64_t s, uint32_t* col, int stride) {
  if (qi >= a.Q) return;
  const RetrievalLane<MAXW, MULTI> ln(a, qi, s);
  const int64_t* st = a.start + s * a.NB * a.Q + qi;
  uint32_t* rk = col;
  uint32_t* ht = col + a.NB * stride;
  for (int d = 0; d < a.NB; ++d) {
    const int64_t v = st[d * a.Q];
    rk[d * stride] = static_cast<uint32_t>(v & 0xFFFFFFFF);
    ht[d * stride] = static_cast<uint32_t>(v >> 32);
  }
  const int64_t last_cut = a.ncut > 0 ? ld(a.cuts + a.ncut - 1) : 0;
  double psum = 0.0;
  // an item: its rank and, if relevant, hits / rank and its cut-off bucket
  auto take = [&](int d, bool rel) {
    const uint32_t rank = rk[d * stride] + 1u;
    rk[d * stride] = rank;
    if (rel) {
      const uint32_t hits = ht[d * stride] + 1u;
      ht[d * stride] = hits;
      const double term = static_cast<double>(hits) / static_cast<double>(rank);
      psum += term;
      if (static_cast<int64_t>(rank) <= last_cut) {
        int c = 0;
        while (ld(a.cuts + c) < static_cast<int64_t>(rank)) ++c;
        const int64_t at = (s * a.ncut + c) * a.Q + qi;
        a.cps[at] += term;
        a.chit[at] += 1;
      }
    }
  };
  const int64_t end = ln.end;
  int64_t gi = ln.begin;
  // kBatch items' codes and labels are loaded and their distances computed before the first
  // counter update (whose shared-memory round trip each next item waits for): the loads and
  // popcounts of a batch overlap, the updates stay in index order.
  for (; gi + kBatch <= end; gi += kBatch) {
    int d[kBatch];
    bool rel[kBatch];
    HL_UNROLL
    for (int u = 0; u < kBatch; ++u) {
      d[u] = ln.dist(a, gi + u);
      rel[u] = ln.rel(a, gi + u);
    }
    HL_UNROLL
    for (int u = 0; u < kBatch; ++u) take(d[u], rel[u]);
  }
  for (; gi < end; ++gi) take(ln.dist(a, gi), ln.rel(a, gi));
  a.psum[s * a.Q + qi] = psum;
}

// The passes as types, for the kernels and the emulation that run them on every lane.
struct HistPass {
  template <int MAXW, bool MULTI>
  static HL_FN void lane(const RetrievalArgs& a, int64_t qi, int64_t s, uint32_t* col, int stride) {
    ap_hist_lane<MAXW, MULTI>(a, qi, s, col, stride);
  }
  static int64_t smem_bytes(int NB, int64_t lanes) { return 4 * NB * lanes; }  // 1 uint32 each
};
struct RankPass {
  template <int MAXW, bool MULTI>
  static HL_FN void lane(const RetrievalArgs& a, int64_t qi, int64_t s, uint32_t* col, int stride) {
    ap_rank_lane<MAXW, MULTI>(a, qi, s, col, stride);
  }
  static int64_t smem_bytes(int NB, int64_t lanes) { return 8 * NB * lanes; }  // 2 uint32 each
};

struct FilterArgs {
  const int64_t* q;     // (Q, W)
  const int64_t* g;     // gallery view: row r at g + r * GS (W words)
  const int32_t* t;     // (Q,) the bound of each query's k-th distance
  int64_t* keys;        // (Q, S * (CA + KB)) candidate keys, EMPTY-filled by the caller
  int32_t* na;          // (Q, S) items below the bound per slice (may exceed CA: an overflow)
  int64_t Q, G, GS, L;  // queries, view rows, view row stride (words), rows per slice
  int64_t CA, KB;       // slots per (query, slice) for items below / at the bound
  int64_t S;            // slices
  int W;
};

// The top-k filter pass [M:rank] for query `qi` and slice `s`: keys d << 40 | row of the first CA
// rows with d < t and the first KB rows with d == t, in row order; the count of rows with d < t.
template <int MAXW>
HL_FN void filter_lane(const FilterArgs& a, int64_t qi, int64_t s) {
  if (qi >= a.Q) return;
  Query<MAXW> q;
  q.load(a.q, qi, a.W);
  const int t = ld(a.t + qi);
  int64_t* slot = a.keys + (qi * a.S + s) * (a.CA + a.KB);
  int64_t na = 0, nb = 0;
  const int64_t begin = s * a.L;
  const int64_t end = begin + a.L < a.G ? begin + a.L : a.G;
  for (int64_t gi = begin; gi < end; ++gi) {
    const int d = q.dist(a.g + gi * a.GS);
    if (d <= t) {
      const int64_t key = (static_cast<int64_t>(d) << kKeyShift) | gi;
      if (d < t) {
        if (na < a.CA) slot[na] = key;
        ++na;
      } else if (nb < a.KB) {
        slot[a.CA + nb] = key;
        ++nb;
      }
    }
  }
  a.na[qi * a.S + s] = static_cast<int32_t>(na < INT32_MAX ? na : INT32_MAX);
}

// One entry of the (Q, G) distance matrix (hamming_distance).
template <int MAXW>
HL_FN int32_t cdist_lane(const int64_t* q, const int64_t* g, int W, int64_t qi, int64_t gi) {
  Query<MAXW> qq;
  qq.load(q, qi, W);
  return qq.dist(g + gi * W);
}

// Calls f(std::integral_constant<int, MAXW>) with the smallest MAXW in {1, 2, 4, 8, 16} >= W
// (host code: picks the kernel instantiation).
template <typename F>
inline void with_max_words(int W, F&& f) {
  if (W <= 1) f(IntC<1>());
  else if (W <= 2) f(IntC<2>());
  else if (W <= 4) f(IntC<4>());
  else if (W <= 8) f(IntC<8>());
  else f(IntC<16>());
}

}  // namespace hamming_lanes
