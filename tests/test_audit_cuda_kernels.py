"""GPU-only properties of the CUDA kernels that no CPU emulation exercises, checked on the source.

Block size vs the kernel as compiled (csrc/hamming_cuda.cu): the ops hamming_lanes_filter /
_ap_hist / _ap_rank accept 1 to 1024 lanes (check_lanes, and the CPU emulation runs any of them),
but the kernels keep a query's code in registers: ptxas gives filter_kernel<16> 72 registers per
thread and the retrieval kernels up to 128 (sm_90, `python bench/cuda_resources.py`), so a block
of more than 896 (512) threads cannot launch and the op died with CUDA's "too many resources
requested for launch".  Every launch whose block size is `lanes` must first check `lanes` against
the compiled kernel's cudaFuncAttributes::maxThreadsPerBlock (check_block), which turns that into
an error naming the limit.  No GPU here: the test reads the launches out of the source.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAMMING_CU = os.path.join(ROOT, "csrc", "hamming_cuda.cu")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import cuda_resources  # noqa: E402  (its top-level comma split of template argument lists)


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _function_bodies(src: str) -> dict:
    """{name: body} of the functions defined at namespace level (braces at depth 1 inside the
    anonymous namespace, or depth 0), found by brace matching on comment-free source."""
    out, depth, i = {}, 0, 0
    ns_depths = []
    while i < len(src):
        ch = src[i]
        if ch == "{":
            head = src[max(src.rfind(";", 0, i), src.rfind("}", 0, i)) + 1:i]
            if re.search(r"\bnamespace\b[^()]*$", head):
                ns_depths.append(depth)
                depth += 1
                i += 1
                continue
            m = re.search(r"\b(\w+)\s*\([^{}]*\)\s*(?:const\s*)?$", head)
            if m and depth == len(ns_depths):
                # a function body: match its braces
                d, j = 0, i
                while True:
                    if src[j] == "{":
                        d += 1
                    elif src[j] == "}":
                        d -= 1
                        if d == 0:
                            break
                    j += 1
                out[m.group(1)] = src[i:j + 1]
                i = j + 1
                continue
            depth += 1
        elif ch == "}":
            depth -= 1
            if ns_depths and ns_depths[-1] == depth:
                ns_depths.pop()
        i += 1
    return out


_LAUNCH = re.compile(r"([\w:<>]+)\s*<<<\s*(.*?)>>>", re.S)


def unchecked_lane_launches(src: str) -> list:
    """The launches of `src` whose block size is `lanes` with no check_block(<that kernel>, ...)
    before them in their function, as 'function: kernel'."""
    bodies = _function_bodies(_strip_comments(src))
    bad = []
    for fname, body in bodies.items():
        for m in _LAUNCH.finditer(body):
            kernel, cfg = m.group(1), cuda_resources._split_top(m.group(2))
            if len(cfg) < 2 or not re.search(r"\blanes\b", cfg[1]):
                continue
            before = body[:m.start()]
            if not re.search(r"\bcheck_block\s*\(\s*" + re.escape(kernel) + r"\s*,\s*lanes\b",
                             before):
                bad.append(f"{fname}: {kernel}")
    return bad


def test_lane_launches_are_found():
    """The parser sees the launches it must check (a parser that found none would pass)."""
    src = _strip_comments(open(HAMMING_CU).read())
    bodies = _function_bodies(src)
    launched = {m.group(1) for b in bodies.values() for m in _LAUNCH.finditer(b)}
    assert {"kernel", "filter_kernel<M>", "cdist_kernel<M>"} <= launched, launched
    assert unchecked_lane_launches(
        "namespace {\nvoid f(int64_t lanes) {\n  k<M><<<g, lanes, 0, s>>>(a);\n}\n}\n") == ["f: k<M>"]


def test_every_lanes_sized_launch_checks_the_compiled_block_limit():
    src = open(HAMMING_CU).read()
    assert unchecked_lane_launches(src) == []
    body = _function_bodies(_strip_comments(src)).get("check_block", "")
    assert "cudaFuncGetAttributes" in body and "maxThreadsPerBlock" in body, (
        "check_block must compare lanes with the compiled kernel's maxThreadsPerBlock")
