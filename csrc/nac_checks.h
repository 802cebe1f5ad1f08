// Argument checks of the nac_fast::nac_fwd / nac_bwd / nac_noise ops, shared by every kernel that
// registers them (nac_cpu.cpp, nac_noise.cpp, nac_cuda.cu), so a direct torch.ops call with a bad
// argument is a RuntimeError naming that argument ("nac_fast: lse must be ..."), never an
// out-of-bounds read or memory read as the wrong type.  User-facing ValueError/TypeError messages
// for the public functions live in nac_fast/ops/loss.py, which checks before it calls these ops.
//
// What every kernel may then assume:
//   device      every tensor argument is on a's device (CUDA: the same CUDA device, so the
//               kernels never get a host pointer or another GPU's pointer).
//   dtype       a, r, noise, keys: float16, bfloat16, float32 or float64 (r, noise and keys are
//               converted to the kernel's dtype, so they need not match a's); g: one of those,
//               converted to the accumulation dtype; lse and ga: exactly the accumulation dtype
//               (float64 for float64 a, float32 otherwise), since they are nac_fwd's own outputs
//               and a narrower copy would silently lose the softmax's precision.
//   shape       a (n, D) with n, D > 0; r and noise (n, D); keys (N, D) with N > 0; lse and g
//               (n,); ga (n, D) when need_a, else (n, D) or the empty (0,) that
//               nac_fwd(grad_rows=False) returns.
//   self_offset -1 (every key: the paper's) or o in [0, N - n] with N >= 2 (N = n without keys):
//               row i's own key, key o + i, is left out of its logsumexp (docs/math.md
//               [M:self-key]), so every row keeps at least one key (check_self_offset).
//   contiguity  NOT required: every kernel makes its operands contiguous explicitly (.contiguous()
//               after the dtype conversion; a no-op for contiguous inputs), so strided views are
//               read correctly.  These checks therefore say nothing about strides.
#pragma once

#include <ATen/ATen.h>

namespace nac {

// The accumulation dtype of the kernels for input dtype `t`.
inline at::ScalarType acc_scalar_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

inline bool supported_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

inline void check_float_input(const char* name, const at::Tensor& t) {
  TORCH_CHECK(supported_float(t.scalar_type()), "nac_fast: ", name,
              " must be float16, bfloat16, float32 or float64, got ", t.scalar_type());
}

inline void check_same_device(const char* name, const at::Tensor& t, const at::Tensor& a) {
  TORCH_CHECK(t.device() == a.device(), "nac_fast: ", name, " must be on a's device (",
              a.device(), "), got ", t.device());
}

// self_offset of nac_fwd / nac_bwd for n rows and N keys: -1, every key in each row's logsumexp;
// o >= 0, row i's own key (key o + i) left out, [M:self-key].  The n own keys must lie inside the
// N keys (o <= N - n, written so that no sum can overflow) and one other key must remain (N >= 2).
inline void check_self_offset(int64_t self_offset, int64_t n, int64_t N) {
  TORCH_CHECK(self_offset >= -1,
              "nac_fast: self_offset must be -1 (every key) or >= 0 (row i's own key is key "
              "self_offset + i, left out), got ", self_offset);
  if (self_offset < 0) return;
  TORCH_CHECK(self_offset <= N - n, "nac_fast: self_offset must lie in [0, N - n] = [0, ", N - n,
              "] (row i's own key is key self_offset + i; n = ", n, ", N = ", N, "), got ",
              self_offset);
  TORCH_CHECK(N >= 2, "nac_fast: self_offset >= 0 needs at least 2 keys (the row's own and one "
              "other), got N = ", N);
}

inline void check_fwd_args(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                           const c10::optional<at::Tensor>& keys, int64_t self_offset) {
  TORCH_CHECK(a.dim() == 2 && a.size(0) > 0 && a.size(1) > 0,
              "nac_fast: a must be a non-empty (n, D) matrix, got shape ", a.sizes());
  check_float_input("a", a);
  TORCH_CHECK(r.sizes() == a.sizes(), "nac_fast: r must have a's shape ", a.sizes(), ", got ",
              r.sizes());
  check_float_input("r", r);
  check_same_device("r", r, a);
  TORCH_CHECK(noise.sizes() == a.sizes(), "nac_fast: noise must have a's shape ", a.sizes(),
              ", got ", noise.sizes());
  check_float_input("noise", noise);
  check_same_device("noise", noise, a);
  if (keys.has_value()) {
    TORCH_CHECK(keys->dim() == 2 && keys->size(0) > 0 && keys->size(1) == a.size(1),
                "nac_fast: keys must be a non-empty (N, D) matrix with a's D = ", a.size(1),
                ", got shape ", keys->sizes());
    check_float_input("keys", *keys);
    check_same_device("keys", *keys, a);
  }
  check_self_offset(self_offset, a.size(0), keys.has_value() ? keys->size(0) : a.size(0));
}

inline void check_bwd_args(const at::Tensor& a, const at::Tensor& r, const at::Tensor& noise,
                           const c10::optional<at::Tensor>& keys, const at::Tensor& lse,
                           const at::Tensor& ga, const at::Tensor& g, bool need_a,
                           int64_t self_offset) {
  check_fwd_args(a, r, noise, keys, self_offset);
  const int64_t n = a.size(0), D = a.size(1);
  const at::ScalarType acc = acc_scalar_type(a.scalar_type());
  TORCH_CHECK(lse.dim() == 1 && lse.size(0) == n, "nac_fast: lse must be (n,) = (", n,
              ",), got shape ", lse.sizes());
  TORCH_CHECK(lse.scalar_type() == acc, "nac_fast: lse must have the accumulation dtype ", acc,
              " (as nac_fwd returns it for a of dtype ", a.scalar_type(), "), got ",
              lse.scalar_type());
  check_same_device("lse", lse, a);
  const bool ga_full = ga.dim() == 2 && ga.size(0) == n && ga.size(1) == D;
  if (need_a) {
    TORCH_CHECK(ga_full, "nac_fast: ga must be the (n, D) = (", n, ", ", D,
                ") row gradient returned by nac_fwd(grad_rows=True) when need_a, got shape ",
                ga.sizes());
  } else {
    TORCH_CHECK(ga_full || (ga.dim() == 1 && ga.size(0) == 0),
                "nac_fast: ga must be (n, D) = (", n, ", ", D, ") or empty (0,), got shape ",
                ga.sizes());
  }
  TORCH_CHECK(ga.scalar_type() == acc, "nac_fast: ga must have the accumulation dtype ", acc,
              " (as nac_fwd returns it for a of dtype ", a.scalar_type(), "), got ",
              ga.scalar_type());
  check_same_device("ga", ga, a);
  TORCH_CHECK(g.dim() == 1 && g.size(0) == n, "nac_fast: g must be (n,) = (", n,
              ",), got shape ", g.sizes());
  check_float_input("g", g);
  check_same_device("g", g, a);
}

inline void check_noise_args(const at::Tensor& like, const at::Tensor& seed, double p) {
  TORCH_CHECK(like.is_floating_point(), "nac_fast: nac_noise's like must be floating point, got ",
              like.scalar_type());
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong,
              "nac_fast: nac_noise's seed must be a one-element int64 tensor, got ",
              seed.scalar_type(), " of shape ", seed.sizes());
  TORCH_CHECK(seed.device() == like.device(), "nac_fast: nac_noise's seed must be on like's device (",
              like.device(), "), got ", seed.device());
  TORCH_CHECK(p > 0.0 && p < 0.5, "nac_fast: nac_noise's p must lie in (0, 0.5), got ", p);
}

}  // namespace nac
