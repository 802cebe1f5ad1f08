"""Tuned launch configurations of the Triton NAC kernels (issue 38).

The launchers (kernels/nac_triton.py `config`) take a kernel's block configuration from a *table*
of timed winners when one applies, else from the built-in `CONFIGS`.  A table is a JSON file
written by the autotune stage (``python bench/autotune.py``, a GPU suite stage) for one GPU
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
Every configuration a table names must be one of `nac_triton.CANDIDATES` (which the compile check
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
import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

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
    from . import nac_triton as NT
    if dtype == torch.float32:
        mode = NT.fp32_precision(D)
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
    from . import nac_triton as NT
    name = candidate_dtype(dtype, D)
    if name is None:
        return []
    return list(NT.CANDIDATES.get((kernel, name, NT.block_d(D)), ()))


def candidates_digest() -> str:
    """8 hex digits naming the candidate lists: a first-use cache made with other lists (or
    another triton) is another file."""
    from . import nac_triton as NT
    text = json.dumps(sorted((list(k), [config_dict(c) for c in v])
                             for k, v in NT.CANDIDATES.items()))
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
    from . import nac_triton as NT
    cfg = entry.get("config")
    if not isinstance(cfg, dict) or set(cfg) != set(CONFIG_FIELDS) or \
            not all(isinstance(cfg[f], int) and cfg[f] > 0 for f in CONFIG_FIELDS):
        raise _bad(path, f"entry {entry.get('kernel')}/{entry.get('dtype')}/{entry.get('kind')}: "
                         f"config must give positive integers {CONFIG_FIELDS}, got {cfg!r}")
    want = Config(**cfg)
    name = candidate_name(entry["dtype"], entry.get("precision"))
    for c in NT.CANDIDATES.get((entry["kernel"], name, entry["block_d"]), ()):
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
                         f"`python bench/autotune.py` makes one, {ENV_AUTOTUNE}=1 tunes on "
                         "first use")
    _TABLES[key] = out
    return out


def _fits(c: Config, kernel: str, dtype: torch.dtype, D: int, target) -> bool:
    from . import nac_triton as NT
    return c.applies(target.arch) and NT.smem_estimate(kernel, c, dtype, D) <= target.smem


def lookup(kernel: str, dtype: torch.dtype, D: int, target, kind: Optional[str],
           n: Optional[int], N: Optional[int],
           device: Optional[torch.device] = None) -> Optional[Config]:
    """The tuned configuration of this call, or None (the built-in table applies): None also on
    the interpreter (arch 0), without the call's kind/n/N, and for keys no table holds."""
    if target.arch == 0 or kind is None or n is None or N is None or n < 1 or N < 1:
        return None
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    from . import nac_triton as NT
    if not candidates(kernel, dtype, D):
        return None
    dname = dtype_name(dtype)
    bd = NT.block_d(D)
    prec = NT._dot_consts(dtype, D, torch.device("cuda"))["PRECISION"]
    device = _cuda_device(device)
    dev_name = _device_name(device)
    source, table = table_for(target.arch, dev_name)
    if source == "off":
        return None
    if source in ("cache", "autotune") and autotune_enabled() and (
            table is None or not table.has_class(kernel, dname, bd, prec, kind, n, N)):
        table = first_use_autotune(kernel, dtype, D, kind, n, N, device, target)
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


# ---------------------------------------------------------------------------------------------
# Timing the candidates of one key (the autotune stage and the first-use autotune)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    """One shape to tune at: `kind` with n query rows, N keys (n for in-batch), D code bits."""
    kind: str
    n: int
    N: int
    D: int
    dtype: torch.dtype

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "inbatch" and self.N != self.n:
            raise ValueError(f"in-batch: N must equal n, got n={self.n}, N={self.N}")
        if min(self.n, self.N, self.D) < 1:
            raise ValueError(f"n, N, D must be >= 1, got {self.n}, {self.N}, {self.D}")


P_CHANNEL = 0.1  # the channel's flip probability of the random data (s = channel_scale(p))


