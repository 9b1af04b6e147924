"""Every relative link of README.md and docs/**/*.md resolves: the file exists, and a ``#fragment``
into a Markdown file names one of its headings (GitHub's anchors: lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` for repeats). Links with a scheme (https:, mailto:) are not
followed: the check runs offline."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: [text](target) and ![alt](target); the target ends at whitespace (an optional "title" follows)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (their brackets are no links)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of every ATX heading of a Markdown text."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that do not resolve, as ``target (why)``."""
    bad = []
    for m in LINK.finditer(_prose(page.read_text(encoding="utf-8"))):
        target = m.group(1)
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target} (no heading with that anchor)")
    return bad


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links"


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## `name`: a section (B > 1)\n\n## Repeat\n\n## Repeat\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#name-a-section-b--1) [ok](other.md#repeat-1) ![ok](other.md) "
                    "[web](https://example.org/x.md) `[code](nothing.md)`\n"
                    "[gone](missing.md) [no anchor](other.md#repeat-2) [self](#nowhere)\n"
                    "```\n[fenced](also-missing.md)\n```\n")
    assert broken_links(page) == ["missing.md (no such file)", "other.md#repeat-2 (no heading with that anchor)",
                                  "#nowhere (no heading with that anchor)"]
