"""Cross-entropy, the baseline every other loss is compared with."""

from __future__ import annotations

from torch import Tensor

from cals_seg.losses._base import SegLoss
from cals_seg.losses._functional import ce_sum
from cals_seg.losses.registry import LOSSES


@LOSSES.register("ce")
class CrossEntropyLoss(SegLoss):
    """Mean cross-entropy over valid positions: ``-(1/|V|) sum_{i in V} log softmax(l_i)_{y_i}``.

    Equal to ``F.cross_entropy(logits, target, ignore_index=...)``, except that a batch with
    every position ignored gives 0 (with a zero gradient) instead of NaN.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        loss = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        self.terms = {"ce": loss.detach()}
        return loss
