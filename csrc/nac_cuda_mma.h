// Interface between nac_cuda.cu (the op: tensors, plan, finish and rows kernels) and
// nac_cuda_mma.cu (the bf16/fp16 matrix kernels on tensor cores).  Plain pointers and a stream:
// nac_cuda_mma.cu includes no ATen, so its host side compiles in seconds (build-time note in its
// header).  Both files include this one, so a signature change cannot link half-updated.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace nac_mma {

enum class Dtype { kBF16, kF16 };

// Rows per block: the resident operand (queries in the forward, keys in the keys' backward) and
// the streamed tile (keys / queries).  dpad: 32, 64, 128 or 256.
struct Tiles {
  int resident, stream;
};
Tiles tiles(int dpad);

// A row-major (rows, ld) operand of 16-bit values with ld % 8 == 0 and a 16-byte aligned base;
// columns [chunks * 8, dpad) read as zero (chunks = ceil(D / 8) ... dpad / 8).
struct Operand {
  const void* ptr;
  int64_t rows, ld;
  int chunks;
};

// Q2 = s log2(e) m tanh(a) and, when k != nullptr, K = tanh(a): (n, dpad) row-major, columns
// >= D zero.  a, noise: contiguous (n, D).
void prologue(Dtype dt, const void* a, const void* noise, void* q, void* k, int64_t n, int D,
              int dpad, float scale2, cudaStream_t stream);

// Forward partials per (query tile, key split): pm (log2 units), pl, and when grad
// pacc = sum_j exp2(S2_ij - pm) k_j, each at [split * n + row] (pacc: times D + column).
// self_offset >= 0: row i's own key, key self_offset + i, is left out (probability 0,
// docs/math.md [M:self-key]); -1: every key.
void fwd(Dtype dt, int dpad, Operand q, Operand k, float* pm, float* pl, float* pacc, int D,
         int64_t tiles_per_split, int nsplit, bool grad, int64_t self_offset,
         cudaStream_t stream);

// Resident blocks per SM of the forward / keys' backward kernel of (dtype, dpad) on the current
// device (cudaOccupancyMaxActiveBlocksPerMultiprocessor): what the host's split plan fills.
int fwd_blocks_per_sm(Dtype dt, int dpad);
int bwd_blocks_per_sm(Dtype dt, int dpad);

// Keys' gradient per (key tile, query split): pdk[split, key, :] = ln 2 sum_i g_i P_ij Q2_i with
// P_ij = exp2(S2_ij - log2(e) lse_i), lse natural log (the op's contract); P_ij = 0 for j =
// self_offset + i when self_offset >= 0 (the forward's own key left out).
void bwd_keys(Dtype dt, int dpad, Operand q, Operand k, const float* lse, const float* g,
              float* pdk, int D, int64_t tiles_per_split, int nsplit, int64_t self_offset,
              cudaStream_t stream);

}  // namespace nac_mma
