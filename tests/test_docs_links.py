"""Every relative link in README.md and docs/*.md resolves: to a file, and to a heading where it names one.

Pages move and headings change as the project grows; a newcomer following a dead link is lost
at once. Links are markdown's `[text](target)`; web links (http, https, mailto) are not checked,
and neither is anything inside code (fenced blocks and `inline code`), which is text, not links.
Anchors are GitHub's: the heading lowercased, everything but letters, digits, `_`, `-` and
spaces dropped, spaces made `-`, and `-1`, `-2`, ... added to repeats.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
_WEB = ("http://", "https://", "mailto:")


def pages(root: Path) -> list[Path]:
    """The pages whose links are checked: README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text with code removed: fenced blocks first (they may hold backticks), then spans."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown page."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(root: Path) -> tuple[int, list[str]]:
    """How many relative links the pages under root hold, and each one that does not resolve."""
    checked, broken = 0, []
    for page in pages(root):
        for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if target.startswith(_WEB):
                continue
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {dest}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return checked, broken


def test_every_relative_link_resolves() -> None:
    checked, broken = broken_links(ROOT)
    assert len(pages(ROOT)) > 1, "expected README.md and pages under docs/"
    assert checked > 0, "expected relative links in README.md and docs/*.md, found none"
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n[ok](docs/a.md) [ok anchor](docs/a.md#the-one-path-scriptsx_y) [web](https://example.org/x)\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#no-such-heading)\n"
        "`[in code](docs/missing-in-code.md)`\n```\n[in a block](docs/missing-in-block.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## The one path (`scripts/x_y`)\n\n[back](../README.md#top) [self](#a) [self gone](#b)\n")
    checked, broken = broken_links(tmp_path)
    assert checked == 7
    assert [line.split(": ", 2)[1] for line in broken] == [
        "(docs/missing.md)", "(docs/a.md#no-such-heading)", "(#b)"]
