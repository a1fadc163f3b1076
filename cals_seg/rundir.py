"""A run directory and everything written into it, read and written side by side.

    runs/<name>/
        config.yaml          the resolved config (every default filled in)
        history.jsonl        one JSON line per finished epoch
        checkpoint_last.pt   the state to resume from (model, optimizer, schedule, multipliers, RNG)
        checkpoint_best.pt   the same state at the best validation epoch
        test_metrics.json    the best checkpoint's test metrics, before and after temperature
                             scaling
        temperature.json     the temperature fitted on the validation split
        plots/*.png

Every file is written atomically (a temporary file, fsync, rename), and an epoch's files are
written in an order that leaves a consistent run whatever instant the process dies at: the
history line first, then ``checkpoint_last.pt``, then ``checkpoint_best.pt``. A resume keeps the
history lines of the epochs the checkpoint holds and repairs a best checkpoint the crash left
behind (see :meth:`RunDir.trim_history` and :meth:`RunDir.repair_best`).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

CHECKPOINT_FILES = ("checkpoint_last.pt", "checkpoint_best.pt")
RUN_FILES = ("config.yaml", "history.jsonl", *CHECKPOINT_FILES, "test_metrics.json")




def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/inf floats replaced by None, so that the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Any) -> None:
    """Call ``write(tmp_path)``, fsync the file, then rename it to ``path`` (and fsync the
    folder): a crash or power cut leaves either the old file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: str | Path, obj: Any) -> None:
    """Atomic, standard JSON (NaN/inf written as null)."""
    text = json.dumps(json_safe(obj), indent=1)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """``torch.save`` atomically (see :func:`atomic_write`)."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def link_checkpoint(src: str | Path, dst: str | Path) -> None:
    """Make ``dst`` an atomic copy of the checkpoint ``src`` without serialising it again: a
    hard link (``src`` is later *replaced*, never rewritten in place, so the link keeps this
    content), or a byte copy where the file system has no hard links."""
    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, dst)
    _fsync_dir(dst.parent)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`.

    It is a trusted file of this toolkit (it holds RNG states), so it is not loaded with
    ``weights_only``.

    Raises:
        CheckpointError: the file is missing, truncated or not a checkpoint of this toolkit.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError ...
        raise CheckpointError(
            f"Checkpoint {path} cannot be read ({type(err).__name__}: {str(err)[:120]}); it is "
            "truncated or not a checkpoint. Use the run's other checkpoint, or retrain."
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a cals_seg checkpoint (no 'model' entry).")
    return state


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) RNG states, for an exact resume."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (``[]`` when it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunDir:
    """The files of one run (see the module docstring). Only the main process writes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    config = property(lambda self: self.path / "config.yaml")
    history_file = property(lambda self: self.path / "history.jsonl")
    last = property(lambda self: self.path / "checkpoint_last.pt")
    best = property(lambda self: self.path / "checkpoint_best.pt")
    test_metrics = property(lambda self: self.path / "test_metrics.json")
    temperature_file = property(lambda self: self.path / "temperature.json")
    plots = property(lambda self: self.path / "plots")

    def holds_run(self) -> list[str]:
        """The files of a run found here (empty for a new or empty folder)."""
        return [name for name in RUN_FILES if (self.path / name).exists()]

    def check_resumable(self) -> None:
        """Refuse to resume from a folder without ``config.yaml`` and ``checkpoint_last.pt``.

        Raises:
            FileNotFoundError: naming what is missing and what to do instead.
        """
        if self.config.is_file() and self.last.is_file():
            return
        found = self.holds_run()
        what = ("does not exist" if not self.path.exists() else
                "holds no run" if not found else
                f"has no checkpoint_last.pt (it holds {', '.join(found)}: a finished run keeps "
                "only checkpoint_best.pt)")
        raise FileNotFoundError(
            f"--resume {self.path}: the folder {what}, so there is nothing to continue; start a "
            "new run without --resume (or name the run directory, runs/<name>)."
        )

    def history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.history_file)

    def append_history(self, record: dict[str, Any]) -> None:
        """Append one line and fsync it, so it survives before the checkpoint is written."""
        with self.history_file.open("a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def trim_history(self, next_epoch: int) -> None:
        """Keep the lines of the epochs before ``next_epoch`` (a crash after an epoch's line
        and before its checkpoint leaves a line that the resumed run writes again)."""
        kept = [h for h in self.history() if h["epoch"] < next_epoch]
        text = "".join(json.dumps(h) + "\n" for h in kept)
        atomic_write(self.history_file, lambda tmp: Path(tmp).write_text(text))

    def repair_best(self, last: dict[str, Any]) -> None:
        """A crash between ``checkpoint_last.pt`` and ``checkpoint_best.pt`` of an improving
        epoch leaves an older best: the last checkpoint IS the best one then, so copy it."""
        if last.get("best_epoch") != last.get("epoch"):
            return
        if self.best.is_file():
            try:
                if load_checkpoint(self.best).get("epoch") == last["epoch"]:
                    return
            except CheckpointError:
                pass
        save_checkpoint(last, self.best)

    def write_temperature(self, temperature: float, split: str = "val") -> None:
        write_json(self.temperature_file, {"temperature": temperature, "fitted_on": split})

    def read_temperature(self) -> float | None:
        """The temperature fitted on validation, or None when the run has none."""
        if not self.temperature_file.is_file():
            return None
        return float(json.loads(self.temperature_file.read_text())["temperature"])
