"""Boundary masks and exact, bounded Euclidean distances on the device (torch).

The torch counterparts of :func:`cals_seg.metrics.regions.boundary_pixels` and
:func:`cals_seg.metrics.regions.boundary_bands` for maps without void pixels (a predicted map):
same boundary rule, same bands, decided on the same integers, but computed where the map is
(no copy to the host, no per-image loop). Used by the ``boundary_ts`` calibrator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor


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


def _small_dtype(largest: int) -> torch.dtype:
    """The narrowest integer dtype holding ``0 .. largest``."""
    if largest < 2**8:
        return torch.uint8
    return torch.int16 if largest < 2**15 else torch.int32


def capped_squared_distance(boundary: Tensor, limit: int) -> Tensor:
    """``min(D, limit)`` for the exact squared Euclidean distance ``D`` (pixels^2) of every pixel
    to the nearest boundary pixel of its image, in the narrowest integer dtype that holds the
    intermediate values (uint8 for ``limit <= 121``, e.g. 64 for the default bands).

    Two separable passes. Vertical: the distance ``g`` to the nearest boundary pixel of the same
    column, capped at ``R + 1`` with ``R = isqrt(limit - 1)``, as ``g = sum_{d=0..R} [no
    boundary pixel within d rows]``, the mask being dilated by one row up and down per step
    (``2 R`` one-byte slice ORs). Horizontal: ``D(y, x) = min_{|dx| <= R} g(y, x + dx)^2 + dx^2``
    (``2 R + 1`` shifted minima). A boundary pixel at ``D < limit`` has ``|dx|, |dy| <= R``, so
    it is among the candidates; a capped candidate is ``>= (R + 1)^2 >= limit``; every candidate
    is the squared distance of a boundary pixel. So the result is exact below ``limit``.
    ``limit = H^2 + W^2`` gives the whole transform (slowly: ``R`` is then the diagonal).

    Shape:
        - boundary: ``(N, H, W)`` bool; returns ``(N, H, W)`` uint8, int16 or int32.
    """
    if limit < 1:
        raise ValueError(f"Expected `limit` >= 1, but got {limit}.")
    n, h, w = boundary.shape
    r = math.isqrt(limit - 1)
    cap = r + 1
    dt = _small_dtype(max(cap * cap + r * r, limit))
    near = boundary.clone()  # a boundary pixel within d rows, for d = 0, 1, ...
    far = (~near).to(dt)  # g = number of d in 0..R without one (so g <= R + 1 = cap)
    for _ in range(min(r, h)):
        grown = near.clone()
        grown[:, 1:] |= near[:, :-1]
        grown[:, :-1] |= near[:, 1:]
        near = grown
        far += ~near
    if r > h:  # no boundary pixel within h rows: none in the column; g = cap there
        far.masked_fill_(~near, cap)
    g2 = far.mul_(far)
    padded = F.pad(g2, (r, r), value=cap * cap)
    out = padded[..., r:r + w].clone()  # dx = 0
    for dx in range(1, r + 1):
        torch.minimum(out, padded[..., r - dx:r - dx + w] + dx * dx, out=out)
        torch.minimum(out, padded[..., r + dx:r + dx + w] + dx * dx, out=out)
    return out.clamp_(max=limit)


def int_thresholds(bands: Sequence[float]) -> tuple[int, ...]:
    """Integer thresholds on squared distances, ``d < b  <=>  d^2 < ceil(b^2)`` with ``ceil`` of
    the exact rational ``b^2`` (the region meters' :func:`cals_seg.metrics.regions.band_thresholds`
    hold the same numbers as float64)."""
    return tuple(math.ceil(Fraction(b) ** 2) for b in bands)  # d < b  <=>  d^2 < ceil(b^2)


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
    if not thresholds:
        return torch.zeros(label_map.shape, dtype=torch.int64, device=label_map.device)
    dist2 = capped_squared_distance(boundary_mask(label_map, ignore_index), max(thresholds))
    out = (dist2 >= thresholds[0]).to(torch.int64)
    for t in thresholds[1:]:
        out += dist2 >= t
    return out
