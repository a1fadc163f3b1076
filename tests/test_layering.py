"""The floor plan holds: each folder of ``cals_seg`` imports only folders on its own layer or
below (docs/design.md, "The floor plan"), counting imports inside functions too, and only
``__init__.py`` and ``errors.py`` stand at the top of the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cals_seg"

LAYERS = [
    {"errors", "utils"},
    {"data", "models", "metrics", "visualization"},
    {"losses", "calibrators"},
    {"evaluation", "config"},
    {"tasks"},
    {"runs"},
    {"training"},
    {"integrations", "commands"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: Path) -> set[tuple[str, int]]:
    """The ``cals_seg`` folders or top modules ``path`` imports, with the line of each."""
    tree = ast.parse(path.read_text())
    package = ".".join(("cals_seg", *path.relative_to(PACKAGE).with_suffix("").parts))
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: -node.level]
                if path.name == "__init__.py":
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names = [module] if module != "cals_seg" else [f"cals_seg.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "cals_seg" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_only_two_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py"]
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert set(folders) | {"errors"} == set(LAYER), "a new folder needs its layer here and in docs"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_up_a_layer(path):
    mine = LAYER[_part(path)]
    up = sorted(f"line {line}: cals_seg.{part} (layer {LAYER.get(part, '?')})"
                for part, line in _imported_parts(path)
                if part != _part(path) and LAYER.get(part, len(LAYERS)) > mine)
    assert not up, f"{path.relative_to(PACKAGE)} (layer {mine}) imports upward: {up}"
