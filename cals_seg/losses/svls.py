"""Spatially varying label smoothing, SVLS (Islam and Glocker, IPMI 2021)."""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.losses._spatial import (
    SpatialLoss,
    check_kernel_size,
    gaussian_svls_kernel,
    neighbourhood_distribution,
)
from cals_seg.losses.registry import LOSSES


@LOSSES.register("svls")
class SVLSLoss(SpatialLoss):
    """Cross-entropy against soft labels from a Gaussian-weighted neighbourhood of the labels.

    With the SVLS kernel ``w`` (a normalised ``k x k`` Gaussian of width ``sigma`` whose centre
    weight is replaced by the sum of the others, so the pixel's own label keeps half the mass)::

        q_ik = sum_{j in W(i)} w_j u_jk / sum_{j in W(i)} w_j,   u_jk = [y_j = k] (1/K if void)
        loss = -(1 / |V|) sum_{i in V} sum_k q_ik log softmax(l_i)_k

    Outside the image the labels are replicated (the authors' ``padding_mode="replicate"``);
    a void neighbour's weight is spread evenly over the classes, void pixels leave the mean.
    Without void this is the authors' ``CELossWithSVLS_2D`` (docs/spatial_losses.md).

    Args:
        num_classes: K.
        kernel_size: window side k, odd (authors: 3).
        sigma: Gaussian width in pixels (authors: 1).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, H, W)``; target: ``(N, H, W)``. Other shapes are refused.
    """

    loss_name = "svls"

    def __init__(self, num_classes: int, kernel_size: int = 3, sigma: float = 1.0,
                 ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self.kernel_size = check_kernel_size(kernel_size)
        self.sigma = float(sigma)
        kernel = gaussian_svls_kernel(kernel_size, sigma)
        self.kernel = kernel.tolist()  # plain floats
        # the weights rounded to each computing dtype, made here: a call reads no tensor
        self._weights = {dt: kernel.to(dt).tolist() for dt in (torch.float32, torch.float64)}

    def soft_labels(self, target: Tensor, valid: Tensor,
                    dtype: torch.dtype = torch.float32) -> Tensor:
        """``q (N, K, H, W)`` in ``dtype`` from ``target`` and ``valid`` ``(N, H, W)``."""
        weights = self._weights.get(dtype)
        if weights is None:
            weights = torch.tensor(self.kernel, dtype=torch.float64).to(dtype).tolist()
        k = self.num_classes
        return neighbourhood_distribution(target, valid, k, weights, "replicate", dtype)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        q = self.soft_labels(target, valid, logits.dtype)
        per_pixel = -(q * torch.log_softmax(logits, dim=1)).sum(dim=1)  # (N, H, W)
        loss = per_pixel.masked_fill(~valid, 0.0).sum() / valid.sum().clamp(min=1)
        self.terms = {"svls": loss.detach()}
        return loss

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}, sigma={self.sigma:g}"
