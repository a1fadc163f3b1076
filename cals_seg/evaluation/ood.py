"""Images far from the validation data: a flag on the mean predictive entropy.

An image is flagged when its mean predictive entropy (over all its pixels, in nats, of the
calibrated probabilities) is above the ``q``-quantile (default 0.99) of the same statistic over
the validation images. ``predict_seg`` warns on such an image; ``eval_seg --shift`` reports the
fraction flagged on the clean and on each corrupted split (docs/shift.md)::

    ref = MeanEntropy(temperature=T)
    evaluate(model, val_loader, device, [], image_consumers=[ref])
    limit = entropy_limit(ref.values)                       # 99th percentile
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

QUANTILE = 0.99


def image_mean_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean over each image's pixels of ``-sum_k p_k log p_k``, ``p = softmax(logits / T)``.

    Shape:
        ``logits (N, K, H, W)`` -> ``(N,)`` float64.
    """
    log_p = torch.log_softmax(logits.double() / temperature, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1).flatten(1).mean(dim=1)


class MeanEntropy:
    """An image consumer (``update(logits, target, inputs)``) collecting each image's mean
    predictive entropy at temperature ``T`` in ``values``."""

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = float(temperature)
        self.values: list[float] = []

    def update(self, logits: Tensor, target: Tensor | None = None, inputs: Tensor | None = None
               ) -> None:
        self.values.extend(image_mean_entropy(logits, self.temperature).tolist())


def entropy_limit(values: Sequence[float], quantile: float = QUANTILE) -> float:
    """The ``quantile`` of the validation images' mean entropies (linear interpolation).

    Raises:
        ValueError: no values, or a quantile outside (0, 1).
    """
    if not values:
        raise ValueError("entropy_limit: no validation images.")
    if not 0 < quantile < 1:
        raise ValueError(f"entropy_limit: quantile must be in (0, 1), got {quantile}.")
    return float(np.quantile(np.asarray(values, np.float64), quantile))


def flagged_rate(values: Sequence[float], limit: float) -> float:
    """Fraction of the images whose mean entropy is above ``limit``."""
    return float(np.mean(np.asarray(values) > limit)) if len(values) else 0.0


__all__ = ["QUANTILE", "MeanEntropy", "entropy_limit", "flagged_rate", "image_mean_entropy"]
