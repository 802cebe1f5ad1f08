"""The README's commands are real (docs/math.md [M:bug4]: "every command in the README is run by a
test"): CI runs `make test` (this suite); here the README's main-job command runs a short
training, the Makefile targets parse, and the API example executes."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
STAMP = os.path.join(ROOT, ".venv", ".nac_fast_setup")


def _section(title: str) -> str:
    text = open(README).read()
    m = re.search(rf"## {re.escape(title)}\n(.*?)(?=\n## |\Z)", text, re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def _fenced(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def readme_commands() -> list[str]:
    (block,) = _fenced(_section("Two commands on a fresh machine"), "bash")
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_readme_has_exactly_the_two_newcomer_commands():
    assert readme_commands() == ["make train", "make test"]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert re.search(r"^make test$", ci, re.M), ".ci/run must run the README's test command"


@pytest.mark.parametrize("cmd", readme_commands())
def test_make_targets_parse(cmd):
    # a clean make: under `make test` (CI) the inherited MAKELEVEL/MAKEFLAGS make the child print
    # "Entering directory" lines after the recipe
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(cmd.split() + ["-n", "--no-print-directory"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # the dry run shows the command the README promises (Makefile header, README "Two commands")
    want = {"make train": ".venv/bin/torchrun --standalone --nproc_per_node=2 train.py --out "
                          "runs/default",
            "make test": ".venv/bin/python -m pytest -q tests"}[cmd]
    assert want in out.stdout.splitlines()[-1], out.stdout


def test_make_test_fast_is_the_suite_less_the_slow_tests():
    """README "Two commands": `make test-fast` is pytest -m "not slow" (the marker registered in
    tests/conftest.py); `make test` (CI) runs every test and lists the 15 slowest."""
    assert "`make test-fast`" in _section("Two commands on a fresh machine")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    run = {t: subprocess.run(["make", t, "-n", "--no-print-directory"], cwd=ROOT, env=env,
                             capture_output=True, text=True) for t in ("test-fast", "test")}
    assert all(r.returncode == 0 for r in run.values()), {t: r.stderr for t, r in run.items()}
    fast, full = (run[t].stdout.splitlines()[-1] for t in ("test-fast", "test"))
    assert ".venv/bin/python -m pytest -q tests -m \"not slow\"" in fast, fast
    assert full.endswith("-m pytest -q tests --durations=15") and "slow" not in full, full


def _subsection(title: str) -> str:
    text = open(README).read()
    m = re.search(rf"### {re.escape(title)}\n(.*?)(?=\n##|\Z)", text, re.S)
    assert m, f"README has no subsection {title!r}"
    return m.group(1)


def test_readme_api_example_runs():
    (code,) = _fenced(_section("The loss API").split("### ")[0], "python")
    env = {}
    exec(compile(code, "README.md", "exec"), env)
    import math
    import torch
    a1, a2, r1, r2 = (env[k] for k in ("a1", "a2", "r1", "r2"))
    assert env["loss"].dim() == 0 and all(t.grad is not None for t in (a1, a2, r1, r2))
    # the NAC-MQ criterion enqueued tanh of both views' momentum codes before its loss
    K, queue = a1.shape[0], env["queue"]
    assert int(queue.ptr) == 2 * K and "codes" in queue.state_dict()
    m_a = torch.cat([env["m1"][0], env["m2"][0]])
    assert torch.equal(queue.codes[:2 * K], torch.tanh(m_a))
    # The NAC-MQ line's loss reaches r only through the VI term (the momentum logits are r_hat),
    # whose gradient is (sig(r) - (1 + m tanh(a)) / 2) / n [M:vi] with the channel's +-1 sample
    # m, each view's code paired with the OTHER view's r: recover m from the gradient and check
    # it is a +-1 channel sample of flip rate p = 0.1 (a wrong pairing gives no +-1 sample).
    g1, g2 = torch.autograd.grad(env["loss"], [r1, r2])
    a, r, g = torch.cat([a1, a2]).detach(), torch.cat([r2, r1]).detach(), torch.cat([g2, g1])
    z = torch.tanh(a)
    m = (2 * (torch.sigmoid(r) - a.shape[0] * g) - 1) / z
    m = m[z.abs() > 0.1]
    assert torch.allclose(m.abs(), torch.ones_like(m), atol=1e-3), (m.abs() - 1).abs().max()
    flips = (m < 0).double().mean().item()
    assert abs(flips - 0.1) <= 4 * math.sqrt(0.1 * 0.9 / m.numel()), flips
    # NACMQ: one call made the momentum keys of both views (8 images each) and the loss, whose
    # gradient reaches the online model and not its momentum copy
    nacmq, out = env["nacmq"], env["out"]
    q = nacmq.queue.codes  # 16 momentum codes tanh(a) written at the front, the rest still 0
    assert int(nacmq.queue.ptr) == 16 and q[:16].ne(0).all() and q[:16].abs().lt(1).all()
    assert not q[16:].any()
    assert out.loss.dim() == 0 and math.isfinite(out.loss.item())
    assert all(p.grad is not None for p in env["model"].head.parameters())
    assert all(p.grad is None and not p.requires_grad
               for p in nacmq.momentum_model.parameters())


def test_readme_training_loop_example_runs():
    """The "use the loss in your own training loop" example trains (every module's weights move,
    the loss is finite) and gives +-1 codes."""
    import torch
    (code,) = _fenced(_subsection("Use the loss in your own training loop"), "python")
    setup, loop = code.split("for step", 1)
    torch.manual_seed(0)
    env = {}
    exec(compile(setup, "README.md", "exec"), env)
    before = [p.detach().clone() for p in env["params"]]
    exec(compile("for step" + loop, "README.md", "exec"), env)
    assert torch.isfinite(env["loss"]) and env["loss"].dim() == 0
    assert all(not torch.equal(b, p) for b, p in zip(before, env["params"]))
    assert env["codes"].shape == (64, 64) and set(env["codes"].unique().tolist()) <= {-1.0, 1.0}


@pytest.mark.skipif(not os.path.exists(STAMP),
                    reason="runs inside `make test` (the set-up venv); not from a bare checkout")
def test_readme_main_job_runs(tmp_path):
    """`make train` as the README writes it, into OUT, with ARGS for a 3-step run: same target,
    same set-up stamp, same torchrun line.  A second `make train` into the same OUT stops (the
    README: status 2) without touching the first run; ARGS=--resume continues it."""
    import hashlib
    import json
    import math
    out = tmp_path / "run"
    small = "--max-steps 3 --batch-size 64 --no-progress --log-every 1"
    proc = subprocess.run(["make", "train", f"OUT={out}", f"ARGS={small}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "last.pt").exists()
    # the README's run: two processes (torchrun, NPROC=2) on Fashion-MNIST, every step logged
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in log)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["data"] == "fashion-mnist"
    assert "train.py: exit status 0 (done)" in proc.stdout and f"{out}/last.pt" in proc.stdout
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}
    again = subprocess.run(["make", "train", f"OUT={out}", f"ARGS={small}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert again.returncode != 0
    assert f"--out '{out}' holds a run" in again.stderr and "exit status 2" in again.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == files
    more = subprocess.run(["make", "train", f"OUT={out}", f"ARGS={small} --max-steps 4 --resume"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4]
