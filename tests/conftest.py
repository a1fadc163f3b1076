"""Shared test helpers: the command-line tools loaded as modules, and the ``cuda`` marker."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one")


def load_tool(name: str) -> ModuleType:
    """The command behind ``tools/<name>.py``: ``cals_seg.commands.<name>``."""
    return importlib.import_module(f"cals_seg.commands.{name}")


def recomputed_test_accuracy(run_dir: Path) -> tuple[float, int]:
    """Accuracy of ``run_dir/checkpoint_best.pt`` on the test split, one sample at a time with a
    plain loop (no meter, no DataLoader): an independent check of ``test_metrics.json``."""
    import torch

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.utils.io import load_checkpoint

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


# No test touches the network: pretrained weights that are not cached fail at once
# (cals_seg.models._hub reads this), and huggingface_hub itself stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
