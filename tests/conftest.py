"""Shared pytest set-up.

Triton kernels run on CPU tensors under the interpreter when no GPU is present; the variable must
be set before triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
