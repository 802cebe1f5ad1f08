"""Per-kernel resources of the CUDA kernels (csrc/*.cu: nac_cuda.cu, nac_cuda_mma.cu,
hamming_cuda.cu) as ptxas reports them: registers, spills, static shared memory and stack frame,
plus the tensor-core instructions in the SASS (HMMA/HGMMA count), per target arch, with no GPU
needed.

    python tools/cuda_resources.py --csv /tmp/cuda_resources.csv [--archs 80,90] [--jobs 2]

(the committed figures are the `cuda:` rows of bench/results/compile_check.csv, which
tools/compile_check.py makes with this module)

Each (source, arch) is one device-only nvcc compile (-cubin: no host compile, no link) with the
flags and include paths of the real build (csrc/build_flags.py, which setup.py uses too) plus
-Xptxas -v, run as parallel nvcc processes; cuobjdump --dump-sass of each cubin gives the matrix
instructions per kernel.  Mangled names are demangled (cu++filt from the toolkit when present,
else libstdc++'s abi::__cxa_demangle) into a readable kernel name with its template arguments,
from which come the input dtype (bf16/fp16/fp32/fp64) and D (the DPAD template value).

Library use (tools/compile_check.py): cuda_resource_rows() -> rows, problems(rows) -> messages.
Importing this module has no side effects; cuda_resource_rows raises RuntimeError with the
reason when nvcc, cuobjdump or torch is missing, for the caller to turn into a skip.

The CLI prints the table, writes the CSV, prints each problem, and exits 1 when there is one.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import ctypes
import ctypes.util
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = tuple(sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu"))))

FIELDS = ("kernel", "arch", "dtype", "D", "registers", "spill_store_bytes", "spill_load_bytes",
          "smem_bytes", "stack_bytes", "mma_instr", "mma_count", "source", "compile_s")

# Static __shared__ memory per block: 48 KiB on every arch.  More needs dynamic shared memory and
# the cudaFuncAttributeMaxDynamicSharedMemorySize opt-in (sm_80: 163 KiB, sm_90: 227 KiB); the
# NAC kernels use static shared memory only (the tensor-core kernels: 17-39 KiB, checked by a
# static_assert too), so 48 KiB is the limit that applies.
STATIC_SMEM_LIMIT = {80: 48 * 1024, 86: 48 * 1024, 89: 48 * 1024, 90: 48 * 1024}
# Spills are a problem on the bf16/fp16 and fp32 instantiations; fp64 (tests, references) may
# spill.
NO_SPILL_DTYPES = ("bf16", "fp16", "fp32")
# The matrix kernels (the n x N products): a bf16/fp16 instantiation of one without a tensor-core
# instruction is a problem (the 16-bit path fell back to scalar FMAs).
MATRIX_KERNEL = re.compile(r"^(fwd|bwd_keys)\w*_kernel\b")
# The Hamming engine's kernels (csrc/hamming_cuda.cu: a query per thread, its code in registers):
# any spill or stack frame is a problem (the query's words went to local memory).
HAMMING_KERNEL = re.compile(r"^(cdist|filter|retrieval)_kernel<")
# Threads per block the host launches them with (csrc/hamming_cuda.cu, nac_fast/ops/hamming_cuda.py:
# the retrieval passes launch a warp per block, half a warp for codes whose counters would not fit)
HAMMING_THREADS = {"cdist": 256, "filter": 128, "retrieval": 32}
MMA_OPS = ("HGMMA", "HMMA")


def _build_flags():
    spec = importlib.util.spec_from_file_location("nac_build_flags",
                                                  os.path.join(ROOT, "csrc", "build_flags.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# ptxas report parsing
# ---------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> list:
    """ptxas -v output -> one dict per entry function (kernel), in report order: mangled, arch,
    registers, spill_store_bytes, spill_load_bytes, smem_bytes (static), stack_bytes.  Non-entry
    functions ptxas lists (non-inlined device functions) are left out."""
    rows, props, current, pending = [], {}, None, None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = {"mangled": m.group(1), "arch": int(m.group(2))}
            rows.append(current)
            continue
        m = _PROPS.search(line)
        if m:
            pending = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and pending is not None:
            props[pending] = tuple(int(x) for x in m.groups())
            pending = None
            continue
        m = _USED.search(line)
        if m and current is not None:
            s = _SMEM.search(line)
            current["registers"] = int(m.group(1))
            current["smem_bytes"] = int(s.group(1)) if s else 0
    for r in rows:
        if "registers" not in r or r["mangled"] not in props:
            raise ValueError(f"incomplete ptxas report for {r['mangled']} (sm_{r['arch']})")
        r["stack_bytes"], r["spill_store_bytes"], r["spill_load_bytes"] = props[r["mangled"]]
    return rows


def _cxa_demangle(name: str) -> str:
    lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int()
    ptr = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        ctypes.CDLL(None).free(ctypes.c_void_p(ptr))


def demangle(names, cuda_home=None) -> dict:
    """{mangled: demangled}: one cu++filt call when the toolkit has it, else __cxa_demangle."""
    names = list(dict.fromkeys(names))
    tool = os.path.join(cuda_home, "bin", "cu++filt") if cuda_home else None
    if tool and os.path.exists(tool) and names:
        out = subprocess.run([tool], input="\n".join(names) + "\n", capture_output=True,
                             text=True, check=True).stdout.splitlines()
        if len(out) == len(names):
            return dict(zip(names, out))
    return {n: _cxa_demangle(n) for n in names}


def _split_top(s: str) -> list:
    """Split a template argument list at its top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def describe(demangled: str) -> tuple:
    """'void (anonymous namespace)::fwd_kernel<c10::BFloat16, float, 64>(float const*, ...)'
    -> ('fwd_kernel<c10::BFloat16, float, 64>', 'bf16', '64').  dtype: the input dtype of the
    instantiation (bf16/fp16 when a template argument is c10::BFloat16/c10::Half, else fp64 or
    fp32 from double/float; '' when none, e.g. noise_kernel); D: the first integer template
    argument (DPAD), '' when none."""
    s = demangled.strip()
    if s.startswith("void "):
        s = s[5:]
    if s.endswith(")"):  # drop the parameter list: the last top-level (...) group
        depth = 0
        for k in range(len(s) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(s[k], 0)
            if depth == 0:
                s = s[:k]
                break
    s = s.replace("(anonymous namespace)::", "")
    args = []
    if s.endswith(">"):
        args = _split_top(s[s.index("<") + 1:-1])
    dtype = ""
    for key, tag in (("BFloat16", "bf16"), ("__nv_bfloat16", "bf16"), ("Half", "fp16"),
                     ("__half", "fp16"), ("double", "fp64"), ("float", "fp32")):
        if any(re.search(rf"\b{key}\b", a) for a in args):
            dtype = tag
            break
    D = next((re.sub(r"[uUlL]+$", "", a) for a in args if re.fullmatch(r"-?\d+[uUlL]*", a)), "")
    return s, dtype, D


# ---------------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------------

def nvcc_command(arch: int, out_path: str, source: str = SOURCES[0]) -> tuple:
    """(nvcc argv, cuda_home) of the device-only compile of `source` (a csrc/*.cu file) for
    sm_<arch>, with the build's flags and include paths.  RuntimeError when nvcc or torch is
    missing."""
    bf = _build_flags()
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise RuntimeError(f"torch is not importable ({exc}): the .cu file includes ATen") from exc
    home = bf.find_cuda_home(cpp_extension.CUDA_HOME)
    if home is None:
        nvcc_on_path = shutil.which("nvcc")
        raise RuntimeError("no CUDA toolkit (nvcc + libcudart) found: set CUDA_HOME"
                           + (f" (nvcc on PATH at {nvcc_on_path} has no toolkit around it)"
                              if nvcc_on_path else ""))
    includes = [bf.csrc_dir()] + bf.cuda_wheel_include_dirs(torch.__file__) + \
        cpp_extension.include_paths() + [os.path.join(home, "include")]
    argv = [os.path.join(home, "bin", "nvcc"), "-cubin", f"-arch=sm_{arch}", "-Xptxas", "-v",
            *bf.torch_nvcc_flags(torch.__version__), *bf.NVCC_FLAGS,
            *[f"-I{d}" for d in includes], source, "-o", out_path]
    return argv, home


def _compile(job) -> tuple:
    """One (source, arch): nvcc -cubin with ptxas' report, then the cubin's SASS.  Returns
    (ptxas rows, {mangled: {op: count}}, seconds, cuda_home)."""
    source, arch, tool = job
    with tempfile.TemporaryDirectory(prefix="nac_res_") as tmp:
        cubin = os.path.join(tmp, f"{os.path.basename(source)}_sm{arch}.cubin")
        argv, home = nvcc_command(arch, cubin, source)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True)
        secs = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {os.path.basename(source)} for sm_{arch} "
                               f"(exit {proc.returncode}):\n"
                               + (proc.stdout + proc.stderr)[-4000:])
        sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True)
        if sass.returncode != 0:
            raise RuntimeError(f"{tool} --dump-sass failed: {sass.stderr[-2000:]}")
    ops = {f: c for (_, f), c in parse_sass_counts(sass.stdout).items()}
    return parse_ptxas(proc.stdout + "\n" + proc.stderr), ops, secs, home