def case_inputs(case: Case, device, seed: int = 0) -> dict:
    """Random inputs of a case (never zeros): codes a ~ 1.5 N(0,1), logits r ~ 2 N(0,1), noise
    +-1 flipped with p = 0.1, keys tanh(1.5 N(0,1)) (queue), upstream gradient g in [0.5, 1.5)/n."""
    gen = torch.Generator().manual_seed(seed)
    n, N, D, dt = case.n, case.N, case.D, case.dtype
    t = dict(a=torch.randn(n, D, generator=gen) * 1.5, r=torch.randn(n, D, generator=gen) * 2,
             noise=torch.where(torch.rand(n, D, generator=gen) < P_CHANNEL, -1.0, 1.0),
             g=(torch.rand(n, generator=gen) + 0.5) / n)
    t["keys"] = (torch.tanh(torch.randn(N, D, generator=gen) * 1.5) if case.kind == "queue"
                 else None)
    acc = torch.float64 if dt == torch.float64 else torch.float32
    return {k: (None if v is None else v.to(device=device, dtype=acc if k == "g" else dt))
            for k, v in t.items()}


def channel_scale(p: float) -> float:
    return 0.5 * math.log((1.0 - p) / p)


def plan_call(kernel: str, case: Case, inputs: dict, target, cfg: Optional[Config],
              fwd_state: Optional[tuple] = None):
    """(launches, outputs, split, state) of `kernel`'s plan for the case with configuration `cfg`
    forced (None: the built-in one, `nac_triton.builtin_config`, whatever a table says).  fwd:
    the forward plan (prologue, forward, finish) with the rows' gradient, state = its (loss,
    lse, ga, q, k) for the backward; bwd_keys: the backward plan (keys' backward and what follows
    it) from the forward's state.  outputs: the tensors the check compares; split: the kernel's
    split count (grid[1])."""
    from . import nac_triton as NT
    s = channel_scale(P_CHANNEL)
    l2 = 0.1 if case.kind == "queue" else 0.0
    a, r, noise, keys = inputs["a"], inputs["r"], inputs["noise"], inputs["keys"]
    if cfg is None:
        cfg = NT.builtin_config(kernel, case.dtype, case.D, target)
    with forced(**{kernel: cfg}):
        if kernel == "fwd":
            launches, state = NT.fwd_plan(a, r, noise, keys, s, l2, True, target)
            outputs = dict(loss=state[0], lse=state[1], ga=state[2])
        else:
            loss, lse, ga, q, k = fwd_state[:5]
            launches, out = NT.bwd_plan(a, r, noise, keys, lse, ga, inputs["g"], q, k, s,
                                        True, True, keys is not None, target)
            outputs = dict(grad_a=out[0], grad_r=out[1], grad_keys=out[2])
            state = None
    mine = [L for L in launches if L.tag.startswith(kernel)]
    return launches, outputs, (mine[0].grid[1] if mine else 0), state


def _time_cpu(fn: Callable[[], None], reps: int) -> Tuple[float, float, float]:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) > 1 else ts * 9
    return statistics.median(ts), q[1], q[7]


def _time_gpu(fn: Callable[[], None], rep_ms: float, warmup_ms: float
              ) -> Tuple[float, float, float]:
    """CUDA-graph replay of `fn` (its launches captured once), triton.testing.do_bench's median,
    p20, p80 in ms (L2 flushed between replays, as bench/bench_loss.py's +graph rows)."""
    from triton.testing import do_bench
    fn()  # compiles (or loads from triton's cache) before the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    med, p20, p80 = do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms,
                             quantiles=[0.5, 0.2, 0.8])
    del graph
    return float(med), float(p20), float(p80)


def _rel_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    x, ref = x.double(), ref.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    den = float(ref.norm())
    return float((x - ref).norm()) / (den if den > 0 else 1.0)


def run_fwd(case: Case, inputs: dict, target) -> tuple:
    """The forward with the built-in configuration, run: its state for the keys' backward."""
    from .launch import run
    launches, _, _, state = plan_call("fwd", case, inputs, target, None)
    run(launches)
    return state


