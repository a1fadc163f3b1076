"""Every name the user docs show resolves: each ``from cals_seg... import ...`` line and each
dotted ``cals_seg.x.y`` reference in README.md and docs/*.md imports (a moved or renamed module
fails here, not in a user's terminal)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The studies too, but not the page of retired code: it names code as it was at the commit it
# gives (`git show COMMIT:PATH`), gone from HEAD by definition.
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                    if p != ROOT / "docs" / "studies" / "retired.md")]


def _name(doc: Path) -> str:
    """``README.md``, ``design.md``, ``studies/margin.md``: the doc as the failures name it."""
    return doc.relative_to(ROOT / "docs").as_posix() if doc.parent != ROOT else doc.name

IMPORT_RE = re.compile(
    r"^[ \t]*from[ \t]+(cals_seg[\w.]*)[ \t]+import[ \t]+(?:\(([^)]*)\)|([\w, \t]+))", re.M)
DOTTED_RE = re.compile(r"(?<![\w./-])cals_seg(?:\.\w+)+")


def _import_lines() -> list[tuple[str, str, str]]:
    found = []
    for doc in DOCS:
        for m in IMPORT_RE.finditer(doc.read_text()):
            names = (m.group(2) or m.group(3)).replace("\n", ",").split(",")
            for name in (n.split("#")[0].split(" as ")[0].strip() for n in names):
                if name.isidentifier():
                    found.append((_name(doc), m.group(1), name))
    return sorted(set(found))


def _dotted() -> list[tuple[str, str]]:
    """Every dotted ``cals_seg.x.y`` of the docs, except a pattern whose last part is a
    placeholder in capitals (``cals_seg.contrib.NAME``: its parent is still checked)."""
    found = set()
    for doc in DOCS:
        for m in DOTTED_RE.finditer(doc.read_text()):
            dotted = m.group(0).rstrip(".")
            if dotted.rsplit(".", 1)[1].isupper():
                dotted = dotted.rsplit(".", 1)[0]
            found.add((_name(doc), dotted))
    return sorted(found)


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted`` and walk the rest as attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name and not ".".join(parts[:cut]).startswith(err.name):
                raise  # a dependency is missing, not the documented module
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_docs_document_names():
    assert len(_import_lines()) >= 10
    assert len(_dotted()) >= 10


@pytest.mark.parametrize(("doc", "module", "name"), _import_lines())
def test_documented_import_resolves(doc, module, name):
    pytest.importorskip("torch")
    if module.startswith("cals_seg.integrations"):
        pytest.importorskip("lightning" if "lightning" in module else "torchmetrics")
    mod = importlib.import_module(module)
    assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), (
        f"{doc}: `from {module} import {name}` fails")


@pytest.mark.parametrize(("doc", "dotted"), _dotted())
def test_documented_dotted_name_resolves(doc, dotted):
    if dotted.startswith("cals_seg.integrations"):
        pytest.importorskip("lightning" if "lightning" in dotted else "torchmetrics")
    try:
        _resolve(dotted)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{doc}: `{dotted}` does not resolve ({err})")
