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

A checkpoint holds tensors, numbers, strings, lists, tuples and dicts only, and is read with
``torch.load(weights_only=True)``: loading a checkpoint someone shared cannot run code
(:func:`load_checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cals_seg.errors import CheckpointError, MissingPathError
from cals_seg.utils.io import (
    atomic_write,
    json_safe,
    load_checkpoint,
    read_jsonl,
    save_checkpoint,
    write_json,
)

CHECKPOINT_FILES = ("checkpoint_last.pt", "checkpoint_best.pt")
RUN_FILES = ("config.yaml", "history.jsonl", *CHECKPOINT_FILES, "test_metrics.json")


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
        if self.config.is_file() and (self.last.is_file() or not (
                self.best.is_file() or self.test_metrics.is_file())):
            return  # a checkpoint to continue from, or none yet: the run starts again
        found = self.holds_run()
        what = ("does not exist" if not self.path.exists() else
                "holds no run" if not found else
                f"has no checkpoint_last.pt (it holds {', '.join(found)}: a finished run keeps "
                "only checkpoint_best.pt)")
        raise MissingPathError(
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
