"""A dilation margin for binary masks with a conformal guarantee (docs/conformal.md)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.evaluation.conformal import guarantee_status, quantile_threshold
from cals_seg.metrics.functional import sum_over_ranks
from cals_seg.metrics.regions import squared_boundary_distance


class DilationMargin(nn.Module):
    """A dilation radius ``r`` such that the true mask lies in the predicted mask dilated by
    ``r`` (every pixel within Euclidean distance ``r`` of it) with probability ``>= 1 - alpha``.

    The score of an image is ``S_i = ceil(max_{p in T_i} d(p, M_i))``: ``T_i`` its valid true
    pixels of ``foreground``, ``M_i`` its predicted ones (argmax), ``d`` the exact Euclidean
    distance (0 when ``T_i`` is empty, the overflow cell when ``M_i`` is empty and ``T_i`` is
    not). ``T ⊆ dilate(M, r)`` iff ``S <= r``, so the split-conformal quantile of the ``S_i``
    (:func:`quantile_threshold`) gives ``P(T_test ⊆ dilate(M_test, r)) >= 1 - alpha`` for
    exchangeable images. State: a histogram of radii ``0..max_radius`` plus an overflow cell
    (int64), one count per image.

    Shape:
        - logits: ``(N, K, H, W)``; target: ``(N, H, W)``.
    """

    def __init__(self, num_classes: int, alpha: float, foreground: int = 1,
                 ignore_index: int = -100, max_radius: int = 1024) -> None:
        super().__init__()
        if not 0 < alpha < 1:
            raise ValueError(f"Expected `alpha` in (0, 1), but got {alpha!r}.")
        if not 0 <= foreground < num_classes:
            raise ValueError(f"Expected `foreground` in [0, {num_classes}), got {foreground}.")
        self.num_classes, self.alpha, self.foreground = num_classes, float(alpha), foreground
        self.ignore_index, self.max_radius = ignore_index, max_radius
        self.register_buffer("radius_hist", torch.zeros(max_radius + 2, dtype=torch.int64))
        self.radius: int | None = None

    def image_radii(self, logits: Tensor, target: Tensor) -> Tensor:
        """``S_i`` per image ``(N,)`` int64, ``max_radius + 1`` for anything larger."""
        pred = (logits.argmax(dim=1) == self.foreground).cpu().numpy()
        t = target.cpu().numpy()
        true = (t == self.foreground) & (t != self.ignore_index)
        d2 = squared_boundary_distance(pred)  # squared distance to the predicted mask
        out = []
        for i in range(len(t)):
            if not true[i].any():
                out.append(0)
                continue
            worst = float(d2[i][true[i]].max())
            r = math.isqrt(int(worst)) if math.isfinite(worst) else self.max_radius + 1
            r += 0 if math.isfinite(worst) and r * r == int(worst) else 1
            out.append(min(r, self.max_radius + 1))
        return torch.tensor(out, dtype=torch.int64)

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor) -> None:
        """Add calibration images."""
        r = self.image_radii(logits, target)
        self.radius_hist.add_(torch.bincount(r, minlength=self.max_radius + 2).to(
            self.radius_hist.device))

    @torch.no_grad()
    def fit(self) -> dict[str, Any]:
        """``{"alpha", "radius" (None: no finite radius qualifies), "calibration_images",
        "guarantee", "needs_images"}`` (and a one-line ``"warning"`` when there are fewer than
        ``needs_images = ceil(1 / alpha) - 1`` images: the radius is then None, the whole
        image, and the guarantee says nothing; :func:`guarantee_status`)."""
        (hist,) = sum_over_ranks([self.radius_hist])
        g = quantile_threshold(hist.tolist(), self.alpha)
        self.radius = None if g > self.max_radius else g
        n = int(hist.sum())
        return {"alpha": self.alpha, "radius": self.radius, "calibration_images": n,
                **guarantee_status(self.alpha, "dilation", [n])}

    @torch.no_grad()
    def dilate(self, logits: Tensor) -> Tensor:
        """The predicted mask dilated by the fitted radius ``(N, H, W)`` bool (all pixels when
        no finite radius qualified)."""
        pred = (logits.argmax(dim=1) == self.foreground).cpu().numpy()
        if self.radius is None:
            return torch.ones(pred.shape, dtype=torch.bool)
        return torch.from_numpy(squared_boundary_distance(pred) <= self.radius**2)
