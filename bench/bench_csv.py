"""The bench scripts' CSV helpers (bench_loss, bench_hamming, bench_index, precision_table,
host_overhead, split_emulation): one appender that keeps rows aligned with their header, and one
check of an output path made before any measurement.

(Not named _csv.py: bench/ is first on sys.path when a bench script runs, and a bench/_csv.py
would shadow the standard library's _csv module that `import csv` loads.)
"""
from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import check_writable  # noqa: E402


def read_csv_rows(path):
    """(header, rows) of an existing CSV, ([], []) if there is none."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def append_rows(path, rows, fields):
    """Append rows (dicts; missing keys are written empty) to the CSV `path` with columns
    `fields`; a CSV with another header is rewritten first with fields (+ its own extra columns),
    so its old rows keep their values and the columns stay aligned.  The folder is made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    header, old = read_csv_rows(path)
    if header and header != list(fields):
        cols = list(fields) + [c for c in header if c not in fields]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(old)
        fields = cols
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if not header:
            w.writeheader()
        w.writerows(rows)


def output_file_problem(flag: str, path: str):
    """Why the output file `path` (option `flag`) could not be written, or None: a folder, a
    path under a file, a place where no file can be created (nac_fast._files.check_writable).
    A bare file name is the current folder's."""
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder; give a file path"
    try:
        check_writable(flag, path)
    except ValueError as exc:
        return str(exc)
    return None


def check_output_file(ap, flag: str, path: str) -> None:
    """ap.error (exit status 2) naming `flag` when `path` could not be written; call it right
    after parse_args, before any measurement."""
    why = output_file_problem(flag, path)
    if why:
        ap.error(why)


def check_output_folder(ap, flag: str, path: str) -> None:
    """ap.error naming `flag` when files could not be written in the folder `path` (existing or
    to be made): a file there, a path under a file, an unwritable place."""
    if os.path.lexists(path) and not os.path.isdir(path):
        ap.error(f"{flag} {path!r} is not a folder")
    try:
        check_writable(flag, os.path.join(path, "x"))
    except ValueError as exc:
        ap.error(str(exc))


def check_least(ap, args, least: dict) -> None:
    """Usage errors (ap.error, exit status 2) for the flags of `least` ({"--flag": least value})
    whose value is below it."""
    for flag, lo in least.items():
        val = getattr(args, flag[2:].replace("-", "_"))
        if val < lo:
            ap.error(f"{flag} must be >= {lo}, got {val}")


def check_flip(ap, args) -> None:
    """--flip: a bit-flip probability in [0, 0.5] (0.5: codes unrelated to their class)."""
    if not 0.0 <= args.flip <= 0.5:
        ap.error(f"--flip: a bit-flip probability in [0, 0.5], got {args.flip}")
