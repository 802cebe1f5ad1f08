"""Fault tolerance of train.py (docs/training.md "Fault tolerance"), on CPU with gloo:

1. a torchrun worker group restarted after a SIGKILL (--max-restarts) resumes by itself and
   logs the losses of an uninterrupted run;
2. two "nodes" (two torchrun launchers, c10d rendezvous on 127.0.0.1) train like one node of
   two processes (data sharded by GLOBAL rank) and both restart and resume after a SIGKILL;
3. --resume with a larger --max-steps extends a finished run (cosine restretched to the new
   total, state continued exactly);
4. a non-finite loss stops the run naming its step, keeps the last good checkpoints, writes none
   after it, and an elastic restart does not replay it;
5. damaged checkpoints: clear errors naming the file; automatic resume falls back to prev.pt;
   the rotation touches nothing but last.pt / prev.pt;
6. a failed save (disk full, unwritable --out) leaves the previous checkpoint intact and stops
   every rank with status 4;
7. bad data (--on-bad-file, a data set smaller than one global batch, DALI sharding by global
   rank) is tested in tests/test_data_bad.py;
8. `srun python train.py`: SLURM's variables form one run (SLURM's host lists parsed), and a
   partial or contradictory set stops with status 2 in one line; init_distributed checks the
   process group's environment (WORLD_SIZE, RANK, LOCAL_RANK) and its timeout;
9. the elastic resize: a checkpoint of 4 processes resumed on 2 continues the global sample
   order, schedule and queue; torchrun --nnodes=1:2 with a lost node goes on by itself on the
   survivor from the last checkpoint;
and docs/training.md's "Fault tolerance" commands use the launcher flags tested here.

The kills in 1 and 2 come from a test-only wrapper script (written here, never part of train.py):
it replaces train.train_step by one that SIGKILLs global rank 1 once, before a given step.
"""
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # train.py lives at the repository root
import train  # noqa: E402
from nac_fast.train import checkpoint as ckpt_mod  # noqa: E402
from nac_fast.train import run as run_mod  # noqa: E402
from _poison import poison_loss  # noqa: E402
from nac_fast.train.checkpoint import load_checkpoint, load_model, save_atomic  # noqa: E402
from nac_fast.train.schedule import WarmupCosine, get_lr  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """In-process runs on one intra-op thread, like the torchrun ones (OMP_NUM_THREADS=1): on a
    busy shared CPU the tiny model's ops otherwise wait on thread hand-offs (~20x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _last_occurrence(out):
    """{step: record}: a resumed run appends to log.jsonl, so steps after its checkpoint can
    appear twice (the attempt that died, then the resumed one); the LAST record of a step is
    the one of the run that went on."""
    return {r["step"]: r for r in _log(out)}


def _losses(out):
    return {s: r["loss"] for s, r in _last_occurrence(out).items()}


def _step(out, name="last.pt"):
    return load_checkpoint(os.path.join(out, name))["step"]


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        env.pop(k, None)
    return env


def _clear_elastic_env(monkeypatch):
    for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


def _same_state(a, b):
    ca, cb = (load_checkpoint(os.path.join(d, "last.pt")) for d in (a, b))
    assert ca["step"] == cb["step"]
    for part in ("model", "momentum_model"):
        for k in ca[part]:
            assert torch.equal(ca[part][k], cb[part][k]), (part, k)
    assert torch.equal(ca["queue"]["codes"], cb["queue"]["codes"])
    assert ca["queue"]["ptr"] == cb["queue"]["ptr"]
    for i, s in ca["optimizer"]["state"].items():
        assert torch.equal(s["momentum_buffer"], cb["optimizer"]["state"][i]["momentum_buffer"])


# ---- 1, 2: torchrun: elastic restart and two "nodes" ------------------------------------------

# NAC-MQ (queue, EMA model, batch shuffle across ranks), 4 steps an epoch, 2 epochs
DDP = ["--method", "nac-mq", "--data", "synthetic:128", "--image-size", "8", "--batch-size", "32",
       "--queue-size", "128", "--max-steps", "8", "--log-every", "1", "--save-every", "3",
       "--no-progress", "--save-mode", "sync"]  # sync: step 3's checkpoint is on disk before
# step 4, whenever the kill before step 6 lands (async: its write may still be in flight then,
# and the restart would resume an older one; tests/test_train_resume.py tests that case)
TIMEOUT = 240  # seconds for any one launch (they take ~10-30 s here)

KILLER = """import os, signal, sys
sys.path.insert(0, {root!r})
import train

real_step = train.train_step


