"""The README and the pages under docs/ link to each other: every relative link, and every
``#anchor`` in one, must point at a file and a heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, whose brackets are not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lowercase, punctuation dropped, spaces as hyphens,
    a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_checker_sees_links_and_anchors():
    readme = ROOT / "README.md"
    assert "docs/contract.md" in _links(readme)
    assert "quickstart" in _anchors(readme)
    assert "writing-into-a-given-tensor-out" in _anchors(ROOT / "docs" / "semantics.md")
