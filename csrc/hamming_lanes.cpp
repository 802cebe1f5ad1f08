// The ops of the Hamming engine's CUDA kernels (nac_fast/ops/hamming_cuda.py, backend "cuda" of
// op "hamming") and their CPU emulation.  On CUDA tensors they launch csrc/hamming_cuda.cu; on CPU
// tensors they run the very lane functions of csrc/hamming_lanes.h that those kernels run, lane by
// lane, each block of `lanes` lanes with its own emulated shared memory laid out as on the GPU.  So
// CI checks, without a GPU, everything of the kernels but the lines that map blockIdx / threadIdx
// to (query, slice): tests/test_hamming_cuda.py against the C++ engine.
//
//   hamming_lanes_cdist(query, gallery)                                   -> int32 (Q, G)
//   hamming_lanes_filter(query, gallery_view, bound, rows_per_slice, below_slots, at_slots, lanes)
//       -> (int64 keys (Q, S * (below + at)), int32 below counts (Q, S)): top-k filter [M:rank]
//   hamming_lanes_ap_hist(query, gallery, query_labels, gallery_labels, rows_per_slice, lanes)
//       -> int64 (S, W * 64 + 1, Q): items + (relevant << 32) per slice and distance  [M:ap-count]
//   hamming_lanes_ap_rank(query, gallery, query_labels, gallery_labels, start, cuts,
//                         rows_per_slice, lanes)
//       -> (float64 psum (S, Q), float64 cut buckets (S, C, Q), int64 cut buckets (S, C, Q))
// S = ceil(G / rows_per_slice).  Labels: int64 class ids (n,) or packed multi-hot words (n, LW).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <vector>

#include "hamming_lanes.h"
#include "hamming_lanes_ops.h"

namespace {

using namespace hamming_lanes;
constexpr auto kCPU = c10::DeviceType::CPU;

// Every (block of `lanes` queries, slice) as a task; f(block, slice, smem) runs its lanes.
template <typename F>
void for_blocks(int64_t Q, int64_t S, int64_t lanes, int64_t smem_bytes, F&& f) {
  const int64_t nb = (Q + lanes - 1) / lanes;
  at::parallel_for(0, nb * S, 1, [&](int64_t b, int64_t e) {
    std::vector<uint32_t> smem(static_cast<size_t>(smem_bytes / 4));
    for (int64_t i = b; i < e; ++i) f(i % nb, i / nb, smem.data());
  });
}

// Pass P on every lane, as the CUDA kernel runs it: lane l of block blk owns column l of the
// block's shared memory.
template <class P>
void emulate_retrieval(const RetrievalArgs& a, int64_t S, int64_t lanes, bool multi) {
  with_max_words(a.W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    for_blocks(a.Q, S, lanes, P::smem_bytes(a.NB, lanes),
               [&](int64_t blk, int64_t s, uint32_t* smem) {
      for (int64_t l = 0; l < lanes; ++l) {
        if (multi)
          P::template lane<M, true>(a, blk * lanes + l, s, smem + l, static_cast<int>(lanes));
        else
          P::template lane<M, false>(a, blk * lanes + l, s, smem + l, static_cast<int>(lanes));
      }
    });
  });
}

at::Tensor lanes_cdist_cpu(const at::Tensor& q, const at::Tensor& g) {
  auto out = cdist_out(q, g, kCPU);
  const int64_t Q = q.size(0), G = g.size(0);
  const int W = static_cast<int>(q.size(1));
  const int64_t* qp = q.data_ptr<int64_t>();
  const int64_t* gp = g.data_ptr<int64_t>();
  int32_t* o = out.data_ptr<int32_t>();
  with_max_words(W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    at::parallel_for(0, Q, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        for (int64_t j = 0; j < G; ++j) o[i * G + j] = cdist_lane<M>(qp, gp, W, i, j);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> lanes_filter_cpu(const at::Tensor& q, const at::Tensor& g,
                                                    const at::Tensor& t, int64_t L, int64_t CA,
                                                    int64_t KB, int64_t lanes) {
  FilterCall c = filter_call(q, g, t, L, CA, KB, lanes, kCPU);
  with_max_words(c.a.W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    for_blocks(c.a.Q, c.a.S, lanes, 0, [&](int64_t blk, int64_t s, uint32_t*) {
      for (int64_t l = 0; l < lanes; ++l) filter_lane<M>(c.a, blk * lanes + l, s);
    });
  });
  return {c.keys, c.na};
}

at::Tensor lanes_ap_hist_cpu(const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql,
                             const at::Tensor& gl, int64_t L, int64_t lanes) {
  HistCall c = hist_call(q, g, ql, gl, L, lanes, kCPU);
  emulate_retrieval<HistPass>(c.a, c.S, lanes, ql.dim() == 2);
  return c.hist;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lanes_ap_rank_cpu(
    const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql, const at::Tensor& gl,
    const at::Tensor& start, const at::Tensor& cuts, int64_t L, int64_t lanes) {
  RankCall c = rank_call(q, g, ql, gl, start, cuts, L, lanes, kCPU);
  emulate_retrieval<RankPass>(c.a, c.S, lanes, ql.dim() == 2);
  return {c.psum, c.cps, c.chit};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nac_fast, m) {
  m.def("hamming_lanes_cdist(Tensor query, Tensor gallery) -> Tensor");
  m.def("hamming_lanes_filter(Tensor query, Tensor gallery_view, Tensor bound, int rows_per_slice, "
        "int below_slots, int at_slots, int lanes) -> (Tensor, Tensor)");
  m.def("hamming_lanes_ap_hist(Tensor query, Tensor gallery, Tensor query_labels, "
        "Tensor gallery_labels, int rows_per_slice, int lanes) -> Tensor");
  m.def("hamming_lanes_ap_rank(Tensor query, Tensor gallery, Tensor query_labels, "
        "Tensor gallery_labels, Tensor start, Tensor cuts, int rows_per_slice, int lanes) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nac_fast, CPU, m) {
  m.impl("hamming_lanes_cdist", &lanes_cdist_cpu);
  m.impl("hamming_lanes_filter", &lanes_filter_cpu);
  m.impl("hamming_lanes_ap_hist", &lanes_ap_hist_cpu);
  m.impl("hamming_lanes_ap_rank", &lanes_ap_rank_cpu);
}
