// Argument checks of the nac_fast::nac_fwd / nac_bwd ops, shared by every kernel that registers
// them (nac_cpu.cpp, nac_cuda.cu).  User-facing messages with argument names live in
// nac_fast/loss.py; these guard direct torch.ops calls so bad shapes are a RuntimeError, never an
// out-of-bounds read.
#pragma once

#include <ATen/ATen.h>

namespace nac {

inline void check_fwd_args(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                           const c10::optional<at::Tensor>& keys) {
  TORCH_CHECK(a.dim() == 2 && a.size(0) > 0 && a.size(1) > 0,
              "nac_fast: a must be a non-empty (n, D) matrix");
  TORCH_CHECK(a.is_floating_point(), "nac_fast: a must be floating point");
  TORCH_CHECK(r.sizes() == a.sizes(), "nac_fast: r must have a's shape");
  TORCH_CHECK(noise.sizes() == a.sizes(), "nac_fast: noise must have a's shape");
  if (keys.has_value()) {
    TORCH_CHECK(keys->dim() == 2 && keys->size(0) > 0 && keys->size(1) == a.size(1),
                "nac_fast: keys must be a non-empty (N, D) matrix with a's D");
    TORCH_CHECK(keys->is_floating_point(), "nac_fast: keys must be floating point");
  }
}

inline void check_noise_args(const at::Tensor& like, const at::Tensor& seed, double p) {
  TORCH_CHECK(like.is_floating_point(), "nac_fast: nac_noise's like must be floating point");
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong,
              "nac_fast: nac_noise's seed must be a one-element int64 tensor");
  TORCH_CHECK(seed.device() == like.device(), "nac_fast: nac_noise's seed must be on like's device");
  TORCH_CHECK(p > 0.0 && p < 0.5, "nac_fast: nac_noise's p must lie in (0, 0.5)");
}

inline void check_bwd_args(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                           const c10::optional<at::Tensor>& keys, const at::Tensor& lse,
                           const at::Tensor& g) {
  check_fwd_args(a, r, noise, keys);
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == a.size(0), "nac_fast: lse must be (n,)");
  TORCH_CHECK(g.dim() == 1 && g.size(0) == a.size(0), "nac_fast: g must be (n,)");
}

}  // namespace nac
