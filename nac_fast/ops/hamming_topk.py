"""The GPU Hamming engines' exact top-k: kernels/hamming_topk.py (plain PyTorch, shared by the
Triton and the CUDA engines), re-exported under its former name."""
from ..kernels.hamming_topk import (  # noqa: F401
    EMPTY_KEY,
    KEY_INDEX_MASK,
    KEY_SHIFT,
    kth_bound,
    kth_outright,
    outright_rows,
    smallest_keys,
    topk,
    topk_capacity,
    topk_direct,
    workspace_bytes,
)
