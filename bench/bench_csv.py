"""The bench scripts' CSV helpers (bench_loss, bench_hamming, bench_index, precision_table,
host_overhead, split_emulation): one appender that keeps rows aligned with their header, and one
check of an output path made before any measurement.

(Not named _csv.py: bench/ is first on sys.path when a bench script runs, and a bench/_csv.py
would shadow the standard library's _csv module that `import csv` loads.)
"""
from __future__ import annotations

import csv
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nac_fast._files import atomic_write, check_writable  # noqa: E402


def read_csv_rows(path):
    """(header, rows) of an existing CSV, ([], []) if there is none."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def csv_problem(path):
    """Why the existing CSV `path` could not be appended to without damaging it, or None (no
    file, an empty one, a readable CSV): not text, no header line, a row with more values than
    the header (its extra values would have no column)."""
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
    """Append rows (dicts; missing keys are written empty) to the CSV `path` with columns
    `fields`; a CSV with another header is rewritten first with fields (+ its own extra columns),
    so its old rows keep their values and the columns stay aligned.  The folder is made.
    All or nothing: the new file is written whole beside the old one and renamed over it
    (nac_fast._files.atomic_write), so an error (a damaged CSV: ValueError naming it, a row with
    a column not in the header, a full disk) leaves the old file as it was; a last line without
    its newline (a cut row) keeps its own line."""
    why = csv_problem(path)
    if why:
        raise ValueError(f"CSV {path!r} {why}: not appending to it (repair it or give another "
                         "--csv)")
    header, old = read_csv_rows(path)
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


def output_file_problem(flag: str, path: str, csv_file: bool = True):
    """Why the output file `path` (option `flag`) could not be written, or None: a folder, a
    path under a file, a place where no file can be created (nac_fast._files.check_writable),
    and for a CSV to append to (`csv_file`) an existing one that is damaged (csv_problem).
    A bare file name is the current folder's; an empty path names no file (a script that takes
    '' as "no file" does not check it)."""
    if not path:
        return f"{flag} is empty; give a file path"
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder; give a file path"
    try:
        check_writable(flag, path)
    except ValueError as exc:
        return str(exc)
    why = csv_problem(path) if csv_file else None
    return f"{flag} {path!r} {why}" if why else None


def check_output_file(ap, flag: str, path: str, csv_file: bool = True) -> None:
    """ap.error (exit status 2) naming `flag` when `path` could not be written (output_file_problem;
    csv_file=False for an output that is not a CSV appended to); call it right after parse_args,
    before any measurement."""
    why = output_file_problem(flag, path, csv_file)
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
