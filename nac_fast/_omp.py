"""Run a command-line entry point with OpenMP threads that sleep while they wait.

libgomp's default wait policy spins: a thread that reaches a barrier first busy-waits for the
others.  On a machine whose cores are shared with other work (the development machine runs at a
load average of 15-25 on 2 cores), the spinning thread takes the time slice the late thread
needs, and `python -m nac_fast.eval`'s feature extraction ran at 232 images/s with 2 threads
against 1,161 with OMP_WAIT_POLICY=PASSIVE (and 825 with 1 thread), bench/results/eval_cpu.md.
The policy is read once, when torch loads libgomp, so an entry point that finds it unset
re-executes itself with it set (``NAC_FAST_OMP_REEXEC=0`` turns this off; an explicit
OMP_WAIT_POLICY is always kept)."""
from __future__ import annotations

import os
import sys


def passive_openmp(module: str) -> None:
    """Re-exec ``python -m module ARGS`` with OMP_WAIT_POLICY=PASSIVE unless it is set."""
    if "OMP_WAIT_POLICY" in os.environ or os.environ.get("NAC_FAST_OMP_REEXEC") == "0":
        return
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module] + sys.argv[1:], env)
