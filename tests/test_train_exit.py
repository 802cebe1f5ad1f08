"""What a user keeps and reads when train.py starts, refuses to start, or ends (docs/training.md
"Reading a run", "Fault tolerance"): a run is never replaced by another, --resume with nothing
to resume says so, an unwritable --out gives status 4 in one line, the status survives torchrun,
--help shows the values a run uses, config.json is the one resolved configuration, and the last
lines say what the loss means and what to run next; --overwrite takes the replaced run's
TensorBoard events and nothing else of the user's.  Subprocess runs of train.py (and torchrun),
as a user types them, where that is what is tested."""
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint, load_model, save_atomic  # noqa: E402
from nac_fast.train.config import TrainConfig, parse  # noqa: E402
from nac_fast.train.monitor import reference_line  # noqa: E402

from _train_main import SMALL, main_captured as _main, snapshot as _snapshot  # noqa: E402

STATUS_LINE = re.compile(r"^train\.py: exit status (\d+) \(")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID"):
        env.pop(k, None)
    return env


def _train(args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py")] + args, env=_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _last_line(text):
    return text.rstrip().splitlines()[-1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run (in-process), with its printed summary."""
    out = str(tmp_path_factory.mktemp("done") / "run")
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert train.main(SMALL + ["--max-steps", "3", "--out", out]) == 0
    return out, buf.getvalue()


# ---- a run is never replaced by another ---------------------------------------------------------

def test_fresh_run_into_a_run_stops_before_touching_it(finished, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(finished[0], out)
    before = _snapshot(out)
    assert {"last.pt", "log.jsonl", "config.json"} <= set(before)
    r = _train(SMALL + ["--max-steps", "3", "--out", out])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    msg = [ln for ln in r.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(msg) == 1, r.stderr
    for part in (repr(out), "holds a run", "--resume", "new --out", "--overwrite",
                 "nothing was changed"):
        assert part in msg[0], msg[0]
    assert STATUS_LINE.match(_last_line(r.stderr)).group(1) == "2"
    assert _snapshot(out) == before                      # not a byte, not a timestamp changed
    # --overwrite replaces it: a new run id, a log of the new run only, no prev.pt of the old one
    old_id = json.load(open(os.path.join(out, "config.json")))["run_id"]
    save_atomic(load_checkpoint(os.path.join(out, "last.pt")), os.path.join(out, "prev.pt"))
    assert train.main(SMALL + ["--max-steps", "2", "--out", out, "--overwrite"]) == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["run_id"] != old_id and cfg["overwrite"] is True
    assert [json.loads(x)["step"] for x in open(os.path.join(out, "log.jsonl"))] == [1, 2]
    assert not os.path.exists(os.path.join(out, "prev.pt"))
    assert load_checkpoint(os.path.join(out, "last.pt"))["step"] == 2


def test_resume_with_nothing_to_resume_stops(tmp_path, capsys):
    out = str(tmp_path / "absent")
    r = _train(SMALL + ["--max-steps", "2", "--out", out, "--resume"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--out {out!r} holds no checkpoint to resume" in r.stderr, r.stderr
    assert "leave out --resume" in r.stderr
    assert STATUS_LINE.match(_last_line(r.stderr)).group(1) == "2"
    assert not os.path.exists(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train.main(SMALL + ["--max-steps", "2", "--out", str(empty), "--resume"]) == 2
    assert "holds no checkpoint to resume" in capsys.readouterr().err
    assert os.listdir(empty) == []


def test_resume_and_overwrite_contradict(tmp_path, capsys):
    assert train.main(SMALL + ["--out", str(tmp_path), "--resume", "--overwrite"]) == 2
    assert "--resume and --overwrite contradict" in capsys.readouterr().err


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


# ---- two runs at once into one --out: exactly one runs (the lock) ----------------------------------

STARTER = """import os, sys, time
sys.path.insert(0, {root!r})
import train  # TEST ONLY: imported first, then every starter calls main() at the same moment
open({ready!r}, "w").close()
while not os.path.exists({go!r}):
    time.sleep(0.01)
sys.exit(train.main({args!r}))
"""


@pytest.mark.slow
def test_two_runs_started_at_once_into_one_out_exactly_one_runs(tmp_path):
    """Two train.py processes, both past their imports, call main() within milliseconds of each
    other into one empty --out: both would pass a check of the folder; the lock lets one in."""
    out = tmp_path / "run"
    out.mkdir()
    args = SMALL + ["--max-steps", "30", "--save-every", "10", "--out", str(out)]
    procs = []
    for i in range(2):
        script = tmp_path / f"start{i}.py"
        script.write_text(STARTER.format(root=ROOT, ready=str(tmp_path / f"ready{i}"),
                                         go=str(tmp_path / "go"), args=args))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    (tmp_path / "go").touch()
    res = [(p.wait(300), *p.communicate()) for p in procs]
    assert sorted(rc for rc, _, _ in res) == [0, 2], res
    (_, _, err), = [r for r in res if r[0] == 2]
    msg = [ln for ln in err.splitlines() if ln.startswith("train.py: error:")]
    assert len(msg) == 1 and f"--out {str(out)!r} is in use by another train.py run" in msg[0] \
        and "nothing was changed" in msg[0], err
    assert STATUS_LINE.match(_last_line(err)).group(1) == "2"
    # one run's files, one log, the lock file gone with the run
    assert sorted(os.listdir(out)) == ["config.json", "last.pt", "log.jsonl", "prev.pt",
                                       "status.json"]
    assert [json.loads(x)["step"] for x in open(out / "log.jsonl")] == list(range(1, 31))
    assert json.load(open(out / "status.json"))["status"] == 0


def test_run_lock_is_taken_before_the_folder_is_read(tmp_path, capsys):
    """A run holding --out (its lock): another stops at once with status 2 and touches nothing,
    also with --overwrite; a run killed with its lock file left behind does not block the next
    (the kernel dropped the lock)."""
    from nac_fast.train.run import LOCK, RunLock
    out = str(tmp_path / "run")
    os.makedirs(out)
    held = RunLock.acquire(out)
    try:
        before = _snapshot(out)
        for extra in ([], ["--overwrite"]):
            assert train.main(SMALL + ["--max-steps", "2", "--out", out] + extra) == 2
            err = capsys.readouterr().err
            assert "is in use by another train.py run" in err and f"pid {os.getpid()}" in err
            assert _snapshot(out) == before
    finally:
        held.release()
    assert os.listdir(out) == []
    with open(os.path.join(out, LOCK), "w") as f:        # what a kill -9 leaves
        f.write("pid 1 on elsewhere\n")
    assert train.main(SMALL + ["--max-steps", "2", "--out", out]) == 0
    assert LOCK not in os.listdir(out)


# ---- an unwritable --out at start-up: status 4, one line ----------------------------------------

def _read_only_command(ro_dir, cmds):
    """`cmds` (shell lines) run with `ro_dir` read-only: chmod 555 for a normal user; as root
    (which writes through mode bits) a read-only bind mount in a private mount namespace.  None
    where neither can be had."""
    if os.geteuid() != 0:
        for d, _, _ in os.walk(ro_dir):
            os.chmod(d, 0o555)
        return ["sh", "-c", "; ".join(cmds)]
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {ro_dir} {ro_dir} && "
                            f"mount -o remount,bind,ro {ro_dir} && ! touch {ro_dir}/.probe"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None
    return ["unshare", "-m", "sh", "-c", f"mount --bind {ro_dir} {ro_dir} && mount -o "
            f"remount,bind,ro {ro_dir} && " + "; ".join(cmds)]


@pytest.mark.slow
def test_unwritable_out_at_start_up_is_status_4(finished, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(finished[0], ro / "done")
    before = _snapshot(ro / "done")
    py = f"{shlex.quote(sys.executable)} {shlex.quote(os.path.join(ROOT, 'train.py'))}"
    small = " ".join(SMALL + ["--max-steps", "4"])
    cmds = [f"{py} {small} --out {ro}/new 2>{tmp_path}/new.err; echo $? > {tmp_path}/new.rc",
            f"{py} {small} --out {ro}/done --resume 2>{tmp_path}/done.err; "
            f"echo $? > {tmp_path}/done.rc"]
    cmd = _read_only_command(str(ro), cmds)
    if cmd is None:
        pytest.skip("no read-only directory here (root without mount namespaces)")
    try:
        subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        for d, _, _ in os.walk(ro):
            os.chmod(d, 0o755)
    for case, folder in (("new", f"{ro}/new"), ("done", f"{ro}/done")):
        err = (tmp_path / f"{case}.err").read_text()
        assert (tmp_path / f"{case}.rc").read_text().strip() == "4", err
        assert "Traceback" not in err, err
        msg = [ln for ln in err.splitlines() if ln.startswith("train.py: error:")]
        assert len(msg) == 1 and f"--out {folder!r} cannot be written" in msg[0], err
        assert STATUS_LINE.match(_last_line(err)).group(1) == "4"
    assert not (ro / "new").exists() and _snapshot(ro / "done") == before


# ---- under torchrun: the message once, last, and the status visible ------------------------------

def _torchrun(args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--local_addr=127.0.0.1", os.path.join(ROOT, "train.py")] + args
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _root_cause(stderr):
    """torchrun's report: the 'Root Cause' block at its end."""
    assert "Root Cause (first observed failure):" in stderr, stderr[-3000:]
    return stderr.rsplit("Root Cause (first observed failure):", 1)[1]


@pytest.mark.slow
def test_torchrun_bad_flag_status_2_printed_once_and_last(tmp_path):
    r = _torchrun(SMALL + ["--flip-prob", "0.7", "--out", str(tmp_path / "o")])
    assert r.returncode == 1  # torchrun's own status for any failed worker
    msg = "--flip-prob must lie in (0, 0.5), got 0.7"
    report = r.stderr.split("Traceback (most recent call last):")[0]  # before torchrun's report
    assert report.count(msg) == 1, r.stderr                 # rank 0 only
    assert any(STATUS_LINE.match(ln) and "status 2" in ln for ln in report.splitlines())
    cause = _root_cause(r.stderr)
    # rank 0 is the root cause with its own exit code; on a loaded machine torchrun may stop it
    # (SIGTERM, -15) after it wrote its error file but before it exited
    assert "rank      : 0" in cause and re.search(r"exitcode  : (2|-15) ", cause), cause
    assert msg in cause and "train.py: exit status 2" in cause, cause
    assert "To enable traceback" not in r.stderr               # every rank wrote its error file
    assert not (tmp_path / "o").exists()


_SKEWED = """
import os, sys, time
from nac_fast.train.run import finish
rank, late = int(os.environ["RANK"]), int(sys.argv[1])
if rank == late:
    time.sleep(float(sys.argv[2]))
sys.exit(finish(2, "the flags are wrong"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("late,delay", [(0, 2.5), (1, 1.0)])
def test_torchrun_root_cause_is_rank_0_whichever_rank_gets_there_first(tmp_path, late, delay):
    """The ranks check the flags on their own, so on a loaded machine one may reach finish()
    seconds before the other: rank 0's message stays the root cause, and every rank leaves a
    record (the CI failure this replaces: rank 1, two seconds early, was the root cause).  Rank 0
    late by 2.5 s: half of the followers' wait (FOLLOWER_EXIT_DELAY_S, 5 s) is left for the two
    processes' start-up skew on a loaded 2-core machine (at 4 s, CI of 2026-11-28 once saw rank
    1's record first: its import finished over a second before rank 0's)."""
    from nac_fast.train.run import FOLLOWER_EXIT_DELAY_S
    assert delay <= FOLLOWER_EXIT_DELAY_S / 2
    script = tmp_path / "skewed.py"
    script.write_text(_SKEWED)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "--local_addr=127.0.0.1", str(script), str(late),
                        str(delay)], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    cause = _root_cause(r.stderr)
    assert "rank      : 0" in cause and "the flags are wrong" in cause, cause
    assert "train.py: exit status 2" in cause, cause
    assert "rank 1 stopped with rank 0 (exit status 2)" in r.stderr, r.stderr[-3000:]
    assert "To enable traceback" not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_unwritable_out_status_4(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    torchrun = (f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone "
                f"--nproc_per_node=2 --local_addr=127.0.0.1 "
                f"{shlex.quote(os.path.join(ROOT, 'train.py'))}")
    cmd = _read_only_command(str(ro), [f"{torchrun} {' '.join(SMALL)} --out {ro}/run "
                                       f"2>{tmp_path}/err; echo $? > {tmp_path}/rc"])
    if cmd is None:
        pytest.skip("no read-only directory here (root without mount namespaces)")
    try:
        subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        os.chmod(ro, 0o755)
    err = (tmp_path / "err").read_text()
    assert (tmp_path / "rc").read_text().strip() == "1", err
    cause = _root_cause(err)
    # rank 0 is the root cause with its message and exit code 4 (or -15 where torchrun stopped
    # it on a loaded machine after it wrote its error file, before it exited)
    assert "rank      : 0" in cause and re.search(r"exitcode  : (4|-15) ", cause), cause
    assert f"--out '{ro}/run' cannot be written" in cause, cause
    assert "train.py: exit status 4" in err.split("Traceback (most recent call last):")[0]


# ---- what --help and config.json say --------------------------------------------------------------

def _help_line(text, flag):
    """The help of one flag, joined over its wrapped lines."""
    m = re.search(rf"^  {re.escape(flag)}\b(.*?)(?=^  -|\Z)", text, re.S | re.M)
    assert m, f"no {flag} in --help"
    return " ".join(m.group(1).split())


def test_help_shows_the_values_a_run_uses_and_the_recipe():
    r = _train(["--help"], timeout=120)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    recipe = os.path.join("configs", "small.toml")
    assert f"the recipe {recipe}" in " ".join(text.split())
    for flag, want in (("--learn-gain", f"[default: True; from {recipe}]"),
                       ("--a-gain", f"[default: 6.0; from {recipe}]"),
                       ("--head-bn", f"[default: True; from {recipe}]"),
                       ("--infer-init", f"[default: copy; from {recipe}]"),
                       ("--batch-size", f"[default: 256; from {recipe}]"),
                       ("--r-gain", "auto = 2(1-2p) x a_gain = 6;"),
                       ("--lr", "= 1.2 at batch 256"),
                       ("--flip-prob", f"[default: 0.25; from {recipe}]"),
                       ("--config", f"[default: {recipe}]")):
        assert want in _help_line(text, flag), (flag, _help_line(text, flag))
    assert not re.search(r"^\s+--p\b", text, re.M) and "--p P" not in text  # an alias only


def test_help_for_an_image_folder_shows_its_recipe(tmp_path, capsys, monkeypatch):
    from nac_fast.data.sources.synthetic import write_jpeg_folder
    write_jpeg_folder(str(tmp_path / "im" / "train"), num_classes=2, per_class=2)
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        parse(["--data", str(tmp_path / "im"), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    recipe = os.path.join("configs", "imagenet.toml")
    assert f"[default: 512; from {recipe}]" in _help_line(out, "--batch-size")
    assert f"[default: 200; from {recipe}]" in _help_line(out, "--epochs")


def test_config_json_is_the_one_resolved_configuration(finished):
    out = finished[0]
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert "config" not in cfg and "p" not in cfg            # one record of the recipe
    assert cfg["recipe"] == os.path.join(ROOT, "configs", "small.toml")
    assert os.path.isfile(cfg["recipe"])
    # every value the run used, resolved: the rules' lr, EMA decay, steps, warm-up, r gain
    assert cfg["lr"] == pytest.approx(0.075 * math.sqrt(16)) and cfg["momentum"] == 0.99
    assert (cfg["total_steps"], cfg["steps_per_epoch"], cfg["warmup_steps"]) == (3, 4, 0)
    assert cfg["r_gain"] == pytest.approx(2 * (1 - 2 * 0.25) * 6.0) and cfg["a_gain"] == 6.0
    assert (cfg["flip_prob"], cfg["image_size"], cfg["in_channels"], cfg["world_size"],
            cfg["amp"], cfg["device"], cfg["workers"]) == (0.25, 8, 3, 1, "off", "cpu", 0)
    assert cfg["run_id"] and cfg["extended"] == []
    # the checkpoint stores the same object; it is a TrainConfig, field for field
    assert load_checkpoint(os.path.join(out, "last.pt"))["config"] == cfg
    assert TrainConfig(**cfg).to_dict() == cfg
    st = json.load(open(os.path.join(out, "status.json")))
    assert (st["status"], st["meaning"], st["step"], st["run_id"]) == (0, "done", 3, cfg["run_id"])


def test_recipe_values_are_checked_and_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = 32\nepochs = 1\nflip_prob = 0.7\n")
    with pytest.raises(ValueError, match=r"flip_prob \(recipe .*bad\.toml\) must lie in"):
        parse(["--config", str(bad)])
    bad.write_text("p = 0.2\n")                                # the flag's name is flip_prob
    with pytest.raises(ValueError, match="unknown or per-run key 'p'"):
        parse(["--config", str(bad)])
    bad.write_text("batch_size = 2.5\n")
    with pytest.raises(ValueError, match="batch_size = 2.5: must be an integer"):
        parse(["--config", str(bad)])
    bad.write_text("flip_prob_final_min_images = 1.5\n")
    with pytest.raises(ValueError, match="flip_prob_final_min_images = 1.5: expected an integer"):
        parse(["--config", str(bad)])
    bad.write_text("flip_prob_final_min_images = true\n")
    with pytest.raises(ValueError, match="flip_prob_final_min_images = True: has the wrong type"):
        parse(["--config", str(bad)])
    bad.write_text('batch_size = 32\nepochs = 1\nflip_prob_final_min_images = "none"\n'
                   'flip_prob_final_min_steps = 7\n')
    c = parse(["--config", str(bad)])
    assert (c.flip_prob_final_min_images, c.flip_prob_final_min_steps) == (None, 7)
    # the command line beats the recipe, which beats the built-in value
    good = tmp_path / "good.toml"
    good.write_text('flip_prob = 0.2\nbatch_size = 32\nepochs = 1\nqueue_size = "4x"\n')
    c = parse(["--config", str(good), "--batch-size", "64"])
    assert (c.flip_prob, c.batch_size, c.epochs, c.queue_size, c.a_gain) == (0.2, 64, 1, "4x",
                                                                             1.0)
    assert parse(["--p", "0.3"]).flip_prob == 0.3                # the plain-python alias


def test_l2_auto_from_the_command_line_and_a_recipe(tmp_path):
    """--l2 takes a number >= 0 or 'auto' ([M:mq-l2]); the start line says the values a NAC-MQ run
    uses, over the p schedule."""
    from nac_fast.train.run import describe_l2
    assert parse(["--l2", "auto"]).l2 == "auto" and parse(["--l2", "0.05"]).l2 == 0.05
    for bad in ("-1", "nan", "inf", "Auto"):
        with pytest.raises(ValueError, match="argument --l2: invalid number >= 0 or 'auto'"):
            parse(["--l2", bad])
    rec = tmp_path / "r.toml"
    rec.write_text('l2 = "auto"\nbatch_size = 32\nepochs = 1\n')
    assert parse(["--config", str(rec)]).l2 == "auto"
    rec.write_text("l2 = -0.5\n")
    with pytest.raises(ValueError, match="l2 = -0.5: expected a number >= 0 or 'auto'"):
        parse(["--config", str(rec)])
    # check() (a configuration made other than by parse) refuses what the flag refuses
    from nac_fast.train.config import check
    for bad in (-1.0, "x", float("nan")):
        with pytest.raises(ValueError, match="--l2: expected a number >= 0 or 'auto'"):
            check(dataclasses.replace(parse([]), l2=bad), 1)
    cfg = parse(["--l2", "auto", "--flip-prob", "0.25", "--flip-prob-final", "0.4",
                 "--flip-prob-final-min-images", "none", "--method", "nac-mq"])
    ramp = dataclasses.replace(cfg, total_steps=100, batch_size=8)
    assert describe_l2(ramp) == "auto (0.0391->0.00625)"     # p 0.25 at step 0, 0.4 at 99
    const = dataclasses.replace(ramp, flip_prob_final=None)
    assert describe_l2(const) == "auto (0.0391)"
    assert describe_l2(dataclasses.replace(const, l2=0.1)) == "0.1"
    assert describe_l2(dataclasses.replace(const, l2=0.0)) == "0"
    # at p = 0.4 the paper's 0.1 is five times the channel's capacity per bit, 0.0201 nats
    warned = describe_l2(dataclasses.replace(ramp, l2=0.1))
    assert warned.startswith("0.1 (warning: >= ln 2 - H(p) = 0.0201 at p = 0.4") and \
        "zero code is the loss's optimum" in warned
    assert describe_l2(dataclasses.replace(ramp, l2=0.02)) == "0.02"


def test_flip_prob_is_the_flag_in_docs_and_recipes():
    """--flip-prob everywhere a user reads a train.py flag (torchrun takes --p for its own)."""
    texts = {p: open(os.path.join(ROOT, p)).read() for p in
             ["train.py", "docs/training.md", "Makefile"] +
             [os.path.join("configs", f) for f in os.listdir(os.path.join(ROOT, "configs"))]}
    readme = open(os.path.join(ROOT, "README.md")).read()
    texts["README.md"] = readme
    for path, text in texts.items():
        for m in re.finditer(r"(?<![\w-])--p\b(?!-)", text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
            assert "also takes `--p`" in line, (path, line)   # the one mention: the alias
        assert not re.search(r"^p\s*=", text, re.M), path       # recipes: flip_prob = ...


# ---- the last lines of a run -------------------------------------------------------------------------

def test_summary_rounds_the_loss_and_gives_the_next_commands(finished, tmp_path):
    out, printed = finished
    lines = printed.rstrip().splitlines()
    assert STATUS_LINE.match(lines[-1]).group(1) == "0"
    done = next(ln for ln in lines if ln.startswith("done: step 3/3"))
    m = re.search(r"loss (\d+\.\d{3}) \(step 1\) -> (\d+\.\d{3}) \(D ln 2 = (\d+\.\d\d), ", done)
    assert m, done
    assert float(m.group(3)) == pytest.approx(16 * math.log(2), abs=0.005)
    log = [json.loads(x) for x in open(os.path.join(out, "log.jsonl"))]
    assert float(m.group(2)) == pytest.approx(log[-1]["loss"], abs=5e-4)
    ev = next(ln for ln in lines if ln.strip().startswith("evaluate"))
    assert shlex.split(ev)[1:] == ["python", "-m", "nac_fast.eval", "--checkpoint",
                                   os.path.join(out, "last.pt"), "--out",
                                   os.path.join(out, "eval")]
    # the plot command, as printed, draws this run's log
    plot = shlex.split(next(ln for ln in lines if ln.strip().startswith("plot")))[1:]
    assert plot[0] == "python" and plot[2:] == [os.path.join(out, "log.jsonl"), "--out",
                                                os.path.join(out, "curves.png")]
    png = tmp_path / "c.png"
    r = subprocess.run([sys.executable] + plot[1:-1] + [str(png)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", r.stderr
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith("last log"))
    assert "step 3" in lines[i] and "Reading a run" in lines[i]
    stats = {ln.split()[0]: ln for ln in lines[i + 1:i + 5]}      # one line each, with meaning
    assert set(stats) == {"code_mag", "r_slope", "balance_score", "distinct_frac"}, lines
    assert float(stats["code_mag"].split()[1]) == pytest.approx(log[-1]["code_mag"], rel=1e-2)
    assert "collapsed" in stats["code_mag"] and "ignores the codes" in stats["r_slope"]
    assert lines[-2].strip().startswith("plot") and lines[-3].strip().startswith("evaluate")


def test_reference_points_of_the_results_page():
    """The default recipe, SimCLR and the random-init encoder at the same budget, from
    docs/results_summary.json (docs/results.md's "Each method's default at every budget" and
    main tables: 47.5 / 83.2 / 77.9 etc.)."""
    line = reference_line(parse([]), 2)
    assert "2 epochs, 2 proc, batch 256, resnet-tiny, mean of 3 seeds, linear probe 30 epochs" \
        in line, line
    assert "this configuration 47.5 / 83.2 / 77.9" in line, line
    assert "SimCLR 44.4 / 82.2 / 76.4" in line and "random-init encoder 15.2 / 71.4 / 70.7" in line
    paper = reference_line(parse(["--config", os.path.join(ROOT, "configs",
                                                           "fashion_mnist_paper.toml")]), 2)
    assert "this configuration 30.5 / 80.1 / 73.0" in paper, paper
    # 10 epochs: today's default (p 0.25 -> 0.4, [M:p-schedule]); the rows of the earlier
    # default (constant p = 0.25, commands without --config) are not taken for it
    ten = reference_line(parse(["--epochs", "10"]), 2)
    assert "10 epochs, 2 proc" in ten and "this configuration 52.3 / 85.0 / 80.0" in ten, ten
    assert "SimCLR 50.3 / 84.8 / 80.1" in ten, ten
    assert reference_line(parse(["--epochs", "3"]), 2) is None      # a budget it did not run
    assert reference_line(parse([]), 1) is None                       # one process


# ---- a checkpoint of the code before TrainConfig is refused, naming what it lacks ---------------

def test_checkpoint_with_the_earlier_config_layout_is_refused(finished, tmp_path):
    """The layout train.py wrote before this configuration object ("p" for the flip
    probability): 0.1.0 had no users, so there is no reader for it; load_model says why."""
    path = str(tmp_path / "last.pt")
    ck = load_checkpoint(os.path.join(finished[0], "last.pt"))
    cfg = dict(ck["config"])
    cfg["p"] = cfg.pop("flip_prob")
    save_atomic(dict(ck, config=cfg), path)
    with pytest.raises(ValueError, match="config has no flip_prob"):
        load_model(path)


def test_the_printed_commands_replace_earlier_outputs_only_by_saying_so(tmp_path):
    """Where the run's folder already holds an evaluation report or curves.png (a run trained
    further, say), the printed evaluate and plot commands carry --overwrite (both tools refuse
    an existing output without it), and the plot command as printed replaces the picture."""
    import contextlib
    import io
    out = tmp_path / "run"
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "report.json").write_text("{}")
    (out / "curves.png").write_bytes(b"old")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert train.main(SMALL + ["--max-steps", "2", "--out", str(out)]) == 0
    lines = buf.getvalue().rstrip().splitlines()
    ev = shlex.split(next(ln for ln in lines if ln.strip().startswith("evaluate")))[1:]
    assert ev[-3:] == ["--out", str(out / "eval"), "--overwrite"]
    plot = shlex.split(next(ln for ln in lines if ln.strip().startswith("plot")))[1:]
    assert plot[-3:] == ["--out", str(out / "curves.png"), "--overwrite"]
    r = subprocess.run([sys.executable] + plot[1:], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and (out / "curves.png").read_bytes()[:4] == b"\x89PNG", r.stderr


def test_a_run_stopped_before_it_began_leaves_no_out_folder(tmp_path, capsys):
    """Bad data stops the run after --out was checked (created, probed) and before anything was
    written: the folders train.py made for --out go again; a folder that existed stays."""
    for c in ("a", "b"):
        os.makedirs(tmp_path / "d" / c)
        for i in range(3):
            (tmp_path / "d" / c / f"{i}.png").write_bytes(b"not an image at all")
    args = ["--data", str(tmp_path / "d"), "--image-size", "8", "--batch-size", "4",
            "--code-dim", "16", "--no-progress", "--max-steps", "2"]
    out = tmp_path / "new" / "deeper" / "run"
    assert train.main(args + ["--out", str(out)]) == 2
    assert "is an image" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert train.main(args + ["--out", str(kept / "run")]) == 2
    assert kept.is_dir() and os.listdir(kept) == []
    assert train.main(args + ["--out", str(kept)]) == 2
    assert kept.is_dir()
