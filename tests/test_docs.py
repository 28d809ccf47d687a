"""The documentation stands on its own: links resolve inside the repository, nothing points
outside it, and the sdist ships docs/ and examples/."""

from __future__ import annotations

import re
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
