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
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in re.finditer(pattern, path.read_text(encoding="utf-8"), re.IGNORECASE):
            word = m.group("n").lower()
            found.append((f"{path.relative_to(ROOT)}: {m.group(0)!r}",
                          int(word) if word.isdigit() else WORDS.index(word)))
    return found


def test_calibrator_counts():
    """The docs count the core's calibrators: those of ``cals_seg/contrib/`` are opt-in and
    counted apart, whether or not another test has imported them."""
    from cals_seg.calibrators import CALIBRATORS

    core = [name for name in CALIBRATORS
            if not CALIBRATORS[name].__module__.startswith("cals_seg.contrib")]
    claims = _claims(r"\b" + NUMBER + r" (?:registered )?post-hoc calibrators\b")
    assert claims
    for where, n in claims:
        assert n == len(core), where


def test_setup_file_counts():
    n_files = len(list((ROOT / "configs").glob("*.yaml")))
    for where, n in _claims(r"\bthe " + NUMBER + r" setup files\b"):
        assert n == n_files, where


def test_public_names_are_listed_alike():
    """``cals_seg``'s public names are written once, ``_EXPORTS`` (name -> module); ``__all__`` is
    derived from it, and the names static analysers see (the ``TYPE_CHECKING`` imports, written
    out because they must be) are the same names, each from the same module, re-exported."""
    import ast

    import cals_seg

    tree = ast.parse((ROOT / "cals_seg" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    for a in sub.names:
                        assert a.asname == a.name, f"{a.name}: import it `as {a.name}`"
                        assert a.name not in typed, f"{a.name} imported twice"
                        typed[a.name] = sub.module
    assert cals_seg.__all__ == ["__version__", *cals_seg._EXPORTS]
    assert typed == cals_seg._EXPORTS