def spilling(launches, kernel: str, figures: Callable) -> List[str]:
    """'tag: N B' for each of `kernel`'s launches whose compiled kernel uses local memory
    (`figures(launch)`: kernels/launch.py compiled_figures, the driver's figures of the kernel as
    the running Triton compiled it).  Resources are part of correctness: a candidate that spills
    is refused, whatever its time (the compile check holds the shipped configurations to it on
    CI's Triton; this holds the autotune's winners to it on the device's)."""
    out = []
    for L in launches:
        if L.tag.startswith(kernel) and all(g > 0 for g in L.grid):
            local = figures(L).local_bytes
            if local:
                out.append(f"{L.tag}: {local} B")
    return out


def tune_key(kernel: str, case: Case, device, target, cands: Sequence[Config],
             rep_ms: float = 25.0, warmup_ms: float = 5.0, cpu_reps: int = 3,
             deadline: Optional[float] = None, progress: Optional[Callable[[], None]] = None,
             figures: Optional[Callable] = None) -> dict:
    """Time every candidate of `kernel` on the case (random data) and check each one's outputs
    against the built-in configuration's.  Returns dict(default=row, rows=[row per candidate
    timed or refused], winner=the fastest "ok" row or None, skipped=[labels of the candidates
    past the deadline, not timed]).  A row: label, config, split, programs, median_ms, p20_ms,
    p80_ms, peak_mib (GPU: the MiB of buffers the plan allocates), max_rel_diff, status:
    "ok", "mismatch (...)", "error: ...", "spills (...)" (refused untimed: `spilling`, with
    `figures`, by default on a GPU kernels/launch.py compiled_figures; the interpreter has none),
    "same plan as waves 1", or "no-effect: ..." (the plan does not pass Config.waves to the
    split)."""
    from .launch import compiled_figures, run
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    inputs = case_inputs(case, dev)
    fwd_state = run_fwd(case, inputs, target) if kernel == "bwd_keys" else None
    timer = ((lambda f: _time_gpu(f, rep_ms, warmup_ms)) if gpu
             else (lambda f: _time_cpu(f, cpu_reps)))

    def split_of(cfg):
        return plan_call(kernel, case, inputs, target, cfg, fwd_state)[2]

    if figures is None and gpu:
        figures = compiled_figures

    def measure(cfg):
        before = torch.cuda.memory_allocated(dev) if gpu else 0
        launches, outputs, split, _ = plan_call(kernel, case, inputs, target, cfg, fwd_state)
        spills = spilling(launches, kernel, figures) if cfg is not None and figures else []
        if spills:
            import triton
            return dict(split=split, status=f"spills ({'; '.join(spills)}; triton "
                                            f"{triton.__version__})")
        # the plan's buffers (outputs, split partials); the kernels allocate nothing
        peak = round((torch.cuda.memory_allocated(dev) - before) / 2 ** 20, 1) if gpu else ""
        med, p20, p80 = timer(lambda: run(launches))
        programs = next((L.grid[0] * L.grid[1] for L in launches if L.tag.startswith(kernel)), 0)
        return dict(split=split, programs=programs, median_ms=med, p20_ms=p20, p80_ms=p80,
                    peak_mib=peak, outputs={k: v.clone() for k, v in outputs.items()})

    base = measure(None)
    base_out = base.pop("outputs")
    default_row = dict(label="built-in", config=None, max_rel_diff=0.0, status="ok", **base)
    tol = CHECK_TOL.get(dtype_name(case.dtype), 1e-4)
    honours = None
    rows, skipped = [], []
    nan = float("nan")
    for c in cands:
        if deadline is not None and time.monotonic() > deadline:
            skipped.append(config_label(c))
            continue
        row = dict(label=config_label(c), config=config_dict(c), split=0, programs=0,
                   median_ms=nan, p20_ms=nan, p80_ms=nan, peak_mib="", max_rel_diff=nan)
        try:
            if c.waves > 1:
                if honours is None:
                    honours = split_of(dataclasses.replace(c, waves=1)) != split_of(
                        dataclasses.replace(c, waves=1 << 12))
                if not honours:
                    row["status"] = ("no-effect: the plan does not pass Config.waves to _split "
                                     "(kernels/nac_triton.py fwd_plan/bwd_plan)")
                elif split_of(c) == split_of(dataclasses.replace(c, waves=1)):
                    row["status"] = "same plan as waves 1"
            if "status" not in row:
                m = measure(c)
                out = m.pop("outputs", None)  # None: refused before timing (its status says)
                row.update(m)
                if out is not None:
                    diff = max(_rel_diff(out[k], base_out[k]) for k in base_out)
                    row["max_rel_diff"] = diff
                    row["status"] = ("ok" if diff <= tol
                                     else f"mismatch ({diff:.2e} > {tol:g})")
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a finding, not a stop
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            row["status"] = f"error: {type(exc).__name__}: {first}"
        rows.append(row)
        if progress is not None:
            progress()
    ok = [r for r in rows if r["status"] == "ok"]
    winner = min(ok, key=lambda r: r["median_ms"]) if ok else None
    return dict(default=default_row, rows=rows, winner=winner, skipped=skipped)


