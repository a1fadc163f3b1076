"""Long-tail view of a classifier: per-class accuracy and many / medium / few-shot calibration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from cals_seg.metrics._base import Meter
from cals_seg.metrics.calibration import CalibrationMeter
from cals_seg.metrics.registry import register_meter
from cals_seg.utils.validation import check_tensors

# Groups by number of TRAINING samples of a class (the ImageNet-LT convention).
SHOT_GROUPS: dict[str, tuple[int, int | None]] = {
    "many": (101, None),  # > 100
    "medium": (20, 100),  # 20 .. 100
    "few": (0, 19),  # < 20
}


def shot_groups(class_counts: Sequence[int]) -> dict[str, list[int]]:
    """Classes of each group by training count: many (> 100), medium (20-100), few (< 20)."""
    return {
        name: [k for k, c in enumerate(class_counts) if c >= low and (high is None or c <= high)]
        for name, (low, high) in SHOT_GROUPS.items()
    }


@register_meter("groups", families=("classification",), test_only=True,
                build=lambda task, n_bins, test: ShotGroupMeter(
                    task.train_set.class_counts(), n_bins, task.ignore_index))
class ShotGroupMeter(Meter):
    """Per-class accuracy and a :class:`CalibrationMeter` per shot group, streamed.

    A group's calibration is measured over the positions whose TRUE class is in the group
    (predictions may be any class): the meter of group g sees the target with every other class
    set to ``ignore_index``. State: ``2 K`` int64 counts plus three calibration meters, whatever
    the number of samples; exact under torch.distributed (sums over ranks).

    Args:
        class_counts: training samples per class (length ``K``); they define the groups.
        n_bins: calibration bins.
        ignore_index: target value of void positions.
        inputs: ``"logits"`` (default) or ``"probs"``, as in :class:`CalibrationMeter`.

    Shape:
        ``update(logits (N, K, *S), target (N, *S))``.
    """

    def __init__(
        self,
        class_counts: Sequence[int],
        n_bins: int = 15,
        ignore_index: int = -100,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        counts = [int(c) for c in class_counts]
        k = len(counts)
        super().__init__(k, ignore_index, inputs, n_bins)
        self.class_counts = counts
        self.groups = shot_groups(self.class_counts)
        self.meters = nn.ModuleDict({
            g: CalibrationMeter(k, n_bins, ignore_index, classwise=False, inputs=inputs)
            for g in self.groups
        })
        for name, classes in self.groups.items():
            member = torch.zeros(k, dtype=torch.bool)
            member[classes] = True
            self.register_buffer(f"member_{name}", member, persistent=False)
        self.add_state("correct", torch.zeros(k, dtype=torch.int64))
        self.add_state("total", torch.zeros(k, dtype=torch.int64))

    def reset(self) -> None:
        """Zero the per-class counts and the group meters."""
        super().reset()
        for meter in self.meters.values():
            meter.reset()

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor) -> None:
        check_tensors(logits, target, "meter.update")  # e.g. a model's output dict, named
        k = len(self.class_counts)
        valid = target != self.ignore_index
        y = target[valid]
        pred = logits.argmax(dim=1)[valid]
        self.total += torch.bincount(y, minlength=k)
        self.correct += torch.bincount(y[pred == y], minlength=k)
        safe = target.clamp(min=0, max=k - 1)
        void = torch.full_like(target, self.ignore_index)
        for name, meter in self.meters.items():
            keep = valid & getattr(self, f"member_{name}")[safe]
            meter.update(logits, torch.where(keep, target, void))

    @torch.no_grad()
    def compute(self) -> dict[str, Any]:
        """``{"class_counts": K ints, "per_class_acc": K floats (None without test samples),
        "per_class_count": K ints, "groups": {group: {"classes", "num_classes", metrics...}}}``
        (a group's metrics are :class:`CalibrationMeter`'s without the reliability data and
        per-image means)."""
        states = self.synced_states()
        correct, total = states["correct"], states["total"]
        per_class = [
            c / n if n > 0 else None for c, n in zip(correct.tolist(), total.tolist(), strict=True)
        ]
        groups = {}
        for name, classes in self.groups.items():
            metrics = self.meters[name].compute()
            metrics.pop("reliability", None)
            metrics = {m: v for m, v in metrics.items() if not m.endswith("_image_mean")}
            groups[name] = {"classes": classes, "num_classes": len(classes), **metrics}
        return {
            "class_counts": self.class_counts,
            "per_class_acc": per_class,
            "per_class_count": total.tolist(),
            "groups": groups,
        }
