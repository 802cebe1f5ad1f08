"""Lower bounds on the time of the NAC losses' forward+backward on an H100 SXM or H200, from the
work our kernels must do (kernels/nac_triton.py, csrc/nac_cuda.cu) and the chip's ceilings.

    python bench/roofline.py                       # table for the benchmark shapes, both GPUs
    python bench/roofline.py --gpu H100 --ceilings datasheet --fp32 tf32x3

    from roofline import bound, pct_of_bound
    b = bound("inbatch", 8192, 8192, 128, "bfloat16", "NVIDIA H100 80GB HBM3")
    pct = pct_of_bound(b["bound_s"], measured_s)

Work counted (n query rows, N keys, D code bits; one "product" = one n x N x D matrix product,
2nND FLOPs):

  in-batch (keys = the batch's own codes, which get a gradient), 4 products:
      forward:  scores q k^T, and P k for the rows' gradient (same loop, flash-attention style);
      backward: scores again (from the saved logsumexp), and P^T q for the keys' gradient.
      exps: 2 nN (one per logit in each of the two score passes).
  queue (NAC-MQ: the queue is a constant, no keys' gradient), 2 products:
      forward: scores and P k; the backward has no pass over the keys at all (the rows' gradient
      was finished in the forward).  exps: nN.
      (keys_grad=True counts a queue whose keys want a gradient: 4 products, 2nN exps.)

Bytes: the fewest a kernel must move through HBM, each input read once and each output written
once: a, r, noise (n x D each), the keys when they are a separate tensor (N x D), the gradients of
a and r (n x D each; of the keys too when they get one), in the input dtype, plus the fp32 loss.
(The fused kernels re-read the keys once per 128-row query block; at these sizes the queue, 16 MiB
in bf16 at N = 65536, stays in the 50/60 MB L2, so the HBM floor is what counts.)

Rates:
  matrix    bf16: tensor cores.  fp32 with the kernels' default ("tf32x3", D <= 128): three tf32
            tensor-core products per product (the split-precision fp32 the kernels run);
            "ieee" (NAC_FAST_FP32_DOT=ieee, and every D > 128): FMA units, 128 lanes x 2 FLOP x
            SMs x clock; "tf32" (NAC_FAST_FP32_DOT=tf32): one tf32 tensor-core product;
            "bf16x6" (NAC_FAST_FP32_DOT=bf16x6): six bf16 tensor-core products per product (the
            three-part operand splits of kernels/nac_triton.py _dot6); "fp16x3" (in-batch): three
            fp16 tensor-core products (the two-part splits of _dot3h; fp16's rate is bf16's).
  exp       MUFU ex2: 16 per clock per SM x SMs x clock (exp2 is what the kernels call).
  memory    HBM bandwidth.
"measured" ceilings are the ones the device tool measured on this workplace's machines (bf16
matmul 8192^3 on random data; device-to-device copy, bytes read + written); where nothing was
measured (exp, fp32 FMA, tf32) the datasheet/computed peak is used and the source says so.

Overlap model: the three units work in parallel, so bound = max(matrix, exp, memory) time.  It is
optimistic (FlashAttention-3 on an H100 reaches ~75% of the matmul peak because the softmax exps
do not fully hide behind the products), which makes pct_of_bound a conservative score.
pct_of_bound = bound_time / measured_time * 100.
"""
from __future__ import annotations

import argparse
import re

# ---- the chips --------------------------------------------------------------------------------
# Datasheet values: NVIDIA H100 / H200 SXM datasheets (dense, no sparsity).  Measured values:
# bench/gpu_notes.md "Rates" (the device tool's H100 and H200 machines).
GPUS = {
    "H100": {
        "label": "H100 SXM5 80GB", "sms": 132, "clock_ghz": 1.98,
        "datasheet": {"bf16_tflops": 989.4, "tf32_tflops": 494.7, "fp32_tflops": 66.9,
                      "hbm_tbs": 3.35},
        "measured": {"bf16_tflops": 798.0, "hbm_tbs": 3.0},
    },
    "H200": {
        "label": "H200 SXM 141GB", "sms": 132, "clock_ghz": 1.98,
        "datasheet": {"bf16_tflops": 989.4, "tf32_tflops": 494.7, "fp32_tflops": 66.9,
                      "hbm_tbs": 4.8},
        "measured": {"bf16_tflops": 788.0, "hbm_tbs": 4.3},
    },
}
EX2_PER_CLK_PER_SM = 16
FMA_LANES_PER_SM = 128  # fp32 lanes; one FMA = 2 FLOPs
KINDS = ("inbatch", "queue")
FP32_MODES = ("ieee", "tf32", "tf32x3", "bf16x6", "fp16x3")
_DTYPES = {"bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
           "float32": ("float32", 4), "fp32": ("float32", 4)}

