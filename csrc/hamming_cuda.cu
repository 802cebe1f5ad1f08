// CUDA kernels of the Hamming engine's "cuda" backend (nac_fast/ops/hamming_cuda.py): the CUDA
// dispatch key of the ops nac_fast::hamming_lanes_* (schemas and the CPU emulation in
// hamming_lanes.cpp).  Every kernel is one lane function of hamming_lanes.h per thread: a thread
// owns a query (blockIdx.x * blockDim.x + threadIdx.x) and walks gallery slice blockIdx.y; the
// retrieval passes give each thread a column of dynamic shared memory (stride blockDim.x, so the
// lanes of a warp sit in 32 different banks).  No barrier, no atomic: a thread past the last query
// returns at once.  Design and predictions: bench/gpu_notes.md "The CUDA Hamming engine".
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "hamming_lanes.h"
#include "hamming_lanes_ops.h"

namespace {

using namespace hamming_lanes;

constexpr int kCdistThreads = 256;  // gallery rows per block of the distance matrix

template <int M>
__global__ void __launch_bounds__(kCdistThreads) cdist_kernel(const int64_t* __restrict__ q,
                                                              const int64_t* __restrict__ g,
                                                              int32_t* __restrict__ out,
                                                              int64_t Q, int64_t G, int W) {
  const int64_t gi = blockIdx.x * static_cast<int64_t>(kCdistThreads) + threadIdx.x;
  if (gi >= G) return;
  for (int64_t qi = blockIdx.y; qi < Q; qi += gridDim.y)
    out[qi * G + gi] = cdist_lane<M>(q, g, W, qi, gi);
}

template <int M>
__global__ void filter_kernel(FilterArgs a) {
  filter_lane<M>(a, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x, blockIdx.y);
}

// Pass P (HistPass, RankPass of hamming_lanes.h) of the retrieval: thread threadIdx.x owns column
// threadIdx.x of the block's dynamic shared memory.
template <class P, int M, bool MULTI>
__global__ void retrieval_kernel(RetrievalArgs a) {
  extern __shared__ uint32_t smem[];
  P::template lane<M, MULTI>(a, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                             blockIdx.y, smem + threadIdx.x, blockDim.x);
}

constexpr auto kCUDA = c10::DeviceType::CUDA;

// Dynamic shared memory above the default 48 KiB needs the kernel's opt-in; more than the device
// allows is an error naming the lanes to use instead.
template <typename K>
void set_smem(K kernel, int64_t bytes, int64_t lanes, const char* op) {
  int dev = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TORCH_CHECK(bytes <= optin, op, ": ", lanes, " lanes need ", bytes,
              " bytes of shared memory, the device allows ", optin, " per block: use fewer lanes");
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
}

// A block of `lanes` threads must fit the kernel as compiled: check_lanes allows 1024, but its
// registers per thread cap the block below that (sm_90: 72 for filter_kernel<16>, 896 lanes; up to
// 128 for the retrieval kernels, 512 lanes), where the launch would fail with "too many resources
// requested for launch" (the CPU emulation runs any lanes).
template <typename K>
void check_block(K kernel, int64_t lanes, const char* op) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  TORCH_CHECK(lanes <= attr.maxThreadsPerBlock, op, ": ", lanes, " lanes per block; this kernel (",
              attr.numRegs, " registers per thread) runs at most ", attr.maxThreadsPerBlock,
              " per block on this device: use fewer lanes");
}

// (query blocks, slices).  S <= 65535 (check_slices: gridDim.y); the query blocks are gridDim.x,
// at most 2^31 - 1, and nothing else bounds the queries: with few lanes (a direct op call with
// lanes = 1: the filter's ~24 bytes per query fit 2^32 queries in 96 GiB) 2^31 .. 2^32 - 1 blocks
// failed to launch ("invalid configuration argument") and from 2^32 on the cast to unsigned
// wrapped: the kernel silently ran only the first (blocks mod 2^32) blocks' queries.  The engine
// (nac_fast/ops/hamming_cuda.py: 128 filter lanes; retrieval outputs of >= 520 bytes per query)
// never comes near; this error names the limit for direct calls.
dim3 lane_grid(int64_t Q, int64_t S, int64_t lanes, const char* op) {
  const int64_t blocks = (Q + lanes - 1) / lanes;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), op, ": ", Q,
              " queries in blocks of ", lanes, " lanes need ", blocks,
              " blocks, more than the grid's 2^31 - 1: use more lanes or fewer queries per call");
  return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(S));
}

