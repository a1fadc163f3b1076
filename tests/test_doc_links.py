"""Every relative link of README.md and docs/ (the studies included) leads somewhere: the file
exists, and a ``#section`` names a heading of that file as GitHub spells its anchor. Pages move
between the guides and docs/studies/; a link left behind fails here, not in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (a link there is an example)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "``", line))
    return "\n".join(kept)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped (letters,
    digits, ``_`` and ``-`` kept), each space a ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings, a repeated one numbered ``-1``, ``-2`` as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for m in LINK.finditer(_prose(doc.read_text(encoding="utf-8"))):
            target = m.group(1)
            if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are not checked here
                found.append((str(doc.relative_to(ROOT)), target))
    return found


LINKS = _links()


def test_there_are_links_to_check():
    assert len(LINKS) > 100
    assert any(doc.startswith("docs/studies/") for doc, _ in LINKS)


def test_anchor_spelling():
    assert anchor("The pixel goal post hoc, and the order-keeping calibrators, on CE") == \
        "the-pixel-goal-post-hoc-and-the-order-keeping-calibrators-on-ce"
    assert anchor("`margin: auto`: an opt-in experiment") == "margin-auto-an-opt-in-experiment"
    assert anchor("Choosing the margin (`tools/margin.py`)") == "choosing-the-margin-toolsmarginpy"


@pytest.mark.parametrize(("doc", "target"), LINKS, ids=[f"{d}->{t}" for d, t in LINKS])
def test_link_resolves(doc, target):
    path, _, section = target.partition("#")
    file = (ROOT / doc).parent / path if path else ROOT / doc
    assert file.exists(), f"{doc}: {target}: {file.relative_to(ROOT)} does not exist"
    if section and file.suffix == ".md":
        assert section in anchors(file), (
            f"{doc}: {target}: no heading of {file.relative_to(ROOT)} has the anchor #{section}")
