"""Tuned launch configurations of the Triton NAC kernels (issue 38).

The launchers (kernels/nac_triton.py `config`) take a kernel's block configuration from a *table*
of timed winners when one applies, else from the built-in `CONFIGS`.  A table is a JSON file
written by the autotune stage (``python tools/autotune.py``, a GPU suite stage) for one GPU
architecture: ``kernels/tuned/sm<arch>.json`` (shipped with the package), with the device, the
triton/torch versions and, per entry, the figures that chose the winner.

Key of an entry: (kernel, dtype, BLOCK_D, precision, kind, size class).
  kernel     "fwd" (_fwd_kernel) or "bwd_keys" (_bwd_keys_kernel)
  dtype      the input dtype tuned ("bfloat16", "float32"); other dtypes keep the built-in table
  precision  how the products run: "ieee" for 16-bit inputs, fp32's NAC_FAST_FP32_DOT mode
  kind       "inbatch" (the batch's own codes are the keys) or "queue" (keys given: a queue or
             gathered keys)
  size class (round(log2 n), round(log2 N)) of the call's n query rows and N keys; a call takes the
             entry of its key with the nearest class (|d log2 n| + |d log2 N|, ties: the first
             entry), so a table tuned at n = 8192 also serves n = 4096 or 256; the split counts
             adapt to the shape (Config.waves, kernels/launch.py `split_count`).
Every configuration a table names must be one of `configs.CANDIDATES` (which the compile check
compiles for sm_80 and sm_90): a table naming another is refused (ValueError naming the file).

Which table a GPU of arch A uses (`table_for`), once per process, announced once on the
"nac_fast" logger (a warning: stderr unless logging is configured):
  1. NAC_FAST_TUNED=0: none (the built-in configurations); NAC_FAST_TUNED=<file>: that table;
  2. kernels/tuned/sm<A>.json;
  3. the first-use autotune cache of this device (below), when it exists;
  4. NAC_FAST_AUTOTUNE=1: a first-use autotune: each key is timed the first time a call needs it
     (the candidates on random data of the call's shape, CUDA-graph replay), and the winners are
     written to ``$NAC_FAST_CACHE_DIR`` (default ``$XDG_CACHE_HOME/nac_fast``, else
     ``~/.cache/nac_fast``) ``/tuned/<device>-sm<A>-triton<version>-<candidates digest>.json``;
  5. the table of the nearest arch in kernels/tuned/ (|A - arch|, ties: the lower arch);
  6. none: the built-in configurations.
A tuned configuration that does not fit the GPU (its archs, the shared-memory estimate) is not
used: the built-in configuration is, and the announcement says so.

fp32's product mode: where a table tuned fp32 in tf32x3 and another mode (bf16x6; in-batch also
fp16x3) at one size class (`Table.fp32_mode`), fp32 calls of that kind and class run in the
fastest whole step (forward plan, plus the keys' backward in-batch) when NAC_FAST_FP32_DOT is
unset (`fp32_choice`, asked by nac_triton.call_fp32_mode when a plan is built); a mode other than
tf32x3 is announced once per class.

The configurations themselves (CONFIGS, CANDIDATES, block_d, smem_estimate) are kernels/configs.py;
the timing (the autotune stage's and the first-use autotune's) is kernels/autotuner.py, which
registers itself here (`register_autotuner`): this module never imports the kernels.

`forced` (a context) makes `config` return given configurations: the autotune stage and the
compile check build the launch plans of every candidate with it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import re
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from . import configs as CF
from .launch import Config

FORMAT = 1
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
KERNELS = ("fwd", "bwd_keys")
KINDS = ("inbatch", "queue")
CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "waves")
ENV_TUNED = "NAC_FAST_TUNED"
ENV_AUTOTUNE = "NAC_FAST_AUTOTUNE"
ENV_CACHE = "NAC_FAST_CACHE_DIR"
# what a candidate's outputs may differ from the built-in configuration's (norm-wise relative):
# only the order of fp32 sums and the running max at which P is rounded to the input dtype differ
CHECK_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}

log = logging.getLogger("nac_fast")


# ---------------------------------------------------------------------------------------------
# Forced configurations (the autotune stage, the compile check)
# ---------------------------------------------------------------------------------------------

_FORCED: contextvars.ContextVar = contextvars.ContextVar("nac_fast_forced_configs", default={})


@contextlib.contextmanager
def forced(**configs: Config):
    """Within the context, `nac_triton.config(kernel, ...)` returns configs[kernel] for each
    kernel named (fwd=..., bwd_keys=...), on every target, the interpreter included."""
    for k, c in configs.items():
        if k not in KERNELS:
            raise ValueError(f"forced: kernel must be one of {KERNELS}, got {k!r}")
        if not isinstance(c, Config):
            raise TypeError(f"forced: {k} must be a Config, got {type(c).__name__}")
    token = _FORCED.set({**_FORCED.get(), **configs})
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_config(kernel: str) -> Optional[Config]:
    return _FORCED.get().get(kernel)


# The settings a plan reads from the environment: the fp32 product mode (nac_triton
# fp32_precision) and the table settings.  Read at every call (a test or a user may change them
# between calls) from os.environ's own mapping, with the names encoded once: the values only go
# into cache keys, so they stay encoded (0.02 us a read against os.environ.get's 0.6 us).
_PLAN_ENV = ("NAC_FAST_FP32_DOT", ENV_TUNED, ENV_AUTOTUNE, "NAC_FAST_FOLD")
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = (tuple(os.environ.encodekey(v) for v in _PLAN_ENV)
             if _ENV_DATA is not None and hasattr(os.environ, "encodekey") else None)


def plan_key() -> tuple:
    """What a cached launch plan depends on beyond its shapes, strides, dtype and device: the
    forced configurations and the environment's fp32 product mode, table settings and
    NAC_FAST_FOLD (the op
    layer's plan caches add it to their keys)."""
    forced = _FORCED.get()
    if _ENV_KEYS is not None:
        env = tuple(_ENV_DATA.get(k) for k in _ENV_KEYS)
    else:
        env = tuple(os.environ.get(v) for v in _PLAN_ENV)
    return (tuple(sorted(forced.items())) if forced else (), env)


# ---------------------------------------------------------------------------------------------
# Keys, size classes, configurations
# ---------------------------------------------------------------------------------------------

def size_class(n: int, N: int) -> Tuple[int, int]:
    """(round(log2 n), round(log2 N)): calls within a factor sqrt(2) share a class."""
    if n < 1 or N < 1:
        raise ValueError(f"size_class: n and N must be >= 1, got n={n}, N={N}")
    return (int(round(math.log2(n))), int(round(math.log2(N))))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def config_dict(c: Config) -> dict:
    return {f: getattr(c, f) for f in CONFIG_FIELDS}


def config_label(c: Config) -> str:
    """'128x64 w8 s3 x1': BLOCK_M x BLOCK_N, warps, stages, waves."""
    return f"{c.BLOCK_M}x{c.BLOCK_N} w{c.num_warps} s{c.num_stages} x{c.waves}"


def _same(a: Config, b: Config) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in CONFIG_FIELDS)


