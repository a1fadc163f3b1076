"""``METERS``: the meters a task's evaluations run, by the key of the task's meter set.

Declared here once; each meter registers itself where its class is defined, with the task
families it reports on and how it is built for a task::

    from cals_seg.metrics.registry import register_meter

    @register_meter("segmentation", families=("segmentation",),
                    build=lambda task, n_bins, test: SegmentationMeter(task.num_classes,
                                                                       task.ignore_index))
    class SegmentationMeter(Meter): ...

A task's ``meters(n_bins, test)`` (:mod:`cals_seg.tasks`) is every entry of its family (and the
``test_only`` ones on the test pass), in registration order. A new meter is one new file in
``cals_seg/metrics/``: the registry imports every module of the package the first time its names
are read, after the built-ins, which ``cals_seg/metrics/__init__.py`` imports in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from cals_seg.utils.registry import Registry

M = TypeVar("M", bound=type)
# (task, n_bins, test) -> a fresh meter; ``task`` is a cals_seg.tasks.Task (num_classes,
# ignore_index, class_names, train_set).
MeterBuilder = Callable[[Any, int, bool], nn.Module]


@dataclass(frozen=True)
class MeterEntry:
    """A registered meter: its class, the task families whose evaluations run it, whether only
    the test pass does, and how it is built for a task."""

    cls: type
    families: tuple[str, ...]
    test_only: bool
    build: MeterBuilder

    def applies(self, family: str, test: bool) -> bool:
        """Whether an evaluation of a ``family`` task (``test``: the test pass) runs it."""
        return family in self.families and (test or not self.test_only)


METERS: Registry[MeterEntry] = Registry("meter", discover="cals_seg.metrics")


def register_meter(name: str, families: Sequence[str] = ("segmentation", "classification"),
                   test_only: bool = False,
                   build: MeterBuilder | None = None) -> Callable[[M], M]:
    """Decorator: register a meter class as ``name``, the key of its outputs' set in a task's
    meters.

    Args:
        name: the key in ``task.meters()`` (unique).
        families: the task families (``segmentation``, ``classification``) that run it.
        test_only: only the test pass runs it (e.g. a per-object-size breakdown).
        build: ``build(task, n_bins, test) -> meter``; default
            ``cls(task.num_classes, n_bins=n_bins, ignore_index=task.ignore_index)``.

    Returns:
        The decorator, which returns the class unchanged.
    """

    def add(cls: M) -> M:
        def default(task: Any, n_bins: int, test: bool) -> nn.Module:
            return cls(task.num_classes, n_bins=n_bins, ignore_index=task.ignore_index)

        METERS.register(name, MeterEntry(cls, tuple(families), bool(test_only), build or default))
        return cls

    return add


__all__ = ["METERS", "MeterEntry", "register_meter"]
