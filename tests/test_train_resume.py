"""Checkpoints: atomic writes, exact resume (same logged losses as an uninterrupted run),
SIGKILL loses at most one save interval, and the end-to-end `torchrun --nproc_per_node=2
train.py` run.  (The non-finite stop: tests/test_fault_tolerance.py and tests/test_sync_free.py;
resume under torchrun: tests/test_fault_tolerance.py's elastic restart.)

--resume refused (an audit of train.py as a user drives it): a checkpoint whose model is not the
one the flags build, whose contents are malformed, or whose data changed since is exit status 2
with one message naming the file or the option, never a traceback, and --out is left as it was;
a resumed run with nothing to do says why, and its log's time goes on from the checkpoint."""
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint, load_model, save_atomic  # noqa: E402

from _train_main import SMALL, main_captured as _main, refused as _refused  # noqa: E402


def _log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(out):
    return [(r["step"], r["loss"]) for r in _log(out)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        env.pop(k, None)
    return env


def test_save_atomic_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "ck.pt"
    save_atomic({"step": 1}, str(p))
    assert torch.load(p)["step"] == 1
    with pytest.raises(Exception):
        save_atomic({"step": 2, "bad": lambda: 0}, str(p))   # unpicklable: torch.save fails
    assert torch.load(p)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]          # no temp file left behind


MQ = ["--data", "synthetic:128", "--image-size", "8", "--batch-size", "32", "--max-steps", "7",
      "--method", "nac-mq", "--queue-size", "96", "--log-every", "1", "--save-every", "2",
      "--no-progress"]


@pytest.mark.slow
def test_resume_equals_uninterrupted_nac_mq_across_epochs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert train.main(MQ + ["--out", a]) == 0
    assert train.main(MQ + ["--out", b, "--stop-at-step", "5"]) == 0   # epoch 1, batch 1
    assert load_checkpoint(os.path.join(b, "last.pt"))["step"] == 5
    assert train.main(MQ + ["--out", b, "--resume"]) == 0
    assert _losses(a) == _losses(b)                  # bit-identical, step for step
    assert [s for s, _ in _losses(b)] == list(range(1, 8))
    ca, cb = (load_checkpoint(os.path.join(d, "last.pt")) for d in (a, b))
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    assert torch.equal(ca["queue"]["codes"], cb["queue"]["codes"])
    assert ca["queue"]["ptr"] == cb["queue"]["ptr"] == (7 * 64) % 96


@pytest.mark.slow
def test_resume_mid_epoch_on_fashion_mnist(tmp_path):
    args = ["--batch-size", "32", "--max-steps", "4", "--log-every", "1", "--save-every", "100",
            "--no-progress"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert train.main(args + ["--out", a]) == 0
    assert train.main(args + ["--out", b, "--stop-at-step", "2"]) == 0
    assert train.main(args + ["--out", b, "--resume", os.path.join(b, "last.pt")]) == 0
    assert _losses(a) == _losses(b)
    rec = _log(a)[-1]
    for key in ("step", "epoch", "loss", "lr", "img_per_s", "data_wait", "distinct_frac",
                "mean_hamming", "balance_score"):
        assert key in rec


def test_resume_rejects_other_config(tmp_path, capsys):
    out = str(tmp_path / "c")
    assert train.main(MQ + ["--out", out, "--max-steps", "2"]) == 0
    assert train.main(MQ + ["--out", out, "--batch-size", "64", "--queue-size", "128",
                            "--resume"]) == 2
    assert "checkpoint has batch_size=32" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkill_loses_at_most_one_save_interval(tmp_path):
    # The kill must land before the run ends: a step takes ~10 ms here, so the steps after the
    # 10th record are all the slack this test's polling (every 50 ms, on a loaded machine) has.
    # With 30 steps that was ~0.25 s, and a kill after the final save (step 30, not a multiple
    # of 4) failed the checks below; 100 steps give ~1 s.  --save-mode sync: the bound of one
    # interval is the synchronous save's (an async save's write may still be in flight at the
    # kill: test_sigkill_during_background_write_resumes_previous_checkpoint)
    total = 100
    out = str(tmp_path / "k")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", "synthetic:512",
           "--image-size", "8", "--batch-size", "32", "--max-steps", str(total),
           "--save-every", "4", "--log-every", "1", "--no-progress", "--save-mode", "sync",
           "--out", out]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = os.path.join(out, "log.jsonl")
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(log) and len(open(log).readlines()) >= 10:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = _losses(out)
    last_logged = killed[-1][0]
    ck = load_checkpoint(os.path.join(out, "last.pt"))["step"]
    assert ck % 4 == 0 and 0 <= last_logged - ck <= 4
    # resumed in a fresh process with the same thread count (CPU kernels' float sums depend on it)
    r = subprocess.run(cmd + ["--resume"], env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    after = _losses(out)[len(killed):]
    assert after[0][0] == ck + 1 and after[-1][0] == total
    # the steps the killed run had done after its checkpoint are recomputed identically
    redo = dict(after)
    for s, v in killed:
        if s > ck:
            assert redo[s] == v, s
    assert load_checkpoint(os.path.join(out, "last.pt"))["step"] == total


def _torchrun(args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           os.path.join(ROOT, "train.py")] + args
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.mark.slow
def test_torchrun_inference_warmup(tmp_path):
    """--infer-warmup-steps under DDP: the warm-up steps leave the encoder and code head without
    gradient, which DDP refused ("did not receive grad": the run died at step 2) until the
    wrapper looked for unused parameters.  Run 2 processes through the warm-up and past it."""
    out = str(tmp_path / "warm")
    r = _torchrun(["--max-steps", "4", "--batch-size", "64", "--log-every", "1", "--no-progress",
                   "--infer-warmup-steps", "2", "--out", out])
    assert "done: step 4/4" in r.stdout
    assert [x["step"] for x in _log(out)] == [1, 2, 3, 4]
    assert all(math.isfinite(x["loss"]) for x in _log(out))


@pytest.mark.slow
def test_torchrun_two_processes_end_to_end(tmp_path):
    out = str(tmp_path / "e2e")
    r = _torchrun(["--max-steps", "3", "--batch-size", "64", "--log-every", "1", "--no-progress",
                   "--out", out])
    assert "world=2" in r.stdout and "done: step 3/3" in r.stdout
    log = _log(out)
    assert [x["step"] for x in log] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(x["loss"])) for x in log)
    ck = load_checkpoint(os.path.join(out, "last.pt"))
    assert ck["step"] == 3 and ck["config"]["world_size"] == 2 and len(ck["rng"]) == 2
    # evaluation-ready: the checkpoint rebuilds the model, which codes real test images
    from nac_fast.data import build_eval_loader
    model = load_model(os.path.join(out, "last.pt"))
    images, labels = next(iter(build_eval_loader("fashion-mnist", "test", batch_size=16)))
    with torch.no_grad():
        h, a = model.encode(images)
    assert h.shape == (16, 128) and a.shape == (16, 128) and torch.isfinite(a).all()


