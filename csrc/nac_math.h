// Per-element math of the NAC losses, shared by the CPU kernel (nac_cpu.cpp) and the CUDA kernel
// (nac_cuda.cu) so that what CI runs on the CPU is the math the GPU runs.
//
// Notation (NAC_SPEC.md; paper eq. `optimization_objective`, `momentum_objective`):
//   z = tanh(a), z~ = m * z (m = +-1 channel noise), q = s * z~ with s = 1/2 log((1-p)/p)
//   loss_i = lse_i - log N - bern_i + l2 * ||z_i||^2
//   lse_i  = log sum_j exp(q_i . k_j)
//   bern_i = 1/2 sum_d [ z~_id r_id + log sig(r_id) + log sig(-r_id) ]
// Gradients of loss_i (P_ij = exp(q_i.k_j - lse_i), A_i = sum_j P_ij k_j):
//   d/dr_id  = sig(r_id) - (1 + z~_id)/2           (BCE against soft targets (1+z~)/2)
//   d/da_id  = [ m_id (s A_id - r_id/2) + 2 l2 z_id ] (1 - z_id^2)
//   d/dk_j   = sum_i P_ij q_i                          (times (1 - z_j^2) for the self keys z)
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define NAC_HD __host__ __device__ __forceinline__
#else
#define NAC_HD inline
#endif

namespace nac {

NAC_HD float tanh_(float x) { return tanhf(x); }
NAC_HD double tanh_(double x) { return tanh(x); }
NAC_HD float exp_(float x) { return expf(x); }
NAC_HD double exp_(double x) { return exp(x); }
NAC_HD float log1p_(float x) { return log1pf(x); }
NAC_HD double log1p_(double x) { return log1p(x); }
NAC_HD float abs_(float x) { return fabsf(x); }
NAC_HD double abs_(double x) { return fabs(x); }

// log sig(r) + log sig(-r) = -|r| - 2 log1p(exp(-|r|)): stable for any |r|.
template <typename T>
NAC_HD T log_sigmoid_pair(T r) {
  const T ar = abs_(r);
  return -ar - T(2) * log1p_(exp_(-ar));
}

// Numerically stable logistic sigmoid.
template <typename T>
NAC_HD T sigmoid(T r) {
  const T e = exp_(-abs_(r));
  return r >= T(0) ? T(1) / (T(1) + e) : e / (T(1) + e);
}

// One element's share of 2 * bern_i: z~ r + log sig(r) + log sig(-r).
template <typename T>
NAC_HD T bern2_elem(T zt, T r) {
  return zt * r + log_sigmoid_pair(r);
}

// d loss_i / d r_id.
template <typename T>
NAC_HD T grad_r_elem(T zt, T r) {
  return sigmoid(r) - T(0.5) * (T(1) + zt);
}

// d loss_i / d a_id given sA = s * A_id (the softmax-weighted mean key, times s).
template <typename T>
NAC_HD T grad_a_elem(T m, T z, T sA, T r, T l2) {
  return (m * (sA - T(0.5) * r) + T(2) * l2 * z) * (T(1) - z * z);
}

}  // namespace nac
