"""The fused CPU op's extra peak memory, as process RSS, against the eager reference.

Issue item: in-batch n = N = 4096, D = 128, fp32, forward+backward, the `cpu` backend's extra peak
RSS must be at most 1/20 of the reference's.  The measurement (from bench/cpu_memory.py, since
removed: `git show f5f4164:bench/cpu_memory.py`): a fresh process per case (this file run as a
script); a warm-up step of every backend at max(256, 128 x threads) rows, so one-time set-up
(OpenMP pool, thread stacks, MKL, autograd) is not counted; malloc_trim(0), so the step cannot
draw on free heap the warm-up left (7.2 MiB after a 256-row warm-up, 3.9 MiB after a 1024-row
one); the RSS high-water mark reset (/proc/self/clear_refs); extra = VmHWM - VmRSS before the
step.  Here one process per backend, both at once (each measures its own RSS, so running them side by side
changes nothing but the wall time).  Threads are pinned to 2, the configuration of the issue: the
fused op's per-worker buffers (tiles, MKL's GEMM packing) grow with the thread count.  The
measured margins (and the figures before the memory work, which failed this test) are in
bench/results/notes.md.
"""
import gc
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import nac_fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:  # no fallback: a stale high-water mark would give wrong figures
        raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs, "
                           f"Linux >= 4.0 needed): {e}") from e


def _trim_heap() -> None:
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        raise RuntimeError("glibc's malloc_trim is not available: the measurement needs glibc")
    libc.malloc_trim(0)


def default_warmup_n(threads: int) -> int:
    return max(256, 128 * threads)


def measure_once(backend: str, n: int, D: int, dtype: str, threads: int, warmup_n: int,
                 warmup_backends) -> dict:
    """The child process's work: baseline RSS and extra peak RSS of one step, in bytes."""
    import torch
    import nac_fast

    torch.set_num_threads(threads)
    dt_ = getattr(torch, dtype)

    def inputs(rows, seed):
        g = torch.Generator().manual_seed(seed)
        a = (torch.randn(rows, D, generator=g) * 1.5).to(dt_).requires_grad_()
        r = torch.randn(rows, D, generator=g).to(dt_).requires_grad_()
        noise = nac_fast.draw_noise((rows, D), 0.1, generator=g).to(dt_)
        return a, r, noise

    for b in warmup_backends if warmup_n > 0 else ():
        wa, wr, wnoise = inputs(warmup_n, 1)
        nac_fast.nac_loss(wa, wr, 0.1, noise=wnoise, backend=b).backward()
        del wa, wr, wnoise
    a, r, noise = inputs(n, n)
    gc.collect()
    _trim_heap()
    _reset_hwm()
    base = _status_kib("VmRSS")
    nac_fast.nac_loss(a, r, 0.1, noise=noise, backend=backend).backward()
    peak = _status_kib("VmHWM")
    if a.grad is None or r.grad is None:
        raise RuntimeError("the step left no gradient")
    return {"baseline": base * 1024, "extra": (peak - base) * 1024,
            "input_checks": bool(nac_fast.ops.loss.CHECK_VALUES)}


def run_child(backend: str, n: int, D: int, dtype: str, threads: int, warmup_n: int,
              warmup_backends) -> dict:
    """One measurement in a fresh interpreter (this file as a script, same environment)."""
    cmd = [sys.executable, os.path.abspath(__file__), backend, str(n), str(D), dtype,
           str(threads), str(warmup_n), ",".join(warmup_backends)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"measurement process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


pytestmark = [
    pytest.mark.skipif("cpu" not in nac_fast.available_backends("cpu"),
                       reason="compiled extension (fused cpu backend) not built"),
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="RSS high-water mark reset needs Linux /proc"),
]


@pytest.mark.slow
def test_cpu_inbatch_extra_rss_at_most_a_twentieth_of_reference():
    n, D, threads = 4096, 128, 2
    warmup = default_warmup_n(threads)
    backends = ("cpu", "reference")
    with ThreadPoolExecutor(len(backends)) as pool:
        futs = {b: pool.submit(run_child, b, n, D, "float32", threads, warmup, backends)
                for b in backends}
        extra = {b: f.result()["extra"] for b, f in futs.items()}
    ratio = extra["cpu"] / extra["reference"]
    msg = f"cpu {extra['cpu'] / MIB:.2f} MiB, reference {extra['reference'] / MIB:.2f} MiB"
    # The measurement sees memory at all: a.grad and r.grad (4 MiB) are new for both, and the
    # reference holds at least one n x n fp32 logits matrix (64 MiB).
    assert extra["cpu"] >= 4 * MIB, msg
    assert extra["reference"] >= 64 * MIB, msg
    assert ratio <= 0.05, f"ratio {ratio:.4f} > 1/20: {msg}"


if __name__ == "__main__":  # run_child's process: backend n D dtype threads warmup_n warmup_backends
    sys.path.insert(0, ROOT)
    b, n_, d_, dt_, th, wn, wb = sys.argv[1:8]
    print(json.dumps(measure_once(b, int(n_), int(d_), dt_, int(th), int(wn), wb.split(","))))
