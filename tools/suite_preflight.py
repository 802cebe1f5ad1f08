"""The GPU suite's preflight (bench/gpu_suite.sh, before any stage), in one Python start:

    python tools/suite_preflight.py

prints three parts on stdout: the device's name as the results folder's (`cpu` in the suite's CPU
mode, NAC_FAST_SUITE_CPU=1), the versions line (the suite summary's first), and versions.json
(the versions of torch, CUDA, Triton, nvcc, the driver and the GPU, the commit from
NAC_FAST_COMMIT); the versions also go to stderr as one `== versions:` line.  Exit 1, saying so,
when torch sees no GPU outside CPU mode (docs/gpu.md "The suite's stages").
"""
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import torch


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        return ""


def main() -> int:
    cpu = os.environ.get("NAC_FAST_SUITE_CPU", "0") == "1"
    if not cpu and not torch.cuda.is_available():
        sys.exit("no GPU visible to torch (NAC_FAST_SUITE_CPU=1 runs the suite's CPU mode)")
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": os.environ.get("NAC_FAST_COMMIT") or "unknown",
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda or "none"}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as exc:  # reported, not fatal here: the build stage checks what it needs
        info["triton"] = f"not importable ({type(exc).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                    sms=p.multi_processor_count, gpu_memory_gib=round(p.total_memory / 2**30, 1))
    else:
        info["gpu"] = "none (CPU mode)"
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,power.limit",
                "--format=csv,noheader"]) if shutil.which("nvidia-smi") else ""
    info["driver"] = smi.split(",")[0].strip() if smi else "unknown"
    info["nvidia_smi"] = smi
    nvcc = shutil.which("nvcc")
    if nvcc is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        nvcc = "/usr/local/cuda/bin/nvcc"
    info["nvcc"] = (_run([nvcc, "--version"]).splitlines() or [""])[-1] if nvcc else "not found"
    info["cpus"] = os.cpu_count()
    print("== versions: " + "; ".join(f"{k} {v}" for k, v in info.items()), file=sys.stderr)
    print("cpu" if cpu else re.sub(r"[^A-Za-z0-9.-]+", "-", info["gpu"]).strip("-"))
    print("versions: gpu %s, driver %s, torch %s (CUDA %s), triton %s, %s, python %s, commit %s" % (
        info["gpu"], info["driver"], info["torch"], info["cuda_runtime"], info["triton"],
        info["nvcc"], info["python"], info["commit"]))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
