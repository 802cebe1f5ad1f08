"""Audit of train.py as a user drives it: recipes that cannot be read, --resume of a checkpoint
whose model is not the one the flags build, or whose contents are malformed, and what the summary
says when a resumed run has nothing to do.  Every failure is exit status 2 with one message naming
the file or the option, never a traceback, and --out is left as it was.  In-process runs of a few
steps on synthetic data (train.main), as tests/test_train_exit.py does."""
import contextlib
import errno
import hashlib
import io
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint  # noqa: E402
from nac_fast.train.config import UsageError, parse  # noqa: E402

SMALL = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--code-dim", "16",
         "--log-every", "1", "--no-progress"]


def _main(argv):
    """(status, stdout, stderr) of train.main(argv); an exception (status 1) fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, out.getvalue(), err.getvalue()


def _snapshot(d):
    snap = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                snap[name] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return snap


def _refused(argv, out, *parts):
    """argv exits with status 2, one error line holding `parts`, nothing in `out` changed."""
    before = _snapshot(out) if os.path.isdir(out) else None
    status, _, err = _main(argv)
    assert status == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], lines[0]
    assert err.rstrip().splitlines()[-1].startswith("train.py: exit status 2 (")
    if before is not None:
        assert _snapshot(out) == before
    return lines[0]


@pytest.fixture(scope="module")
def fixed_gains(tmp_path_factory):
    """A finished 3-step run of the small recipe's heads with fixed gains (--no-learn-gain)."""
    out = str(tmp_path_factory.mktemp("fixed") / "run")
    status, _, err = _main(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out])
    assert status == 0, err
    return out


# ---- --resume with flags that build another model ------------------------------------------------

@pytest.mark.parametrize("extra,key", [
    (["--learn-gain"], "learn_gain"),          # the gains become parameters: other state keys
    (["--no-head-bn"], "head_bn"),             # the code head's BatchNorm buffers go
    (["--no-infer-bn"], "infer_bn"),
    (["--config", os.path.join(ROOT, "configs", "fashion_mnist_paper.toml")], "head_bn"),
    (["--no-scale-codes"], "scale_codes"),     # same state keys, codes sqrt(D) times larger
    (["--a-gain", "3"], "a_gain"),             # a fixed gain is part of the model
])
def test_resume_with_flags_that_build_another_model_is_refused(fixed_gains, tmp_path, extra,
                                                               key):
    out = str(tmp_path / "run")
    shutil.copytree(fixed_gains, out)
    _refused(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out, "--resume"] + extra,
             out, "--resume", "last.pt", f"{key}=")


def test_resume_with_an_image_size_across_the_small_stem_is_refused(fixed_gains, tmp_path):
    """--image-size is an augmentation flag a resumed run may change, but a ResNet's stem
    follows it (3x3 stride 1 up to 64 px, else 7x7/2): the weights no longer fit."""
    out = str(tmp_path / "run")
    shutil.copytree(fixed_gains, out)
    msg = _refused([a if a != "8" else "72" for a in SMALL]
                   + ["--no-learn-gain", "--max-steps", "3", "--out", out, "--resume"],
                   out, "--resume", "last.pt", "do not fit")
    assert "conv1" in msg


def test_resume_may_change_what_is_not_the_model(fixed_gains, tmp_path):
    """The positive control: the inference net's initialisation (used once, at a fresh start)
    and the lr are not the checkpoint's model."""
    out = str(tmp_path / "run")
    shutil.copytree(fixed_gains, out)
    status, stdout, err = _main(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out,
                                         "--resume", "--infer-init", "independent",
                                         "--lr", "0.2"])
    assert status == 0, err
    assert "nothing to train" in stdout


# ---- --resume of a checkpoint with malformed contents --------------------------------------------

def _drop_first_weight(ck):
    ck["model"] = dict(ck["model"])
    ck["model"].pop(next(iter(ck["model"])))


MALFORMED = {
    "no_total_steps": (lambda ck: ck["config"].pop("total_steps"), "total_steps"),
    "no_run_id": (lambda ck: ck["config"].pop("run_id"), "run_id"),
    "config_list": (lambda ck: ck.__setitem__("config", [1, 2]), "config"),
    "step_str": (lambda ck: ck.__setitem__("step", "3"), "step"),
    "rng_empty": (lambda ck: ck.__setitem__("rng", []), "rng"),
    "model_short": (_drop_first_weight, "do not fit"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("how", ["path", "auto"])
def test_resume_of_a_malformed_checkpoint_is_status_2(fixed_gains, tmp_path, case, how):
    edit, part = MALFORMED[case]
    ck = load_checkpoint(os.path.join(fixed_gains, "last.pt"), require=())
    ck["config"] = dict(ck["config"])
    edit(ck)
    if how == "path":       # --resume PATH into a new --out: the folder is not made
        path = str(tmp_path / "odd.pt")
        torch.save(ck, path)
        out = str(tmp_path / "new")
        _refused(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out, "--resume", path],
                 out, repr(path) if case == "config_list" else path, part)
        assert not os.path.exists(out)
    else:                   # --resume: the one checkpoint in --out
        out = str(tmp_path / "run")
        os.makedirs(out)
        torch.save(ck, os.path.join(out, "last.pt"))
        _refused(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out, "--resume"],
                 out, "last.pt", part)


