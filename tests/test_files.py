"""nac_fast/_files.py: atomic_folder, the one way the scripts that write a whole folder
(make_synthetic_folders, make_ilsvrc_tree, make_image_folder) put it in place."""
import os

import pytest

from nac_fast._files import atomic_folder


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, fs in os.walk(path) for f in fs)


def _siblings(parent):
    return sorted(os.listdir(parent))


def test_a_new_folder_appears_whole(tmp_path):
    out = tmp_path / "a" / "out"
    with atomic_folder(str(out)) as tmp:
        assert not os.path.exists(out) and os.path.dirname(tmp) == str(out.parent)
        os.makedirs(os.path.join(tmp, "train"))
        open(os.path.join(tmp, "train", "x.png"), "w").close()
    assert _tree(out) == ["train/x.png"] and _siblings(out.parent) == ["out"]


@pytest.mark.parametrize("before", ["empty", "full", "file"])
def test_what_was_there_is_replaced_only_once_the_new_folder_is_complete(tmp_path, before):
    out = tmp_path / "out"
    if before == "empty":
        out.mkdir()
    elif before == "full":
        out.mkdir()
        (out / "old.txt").write_text("old")
    else:
        out.write_text("a file")
    with atomic_folder(str(out)) as tmp:
        # while the new one is written, the old one is untouched
        assert (before != "full" or (out / "old.txt").read_text() == "old")
        open(os.path.join(tmp, "new.txt"), "w").close()
    assert _tree(out) == ["new.txt"] and _siblings(tmp_path) == ["out"]


@pytest.mark.parametrize("before", [None, "full"])
def test_a_failure_leaves_out_as_it_was_and_no_temporary_folder(tmp_path, before):
    out = tmp_path / "out"
    if before:
        out.mkdir()
        (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_folder(str(out)) as tmp:
            open(os.path.join(tmp, "half.png"), "w").close()
            raise KeyboardInterrupt
    assert _siblings(tmp_path) == (["out"] if before else [])
    if before:
        assert _tree(out) == ["old.txt"]


def test_a_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".tmp-out-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        with atomic_folder(str(out)) as tmp:
            open(os.path.join(tmp, "new.txt"), "w").close()
    assert _tree(out) == ["old.txt"] and _siblings(tmp_path) == ["out"]