def step(st, x):  # TEST ONLY: global rank {rank} dies by SIGKILL before step {step}, once
    if (os.environ["RANK"] == "{rank}" and st.step + 1 == {step}
            and not os.path.exists({flag!r})):
        open({flag!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(st, x)


train.train_step = step
sys.exit(train.main())
"""

def _killed_then_resumed(out, reference):
    """The log of a group whose rank 1 died before step 6 and that resumed from step 3: the
    killed attempt's steps 1..k, then 4..8.  k is 5, or 4 where rank 0 had not yet written step
    5's record when torchrun stopped it: rank 1 dies right after step 5's last collective, while
    rank 0 goes on to log step 5 on its own, and torchrun's agent SIGTERMs rank 0 within its
    monitor interval (0.1 s) of rank 1's death, whatever rank 0 is doing.  The killed attempt's
    records are the reference's."""
    steps = [x["step"] for x in _log(out)]
    k = steps.index(4, 4)  # the first step of the resumed attempt (it resumes at step 3)
    assert k in (4, 5) and steps == list(range(1, k + 1)) + [4, 5, 6, 7, 8], steps
    assert [x["loss"] for x in _log(out)[3:k]] == [_losses(reference)[s] for s in range(4, k + 1)]


def _killer(tmp_path, rank, step):
    path = tmp_path / "killer_train.py"
    path.write_text(KILLER.format(root=ROOT, rank=rank, step=step,
                                  flag=str(tmp_path / "killed.flag")))
    return str(path)


def _torchrun(launcher, script, args, env=None, timeout=TIMEOUT):
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, script, *args]
    r = subprocess.run(cmd, env={**_env(), **(env or {})}, cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r


def _standalone(*extra):
    return ["--standalone", "--nproc_per_node=2", "--local_addr=127.0.0.1", *extra]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """One node, two processes, uninterrupted."""
    out = str(tmp_path_factory.mktemp("ref") / "run")
    _torchrun(_standalone(), os.path.join(ROOT, "train.py"), DDP + ["--out", out])
    assert sorted(_losses(out)) == list(range(1, 9))
    return out


@pytest.mark.slow
def test_elastic_restart_resumes_by_itself(ddp_reference, tmp_path):
    out = str(tmp_path / "run")
    r = _torchrun(_standalone("--max-restarts=1"), _killer(tmp_path, rank=1, step=6),
                  DDP + ["--out", out])
    # rank 1 died before step 6: rank 0 logged steps 1..5 (or 1..4: _killed_then_resumed), the
    # restarted group resumed by itself (no --resume) from the checkpoint of step 3 and appended
    # steps 4..8
    assert os.path.exists(tmp_path / "killed.flag")
    assert "at step 3" in r.stdout and "restart count 1)" in r.stdout, r.stdout
    _killed_then_resumed(out, ddp_reference)
    assert _losses(out) == _losses(ddp_reference)        # bit-identical, step for step
    _same_state(out, ddp_reference)
    assert _step(out) == 8 and _step(out, "prev.pt") == 6


def _two_nodes(script, args, tmp_path, restarts=0, env=None):
    """Two torchrun launchers (one process each) meeting at a c10d rendezvous on 127.0.0.1."""
    port, rid = _free_port(), f"nacft-{uuid.uuid4().hex[:8]}"
    procs = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                   f"--rdzv_id={rid}", f"--rdzv_conf=is_host={int(node == 0)},join_timeout=120",
                   "--local_addr=127.0.0.1", f"--max-restarts={restarts}", script, *args]
            log = open(tmp_path / f"node{node}.log", "w")
            procs.append((subprocess.Popen(cmd, env={**_env(), **(env or {})}, cwd=ROOT,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True), log))
        for p, _ in procs:
            p.wait(TIMEOUT)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
            log.close()
    texts = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert all(p.returncode == 0 for p, _ in procs), "\n".join(t[-3000:] for t in texts)
    return texts


@pytest.mark.slow
def test_two_nodes_c10d_shard_by_global_rank_and_restart(ddp_reference, tmp_path):
    """Each node has one process (LOCAL_RANK 0 on both): the same losses as one node with two
    processes show that the data is sharded by the global RANK.  Global rank 1 dies before step
    6; both nodes' worker groups restart and resume from the checkpoint of step 3."""
    out = str(tmp_path / "run")
    texts = _two_nodes(_killer(tmp_path, rank=1, step=6), DDP + ["--out", out], tmp_path,
                       restarts=1)
    assert os.path.exists(tmp_path / "killed.flag")
    assert any("world=2" in t for t in texts)
    assert any("resumed from" in t and "at step 3" in t for t in texts), texts
    _killed_then_resumed(out, ddp_reference)
    assert _losses(out) == _losses(ddp_reference)
    _same_state(out, ddp_reference)


# ---- SLURM: `srun python train.py` (one task per GPU) forms one run -------------------------------

SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
              "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID",
              "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def test_slurm_host_list_first_host():
    from nac_fast.train.distributed import slurm_hosts
    cases = {"node[01-04,07],gpu5": ["node01", "node02", "node03", "node04", "node07", "gpu5"],
             "gpu5,node[01-02]": ["gpu5", "node01", "node02"],
             "a1": ["a1"], "n[8-11]": ["n8", "n9", "n10", "n11"],
             "n[098-101]": ["n098", "n099", "n100", "n101"],
             "rack[1-2]-n[1-2]": ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"],
             "10.0.0.[3-4]": ["10.0.0.3", "10.0.0.4"]}
    for text, hosts in cases.items():
        assert list(slurm_hosts(text)) == hosts, text
    assert next(slurm_hosts("node[00001-99999]")) == "node00001"      # lazily: the first one
    for bad, why in (("node[01-04", "'[' without ']'"), ("node01]", "']' without '['"),
                     ("n[1-[2]]", "nested"), ("n[a-b]", "not a list of numbers"),
                     ("n[4-2]", "goes down"), ("a,,b", "empty host name"), ("", "non-empty")):
        with pytest.raises(ValueError, match=re.escape(why)):
            list(slurm_hosts(bad))


def test_slurm_launch_env_forms_one_run_or_names_what_is_missing():
    from nac_fast.train.distributed import LaunchError, slurm_launch_env
    task = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
            "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "123456"}
    assert slurm_launch_env(task) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                      "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu07",
                                      "MASTER_PORT": str(15000 + 123456 % 15000)}
    # the step's node list before the job's; MASTER_ADDR / MASTER_PORT win
    got = slurm_launch_env({**task, "SLURM_STEP_NODELIST": "gpu[08]", "MASTER_PORT": "29400"})
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("gpu08", "29400")
    assert slurm_launch_env({**task, "MASTER_ADDR": "10.1.2.3"})["MASTER_ADDR"] == "10.1.2.3"
    # not a SLURM task launch: torchrun's variables (srun torchrun ...), or one task at most
    assert slurm_launch_env({**task, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}) is None
    assert slurm_launch_env({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "5"}) is None
    assert slurm_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}) \
        is None
    assert slurm_launch_env({}) is None
    refused = {
        "without SLURM_PROCID, SLURM_LOCALID": {"SLURM_NTASKS": "2"},
        "without SLURM_NTASKS": {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
        "SLURM_PROCID and SLURM_LOCALID must lie in [0, SLURM_NTASKS)":
            {**task, "SLURM_PROCID": "16"},
        "SLURM_LOCALID must be < SLURM_NTASKS_PER_NODE": {**task, "SLURM_LOCALID": "8"},
        "SLURM_NTASKS='two' is not an integer": {**task, "SLURM_NTASKS": "two"},
        "without SLURM_JOB_NODELIST": {k: v for k, v in task.items() if k != "SLURM_JOB_NODELIST"},
        "without MASTER_PORT or SLURM_JOB_ID": {k: v for k, v in task.items()
                                                if k != "SLURM_JOB_ID"},
        "SLURM_JOB_NODELIST: host list 'gpu[07-08'": {**task, "SLURM_JOB_NODELIST": "gpu[07-08"},
        "MASTER_PORT='70000' is not a port number": {**task, "MASTER_PORT": "70000"},
    }
    for why, env in refused.items():
        with pytest.raises(LaunchError, match=re.escape(why)):
            slurm_launch_env(env)


def test_slurm_bad_launch_is_status_2_in_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                     capsys):
    out = tmp_path / "run"
    for k in SLURM_VARS + ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for env, why in (({"SLURM_NTASKS": "2"}, "without SLURM_PROCID, SLURM_LOCALID"),
                     ({"SLURM_NTASKS": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0"},
                      "must lie in [0, SLURM_NTASKS)")):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert train.main(MQ + ["--max-steps", "2", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and err[0].startswith("train.py: error: SLURM launch") \
            and why in err[0] and err[1].startswith("train.py: exit status 2"), err
        assert not out.exists() and "RANK" not in os.environ


@pytest.mark.parametrize("env, match", [({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
                                        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
                                        ({"LOCAL_RANK": "-1"}, "LOCAL_RANK")])
def test_init_distributed_checks_the_environment(monkeypatch, env, match):
    from nac_fast.train.distributed import init_distributed
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        init_distributed("cpu", timeout_s=5.0)


def test_init_distributed_checks_timeout(monkeypatch):
    from nac_fast.train.distributed import init_distributed
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed("cpu", timeout_s=-1)


def test_each_process_takes_its_gpu_or_the_only_one_it_sees(monkeypatch, tmp_path, capsys):
    """cuda:LOCAL_RANK, or the one GPU a process sees where the launcher binds one GPU to each
    task (srun --gpus-per-task=1); several GPUs but fewer than LOCAL_RANK + 1, or launcher
    variables that do not fit, stop with status 2 in one line (no traceback)."""
    from nac_fast.train import distributed as nd
    for k in SLURM_VARS + ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    for count, gpu in ((8, 3), (4, 3), (1, 0)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda c=count: c)
        di = nd.init_distributed("cuda")
        assert (di.device, di.local_rank) == (torch.device("cuda", gpu), 3)
        assert picked[-1] == torch.device("cuda", gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(nd.LaunchError, match=re.escape("LOCAL_RANK=3, but this process sees 2 "
                                                       "GPUs")):
        nd.init_distributed("cuda")
    monkeypatch.undo()
    for k in SLURM_VARS + ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "-1")
    out = tmp_path / "run"
    assert train.main(MQ + ["--max-steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "LOCAL_RANK must be >= 0, got -1" in err[0], err
    assert not out.exists()


@pytest.mark.slow
def test_srun_tasks_form_one_run(tmp_path):
    """Two processes with SLURM's variables of `srun --ntasks=2 python train.py` and none of
    torchrun's: one run of world size 2 (rank 0 prints and logs, each step once)."""
    out, port = tmp_path / "run", _free_port()
    args = MQ + ["--max-steps", "4", "--save-every", "2", "--out", str(out)]
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in _env().items() if k not in SLURM_VARS}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost,node[02-03]",
                   SLURM_JOB_ID="77", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args],
                                      env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    res = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], res
    assert "world=2" in res[0][0] and res[1][0] == "", res
    assert [r["step"] for r in _log(str(out))] == [1, 2, 3, 4]
    ck = load_checkpoint(str(out / "last.pt"))
    assert ck["config"]["world_size"] == 2 and len(ck["rng"]) == 2 and ck["step"] == 4
    assert sorted(os.listdir(out)) == ["config.json", "last.pt", "log.jsonl", "prev.pt",
                                       "status.json"]


# ---- elastic resize: a run resumes on another world size that divides its global batch -----------

RECORDER = """import json, os, sys
sys.path.insert(0, {root!r})
import train
from nac_fast.data.sources.synthetic_pairs import SyntheticPairLoader

seen = []
real_image, real_step = SyntheticPairLoader._image, train.train_step


def image(self, i):  # TEST ONLY: the images of this rank's batch, in order
    seen.append(int(i))
    return real_image(self, i)


def step(st, x):  # TEST ONLY: records (step, rank, the batch's image ids) for each step
    with open(os.path.join({rec!r}, "rank%s.jsonl" % os.environ["RANK"]), "a") as f:
        f.write(json.dumps({{"step": st.step + 1, "ids": seen}}) + "\\n")
    seen.clear()
    return real_step(st, x)


SyntheticPairLoader._image, train.train_step = image, step
sys.exit(train.main())
"""


def _recorder(tmp_path, name):
    rec = tmp_path / f"ids-{name}"
    rec.mkdir()
    script = tmp_path / f"record_{name}.py"
    script.write_text(RECORDER.format(root=ROOT, rec=str(rec)))
    return str(script), rec


def _global_batches(rec):
    """{step: the image ids of the global batch, rank 0's slice first}: the last record of each
    step on each rank (a resumed run may repeat steps)."""
    per_rank = {}
    for f in sorted(rec.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
        per_rank[int(f.stem[4:])] = {r["step"]: r["ids"] for r in map(json.loads, open(f))}
    steps = set.intersection(*(set(d) for d in per_rank.values()))
    return {s: [i for r in sorted(per_rank) for i in per_rank[r][s]] for s in sorted(steps)}


def test_sharded_order_global_batches_do_not_depend_on_the_world_size():
    from nac_fast.data.order import ShardedOrder
    G, n = 48, 1000
    ref = {e: ShardedOrder(n, G, 0, 1, seed=7).rank_indices(e) for e in (0, 3)}  # (steps, G)
    assert ref[0].shape == (n // G, G) and not np.array_equal(ref[0], ref[3])
    for world in (2, 3, 4, 6, 8, 16):
        orders = [ShardedOrder(n, G // world, r, world, seed=7) for r in range(world)]
        assert {o.num_batches for o in orders} == {n // G}
        for epoch in (0, 3):
            for k in (0, 5):   # from the epoch's start, and resumed at its batch 5
                got = np.concatenate([o.rank_indices(epoch, k) for o in orders], axis=1)
                assert np.array_equal(got, ref[epoch][k:]), (world, epoch, k)


RESIZE = ["--method", "nac-mq", "--data", "synthetic:128", "--image-size", "8", "--batch-size",
          "32", "--queue-size", "256", "--max-steps", "6", "--log-every", "1", "--save-every", "3",
          "--no-progress"]


@pytest.mark.slow
def test_resume_on_another_world_size_continues_the_global_run(tmp_path):
    """4 processes to step 6 (a checkpoint at 3, mid-epoch: prev.pt), that checkpoint resumed on
    2 processes to step 6 (across the epoch boundary at 4), and 2 processes uninterrupted: the
    global batch of every step is the same images in the same order at 4 and at 2 processes,
    and the resumed run's schedule, steps, queue and sample order are the 4-process run's."""
    four, resized, two = (str(tmp_path / n) for n in ("four", "resized", "two"))
    script, rec4 = _recorder(tmp_path, "four")
    _torchrun(["--standalone", "--nproc_per_node=4", "--local_addr=127.0.0.1"], script,
              RESIZE + ["--out", four], timeout=2 * TIMEOUT)
    assert _step(four) == 6 and _step(four, "prev.pt") == 3
    script, rec_r = _recorder(tmp_path, "resized")
    r = _torchrun(_standalone(), script,
                  RESIZE + ["--resume", os.path.join(four, "prev.pt"), "--out", resized])
    assert ("resized: world size 4 -> 2 at step 3 (per process batch 8 -> 16 of the global 32)"
            in r.stdout), r.stdout
    script, rec2 = _recorder(tmp_path, "two")
    _torchrun(_standalone(), script, RESIZE + ["--out", two])

    g4, gr, g2 = (_global_batches(d) for d in (rec4, rec_r, rec2))
    assert sorted(g4) == sorted(g2) == list(range(1, 7)) and sorted(gr) == [4, 5, 6]
    assert all(len(g4[s]) == 32 and len(set(g4[s])) == 32 for s in g4)
    assert g4 == g2                                      # the order is global: any world size
    assert {s: g4[s] for s in gr} == gr                  # the resumed run goes on with it
    # the schedule and the step count go on; the log has the resumed steps once
    log4, log_r, log2 = (_last_occurrence(d) for d in (four, resized, two))
    assert sorted(log_r) == [4, 5, 6]
    for s in (4, 5, 6):
        assert log_r[s]["lr"] == log4[s]["lr"] == log2[s]["lr"]
        assert log_r[s]["epoch"] == log4[s]["epoch"] == (s - 1) // 4
        assert math.isfinite(log_r[s]["loss"])
    # the queue: the same pointer, and the rows written before the resize (step 3's, which
    # steps 4..6 do not reach: 64 codes a step in a queue of 256) are the 4-process run's
    c4, cr, c2 = (load_checkpoint(os.path.join(d, "last.pt")) for d in (four, resized, two))
    assert cr["queue"]["ptr"] == c4["queue"]["ptr"] == c2["queue"]["ptr"] == (6 * 64) % 256
    assert torch.equal(cr["queue"]["codes"][128:192], c4["queue"]["codes"][128:192])
    assert not torch.equal(cr["queue"]["codes"][:128], c4["queue"]["codes"][:128])
    assert cr["step"] == 6 and len(cr["rng"]) == 2 and cr["config"]["world_size"] == 2
    assert cr["config"]["resized"] == [{"step": 3, "from_world_size": 4, "to_world_size": 2}]
    assert cr["config"]["run_id"] == c4["config"]["run_id"]


NODE_LOSS = """import os, signal, sys
sys.path.insert(0, {root!r})
import train

victim = os.environ.get("NACFT_VICTIM") == "1"
if victim:
    with open(os.path.join({pids!r}, "worker" + os.environ["LOCAL_RANK"]), "w") as f:
        f.write(str(os.getpid()))
real_step = train.train_step


def step(st, x):  # TEST ONLY: the victim node is lost (its agent, both workers) before step {step}
    if victim and os.environ["LOCAL_RANK"] == "0" and st.step + 1 == {step} \\
            and not os.path.exists({flag!r}):
        open({flag!r}, "w").close()
        sibling = int(open(os.path.join({pids!r}, "worker1")).read())
        for pid in (os.getppid(), sibling, os.getpid()):   # torchrun's agent is the parent
            os.kill(pid, signal.SIGKILL)
    return real_step(st, x)


train.train_step = step
sys.exit(train.main())
"""


@pytest.mark.slow
def test_lost_node_the_run_continues_on_the_survivor(tmp_path):
    """torchrun --nnodes=1:2: two agents of 2 processes each (c10d rendezvous on 127.0.0.1,
    agent 0 hosts the store).  Before step 6 the other node is lost: its agent and both its
    workers die by SIGKILL.  The surviving agent restarts its workers; the rendezvous closes with
    the one node left (min 1), and the new group of world size 2 resumes by itself from the
    checkpoint of step 3 (written at world size 4: the elastic resize) and trains to the end."""
    out, port, rid = str(tmp_path / "run"), _free_port(), f"nacft-{uuid.uuid4().hex[:8]}"
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "node_loss.py"
    script.write_text(NODE_LOSS.format(root=ROOT, pids=str(pids), step=6,
                                       flag=str(tmp_path / "lost.flag")))
    procs = []
    try:
        for node in (0, 1):
            conf = (f"is_host={int(node == 0)},join_timeout=120,last_call_timeout=10,"
                    "keep_alive_interval=1,keep_alive_max_attempt=2")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                   "--nproc_per_node=2", "--rdzv_backend=c10d",
                   f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rid}",
                   f"--rdzv_conf={conf}", "--local_addr=127.0.0.1", "--max-restarts=2",
                   str(script), *DDP, "--out", out]
            log = open(tmp_path / f"node{node}.log", "w")
            env = {**_env(), "NACFT_VICTIM": str(node)}
            procs.append((subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True),
                          log))
        procs[0][0].wait(2 * TIMEOUT)
        procs[1][0].wait(30)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
            log.close()
    text = (tmp_path / "node0.log").read_text()
    assert os.path.exists(tmp_path / "lost.flag")
    assert procs[1][0].returncode == -signal.SIGKILL
    assert procs[0][0].returncode == 0, text[-4000:]
    assert "world=4" in text or "world=4" in (tmp_path / "node1.log").read_text()
    assert "resized: world size 4 -> 2 at step 3" in text, text[-4000:]
    assert f"(restart of torchrun job {rid}, restart count 1)" in text
    ck = load_checkpoint(os.path.join(out, "last.pt"))
    assert ck["step"] == 8 and ck["config"]["world_size"] == 2 and len(ck["rng"]) == 2
    assert ck["config"]["resized"] == [{"step": 3, "from_world_size": 4, "to_world_size": 2}]
    steps = [r["step"] for r in _log(out)]
    k = len(steps) - 5             # the lost group's steps 1..k (k: 5, or fewer where rank 0
    # was stopped before logging them), then the resumed group's 4..8
    assert steps[:k] == list(range(1, k + 1)) and 3 <= k <= 5 and steps[k:] == [4, 5, 6, 7, 8]
    assert json.load(open(os.path.join(out, "status.json")))["status"] == 0


def test_restarted_group_waits_for_the_lock_of_the_failed_one(mq_reference, tmp_path,
                                                              monkeypatch, capsys):
    """A restarted worker group of the job that owns --out waits for the run lock (the failed
    group's rank 0 may still be exiting) and then resumes; a new launch does not wait."""
    from nac_fast.train.run import RunLock
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-w")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    out = str(tmp_path / "run")
    args = MQ + ["--max-steps", "8", "--save-every", "2", "--out", out]
    assert train.main(args + ["--stop-at-step", "4"]) == 0
    monkeypatch.setattr(run_mod, "LOCK_WAIT_RESTART_S", 60.0)
    held = RunLock.acquire(out)                         # the failed group's rank 0, exiting
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-other")     # a new launch: refused at once
    assert train.main(args + ["--resume"]) == 2
    assert "is in use by another train.py run" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-w")          # the job's restart: waits
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    timer = threading.Timer(2.0, held.release)
    t0 = time.monotonic()
    timer.start()
    try:
        assert train.main(args) == 0
    finally:
        timer.cancel()
        held.release()
    assert time.monotonic() - t0 >= 2.0
    assert "at step 4 (epoch 1, batch 0) (restart of torchrun job job-w, restart count 1)" \
        in capsys.readouterr().out
    assert _losses(out) == _losses(mq_reference) and _step(out) == 8


def test_resume_on_a_world_size_the_global_batch_does_not_divide_is_refused(
        mq_reference, tmp_path, monkeypatch, capsys):
    _clear_elastic_env(monkeypatch)
    out = str(tmp_path / "run")
    shutil.copytree(mq_reference, out)
    before = {n: _sha(os.path.join(out, n)) for n in os.listdir(out)}
    monkeypatch.setenv("WORLD_SIZE", "3")            # 3 processes: the global 16 does not divide
    monkeypatch.setenv("RANK", "0")
    assert train.main(MQ + ["--max-steps", "8", "--save-every", "2", "--resume",
                            "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--batch-size 16 (global) is not divisible by the world size 3" \
        in err[0] and err[1].startswith("train.py: exit status 2"), err
    assert {n: _sha(os.path.join(out, n)) for n in os.listdir(out)} == before


# ---- in-process runs (3-6) --------------------------------------------------------------------

MQ = ["--method", "nac-mq", "--data", "synthetic:64", "--image-size", "8", "--batch-size", "16",
      "--queue-size", "48", "--code-dim", "16", "--log-every", "1", "--no-progress"]


@pytest.fixture(scope="module")
def mq_reference(tmp_path_factory):
    """8 steps (2 epochs) uninterrupted, a checkpoint every 2."""
    out = str(tmp_path_factory.mktemp("mq") / "run")
    assert train.main(MQ + ["--max-steps", "8", "--save-every", "2", "--out", out]) == 0
    return out


# ---- 3: extending a finished run ----------------------------------------------------------------

def test_extend_finished_run_restretches_cosine_and_continues_exactly(tmp_path, monkeypatch,
                                                                      capsys):
    _clear_elastic_env(monkeypatch)
    ext, ref = str(tmp_path / "ext"), str(tmp_path / "ref")
    args = MQ + ["--save-every", "10"]
    # 20 steps at 4 a step per epoch: the auto warm-up is min(10 epochs, 10% of the run) = 2
    assert train.main(args + ["--max-steps", "20", "--out", ext]) == 0
    lr_end = _log(ext)[-1]["lr"]
    assert train.main(args + ["--max-steps", "30", "--resume", "--out", ext]) == 0
    assert "extended: the schedule now ends at step 30 (was 20)" in capsys.readouterr().out

    # The reference: one 30-step run whose schedule is the 20-step one before step 20 and the
    # 30-step one from step 20 on (what the documentation promises for the extended run)
    def piecewise(step, base_lr, warmup_steps, total_steps):
        return get_lr(step, base_lr, 2, 20 if step < 20 else total_steps)

    with monkeypatch.context() as m:
        m.setattr(run_mod, "get_lr", piecewise)
        assert train.main(args + ["--max-steps", "30", "--warmup-epochs", "0.5",
                                  "--out", ref]) == 0
    got, want = _last_occurrence(ext), _last_occurrence(ref)
    assert sorted(got) == list(range(1, 31))
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in want.items()}
    base = 0.075 * 16 ** 0.5                            # the default lr of a global batch of 16
    for s in range(21, 31):                             # record s: the lr of update s (index s-1)
        assert got[s]["lr"] == want[s]["lr"] == base * WarmupCosine(2, 30)(s - 1), s
    assert lr_end < 0.01 * base < got[21]["lr"]        # the documented jump up at the extension
    _same_state(ext, ref)
    cfg = load_checkpoint(os.path.join(ext, "last.pt"))["config"]
    assert (cfg["total_steps"], cfg["warmup_steps"]) == (30, 2)   # the warm-up is kept
    assert cfg["extended"] == [{"step": 20, "from_total_steps": 20, "to_total_steps": 30}]
    # a resumed extended run goes on; shortening is refused
    assert train.main(args + ["--max-steps", "25", "--resume", "--out", ext]) == 2
    assert "may extend the schedule, not shorten it" in capsys.readouterr().err


# ---- 4: non-finite loss -------------------------------------------------------------------------

def test_non_finite_loss_keeps_good_checkpoints_and_is_not_replayed(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")       # as torchrun sets them
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    calls, real = poison_loss(monkeypatch, run_mod, "nac_mq_step", at_call=5)
    out = str(tmp_path / "run")
    args = MQ + ["--max-steps", "8", "--save-every", "2", "--log-every", "3", "--out", out]
    assert train.main(args) == 3
    err = capsys.readouterr().err
    assert (f"non-finite loss (nan) at step 5 (found at step 6); stopping. Last good checkpoint "
            f"kept: {os.path.join(out, 'last.pt')} (step 4)") in err, err
    assert calls["n"] == 6                          # stopped at the check before the save at 6
    assert _step(out) == 4 and _step(out, "prev.pt") == 2          # both from before step 5
    assert sorted(os.listdir(out)) == ["config.json", "last.pt", "log.jsonl", "non_finite.json",
                                       "prev.pt", "status.json"]   # no checkpoint after it
    assert json.loads(open(os.path.join(out, "status.json")).read())["status"] == 3
    assert [r["step"] for r in _log(out)] == [3]
    assert json.loads(open(os.path.join(out, "non_finite.json")).read())["step"] == 5

    # torchrun restarts a failed worker group: the restart stops at once instead of replaying
    # steps 5..6 from the checkpoint of step 4
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert train.main(args) == 3
    assert "would replay it" in capsys.readouterr().err
    assert calls["n"] == 6 and _step(out) == 4

    # a new launch (restart count 0) resuming explicitly goes on (here the cause is gone)
    monkeypatch.setattr(run_mod, "nac_mq_step", real)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert train.main(args + ["--resume"]) == 0
    assert _step(out) == 8 and not os.path.exists(os.path.join(out, "non_finite.json"))


# ---- 5: damaged checkpoints ---------------------------------------------------------------------

def test_damaged_checkpoint_errors_name_the_file(tmp_path, monkeypatch):
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.randn(4096)}, "config": {}, "step": 1}, good)
    data = good.read_bytes()
    cases = {
        "truncated.pt": (data[: len(data) // 2], "truncated, corrupt or not a checkpoint"),
        "garbage.pt": (os.urandom(5000), "truncated, corrupt or not a checkpoint"),
        "empty.pt": (b"", "is empty (0 bytes)"),
        "text.pt": (b"not a checkpoint\n", "truncated, corrupt or not a checkpoint"),
    }
    for name, (content, msg) in cases.items():
        (tmp_path / name).write_bytes(content)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")     # another structure
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    (tmp_path / "dir.pt").mkdir()
    cases.update({"other.pt": (None, "is not a train.py checkpoint: it has no model, config"),
                  "tensor.pt": (None, "holds a Tensor, not a train.py checkpoint"),
                  "dir.pt": (None, "is not a regular file"),
                  "missing.pt": (None, "no such file")})
    for name, (_, msg) in cases.items():
        p = str(tmp_path / name)
        with pytest.raises(ValueError) as e:
            load_checkpoint(p)
        assert repr(p) in str(e.value) and msg in str(e.value), (name, str(e.value))
    # evaluation checkpoints need the model and config only; resume needs the whole state
    assert load_checkpoint(str(good))["step"] == 1
    with pytest.raises(ValueError, match="it has no optimizer, scaler, rng"):
        load_checkpoint(str(good), require=ckpt_mod.STATE_KEYS)
    # unreadable (permissions: tests run as root here, where chmod does not stop reads)
    real_open = open

    def deny(f, *a, **k):
        if f == str(good):
            raise PermissionError(errno.EACCES, "Permission denied", f)
        return real_open(f, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(good))
    assert repr(str(good)) in str(e.value) and "Permission denied" in str(e.value)


def test_automatic_resume_falls_back_to_prev(mq_reference, tmp_path, monkeypatch, capsys):
    _clear_elastic_env(monkeypatch)
    out = str(tmp_path / "run")
    args = MQ + ["--max-steps", "8", "--save-every", "2", "--out", out]
    assert train.main(args + ["--stop-at-step", "6"]) == 0
    assert _step(out) == 6 and _step(out, "prev.pt") == 4
    for name in ("keep.pt", "notes.txt"):                         # files of the user's
        shutil.copy(os.path.join(out, "last.pt") if name == "keep.pt" else __file__,
                    os.path.join(out, name))
    user = {n: _sha(os.path.join(out, n)) for n in ("keep.pt", "notes.txt")}
    last = os.path.join(out, "last.pt")
    with open(last, "r+b") as f:                                  # cut in half
        f.truncate(os.path.getsize(last) // 2)
    capsys.readouterr()
    # a named file is not replaced by another: a clear error naming it
    assert train.main(args + ["--resume", last]) == 2
    assert f"checkpoint {last!r}" in capsys.readouterr().err
    # --resume without a path: prev.pt, with a note naming the damaged last.pt
    assert train.main(args + ["--resume"]) == 0
    o = capsys.readouterr()
    assert f"note: checkpoint {last!r}" in o.err and "truncated" in o.err
    assert f"resumed from {os.path.join(out, 'prev.pt')} at step 4" in o.out
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert _losses(out) == _losses(mq_reference)
    _same_state(out, mq_reference)
    assert _step(out) == 8 and _step(out, "prev.pt") == 6
    ck = load_checkpoint(last)                                    # evaluation reads last.pt:
    assert ck["step"] == 8 and all(torch.equal(v, ck["model"][k])  # its step-8 weights
                                   for k, v in load_model(last).state_dict().items())
    assert {n: _sha(os.path.join(out, n)) for n in user} == user
    assert sorted(os.listdir(out)) == ["config.json", "keep.pt", "last.pt", "log.jsonl",
                                       "notes.txt", "prev.pt", "status.json"]

    # the elastic restart of a job takes the same way: last.pt of another structure now
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    out2 = str(tmp_path / "run2")
    args2 = MQ + ["--max-steps", "8", "--save-every", "2", "--out", out2]
    assert train.main(args2 + ["--stop-at-step", "6"]) == 0
    torch.save({"weights": torch.zeros(2)}, os.path.join(out2, "last.pt"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert train.main(args2) == 0                                 # no --resume
    o = capsys.readouterr()
    assert "it has no model" in o.err
    assert "at step 4 (epoch 1, batch 0) (restart of torchrun job job-2, restart count 1)" in o.out
    assert _losses(out2) == _losses(mq_reference)

    # nothing usable: an error naming both files, no fresh start over them
    for name in ("last.pt", "prev.pt"):
        with open(os.path.join(out2, name), "wb") as f:
            f.write(b"\0" * 100)
    assert train.main(args2) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err
    assert "last.pt" in err and "prev.pt" in err


# ---- 6: a save that fails -----------------------------------------------------------------------

def _enospc_save(fail_call, seen):
    """torch.save that writes half of the file and raises ENOSPC at its `fail_call`-th call."""
    real = torch.save

    def save(obj, f, *a, **k):
        seen.append(getattr(f, "name", f))
        if len(seen) != fail_call:
            return real(obj, f, *a, **k)
        f.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    return save


def test_save_atomic_failures_keep_the_old_file(tmp_path, monkeypatch):
    p, prev = str(tmp_path / "last.pt"), str(tmp_path / "prev.pt")
    save_atomic({"step": 1}, p)
    save_atomic({"step": 2}, p, previous=prev)
    assert torch.load(p)["step"] == 2 and torch.load(prev)["step"] == 1
    before = (_sha(p), _sha(prev))
    with monkeypatch.context() as m:                     # disk full while writing
        m.setattr(torch, "save", _enospc_save(1, []))
        with pytest.raises(OSError, match="No space left"):
            save_atomic({"step": 3}, p, previous=prev)
    assert (_sha(p), _sha(prev)) == before
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "prev.pt"]   # no temp file left
    real_replace = os.replace

    def replace(src, dst):                               # the final rename fails (read-only)
        if dst == p:
            raise OSError(errno.EROFS, "Read-only file system", dst)
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(OSError, match="Read-only"):
            save_atomic({"step": 3}, p, previous=prev)
    assert _sha(p) == before[0] and torch.load(prev)["step"] == 2   # last.pt intact
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "prev.pt"]
    with monkeypatch.context() as m:                     # a file system without hard links
        m.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EPERM, "no")))
        save_atomic({"step": 4}, p, previous=prev)
    assert torch.load(p)["step"] == 4 and torch.load(prev)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "prev.pt"]


READ_ONLY_SAVE = """import sys, torch
from nac_fast.train.checkpoint import save_atomic
try:
    save_atomic({{"step": 2}}, {p!r}, previous={prev!r})
except OSError as exc:
    print(type(exc).__name__, exc.errno)
    sys.exit(0)
sys.exit(1)
"""


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions and mounts")
def test_read_only_out_keeps_the_old_file(tmp_path):
    """save_atomic into a read-only --out raises and leaves last.pt as it was.  Read-only as a
    normal user: mode 555; as root (CI), which writes through mode bits: a read-only bind mount
    in a private mount namespace (unshare -m)."""
    d = tmp_path / "out"
    p, prev = str(d / "last.pt"), str(d / "prev.pt")
    save_atomic({"step": 1}, p)
    before = _sha(p)
    code = READ_ONLY_SAVE.format(p=p, prev=prev)
    if os.geteuid() != 0:
        cmd = [sys.executable, "-c", code]
        os.chmod(d, 0o555)
    else:
        import shlex
        if shutil.which("unshare") is None:
            pytest.skip("root without unshare: no read-only directory here")
        cmd = ["unshare", "-m", "sh", "-c", f"mount --bind {d} {d} && mount -o remount,bind,ro "
               f"{d} && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"]
    try:
        r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    finally:
        os.chmod(d, 0o755)
    if os.geteuid() == 0 and "mount" in r.stderr and r.returncode != 0:
        pytest.skip(f"no mount namespace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split()[0] in ("PermissionError", "OSError"), r.stdout   # EACCES / EROFS
    assert _sha(p) == before and sorted(os.listdir(d)) == ["last.pt"]


def test_disk_full_during_save_stops_with_intact_checkpoint(mq_reference, tmp_path, monkeypatch,
                                                            capsys):
    _clear_elastic_env(monkeypatch)
    out = str(tmp_path / "run")
    # --save-mode sync: the run stops at the failing save itself (async: at the next one,
    # tests/test_train_resume.py test_async_save_error_surfaces_at_next_save_or_run_end)
    args = MQ + ["--max-steps", "8", "--save-every", "2", "--save-mode", "sync", "--out", out]
    seen, snap = [], {}
    fail = _enospc_save(3, seen)

    def save(obj, f, *a, **k):                  # 3rd checkpoint (step 6): the disk is full
        if len(seen) == 2:
            snap["last"] = _sha(os.path.join(out, "last.pt"))
        return fail(obj, f, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", save)
        assert train.main(args) == 4
    err = capsys.readouterr().err
    last = os.path.join(out, "last.pt")
    assert (f"checkpoint of step 6 could not be written to {last}: OSError: [Errno 28] No space "
            f"left on device") in err, err
    assert f"stopping (status 4); {last} (step 4) is intact" in err
    assert _sha(last) == snap["last"] and _step(out) == 4 and _step(out, "prev.pt") == 2
    assert sorted(os.listdir(out)) == ["config.json", "last.pt", "log.jsonl", "prev.pt",
                                       "status.json"]
    assert json.loads(open(os.path.join(out, "status.json")).read())["status"] == 4
    assert max(r["step"] for r in _log(out)) == 6
    # space freed: --resume continues from the intact checkpoint, exactly
    assert train.main(args + ["--resume"]) == 0
    assert _losses(out) == _losses(mq_reference)
    _same_state(out, mq_reference)


# ---- the README's commands ----------------------------------------------------------------------

def test_readme_fault_tolerance_commands_are_the_tested_ones():
    """docs/training.md's 'Fault tolerance' torchrun commands use the launcher flags that the tests
    above run (1, 2) and train.py flags that parse."""
    import re

    from nac_fast.train.config import parse
    text = open(os.path.join(ROOT, "docs", "training.md")).read()
    section = re.search(r"## Fault tolerance\n(.*?)(?=\n## |\Z)", text, re.S).group(1)
    (block,) = re.findall(r"```text\n(.*?)```", section, re.S)
    cmds = [c.strip() for c in re.sub(r"\\\n\s*", "", block).splitlines()
            if c.strip().startswith("torchrun")]
    assert len(cmds) == 2
    tested = open(__file__).read().split("# ---- the README's commands")[0]  # tests 1, 2
    for cmd in cmds:
        launcher, train_args = cmd.split(" train.py ")
        for flag in re.findall(r"(--[\w-]+)=", launcher):
            assert f"{flag}=" in tested, flag
        args = parse(train_args.split() + ["--out", "x"])
        assert args.resume is None                     # restarts resume without --resume
    assert "--max-restarts=" in cmds[0] and "--rdzv_backend=c10d" in cmds[1]


def test_slurm_launches_of_the_docs_and_the_sbatch_script():
    """docs/training.md "Several machines" and scripts/slurm_train.sbatch show both launches
    (srun python train.py; srun torchrun with --nnodes=MIN:MAX), with train.py flags that parse
    and torchrun flags that the tests above run; the script is valid bash."""
    import re

    from nac_fast.train.config import parse
    script = os.path.join(ROOT, "scripts", "slurm_train.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(os.path.join(ROOT, "docs", "training.md")).read()
    section = re.search(r"## Several machines[^\n]*\n(.*?)(?=\n## |\Z)", text, re.S).group(1)
    (block,) = re.findall(r"```text\n(.*?)```", section, re.S)
    cmds = [c.strip() for c in block.splitlines() if c.strip().startswith("srun")]
    assert len(cmds) == 2 and " python train.py " in cmds[0] and " torchrun " in cmds[1]
    sbatch = re.sub(r"\\\n\s*", "", open(script).read())
    assert re.search(r"srun [^\n]*python train\.py", sbatch)
    assert re.search(r"srun [^\n]*torchrun --nnodes=\S+:\S+ [^\n]* train\.py", sbatch)
    tested = open(__file__).read().split("def test_slurm_launches_of_the_docs")[0]
    launches = [c for c in cmds + re.findall(r"srun [^\n]*", sbatch) if "torchrun " in c]
    assert len(launches) >= 2
    for cmd in launches:
        for flag in re.findall(r"(--(?:nnodes|nproc_per_node|max-restarts|rdzv_\w+))=", cmd):
            assert f"{flag}=" in tested, flag
    for cmd in cmds:
        args = parse(cmd.split(" train.py ")[1].split())
        assert args.out == "/shared/in1k" and args.resume is None