def cuda_resource_rows(archs=(80, 90), jobs=2, sources=SOURCES) -> list:
    """Compile each csrc/*.cu file for each arch (up to `jobs` nvcc processes at once) and return
    one row per (kernel instantiation, arch) with FIELDS as keys, sorted by arch then kernel.
    RuntimeError when the toolkit, cuobjdump or torch is missing or nvcc fails."""
    archs = [int(a) for a in archs]
    if not archs:
        raise ValueError("archs must name at least one arch, e.g. (80, 90)")
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if not sources:
        raise RuntimeError(f"no CUDA source (csrc/*.cu) under {ROOT}")
    nvcc_command(archs[0], os.devnull, sources[0])  # no toolkit or torch: RuntimeError here
    tool = find_cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump found to count the tensor-core instructions (Triton's "
                           "wheel ships one in triton/backends/nvidia/bin)")
    jobs_list = [(src, arch, tool) for arch in archs for src in sources]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(jobs, len(jobs_list))) as pool:
        results = list(pool.map(_compile, jobs_list))
    names = demangle([r["mangled"] for rows, _, _, _ in results for r in rows], results[0][3])
    out = []
    for (src, arch, _), (rows, ops, secs, _) in zip(jobs_list, results):
        for r in rows:
            kernel, dtype, D = describe(names[r["mangled"]])
            counts = ops.get(r["mangled"], {})
            used = [m for m in MMA_OPS if counts.get(m)]
            out.append({"kernel": kernel, "arch": arch, "dtype": dtype, "D": D,
                        "registers": r["registers"],
                        "spill_store_bytes": r["spill_store_bytes"],
                        "spill_load_bytes": r["spill_load_bytes"],
                        "smem_bytes": r["smem_bytes"], "stack_bytes": r["stack_bytes"],
                        "mma_instr": "+".join(used),
                        "mma_count": sum(counts.get(m, 0) for m in MMA_OPS),
                        "source": os.path.basename(src), "compile_s": round(secs, 2)})
    out.sort(key=lambda r: (r["arch"], r["kernel"]))
    return out


