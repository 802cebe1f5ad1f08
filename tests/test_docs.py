"""The docs' claims against the code and the results files.

The README's commands are real (docs/math.md [M:bug4]: "every command in the README is run by a
test"): CI runs `make test` (this suite); here the README's main-job command runs a short
training, the Makefile targets parse, and the API example executes.

docs/math.md is the canonical math and the code cites it by label: every label cited anywhere
in the repository (code, docs, configs, tests) is defined in docs/math.md, every link to an anchor
of docs/math.md lands on one, and every label docs/math.md defines is either cited somewhere else
or listed in its table "Where the code computes each equation".

The rest (fast: no training, no subprocess; tests/test_train_exit.py covers --help and the
recipe value checks):

- every configs/*.toml loads through the config loader, key for key, and the paper's recipes
  hold the paper's values (docs/math.md [M:recipe]), the ImageNet ones a ResNet-50;
- every repository path the README and docs/*.md name exists, and every markdown link lands on
  a file and, with an anchor, on a heading or an <a id> of that file;
- every --flag in the README is an option of the command it is written with (or, in prose, of
  one of the project's commands);
- the README's GPU figures and its results table are what the results files hold
  (bench/results/NVIDIA-H100-80GB-HBM3_2026-11-27*/, docs/results_summary.json);
- the README is a newcomer's page (at most 200 lines), and no doc names a machine's paths.
"""
import argparse
import csv
import glob
import json
import math
import os
import re
import statistics
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
STAMP = os.path.join(ROOT, ".venv", ".nac_fast_setup")
MATH = os.path.join(ROOT, "docs", "math.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
H100 = os.path.join(ROOT, "bench", "results", "NVIDIA-H100-80GB-HBM3_2026-11-27")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _toml(path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


# ---- the README's commands -------------------------------------------------------------------

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
            "make test": ".venv/bin/python -m pytest -q tests -n 2 --dist loadfile"}[cmd]
    assert want in out.stdout.splitlines()[-1], out.stdout


def test_make_test_fast_is_the_suite_less_the_slow_tests():
    """README "Two commands": `make test-fast` is pytest -m "not slow" (the marker registered in
    tests/conftest.py); `make test` (CI) runs every test and lists the 15 slowest; both on two
    pytest-xdist workers, a test file whole on one."""
    assert "`make test-fast`" in _section("Two commands on a fresh machine")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    run = {t: subprocess.run(["make", t, "-n", "--no-print-directory"], cwd=ROOT, env=env,
                             capture_output=True, text=True) for t in ("test-fast", "test")}
    assert all(r.returncode == 0 for r in run.values()), {t: r.stderr for t, r in run.items()}
    fast, full = (run[t].stdout.splitlines()[-1] for t in ("test-fast", "test"))
    assert ".venv/bin/python -m pytest -q tests -n 2 --dist loadfile -m \"not slow\"" in fast, fast
    assert full.endswith("-m pytest -q tests -n 2 --dist loadfile --durations=15"), full
    assert "slow" not in full, full


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
@pytest.mark.slow
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


# ---- docs/math.md's labels: cited, defined, linked ---------------------------------------------

# Labels are lower-case words joined by "-", cited in square brackets after "M:".
CITE = re.compile(r"\[M:([a-z0-9]+(?:-[a-z0-9]+)*)\]")
DEFINE = re.compile(r'<a id="m-([a-z0-9-]+)"></a>\[M:([a-z0-9-]+)\]')
ANCHOR = re.compile(r"(?:docs/math\.md|\()#(m-[a-z0-9-]+)")
TEXT_EXT = (".py", ".md", ".cpp", ".cu", ".h", ".toml", ".txt", ".sh", ".cfg", ".ini", ".yml",
            ".yaml")
# docs/math.md's "How to cite" paragraph writes the label syntax with the placeholder "name".
PLACEHOLDERS = {"name"}
SKIP_DIRS = {".git", ".venv", "build", "dist", "runs", "__pycache__", ".pytest_cache",
             "node_modules"}


def _repo_files():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames
                       if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            if name.endswith(TEXT_EXT) or name in ("Makefile", "run"):
                yield os.path.join(dirpath, name)


def _read_lenient(path):
    """Any text file of the repository (a stray byte is not this check's business)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _defined():
    text = _read_lenient(MATH)
    pairs = DEFINE.findall(text)
    assert pairs, "docs/math.md defines no labels"
    for anchor, label in pairs:
        assert anchor == label, f"docs/math.md: anchor m-{anchor} does not match label M:{label}"
    labels = [label for _, label in pairs]
    dup = {x for x in labels if labels.count(x) > 1}
    assert not dup, f"docs/math.md defines these labels twice: {sorted(dup)}"
    return set(labels), text


def _where_table(text):
    m = re.search(r'## <a id="where"></a>.*', text, re.S)
    assert m, 'docs/math.md has no section <a id="where"> (the label -> code table)'
    return m.group(0)


def test_every_cited_label_is_defined():
    defined, _ = _defined()
    bad = []
    for path in _repo_files():
        text = _read_lenient(path)
        for lineno, line in enumerate(text.splitlines(), 1):
            for label in CITE.findall(line):
                if label not in defined and label not in PLACEHOLDERS:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{lineno}: M:{label}")
    assert not bad, "labels cited but not defined in docs/math.md:\n" + "\n".join(bad)


def test_every_anchor_link_exists():
    defined, _ = _defined()
    anchors = {"m-" + x for x in defined | PLACEHOLDERS}
    bad = []
    for path in _repo_files():
        for lineno, line in enumerate(_read_lenient(path).splitlines(), 1):
            if "#m-" not in line:
                continue
            for anchor in ANCHOR.findall(line):
                # in math.md itself (#m-...) links; elsewhere only links into docs/math.md
                if (path == MATH or "docs/math.md#" in line) and anchor not in anchors:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{lineno}: #{anchor}")
    assert not bad, "links to anchors that docs/math.md does not have:\n" + "\n".join(bad)


def test_every_defined_label_is_cited_or_listed():
    defined, text = _defined()
    listed = set(CITE.findall(_where_table(text)))
    cited = set()
    for path in _repo_files():
        if path != MATH:
            cited.update(CITE.findall(_read_lenient(path)))
    missing = sorted(defined - listed - cited)
    assert not missing, ("labels defined in docs/math.md but neither cited in the repository nor "
                         f"listed in its 'Where the code computes each equation' table: {missing}")


def test_the_checks_can_fail():
    """The patterns find what they must: a citation, a definition and a link."""
    assert CITE.findall("see docs/math.md [" + "M:grad-self-keys], [" + "M:z0]") == \
        ["grad-self-keys", "z0"]
    assert CITE.findall("[" + "M:]" + " [" + "M:Bad]") == []
    assert DEFINE.findall('### <a id="m-ap"></a>[' + 'M:ap] AP') == [("ap", "ap")]
    assert ANCHOR.findall("[x](docs/math.md#m-inbatch)") == ["m-inbatch"]


# ---- recipes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_key_is_an_option_of_the_loader(path):
    from nac_fast.train.config import build_parser, load_recipe, parse
    raw = {k: v for k, v in _toml(path).items() if k != "description"}
    recipe = load_recipe(path, build_parser())   # UsageError on a key that is not a flag
    assert set(recipe) == set(raw)
    cfg = parse(["--config", path, "--data", "synthetic"])
    for key, value in recipe.items():
        assert getattr(cfg, key) == value, (key, getattr(cfg, key), value)


# The paper's Experimental Details (docs/math.md [M:recipe]); lr None = 0.075 sqrt(batch).
AUTHORS_HEADS = dict(head_bn=False, infer_bn=False, a_gain=1.0, r_gain=1.0, learn_gain=False,
                     infer_init="independent", scale_codes=True, code_dim=128)
PAPER_LOSS = dict(flip_prob=0.1, flip_prob_final=None, channel_likelihood="dot",
                  self_key="include", l2=0.1, wd=1e-6, warmup_epochs=None)
PAPER = {
    "cifar10.toml": dict(arch="resnet50", method="nac", batch_size=1000, epochs=1000, lr=3.0,
                         queue_size=50000, momentum=0.99, image=32, want_lr=3.0),
    "imagenet.toml": dict(arch="resnet50", method="nac", batch_size=512, epochs=200, lr=None,
                          queue_size=65536, momentum=0.999, image=224, want_lr=1.7),
    "imagenet_nac_mq.toml": dict(arch="resnet50", method="nac-mq", batch_size=512, epochs=200,
                                 lr=None, queue_size=65536, momentum=0.999, image=224,
                                 want_lr=1.7),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_recipes_hold_the_papers_values(name):
    from nac_fast.train.config import parse, resolve
    want = dict(PAPER[name])
    image, want_lr = want.pop("image"), want.pop("want_lr")
    cfg = parse(["--config", os.path.join(ROOT, "configs", name), "--data", "synthetic"])
    for key, value in {**want, **AUTHORS_HEADS, **PAPER_LOSS}.items():
        assert getattr(cfg, key) == value, (name, key, getattr(cfg, key), value)
    steps = 100
    run = resolve(cfg, world_size=1, device_type="cpu", steps_per_epoch=steps, image_size=image,
                  in_channels=3, num_images=steps * cfg.batch_size)
    assert run.lr == pytest.approx(want_lr, abs=0.005)           # 0.075 sqrt(512) = 1.697
    assert run.warmup_steps == 10 * steps                          # 10 epochs of warm-up
    assert run.momentum == want["momentum"]
    if cfg.method == "nac-mq":
        assert run.queue_size == want["queue_size"]


def test_math_recipe_table_matches_the_recipes():
    text = _read(os.path.join(ROOT, "docs", "math.md"))
    c, i = (_toml(os.path.join(ROOT, "configs", f)) for f in ("cifar10.toml", "imagenet.toml"))
    assert f"| batch (images) | {c['batch_size']} | {i['batch_size']} |" in text
    assert f"| epochs | {c['epochs']} | {i['epochs']} |" in text
    assert f"lr {c['lr']:.1f} |" in text
    assert f"M = {c['queue_size']}, EMA decay {c['momentum']:g}" in text
    assert f"M = {i['queue_size']}, EMA decay {i['momentum']:g}" in text


def test_paper_faithful_small_recipe_keeps_the_papers_loss():
    """README: the paper-faithful small-data run is `--config configs/fashion_mnist_paper.toml`;
    it scales the budget (docs/math.md [M:recipe], "Where the recipes differ") but keeps p,
    lambda and the authors' heads."""
    from nac_fast.train.config import parse
    cfg = parse(["--config", os.path.join(ROOT, "configs", "fashion_mnist_paper.toml")])
    for key, value in {**AUTHORS_HEADS, **PAPER_LOSS}.items():
        assert getattr(cfg, key) == value, (key, getattr(cfg, key), value)
    assert cfg.lr is None and cfg.min_steps is None


# ---- paths and links ---------------------------------------------------------------------------

PATH = re.compile(r"(?<![\w./-])((?:docs|bench|configs|scripts|nac_fast|tests|csrc|kernels)"
                  r"/[\w.*/-]*[\w*/])")


def _path_exists(rel):
    rel = rel.rstrip("/")
    full = os.path.join(ROOT, rel)
    if any(ch in rel for ch in "*"):
        return bool(glob.glob(full))
    return os.path.exists(full) or os.path.exists(full + ".py")


@pytest.mark.parametrize("doc", [README] + DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_named_repository_paths_exist(doc):
    bad = []
    for lineno, line in enumerate(_read(doc).splitlines(), 1):
        for m in PATH.finditer(line):
            rel = m.group(1)
            # placeholders (sm<arch>, loss_<device>), brace expansions ({time,memory}) and what
            # a build writes (the extension for another Python) are not repository paths
            if line[m.end():m.end() + 1] in ("<", "{") or "..." in rel or ".cpython-" in rel:
                continue
            if not _path_exists(rel):
                bad.append(f"{os.path.relpath(doc, ROOT)}:{lineno}: {rel}")
    assert not bad, "paths that do not exist:\n" + "\n".join(bad)


def _anchors(path):
    text = _read(path)
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.*)$", text, re.M):
        heading = re.sub(r"<a id=\"[^\"]*\"></a>", "", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", [README] + DOCS, ids=lambda p: os.path.relpath(p, ROOT))
def test_markdown_links_land(doc):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _read(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        full = doc if not path else os.path.normpath(os.path.join(os.path.dirname(doc), path))
        if not os.path.exists(full):
            bad.append(f"{target}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            bad.append(f"{target}: no such anchor")
    assert not bad, f"{os.path.relpath(doc, ROOT)}: links that do not land:\n" + "\n".join(bad)


# ---- flags -------------------------------------------------------------------------------------

def _options(parser):
    opts = set()
    for action in parser._actions:
        opts.update(action.option_strings)
    return opts


def _parsers():
    from nac_fast.eval.cli import build_parser as eval_parser
    from nac_fast.index.cli import build_parser as index_parser
    from nac_fast.train.config import build_parser as train_parser
    from nac_fast.vae.cli import build_parser as vae_parser
    out = {"train.py": _options(train_parser()), "nac_fast.eval": _options(eval_parser()),
           "nac_fast.vae": _options(vae_parser())}
    index = index_parser()
    sub = next(a for a in index._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        out[f"index {name}"] = _options(p)
    for script in glob.glob(os.path.join(ROOT, "scripts", "*.py")):
        src = _read(script)
        out[f"scripts/{os.path.basename(script)}"] = set(re.findall(r"[\"'](--[\w-]+)[\"']", src))
    return out


def _readme_snippets():
    """Each code-block line (backslash continuations joined) and each inline code span."""
    text = _read(README)
    blocks = re.findall(r"```(?:text|bash)\n(.*?)```", text, re.S)
    lines = []
    for block in blocks:
        lines += [ln.split("#")[0] for ln in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", prose, re.S)]
    return lines + spans


def _command_of(snippet):
    m = re.search(r"(?:nac_fast\.)?index (build|search|encode)\b", snippet)
    if m:
        return f"index {m.group(1)}"
    for key in ("nac_fast.eval", "nac_fast.vae", "train.py"):
        if key in snippet:
            return key
    m = re.search(r"scripts/(\w+\.py)", snippet)
    return f"scripts/{m.group(1)}" if m else None


# srun's options the README uses (SLURM is not installed here to ask it)
SRUN_FLAGS = {"--ntasks-per-node", "--nodes", "--ntasks", "--gpus-per-task", "--gpus-per-node"}


def _launcher_flags() -> set:
    """torchrun's own options (its parser) and srun's: a launcher's flags before the command."""
    from torch.distributed.run import get_args_parser
    opts = {o for a in get_args_parser()._actions for o in a.option_strings if o.startswith("--")}
    return opts | SRUN_FLAGS


def test_readme_flags_are_options_of_their_command():
    parsers = _parsers()
    everything = set().union(*parsers.values())
    launcher = _launcher_flags()
    bad = []
    for snippet in _readme_snippets():
        if re.search(r"\bpip\b", snippet):
            continue
        cmd = _command_of(snippet)
        head, tail = "", snippet
        if re.match(r"\s*(torchrun|srun)\b", snippet):  # the launcher's flags, then the command's
            key = cmd.split()[0] if cmd and cmd.startswith("index") else cmd
            head, tail = snippet.split(key, 1) if key and key in snippet else (snippet, "")
        elif cmd == "train.py":
            tail = snippet.split("train.py", 1)[1]
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", head):
            if flag not in launcher:
                bad.append(f"launcher: {flag} in {snippet.strip()!r}")
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", tail):
            known = parsers[cmd] if cmd in parsers else everything
            if flag not in known:
                bad.append(f"{cmd or 'prose'}: {flag} in {snippet.strip()!r}")
    assert not bad, "README flags that no command has:\n" + "\n".join(bad)


# ---- figures -----------------------------------------------------------------------------------

def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_readme_h100_figures_are_the_results_files():
    readme = _read(README)
    rows = _rows(os.path.join(H100 + "_run3", "loss_gpu.csv"))

    def row(kind, backend):
        (r,) = [r for r in rows if r["kind"] == kind and r["dtype"] == "bfloat16"
                and r["backend"] == backend and r["N"] == ("8192" if kind == "inbatch"
                                                           else "65536")]
        return r
    for kind in ("inbatch", "mq"):
        graph, eager = row(kind, "triton+graph"), row(kind, "reference")
        compiled = row(kind, "compiled-reference")
        ms = float(graph["median_s"]) * 1e3
        x_eager = float(eager["median_s"]) / float(graph["median_s"])
        x_compile = float(compiled["median_s"]) / float(graph["median_s"])
        pct = float(graph["pct_of_bound"])
        assert (f"{ms:.3f} ms" in readme or f"{ms:.2f} ms" in readme), (kind, ms)
        assert f"({math.floor(pct)}%" in readme or f"({round(pct)}%" in readme, (kind, pct)
        assert f"{round(x_eager)}x" in readme, (kind, x_eager)
        assert f"{x_compile:.1f}x" in readme, (kind, x_compile)
    train = json.load(open(os.path.join(H100 + "_run2", "train.json")))
    assert f"{round(train['img_per_s']):,} img/s" in readme
    assert f"{round(train['compile_s'])} s once" in readme
    ham = [float(r["speedup_vs_cpu"]) for r in _rows(os.path.join(H100 + "_run2",
                                                                   "hamming_gpu.csv"))
           if r["speedup_vs_cpu"]]
    assert f"{min(ham):.2f}-{max(ham):.1f}x" in readme, (min(ham), max(ham))


def _mean_std(xs):
    xs = [100 * x for x in xs]
    return f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}%"


# README results table row -> (group of docs/results_summary.json, budget, NAC variant, bits)
TABLE = {
    "2 epochs": ("budgets", "2 epochs,", "nac:default", "128"),
    "10 epochs": ("budgets", "10 epochs,", "nac:default", "128"),
    "20 epochs": ("budgets", "20 epochs,", "nac:default", "128"),
    "batch 64, 2400 steps": ("extra:fashion-mnist:2400 steps", "2400 steps,", "nac:p-constant",
                             "128"),
}


def test_readme_results_table_is_the_results_summary():
    summary = json.load(open(os.path.join(ROOT, "docs", "results_summary.json")))
    table = {}
    for line in _read(README).splitlines():
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 5:
            table[cells[0].split(" (")[0]] = cells[1:]
    assert set(TABLE) <= set(table), set(TABLE) - set(table)
    for label, (group, budget, nac, bits) in TABLE.items():
        (key,) = [k for k in summary if k.startswith(group)]
        runs = [r for r in summary[key] if r["budget"].startswith(budget)]
        got = []
        for variant in (nac, "simclr"):
            rs = [r for r in runs if r["variant"] == variant]
            assert len(rs) >= 2, (label, variant)
            got.append((variant, [r["map"][bits] for r in rs], [r["linear_top1"] for r in rs]))
        want = [_mean_std(got[0][1]), _mean_std(got[1][1]), _mean_std(got[0][2]),
                _mean_std(got[1][2])]
        assert table[label] == want, (label, table[label], want)


def test_kernels_and_training_docs_gpu_figures_are_the_results_files():
    """docs/kernels.md "GPU figures (H100)" and docs/training.md "Measured": the graph-replay
    times of the first and third runs and the compiled training rate, as their files hold them."""
    kernels = _read(os.path.join(ROOT, "docs", "kernels.md"))
    for run in ("", "_run3"):
        rows = [r for r in _rows(os.path.join(H100 + run, "loss_gpu.csv"))
                if r["backend"] == "triton+graph" and r["dtype"] == "bfloat16"
                and r["n"] == "8192" and r["N"] in ("8192", "65536")]
        for N in ("8192", "65536"):
            ms = sorted(float(r["median_s"]) * 1e3 for r in rows if r["N"] == N)
            shown = (f"{ms[0]:.3f}" if ms[0] == ms[-1] or f"{ms[0]:.3f}" == f"{ms[-1]:.3f}"
                     else f"{ms[0]:.3f}-{ms[-1]:.3f}")
            assert shown in kernels, (run or "_run1", N, shown)
    training = _read(os.path.join(ROOT, "docs", "training.md"))
    train = json.load(open(os.path.join(H100 + "_run2", "train.json")))
    assert f"**{round(train['img_per_s']):,}\nimg/s**" in training \
        or f"**{round(train['img_per_s']):,} img/s**" in training
    assert f"{round(train['peak_mem_mib']):,} MiB" in training
    assert f"compilation of {train['compile_s']:.1f} s" in training


# ---- a newcomer's README, and no machine's paths ------------------------------------------------

def test_readme_is_at_most_200_lines():
    """Issue 57: the README is the newcomer's page; details live in docs/."""
    n = len(_read(README).splitlines())
    assert n <= 200, f"README.md has {n} lines"


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users|mnt)/[\w.-]+")


def test_no_machine_paths_in_readme_docs_and_results():
    """README, docs/ and bench/results/*.md name paths a user of a checkout can type (relative
    to it, or placeholders like /path/imagenet), never the machine a run was made on."""
    files = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.json"))) + sorted(
        glob.glob(os.path.join(ROOT, "bench", "results", "*.md")))
    bad = [f"{os.path.relpath(f, ROOT)}: {m.group(0)}" for f in files
           for m in MACHINE_PATH.finditer(_read(f))]
    assert not bad, "machine paths:\n" + "\n".join(bad[:20])
