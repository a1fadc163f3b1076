"""Streaming segmentation metrics from an int64 confusion matrix (docs/design.md, "Metrics").

``_confusion_update`` turns one batch into a ``(K, K)`` confusion matrix (rows = target,
columns = prediction), ``_segmentation_compute`` turns the accumulated matrix into IoU and
accuracies, and ``SegmentationMeter`` only stores the matrix.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from cals_seg.metrics._base import Meter
from cals_seg.metrics.functional import (
    argmax_map,
    prepare_logits,
    prepare_predictions,
)
from cals_seg.metrics.registry import register_meter


def _confusion_update(
    logits_or_preds: Tensor,
    target: Tensor,
    num_classes: int,
    ignore_index: int = -100,
    inputs: str = "logits",
) -> Tensor:
    """Confusion matrix of one batch over its valid positions, with one ``bincount``.

    ``confusion[t, p]`` = number of valid positions with target ``t`` and prediction ``p``;
    the prediction is ``argmax_k logits_k`` for floating input, the value itself for integer
    input.

    Shape:
        - logits_or_preds: logits ``(N, K, *S)`` (floating) or predictions ``(N, *S)`` (integer).
        - target: ``(N, *S)`` integer, ``ignore_index`` marks void positions.
        - returns: ``(K, K)`` int64.
    """
    if isinstance(logits_or_preds, Tensor) and logits_or_preds.is_floating_point():
        x, y, valid = prepare_logits(logits_or_preds, target, num_classes, ignore_index, inputs)
        pred = argmax_map(x, check=True)  # blocks of positions: no logits-sized temporary
    else:
        pred, y, valid = prepare_predictions(logits_or_preds, target, num_classes, ignore_index)
    size = num_classes * num_classes
    index = y.mul(num_classes).add_(pred).masked_fill_(~valid, size)
    counts = torch.bincount(index.reshape(-1), minlength=size + 1)[:size]
    return counts.view(num_classes, num_classes)


def _segmentation_compute(confusion: Tensor) -> dict[str, Any]:
    """IoU and accuracies from a ``(K, K)`` confusion matrix (rows = target, cols = prediction).

    ``IoU_k = TP_k / (TP_k + FP_k + FN_k)`` for classes with a non-empty union, None otherwise;
    ``miou`` is their mean, ``miou_fg`` the same without class 0 (background), ``pixel_acc =
    trace / total``, ``mean_class_acc`` the mean of ``TP_k / (TP_k + FN_k)`` over classes with a
    target pixel. Undefined values (nothing seen) are None.
    """
    cm = confusion.cpu().to(torch.int64)
    tp = cm.diagonal()
    target_total, pred_total = cm.sum(dim=1), cm.sum(dim=0)
    union = target_total + pred_total - tp
    iou = tp.double() / union.clamp(min=1).double()
    class_acc = tp.double() / target_total.clamp(min=1).double()
    has_union, has_target = union > 0, target_total > 0
    fg = has_union.clone()
    fg[0] = False
    total = int(cm.sum())

    def mean_or_none(values: Tensor, mask: Tensor) -> float | None:
        return float(values[mask].mean()) if bool(mask.any()) else None

    return {
        "count": total,
        "miou": mean_or_none(iou, has_union),
        "miou_fg": mean_or_none(iou, fg),
        "iou_per_class": [float(v) if h else None for v, h in zip(iou, has_union, strict=True)],
        "pixel_acc": float(tp.sum()) / total if total else None,
        "mean_class_acc": mean_or_none(class_acc, has_target),
        "class_acc": [float(v) if h else None for v, h in zip(class_acc, has_target, strict=True)],
        "confusion": cm.tolist(),
    }


@register_meter("segmentation", families=("segmentation",), build=lambda task, n_bins, test:
                SegmentationMeter(task.num_classes, task.ignore_index))
class SegmentationMeter(Meter):
    """mIoU and friends from an int64 ``K x K`` confusion matrix, exact over DDP.

    State: one registered int64 buffer ``confusion`` ``(K, K)`` (rows = target, columns =
    prediction), ``8 K^2`` bytes whatever the number of pixels.

    Args:
        num_classes: K >= 2.
        ignore_index: target value of void positions (255 in VOC).
        inputs: what floating input is: ``"logits"`` (default) or ``"probs"``. Logits that look
            like probabilities raise ``ValueError``, with the rule of :class:`CalibrationMeter`
            (the arg-max would not change, but the mistake would go on to the calibration
            meters).

    Shape:
        - logits_or_preds: logits ``(N, K, *S)`` (floating; the arg-max is taken) or integer
          predictions ``(N, *S)``.
        - target: ``(N, *S)`` integer.

    Example:
        >>> meter = SegmentationMeter(num_classes=3, ignore_index=255)
        >>> meter.update(torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1, 1]]))
        >>> meter.compute()["pixel_acc"]
        0.6666666666666666
    """

    def __init__(
        self,
        num_classes: int,
        ignore_index: int = -100,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        super().__init__(num_classes, ignore_index, inputs)
        self.add_state("confusion", torch.zeros(num_classes, num_classes, dtype=torch.int64))

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, ignore_index={self.ignore_index}, "
                f"inputs={self.inputs}")

    def batch_stats(self, logits_or_preds: Tensor, target: Tensor) -> dict[str, Tensor]:
        """The confusion counts of one batch; raises ``ValueError`` on bad input (see the class
        docstring)."""
        return {"confusion": _confusion_update(
            logits_or_preds, target, self.num_classes, self.ignore_index, self.inputs
        )}

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """Values from a summed confusion matrix, JSON-serialisable.

        Keys: ``count`` (valid positions), ``miou``, ``miou_fg``, ``iou_per_class`` (K floats,
        None for classes with an empty union), ``pixel_acc``, ``mean_class_acc``, ``class_acc``
        (K, None for classes without target pixels), ``confusion`` (K lists of K ints).
        """
        return _segmentation_compute(states["confusion"])