# The benchmark shapes of bench/gpu_suite.sh's bench stage: (kind, n, N)
BENCH_SHAPES = [("inbatch", n, n) for n in (1024, 4096, 8192, 16384)] + \
               [("queue", 8192, N) for N in (65536, 262144)]


def resolve_gpu(gpu_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100', 'NVIDIA H200' -> 'H200'; ValueError otherwise."""
    if not isinstance(gpu_name, str):
        raise TypeError(f"gpu_name must be a str, got {type(gpu_name).__name__}")
    name = gpu_name.upper()
    if re.search(r"H200", name):
        return "H200"
    if re.search(r"H100", name):
        if re.search(r"PCIE|NVL", name):
            raise ValueError(f"gpu_name {gpu_name!r}: only the H100 SXM (HBM3) and the H200 have "
                             "ceilings here (the PCIe/NVL parts have fewer SMs and clocks)")
        return "H100"
    raise ValueError(f"gpu_name {gpu_name!r}: no ceilings known (known: H100 SXM, H200)")


def known_gpu(gpu_name: str) -> bool:
    try:
        resolve_gpu(gpu_name)
        return True
    except (TypeError, ValueError):
        return False


def ceilings(gpu_name: str, which: str = "measured") -> dict:
    """Rates in units per second and where each comes from."""
    if which not in ("measured", "datasheet"):
        raise ValueError(f"ceilings must be 'measured' or 'datasheet', got {which!r}")
    g = GPUS[resolve_gpu(gpu_name)]
    sheet, meas = g["datasheet"], g["measured"]
    clock = g["clock_ghz"] * 1e9

    def pick(key):
        if which == "measured" and key in meas:
            return meas[key], "measured"
        return sheet[key], "datasheet"

    bf16, bf16_src = pick("bf16_tflops")
    hbm, hbm_src = pick("hbm_tbs")
    tf32, tf32_src = pick("tf32_tflops")
    return {
        "gpu": resolve_gpu(gpu_name), "label": g["label"], "sms": g["sms"],
        "clock_ghz": g["clock_ghz"],
        "bf16_flops": bf16 * 1e12, "bf16_source": bf16_src,
        "tf32_flops": tf32 * 1e12, "tf32_source": tf32_src,
        "fp32_fma_flops": FMA_LANES_PER_SM * 2 * g["sms"] * clock,
        "fp32_fma_source": "computed peak (128 lanes x 2 x SMs x clock)",
        "exp_per_s": EX2_PER_CLK_PER_SM * g["sms"] * clock,
        "exp_source": "computed peak (MUFU ex2 16/clk/SM x SMs x clock)",
        "hbm_bytes_per_s": hbm * 1e12, "hbm_source": hbm_src,
    }


def work(kind: str, n: int, N: int, D: int, dtype: str, *, keys_grad: bool | None = None) -> dict:
    """Matrix FLOPs, exps and bytes of one forward+backward of our algorithm (module docstring)."""
    if kind == "mq":
        kind = "queue"
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
    dname, b = _DTYPES[dtype]
    if keys_grad is None:
        keys_grad = kind == "inbatch"
    if kind == "inbatch" and not keys_grad:
        raise ValueError("in-batch keys always get a gradient (keys_grad must be True or None)")
    products = 4 if keys_grad else 2
    in_elems = 3 * n * D + (N * D if kind == "queue" else 0)            # a, r, noise (+ keys)
    out_elems = 2 * n * D + (N * D if kind == "queue" and keys_grad else 0)  # grads a, r (+ keys)
    return {"kind": kind, "n": n, "N": N, "D": D, "dtype": dname, "keys_grad": keys_grad,
            "products": products, "matrix_flops": products * 2 * n * N * D,
            "exps": (2 if keys_grad else 1) * n * N,
            "bytes": (in_elems + out_elems) * b + 4}


def bound(kind: str, n: int, N: int, D: int, dtype: str, gpu_name: str, *,
          fp32_mode: str = "tf32x3", ceilings_from: str = "measured",
          keys_grad: bool | None = None) -> dict:
    """The time floor of one forward+backward: max(matrix, exp, memory) time, with the work and
    the rates used.  fp32_mode applies to float32 inputs only ('tf32x3': the kernels' default at
    D <= 128; 'ieee': FMA units, their mode above; 'tf32'; 'bf16x6': six bf16 products;
    'fp16x3': three fp16 products)."""
    if fp32_mode not in FP32_MODES:
        raise ValueError(f"fp32_mode must be one of {FP32_MODES}, got {fp32_mode!r}")
    w = work(kind, n, N, D, dtype, keys_grad=keys_grad)
    c = ceilings(gpu_name, ceilings_from)
    if w["dtype"] == "bfloat16":
        unit, rate, flops = "bf16 tensor cores", c["bf16_flops"], w["matrix_flops"]
    elif fp32_mode == "ieee":
        unit, rate, flops = "fp32 FMA", c["fp32_fma_flops"], w["matrix_flops"]
    elif fp32_mode == "tf32":
        unit, rate, flops = "tf32 tensor cores", c["tf32_flops"], w["matrix_flops"]
    elif fp32_mode == "bf16x6":
        unit, rate, flops = "bf16x6 tensor cores", c["bf16_flops"], 6 * w["matrix_flops"]
    elif fp32_mode == "fp16x3":  # fp16's tensor-core rate is bf16's
        unit, rate, flops = "fp16x3 tensor cores", c["bf16_flops"], 3 * w["matrix_flops"]
    else:
        unit, rate, flops = "tf32x3 tensor cores", c["tf32_flops"], 3 * w["matrix_flops"]
    times = {"matrix_s": flops / rate, "exp_s": w["exps"] / c["exp_per_s"],
             "memory_s": w["bytes"] / c["hbm_bytes_per_s"]}
    limiter = max(times, key=times.get)[:-2]
    return {**w, "gpu": c["gpu"], "gpu_label": c["label"], "ceilings": ceilings_from,
            "fp32_mode": fp32_mode if w["dtype"] == "float32" else None,
            "matrix_unit": unit, "matrix_rate": rate, "matrix_flops_executed": flops,
            "exp_rate": c["exp_per_s"], "hbm_rate": c["hbm_bytes_per_s"], **times,
            "bound_s": max(times.values()), "limiter": limiter}


def pct_of_bound(bound_s: float, measured_s: float) -> float:
    """How close a measurement is to the floor: bound / measured x 100 (100 = at the floor)."""
    if not measured_s > 0:
        raise ValueError(f"measured_s must be > 0, got {measured_s!r}")
    return 100.0 * bound_s / measured_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="H100,H200", help="comma list of GPU names")
    ap.add_argument("--ceilings", default="measured", choices=("measured", "datasheet"))
    ap.add_argument("--fp32", default="tf32x3", choices=FP32_MODES, help="fp32 matrix mode")
    ap.add_argument("--D", type=int, default=128)
    args = ap.parse_args(argv)
    gpus = args.gpu.split(",")
    bad = [g for g in gpus if not known_gpu(g)]
    if bad:  # before any table line
        ap.error(f"--gpu: no ceilings known for {', '.join(repr(g) for g in bad)} (known: "
                 f"{', '.join(GPUS)}; the H100 is the SXM part, not PCIe/NVL)")
    if len({resolve_gpu(g) for g in gpus}) != len(gpus):  # its table would be printed twice
        ap.error(f"--gpu: a GPU is named twice in {args.gpu!r}")
    if args.D < 1:
        ap.error(f"--D must be >= 1, got {args.D}")
    print(f"{'gpu':5s} {'kind':8s} {'n':>6s} {'N':>7s} {'dtype':9s} {'GFLOP':>8s} {'Mexp':>7s} "
          f"{'MB':>6s} {'matrix us':>10s} {'exp us':>8s} {'mem us':>8s} {'bound us':>9s} limiter")
    for gpu in gpus:
        for kind, n, N in BENCH_SHAPES:
            for dtype in ("bfloat16", "float32"):
                b = bound(kind, n, N, args.D, dtype, gpu, fp32_mode=args.fp32,
                          ceilings_from=args.ceilings)
                print(f"{b['gpu']:5s} {kind:8s} {n:6d} {N:7d} {dtype:9s} "
                      f"{b['matrix_flops_executed'] / 1e9:8.1f} {b['exps'] / 1e6:7.0f} "
                      f"{b['bytes'] / 1e6:6.1f} {b['matrix_s'] * 1e6:10.1f} {b['exp_s'] * 1e6:8.1f} "
                      f"{b['memory_s'] * 1e6:8.1f} {b['bound_s'] * 1e6:9.1f} {b['limiter']}")
    c = ceilings(gpus[0], args.ceilings)
    print(f"\nrates ({args.ceilings}; {c['label']}): bf16 {c['bf16_flops'] / 1e12:.0f} TFLOP/s "
          f"({c['bf16_source']}), fp32 FMA {c['fp32_fma_flops'] / 1e12:.1f} TFLOP/s "
          f"({c['fp32_fma_source']}), tf32 {c['tf32_flops'] / 1e12:.0f} TFLOP/s "
          f"({c['tf32_source']}), exp {c['exp_per_s'] / 1e12:.2f} T/s ({c['exp_source']}), "
          f"HBM {c['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({c['hbm_source']})")


if __name__ == "__main__":
    main()
