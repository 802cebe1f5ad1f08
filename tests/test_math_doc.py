"""docs/math.md is the canonical math and the code cites it by label: every label cited anywhere
in the repository (code, docs, configs, tests) is defined in docs/math.md, every link to an anchor
of docs/math.md lands on one, and every label docs/math.md defines is either cited somewhere else
or listed in its table "Where the code computes each equation"."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(ROOT, "docs", "math.md")
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


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _defined():
    text = _read(MATH)
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
        text = _read(path)
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
        for lineno, line in enumerate(_read(path).splitlines(), 1):
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
            cited.update(CITE.findall(_read(path)))
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
