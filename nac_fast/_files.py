"""Atomic file writes (nac_fast.train: config.json, status.json; nac_fast.eval, nac_fast.index:
reports, indexes, CSVs, PNGs): a temporary file in the target's folder, fsync, then a rename,
so the target is always the old file or the complete new one and a failure leaves no
temporary file behind (the same protocol as nac_fast/train/checkpoint.py's save_atomic, for
files that are not torch pickles)."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


def check_new_file(flag: str, path: str, overwrite: bool, *, error=ValueError) -> None:
    """Refuse an output file ``path`` (named by the option ``flag``) that would replace one
    already there unless ``overwrite`` (nothing of the user's is replaced without being asked),
    that names a folder, or that could not be written (:func:`check_writable`: a parent that is
    not a folder, a folder where no file can be created); raises ``error`` naming ``flag``.
    Callers check before any work, so a refusal costs nothing."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{flag} {path!r} is a directory; name a file")
    if os.path.lexists(path) and not overwrite:
        raise error(f"{flag} {path!r} exists; pass --overwrite to replace it")
    check_writable(flag, path, error=error)


def check_writable(flag: str, path: str, *, error=ValueError) -> None:
    """Refuse an output file ``path`` (named by the option ``flag``) that could not be written:
    a path component that exists but is not a folder, or a nearest existing folder in which no
    file can be created (read-only, no permission, /proc, ...); raises ``error`` naming
    ``flag``.  The folders still missing are not created here (``atomic_write`` makes them).
    Found by creating (and removing) a temporary file, so it holds for root too.  Callers check
    before any work (:func:`check_new_file` includes it), so a long run cannot fail at its end."""
    path = os.path.abspath(os.fspath(path))
    d = os.path.dirname(path)
    while not os.path.lexists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise error(f"{flag} {path!r}: {d!r} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-write-check.", dir=d)
    except OSError as exc:
        raise error(f"{flag} {path!r}: cannot write in {d!r} "
                    f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write_all(items) -> None:
    """Write several files all or none: ``items`` is a list of ``(path, write, mode)`` as for
    :func:`atomic_write`.  Every file is written to a temporary file in its target's folder
    first; only when all are complete are they renamed into place, so a failure while writing
    (a full disk, an error of one ``write``) leaves every target as it was and no temporary
    file."""
    done = []  # (tmp, path) of the complete temporary files
    try:
        for path, write, mode in items:
            path = os.path.abspath(os.fspath(path))
            d = os.path.dirname(path)
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=d)
            done.append((tmp, path))
            with os.fdopen(fd, mode) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        for tmp, _ in done:
            os.chmod(tmp, 0o666 & ~umask)
        for i, (tmp, path) in enumerate(done):
            os.replace(tmp, path)
            done[i] = (None, path)
    except BaseException:
        for tmp, _ in done:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
        raise


def atomic_write(path: str, write, *, mode: str = "wb") -> None:
    """Call ``write(f)`` on a temporary file opened with ``mode`` ("wb" or "w"), then rename it
    to ``path`` (replacing what is there: callers decide whether they may)."""
    atomic_write_all([(path, write, mode)])


@contextlib.contextmanager
def atomic_folder(out: str):
    """Yield a new empty temporary folder beside ``out`` to fill. On a normal exit it takes the
    place of ``out`` whole: an empty folder at ``out`` is removed first; anything else there is
    moved aside, and deleted only once the new folder is in place (put back if that rename
    fails), so callers decide beforehand whether they may replace it (--overwrite). On an
    exception the temporary folder is deleted and ``out`` is left as it was."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=parent)
    try:
        yield tmp
        old = None
        if os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out):
            os.rmdir(out)
        elif os.path.lexists(out):
            old = tempfile.mkdtemp(prefix=".old-" + os.path.basename(out) + "-", dir=parent)
            os.rename(out, os.path.join(old, "x"))
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(os.path.join(old, "x"), out)
                os.rmdir(old)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
