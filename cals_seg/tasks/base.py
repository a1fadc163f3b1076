"""The pieces every task family shares: :class:`Task` (three splits, a model, meters),
:func:`register_dataset` and :func:`build_task` over :data:`cals_seg.data.registry.DATASETS`
(the public names are re-exported by :mod:`cals_seg.tasks`; the families' modules import them
from here, so no module of the package imports the package's ``__init__``)."""


from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from cals_seg.config.rules import check_num_classes
from cals_seg.config.schema import Config
from cals_seg.data.registry import DATASETS, KINDS, DatasetEntry
from cals_seg.errors import ConfigError
from cals_seg.evaluation.inference import EvalProtocol
from cals_seg.metrics import METERS


@dataclass
class Task:
    """Splits, model and display information of a run (a classification-like task: logits
    ``(N, K)``, targets ``(N,)``); its meters are those registered for its family."""

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
        """Fresh meters for one evaluation pass: every meter of :data:`cals_seg.metrics.METERS`
        registered for this task's family, in registration order (segmentation: calibration,
        segmentation and the boundary-band meters; classification: calibration).

        Args:
            n_bins: confidence bins of the calibration meters.
            test: the test pass: also the ``test_only`` meters (segmentation: object sizes;
                classification: many / medium / few-shot groups) and class-wise ECE.

        Returns:
            ``{key: meter}``, fresh (reset) meters.
        """
        return {name: entry.build(self, n_bins, test) for name, entry in METERS.items()
                if entry.applies(self.family, test)}


@dataclass
class SegmentationTask(Task):
    """Logits ``(N, K, H, W)``, masks ``(N, H, W)``: calibration, segmentation and region meters
    (the band meter gives ``ece_band_weighted`` beside the pooled ``ece``)."""

    family = "segmentation"
    score_metric = "miou"


@dataclass
class ClassificationTask(Task):
    """Image or text classification; the test pass adds the many / medium / few-shot view."""


TASK_TYPES: dict[str, type[Task]] = {
    "segmentation": SegmentationTask,
    "classification": ClassificationTask,
}


Builder = Callable[[Config], Task]


def register_dataset(name: str, family: str, kind: str | None = None,
                     classes: Sequence[str] | None = None,
                     splits: Callable[..., Any] | None = None) -> Callable[[Builder], Builder]:
    """Decorator: make ``builder(cfg) -> Task`` the one for ``data.name == name``.

    Args:
        name: the ``data.name`` (unique).
        family: the task family, ``segmentation`` or ``classification``.
        kind: what its samples are (``segmentation``, ``classification``, ``text``); default
            the family.
        classes: its own class names (segmentation datasets).
        splits: its split builder (segmentation datasets; what ``tools/check_data.py`` reads).

    Returns:
        The decorator, which registers the builder in :data:`DATASETS` and returns it.

    Raises:
        ValueError: an unknown family or kind, a kind of another family, or a name already
            registered.
    """
    kind = family if kind is None else kind
    if family not in TASK_TYPES or kind not in KINDS or (
            family != (kind if kind != "text" else "classification")):
        raise ValueError(f"data.name {name!r}: family {family!r} / kind {kind!r}; expected a "
                         f"family of {list(TASK_TYPES)} and a kind of it among {list(KINDS)}.")

    def add(builder: Builder) -> Builder:
        DATASETS.register(name, DatasetEntry(family, builder, kind, classes, splits))
        return builder

    return add


def dataset_names(family: str | None = None) -> list[str]:
    """Registered ``data.name`` values (of one family, or all)."""
    return [n for n, entry in DATASETS.items() if family is None or entry.family == family]


def task_family(cfg: Config) -> str:
    """``segmentation`` or ``classification`` (images and text) for ``cfg.data.name``."""
    if cfg.data.name not in DATASETS:
        raise ConfigError(
            f"data.name: unknown dataset {cfg.data.name!r}; valid names are {dataset_names()}."
        )
    return DATASETS[cfg.data.name].family


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
    task = DATASETS[cfg.data.name].build(cfg)
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


__all__ = [
    "DATASETS",
    "ClassificationTask",
    "DatasetEntry",
    "SegmentationTask",
    "Task",
    "TASK_TYPES",
    "build_task",
    "dataset_names",
    "register_dataset",
    "score_metric",
    "task_family",
]