def threads_per_block(kernel: str) -> int:
    """Threads per block the host launches `kernel` with (csrc/nac_cuda.cu, nac_cuda_mma.cu):
    128 for finish_kernel (one block per row), 256 for every other kernel; the Hamming kernels'
    (csrc/hamming_cuda.cu) from HAMMING_THREADS."""
    m = HAMMING_KERNEL.match(kernel)
    if m:
        return HAMMING_THREADS[m.group(1)]
    return 128 if kernel.startswith("finish_kernel") else 256


def is_matrix_kernel_16bit(row) -> bool:
    """A bf16/fp16 instantiation of a matrix kernel (fwd*, bwd_keys*): it must use tensor cores."""
    return row["dtype"] in ("bf16", "fp16") and bool(MATRIX_KERNEL.match(row["kernel"]))


def problems(rows) -> list:
    """Resource problems: spills on a bf16/fp16/fp32 path, static shared memory over the 48 KiB
    per-block limit, a bf16/fp16 matrix kernel without HMMA/HGMMA in its SASS."""
    msgs = []
    for r in rows:
        where = f"sm_{r['arch']} {r['kernel']}"
        if HAMMING_KERNEL.match(r["kernel"]) and (r["spill_store_bytes"] or r["spill_load_bytes"]
                                                   or int(r.get("stack_bytes") or 0)):
            msgs.append(f"{where} (Hamming) uses local memory: {r['spill_store_bytes']} B spill "
                        f"stores, {r['spill_load_bytes']} B spill loads, "
                        f"{r.get('stack_bytes') or 0} B stack")
        if r["dtype"] in NO_SPILL_DTYPES and (r["spill_store_bytes"] or r["spill_load_bytes"]):
            msgs.append(f"{where} ({r['dtype']}) spills: {r['spill_store_bytes']} B stores, "
                        f"{r['spill_load_bytes']} B loads")
        limit = STATIC_SMEM_LIMIT.get(int(r["arch"]), 48 * 1024)
        if r["smem_bytes"] > limit:
            msgs.append(f"{where} uses {r['smem_bytes']} B of static shared memory, over the "
                        f"{limit} B per-block limit")
        if is_matrix_kernel_16bit(r) and not int(r.get("mma_count") or 0):
            msgs.append(f"{where} ({r['dtype']}) has no tensor-core instruction (HMMA/HGMMA) "
                        "in its SASS")
    return msgs


