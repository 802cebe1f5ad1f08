"""pytest-benchmark suite of the NAC losses (forward+backward), per backend, at the paper shapes.

    pytest bench/test_bench_loss.py --benchmark-only [--benchmark-json out.json]

Timing only: nothing here asserts a duration (bench_loss.py writes the CSV and the ratios).
Kept out of tests/ so CI never runs timed tests.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nac_fast  # noqa: E402
from bench_loss import make_step  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [("inbatch", 1000, 1000), ("inbatch", 2048, 2048), ("inbatch", 4096, 4096),
         ("mq", 512, 16384), ("mq", 512, 65536), ("mq", 512, 262144)]


@pytest.mark.parametrize("backend", nac_fast.available_backends(DEVICE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,n,N", CASES, ids=[f"{k}-{n}x{N}" for k, n, N in CASES])
def test_loss_fwd_bwd(benchmark, backend, dtype, kind, n, N):
    step = make_step(kind, n, N, 128, dtype, DEVICE, backend)
    if DEVICE == "cuda":
        def run():
            step()
            torch.cuda.synchronize()
    else:
        run = step
    benchmark.group = f"{kind}-{n}x{N}-{str(dtype)[6:]}"
    benchmark.pedantic(run, warmup_rounds=1, rounds=5, iterations=1)
