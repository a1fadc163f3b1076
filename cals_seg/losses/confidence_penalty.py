"""Explicit confidence penalty, ECP (Pereyra et al. 2017)."""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.losses._base import SegLoss, masked_mean
from cals_seg.losses._functional import ce_sum
from cals_seg.losses.registry import LOSSES

ENTROPY_FORMS = ("class_mean", "sum")


@LOSSES.register("ecp")
class ConfidencePenaltyLoss(SegLoss):
    """Cross-entropy minus ``beta`` times an entropy bonus.

    With ``entropy="class_mean"`` (default, the scale of the authors' ``PenaltyEntropy`` behind
    the paper's ECP rows) the bonus is the mean of ``-p_k log p_k`` over the valid positions *and*
    the K classes, i.e. 1/K of the per-position entropy::

        loss = CE - beta * (1/(|V| K)) sum_{i in V} sum_k -p_ik log p_ik

    With ``entropy="sum"`` (the form of cals_seg before it followed the authors; the same
    ``beta`` weighs the entropy K times more) the bonus is the per-position entropy::

        loss = CE - beta * (1/|V|) sum_{i in V} H(p_i),   H(p) = -sum_k p_k log p_k

    Args:
        num_classes: K.
        beta: weight of the entropy bonus (paper: 0.1).
        entropy: ``"class_mean"`` (default) or ``"sum"``, see above.
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.

    Raises:
        ValueError: ``entropy`` not one of ``"class_mean"``, ``"sum"``.
    """

    def __init__(
        self,
        num_classes: int,
        beta: float = 0.1,
        entropy: str = "class_mean",
        ignore_index: int = -100,
    ) -> None:
        super().__init__(num_classes, ignore_index)
        if entropy not in ENTROPY_FORMS:
            raise ValueError(
                f"Expected `entropy` to be one of {list(ENTROPY_FORMS)}, but got {entropy!r}."
            )
        self.beta = float(beta)
        self.entropy = entropy

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        logp = torch.log_softmax(logits, dim=1)
        entropy = -(logp.exp() * logp).sum(dim=1)
        ent = masked_mean(entropy, valid)
        if self.entropy == "class_mean":
            ent = ent / self.num_classes
        self.terms = {"ce": ce.detach(), "entropy": ent.detach()}
        return ce - self.beta * ent

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, beta={self.beta}, entropy={self.entropy!r}"
