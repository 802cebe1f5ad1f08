"""Integer widths of the CUDA kernels at the largest sizes their host code accepts, checked on the
source (no GPU here: the kernels cannot run; tests/test_audit_cuda_kernels.py does the same).

The Triton kernels twice wrapped an int32 at sizes near 2^31 (a split end `s*L + L`, a row offset
`row * stride`; kernels/nac_triton.py MAX_ROWS / MAX_ROW_STRIDE, tests/test_audit_limits.py).
The CUDA kernels compute those in int64 (the guards below keep it so); what wrapped there was a
grid dimension:

  - csrc/hamming_cuda.cu lane_grid: gridDim.x = ceil(Q / lanes) queries' blocks, cast to unsigned
    with no bound on Q.  The ops hamming_lanes_filter / _ap_hist / _ap_rank accept lanes = 1 and
    any number of queries; the filter needs ~24 bytes per query (codes, bound, one slot, count),
    so 2^32 + 1 one-word queries fit in ~96 GiB of an H200, and the launch ran one block: the
    other queries kept their EMPTY keys, no error.  (2^31 .. 2^32 - 1 blocks failed to launch
    with CUDA's "invalid configuration argument".)  Now a TORCH_CHECK names the limit.
"""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
HAMMING_CU = os.path.join(CSRC, "hamming_cuda.cu")

INT32_MAX = r"(?:std::numeric_limits<int32_t>::max\(\)|INT32_MAX|2147483647|\(int64_t\{1\} << 31\) - 1)"


def _src(path: str) -> str:
    with open(path) as f:
        src = f.read()
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _body(src: str, name: str) -> str:
    """The body (braces included) of the function `name` defined in `src`."""
    m = re.search(r"\b" + name + r"\s*\([^;{}]*\)\s*\{", src)
    assert m, f"{name} not found"
    i, d = m.end() - 1, 0
    for j in range(i, len(src)):
        d += {"{": 1, "}": -1}.get(src[j], 0)
        if d == 0:
            return src[i:j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


# --------------------------------------------------------------------------------------------
# The defect: the query blocks' grid dimension
# --------------------------------------------------------------------------------------------

def test_lane_grid_checks_the_query_blocks_against_grid_x_limit():
    body = _body(_src(HAMMING_CU), "lane_grid")
    check = re.search(r"TORCH_CHECK\(\s*(\w+)\s*<=\s*" + INT32_MAX, body)
    assert check, ("lane_grid must check the query blocks (ceil(Q / lanes), gridDim.x) against "
                   "2^31 - 1 before the unsigned cast: lanes = 1 with 2^32 + 1 queries (96 GiB) "
                   "wrapped to one block")
    var = check.group(1)
    assert re.search(r"\b" + var + r"\s*=\s*\(\s*Q\s*\+\s*lanes\s*-\s*1\s*\)\s*/\s*lanes", body), \
        f"the checked {var} must be the block count ceil(Q / lanes)"
    grid = re.search(r"dim3\(\s*static_cast<unsigned>\((.*?)\)\s*,", body, re.S)
    assert grid and grid.group(1).strip() == var, "gridDim.x must be the checked block count"
    assert check.start() < grid.start(), "the check must come before the cast"


def test_every_launch_over_queries_goes_through_lane_grid_and_cdist_caps_grid_y():
    """No other grid is built from the (unbounded) query count: the lane kernels take
    lane_grid(...); cdist's x is the gallery (< 2^31 rows: <= 2^23 blocks of 256) and its y
    min(Q, 65535), a grid-stride loop over the queries."""
    src = _src(HAMMING_CU)
    launches = re.findall(r"<<<\s*(.*?)\s*,", src, re.S)
    assert launches, "no launch found"
    for grid in launches:
        assert grid.startswith("lane_grid(") or grid == "grid", grid
    cdist = _body(src, "lanes_cdist_cuda")
    assert re.search(r"std::min<int64_t>\(\s*Q\s*,\s*65535\s*\)", cdist)
    assert re.search(r"\(\s*G\s*\+\s*kCdistThreads\s*-\s*1\s*\)\s*/\s*kCdistThreads", cdist)
    calls = re.findall(r"<<<\s*lane_grid\(([^()]*)\)", src)
    assert len(calls) == 2, calls  # the retrieval passes' launch and the filter's
    for call in calls:  # (Q, S, lanes, op): the error names the op
        assert len([a for a in call.split(",") if a.strip()]) == 4, call


# --------------------------------------------------------------------------------------------
# Guards: the Triton defects' expressions stay int64 in the CUDA kernels
# --------------------------------------------------------------------------------------------

# Split / slice bounds and tile row bases: the int32 `s*L + L` and `row * stride` of the Triton
# kernels.  In the CUDA sources each is int64_t (a 32-bit type here would wrap within a few tiles
# of 2^31 rows, as Triton's did).
BOUNDS = {
    "nac_cuda.cu": ("i0", "j0", "jstart", "jend", "istart", "iend", "row"),
    "nac_cuda_mma.cu": ("row0", "key0", "sp", "jstart", "jend", "istart", "iend", "ntiles",
                        "j0", "it", "row", "r_lo", "r_hi", "total", "src"),
    "hamming_lanes.h": ("begin", "end", "c0", "c1", "gi", "at", "key", "na", "nb"),
}
NARROW = r"(?:int|unsigned|unsigned int|int32_t|uint32_t|long|auto)"


def test_split_bounds_and_row_bases_are_int64():
    for name, idents in BOUNDS.items():
        src = _src(os.path.join(CSRC, name))
        for ident in idents:
            wide = re.findall(r"\bint64_t\s+(?:[\w\s,=+*/()<>:.\-?]*?,\s*)?" + ident + r"\b\s*[=;,]",
                              src)
            assert wide, f"{name}: {ident} is not declared int64_t"
            narrow = re.findall(r"(?<![\w:])(?:const\s+)?" + NARROW + r"\s+" + ident + r"\s*[=;,]",
                                src)
            assert not narrow, f"{name}: {ident} declared with a 32-bit type: {narrow}"


def test_kernel_row_indices_start_in_64_bits():
    """blockIdx.x * blockDim.x is unsigned int: every product with blockIdx.x / gridDim.x is widened
    first (int64_t(blockIdx.x) * ..., blockIdx.x * int64_t(...) / static_cast<int64_t>(...))."""
    wide = r"(?:int64_t\(|\(int64_t\)|static_cast<int64_t>\()"
    for name in ("nac_cuda.cu", "nac_cuda_mma.cu", "hamming_cuda.cu"):
        src = _src(os.path.join(CSRC, name))
        products = 0
        for m in re.finditer(r"(\S*)\s*\b(blockIdx|gridDim)\.x\)?\s*\*\s*(\S+)", src):
            products += 1
            left, right = m.group(1), m.group(3)
            assert left.endswith(("int64_t(", "(int64_t)")) or re.match(wide, right), \
                f"{name}: 32-bit product {m.group(0)!r}"
        assert not re.search(r"\*\s*(blockIdx|gridDim)\.x", src), name
        assert products, name
