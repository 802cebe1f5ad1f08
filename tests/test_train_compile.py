"""train.py's torch.compile (docs/training.md "Speed"), on the CPU with the aot_eager backend
(the traced graphs run by eager ops: the same numbers as eager, bit for bit, so every check here
is an equality; inductor on CPU tensors: tests/test_train_resume.py's slow test):

- the default: compiled with CUDA, eager on the CPU; --compile / --no-compile; the start line
  says what is compiled, the first step's line what it cost, the log records it;
- the encoders really run compiled (dynamo's graph count), the online one with gradient and the
  momentum one without;
- a compiled NAC-MQ run equals the eager run (losses, model, momentum model and its BN
  statistics, queue, optimizer), its checkpoints have no "_orig_mod." keys, and a checkpoint
  whose keys have them (a model saved through a torch.compile wrapper) still loads;
- exact resume across compile: an eager checkpoint continued compiled, and the other way;
- DDP (2 processes, gloo, torchrun) with shuffle BN, compiled, killed and restarted, equals the
  eager run.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint, load_model, save_atomic  # noqa: E402
from nac_fast.train.config import UsageError, parse, resolve  # noqa: E402
from nac_fast.ops.momentum import ema_update_  # noqa: E402

SMALL = ["--method", "nac-mq", "--data", "synthetic:64", "--image-size", "8", "--batch-size",
         "16", "--code-dim", "16", "--queue-size", "32", "--no-progress", "--seed", "3"]
AOT = ["--compile", "--compile-backend", "aot_eager"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread, like the torchrun runs (OMP_NUM_THREADS=1): on a busy shared CPU the
    tiny model's ops otherwise wait on thread hand-offs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(out, *extra, keep=None):
    """train.main on `out`; keep: a dict that receives the TrainState."""
    real = train.train

    def train_and_keep(st, flags):
        keep["st"] = st
        return real(st, flags)

    if keep is not None:
        train.train = train_and_keep
    try:
        return train.main([*SMALL, *extra, "--out", str(out)])
    finally:
        train.train = real


def _same_state(a, b):
    ca, cb = (load_checkpoint(os.path.join(d, "last.pt")) for d in (a, b))
    assert ca["step"] == cb["step"]
    for part in ("model", "momentum_model"):
        assert set(ca[part]) == set(cb[part]), part
        for k in ca[part]:
            assert torch.equal(ca[part][k], cb[part][k]), (part, k)
    assert torch.equal(ca["queue"]["codes"], cb["queue"]["codes"])
    assert torch.equal(ca["queue"]["ptr"], cb["queue"]["ptr"])
    for i, s in ca["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], cb["optimizer"]["state"][i]["momentum_buffer"])


def test_compile_default_follows_the_device(capsys):
    cfg = parse(SMALL + ["--max-steps", "2"])
    assert cfg.compile is None and cfg.compile_backend == "inductor"
    kw = dict(world_size=1, steps_per_epoch=4, image_size=8, in_channels=3, num_images=64)
    assert resolve(cfg, device_type="cuda", **kw).compile is True
    assert resolve(cfg, device_type="cpu", **kw).compile is False
    for flag, want in (("--compile", True), ("--no-compile", False)):
        c = parse(SMALL + ["--max-steps", "2", flag])
        assert resolve(c, device_type="cuda", **kw).compile is want
        assert resolve(c, device_type="cpu", **kw).compile is want
    with pytest.raises(UsageError, match="--compile-backend: invalid choice: 'cudagraphs'"):
        parse(SMALL + ["--compile-backend", "cudagraphs"])
    with pytest.raises(SystemExit):
        parse(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--compile, --no-compile" in help_text
    assert "[default: on with CUDA, off on CPU]" in help_text


def test_cpu_default_is_eager(tmp_path, capsys):
    keep = {}
    assert _run(tmp_path / "run", "--max-steps", "2", keep=keep) == 0
    out = capsys.readouterr().out
    assert " compile=off " in out.splitlines()[0]
    assert "compiled at step" not in out
    assert keep["st"].compiled is None and counters["stats"]["unique_graphs"] == 0
    assert "first_step_s" not in _log(tmp_path / "run")[0]
    assert json.load(open(tmp_path / "run" / "config.json"))["compile"] is False


def test_compiled_nac_mq_equals_eager_and_saves_plain_keys(tmp_path, capsys):
    eager, comp = tmp_path / "eager", tmp_path / "compiled"
    args = ["--max-steps", "4", "--log-every", "2", "--save-every", "2"]
    assert _run(eager, *args, "--no-compile") == 0
    capsys.readouterr()
    keep = {}
    assert _run(comp, *args, *AOT, keep=keep) == 0
    out = capsys.readouterr().out.splitlines()
    # the start line names what is compiled; the first step's line its cost
    what = "aot_eager: online encoder fwd+bwd, momentum encoder fwd (no grad)"
    assert f" compile={what}, at the first step " in out[0]
    assert keep["st"].compiled == what
    cost = [line for line in out if line.startswith("compiled at step 1: ")]
    assert len(cost) == 1 and "one-time" in cost[0]
    recs = _log(comp)
    assert recs[0]["first_step_s"] > 0 and "first_step_s" not in recs[1]
    # the encoders ran compiled: the online one (forward+backward) and the momentum one under
    # no_grad (a second graph); nothing else is compiled, and nothing recompiled over 4 steps
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["aot_autograd"]["ok"] == 2
    st = keep["st"]
    assert st.model.encoder._compiled_call_impl is not None
    assert st.mom_model.encoder._compiled_call_impl is not None
    # compiled == eager, bit for bit (aot_eager): losses, weights, EMA, BN statistics, queue
    assert [(r["loss"], r["loss_avg"]) for r in recs] == \
        [(r["loss"], r["loss_avg"]) for r in _log(eager)]
    _same_state(eager, comp)
    ck = load_checkpoint(str(comp / "last.pt"))
    assert not [k for part in ("model", "momentum_model") for k in ck[part] if "_orig_mod" in k]
    assert any(k.endswith("running_mean") for k in ck["momentum_model"])
    # the compiled momentum forward (the graph cached in training) reads the momentum weights
    # as they are now: an EMA update in place changes its output to the eager forward's
    mm = st.mom_model
    x = torch.randn(32, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        before = mm.encode(x)[1]
        ema_update_(mm, st.model, 0.5)
        got = mm.encode(x)[1]
        with torch.compiler.set_stance("force_eager"):
            want = mm.encode(x)[1]
    assert counters["stats"]["unique_graphs"] == 2  # the same graphs as in training
    assert not torch.equal(got, before) and torch.equal(got, want)


@pytest.mark.slow
def test_resume_across_compile(tmp_path):
    """An eager checkpoint continued compiled, and a compiled one continued eager, equal the
    uninterrupted eager run."""
    ref = tmp_path / "ref"
    args = ["--max-steps", "4", "--log-every", "1", "--save-every", "2"]
    assert _run(ref, *args, "--no-compile") == 0
    for first, second, name in ((["--no-compile"], AOT, "e2c"), (AOT, ["--no-compile"], "c2e")):
        out = tmp_path / name
        assert _run(out, *args, *first, "--stop-at-step", "2") == 0
        assert load_checkpoint(str(out / "last.pt"))["step"] == 2
        assert _run(out, *args, *second, "--resume") == 0
        assert [r["loss"] for r in _log(out)] == [r["loss"] for r in _log(ref)], name
        _same_state(ref, out)


def test_checkpoint_with_compiled_wrapper_keys_loads(tmp_path):
    """A checkpoint whose model keys carry torch.compile's "_orig_mod." (a model saved through
    an OptimizedModule by other code) resumes exactly and loads for evaluation."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    args = ["--max-steps", "4", "--log-every", "1", "--save-every", "2", "--no-compile"]
    assert _run(ref, *args) == 0
    assert _run(out, *args, "--stop-at-step", "2") == 0
    path = str(out / "last.pt")
    ck = load_checkpoint(path)
    for part in ("model", "momentum_model"):
        ck[part] = {k.replace("encoder.", "encoder._orig_mod.", 1): v for k, v in ck[part].items()}
    assert any("_orig_mod." in k for k in ck["model"])
    save_atomic(ck, path)
    plain = load_model(str(ref / "last.pt"))
    assert set(load_model(path).state_dict()) == set(plain.state_dict())
    assert _run(out, *args, "--resume") == 0
    assert [r["loss"] for r in _log(out)] == [r["loss"] for r in _log(ref)]
    _same_state(ref, out)


