"""The streaming meters as ``torchmetrics.Metric`` s (optional: ``pip install torchmetrics``).

Each class keeps exactly the sufficient statistics of :class:`~cals_seg.metrics.CalibrationMeter`
or :class:`~cals_seg.metrics.SegmentationMeter` as torchmetrics states with
``dist_reduce_fx="sum"`` (int64 counts, float64 sums, O(K * n_bins + 69617) numbers whatever the
number of pixels), and computes from them with the meters' own functions, so the values are the
meters' to float64 rounding, on one process or under DDP (torchmetrics sums the states over the
processes before ``compute``). They work with Lightning's ``self.log`` and ``MetricCollection``:

    from cals_seg.integrations.torchmetrics import ECE, AdaptiveECE, MeanIoU
    metrics = MetricCollection({"ece": ECE(21, ignore_index=255),
                                "aece": AdaptiveECE(21, ignore_index=255),
                                "miou": MeanIoU(21, ignore_index=255)})
    metrics.update(logits, target)   # logits (N, K, *S), target (N, *S)
    metrics.compute()                # {"ece": tensor(...), "aece": ..., "miou": ...}

Inputs are logits, as for the meters (``inputs="probs"`` for softmax outputs; probabilities
passed as logits raise ``ValueError``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

try:
    from torchmetrics import Metric
except ImportError:  # pragma: no cover - exercised by the missing-package test
    raise ImportError(
        "cals_seg.integrations.torchmetrics needs the torchmetrics package; install it with: "
        'pip install "cals_seg[lightning]" (or: pip install torchmetrics).'
    ) from None

from cals_seg.metrics.calibration import (
    CalibrationMeter,
    _calibration_compute,
    _calibration_update,
)
from cals_seg.metrics.segmentation import (
    SegmentationMeter,
    _confusion_update,
    _segmentation_compute,
)


def _value(x: float | None) -> Tensor:
    """A metric value as a float64 scalar tensor (NaN when nothing valid was seen)."""
    return torch.tensor(math.nan if x is None else float(x), dtype=torch.float64)


class CalibrationMetrics(Metric):
    """Every metric of :class:`~cals_seg.metrics.CalibrationMeter` as one torchmetrics
    ``Metric``; ``compute`` returns the meter's dict (floats, lists, the reliability data).

    Args:
        num_classes: K >= 2.
        n_bins: equal-width bins (and adaptive bins).
        ignore_index: target value of void positions.
        classwise: also accumulate the class-wise ECE (a ``(K, n_bins)`` state and a pass
            over ``(N, K, *S)``).
        inputs: ``"logits"`` (default) or ``"probs"``.
        **kwargs: torchmetrics ``Metric`` options (``sync_on_compute``, ``process_group`` ...).

    Shape:
        - preds: ``(N, K, *S)`` floating logits (or probabilities with ``inputs="probs"``).
        - target: ``(N, *S)`` integer.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        ignore_index: int = -100,
        classwise: bool = True,
        inputs: Literal["logits", "probs"] = "logits",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # The meter validates the arguments and defines the states (names, shapes, dtypes).
        meter = CalibrationMeter(num_classes, n_bins, ignore_index, classwise, inputs)
        self.num_classes, self.n_bins, self.ignore_index = num_classes, n_bins, ignore_index
        self.classwise, self.inputs = classwise, inputs
        self._names = meter._state_names
        for name in self._names:
            self.add_state(name, default=getattr(meter, name).clone(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        stats = _calibration_update(preds.detach(), target, self.num_classes, self.n_bins,
                                    self.ignore_index, self.classwise, self.inputs)
        for name, value in stats.items():
            getattr(self, name).add_(value)

    def _metrics(self) -> dict[str, Any]:
        return _calibration_compute({n: getattr(self, n) for n in self._names}, self.n_bins)

    def compute(self) -> Any:
        return self._metrics()


class ECE(CalibrationMetrics):
    """Expected calibration error ``sum_b |B_b| / m |acc(B_b) - conf(B_b)|`` over equal-width
    bins (:class:`~cals_seg.metrics.CalibrationMeter`); ``compute`` returns a float64 scalar
    tensor. Arguments as :class:`CalibrationMetrics` (``classwise`` defaults to False)."""

    higher_is_better = False
    key = "ece"

    def __init__(self, num_classes: int, n_bins: int = 15, ignore_index: int = -100,
                 inputs: Literal["logits", "probs"] = "logits", **kwargs: Any) -> None:
        super().__init__(num_classes, n_bins, ignore_index, classwise=False, inputs=inputs,
                         **kwargs)

    def compute(self) -> Tensor:
        return _value(self._metrics()[self.key])


class AdaptiveECE(ECE):
    """Adaptive (equal-mass) ECE of :class:`~cals_seg.metrics.CalibrationMeter`, streamed from
    its fine confidence histogram; a float64 scalar tensor."""

    key = "aece"


class ClasswiseECE(CalibrationMetrics):
    """Class-wise ECE (mean over the K classes of the ECE of ``p_k``); a float64 scalar."""

    higher_is_better = False

    def __init__(self, num_classes: int, n_bins: int = 15, ignore_index: int = -100,
                 inputs: Literal["logits", "probs"] = "logits", **kwargs: Any) -> None:
        super().__init__(num_classes, n_bins, ignore_index, classwise=True, inputs=inputs,
                         **kwargs)

    def compute(self) -> Tensor:
        return _value(self._metrics()["cwce"])


class SegmentationMetrics(Metric):
    """Every metric of :class:`~cals_seg.metrics.SegmentationMeter` (an int64 ``(K, K)``
    confusion matrix, summed over processes); ``compute`` returns the meter's dict.

    Shape:
        - preds: ``(N, K, *S)`` logits (the arg-max is taken) or ``(N, *S)`` integer labels.
        - target: ``(N, *S)`` integer.
    """

    is_differentiable = False
    full_state_update = False

    def __init__(self, num_classes: int, ignore_index: int = -100,
                 inputs: Literal["logits", "probs"] = "logits", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        meter = SegmentationMeter(num_classes, ignore_index, inputs)
        self.num_classes, self.ignore_index, self.inputs = num_classes, ignore_index, inputs
        self.add_state("confusion", default=meter.confusion.clone(), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        self.confusion.add_(_confusion_update(preds.detach(), target, self.num_classes,
                                              self.ignore_index, self.inputs))

    def compute(self) -> Any:
        return _segmentation_compute(self.confusion)


class MeanIoU(SegmentationMetrics):
    """Mean IoU over the classes with a non-empty union, ``IoU_k = TP / (TP + FP + FN)``
    (:class:`~cals_seg.metrics.SegmentationMeter`); a float64 scalar tensor."""

    higher_is_better = True

    def compute(self) -> Tensor:
        return _value(_segmentation_compute(self.confusion)["miou"])


__all__ = [
    "AdaptiveECE",
    "CalibrationMetrics",
    "ClasswiseECE",
    "ECE",
    "MeanIoU",
    "SegmentationMetrics",
]
