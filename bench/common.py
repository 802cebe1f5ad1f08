"""The bench scripts' one helper module: the CSV appender and output checks, quantiles, the row
fields every CSV carries, and the roofline bound of the NAC losses on an H100 SXM / H200
(docs/kernels.md "The benchmark scripts in detail")."""
from __future__ import annotations

import csv
import datetime as dt
import io
import os
import platform
import re
import socket
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from nac_fast._files import atomic_write, check_writable  # noqa: E402

# ---- CSV ----------------------------------------------------------------------------------------

def csv_problem(path):
    """Why the CSV `path` could not be appended to (not text, no header, a row wider than its
    header), or None."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    try:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            if not any(c.strip() for c in header):
                return "has no header line (an empty first line)"
            for row in reader:
                if len(row) > len(header):
                    return (f"line {reader.line_num} has {len(row)} values, the header "
                            f"{len(header)} (a damaged CSV)")
    except UnicodeDecodeError:
        return "is not a text CSV"
    except csv.Error as exc:
        return f"is not a readable CSV ({exc})"
    return None


def append_rows(path, rows, fields):
    """Append rows (dicts) to the CSV `path` with columns `fields`, all or nothing (docs/kernels.md
    "Benchmarks"; a damaged CSV: ValueError; another header: rewritten, old rows kept)."""
    if why := csv_problem(path):
        raise ValueError(f"CSV {path!r} {why}: not appending to it (repair it or give another "
                         "--csv)")
    header, old = [], []
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, newline="") as f:
            old = list(reader := csv.DictReader(f))
        header = list(reader.fieldnames or [])
    buf = io.StringIO(newline="")
    keep = b""  # the old file's bytes, when its header is the one written
    if header and header != list(fields):
        fields = list(fields) + [c for c in header if c not in fields]
        w = csv.DictWriter(buf, fieldnames=fields)
        w.writeheader()
        w.writerows(old)
    elif header:
        with open(path, "rb") as f:
            keep = f.read()
        if not keep.endswith(b"\n"):
            keep += b"\r\n"
    w = csv.DictWriter(buf, fieldnames=fields)
    if not header:
        w.writeheader()
    w.writerows(rows)
    text = buf.getvalue()
    atomic_write(os.path.realpath(path), lambda f: (f.write(keep), f.write(text.encode())))


def check_output_file(ap, flag: str, path: str, csv_file: bool = True) -> None:
    """ap.error (exit status 2) naming `flag` when the output file `path` could not be written
    (empty, a folder, not writable; a damaged CSV to append to, when `csv_file`)."""
    if not path:
        ap.error(f"{flag} is empty; give a file path")
    if os.path.isdir(path):
        ap.error(f"{flag} {path!r} is a folder; give a file path")
    check_writable(flag, path, error=ap.error)
    if csv_file and (why := csv_problem(path)):
        ap.error(f"{flag} {path!r} {why}")


def check_output_folder(ap, flag: str, path: str) -> None:
    """ap.error naming `flag` when no file could be written in the folder `path`."""
    if os.path.lexists(path) and not os.path.isdir(path):
        ap.error(f"{flag} {path!r} is not a folder")
    check_writable(flag, os.path.join(path, "x"), error=ap.error)


def write_text(path: str, text: str) -> None:
    """`text` to `path` whole or not at all (its folder made)."""
    atomic_write(path, lambda f: f.write(text), mode="w")


def check_least(ap, args, least: dict) -> None:
    """Usage errors (exit status 2) for the flags of `least` ({"--flag": least value}) below it."""
    for flag, lo in least.items():
        val = getattr(args, flag[2:].replace("-", "_"))
        if val < lo:
            ap.error(f"{flag} must be >= {lo}, got {val}")


def int_list(ap, flag: str, text: str, least: int = 0, unique: bool = False) -> list:
    """The comma list of integers `text` of `flag` ("": none); a usage error (exit status 2)
    naming the flag for a value below `least`, or given twice when `unique`."""
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: a comma list of integers, got {text!r}")
    if any(v < least for v in vals):
        ap.error(f"{flag}: values must be >= {least}, got {text!r}")
    if unique and len(set(vals)) != len(vals):
        ap.error(f"{flag}: a value is given twice in {text!r}")
    return vals


# ---- timing and row fields ----------------------------------------------------------------------

def quantiles(times):
    """(median, p20, p80) of >= 1 samples (statistics.quantiles: "exclusive" from 5 on)."""
    if not times:
        raise ValueError("no timing samples")
    if len(times) == 1:
        return times[0], times[0], times[0]
    q = statistics.quantiles(times, n=5, method="exclusive" if len(times) >= 5 else "inclusive")
    return statistics.median(times), q[0], q[3]


def commit() -> str:
    """NAC_FAST_COMMIT if set (the GPU machine gets a copy of the tree without .git), else git."""
    if os.environ.get("NAC_FAST_COMMIT"):
        return os.environ["NAC_FAST_COMMIT"]
    try:
        return subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name and core count."""
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name()
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), name)
    except OSError:
        pass
    return f"{name} x{os.cpu_count()}"


