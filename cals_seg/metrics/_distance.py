"""Boundary masks and exact, bounded Euclidean distances on the device (torch).

The torch counterparts of :func:`cals_seg.metrics.regions.boundary_pixels` and
:func:`cals_seg.metrics.regions.boundary_bands` for maps without void pixels (a predicted map):
same boundary rule, same bands, decided on the same integers, but computed where the map is
(no copy to the host, no per-image loop). Used by the ``boundary_ts`` calibrator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.metrics.regions import band_thresholds


def boundary_mask(label_map: Tensor, ignore_index: int | None = None) -> Tensor:
    """Valid pixels with at least one of their 8 neighbours inside the image of another value.

    The rule of :func:`cals_seg.metrics.regions.boundary_pixels` (no padding): each of the four
    neighbour directions compares the overlapping slices once and marks both pixels of a
    differing pair; a void neighbour (``ignore_index``) counts as different, a void pixel is
    never a boundary pixel. ``ignore_index=None``: no void (a predicted map).

    Shape:
        - label_map: ``(N, H, W)`` integer; returns ``(N, H, W)`` bool.
    """
    t = label_map
    out = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    pairs = (
        ((slice(None), slice(1, None), slice(None)), (slice(None), slice(None, -1), slice(None))),
        ((slice(None), slice(None), slice(1, None)), (slice(None), slice(None), slice(None, -1))),
        ((slice(None), slice(1, None), slice(1, None)),
         (slice(None), slice(None, -1), slice(None, -1))),
        ((slice(None), slice(1, None), slice(None, -1)),
         (slice(None), slice(None, -1), slice(1, None))),
    )
    for a, b in pairs:
        diff = t[a] != t[b]
        out[a] |= diff
        out[b] |= diff
    if ignore_index is not None:
        out &= t != ignore_index
    return out


def squared_distance_below(boundary: Tensor, limit: int) -> Tensor:
    """Exact squared Euclidean distance ``D`` (pixels^2) of every pixel to the nearest boundary
    pixel of its image where ``D < limit``, and ``limit`` elsewhere (``min(D, limit)``; an
    image without boundary pixels is ``limit`` everywhere).

    Two separable passes, in int32 (exact): the vertical distance ``g`` to the nearest boundary
    pixel of the same column (two ``cummax`` scans), capped at ``R + 1`` with
    ``R = isqrt(limit - 1)``; then ``D(y, x) = min_{|dx| <= R} g(y, x + dx)^2 + dx^2``. A
    boundary pixel at ``D < limit`` has ``|dx|, |dy| <= R``, so it is among the candidates; a
    capped candidate is ``>= (R + 1)^2 >= limit``; every candidate is the squared distance of
    a boundary pixel. So the result is exact below ``limit``; the cost is ``2 R + 1`` passes
    over the map (15 for ``limit = 64``). ``limit = H^2 + W^2`` gives the whole transform.

    Shape:
        - boundary: ``(N, H, W)`` bool; returns ``(N, H, W)`` int32.
    """
    if limit < 1:
        raise ValueError(f"Expected `limit` >= 1, but got {limit}.")
    n, h, w = boundary.shape
    dev = boundary.device
    r = math.isqrt(limit - 1)
    cap = r + 1
    i32 = torch.int32
    rows = torch.arange(h, device=dev, dtype=i32).view(1, h, 1)
    far = torch.tensor(-(h + cap), device=dev, dtype=i32)
    above = torch.where(boundary, rows, far).cummax(dim=1).values  # last boundary row <= y
    below = torch.where(boundary, -rows, far).flip(1).cummax(dim=1).values.flip(1).neg_()
    g = torch.minimum(rows - above, below - rows).clamp_(max=cap)
    g2 = g.mul_(g)
    padded = F.pad(g2, (r, r), value=cap * cap)
    out = torch.full((n, h, w), limit, device=dev, dtype=i32)
    for j in range(2 * r + 1):
        out = torch.minimum(out, padded[..., j:j + w] + (j - r) ** 2)
    return out.clamp_(max=limit)


def int_thresholds(bands: Sequence[float]) -> tuple[int, ...]:
    """:func:`cals_seg.metrics.regions.band_thresholds` as Python ints."""
    return tuple(int(t) for t in band_thresholds(bands))


def label_map_bands(label_map: Tensor, bands: Sequence[float],
                    ignore_index: int | None = None,
                    thresholds: Sequence[int] | None = None) -> Tensor:
    """Band of every pixel: the boundary rule of :func:`boundary_mask`, and with
    ``edges = [0, *bands, inf]`` band ``i`` where ``edges[i] <= d < edges[i + 1]``, decided as
    :func:`cals_seg.metrics.regions.boundary_bands` does (``d < b <=> D < ceil(b^2)`` on the
    exact squared distance ``D``); equal to it (void pixels get the band of their distance
    too, as there).

    ``thresholds``: :func:`int_thresholds` of ``bands`` made beforehand (no numpy in the call:
    what a compiled caller passes).

    Shape:
        - label_map: ``(N, H, W)`` integer; returns ``(N, H, W)`` int64 in ``[0, len(bands)]``.
    """
    if thresholds is None:
        thresholds = int_thresholds(bands)
    out = torch.zeros(label_map.shape, dtype=torch.int64, device=label_map.device)
    if not thresholds:
        return out
    boundary = boundary_mask(label_map, ignore_index)
    dist2 = squared_distance_below(boundary, max(thresholds))
    for t in thresholds:
        out += dist2 >= t
    return out
