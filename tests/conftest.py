"""Shared test helpers: the command-line tools loaded as modules, the ``cuda`` marker, nested
results compared within a tolerance, and the single-thread fixture."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one")
    # Consent remembered by import_model / train_seg (cals_seg.models.consent) goes to a file of
    # this test process, never to the developer's own ~/.config; removed when the process ends.
    if "CALS_SEG_CONSENT_FILE" not in os.environ:
        import atexit
        import shutil
        import tempfile

        folder = tempfile.mkdtemp(prefix="cals_seg_consent_")
        atexit.register(shutil.rmtree, folder, True)
        os.environ["CALS_SEG_CONSENT_FILE"] = os.path.join(folder, "consent.json")


def autocast_nesting() -> int:
    """Autocast's nesting count in this thread (a torch 2.14 dynamo trace that raises leaves it
    one too high; tests/test_autocast.py)."""
    import torch

    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


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
# (cals_seg.models.hub reads this), and huggingface_hub itself stays offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
def assert_tree_close(got: Any, want: Any, rel: float = 1e-12, abs_: float = 1e-15,
                      path: str = "") -> None:
    """``got`` has the structure of ``want`` (dicts with the same keys, lists and tuples of the
    same length) and the same leaves: floats within ``math.isclose(rel_tol=rel, abs_tol=abs_)``,
    anything else (ints, None, strings) equal. ``path`` names the leaf that differs."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_tree_close(got[key], want[key], rel, abs_, f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_tree_close(a, b, rel, abs_, f"{path}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=rel, abs_tol=abs_), (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.fixture(scope="session", autouse=True)
def one_thread() -> Iterator[None]:
    """Every test on one torch thread: on a shared machine the many small ops of the meters and
    losses are faster without OpenMP hand-offs, and float64 sums that a test compares to
    1e-12 (streamed against one-shot) do not depend on how a parallel reduction splits them.
    The distributed workers of ``tests/_dist.py`` set one thread themselves."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fake_run(run: Path, cfg: Any, epoch: int | None = 0, model: Any = None,
             config: bool = False, temperature: float | None = None) -> Path:
    """A run folder without training: ``checkpoint_best.pt`` of ``model`` (default: the
    random-weight model of ``cfg`` after ``torch.manual_seed(0)``), with ``epoch`` unless None;
    ``config``: also ``config.yaml``; ``temperature``: also ``temperature.json``."""
    import torch

    from cals_seg.config.schema import save_config
    from cals_seg.runs.run import Run
    from cals_seg.tasks.segmentation import build_model

    run.mkdir(parents=True, exist_ok=True)
    if config:
        save_config(cfg, run / "config.yaml")
    if model is None:
        torch.manual_seed(0)
        model = build_model(cfg)
    state = {"model": model.state_dict(), "num_classes": cfg.data.num_classes}
    if epoch is not None:
        state["epoch"] = epoch
    torch.save(state, run / "checkpoint_best.pt")
    if temperature is not None:
        Run(run).write_temperature(temperature)
    return run
