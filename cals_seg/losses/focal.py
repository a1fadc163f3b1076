"""Focal loss (Lin et al. 2017) and its sample-dependent variant FLSD (Mukhoti et al. 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.losses._base import SegLoss, masked_mean
from cals_seg.losses.registry import LOSSES


def _focal_terms(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """``log p_y (N, S)`` (0 at void positions) and ``p_y``."""
    logp = -F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
    return logp, logp.exp()


@LOSSES.register("fl")
class FocalLoss(SegLoss):
    """Focal loss on the softmax: ``-(1/|V|) sum_{i in V} (1 - p_{i,y_i})^gamma log p_{i,y_i}``.

    Args:
        num_classes: K.
        gamma: focusing parameter (paper: 3).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def __init__(self, num_classes: int, gamma: float = 3.0, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        if gamma < 0:
            raise ValueError(f"Expected `gamma` >= 0, but got {gamma}.")
        self.gamma = float(gamma)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        logp, p = _focal_terms(logits, target, self.ignore_index)
        loss = masked_mean(-((1.0 - p) ** self.gamma) * logp, valid)
        self.terms = {"focal": loss.detach()}
        return loss


@LOSSES.register("flsd")
class FocalLossSD(SegLoss):
    """FLSD-53: focal loss with a per-position gamma, 5 if ``p_y < 0.2`` else 3.

    ``gamma_i`` is chosen from the detached ``p_{i,y_i}`` (the choice is piecewise constant, so
    it carries no gradient), fully vectorised.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def __init__(
        self,
        num_classes: int,
        gamma_low: float = 5.0,
        gamma_high: float = 3.0,
        threshold: float = 0.2,
        ignore_index: int = -100,
    ) -> None:
        super().__init__(num_classes, ignore_index)
        self.gamma_low, self.gamma_high, self.threshold = gamma_low, gamma_high, threshold

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        logp, p = _focal_terms(logits, target, self.ignore_index)
        gamma = torch.where(p.detach() < self.threshold, self.gamma_low, self.gamma_high)
        loss = masked_mean(-((1.0 - p) ** gamma) * logp, valid)
        self.terms = {"focal": loss.detach()}
        return loss
