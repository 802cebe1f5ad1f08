"""Launch configurations of the Triton NAC kernels (kernels/nac_triton.py): the built-in tables
(CONFIGS, FUSED_CONFIGS; SELF_CONFIGS, SELF_FUSED_CONFIGS for the own key left out), the autotune candidates (CANDIDATES), the code-width and fp32-mode
helpers they are keyed by (block_d, fp32_precision, parts_of) and the shared-memory estimate.

A leaf: it imports nothing of nac_triton (tests/test_layering.py), so the tuned-table lookup
(kernels/tuning.py) reads it without the kernels, and nac_triton re-exports every name here
(nac_triton.CONFIGS, nac_triton.CANDIDATES, ... as before).  Read by the launchers, the tuned
tables, tools/compile_check.py and tools/autotune.py.
"""
from __future__ import annotations

import contextvars
import os
from typing import Optional

import torch

from .launch import Config, next_pow2



def _family(dtype: torch.dtype, D: Optional[int] = None) -> str:
    """The CONFIGS family: "16", "32", "64"; for fp32 at D in parts (16-bit part tiles), "32p"
    (bf16x6) or "32h" (fp16x3)."""
    parts = parts_of(dtype, D)[0] if D is not None else 0
    if parts:
        return "32p" if parts == 3 else "32h"
    return {torch.bfloat16: "16", torch.float16: "16", torch.float32: "32",
            torch.float64: "64"}[dtype]


# fp32 modes whose codes are 16-bit part tiles: (parts, their dtype)
PART_MODES = {"bf16x6": (3, torch.bfloat16), "fp16x3": (2, torch.float16)}


def parts_mode(dtype: torch.dtype, D: int) -> bool:
    """Whether fp32 products at code width D run on 16-bit part tiles (NAC_FAST_FP32_DOT=bf16x6
    or fp16x3, `parts_of`): the prologue's Q and K are then (parts, rows, D) 16-bit tensors
    (_parts3 / _parts2h), given keys are split by _parts_kernel (bf16x6), and the matrix kernels
    run the 16-bit tilings with six (three) products each."""
    return dtype == torch.float32 and fp32_precision(D) in PART_MODES


def parts_of(dtype: torch.dtype, D: int) -> tuple:
    """(parts, part dtype) of the codes' tiles in the fp32 mode at D: (3, bf16) for bf16x6, (2,
    fp16) for fp16x3, (0, None) otherwise."""
    if dtype != torch.float32:
        return 0, None
    return PART_MODES.get(fp32_precision(D), (0, None))


def block_d(D: int) -> int:
    return max(16, next_pow2(D))