def make_entry(kernel: str, case: Case, precision: str, result: dict) -> Optional[dict]:
    """A table entry from tune_key's result (None when no candidate passed), with the figures
    that chose it: the winner's and the built-in configuration's timings, every candidate's."""
    from . import nac_triton as NT
    w = result["winner"]
    if w is None:
        return None
    d = result["default"]
    r6 = lambda x: round(float(x), 6)  # noqa: E731 - ms to the nanosecond
    return dict(kernel=kernel, dtype=dtype_name(case.dtype), D=case.D,
                block_d=NT.block_d(case.D), precision=precision, kind=case.kind,
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


def _not_recording():
    """The first-use autotune runs while the op records its plan (kernels/launch.py Plan notes
    every buffer made meanwhile): the autotune's own plans' buffers must not join it."""
    from .launch import not_recording
    return not_recording()


def first_use_autotune(kernel, dtype, D, kind, n, N, device, target) -> Table:
    """Time the candidates of one key at the call's shape on `device` and add the winner to this
    device's cache file (created if needed); returns the cache's table."""
    if device is None:
        raise RuntimeError("the first-use autotune needs the call's device")
    cuda = device.type == "cuda"  # (CPU tensors under the interpreter: the tests)
    if cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{ENV_AUTOTUNE}=1: the first call of a new shape class ({kernel}, {dtype}, D={D}, "
            f"{kind}, n={n}, N={N}) came inside a CUDA graph capture, where kernels cannot be "
            "timed: make one call outside the capture first, or unset " + ENV_AUTOTUNE)
    from . import nac_triton as NT
    name = _device_name(device)
    path = cache_path(name, target.arch)
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # older torch: no fake mode to leave
        unset_fake_temporarily = contextlib.nullcontext
    case = Case(kind, n, N if kind == "queue" else n, D, dtype)
    prec = NT._dot_consts(dtype, D, device)["PRECISION"]
    t0 = time.perf_counter()
    with unset_fake_temporarily(), _not_recording(), (
            torch.cuda.device(device) if cuda else contextlib.nullcontext()):
        res = tune_key(kernel, case, device, target,
                       [c for c in candidates(kernel, dtype, D)
                        if _fits(c, kernel, dtype, D, target)])
    entry = make_entry(kernel, case, prec, res)
    data = load_table(path).data if os.path.exists(path) else table_header(
        target.arch, name, target.sms, gpu=cuda)
    if entry is not None:
        data["entries"] = [e for e in data["entries"] if not (
            (e["kernel"], e["dtype"], e["block_d"], e["precision"], e["kind"],
             e["size_class"]) == (entry["kernel"], entry["dtype"], entry["block_d"],
                                  entry["precision"], entry["kind"], entry["size_class"]))]
        data["entries"].append(entry)
        write_table(path, data)
    announce(f"first-use autotune of {kernel} {dtype_name(dtype)} D={D} {kind} n={n} N={N} "
             f"took {time.perf_counter() - t0:.1f} s: "
             + (f"{config_label(entry_config(entry))}, {entry['median_ms']:.3f} ms "
                f"({entry['speedup']:.2f}x the built-in configuration)" if entry else
                "no candidate passed its check; the built-in configuration stays")
             + f"; cached in {path}")
    return load_table(path) if os.path.exists(path) else validate(data, path)