@pytest.mark.slow
def test_compile_flag_trains_like_eager(tmp_path):
    """--compile (torch.compile of the DDP/plain model; Inductor's C++ backend on CPU) logs the
    losses of the eager run, within float reassociation, and writes a loadable checkpoint."""
    args = ["--data", "synthetic:64", "--image-size", "8", "--batch-size", "16", "--max-steps", "2",
            "--log-every", "1", "--no-progress", "--seed", "3"]
    e, c = str(tmp_path / "eager"), str(tmp_path / "compiled")
    assert train.main(args + ["--out", e]) == 0
    assert train.main(args + ["--out", c, "--compile"]) == 0
    le, lc = _losses(e), _losses(c)
    assert [s for s, _ in le] == [s for s, _ in lc] == [1, 2]
    for (_, x), (_, y) in zip(le, lc):
        assert abs(x - y) <= 1e-4 * abs(x), (le, lc)
    # load_model gives the checkpoint's weights (not a fresh model), in eval mode, and they are
    # the eager run's within float reassociation (no "_orig_mod." keys from the compiled wrapper)
    mc, me = load_model(os.path.join(c, "last.pt")), load_model(os.path.join(e, "last.pt"))
    saved = load_checkpoint(os.path.join(c, "last.pt"))["model"]
    got = mc.state_dict()
    assert not mc.training and set(got) == set(saved) == set(me.state_dict())
    for k, v in got.items():
        assert torch.equal(v, saved[k]), k
        torch.testing.assert_close(v, me.state_dict()[k], rtol=1e-3, atol=1e-5, msg=k)


