"""Calibrators as programs that ``torch.export`` and ONNX hold for every image size.

A fitted calibrator's ``forward`` is written for speed in eager PyTorch: loops over blocks of
positions, in-place writes into slices, reads of its own buffers to decide a branch, rows
selected per class with ``nonzero``. None of these survives an export with dynamic ``N``, ``H``
and ``W``. :meth:`cals_seg.calibrators.Calibrator.export_module` returns instead one of the
modules below: the same numbers (the tests compare each with ``forward`` to float32 rounding,
labels exactly), with the fitted state fixed as buffers and Python constants, no branch on data
and no loop whose length depends on the image.

The predicted boundary bands (:func:`graph_bands`) follow the definition of the fitted
``boundary_ts`` calibrators exactly: the label map is ``argmax(logits)`` (the first maximal
class), a pixel is a boundary pixel when one of its 8 neighbours inside the image has another
label, ``D`` is the exact squared Euclidean distance to the nearest boundary pixel of the same
image, and band ``i`` holds ``ceil(b_i^2) <= D < ceil(b_{i+1}^2)``
(:func:`cals_seg.metrics.distance.label_map_bands`), decided on the same integers.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cals_seg.metrics.distance import int_thresholds


def graph_boundary(label: Tensor) -> Tensor:
    """Pixels with at least one of their 8 neighbours inside the image of another label: the
    rule of :func:`cals_seg.metrics.distance.boundary_mask` (no void), as the 3 x 3 maximum and
    minimum of the labels (max pooling, whose padding is never the maximum) differing: the
    window around a pixel holds two labels exactly when one of its neighbours has another
    label than its own. Two poolings and a comparison whatever the image (no slice, no
    in-place write).

    Shape:
        - label: ``(N, H, W)`` integer (class indices below ``2^24``, exact in float32);
          returns ``(N, H, W)`` bool.
    """
    x = label.unsqueeze(1).to(torch.float32)
    high = torch.nn.functional.max_pool2d(x, 3, stride=1, padding=1)
    low = -torch.nn.functional.max_pool2d(-x, 3, stride=1, padding=1)
    return (high != low).squeeze(1)


def _shifted(x: Tensor, dim: int, step: int, fill: int) -> tuple[Tensor, Tensor]:
    """``(x[i - step], x[i + step])`` along ``dim`` for every ``i``, ``fill`` where that index is
    outside ``x``: slices of ``x`` padded with ``step`` fills on both sides (a concatenation,
    so that the sizes stay symbolic, whatever the size against ``step``)."""
    n = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = step
    edge = torch.full_like(x.narrow(dim, 0, 1), fill).expand(shape)
    padded = torch.cat([edge, x, edge], dim=dim)
    return padded.narrow(dim, 0, n), padded.narrow(dim, 2 * step, n)


def graph_squared_distance(boundary: Tensor, limit: int) -> Tensor:
    """``min(D, limit)`` for the exact squared Euclidean distance ``D`` of every pixel to the
    nearest boundary pixel of its image: the two passes of
    :func:`cals_seg.metrics.distance.capped_squared_distance` in int32, with a number of
    operations that depends on ``limit`` only.

    1. The vertical distance ``g`` capped at ``R + 1`` (``R = isqrt(limit - 1)``): from ``g = 0``
       on boundary pixels and ``R + 1`` elsewhere, ``g(y) = min(g(y), g(y - s) + s,
       g(y + s) + s)`` for ``s = 1, 2, 4, ...`` up to ``R`` (``R + 1`` outside the image). After
       the steps up to ``s``, ``g(y)`` is the minimum over offsets ``|d| <= 2s - 1`` of the
       starting value at ``y + d`` plus the length of a path of those steps, which is at least
       ``|d|`` and equals it along ``d``'s binary digits (no step crossing the image's edge):
       the distance to the nearest boundary pixel within ``R`` of the column, else ``R + 1``,
       in ``log2(R) + 1`` steps instead of ``R``.
    2. The minimum over ``|dx| <= R`` of ``g(x + dx)^2 + dx^2`` (``(R + 1)^2`` outside the
       image), capped at ``limit``.

    Shape:
        - boundary: ``(N, H, W)`` bool; returns ``(N, H, W)`` int32.
    """
    r = math.isqrt(limit - 1)
    cap = r + 1
    g = (~boundary).to(torch.int32) * cap
    step = 1
    while step <= r:
        before, after = _shifted(g, 1, step, cap)
        g = torch.minimum(g, torch.minimum(before, after) + step)
        step *= 2
    g2 = g * g
    if r == 0:
        return g2.clamp(max=limit)
    edge = torch.full_like(g2[:, :, :1], cap * cap).expand(-1, -1, r)
    padded = torch.cat([edge, g2, edge], dim=2)
    w = g2.shape[2]
    out = g2
    for dx in range(1, r + 1):
        # narrow (start, length): no symbolic end to compute per offset, as a slice has
        near = torch.minimum(padded.narrow(2, r - dx, w), padded.narrow(2, r + dx, w))
        out = torch.minimum(out, near + dx * dx)
    return out.clamp(max=limit)


def graph_bands(logits: Tensor, thresholds: Sequence[int]) -> Tensor:
    """Band of every pixel from the boundaries of ``argmax(logits)``: the bands of
    :func:`cals_seg.calibrators.boundary_ts.predicted_bands` (``thresholds``:
    :func:`~cals_seg.metrics.distance.int_thresholds` of the band distances).

    Shape:
        - logits: ``(N, K, H, W)``; returns ``(N, H, W)`` int64.
    """
    label = logits.argmax(dim=1)
    if not thresholds:
        return torch.zeros_like(label)
    dist2 = graph_squared_distance(graph_boundary(label), max(thresholds))
    band = (dist2 >= thresholds[0]).to(torch.int64)
    for t in thresholds[1:]:
        band = band + (dist2 >= t)  # int64 + bool: int64 (one operation fewer per band)
    return band


class BandTemperatures(nn.Module):
    """``l(p) / T[band(p)]`` with the bands of :func:`graph_bands` (``boundary_ts``,
    ``boundary_ts_fine``).

    Args:
        bands: the band distances in pixels.
        temperatures: ``len(bands) + 1`` temperatures.

    Shape:
        - logits: ``(N, K, H, W)`` -> same shape.
    """

    def __init__(self, bands: Sequence[float], temperatures: Tensor) -> None:
        super().__init__()
        self.thresholds = int_thresholds(bands)
        self.register_buffer("temperatures", temperatures.detach().to("cpu", torch.float32)
                             .clone())

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        band = graph_bands(logits, self.thresholds)
        return logits / self.temperatures.to(logits.dtype)[band].unsqueeze(1)


def floored_log_probs(rows: Tensor) -> Tensor:
    """``log softmax`` of ``rows (M, K)`` floored at ``log(1e-16)``, as the selective scaling
    authors' ``log(p + 1e-16)``: no ``-inf`` enters the misprediction classifier."""
    return torch.log_softmax(rows.float(), dim=1).clamp(min=math.log(1e-16))


