"""README.md stays short, and the docs it leads to hold together: every relative link in README.md
and docs/ names a file (and a heading, where it names one) that exists, and every page under docs/
can be reached from README.md by following links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = sorted([README, *(REPO / "docs").rglob("*.md")])

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _links(page: Path) -> list[str]:
    """Relative link targets of a page (no scheme, no mail address), inline code removed first."""
    targets = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                targets.append(target)
    return targets


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-',
    a repeated one numbered."""
    seen: dict[str, int] = {}
    for line in _prose(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def _resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page.parent / path if path else page), anchor


def test_readme_is_at_most_120_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= 120, f"README.md has {lines} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in _links(page):
        path, anchor = _resolve(page, target)
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    reached, todo = {README.resolve()}, [README]
    while todo:
        page = todo.pop()
        for target in _links(page):
            path, _ = _resolve(page, target)
            path = path.resolve()
            if path.suffix == ".md" and path.is_file() and path not in reached:
                reached.add(path)
                todo.append(path)
    lost = [str(p.relative_to(REPO)) for p in PAGES if p.resolve() not in reached]
    assert not lost, f"no chain of links from README.md reaches {lost}"


def _plan_headline(text: str) -> list[str]:
    """The per-host table and the Plan: line of a page's example plan."""
    lines = text.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith("Plan: "))
    start = max(i for i in range(end) if lines[i].startswith("host "))
    return [line for line in lines[start:end + 1] if line.strip() and line.strip() != "..."]


def test_the_readmes_plan_line_is_the_tours():
    """README quotes the Plan: line of the tour's real plan of three fresh lab hosts."""
    quoted = re.findall(r"`(Plan: [^`]*)`", (REPO / "README.md").read_text())
    tour = _plan_headline((REPO / "docs" / "tour.md").read_text())
    assert tour[-1].startswith("Plan: ") and len(tour) >= 5
    assert quoted == [tour[-1]]