# ---- DDP: two processes (gloo), compiled, killed and restarted ----------------------------------

KILLER = """import os, signal, sys
sys.path.insert(0, {root!r})
import train
real = train.train_step
def step(st, x):
    if (st.step + 1 == 4 and int(os.environ["RANK"]) == 1
            and not os.path.exists({flag!r})):
        open({flag!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(st, x)
train.train_step = step
sys.exit(train.record(train.main)())
"""
DDP = ["--method", "nac-mq", "--data", "synthetic:128", "--image-size", "8", "--batch-size", "32",
       "--queue-size", "128", "--max-steps", "5", "--log-every", "1", "--save-every", "2",
       "--no-progress"]


def _torchrun(script, args, restarts=0):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--local_addr=127.0.0.1", f"--max-restarts={restarts}", script, *args]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def _last_losses(out):
    return {r["step"]: r["loss"] for r in _log(out)}


@pytest.mark.slow
def test_ddp_compiled_with_shuffle_bn_restarts_and_equals_eager(tmp_path):
    """torchrun, 2 processes: NAC-MQ (shuffle BN on, keys gathered, queue, EMA) compiled, rank 1
    SIGKILLed before step 4 and the group restarted (it resumes the step-2 checkpoint, compiling
    again), equals the uninterrupted eager run, loss for loss and state for state."""
    ref, out = tmp_path / "eager", tmp_path / "compiled"
    _torchrun(os.path.join(ROOT, "train.py"), DDP + ["--no-compile", "--out", str(ref)])
    killer = tmp_path / "killer_train.py"
    killer.write_text(KILLER.format(root=ROOT, flag=str(tmp_path / "killed.flag")))
    r = _torchrun(str(killer), DDP + AOT + ["--out", str(out)], restarts=1)
    assert os.path.exists(tmp_path / "killed.flag")
    assert "at step 2" in r.stdout and r.stdout.count("compiled at step") == 2, r.stdout
    assert " compile=aot_eager: online encoder fwd+bwd, momentum encoder fwd" in r.stdout
    assert _last_losses(out) == _last_losses(ref)
    _same_state(ref, out)