# ---------------------------------------------------------------------------------------------
# SASS of a built library: which MUFU (special-function unit) instructions the kernels use
# ---------------------------------------------------------------------------------------------

def find_cuobjdump():
    """cuobjdump: Triton's wheel ships one (triton/backends/nvidia/bin), else the toolkit's, else
    PATH; None when there is none."""
    spec = importlib.util.find_spec("triton")
    cands = []
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            cands.append(os.path.join(loc, "backends", "nvidia", "bin", "cuobjdump"))
    home = _build_flags().find_cuda_home()
    if home:
        cands.append(os.path.join(home, "bin", "cuobjdump"))
    cands.append(shutil.which("cuobjdump") or "")
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


_SASS_ARCH = re.compile(r"code for sm_(\d+)")
_SASS_FUNC = re.compile(r"Function : (\S+)")
# MUFU.<op> (special-function unit) and the matrix instructions, by opcode
_SASS_OP = re.compile(r"\b(MUFU\.[A-Z0-9]+|HGMMA|HMMA|DMMA)\b")
# The anonymous namespaces of csrc/nac_cuda.cu and csrc/nac_cuda_mma.cu in mangled names
# ("..._11_nac_cuda_cu_...", "..._15_nac_cuda_mma_cu_...")
_NAC_CU = re.compile(r"_nac_cuda\w*?_cu_")


def parse_sass_counts(text: str) -> dict:
    """cuobjdump --dump-sass output -> {(arch, mangled function): {op: count}} with op one of
    "MUFU.<op>", "HMMA", "HGMMA", "DMMA"; every function listed ({} when it has none)."""
    counts, arch, func = {}, None, None
    for line in text.splitlines():
        m = _SASS_ARCH.search(line)
        if m:
            arch, func = int(m.group(1)), None
            continue
        m = _SASS_FUNC.search(line)
        if m:
            func = m.group(1)
            counts.setdefault((arch, func), {})
            continue
        if func is not None:
            for op in _SASS_OP.findall(line):
                c = counts[(arch, func)]
                c[op] = c.get(op, 0) + 1
    return counts


def parse_sass_mufu(text: str) -> dict:
    """cuobjdump --dump-sass output -> {(arch, mangled function): {MUFU op: count}}, every
    function listed (with {} when it has no MUFU instruction)."""
    return {k: {op[5:]: n for op, n in c.items() if op.startswith("MUFU.")}
            for k, c in parse_sass_counts(text).items()}


