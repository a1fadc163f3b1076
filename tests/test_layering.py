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
    {"contrib"},  # experiments beside the core: they may use it all; nothing imports them
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


def test_the_core_never_imports_contrib():
    """``cals_seg/contrib/`` is opt-in: no module outside it imports it, at the top or inside a
    function (the one loader, :func:`cals_seg.utils.registry.enable_contrib`, imports the modules
    a user names, by a name it checks against the folder)."""
    core = [p for p in MODULES if _part(p) != "contrib"]
    found = sorted(f"{p.relative_to(PACKAGE)}:{line}" for p in core
                   for part, line in _imported_parts(p) if part == "contrib")
    assert not found


# ----------------------------------------------------------------------------- module graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALL_MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
    return False


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(module, line, inside a function)`` for each ``cals_seg`` module ``path`` imports at run
    time (``TYPE_CHECKING`` blocks left out): ``from pkg import name`` counts as importing the
    submodule ``pkg.name`` when it is one, else ``pkg`` (its ``__init__``). The package
    ``__init__`` Python runs first when a submodule is imported is not counted: a submodule never
    needs a name of it that is not yet bound."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or _in_type_checking(node, parents):
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif node.module and not node.level:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in ALL_MODULES
                       else node.module for a in node.names]
        inside = _in_function(node, parents)
        out += [(t, node.lineno, inside) for t in targets if t in ALL_MODULES]
    return out


IMPORTS = {name: _imports(path) for name, path in ALL_MODULES.items()}


def _reach(start: str) -> set[str]:
    """The modules ``start`` imports when it is imported (top-level imports, transitively)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name, _, inside in IMPORTS[todo.pop()]:
            if not inside and name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_of_another_packages_private_module():
    """``cals_seg.X._y`` is X's own business: other folders use X's public names (except
    ``cals_seg/contrib/``, experiments built from the core's parts, as a file of X would be)."""
    found = []
    for name, imports in IMPORTS.items():
        if _package(name) == "contrib":
            continue
        for target, line, _ in imports:
            private = any(p.startswith("_") and p != "__init__" for p in target.split(".")[2:])
            if private and _package(target) != _package(name):
                found.append(f"{name}:{line} imports {target}")
    assert not found, "\n".join(sorted(set(found)))


def test_no_import_circle_between_modules():
    """No module imports, through top-level imports, a module that imports it back."""
    circles = sorted(name for name in IMPORTS if name in _reach(name))
    assert not circles, f"modules in import circles: {circles}"


def test_no_function_level_import_only_breaks_a_circle():
    """An import inside a function is for start-up time (a heavy library, a command's
    ``--help``), never to dodge a circle: moving it to the top of its module would not close one."""
    dodges = sorted(f"{name}:{line} imports {target}" for name, imports in IMPORTS.items()
                    for target, line, inside in imports
                    if inside and target != name and name in _reach(target))
    assert not dodges, "\n".join(dodges)
