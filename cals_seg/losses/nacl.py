"""Neighbour-aware calibration loss, NACL: "Trust your neighbours" (Murugesan et al., 2023)."""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.losses._functional import ce_sum
from cals_seg.losses._spatial import (
    SpatialLoss,
    check_kernel_size,
    mean_weights,
    neighbourhood_distribution,
)
from cals_seg.losses.registry import LOSSES


@LOSSES.register("nacl")
class NACLLoss(SpatialLoss):
    """Cross-entropy plus an L1 pull of the logits towards the label proportions of each pixel's
    neighbourhood::

        q_ik = (#{j in W(i): y_j = k} + #{j in W(i): y_j void} / K) / |W(i)|   (k x k window)
        loss = CE(l, y) + alpha * (1 / (|V| K)) sum_{i in V} sum_k |q_ik - l_ik|

    The penalty acts on the logits themselves, not on probabilities (the authors' default
    ``is_softmax: False``). Outside the image the label map is padded with class 0, as the
    authors' zero-padded ``nn.Unfold``; a void neighbour counts 1/K for every class, void
    pixels leave both means. Without void this is the authors' ``AdaptMarginSVLS`` with
    ``kernel_ops: mean``, ``distance_type: l1`` (docs/spatial_losses.md).

    Args:
        num_classes: K.
        alpha: penalty weight (authors: 0.1).
        kernel_size: window side k, odd (authors: 3).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, H, W)``; target: ``(N, H, W)``. Other shapes are refused.
    """

    loss_name = "nacl"

    def __init__(self, num_classes: int, alpha: float = 0.1, kernel_size: int = 3,
                 ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha < 0:
            raise ValueError(f"Expected `alpha` >= 0, but got {alpha!r}.")
        self.alpha = float(alpha)
        self.kernel_size = check_kernel_size(kernel_size)

    def proportions(self, target: Tensor, valid: Tensor,
                    dtype: torch.dtype = torch.float32) -> Tensor:
        """``q (N, K, H, W)`` in ``dtype`` from ``target`` and ``valid`` ``(N, H, W)``."""
        kernel = mean_weights(self.kernel_size)
        return neighbourhood_distribution(target, valid, self.num_classes, kernel, "zeros", dtype)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        n, k = logits.shape[:2]
        count = valid.sum().clamp(min=1)
        ce = ce_sum(logits.reshape(n, k, -1), target.reshape(n, -1), self.ignore_index) / count
        q = self.proportions(target, valid, logits.dtype)
        dist = (q - logits).abs().sum(dim=1)  # (N, H, W)
        pen = self.alpha * dist.masked_fill(~valid, 0.0).sum() / (count * k)
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:g}, kernel_size={self.kernel_size}"
