"""Shared pytest set-up.

Triton kernels run on CPU tensors under the interpreter when no GPU is present; the variable must
be set before triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (make test: one worker per core) each worker computes on one thread, and the
# processes a test starts inherit it: two workers of two threads each on two cores ran slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test of over ~10 s on the 2-core machine (compile "
                            "checks, packaging and install modes, torchrun launches, the "
                            "reproduction grid, large interpreter shapes); `pytest -m 'not "
                            "slow'` is the fast tier")


@pytest.fixture(autouse=True)
def _triton_interpreter_stays_on():
    """A test or a module it imports that unsets TRITON_INTERPRET would turn every later Triton
    test into a silent skip (it happened once: tools/compile_check.py popped it at import)."""
    yield
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET was unset by this test"
