// Python module of the compiled extension nac_fast._C.  Importing it runs the static
// TORCH_LIBRARY_FRAGMENT / TORCH_LIBRARY_IMPL registrations of every csrc/*.cpp (and *.cu) file,
// which is how the ops reach torch.ops.nac_fast.* (and so autograd and torch.compile).
#include <torch/extension.h>

static bool built_with_cuda() {
#ifdef NAC_FAST_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA kernels were compiled in");
}