def test_resume_path_into_another_runs_out_is_refused(tmp_path, capsys):
    """--resume PATH with an --out that holds another run: status 2, nothing touched; with
    --overwrite the run in --out is replaced by PATH's continuation."""
    base = ["--data", "synthetic:32", "--image-size", "8", "--batch-size", "8", "--no-progress"]
    a, b = str(tmp_path / "runA"), str(tmp_path / "runB")
    assert train.main(base + ["--max-steps", "1", "--seed", "7", "--out", a]) == 0
    assert train.main(base + ["--max-steps", "1", "--seed", "0", "--out", b]) == 0
    capsys.readouterr()
    before = open(os.path.join(a, "last.pt"), "rb").read()
    cfg_before = open(os.path.join(a, "config.json")).read()
    argv = base + ["--max-steps", "2", "--out", a, "--resume", os.path.join(b, "last.pt")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "--resume" in err and "--overwrite" in err, err
    assert open(os.path.join(a, "last.pt"), "rb").read() == before
    assert open(os.path.join(a, "config.json")).read() == cfg_before
    assert train.main(argv + ["--overwrite"]) == 0
    ck = load_checkpoint(os.path.join(a, "last.pt"))
    assert ck["config"]["seed"] == 0 and ck["step"] == 2
    assert not os.path.exists(os.path.join(a, "prev.pt"))
    # the checkpoint's own folder: resumed as before
    assert train.main(base + ["--max-steps", "2", "--out", b, "--resume", b]) == 0


def test_resume_applies_the_weight_decay_it_is_given(tmp_path):
    """A --wd given to a resumed run is the one its optimizer uses from then on, as config.json
    records (--lr likewise: a function of the step).  Before: the optimizer's state_dict
    brought back the checkpoint's weight decay, config.json said 0.5 and the groups held 1e-06.
    The excluded group (BN parameters, biases) stays at 0."""
    out = str(tmp_path / "run")
    args = ["--data", "synthetic:128", "--image-size", "8", "--batch-size", "32", "--max-steps",
            "4", "--method", "nac", "--log-every", "1", "--save-every", "2", "--no-progress",
            "--out", out]
    assert train.main(args + ["--wd", "1e-6", "--stop-at-step", "2"]) == 0
    ck = load_checkpoint(os.path.join(out, "last.pt"))
    assert [g["weight_decay"] for g in ck["optimizer"]["param_groups"]] == [1e-6, 0.0]
    assert train.main(args + ["--wd", "0.5", "--resume"]) == 0
    ck = load_checkpoint(os.path.join(out, "last.pt"))
    assert ck["step"] == 4
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["wd"] == 0.5
    assert [g["weight_decay"] for g in ck["optimizer"]["param_groups"]] == [0.5, 0.0]


# ---- --save-mode async (the default): the step goes on while the checkpoint is written ----------

def _sha(path):
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _temp_files(out):
    return sorted(n for n in os.listdir(out) if n.startswith(".tmp-last.pt."))


def test_background_save_one_in_flight_copy_isolated_and_errors_kept(tmp_path):
    """BackgroundSave: the host copy does not see later changes of the state, start() and
    snapshot() refuse while a write is in flight, the copy reuses the previous one's memory, and
    a write that fails reports its error from wait() leaving the file it would replace intact."""
    from nac_fast.train.checkpoint import BackgroundSave, snapshot
    p, prev = str(tmp_path / "last.pt"), str(tmp_path / "prev.pt")
    w = BackgroundSave()
    assert not w.busy and w.wait() is None
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = {"model": model.state_dict(), "step": 1, "rng": [torch.arange(3)]}
    w0 = model[0].weight.detach().clone()
    copy1 = w.snapshot(state)
    assert copy1["model"]._metadata == state["model"]._metadata        # BN's version kept
    with torch.no_grad():
        model[0].weight.add_(1.0)                                       # a later step
    assert not torch.equal(copy1["model"]["0.weight"], model[0].weight)
    w.start(copy1, p, previous=prev, label=1)
    with pytest.raises(RuntimeError, match="in flight"):
        w.start(copy1, p, label=2)
    with pytest.raises(RuntimeError, match="in flight"):
        w.snapshot(state)
    out = w.wait()
    assert (out.label, out.path, out.error) == (1, p, None) and out.seconds >= 0 and not w.busy
    ck = load_checkpoint(p, require=("model",))
    assert torch.equal(ck["model"]["0.weight"], w0)
    assert ck["model"]._metadata == state["model"]._metadata
    # the next copy goes into the memory of the written one: same buffer, new values
    copy2 = w.snapshot({"model": model.state_dict(), "step": 2, "rng": [torch.arange(3)]})
    assert copy2["model"]["0.weight"].data_ptr() == copy1["model"]["0.weight"].data_ptr()
    assert torch.equal(copy2["model"]["0.weight"], model[0].weight)
    # a tensor that appears twice is copied once (one object, as torch.save would store it)
    t = torch.ones(2)
    twice = snapshot({"a": t, "b": [t]})
    assert twice["a"] is twice["b"][0] and twice["a"] is not t
    # a write that fails (unpicklable state): the error comes back, last.pt and prev.pt stay
    before = _sha(p)
    w.start({"step": 3, "bad": lambda: 0}, p, previous=prev, label=3)
    out = w.wait()
    assert out.label == 3 and out.error is not None and "pickle" in str(out.error).lower()
    assert _sha(p) == before and not os.path.exists(prev) and _temp_files(tmp_path) == []


@pytest.mark.parametrize("value", ["8", "8:x", "a:1", "8:-1", "8:inf", "1:2:3"])
def test_background_save_test_hook_value_is_checked(monkeypatch, value):
    from nac_fast.train.checkpoint import PAUSE_ENV, BackgroundSave
    monkeypatch.setenv(PAUSE_ENV, value)
    with pytest.raises(ValueError, match=f"{PAUSE_ENV} must be STEP:SECONDS"):
        BackgroundSave()


def _enospc_at(call, seen):
    """torch.save that writes 1000 bytes and raises ENOSPC at its `call`-th call (1-based)."""
    import errno
    import threading
    real = torch.save

    def save(obj, f, *a, **k):
        seen.append(threading.current_thread().name)
        if len(seen) != call:
            return real(obj, f, *a, **k)
        f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    return save


@pytest.mark.parametrize("fail_call,failed_step,logged", [(2, 4, 6), (4, 8, 8)])
def test_async_save_error_surfaces_at_next_save_or_run_end(tmp_path, monkeypatch, capsys,
                                                           fail_call, failed_step, logged):
    """A background write that fails (disk full) stops the run with status 4, as a synchronous
    one does, at the next save (a save at step 4 fails: the save at step 6 stops the run), or at
    the run's end (the final save waits for its write: a failure there is not lost); the
    message names the step, the file and the cause, and the checkpoint before it is intact."""
    out = str(tmp_path / "run")
    args = MQ + ["--max-steps", "8", "--save-every", "2", "--out", out]
    seen = []
    monkeypatch.setattr(torch, "save", _enospc_at(fail_call, seen))
    assert train.main(args) == 4
    err = capsys.readouterr().err
    last = os.path.join(out, "last.pt")
    assert (f"checkpoint of step {failed_step} could not be written to {last}: OSError: "
            "[Errno 28] No space left on device") in err, err
    assert f"stopping (status 4); {last} (step {failed_step - 2}) is intact" in err, err
    assert all(name.startswith("nac_fast-save-") for name in seen), seen   # in the background
    assert load_checkpoint(last)["step"] == failed_step - 2
    assert max(r["step"] for r in _log(out)) == logged
    assert _temp_files(out) == []
    assert json.loads(open(os.path.join(out, "status.json")).read())["status"] == 4


@pytest.mark.slow
def test_sigkill_during_background_write_resumes_previous_checkpoint(tmp_path):
    """kill -9 while the background write of step 8's checkpoint is half done (the test hook
    NAC_FAST_TEST_SAVE_PAUSE holds it after its first bytes): the steps went on during the
    write, the save at step 12 waited for it (at most one in flight), last.pt is step 4's
    checkpoint byte for byte, and --resume continues from it exactly."""
    out = str(tmp_path / "k")
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--data", "synthetic:512",
           "--image-size", "8", "--batch-size", "32", "--max-steps", "40", "--save-every", "4",
           "--log-every", "1", "--no-progress", "--out", out]
    env = dict(_env(), NAC_FAST_TEST_SAVE_PAUSE="8:600")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last, log = os.path.join(out, "last.pt"), os.path.join(out, "log.jsonl")
    deadline = time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(log) and len(open(log).readlines()) >= 12:
                break
            time.sleep(0.05)
        time.sleep(1.0)  # the save at step 12 waits for step 8's write: no step 13 comes
        assert proc.poll() is None, proc.stderr.read().decode()
        held = _temp_files(out)
        step4 = _sha(last)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = _losses(out)
    assert [s for s, _ in killed] == list(range(1, 13)), killed
    assert len(held) == 1 and _temp_files(out) == held     # step 8's write, cut short
    assert 0 < os.path.getsize(os.path.join(out, held[0])) < os.path.getsize(last)
    assert _sha(last) == step4 and load_checkpoint(last)["step"] == 4
    assert not os.path.exists(os.path.join(out, "prev.pt"))  # step 8's rotation never came
    r = subprocess.run(cmd + ["--resume", "--stop-at-step", "12"], env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout[-2000:]
    assert _temp_files(out) == []                            # the next start removed it
    after = _losses(out)[len(killed):]
    assert after == killed[4:]                               # steps 5..12, bit for bit
    assert load_checkpoint(last)["step"] == 12


# ---- --resume with flags that build another model ------------------------------------------------

@pytest.fixture(scope="module")
def fixed_gains(tmp_path_factory):
    """A finished 3-step run of the small recipe's heads with fixed gains (--no-learn-gain)."""
    out = str(tmp_path_factory.mktemp("fixed") / "run")
    status, _, err = _main(SMALL + ["--no-learn-gain", "--max-steps", "3", "--out", out])
    assert status == 0, err
    return out


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


# ---- what a resumed run says and logs ------------------------------------------------------------

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


def test_a_resumed_runs_log_time_goes_on_from_its_checkpoint(tmp_path):
    """A resumed run's log.jsonl started elapsed_s at 0 again, so its time axis jumped back at
    every resume.  The checkpoint keeps the run's elapsed_s; the resumed log goes on from it."""
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