def run_fields(device: str) -> dict:
    """The columns every row of a run carries: timestamp, host, device, torch, triton, commit."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = ""
    return dict(timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                host=socket.gethostname(), device=device, torch=torch.__version__,
                triton=triton_version, commit=commit())


# ---- roofline bound ----------------------------------------------------------------------------
# per GPU (SXM parts): each rate as (datasheet, measured or None). Dense bf16 / tf32 tensor-core
# TFLOP/s and HBM TB/s; "measured" is the device tool's (docs/gpu.md "Rates": bf16 matmul 8192^3,
# device-to-device copy); bound() takes the measured one where there is one, else the datasheet's.
GPUS = {"H100": dict(label="H100 SXM5 80GB", sms=132, clock_ghz=1.98, bf16=(989.4, 798.0),
                     tf32=(494.7, None), hbm=(3.35, 3.0)),
        "H200": dict(label="H200 SXM 141GB", sms=132, clock_ghz=1.98, bf16=(989.4, 788.0),
                     tf32=(494.7, None), hbm=(4.8, 4.3))}
# fp32 FMA and exp rates: computed peaks, per clock per SM 128 lanes x 2 (one FMA: 2 FLOPs) and
# MUFU ex2's 16 exps
_PER_CLOCK_SM = {"fp32_fma": 128 * 2, "exp": 16}
KINDS = ("inbatch", "queue")
# fp32 mode (or "bfloat16") -> (matrix unit, its rate, products run per product); fp16's
# tensor-core rate is bf16's
_MATRIX_UNITS = {"bfloat16": ("bf16 tensor cores", "bf16", 1), "ieee": ("fp32 FMA", "fp32_fma", 1),
                 "tf32": ("tf32 tensor cores", "tf32", 1),
                 "tf32x3": ("tf32x3 tensor cores", "tf32", 3),
                 "bf16x6": ("bf16x6 tensor cores", "bf16", 6),
                 "fp16x3": ("fp16x3 tensor cores", "bf16", 3)}
FP32_MODES = tuple(_MATRIX_UNITS)[1:]
_DTYPES = {"bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
           "float32": ("float32", 4), "fp32": ("float32", 4)}


def resolve_gpu(gpu_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA H200' -> 'H200'; ValueError otherwise."""
    if not isinstance(gpu_name, str):
        raise TypeError(f"gpu_name must be a str, got {type(gpu_name).__name__}")
    name = gpu_name.upper()
    if "H200" in name:
        return "H200"
    if "H100" in name:
        if re.search(r"PCIE|NVL", name):
            raise ValueError(f"gpu_name {gpu_name!r}: only the H100 SXM (HBM3) and the H200 have "
                             "ceilings here (the PCIe/NVL parts have fewer SMs and clocks)")
        return "H100"
    raise ValueError(f"gpu_name {gpu_name!r}: no ceilings known (known: H100 SXM, H200)")


def known_gpu(gpu_name: str) -> bool:
    try:
        return bool(resolve_gpu(gpu_name))
    except (TypeError, ValueError):
        return False


def bound(kind: str, n: int, N: int, D: int, dtype: str, gpu_name: str, *,
          fp32_mode: str = "tf32x3", keys_grad: bool | None = None) -> dict:
    """The time floor of one forward+backward of our algorithm: max(matrix, exp, memory) time,
    with the work (matrix FLOPs, exps, bytes) and the rates used.  fp32_mode applies to float32
    inputs only (FP32_MODES)."""
    kind = "queue" if kind == "mq" else kind
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} (or 'mq'), got {kind!r}")
    for name, v in (("n", n), ("N", N), ("D", D)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if kind == "inbatch" and N != n:
        raise ValueError(f"in-batch keys are the batch's own codes: N must equal n, got n={n}, "
                         f"N={N}")
    if fp32_mode not in FP32_MODES:
        raise ValueError(f"fp32_mode must be one of {FP32_MODES}, got {fp32_mode!r}")
    dname, b = _DTYPES[dtype]
    keys_grad = kind == "inbatch" if keys_grad is None else keys_grad
    if kind == "inbatch" and not keys_grad:
        raise ValueError("in-batch keys always get a gradient (keys_grad must be True or None)")
    products = 4 if keys_grad else 2
    in_elems = 3 * n * D + (N * D if kind == "queue" else 0)            # a, r, noise (+ keys)
    out_elems = 2 * n * D + (N * D if kind == "queue" and keys_grad else 0)  # grads a, r (+ keys)
    w = {"kind": kind, "n": n, "N": N, "D": D, "dtype": dname, "keys_grad": keys_grad,
         "products": products, "matrix_flops": products * 2 * n * N * D,
         "exps": (2 if keys_grad else 1) * n * N, "bytes": (in_elems + out_elems) * b + 4}
    g = GPUS[gpu := resolve_gpu(gpu_name)]  # rates per second: measured, else the datasheet's
    c = {key: (g[key][1] or g[key][0]) * 1e12 for key in ("bf16", "tf32", "hbm")}
    c.update({key: per * g["sms"] * g["clock_ghz"] * 1e9 for key, per in _PER_CLOCK_SM.items()})
    unit, key, times_run = _MATRIX_UNITS["bfloat16" if dname == "bfloat16" else fp32_mode]
    rate, flops = c[key], times_run * w["matrix_flops"]
    times = {"matrix_s": flops / rate, "exp_s": w["exps"] / c["exp"],
             "memory_s": w["bytes"] / c["hbm"]}
    return {**w, "gpu": gpu, "gpu_label": g["label"],
            "fp32_mode": fp32_mode if dname == "float32" else None,
            "matrix_unit": unit, "matrix_rate": rate, "matrix_flops_executed": flops,
            "exp_rate": c["exp"], "hbm_rate": c["hbm"], **times,
            "bound_s": max(times.values()), "limiter": max(times, key=times.get)[:-2]}