# (kernel, dtype family, BLOCK_D) -> candidates, best first (the first whose shared-memory estimate
# fits the target wins).  fwd: BLOCK_M query rows per program, BLOCK_N keys per loop step;
# bwd_keys: BLOCK_N keys per program, BLOCK_M query rows per loop step.  Chosen with
# tools/compile_check.py (sm_80 and sm_90: shared memory, registers, spills); see its CSV.
_C = Config
CONFIGS = {
    # ---- bf16 / fp16: tensor cores (HGMMA on sm_90 where BLOCK_M >= 64), fp32 accumulators
    ("fwd", "16", 16): [_C(128, 64, 4, 3)], ("fwd", "16", 32): [_C(128, 64, 4, 3)],
    ("fwd", "16", 64): [_C(128, 64, 4, 3)], ("fwd", "16", 128): [_C(128, 64, 8, 2)],
    ("fwd", "16", 256): [_C(64, 64, 8, 2)], ("fwd", "16", 512): [_C(32, 32, 8, 2)],
    ("bwd_keys", "16", 16): [_C(64, 128, 4, 3)], ("bwd_keys", "16", 32): [_C(64, 128, 4, 3)],
    ("bwd_keys", "16", 64): [_C(64, 128, 4, 3)], ("bwd_keys", "16", 128): [_C(64, 128, 8, 2)],
    ("bwd_keys", "16", 256): [_C(64, 64, 8, 2)], ("bwd_keys", "16", 512): [_C(32, 32, 8, 2)],
    # ---- fp32, D <= 128: tf32x3 (TF32 splits in registers, three tensor-core products)
    ("fwd", "32", 16): [_C(64, 64, 8, 2)], ("fwd", "32", 32): [_C(64, 64, 8, 2)],
    ("fwd", "32", 64): [_C(32, 64, 8, 2)], ("fwd", "32", 128): [_C(32, 32, 8, 2)],
    ("bwd_keys", "32", 16): [_C(64, 64, 8, 2)], ("bwd_keys", "32", 32): [_C(64, 64, 8, 2)],
    ("bwd_keys", "32", 64): [_C(64, 32, 8, 2)], ("bwd_keys", "32", 128): [_C(64, 32, 8, 2)],
    # ---- fp32 in bf16x6 (NAC_FAST_FP32_DOT=bf16x6, D <= 128): three bf16 part tiles per
    # operand (3x a 16-bit tile's shared memory), so smaller tiles than the 16-bit paths'.  sm_90:
    # one-warpgroup HGMMA programs, two or more per SM; sm_80: 8 warps (mma.sync holds operand
    # fragments in registers: the 4-warp tiles spilled there).  tools/compile_check.py, precision
    # bf16x6; the suite's bench-quick stage times them, its autotune stage their alternatives
    # (CANDIDATES "float32:bf16x6").
    **{("fwd", "32p", bd): [_C(64, 32, 4, 2, (90,)), _C(32, 64, 8, 2)]
       for bd in (16, 32, 64, 128)},
    **{("bwd_keys", "32p", bd): [_C(32, 64, 4, 2, (90,)), _C(64, 32, 8, 2)]
       for bd in (16, 32, 64, 128)},
    # ---- fp32 in fp16x3 (in-batch; NAC_FAST_FP32_DOT=fp16x3, D <= 128): two fp16 part tiles
    # per operand, three products (tools/compile_check.py, precision fp16x3)
    **{("fwd", "32h", bd): [_C(64, 32, 4, 2, (90,)), _C(32, 64, 8, 2)]
       for bd in (16, 32, 64, 128)},
    **{("bwd_keys", "32h", bd): [_C(32, 64, 4, 2, (90,)), _C(64, 32, 8, 2)]
       for bd in (16, 32, 64, 128)},
    # ---- fp32, D > 128: exact FMA (every tf32x3 tiling spilled there)
    ("fwd", "32", 256): [_C(16, 16, 8, 2)], ("fwd", "32", 512): [_C(16, 16, 8, 2)],
    ("bwd_keys", "32", 256): [_C(32, 16, 8, 2)], ("bwd_keys", "32", 512): [_C(16, 16, 8, 2)],
    # ---- fp64: the correctness path (DMMA / FMA, fp64 throughout)
    ("fwd", "64", 16): [_C(32, 32, 8, 2)], ("fwd", "64", 32): [_C(32, 32, 8, 2)],
    ("fwd", "64", 64): [_C(16, 32, 8, 2)], ("fwd", "64", 128): [_C(32, 32, 8, 2)],
    ("fwd", "64", 256): [_C(16, 16, 8, 2)], ("fwd", "64", 512): [_C(16, 16, 8, 2)],
    ("bwd_keys", "64", 16): [_C(32, 32, 8, 2)], ("bwd_keys", "64", 32): [_C(32, 32, 8, 2)],
    ("bwd_keys", "64", 64): [_C(32, 32, 8, 2)], ("bwd_keys", "64", 128): [_C(16, 16, 8, 2)],
    ("bwd_keys", "64", 256): [_C(32, 32, 8, 2), _C(16, 16, 8, 2)],
    ("bwd_keys", "64", 512): [_C(16, 16, 8, 2)],
}
# The keys' backward with the rows' backward fused in (OUT_MODE 2, one split, self keys): the
# epilogue's extra tiles spilled in the bwd_keys configurations (sm_90, tools/compile_check.py:
# 24-196 B at D = 64/128).  Fewer keys per block here; None: no fused configuration without a
# spill was found, the rows' backward stays its own launch.
FUSED_CONFIGS = {
    ("16", 16): _C(64, 64, 8, 3), ("16", 32): _C(64, 64, 8, 3), ("16", 64): _C(64, 64, 8, 3),
    ("16", 128): _C(64, 64, 8, 2), ("16", 256): _C(32, 32, 8, 2), ("16", 512): None,
    # bf16x6: clean on sm_80 and sm_90 at every D (32 x 64 spilled 236-604 B at D = 128)
    **{("32p", bd): _C(64, 32, 8, 2) for bd in (16, 32, 64, 128)},
    **{("32h", bd): _C(64, 32, 8, 2) for bd in (16, 32, 64, 128)},
}
# The kernels that leave each row's own key out (SELF, docs/math.md [M:self-key]) hold a few more
# registers (the own key's compare and select, a max that may be -inf): where the tables above
# spilled with SELF (tools/compile_check.py, modes `<mode>-self`: 4 to 36 B, the configurations
# that ran at 246 to 255 registers without it), these take their place.  SELF launches read no
# tuned table (the autotune stage times the paper's kernels): CONFIGS with these entries in place.
SELF_CONFIGS = {
    ("fwd", "16", 64): [_C(128, 64, 8, 3)],           # 128 x 64, 4 warps: 36 B on sm_80
    ("fwd", "16", 256): [_C(64, 32, 8, 2)],           # 64 x 64, 8 warps: 12-20 B on sm_90
    ("fwd", "32p", 128): [_C(64, 32, 4, 2, (90,)), _C(32, 32, 8, 2)],  # 32 x 64 w8: 4 B, sm_80
    ("bwd_keys", "32p", 64): [_C(32, 64, 4, 2, (90,)), _C(32, 64, 8, 2)],  # 64 x 32 w8: 8 B
}
SELF_FUSED_CONFIGS = {("16", 64): _C(64, 64, 8, 2)}   # 64 x 64 x 3 stages: 16 B on sm_80
_INTERP = {"fwd": _C(32, 128), "bwd_keys": _C(32, 128)}  # wide numpy steps under the interpreter


