"""In-process train.py runs for the training tests (tests/test_train_cli.py, test_train_exit.py,
test_train_resume.py): the small synthetic recipe, train.main with its output captured, and the
refusal every usage error must be (exit status 2, one error line naming the file or the option,
never a traceback, and --out left as it was)."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402

SMALL = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--code-dim", "16",
         "--log-every", "1", "--no-progress"]


def main_captured(argv):
    """(status, stdout, stderr) of train.main(argv); an exception (status 1) fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, out.getvalue(), err.getvalue()


def snapshot(d):
    """{file name: (sha256, mtime_ns)} of the plain files in folder d."""
    snap = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                snap[name] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return snap


def refused(argv, out, *parts):
    """argv exits with status 2, one error line holding `parts`, nothing in `out` changed."""
    before = snapshot(out) if os.path.isdir(out) else None
    status, _, err = main_captured(argv)
    assert status == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], lines[0]
    assert err.rstrip().splitlines()[-1].startswith("train.py: exit status 2 (")
    if before is not None:
        assert snapshot(out) == before
    return lines[0]
