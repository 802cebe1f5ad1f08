"""Tensor helpers every layer may use, the Triton kernels (kernels/) included: a leaf that imports
nothing of nac_fast (tests/test_layering.py)."""
import torch


def eager_real(t: torch.Tensor) -> bool:
    """Whether a call on `t` runs eagerly on real data: a plain tensor (or Parameter), no
    torch.compile tracing, no dispatch mode (FakeTensorMode, ...).  Such calls take the fused ops'
    fast path (nac_fast/ops/nac.py `_FusedNAC`, the cached launch plans of kernels/launch.py);
    any other goes through the registered torch.library ops, which tracing understands."""
    try:
        if torch.compiler.is_compiling():  # first: dynamo folds it, and traces nothing after
            return False
    except AttributeError:  # torch < 2.3
        pass
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    return torch._C._len_torch_dispatch_stack() == 0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The losses' output and accumulation dtype for inputs of `dtype`, on every backend (the
    reference, nac_fast/ops/reference.py, re-exports it)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
