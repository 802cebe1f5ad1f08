// nac_fast::nac_noise(Tensor like, Tensor seed, float p) -> Tensor
//
// The NAC channel noise m (docs/math.md [M:channel]), drawn from a seed with the counter-based
// Philox4x32-10 of docs/math.md [M:philox] (nac_math.h): element e of the flattened output is
// noise_sign(seed, e, p).  Output: like's shape, dtype and device.  `seed` is a one-element int64
// tensor on like's device (drawn by torch.randint, so torch.manual_seed reproduces the noise and
// a GPU caller never syncs with the host to read it).  The CPU implementation is here, the CUDA
// one in nac_cuda.cu, the Triton one in kernels/nac_noise_triton.py and the torch reference in
// nac_fast/ops/reference.py; all four give bit-identical noise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "nac_checks.h"
#include "nac_math.h"

namespace {

at::Tensor nac_noise_cpu(const at::Tensor& like, const at::Tensor& seed, double p) {
  nac::check_noise_args(like, seed, p);
  const uint64_t s = static_cast<uint64_t>(seed.item<int64_t>());
  const float pf = static_cast<float>(p);
  at::Tensor out = at::empty(like.sizes(), like.options().dtype(at::kFloat)
                                               .memory_format(at::MemoryFormat::Contiguous));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) o[i] = nac::noise_sign(s, static_cast<uint64_t>(i), pf);
  });
  return like.scalar_type() == at::kFloat ? out : out.to(like.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nac_fast, m) {
  m.def("nac_noise(Tensor like, Tensor seed, float p) -> Tensor");
}

TORCH_LIBRARY_IMPL(nac_fast, CPU, m) {
  m.impl("nac_noise", &nac_noise_cpu);
}
