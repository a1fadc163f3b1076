"""Explicit confidence penalty, ECP (Pereyra et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._base import SegLoss, masked_mean
from ._functional import ce_sum


class ConfidencePenaltyLoss(SegLoss):
    """Cross-entropy minus ``beta`` times the entropy of the prediction:

        loss = CE - beta * (1/|V|) sum_{i in V} H(p_i),   H(p) = -sum_k p_k log p_k

    Args:
        num_classes: K.
        beta: weight of the entropy bonus (paper: 0.1).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """

    def __init__(self, num_classes: int, beta: float = 0.1, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self.beta = float(beta)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        logp = torch.log_softmax(logits, dim=1)
        entropy = -(logp.exp() * logp).sum(dim=1)
        ent = masked_mean(entropy, valid)
        self.terms = {"ce": ce.detach(), "entropy": ent.detach()}
        return ce - self.beta * ent
