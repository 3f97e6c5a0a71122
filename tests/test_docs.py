"""Cross-references into docs/: every ``results.md, "TITLE"`` and ``method.md §N "TITLE"`` cited by
the code, the configs, the tools and the documents names a section that exists (a citation may
shorten a title to its beginning, and may wrap over comment lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = [
    *sorted((REPO / "crtn").rglob("*.py")),
    *sorted((REPO / "conf").rglob("*.yaml")),
    *sorted((REPO / "tools").glob("*")),
    *sorted((REPO / "tests").glob("*.py")),
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
]
RESULTS = re.compile(r'results\.md,? "([^"]+)"')
METHOD = re.compile(r'method\.md §(\d)(?:,)? "([^"]+)"')


def headings(doc: str) -> list[str]:
    """The titles of a document's ``##`` and ``###`` headings."""
    text = (REPO / "docs" / doc).read_text()
    return [m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", text, re.M)]


def flat(path: Path) -> str:
    """The file's text with line breaks and comment markers joined into spaces, so that a citation
    wrapped over lines reads as one."""
    return re.sub(r"\s*\n\s*(?:#+ |// |\* )?\s*", " ", path.read_text(errors="replace"))


def citations(pattern: re.Pattern) -> list[tuple[str, tuple[str, ...]]]:
    found = []
    for path in SOURCES:
        if path.is_file() and path != Path(__file__):
            found += [(str(path.relative_to(REPO)), m.groups()) for m in pattern.finditer(flat(path))]
    return found


def test_citations_are_found():
    """The scan sees the citations (a wrapped one included), so the checks below check something."""
    assert len(citations(RESULTS)) >= 10 and len(citations(METHOD)) >= 5


@pytest.mark.parametrize("where,title", [(w, g[0]) for w, g in citations(RESULTS)])
def test_results_citation_names_a_section(where, title):
    assert any(h.startswith(title) for h in headings("results.md")), f"{where}: results.md has no {title!r}"


@pytest.mark.parametrize("where,groups", citations(METHOD))
def test_method_citation_names_a_section(where, groups):
    section, title = groups
    text = (REPO / "docs" / "method.md").read_text()
    start = text.index(f"## §{section} ")
    end = text.find("\n## §", start + 1)
    part = text[start : end if end > 0 else len(text)]
    titles = [m.group(1).strip() for m in re.finditer(r"^#{3} (.+)$", part, re.M)]
    # a paragraph or a list item that starts with a bold name is a named part of the section
    bold = [m.group(1).rstrip(".") for m in re.finditer(r"^(?:- )?\*\*([^*]+)\*\*", part, re.M)]
    assert any(t.startswith(title) for t in [*titles, *bold]), (
        f"{where}: method.md §{section} has no {title!r}"
    )


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


LINKS = re.compile(r"\]\((?:docs/)?results\.md#([^)]+)\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/findings.md"])
def test_links_into_results_name_a_heading(doc):
    """Every ``results.md#anchor`` link of the README and the findings resolves to a heading."""
    links = LINKS.findall((REPO / doc).read_text())
    assert links, f"{doc} links no results.md section"
    anchors = {anchor(h) for h in headings("results.md")}
    missing = sorted(set(links) - anchors)
    assert not missing, f"{doc}: results.md has no heading for {missing}"


METHOD_LINKS = re.compile(r"\]\((?:docs/)?method\.md#([^)]+)\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/findings.md", "docs/results.md", "CONTRIBUTING.md"])
def test_links_into_method_name_a_heading(doc):
    """Every ``method.md#anchor`` link resolves to a heading of docs/method.md."""
    anchors = {anchor(h) for h in headings("method.md")}
    missing = sorted(set(METHOD_LINKS.findall((REPO / doc).read_text())) - anchors)
    assert not missing, f"{doc}: method.md has no heading for {missing}"


def test_the_readme_python_api_runs():
    """The README's Python API example runs as printed, and its selection has the shape it states."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code.replace("print(", "result = ("), "README.md", "exec"), scope)  # noqa: S102
    slot_shape, alpha_shape = scope["result"]
    assert tuple(slot_shape) == tuple(alpha_shape) == (4, 16, 1)
    assert scope["out"].nll.shape == (4, 16)
