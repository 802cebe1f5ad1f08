"""A copy of this checkout for the install tests: tracked and untracked-but-not-ignored files."""
from __future__ import annotations

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_tree(dst: str) -> str:
    """The checkout's tracked and untracked-but-not-ignored files (no builds, no venv), copied
    into dst; returns dst."""
    files = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for f in files:
        src = os.path.join(ROOT, f)
        if os.path.isfile(src):
            os.makedirs(os.path.join(dst, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, f))
    return dst