def _waves(*configs: Config, waves=(1, 2)) -> list:
    return [_C(c.BLOCK_M, c.BLOCK_N, c.num_warps, c.num_stages, c.archs, w)
            for c in configs for w in waves]


# Autotune candidates (kernels/tuning.py, tools/autotune.py): (kernel, dtype, BLOCK_D) -> the
# configurations the autotune stage times, each with one and two waves of programs (Config.waves);
# a tuned table may name only these.  Each compiles for sm_80 and sm_90 (archs: where it fits)
# within shared memory, without spills and with tensor-core instructions, in every launch a plan
# makes of it (tools/compile_check.py, rows with source "candidate"); the built-in configuration
# is among them.  Grid searched and why each is here: docs/gpu.md "Autotune candidates".
H = (90,)  # candidates that spilled on sm_80 (mma.sync holds operand fragments in registers)
CANDIDATES = {
    ("fwd", "bfloat16", 128): _waves(
        _C(128, 64, 8, 2), _C(128, 64, 8, 3), _C(128, 128, 8, 2, H), _C(128, 128, 8, 3, H),
        _C(128, 128, 8, 4, H), _C(64, 128, 4, 2, H), _C(64, 128, 4, 3, H), _C(64, 128, 4, 4, H),
        _C(64, 128, 8, 2, H), _C(64, 128, 8, 3, H), _C(64, 64, 4, 2, H), _C(64, 64, 4, 3, H),
        _C(64, 64, 8, 2), _C(64, 64, 8, 3)),
    ("bwd_keys", "bfloat16", 128): _waves(
        _C(64, 128, 8, 2), _C(64, 128, 8, 3), _C(64, 128, 8, 4), _C(128, 64, 8, 2, H),
        _C(128, 64, 8, 3), _C(128, 64, 4, 2), _C(128, 64, 4, 3), _C(64, 64, 4, 2, H),
        _C(64, 64, 4, 3, H), _C(64, 64, 4, 4), _C(64, 64, 8, 2), _C(64, 64, 8, 3)),
    # fp32 (tf32x3, the default precision; candidates apply to it only): only 32-row tiles
    # keep the three products' splits in registers without spilling (HMMA, not HGMMA)
    ("fwd", "float32", 128): _waves(
        _C(32, 32, 8, 2), _C(32, 64, 8, 2), _C(32, 64, 8, 3)),
    ("bwd_keys", "float32", 128): _waves(
        _C(64, 32, 8, 2), _C(64, 32, 8, 3), _C(32, 32, 8, 2), _C(32, 32, 8, 3),
        _C(32, 32, 4, 3)),
    # fp32 in bf16x6 (NAC_FAST_FP32_DOT=bf16x6; kernels/tuning.py candidate_dtype): three bf16
    # part tiles per operand, so 32/64-row tiles; sm_90 one-warpgroup HGMMA programs and 8-warp
    # ones, sm_80 8 warps only (docs/gpu.md "fp32 in bf16x6")
    ("fwd", "float32:bf16x6", 128): _waves(
        _C(64, 32, 4, 2, H), _C(64, 32, 4, 3, H), _C(64, 64, 8, 2, H), _C(128, 32, 8, 2, H),
        _C(32, 64, 8, 2)),
    ("bwd_keys", "float32:bf16x6", 128): _waves(
        _C(32, 64, 4, 2, H), _C(32, 64, 4, 3, H), _C(32, 64, 8, 2, H), _C(64, 64, 8, 2, H),
        _C(64, 32, 8, 2)),
    # fp32 in fp16x3 (in-batch; kernels/tuning.py candidate_dtype): two fp16 part tiles per
    # operand and P's two parts in registers, so larger tiles than bf16x6's fit (sm_90: 134-200
    # registers at 64-row tiles; left out for spills: forward 64x128 w4 (300 B), keys' backward
    # 128x64 w8 (64 B), 64x128 w4 (436 B) and, under the device's Triton 3.6, 128x64 w4 (192 B);
    # forward 128x128 w8: over the shared memory estimate; docs/gpu.md "fp32 in fp16x3")
    ("fwd", "float32:fp16x3", 128): _waves(
        _C(64, 32, 4, 2, H), _C(64, 32, 4, 3, H), _C(64, 64, 8, 2, H), _C(128, 32, 8, 2, H),
        _C(32, 64, 8, 2), _C(64, 64, 4, 2, H), _C(64, 64, 4, 3, H), _C(128, 64, 8, 2, H),
        _C(128, 64, 8, 3, H), _C(64, 128, 8, 2, H)),
    ("bwd_keys", "float32:fp16x3", 128): _waves(
        _C(32, 64, 4, 2, H), _C(32, 64, 4, 3, H), _C(32, 64, 8, 2, H), _C(64, 64, 8, 2, H),
        _C(64, 32, 8, 2), _C(64, 64, 4, 2, H), _C(64, 64, 4, 3, H), _C(64, 128, 8, 2, H)),
}
TF32_MAX_D = 128  # fp32 above this runs exact FMA products (see CONFIGS)
# NAC_FAST_FP32_DOT's values (fp32_precision): the default first
FP32_PRECISIONS = ("tf32x3", "ieee", "tf32", "bf16x6", "fp16x3")