class FlaggedTemperature(nn.Module):
    """``l(p) / T_mis`` where a misprediction classifier flags ``p``, else ``l(p)``
    (``selective``): the classifier on every pixel at once.

    Args:
        classifier: ``(P, K)`` log-probabilities -> ``(P,)`` logits of "wrong" (eval mode).
        logit_threshold: flagged where the classifier's logit is above it.
        temperature: ``T_mis`` (a float32 scalar tensor); 1: the identity.

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    def __init__(self, classifier: nn.Module, logit_threshold: float,
                 temperature: Tensor) -> None:
        super().__init__()
        self.classifier = copy.deepcopy(classifier).to("cpu", torch.float32).eval()
        self.logit_threshold = float(logit_threshold)
        t = temperature.detach().to("cpu", torch.float32).reshape(())
        self.identity = float(t) == 1.0
        self.register_buffer("inverse", 1.0 / t)  # as the calibrator computes it, in float32

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        if self.identity:
            return logits
        k = logits.shape[1]
        rows = logits.movedim(1, -1).reshape(-1, k)
        flag = self.classifier(floored_log_probs(rows)) > self.logit_threshold
        flag = flag.reshape(logits.shape[0], *logits.shape[2:])
        scale = torch.where(flag, self.inverse.to(logits.dtype),
                            torch.ones((), dtype=logits.dtype, device=logits.device))
        return logits * scale.unsqueeze(1)


class ExpertAffine(nn.Module):
    """``cms_ap`` / ``cms_op`` (:func:`cals_seg.calibrators.order_keeping.order_keeping_logits`)
    on every pixel at once: each expert's map is computed for all pixels and kept where the
    pixel's predicted class is the expert's (``K`` matrix products of ``(P, K - 1)`` by
    ``(K - 1, K - 1)``: ``K`` times the eager cost, which selects the rows first).

    Args:
        weight: ``(K, K - 1, K - 1)``; bias: ``(K, K - 1)``; mode: ``argmax`` or ``order``.
        topk: rank the classes with ``topk`` (ONNX's ``TopK``, which puts equal values in
            class order, as the stable sort of the eager map does) instead of a stable sort
            (which ONNX has not). Mode ``order`` only: ``argmax`` ranks nothing, so its
            module (and its traced program) is the same for both formats.

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    def __init__(self, weight: Tensor, bias: Tensor, mode: str, topk: bool = False) -> None:
        super().__init__()
        self.mode, self.topk = mode, bool(topk) and mode == "order"
        self.register_buffer("weight", weight.detach().to("cpu", torch.float32).clone())
        self.register_buffer("bias", bias.detach().to("cpu", torch.float32).clone())
        k = weight.shape[0]
        idx = torch.arange(k)
        self.register_buffer("competitors", torch.stack([idx[idx != c] for c in range(k)]))

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        k = logits.shape[1]
        work = logits.float()
        rows = work.movedim(1, -1).reshape(-1, k)
        top = rows.argmax(dim=1, keepdim=True)
        # columns read with narrow and the zeros made once: one traced node per read (a slice
        # `x[:, a:b]` is two), none per class for the zeros
        blank = torch.zeros_like(rows)
        zero = blank.narrow(1, 0, 1)
        out = blank
        weight, bias = self.weight.to(rows.dtype), self.bias.to(rows.dtype)
        if self.mode == "argmax":
            for c in range(k):
                gaps = rows.narrow(1, c, 1) - rows.index_select(1, self.competitors[c])
                values = -(gaps @ weight[c].T + bias[c])
                part = torch.cat([values.narrow(1, 0, c), zero,
                                  values.narrow(1, c, k - 1 - c)], dim=1)
                out = torch.where(top == c, part, out)
        else:
            if self.topk:
                values, perm = torch.topk(rows, k, dim=1, largest=True, sorted=True)
            else:
                values, perm = torch.sort(rows, dim=1, descending=True, stable=True)
            gaps = values.narrow(1, 0, k - 1) - values.narrow(1, 1, k - 1)
            for c in range(k):
                steps = gaps @ weight[c].T + bias[c]
                ranked = torch.cat([zero, -steps.cumsum(dim=1)], dim=1)
                part = blank.scatter(1, perm, ranked)
                out = torch.where(top == c, part, out)
        shape = (logits.shape[0], *logits.shape[2:], k)
        return out.reshape(shape).movedim(-1, 1).to(logits.dtype)


__all__ = ["BandTemperatures", "ExpertAffine", "FlaggedTemperature", "floored_log_probs",
           "graph_bands", "graph_boundary", "graph_squared_distance"]
