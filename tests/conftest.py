"""Shared test helpers: the command-line tools loaded as modules, and the ``cuda`` marker."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one")


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
