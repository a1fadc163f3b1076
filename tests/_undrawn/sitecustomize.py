"""Read by Python at the start of a child process whose ``PYTHONPATH`` names this folder
(:func:`tests._undrawn.children_undrawn`): once the child imports ``matplotlib.figure``,
``Figure.savefig`` writes :data:`PLACEHOLDER_PNG` to the file without drawing, as
tests/conftest.py's ``figures_undrawn`` does in the test process. A child that never imports
matplotlib imports nothing more."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

# A 1 x 1 transparent PNG (the bytes of tests/conftest.py: PLACEHOLDER_PNG).
PLACEHOLDER_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360606060000000050001a5f645400000000049454e44ae426082")


def _placeholder_savefig(self: Any, fname: Any, *args: Any, **kwargs: Any) -> None:
    if hasattr(fname, "write"):
        fname.write(PLACEHOLDER_PNG)
    else:
        Path(fname).write_bytes(PLACEHOLDER_PNG)


class _PatchFigure:
    """A meta-path finder that lets ``matplotlib.figure`` load as usual, then replaces
    ``Figure.savefig``; it removes itself at that first import."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "matplotlib.figure":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            module.Figure.savefig = _placeholder_savefig

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchFigure())
