"""Margin-based label smoothing, MbLS (Liu et al. 2022)."""

from __future__ import annotations

from torch import Tensor

from cals_seg.losses._base import SegLoss
from cals_seg.losses._functional import ce_sum, class_penalty
from cals_seg.losses.registry import LOSSES


@LOSSES.register("mbls")
class MbLSLoss(SegLoss):
    """Cross-entropy plus a uniform hinge on logit distances:

        loss = CE + alpha * (1/(|V| K)) sum_{i in V} sum_k relu(d_ik - m),
        d_ik = max_j l_ij - l_ik

    Args:
        num_classes: K.
        margin: m (paper: 10 for vision, 6 for text).
        alpha: penalty weight (paper: 0.1).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def __init__(
        self, num_classes: int, margin: float = 10.0, alpha: float = 0.1, ignore_index: int = -100
    ) -> None:
        super().__init__(num_classes, ignore_index)
        if isinstance(margin, str):
            raise ValueError(
                f"Expected `margin` to be a number, but got {margin!r}: MbLS has no validation "
                "pass to steer it; margin 'auto' is for cals_alm and cals_hr."
            )
        if margin <= 0:
            raise ValueError(f"Expected `margin` > 0, but got {margin}.")
        self.margin, self.alpha = float(margin), float(alpha)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        # relu(d - m) = m * relu(z); derivative w.r.t. z: m * [z > 0].
        scale = self.alpha * self.margin
        pen = class_penalty(
            logits,
            valid,
            self.margin,
            lambda z: z.clamp_(min=0.0).mul_(scale),
            lambda z: (z > 0).to(z.dtype).mul_(scale),
        )
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin}, alpha={self.alpha}"
