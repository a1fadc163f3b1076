"""Live logging of a training run: CSV, TensorBoard and Weights & Biases (``train.loggers``).

``history.jsonl`` is always written (one JSON line per epoch); ``train.loggers`` adds:

- ``csv``: ``<run>/metrics.csv``, the history as a table, rewritten after every epoch (so after
  a resume it holds exactly the history's lines). Lists of K values (``lambda``, ``rho``) become
  one column per class, ``lambda/<class name>``. Its ``epoch`` column counts from 1, as the
  console and TensorBoard do (``history.jsonl`` keeps the 0-based index).
- ``tensorboard``: event files in ``<run>/tensorboard`` (``tensorboard --logdir runs``).
- ``wandb``: a Weights & Biases run (project ``$WANDB_PROJECT`` or ``cals_seg``, named after the
  run, the resolved config as its config), its files under ``<run>/wandb``. ``WANDB_MODE=offline``
  logs without an account or a network (``wandb sync`` uploads it later).

TensorBoard and W&B receive, at step ``epoch + 1`` (the epoch number the training prints), every
number of the history line -- train terms (``train/<term>``), validation metrics
(``val/<metric>``), ``lr``, ``time``, the multipliers (``lambda/<class>``, ``rho/<class>``) and
the margin of ``margin: auto`` -- and two figures: the validation reliability diagram
(``val/reliability``) and the multiplier curves so far (``multipliers``, adaptive losses only).
At the end of the run the test metrics of the best checkpoint before and after temperature
scaling (``test/<metric>``, ``test_ts/<metric>``) and their reliability diagrams follow.

Only the main process logs (the trainer calls these objects on rank 0 only); every process
checks the names, so a missing package stops every rank before the first epoch with the
command that installs it.
"""

from __future__ import annotations

import csv
import io
import os
import secrets
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cals_seg.config.rules import LOGGERS, LoggerError, check_loggers


# ----------------------------------------------------------------------------- flattening
def flatten_record(record: Mapping[str, Any], class_names: Sequence[str]) -> dict[str, Any]:
    """One history line as flat columns: numbers, strings and bools as they are, a list of K
    numbers as ``<key>/<class name>`` (``<key>/<index>`` for other lengths), None dropped."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, list | tuple):
            names = class_names if len(value) == len(class_names) else range(len(value))
            for name, v in zip(names, value, strict=True):
                if v is not None:
                    out[f"{key}/{name}"] = v
        elif isinstance(value, dict):
            for sub, v in flatten_record(value, class_names).items():
                out[f"{key}/{sub}"] = v
        elif value is not None:
            out[key] = value
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def scalar_tags(record: Mapping[str, Any], class_names: Sequence[str]) -> dict[str, float]:
    """The numbers of one history line under their TensorBoard / W&B tags: ``train_<term>`` ->
    ``train/<term>``, ``val_<metric>`` -> ``val/<metric>``, the rest (``lr``, ``time``,
    ``lambda/<class>``, ``margin`` ...) as flattened; ``epoch`` is the step, not a scalar."""
    out = {}
    for key, value in flatten_record(record, class_names).items():
        if key == "epoch" or not _is_number(value):
            continue
        for prefix in ("train_", "val_"):
            if key.startswith(prefix):
                key = f"{prefix[:-1]}/{key[len(prefix):]}"
                break
        out[key] = float(value)
    return out


def _render(draw: Callable[[Path], Any]) -> np.ndarray | None:
    """Run a plotting function that writes a PNG and return the image ``(H, W, 3)`` uint8."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.png"
        if draw(path) is False or not path.is_file():
            return None
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB")).copy()


def epoch_figures(val: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                  class_names: Sequence[str], title: str) -> dict[str, np.ndarray]:
    """The validation reliability diagram and the multiplier curves as RGB arrays."""
    from cals_seg.visualization import plotting

    images = {}
    rel = val.get("reliability")
    if rel is not None and sum(rel.get("count", [])) > 0:
        image = _render(lambda p: plotting.plot_reliability_diagram(
            rel, p, title=f"{title} validation", ece=val.get("ece")))
        if image is not None:
            images["val/reliability"] = image
    if any(e.get("lambda") is not None for e in history):
        image = _render(lambda p: plotting.plot_multiplier_curves(history, p, class_names))
        if image is not None:
            images["multipliers"] = image
    return images


