"""Tasks: what a config's ``data`` and ``model`` sections build, and which meters report on it.

A :class:`Task` is the three splits, the model and the meters of one task family. Each family has
one module here and registers its dataset builders by ``data.name``::

    @register_dataset("voc", family="segmentation")
    def voc(cfg: Config) -> SegmentationTask: ...

:func:`build_task` looks the name up (a typo lists the valid names). The trainer only ever sees a
``Task``; it never reads ``data`` or ``model`` itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from cals_seg.config.rules import check_num_classes
from cals_seg.config.schema import Config
from cals_seg.data import DATASET_KINDS
from cals_seg.errors import ConfigError
from cals_seg.evaluation.inference import EvalProtocol
from cals_seg.metrics import (
    BoundaryAwareECEMeter,
    BoundaryCalibrationMeter,
    CalibrationMeter,
    ObjectSizeCalibrationMeter,
    SegmentationMeter,
)
from cals_seg.metrics.groups import ShotGroupMeter
from cals_seg.utils.registry import Registry


@dataclass
class Task:
    """Splits, model and display information of a run (a classification-like task: logits
    ``(N, K)``, targets ``(N,)``). Subclasses add the meters of their family."""

    train_set: Dataset
    val_set: Dataset
    test_set: Dataset
    model: nn.Module
    num_classes: int
    ignore_index: int
    class_names: list[str] = field(default_factory=list)
    # How an evaluation makes the network input from a sample (segmentation: resize / pad /
    # tiles, logits brought back to the image's size, see cals_seg.evaluation.inference); None:
    # as is.
    protocol: EvalProtocol | None = None

    family = "classification"
    score_metric = "acc"  # the headline metric of the family, printed and compared

    def meters(self, n_bins: int = 15, test: bool = False) -> dict[str, nn.Module]:
        """Fresh meters for one evaluation pass (``test``: the full set, e.g. class-wise ECE)."""
        return {
            "calibration": CalibrationMeter(
                self.num_classes, n_bins, self.ignore_index, classwise=test
            )
        }


@dataclass
class SegmentationTask(Task):
    """Logits ``(N, K, H, W)``, masks ``(N, H, W)``: calibration and segmentation meters."""

    family = "segmentation"
    score_metric = "miou"

    def meters(self, n_bins: int = 15, test: bool = False) -> dict[str, nn.Module]:
        """Calibration, segmentation and boundary-band meters (the band meter gives
        ``ece_band_weighted`` beside the pooled ``ece``, at about the cost of the calibration
        meter); the test pass adds the object-size meter (class 0 is not an object when it is
        named background)."""
        out = super().meters(n_bins, test)
        k, void = self.num_classes, self.ignore_index
        out["segmentation"] = SegmentationMeter(k, void)
        out["boundary"] = BoundaryCalibrationMeter(k, n_bins=n_bins, ignore_index=void)
        out["rings"] = BoundaryAwareECEMeter(k, n_bins=n_bins, ignore_index=void)  # ba_ece
        if test:
            names = self.class_names[:1]
            background = 0 if names and names[0].lower() in ("background", "_background_") else None
            out["size"] = ObjectSizeCalibrationMeter(
                k, n_bins=n_bins, ignore_index=void, background_index=background
            )
        return out


@dataclass
class ClassificationTask(Task):
    """Image or text classification; the test pass adds the many / medium / few-shot view."""

    def meters(self, n_bins: int = 15, test: bool = False) -> dict[str, nn.Module]:
        out = super().meters(n_bins, test)
        if test:
            counts = self.train_set.class_counts()
            out["groups"] = ShotGroupMeter(counts, n_bins, self.ignore_index)
        return out


Builder = Callable[[Config], Task]
DATASETS: Registry[tuple[str, Builder]] = Registry("dataset")  # data.name -> (family, builder)


def register_dataset(name: str, family: str) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(cfg) -> Task`` the one for ``data.name == name``."""

    def add(builder: Builder) -> Builder:
        kind = DATASET_KINDS.get(name)
        if kind is None or (kind if kind != "text" else "classification") != family:
            raise ValueError(f"data.name {name!r}: add it to cals_seg.data.DATASET_KINDS "
                             f"as a {family} dataset first.")
        DATASETS.register(name, (family, builder))
        return builder

    return add


def dataset_names(family: str | None = None) -> list[str]:
    """Registered ``data.name`` values (of one family, or all)."""
    return [n for n, (f, _) in DATASETS.items() if family is None or f == family]


def task_family(cfg: Config) -> str:
    """``segmentation`` or ``classification`` (images and text) for ``cfg.data.name``."""
    if cfg.data.name not in DATASETS:
        raise ConfigError(
            f"data.name: unknown dataset {cfg.data.name!r}; valid names are {dataset_names()}."
        )
    return DATASETS[cfg.data.name][0]


TASK_TYPES: dict[str, type[Task]] = {
    "segmentation": SegmentationTask,
    "classification": ClassificationTask,
}


def score_metric(cfg: Config) -> str:
    """The headline metric of ``cfg``'s task family (``miou``, ``acc``), without reading data."""
    return TASK_TYPES[task_family(cfg)].score_metric


def build_task(cfg: Config, family: str | None = None) -> Task:
    """The task of ``cfg`` (``family``: also check that it is one, naming the right tool).

    Check the config with :func:`cals_seg.config.checks.check_config` first (every command does,
    before any data is generated or read); the builders apply the rules of what they create
    (the evaluation protocol, the class count, the colour table, the data listing), calling the
    same functions of :mod:`cals_seg.config.rules`.
    """
    found = task_family(cfg)
    if family is not None and found != family:
        tool = "tools/train_seg.py" if found == "segmentation" else "tools/train_cls.py"
        raise ConfigError(
            f"data.name={cfg.data.name!r} is a {found} dataset; train it with {tool}."
        )
    task = DATASETS[cfg.data.name][1](cfg)
    if cfg.data.class_names is not None:  # display names of any dataset
        task.class_names = list(cfg.data.class_names)
    return task


def generate_embedded(cfg: Config, generate: Callable[..., Any], classes: int, what: str) -> None:
    """Generate an embedded dataset at ``data.root`` (when missing) with the generator keyword
    arguments of ``data.synthetic``, after checking ``data.num_classes`` against its ``classes``.

    Raises:
        ConfigError: a class count (:func:`cals_seg.config.rules.check_num_classes`) or a
            ``data.synthetic`` key that does not fit, named.
    """
    d = cfg.data
    check_num_classes(cfg, classes, what)
    accepted = [p for p in inspect.signature(generate).parameters if p != "root"]
    unknown = sorted(set(d.synthetic) - set(accepted))
    if unknown:
        raise ConfigError(f"data.synthetic: unknown key(s) {unknown}; valid keys are {accepted}.")
    try:
        generate(d.root, **d.synthetic)
    except (TypeError, ValueError) as err:  # the generator's own checks of its keywords
        raise ConfigError(f"data.synthetic: {err}") from None


def class_names_or_default(names: Any, num_classes: int) -> list[str]:
    """``names[:K]`` when there are enough of them, else ``class 0 .. class K-1``."""
    names = list(names or [])
    return names[:num_classes] if len(names) >= num_classes else [
        f"class {i}" for i in range(num_classes)
    ]


# The families register their datasets on import.
from cals_seg.tasks import classification, segmentation, text  # noqa: E402, F401

__all__ = [
    "DATASETS",
    "ClassificationTask",
    "SegmentationTask",
    "Task",
    "TASK_TYPES",
    "build_task",
    "dataset_names",
    "register_dataset",
    "score_metric",
    "task_family",
]