# fp32 product modes (NAC_FAST_FP32_DOT) with autotune candidates of their own: tf32x3 (the
# default) under the dtype's name, bf16x6 and fp16x3 under "float32:<mode>"
# (nac_triton.CANDIDATES); fp16x3 in-batch only (given keys run bf16x6)
TUNED_FP32_MODES = ("tf32x3", "bf16x6", "fp16x3")
IN_BATCH_ONLY_FP32_MODES = ("fp16x3",)


def candidate_name(dname: str, precision: Optional[str]) -> str:
    """The dtype part of a `nac_triton.CANDIDATES` key for a dtype name and a product mode (an
    entry's `precision`): the name, or "float32:bf16x6" for a mode other than the 16-bit paths'
    "ieee" and fp32's default tf32x3."""
    return dname if precision in ("ieee", "tf32x3", None) else f"{dname}:{precision}"


def candidate_dtype(dtype: torch.dtype, D: int) -> Optional[str]:
    """The dtype part of a `nac_triton.CANDIDATES` key for calls of `dtype` at code width D under
    the environment's fp32 product mode: the dtype's name, "float32:bf16x6" for fp32 in bf16x6,
    None for an fp32 mode without candidates (ieee, tf32)."""
    if dtype == torch.float32:
        mode = CF.fp32_precision(D)
        return candidate_name("float32", mode) if mode in TUNED_FP32_MODES else None
    return dtype_name(dtype)