# ----------------------------------------------------------------------------- the loggers
class CSVLogger:
    """``<run>/metrics.csv``: the whole history, rewritten after every epoch."""

    def __init__(self, run_path: Path, class_names: Sequence[str]) -> None:
        self.path = Path(run_path) / "metrics.csv"
        self.class_names = list(class_names)

    def log_history(self, history: Sequence[Mapping[str, Any]]) -> None:
        # epochs counted from 1, as the console and TensorBoard count them
        rows = [{**flatten_record(h, self.class_names), "epoch": int(h["epoch"]) + 1}
                for h in history]
        columns: list[str] = []
        for row in rows:
            columns.extend(k for k in row if k not in columns)
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
        tmp = self.path.with_suffix(".csv.tmp")
        tmp.write_text(buffer.getvalue())
        os.replace(tmp, self.path)


class TensorBoardLogger:
    """Event files in ``<run>/tensorboard``; a resume drops the events of later steps."""

    def __init__(self, run_path: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_path) / "tensorboard"),
                                    purge_step=start_step if start_step > 1 else None)

    def log(self, step: int, scalars: Mapping[str, float],
            images: Mapping[str, np.ndarray]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        for tag, image in images.items():
            self.writer.add_image(tag, image, global_step=step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run under ``<run>/wandb``; its id is kept in ``<run>/wandb_run_id`` so that a
    resumed training continues the same W&B run."""

    def __init__(self, run_path: Path, name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        id_file = Path(run_path) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "cals_seg"), name=name, id=run_id,
            resume="allow", dir=str(run_path), config=dict(config), reinit="finish_previous",
        )

    def log(self, step: int, scalars: Mapping[str, float],
            images: Mapping[str, np.ndarray]) -> None:
        data: dict[str, Any] = dict(scalars)
        data.update({tag: self.wandb.Image(image) for tag, image in images.items()})
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class RunLoggers:
    """The loggers of one run, called by the trainer on the main process.

    Args:
        names: ``train.loggers`` (known names whose package is installed: :func:`check_loggers`,
            which the config check and :func:`~cals_seg.training.trainer.fit` run first).
        run_path: the run directory.
        config: the resolved config as a dict (W&B stores it).
        class_names: K names, for the per-class columns and tags.
        start_epoch: the first epoch this process trains (0, or the resumed one).
    """

    def __init__(self, names: Sequence[str], run_path: str | Path, config: Mapping[str, Any],
                 class_names: Sequence[str], start_epoch: int = 0) -> None:
        self.run_path = Path(run_path)
        self.class_names = list(class_names)
        self.csv = CSVLogger(self.run_path, class_names) if "csv" in names else None
        self.live: list[Any] = []
        if "tensorboard" in names:
            self.live.append(TensorBoardLogger(self.run_path, start_epoch + 1))
        if "wandb" in names:
            self.live.append(WandbLogger(self.run_path, self.run_path.name, config))
        self.last_step = start_epoch

    def log_epoch(self, record: Mapping[str, Any], val: Mapping[str, Any],
                  history: Sequence[Mapping[str, Any]]) -> None:
        """After the history line of ``record`` is written: its numbers and the figures.

        Args:
            record: the history line just written.
            val: the validation metrics of that epoch (for the reliability diagram).
            history: every history line so far, ``record`` included.
        """
        if self.csv is not None:
            self.csv.log_history(history)
        if not self.live:
            return
        step = int(record["epoch"]) + 1
        self.last_step = step
        scalars = scalar_tags(record, self.class_names)
        images = epoch_figures(val, history, self.class_names,
                               f"{self.run_path.name} epoch {step}")
        for logger in self.live:
            logger.log(step, scalars, images)

    def log_test(self, test: Mapping[str, Any]) -> None:
        """The test metrics of the best checkpoint (``test/`` before, ``test_ts/`` after
        temperature scaling) and their reliability diagrams, at the last step."""
        if not self.live:
            return
        from cals_seg.visualization import plotting

        scalars: dict[str, float] = {}
        images: dict[str, np.ndarray] = {}
        for key, tag in (("pre_ts", "test"), ("post_ts", "test_ts")):
            metrics = test.get(key)
            if not metrics:
                continue
            scalars.update({f"{tag}/{k}": float(v) for k, v in metrics.items() if _is_number(v)})
            rel = metrics.get("reliability")
            if rel is not None and sum(rel.get("count", [])) > 0:
                image = _render(lambda p, rel=rel, m=metrics, tag=tag:
                                plotting.plot_reliability_diagram(rel, p, title=tag,
                                                                  ece=m.get("ece")))
                if image is not None:
                    images[f"{tag}/reliability"] = image
        if _is_number(test.get("temperature")):
            scalars["test_ts/temperature"] = float(test["temperature"])
        for logger in self.live:
            logger.log(self.last_step, scalars, images)

    def close(self) -> None:
        for logger in self.live:
            logger.close()
        self.live = []


__all__ = [
    "LOGGERS",
    "CSVLogger",
    "LoggerError",
    "RunLoggers",
    "TensorBoardLogger",
    "WandbLogger",
    "check_loggers",
    "flatten_record",
    "scalar_tags",
]
