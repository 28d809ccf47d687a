"""The documentation stands on its own: links resolve inside the repository, nothing points
outside it, every repository path named in a comment or a document exists, and the sdist
ships docs/ and examples/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Documents the index links to that arrive with other changes; each leaves this set when it lands.
PENDING: set[str] = set()

LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"/work/|\.\./shared|DESIGN\.md|/tmp/|/home/|/root/")


def _heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces to '-')."""
    anchors = set()
    for line in text.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            title = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def test_docs_exist() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "design.md", "protocol.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve_inside_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        rel = dest.relative_to(ROOT).as_posix()  # raises if the link leaves the repository
        if rel in PENDING and not dest.exists():
            continue
        assert dest.exists(), f"{doc.name}: link {target!r} -> {rel} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _heading_anchors(dest.read_text()), f"{doc.name}: no heading for #{anchor} in {rel}"


@pytest.mark.parametrize(
    "doc", [*DOCS, *sorted((ROOT / "examples").glob("*.py"))], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_nothing_points_outside_the_repository(doc: Path) -> None:
    hits = [line for line in doc.read_text().splitlines() if OUTSIDE.search(line)]
    assert not hits, f"{doc.name} refers outside the repository: {hits[:3]}"


def test_design_sections_are_numbered_one_to_eight() -> None:
    # Code comments cite "design.md section N": the numbering is part of the contract.
    text = (ROOT / "docs" / "design.md").read_text()
    numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.MULTILINE)]
    assert numbers == list(range(1, 9))


def test_sdist_ships_docs_and_examples() -> None:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["scikit-build"]["sdist"]["include"]
    assert {"docs", "examples"} <= set(include)


#: Text files whose comments and prose name repository paths.
_TEXT_SUFFIXES = (".py", ".pyx", ".pxd", ".pyi", ".hpp", ".cpp", ".h", ".c", ".cu", ".cuh", ".md", ".sh", ".txt",
                  ".cmake", ".toml", ".in")
#: A path from a top-level folder of the repository (relative to the root or to the naming file).
_TOP_PATH = re.compile(r"(?<![\w/.$])((?:csrc|src|docs|tests|bench|examples|\.ci)/[\w.\-/]*[\w\-/])")
#: A public header by its include path.
_INCLUDE = re.compile(r"(?<![\w/])dspark/(\w+\.h(?:pp)?)\b")
#: A source file named by its name or a partial path (``reference/stager.py``).
_SOURCE = re.compile(r"(?<![\w/.\-$])((?:\w+/)*\w+\.(?:py|pyx|pxd|pyi|hpp|cpp|cu|cuh))\b")


#: C-family sources: only their comments are prose (``fx.cpp`` in code is a member).
_C_FAMILY = (".hpp", ".cpp", ".h", ".c", ".cu", ".cuh")
_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _prose(path: str, text: str) -> str:
    """The part of a file that names other files in words: a C-family file's comments, else all of it."""
    return "\n".join(_C_COMMENT.findall(text)) if path.endswith(_C_FAMILY) else text


def _not_a_file(path: str, names: set[str]) -> bool:
    """Names of that shape that are not files of this repository: a project, the
    wheel's installed SDK layout, a short variable's member named in a comment
    (``fx.cpp``), and C++ the build generates from a .pyx."""
    if path == "llama.cpp" or path.startswith("dspark_core/include/") or len(path.rsplit(".", 1)[0]) < 3:
        return True
    return path.endswith(".cpp") and any(n.endswith("/" + path[:-4] + ".pyx") for n in names)


def _repository_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore, less any virtual environment
    made inside the checkout (``python -m venv .venv``: a tree of other projects' files)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    venvs = tuple(f[: -len("pyvenv.cfg")] for f in out if f.endswith("/pyvenv.cfg"))
    return [f for f in out if (ROOT / f).exists() and not (venvs and f.startswith(venvs))]


def test_paths_named_in_comments_and_docs_exist() -> None:
    """A comment or document that names a file of the repository names one that exists
    (the reference twin's old module path was cited for months after it moved)."""
    files = _repository_files()
    names = set(files)
    missing = []
    for f in files:
        if not (f.endswith(_TEXT_SUFFIXES) or f == ".ci/run"):
            continue
        here = (ROOT / f).parent
        text = _prose(f, (ROOT / f).read_text(errors="replace"))
        for m in _TOP_PATH.finditer(text):
            path = m.group(1).rstrip("/.")
            if text[m.end():m.end() + 1] in ("*", "$", "{"):
                continue  # a glob or a name built at run time
            if not ((ROOT / path).exists() or (here / path).exists()):
                missing.append(f"{f}: {path}")
        for m in _INCLUDE.finditer(text):
            if not (ROOT / "csrc" / "include" / "dspark" / m.group(1)).exists():
                missing.append(f"{f}: dspark/{m.group(1)}")
        for m in _SOURCE.finditer(text):
            path = m.group(1)
            if path.startswith(("csrc/", "src/", "docs/", "tests/", "bench/", "examples/")):
                continue  # checked above
            if _not_a_file(path, names):
                continue
            if not any(n == path or n.endswith("/" + path) for n in names):
                missing.append(f"{f}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(set(missing)))


#: A design.md section cited by number: ``design.md §2``, ``design.md 2.1``, ``design.md section 8``.
_DESIGN_SECTION = re.compile(r"design\.md`?\)?,?\s+(?:§\s*|sections?\s+)?(\d+(?:\.\d+)?)(?![\d.]*\d)")


def test_design_sections_named_in_comments_and_docs_exist() -> None:
    """A comment or document citing a numbered section of design.md cites one it has
    (a comment named 2.5, lifecycle, for the batch arrays of 2.9 after a renumbering)."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", design, flags=re.MULTILINE))
    assert {"2", "2.1", "2.9", "8"} <= sections  # the headings parse
    cited, missing = 0, []
    for f in _repository_files():
        if not f.startswith(("csrc/", "src/", "docs/")) or not f.endswith(_TEXT_SUFFIXES):
            continue
        for m in _DESIGN_SECTION.finditer((ROOT / f).read_text(errors="replace")):
            cited += 1
            if m.group(1) not in sections:
                missing.append(f"{f}: design.md {m.group(1)}")
    assert cited > 20  # the pattern still finds the citations
    assert not missing, "design.md sections that do not exist:\n" + "\n".join(sorted(set(missing)))
