"""Label smoothing (Szegedy et al. 2016)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from cals_seg.losses._base import SegLoss
from cals_seg.losses.registry import LOSSES


@LOSSES.register("ls")
class LabelSmoothingLoss(SegLoss):
    """Cross-entropy against the smoothed target ``q_k = (1 - a) [k == y] + a / K``.

    So the true class gets ``1 - a + a/K`` and every other class ``a/K``; the loss is
    ``-(1/|V|) sum_{i in V} sum_k q_ik log p_ik``. Paper default ``a = 0.05``.

    Args:
        num_classes: K.
        alpha: smoothing factor a in [0, 1].
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def __init__(self, num_classes: int, alpha: float = 0.05, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"Expected `alpha` in [0, 1], but got {alpha}.")
        self.alpha = float(alpha)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        total = F.cross_entropy(
            logits,
            target,
            ignore_index=self.ignore_index,
            reduction="sum",
            label_smoothing=self.alpha,
        )
        loss = total / valid.sum().clamp(min=1)
        self.terms = {"ls": loss.detach()}
        return loss
