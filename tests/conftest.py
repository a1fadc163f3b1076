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


def recomputed_test_accuracy(run_dir: Path) -> tuple[float, int]:
    """Accuracy of ``run_dir/checkpoint_best.pt`` on the test split, one sample at a time with a
    plain loop (no meter, no DataLoader): an independent check of ``test_metrics.json``."""
    import torch

    from cals_seg.config import load_config
    from cals_seg.rundir import load_checkpoint
    from cals_seg.tasks import build_task

    cfg = load_config(run_dir / "config.yaml")
    task = build_task(cfg)
    task.model.load_state_dict(load_checkpoint(run_dir / "checkpoint_best.pt")["model"])
    task.model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(len(task.test_set)):
            x, y = task.test_set[i]
            correct += int(task.model(x[None]).argmax(dim=1).item() == int(y))
    return correct / len(task.test_set), len(task.test_set)