def split_candidate_dtype(name: str) -> Tuple[str, Optional[str]]:
    """("float32", "bf16x6") of "float32:bf16x6"; (name, None) of a plain dtype name (fp32's
    default tf32x3 included)."""
    dname, _, mode = name.partition(":")
    return dname, (mode or None)


def candidates(kernel: str, dtype: torch.dtype, D: int) -> List[Config]:
    """The configurations the autotune stage times for (kernel, dtype, D) (`nac_triton.CANDIDATES`,
    every one compile-checked for sm_80 and sm_90) under the environment's fp32 product mode
    (NAC_FAST_FP32_DOT: tf32x3 and bf16x6 have their own), [] where none are listed."""
    name = candidate_dtype(dtype, D)
    if name is None:
        return []
    return list(CF.CANDIDATES.get((kernel, name, CF.block_d(D)), ()))


def candidates_digest() -> str:
    """8 hex digits naming the candidate lists: a first-use cache made with other lists (or
    another triton) is another file."""
    text = json.dumps(sorted((list(k), [config_dict(c) for c in v])
                             for k, v in CF.CANDIDATES.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Table:
    path: str
    arch: int
    device: str
    data: dict
    entries: List[dict]

    def find(self, kernel: str, dtype: str, block_d: int, precision: str, kind: str,
             n: int, N: int) -> Optional[dict]:
        """The entry of the key with the nearest size class, or None."""
        cls = size_class(n, N)
        best, best_d = None, None
        for e in self.entries:
            if (e["kernel"], e["dtype"], e["block_d"], e["precision"], e["kind"]) != \
                    (kernel, dtype, block_d, precision, kind):
                continue
            ec = tuple(e["size_class"])
            d = abs(ec[0] - cls[0]) + abs(ec[1] - cls[1])
            if best_d is None or d < best_d:
                best, best_d = e, d
        return best

    def has_class(self, kernel, dtype, block_d, precision, kind, n, N) -> bool:
        e = self.find(kernel, dtype, block_d, precision, kind, n, N)
        return e is not None and tuple(e["size_class"]) == size_class(n, N)

    def fp32_step_ms(self, block_d: int, kind: str, n: int, N: int) -> Dict[str, tuple]:
        """{fp32 product mode: (size class, ms)} of a training step's Triton kernels at the
        nearest size class this table tuned in that mode: the forward's plan, plus the keys'
        backward's for in-batch calls (a queue's backward is the rows' kernel alone, the same in
        every mode), each the winner's median.  Only the modes of TUNED_FP32_MODES whose step
        the table holds whole."""
        out = {}
        for mode in TUNED_FP32_MODES:
            kernels = ("fwd", "bwd_keys") if kind == "inbatch" else ("fwd",)
            es = [self.find(k, "float32", block_d, mode, kind, n, N) for k in kernels]
            if any(e is None for e in es) or len({tuple(e["size_class"]) for e in es}) != 1:
                continue
            out[mode] = (tuple(es[0]["size_class"]), sum(float(e["median_ms"]) for e in es))
        return out

    def fp32_mode(self, block_d: int, kind: str, n: int, N: int) -> Optional[str]:
        """The fp32 product mode this table timed fastest for a call (`fp32_step_ms`): of the
        modes tuned at the nearest size class where tf32x3 (the built-in default) and at least
        one other were, the fastest (ties: the earlier of TUNED_FP32_MODES); else None (the
        default stays).  A mode tuned only at another class is not compared."""
        steps = self.fp32_step_ms(block_d, kind, n, N)
        if TUNED_FP32_MODES[0] not in steps:
            return None
        cls = steps[TUNED_FP32_MODES[0]][0]
        same = [m for m in TUNED_FP32_MODES if m in steps and steps[m][0] == cls]
        if len(same) < 2:
            return None
        return min(same, key=lambda m: (steps[m][1], TUNED_FP32_MODES.index(m)))


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"tuned table {path}: {what}")


def entry_config(entry: dict, path: str = "<entry>") -> Config:
    """The candidate configuration an entry names (ValueError if it names none)."""
    cfg = entry.get("config")
    if not isinstance(cfg, dict) or set(cfg) != set(CONFIG_FIELDS) or \
            not all(isinstance(cfg[f], int) and cfg[f] > 0 for f in CONFIG_FIELDS):
        raise _bad(path, f"entry {entry.get('kernel')}/{entry.get('dtype')}/{entry.get('kind')}: "
                         f"config must give positive integers {CONFIG_FIELDS}, got {cfg!r}")
    want = Config(**cfg)
    name = candidate_name(entry["dtype"], entry.get("precision"))
    for c in CF.CANDIDATES.get((entry["kernel"], name, entry["block_d"]), ()):
        if _same(c, want):
            return c
    raise _bad(path, f"entry {entry['kernel']} {entry['dtype']} D={entry['block_d']} "
                     f"{entry['kind']}: {config_label(want)} is not one of nac_triton.CANDIDATES "
                     "(only compile-checked candidates may be used)")


def validate(data, path: str) -> Table:
    """A table's JSON, checked: format, arch, entries (keys, size classes, candidate configs)."""
    if not isinstance(data, dict):
        raise _bad(path, "not a JSON object")
    if data.get("format") != FORMAT:
        raise _bad(path, f"format must be {FORMAT}, got {data.get('format')!r}")
    arch = data.get("arch")
    if not isinstance(arch, int) or arch < 0:
        raise _bad(path, f"arch must be an integer >= 0 (10 * major + minor), got {arch!r}")
    entries = data.get("entries")
    if not isinstance(entries, list):
        raise _bad(path, "entries must be a list")
    seen = set()
    for e in entries:
        if not isinstance(e, dict):
            raise _bad(path, f"an entry is not an object: {e!r}")
        for f, ok in (("kernel", lambda v: v in KERNELS), ("kind", lambda v: v in KINDS),
                      ("dtype", lambda v: isinstance(v, str)),
                      ("block_d", lambda v: isinstance(v, int) and v > 0),
                      ("precision", lambda v: isinstance(v, str)),
                      ("size_class", lambda v: isinstance(v, list) and len(v) == 2
                       and all(isinstance(x, int) for x in v)),
                      ("median_ms", lambda v: isinstance(v, (int, float)) and v > 0)):
            if f not in e or not ok(e[f]):
                raise _bad(path, f"entry field {f!r} missing or invalid: {e.get(f)!r}")
        entry_config(e, path)
        key = (e["kernel"], e["dtype"], e["block_d"], e["precision"], e["kind"],
               tuple(e["size_class"]))
        if key in seen:
            raise _bad(path, f"two entries for {key}")
        seen.add(key)
    return Table(path, arch, str(data.get("device", "")), data, entries)


def load_table(path: str) -> Table:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise _bad(path, f"not valid JSON ({exc})") from None
    return validate(data, path)


def write_table(path: str, data: dict) -> None:
    """Validate and write a table atomically (a temporary file renamed over `path`)."""
    validate(data, path)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def repo_tables(table_dir: Optional[str] = None) -> Dict[int, str]:
    """{arch: path} of the shipped tables (sm<arch>.json)."""
    d = table_dir or TABLE_DIR
    out = {}
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            m = re.fullmatch(r"sm(\d+)\.json", name)
            if m:
                out[int(m.group(1))] = os.path.join(d, name)
    return out


def nearest_arch(arch: int, archs: Iterable[int]) -> Optional[int]:
    archs = sorted(archs)
    return min(archs, key=lambda a: (abs(a - arch), a)) if archs else None


def cache_dir() -> str:
    if os.environ.get(ENV_CACHE):
        return os.environ[ENV_CACHE]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nac_fast")


def cache_path(device_name: str, arch: int) -> str:
    import triton
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-") or "device"
    return os.path.join(cache_dir(), "tuned",
                        f"{slug}-sm{arch}-triton{triton.__version__}-{candidates_digest()}.json")


# ---------------------------------------------------------------------------------------------
# Lookup (what nac_triton.config asks)
# ---------------------------------------------------------------------------------------------

_ANNOUNCED: set = set()
_TABLES: dict = {}  # _table_key(arch, device name) -> (source, Table or None)


def announce(msg: str) -> None:
    """Say `msg` once per process (the "nac_fast" logger, WARNING)."""
    if msg not in _ANNOUNCED:
        _ANNOUNCED.add(msg)
        log.warning("nac_fast: %s", msg)


def reset() -> None:
    """Forget the tables read and the announcements made (tests; after writing a table)."""
    _ANNOUNCED.clear()
    _TABLES.clear()


def autotune_enabled() -> bool:
    v = os.environ.get(ENV_AUTOTUNE, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_AUTOTUNE} must be 0 or 1, got {v!r}")
    return v == "1"


def _table_key(arch: int, device_name: str) -> tuple:
    return (arch, device_name, os.environ.get(ENV_TUNED), os.environ.get(ENV_AUTOTUNE),
            os.environ.get(ENV_CACHE), TABLE_DIR)


def table_for(arch: int, device_name: str) -> Tuple[str, Optional[Table]]:
    """(source, table) for a GPU of `arch` named `device_name`; source is "off", "file", "repo",
    "cache", "autotune" (a first-use cache to be filled), "nearest" or "none"."""
    key = _table_key(arch, device_name)
    if key in _TABLES:
        return _TABLES[key]
    env = os.environ.get(ENV_TUNED)
    tables = repo_tables()
    if env == "0":
        out = ("off", None)
    elif env:
        out = ("file", load_table(env))
        announce(f"tuned kernel configurations from {env} ({ENV_TUNED})")
    elif arch in tables:
        out = ("repo", load_table(tables[arch]))
    else:
        cpath = cache_path(device_name, arch)
        if os.path.exists(cpath):
            out = ("cache", load_table(cpath))
            announce(f"no shipped kernel table for sm_{arch} ({device_name}): using the first-use "
                     f"autotune results cached in {cpath}")
        elif autotune_enabled():
            out = ("autotune", None)
            announce(f"no kernel table for sm_{arch} ({device_name}): {ENV_AUTOTUNE}=1, so each "
                     "kernel shape class is timed on its first call (a few seconds each) and "
                     f"cached in {cpath}")
        else:
            near = nearest_arch(arch, tables)
            if near is not None:
                out = ("nearest", load_table(tables[near]))
                announce(f"no kernel table for sm_{arch} ({device_name}): using sm_{near}'s "
                         f"({tables[near]}; its configurations that do not fit this GPU take the "
                         f"built-in ones); {ENV_AUTOTUNE}=1 tunes on first use instead")
            else:
                out = ("none", None)
                announce(f"no tuned kernel table (kernels/tuned/ has none for sm_{arch} or any "
                         "arch): the built-in kernel configurations are used; "
                         f"`python tools/autotune.py` makes one, {ENV_AUTOTUNE}=1 tunes on "
                         "first use")
    _TABLES[key] = out
    return out


# The first-use autotune (kernels/autotuner.py `first_use_autotune`), registered by that module
# when it is imported: it builds the kernels' plans, so this module (which nac_triton imports)
# cannot import it.
_AUTOTUNER: Optional[Callable] = None


def register_autotuner(fn: Optional[Callable]) -> None:
    """Set the function `lookup` calls to tune a key on first use (NAC_FAST_AUTOTUNE=1)."""
    global _AUTOTUNER
    _AUTOTUNER = fn


def _fits(c: Config, kernel: str, dtype: torch.dtype, D: int, target) -> bool:
    return c.applies(target.arch) and CF.smem_estimate(kernel, c, dtype, D) <= target.smem


def lookup(kernel: str, dtype: torch.dtype, D: int, target, kind: Optional[str],
           n: Optional[int], N: Optional[int],
           device: Optional[torch.device] = None) -> Optional[Config]:
    """The tuned configuration of this call, or None (the built-in table applies): None also on
    the interpreter (arch 0), without the call's kind/n/N, and for keys no table holds."""
    if target.arch == 0 or kind is None or n is None or N is None or n < 1 or N < 1:
        return None
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not candidates(kernel, dtype, D):
        return None
    dname = dtype_name(dtype)
    bd = CF.block_d(D)
    prec = CF.precision(dtype, D)
    device = _cuda_device(device)
    dev_name = _device_name(device)
    source, table = table_for(target.arch, dev_name)
    if source == "off":
        return None
    if source in ("cache", "autotune") and autotune_enabled() and (
            table is None or not table.has_class(kernel, dname, bd, prec, kind, n, N)):
        if _AUTOTUNER is None:
            raise RuntimeError(f"{ENV_AUTOTUNE}=1: the first-use autotuner (nac_fast.kernels."
                               "autotuner) is not imported; nac_fast.ops.dispatch imports it with "
                               "the Triton kernels, or import it before the call")
        table = _AUTOTUNER(kernel, dtype, D, kind, n, N, device, target)
        _TABLES[_table_key(target.arch, dev_name)] = ("cache", table)
    if table is None:
        return None
    e = table.find(kernel, dname, bd, prec, kind, n, N)
    if e is None:
        return None
    c = entry_config(e, table.path)
    if not _fits(c, kernel, dtype, D, target):
        announce(f"tuned {kernel} configuration {config_label(c)} of {table.path} does not fit "
                 f"sm_{target.arch} ({dev_name}): the built-in configuration is used")
        return None
    return c


def fp32_choice(block_d: int, kind: str, n: int, N: int, target,
                device: Optional[torch.device]) -> Optional[str]:
    """The fp32 product mode the tuned table of this GPU chose for a call of `kind` with n query
    rows and N keys at BLOCK_D `block_d` (`Table.fp32_mode`: the fastest of tf32x3, bf16x6 and
    (in-batch) fp16x3 in the autotune stage's whole-step figures), or None: no table (the
    interpreter, NAC_FAST_TUNED=0, none for this arch), or one that did not time tf32x3 and
    another mode there.  Never tunes: a first-use autotune tunes the environment's mode only.  A
    choice other than tf32x3 is announced once per size class."""
    if target.arch == 0 or kind not in KINDS or n < 1 or N < 1:
        return None
    source, table = table_for(target.arch, _device_name(_cuda_device(device)))
    if table is None or source == "off":
        return None
    mode = table.fp32_mode(block_d, kind, n, N)
    if mode is not None and mode != TUNED_FP32_MODES[0]:
        steps = table.fp32_step_ms(block_d, kind, n, N)
        cls = steps[mode][0]
        announce(f"fp32 products of the Triton NAC kernels ({kind}, size class 2^{cls[0]} x "
                 f"2^{cls[1]}, BLOCK_D {block_d}) run in {mode}: {table.path} timed a step at "
                 + ", ".join(f"{m} {ms:.3f} ms" for m, (_, ms) in steps.items())
                 + "; NAC_FAST_FP32_DOT=tf32x3 keeps tf32x3")
    return mode


def _device_name(device: Optional[torch.device]) -> str:
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "unknown"


def _cuda_device(device: Optional[torch.device]) -> Optional[torch.device]:
    """The call's device, or the current CUDA device when the plan did not say."""
    if device is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def make_entry(kernel: str, case, precision: str, result: dict) -> Optional[dict]:
    """A table entry from tune_key's result (None when no candidate passed), with the figures
    that chose it: the winner's and the built-in configuration's timings, every candidate's."""
    w = result["winner"]
    if w is None:
        return None
    d = result["default"]
    r6 = lambda x: round(float(x), 6)  # noqa: E731 - ms to the nanosecond
    return dict(kernel=kernel, dtype=dtype_name(case.dtype), D=case.D,
                block_d=CF.block_d(case.D), precision=precision, kind=case.kind,
                size_class=list(size_class(case.n, case.N)), n=case.n, N=case.N,
                config=w["config"], split=w["split"], programs=w["programs"],
                median_ms=r6(w["median_ms"]), p20_ms=r6(w["p20_ms"]), p80_ms=r6(w["p80_ms"]),
                builtin_ms=r6(d["median_ms"]), builtin_split=d["split"],
                speedup=round(d["median_ms"] / w["median_ms"], 4),
                max_rel_diff=float(f"{w['max_rel_diff']:.3g}"),
                candidates=[dict(config=r["config"], split=r["split"],
                                 median_ms=None if r["median_ms"] != r["median_ms"]
                                 else r6(r["median_ms"]),
                                 status=r["status"]) for r in result["rows"]],
                skipped=result["skipped"])


def table_header(arch: int, device_name: str, sms: int, commit: str = "",
                 gpu: bool = True) -> dict:
    import platform

    import triton
    return dict(format=FORMAT, arch=arch, device=device_name, sms=sms,
                versions=dict(triton=triton.__version__, torch=torch.__version__,
                              python=platform.python_version(),
                              cuda=str(torch.version.cuda)),
                commit=commit, candidates_digest=candidates_digest(),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                timing=("each candidate's plan (the kernel and the launches its split count "
                        "changes) captured in a CUDA graph, replays timed by "
                        "triton.testing.do_bench (median, p20, p80 in ms; L2 flushed between)"
                        if gpu else "the interpreter (TRITON_INTERPRET=1): wall time of each "
                        "candidate's plan, median, p20, p80 in ms of a few runs; not GPU "
                        "figures"),
                entries=[])
