// Host side shared by the CPU emulation (hamming_lanes.cpp) and the CUDA kernels
// (hamming_cuda.cu) of the ops nac_fast::hamming_lanes_*: argument checks, outputs, the kernels'
// argument structs.  Schemas in hamming_lanes.cpp; the Python engine is nac_fast/ops/hamming_cuda.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "hamming_lanes.h"

namespace hamming_lanes {

inline void check_words(const at::Tensor& t, const char* op, const char* name, bool rows_strided) {
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be int64 packed words, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D (rows, words), got ", t.dim(), " dims");
  TORCH_CHECK(t.size(1) >= 1 && t.size(1) <= kMaxWords, op, ": ", name, " must have 1 to ",
              kMaxWords, " words per code, got ", t.size(1));
  if (rows_strided) {
    TORCH_CHECK(t.size(1) == 1 || t.stride(1) == 1, op, ": ", name,
                "'s words must be contiguous within a row");
  } else {
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  }
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* name) {
  TORCH_CHECK(a.device() == b.device(), op, ": ", name, " is on ", b.device(),
              ", the query codes on ", a.device());
}

inline void check_pair(const at::Tensor& q, const at::Tensor& g, const char* op, bool g_strided) {
  check_words(q, op, "query", false);
  check_words(g, op, "gallery", g_strided);
  check_same_device(q, g, op, "gallery");
  TORCH_CHECK(q.size(1) == g.size(1), op, ": query and gallery codes have ", q.size(1), " and ",
              g.size(1), " words");
  TORCH_CHECK(g.size(0) < (int64_t{1} << 31), op, ": at most 2^31 - 1 gallery rows, got ",
              g.size(0));
}

inline void check_slices(int64_t G, int64_t L, const char* op) {
  TORCH_CHECK(L >= 1, op, ": rows_per_slice must be >= 1, got ", L);
  const int64_t S = G == 0 ? 0 : (G + L - 1) / L;
  TORCH_CHECK(S <= 65535, op, ": ", S, " slices of ", L, " rows; at most 65535");
}

inline void check_lanes(int64_t lanes, const char* op) {
  TORCH_CHECK(lanes >= 1 && lanes <= 1024, op, ": lanes must be in [1, 1024], got ", lanes);
}

// Retrieval: labels (class ids (n,) or packed multi-hot words (n, LW)), and the bins.
inline RetrievalArgs retrieval_args(const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql,
                                    const at::Tensor& gl, int64_t L, const char* op) {
  check_pair(q, g, op, false);
  const bool multi = ql.dim() == 2;
  TORCH_CHECK(ql.scalar_type() == at::kLong && gl.scalar_type() == at::kLong, op,
              ": labels must be int64 (class ids or packed multi-hot words)");
  TORCH_CHECK(ql.dim() == gl.dim() && (ql.dim() == 1 || ql.dim() == 2), op,
              ": query_labels and gallery_labels must both be 1-D class ids or both 2-D words");
  TORCH_CHECK(ql.size(0) == q.size(0) && gl.size(0) == g.size(0), op,
              ": one label row per code expected");
  TORCH_CHECK(!multi || (ql.size(1) == gl.size(1) && ql.size(1) >= 1), op,
              ": query and gallery label words differ");
  TORCH_CHECK(ql.is_contiguous() && gl.is_contiguous(), op, ": labels must be contiguous");
  check_same_device(q, ql, op, "query_labels");
  check_same_device(q, gl, op, "gallery_labels");
  check_slices(g.size(0), L, op);
  RetrievalArgs a{};
  a.q = q.data_ptr<int64_t>();
  a.g = g.data_ptr<int64_t>();
  a.ql = ql.data_ptr<int64_t>();
  a.gl = gl.data_ptr<int64_t>();
  a.Q = q.size(0);
  a.G = g.size(0);
  a.L = L;
  a.W = static_cast<int>(q.size(1));
  a.LW = multi ? static_cast<int>(ql.size(1)) : 1;
  a.NB = a.W * 64 + 1;  // every distance a code of W words can reach, padding bits or not
  return a;
}

inline int64_t slices(const RetrievalArgs& a) { return a.G == 0 ? 0 : (a.G + a.L - 1) / a.L; }

inline void check_rank_inputs(const RetrievalArgs& a, const at::Tensor& q, const at::Tensor& start,
                              const at::Tensor& cuts, const char* op) {
  const int64_t S = slices(a);
  TORCH_CHECK(start.scalar_type() == at::kLong && start.is_contiguous() && start.dim() == 3 &&
                  start.size(0) == S && start.size(1) == a.NB && start.size(2) == a.Q,
              op, ": start must be contiguous int64 (", S, ", ", a.NB, ", ", a.Q, "), got ",
              start.sizes());
  TORCH_CHECK(cuts.scalar_type() == at::kLong && cuts.dim() == 1 && cuts.is_contiguous(), op,
              ": cuts must be a contiguous 1-D int64 tensor");
  check_same_device(q, start, op, "start");
  check_same_device(q, cuts, op, "cuts");
}

inline FilterArgs filter_args(const at::Tensor& q, const at::Tensor& g, const at::Tensor& t,
                              int64_t L, int64_t CA, int64_t KB, const char* op) {
  check_pair(q, g, op, true);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == q.size(0) &&
                  t.is_contiguous(), op, ": bound must be contiguous int32 (Q,)");
  check_same_device(q, t, op, "bound");
  TORCH_CHECK(CA >= 0 && KB >= 1, op, ": below_slots must be >= 0 and at_slots >= 1");
  check_slices(g.size(0), L, op);
  FilterArgs a{};
  a.q = q.data_ptr<int64_t>();
  a.g = g.data_ptr<int64_t>();
  a.t = t.data_ptr<int32_t>();
  a.Q = q.size(0);
  a.G = g.size(0);
  a.GS = g.size(0) > 1 ? g.stride(0) : g.size(1);
  a.L = L;
  a.CA = CA;
  a.KB = KB;
  a.S = a.G == 0 ? 0 : (a.G + L - 1) / L;
  a.W = static_cast<int>(q.size(1));
  return a;
}