# The fp32 product mode of the plan being built, where the call decides it rather than the
# environment: (mode, over_env).  The forward sets the tuned table's choice (`call_fp32_mode`,
# NAC_FAST_FP32_DOT unset) and, with given keys, bf16x6 for fp16x3 (`fwd_plan`); the backward
# the mode its saved codes were made in (over_env: its parts are bf16x6's or fp16x3's whatever
# the environment says now).
_CALL_FP32: contextvars.ContextVar = contextvars.ContextVar("nac_fast_call_fp32", default=None)


def fp32_precision(D: int) -> str:
    """How fp32 products run at code width D: NAC_FAST_FP32_DOT = tf32x3, ieee, tf32, bf16x6 or
    fp16x3 (parts_mode); unset, the mode the call's plan was given (`call_fp32_mode`: the tuned
    table's choice), else tf32x3; above TF32_MAX_D always ieee."""
    call = _CALL_FP32.get()
    mode = os.environ.get("NAC_FAST_FP32_DOT")
    if call is not None and (mode is None or call[1]):
        mode = call[0]
    elif mode is None:
        mode = FP32_PRECISIONS[0]
    elif mode not in FP32_PRECISIONS:
        raise ValueError(f"NAC_FAST_FP32_DOT must be one of {', '.join(FP32_PRECISIONS)}, "
                         f"got {mode!r}")
    return mode if block_d(D) <= TF32_MAX_D else "ieee"


def smem_estimate(kernel: str, cfg: Config, dtype: torch.dtype, D: int) -> int:
    """Shared memory a configuration needs, in bytes: `num_stages` buffers of the streamed tile,
    plus the resident tile on the 16-bit and fp32 paths, which stage it in shared memory too (the
    fp64 products keep it in registers; the exact-fp32 ones at D = 16 took 512 B more than
    without it), plus 16 KB for the probability tiles and layout conversions; in bf16x6
    (parts_mode) three bf16 tiles for each and P's three parts (fp16x3: two fp16 ones).
    tests/test_compile_check.py checks that it bounds what Triton allocated in every
    configuration, each estimated under the fp32 mode it was planned in; the compile check holds
    the compiled figure against the limit."""
    es = torch.empty((), dtype=dtype).element_size()
    resident, streamed = ((cfg.BLOCK_M, cfg.BLOCK_N) if kernel == "fwd" else
                          (cfg.BLOCK_N, cfg.BLOCK_M))
    if dtype == torch.float64:
        resident = 0
    np_, _ = parts_of(dtype, D)
    if np_:  # the part tiles of each operand (2 bytes each), and P's parts
        return 2 * np_ * (block_d(D) * (resident + cfg.num_stages * streamed)
                          + cfg.BLOCK_M * cfg.BLOCK_N) + 16384
    return es * block_d(D) * (resident + cfg.num_stages * streamed) + 16384


def precision(dtype: torch.dtype, D: int) -> str:
    """The PRECISION constexpr of the matrix kernels for inputs of `dtype` at code width D: fp32's
    mode (`fp32_precision`), "ieee" for the other dtypes."""
    return fp32_precision(D) if dtype == torch.float32 else "ieee"