// Pass P on the current stream: blocks of `lanes` threads over (query blocks, slices).
template <class P>
void launch_retrieval(const RetrievalArgs& a, int64_t S, int64_t lanes, bool multi,
                      const char* op) {
  if (a.Q == 0 || S == 0) return;
  const int64_t bytes = P::smem_bytes(a.NB, lanes);
  auto stream = at::cuda::getCurrentCUDAStream();
  with_max_words(a.W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    auto kernel = multi ? retrieval_kernel<P, M, true> : retrieval_kernel<P, M, false>;
    check_block(kernel, lanes, op);
    set_smem(kernel, bytes, lanes, op);
    kernel<<<lane_grid(a.Q, S, lanes, op), static_cast<unsigned>(lanes), bytes, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor lanes_cdist_cuda(const at::Tensor& q, const at::Tensor& g) {
  auto out = cdist_out(q, g, kCUDA);
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t Q = q.size(0), G = g.size(0);
  const int W = static_cast<int>(q.size(1));
  if (Q == 0 || G == 0) return out;
  const dim3 grid(static_cast<unsigned>((G + kCdistThreads - 1) / kCdistThreads),
                  static_cast<unsigned>(std::min<int64_t>(Q, 65535)));
  auto stream = at::cuda::getCurrentCUDAStream();
  with_max_words(W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    cdist_kernel<M><<<grid, kCdistThreads, 0, stream>>>(
        q.data_ptr<int64_t>(), g.data_ptr<int64_t>(), out.data_ptr<int32_t>(), Q, G, W);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> lanes_filter_cuda(const at::Tensor& q, const at::Tensor& g,
                                                     const at::Tensor& t, int64_t L, int64_t CA,
                                                     int64_t KB, int64_t lanes) {
  FilterCall c = filter_call(q, g, t, L, CA, KB, lanes, kCUDA);
  c10::cuda::CUDAGuard guard(q.device());
  if (c.a.Q == 0 || c.a.S == 0) return {c.keys, c.na};
  auto stream = at::cuda::getCurrentCUDAStream();
  with_max_words(c.a.W, [&](auto m) {
    constexpr int M = decltype(m)::value;
    check_block(filter_kernel<M>, lanes, "hamming_lanes_filter");
    filter_kernel<M><<<lane_grid(c.a.Q, c.a.S, lanes, "hamming_lanes_filter"),
                       static_cast<unsigned>(lanes), 0, stream>>>(c.a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {c.keys, c.na};
}

at::Tensor lanes_ap_hist_cuda(const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql,
                              const at::Tensor& gl, int64_t L, int64_t lanes) {
  HistCall c = hist_call(q, g, ql, gl, L, lanes, kCUDA);
  c10::cuda::CUDAGuard guard(q.device());
  launch_retrieval<HistPass>(c.a, c.S, lanes, ql.dim() == 2, "hamming_lanes_ap_hist");
  return c.hist;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lanes_ap_rank_cuda(
    const at::Tensor& q, const at::Tensor& g, const at::Tensor& ql, const at::Tensor& gl,
    const at::Tensor& start, const at::Tensor& cuts, int64_t L, int64_t lanes) {
  RankCall c = rank_call(q, g, ql, gl, start, cuts, L, lanes, kCUDA);
  c10::cuda::CUDAGuard guard(q.device());
  launch_retrieval<RankPass>(c.a, c.S, lanes, ql.dim() == 2, "hamming_lanes_ap_rank");
  return {c.psum, c.cps, c.chit};
}

}  // namespace

TORCH_LIBRARY_IMPL(nac_fast, CUDA, m) {
  m.impl("hamming_lanes_cdist", &lanes_cdist_cuda);
  m.impl("hamming_lanes_filter", &lanes_filter_cuda);
  m.impl("hamming_lanes_ap_hist", &lanes_ap_hist_cuda);
  m.impl("hamming_lanes_ap_rank", &lanes_ap_rank_cuda);
}