# ---- recipes that cannot be read -----------------------------------------------------------------

def test_a_recipe_that_is_not_utf8_is_a_usage_error(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"batch_size = 32\n# caf\xe9\n")
    with pytest.raises(UsageError, match=r"--config '.*latin1\.toml': not valid TOML"):
        parse(["--config", str(bad)])


def test_an_unreadable_recipe_is_a_usage_error(tmp_path, monkeypatch):
    recipe = tmp_path / "locked.toml"
    recipe.write_text("batch_size = 32\nepochs = 1\n")
    real_open = open

    def deny(f, *a, **k):  # tests run as root here, where chmod does not stop reads
        if str(f) == str(recipe):
            raise PermissionError(errno.EACCES, "Permission denied", str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(UsageError, match=r"--config '.*locked\.toml' cannot be read: "
                                         r".*Permission denied"):
        parse(["--config", str(recipe)])


# ---- the summary of a resumed run with nothing to do ---------------------------------------------

def test_resume_at_stop_at_step_says_so_not_end_of_schedule(tmp_path):
    out = str(tmp_path / "run")
    argv = SMALL + ["--max-steps", "4", "--stop-at-step", "2", "--out", out]
    status, _, err = _main(argv)
    assert status == 0, err
    status, stdout, err = _main(argv + ["--resume"])     # the same command again
    assert status == 0, err
    assert "end of the schedule" not in stdout, stdout
    assert "step 2/4: nothing to train" in stdout and "--stop-at-step 2" in stdout, stdout
    assert "same command plus --resume" not in stdout, stdout   # that is what was just run


# ---- what the recipes say of their numeric queue ------------------------------------------------

@pytest.mark.parametrize("name", ["cifar10.toml", "imagenet.toml", "imagenet_nac_mq.toml"])
def test_a_recipe_queue_is_a_multiple_of_the_batch_as_its_comment_says(name):
    """A recipe's queue_size of a number is held to the rule of a typed --queue-size (a
    multiple of the global batch, error naming the recipe key), not rounded down to one: the
    recipe's own comment must not promise the rounding."""
    path = os.path.join(ROOT, "configs", name)
    with open(path) as f:
        line = next(ln for ln in f if ln.startswith("queue_size"))
    assert "rounded down" not in line, line
    with pytest.raises(UsageError, match=rf"queue_size \(recipe .*{name}\) \d+ must be a "
                                         "multiple of the global batch 768"):
        parse(["--config", path, "--method", "nac-mq", "--data", "synthetic:4096",
               "--batch-size", "768"])


# ---- --resume on data that changed since the checkpoint ------------------------------------------

def test_resume_on_a_data_folder_that_grew_is_refused(tmp_path):
    """The same --data name, more images (a folder added to between the launches): the epoch,
    the batch position and the data order of the checkpoint's step are no longer the ones it
    saved, so the run cannot continue exactly, and (--max-steps fixed) nothing else says so."""
    import glob
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    root = tmp_path / "folder"
    write_jpeg_folder(str(root / "train"), num_classes=2, per_class=8, size_range=(24, 28))
    out = str(tmp_path / "run")
    argv = ["--data", str(root), "--image-size", "8", "--batch-size", "8", "--code-dim", "16",
            "--max-steps", "6", "--loader", "torchvision", "--workers", "0", "--no-progress",
            "--out", out]
    status, _, err = _main(argv + ["--stop-at-step", "2"])
    assert status == 0, err
    write_jpeg_folder(str(tmp_path / "more"), num_classes=2, per_class=8, size_range=(24, 28))
    for cls in os.listdir(root / "train"):
        for i, f in enumerate(sorted(glob.glob(str(tmp_path / "more" / cls / "*")))):
            shutil.copy(f, root / "train" / cls / f"extra{i}.jpg")
    _refused(argv + ["--resume"], out, "--resume", "num_images=16", "32")


# ---- --seed: its range, and the synthetic loader at a large one -----------------------------------

@pytest.mark.parametrize("seed", [-1, 2**32, 2**62])
def test_a_seed_out_of_range_is_a_usage_error(tmp_path, seed):
    """Bug: --seed 2**62 died in torch.manual_seed(seed * 1000 + rank) with "Overflow when
    unpacking long long" (a traceback), after the start line."""
    out = str(tmp_path / "run")
    _refused(SMALL + ["--max-steps", "1", "--seed", str(seed), "--out", out], out, "--seed",
             "[0, 4294967295]")
    assert not os.path.exists(out)


def test_the_largest_seed_trains_on_synthetic_data(tmp_path):
    """Bug: from --seed ~1.2e9 the synthetic loader's derived seeds ((seed * 7919 + epoch) *
    1000003 + i) * 2 + v overflowed torch's 64 bits, and the error blamed --data.  They are
    reduced mod 2**64 beyond that range; smaller ones are unchanged (the same images)."""
    from nac_fast.data.sources.synthetic_pairs import SyntheticPairLoader, _fit
    status, _, err = _main(SMALL + ["--max-steps", "1", "--seed", str(2**32 - 1),
                                    "--out", str(tmp_path / "run")])
    assert status == 0, err
    assert _fit(12345) == 12345 and _fit(-5) == -5 and _fit(2**64 + 7) == 7
    small = SyntheticPairLoader(num_images=16, batch_size=8, seed=3, image_size=8)
    first = next(iter(small))
    ref = torch.Generator().manual_seed(3 * 31 + 0)   # the formula as it was
    order = torch.randperm(16, generator=ref)
    assert torch.equal(first[0][0], small._view(small._image(int(order[0])), int(order[0]), 0))


# ---- every switch a recipe sets can be undone on the command line ---------------------------------

def test_a_recipe_switch_is_undone_by_its_opposite_flag(tmp_path):
    """Bug: --sync-bn, --tensorboard, --no-shuffle-bn, --no-scale-codes and --no-progress had no
    opposite, so a recipe that set them could not be overridden although "any flag given
    wins"."""
    recipe = tmp_path / "r.toml"
    recipe.write_text("sync_bn = true\ntensorboard = true\nshuffle_bn = false\n"
                      "scale_codes = false\nprogress = false\n")
    base = ["--config", str(recipe), "--data", "synthetic:64", "--batch-size", "16",
            "--max-steps", "2"]
    cfg = parse(base + ["--no-sync-bn", "--no-tensorboard", "--shuffle-bn", "--scale-codes",
                        "--progress"])
    assert (cfg.sync_bn, cfg.tensorboard, cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (
        False, False, True, True, True)
    cfg = parse(base + ["--no-sync-bn", "--no-tensorboard"])   # the recipe's values otherwise
    assert (cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (False, False, False)
    with pytest.raises(UsageError, match=r"sync_bn \(recipe .*r\.toml\) needs several"):
        parse(base + ["--no-tensorboard"])
    cfg = parse(["--data", "synthetic:64", "--batch-size", "16", "--max-steps", "2",
                 "--no-shuffle-bn", "--no-scale-codes", "--no-progress"])  # the old spellings
    assert (cfg.shuffle_bn, cfg.scale_codes, cfg.progress) == (False, False, False)


# ---- --overwrite takes the other run's TensorBoard curves too -------------------------------------

def test_overwrite_deletes_the_other_runs_tensorboard_events_only(tmp_path):
    """Bug: --overwrite kept OUT/tensorboard/, so the new run's curves were drawn on top of the
    replaced run's.  Its event files go; anything else of the user's there stays."""
    out = tmp_path / "run"
    status, _, err = _main(SMALL + ["--max-steps", "2", "--out", str(out)])
    assert status == 0, err
    tb = out / "tensorboard"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host.1.0").write_bytes(b"old curves")
    status, _, err = _main(SMALL + ["--max-steps", "2", "--out", str(out), "--overwrite"])
    assert status == 0, err
    assert not tb.exists()
    tb.mkdir()
    (tb / "events.out.tfevents.2.host.1.0").write_bytes(b"old curves")
    (tb / "notes.txt").write_text("mine")
    status, _, err = _main(SMALL + ["--max-steps", "2", "--out", str(out), "--overwrite"])
    assert status == 0, err
    assert sorted(os.listdir(tb)) == ["notes.txt"]


@pytest.mark.parametrize("loader", ["dali-cpu", "dali-gpu"])
def test_a_dali_loader_on_synthetic_data_is_refused(tmp_path, loader):
    """--loader dali-gpu on synthetic data was silently ignored (the in-memory pairs were used),
    while an in-memory data set refuses a DALI loader by name."""
    out = str(tmp_path / "run")
    _refused(SMALL + ["--max-steps", "1", "--loader", loader, "--out", out], out, "--loader",
             loader, "in memory")


def test_a_resumed_runs_log_time_goes_on_from_its_checkpoint(tmp_path):
    """A resumed run's log.jsonl started elapsed_s at 0 again, so its time axis jumped back at
    every resume.  The checkpoint keeps the run's elapsed_s; the resumed log goes on from it."""
    import json
    out = tmp_path / "run"
    argv = SMALL + ["--max-steps", "4", "--save-every", "2", "--out", str(out)]
    status, _, err = _main(argv + ["--stop-at-step", "2"])
    assert status == 0, err
    ck = load_checkpoint(str(out / "last.pt"))
    recs = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    before = ck["elapsed_s"]
    assert before >= recs[-1]["elapsed_s"] > 0
    status, _, err = _main(argv + ["--resume"])
    assert status == 0, err
    recs = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    resumed = [r for r in recs if r["step"] > 2]
    assert resumed and all(r["elapsed_s"] > before for r in resumed), (before, resumed)
    assert load_checkpoint(str(out / "last.pt"))["elapsed_s"] > before