def _library_sass(library: str, cuobjdump=None) -> str:
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump found (Triton's wheel ships one in "
                           "triton/backends/nvidia/bin; or set CUDA_HOME to a full toolkit)")
    proc = subprocess.run([tool, "--dump-sass", library], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} --dump-sass {library} failed: {proc.stderr[-2000:]}")
    return proc.stdout


def sass_mufu_counts(library: str, cuobjdump=None) -> dict:
    """MUFU counts per (arch, function) of the NAC kernels (csrc/nac_cuda*.cu's, whose mangled
    names carry their anonymous namespace, e.g. 'nac_cuda_cu') in a built library."""
    return {k: v for k, v in parse_sass_mufu(_library_sass(library, cuobjdump)).items()
            if _NAC_CU.search(k[1])}


def sass_op_counts(library: str, cuobjdump=None) -> dict:
    """{(arch, mangled function): {op: count}} (parse_sass_counts) of the NAC kernels in a built
    library."""
    return {k: v for k, v in parse_sass_counts(_library_sass(library, cuobjdump)).items()
            if _NAC_CU.search(k[1])}


_RES_FUNC = re.compile(r"Function (\S+):")
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_resource_usage(text: str) -> dict:
    """cuobjdump --dump-resource-usage output -> {(arch, mangled function): {"REG", "STACK",
    "SHARED", "LOCAL"}} (SHARED: static shared memory, including what the arch reserves per
    block; LOCAL: per-thread local memory, where spills go)."""
    out, arch, func = {}, None, None
    for line in text.splitlines():
        m = re.search(r"arch = sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
            continue
        m = _RES_FUNC.search(line)
        if m:
            func = m.group(1)
            continue
        m = _RES_USAGE.search(line)
        if m and func is not None:
            out[(arch, func)] = dict(zip(("REG", "STACK", "SHARED", "LOCAL"),
                                         (int(x) for x in m.groups())))
            func = None
    return out


def library_resource_usage(library: str, cuobjdump=None) -> dict:
    """parse_resource_usage of the NAC kernels in a built library (one cuobjdump call)."""
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise RuntimeError("no cuobjdump found (Triton's wheel ships one in "
                           "triton/backends/nvidia/bin; or set CUDA_HOME to a full toolkit)")
    proc = subprocess.run([tool, "--dump-resource-usage", library], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} --dump-resource-usage {library} failed: "
                           f"{proc.stderr[-2000:]}")
    return {k: v for k, v in parse_resource_usage(proc.stdout).items() if _NAC_CU.search(k[1])}


def _table(rows) -> str:
    cols = ("arch", "kernel", "dtype", "D", "registers", "spill_store_bytes", "spill_load_bytes",
            "smem_bytes", "stack_bytes", "mma_instr", "mma_count")
    heads = ("arch", "kernel", "dtype", "D", "regs", "spill st", "spill ld", "smem", "stack",
             "mma", "mma n")
    cells = [[str(r[c]) for c in cols] for r in rows]
    width = [max(len(h), *(len(c[k]) for c in cells)) for k, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, width))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in cells]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", required=True, help="output CSV path")
    ap.add_argument("--archs", default="80,90", help="comma-separated SM numbers (default 80,90)")
    ap.add_argument("--jobs", type=int, default=2, help="parallel nvcc processes (default 2)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = cuda_resource_rows(tuple(int(a) for a in args.archs.split(",")), args.jobs)
    total = time.perf_counter() - t0
    print(_table(rows))
    per_job = {(r["source"], r["arch"]): r["compile_s"] for r in rows}
    print("nvcc per source and arch (s): "
          + ", ".join(f"{src} sm_{a} {s}" for (src, a), s in per_job.items())
          + f"; total {total:.1f} s with jobs={args.jobs}")
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.csv} ({len(rows)} rows)")
    found = problems(rows)
    for msg in found:
        print("PROBLEM: " + msg)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