inline void check_device(const at::Tensor& q, c10::DeviceType want, const char* op) {
  TORCH_CHECK(q.device().type() == want, op, ": ",
              want == c10::DeviceType::CPU ? "the CPU emulation takes CPU tensors"
                                           : "the CUDA kernels take CUDA tensors");
}

// One call of an op: its checked arguments and its outputs (allocated on the inputs' device), for
// the CPU emulation and the CUDA launch alike.
struct HistCall {
  RetrievalArgs a;
  int64_t S;
  at::Tensor hist;
};

inline HistCall hist_call(const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql,
                          const at::Tensor& gl, int64_t L, int64_t lanes, c10::DeviceType dev) {
  const char* op = "hamming_lanes_ap_hist";
  check_lanes(lanes, op);
  HistCall c{retrieval_args(q, g, ql, gl, L, op), 0, {}};
  check_device(q, dev, op);
  c.S = slices(c.a);
  c.hist = at::zeros({c.S, c.a.NB, c.a.Q}, q.options());
  c.a.hist = c.hist.data_ptr<int64_t>();
  return c;
}

struct RankCall {
  RetrievalArgs a;
  int64_t S;
  at::Tensor psum, cps, chit;
};

inline RankCall rank_call(const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql,
                          const at::Tensor& gl, const at::Tensor& start, const at::Tensor& cuts,
                          int64_t L, int64_t lanes, c10::DeviceType dev) {
  const char* op = "hamming_lanes_ap_rank";
  check_lanes(lanes, op);
  RankCall c{retrieval_args(q, g, ql, gl, L, op), 0, {}, {}, {}};
  check_rank_inputs(c.a, q, start, cuts, op);
  check_device(q, dev, op);
  c.S = slices(c.a);
  const int64_t C = cuts.size(0);
  c.psum = at::zeros({c.S, c.a.Q}, q.options().dtype(at::kDouble));
  c.cps = at::zeros({c.S, C, c.a.Q}, q.options().dtype(at::kDouble));
  c.chit = at::zeros({c.S, C, c.a.Q}, q.options());
  c.a.start = start.data_ptr<int64_t>();
  c.a.psum = c.psum.data_ptr<double>();
  c.a.cuts = cuts.data_ptr<int64_t>();
  c.a.ncut = static_cast<int>(C);
  c.a.cps = c.cps.data_ptr<double>();
  c.a.chit = c.chit.data_ptr<int64_t>();
  return c;
}

struct FilterCall {
  FilterArgs a;
  at::Tensor keys, na;
};

inline FilterCall filter_call(const at::Tensor& q, const at::Tensor& g, const at::Tensor& t,
                              int64_t L, int64_t CA, int64_t KB, int64_t lanes,
                              c10::DeviceType dev) {
  const char* op = "hamming_lanes_filter";
  check_lanes(lanes, op);
  FilterCall c{filter_args(q, g, t, L, CA, KB, op), {}, {}};
  check_device(q, dev, op);
  c.keys = at::full({c.a.Q, c.a.S * (CA + KB)}, kEmptyKey, q.options());
  c.na = at::zeros({c.a.Q, c.a.S}, q.options().dtype(at::kInt));
  c.a.keys = c.keys.data_ptr<int64_t>();
  c.a.na = c.na.data_ptr<int32_t>();
  return c;
}

inline at::Tensor cdist_out(const at::Tensor& q, const at::Tensor& g, c10::DeviceType dev) {
  const char* op = "hamming_lanes_cdist";
  check_pair(q, g, op, false);
  check_device(q, dev, op);
  return at::empty({q.size(0), g.size(0)}, q.options().dtype(at::kInt));
}

}  // namespace hamming_lanes
