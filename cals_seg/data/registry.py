"""``DATASETS``: every dataset a config can name (``data.name``), declared here once.

A dataset registers itself where its builder is defined, in a module of :mod:`cals_seg.tasks`
(``@segmentation_dataset("voc", VOC_CLASSES)``, ``@register_dataset("20news",
family="classification", kind="text")``), with its kind: ``segmentation`` datasets give
(image, mask) samples, ``classification`` (image, label), ``text`` (token ids, label). The config
rules (:mod:`cals_seg.config.rules`) read the kind from here; :func:`cals_seg.tasks.build_task`
calls the builder.

The registry lives on the data floor so that the config rules can read it; its entries are
filled by the task modules, which it imports (every module of :mod:`cals_seg.tasks`, the
built-ins first, in their order) the first time its names are read: a new dataset is one new
file in ``cals_seg/tasks/``, with no list to edit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cals_seg.errors import ConfigError
from cals_seg.utils.registry import Registry

KINDS = ("segmentation", "classification", "text")


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset.

    Attributes:
        family: the task family that trains it (``segmentation`` or ``classification``).
        build: ``build(cfg) -> Task``: its splits, model and meters.
        kind: what its samples are (``segmentation``, ``classification`` or ``text``).
        classes: its own class names (``None``: ``class 0 ...``), for segmentation datasets.
        splits: ``splits(cfg, transforms) -> {"train", "val", "test": Dataset}`` of a
            segmentation dataset (what ``tools/check_data.py`` reads), else ``None``.
    """

    family: str
    build: Callable[[Any], Any]
    kind: str
    classes: Sequence[str] | None = None
    splits: Callable[..., Any] | None = None


DATASETS: Registry[DatasetEntry] = Registry("dataset", error=ConfigError,
                                            discover="cals_seg.tasks")


def dataset_kind(name: str) -> str | None:
    """The kind of the dataset ``name`` (``segmentation``, ``classification``, ``text``), or
    ``None`` when no dataset of that name is registered."""
    entry = DATASETS.get(name)
    return None if entry is None else entry.kind


__all__ = ["DATASETS", "KINDS", "DatasetEntry", "dataset_kind"]
