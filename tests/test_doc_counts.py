"""Counts the docs state in words ("ten post-hoc calibrators", "the thirteen setup files") equal
the registries and folders they count."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen", "twenty"]
NUMBER = r"(?P<n>\d+|" + "|".join(WORDS) + r")"


def _claims(pattern: str) -> list[tuple[str, int]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(pattern, path.read_text(encoding="utf-8"), re.IGNORECASE):
            word = m.group("n").lower()
            found.append((f"{path.relative_to(ROOT)}: {m.group(0)!r}",
                          int(word) if word.isdigit() else WORDS.index(word)))
    return found


def test_calibrator_counts():
    from cals_seg.calibrators import CALIBRATORS

    for where, n in _claims(r"\b" + NUMBER + r" (?:registered )?post-hoc calibrators\b"):
        assert n == len(CALIBRATORS), where


def test_setup_file_counts():
    n_files = len(list((ROOT / "configs").glob("*.yaml")))
    for where, n in _claims(r"\bthe " + NUMBER + r" setup files\b"):
        assert n == n_files, where


def test_public_names_are_listed_alike():
    """``cals_seg``'s public names: ``__all__``, the lazy table and the names static analysers
    see (the ``TYPE_CHECKING`` imports) are the same set."""
    import ast

    import cals_seg

    tree = ast.parse((ROOT / "cals_seg" / "__init__.py").read_text())
    typed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    typed |= {a.asname or a.name for a in sub.names}
    lazy = set(cals_seg._EXPORTS)
    assert set(cals_seg.__all__) == lazy | {"__version__"}
    assert typed == lazy
