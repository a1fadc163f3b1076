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

from cals_seg.metrics import CalibrationMeter, Meter, SegmentationMeter


def _value(x: float | None) -> Tensor:
    """A metric value as a float64 scalar tensor (NaN when nothing valid was seen)."""
    return torch.tensor(math.nan if x is None else float(x), dtype=torch.float64)


class _MeterMetric(Metric):
    """A torchmetrics ``Metric`` around a :class:`~cals_seg.metrics._base.Meter`: the meter
    checks the arguments and declares the states (each becomes a torchmetrics state with its
    default and ``dist_reduce_fx``); ``update`` adds the meter's ``batch_stats`` and ``compute``
    is the meter's ``compute_states`` of the (synced) states. The meter keeps only its
    settings here: it is not a sub-module, so ``state_dict`` holds the torchmetrics states
    alone."""

    is_differentiable = False
    full_state_update = False

    def __init__(self, meter: Meter, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.__dict__["meter"] = meter  # not registered: its buffers are not this metric's
        for state in meter.states:
            self.add_state(state.name, default=state.default.clone(),
                           dist_reduce_fx=state.reduction)

    def update(self, preds: Tensor, target: Tensor) -> None:
        for name, value in self.meter.batch_stats(preds.detach(), target).items():
            getattr(self, name).add_(value)

    def _metrics(self) -> dict[str, Any]:
        return self.meter.compute_states({s.name: getattr(self, s.name) for s in self.meter.states})

    def compute(self) -> Any:
        return self._metrics()


class CalibrationMetrics(_MeterMetric):
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

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        ignore_index: int = -100,
        classwise: bool = True,
        inputs: Literal["logits", "probs"] = "logits",
        **kwargs: Any,
    ) -> None:
        super().__init__(CalibrationMeter(num_classes, n_bins, ignore_index, classwise, inputs),
                         **kwargs)


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


class SegmentationMetrics(_MeterMetric):
    """Every metric of :class:`~cals_seg.metrics.SegmentationMeter` (an int64 ``(K, K)``
    confusion matrix, summed over processes); ``compute`` returns the meter's dict.

    Shape:
        - preds: ``(N, K, *S)`` logits (the arg-max is taken) or ``(N, *S)`` integer labels.
        - target: ``(N, *S)`` integer.
    """

    def __init__(self, num_classes: int, ignore_index: int = -100,
                 inputs: Literal["logits", "probs"] = "logits", **kwargs: Any) -> None:
        super().__init__(SegmentationMeter(num_classes, ignore_index, inputs), **kwargs)


class MeanIoU(SegmentationMetrics):
    """Mean IoU over the classes with a non-empty union, ``IoU_k = TP / (TP + FP + FN)``
    (:class:`~cals_seg.metrics.SegmentationMeter`); a float64 scalar tensor."""

    higher_is_better = True

    def compute(self) -> Tensor:
        return _value(self._metrics()["miou"])


__all__ = [
    "AdaptiveECE",
    "CalibrationMetrics",
    "ClasswiseECE",
    "ECE",
    "MeanIoU",
    "SegmentationMetrics",
]
