"""Distance bands of a mask: the band rule of ``BoundaryCalibrationMeter``, for the losses that
act per band (:mod:`cals_seg.losses.cals_bands`) and for the training data that feeds them.

NumPy on the CPU (OpenCV's exact Euclidean distance transform, imported when first used), so
that the training bands are computed where the data is loaded, not on the accelerator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

ExtraInputFn = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


def boundary_pixels_inside(target: np.ndarray, ignore_index: int,
                           inside: np.ndarray | None = None) -> np.ndarray:
    """The boundary rule of ``BoundaryCalibrationMeter`` with the image's own extent: a valid
    pixel is a boundary pixel when one of its 8 neighbours *inside the image* has another value
    (a void neighbour counts as different). ``inside`` marks the pixels of the image proper
    (``False`` on padding added by the augmentation, which is not a boundary); ``None``: all.

    Shape:
        target: ``(N, H, W)`` integer; inside: ``(N, H, W)`` bool or None; returns ``(N, H, W)``
        bool.
    """
    t = target
    ok = np.ones(t.shape, dtype=bool) if inside is None else inside.astype(bool)
    out = np.zeros(t.shape, dtype=bool)
    whole, head, tail = slice(None), slice(1, None), slice(None, -1)
    for a, b in (
        ((whole, head, whole), (whole, tail, whole)),
        ((whole, whole, head), (whole, whole, tail)),
        ((whole, head, head), (whole, tail, tail)),
        ((whole, head, tail), (whole, tail, head)),
    ):
        diff = (t[a] != t[b]) & ok[a] & ok[b]
        out[a] |= diff
        out[b] |= diff
    return out & (t != ignore_index) & ok


def band_thresholds(bands: Sequence[float]) -> np.ndarray:
    """Integer thresholds on squared distances: ``d < b  <=>  D < ceil(b^2)`` for ``D = d^2``
    an integer (exact rational arithmetic, as ``BoundaryCalibrationMeter``)."""
    return np.array([math.ceil(Fraction(b) ** 2) for b in bands], dtype=np.float64)


def distance_bands(target: np.ndarray, bands: Sequence[float], ignore_index: int,
                   inside: np.ndarray | None = None) -> np.ndarray:
    """The band of every pixel: ``b`` with ``edges[b] <= d < edges[b + 1]``, ``edges = [0,
    *bands, inf]`` and ``d`` the exact Euclidean distance to the nearest boundary pixel of the
    same image; -1 at void pixels and outside the image. With ``inside=None`` these are exactly
    the bands of ``BoundaryCalibrationMeter(bands=bands)``.

    Shape:
        target: ``(N, H, W)`` integer; inside: ``(N, H, W)`` or None; returns ``(N, H, W)``
        int64.
    """
    from cals_seg.metrics.regions import squared_boundary_distance  # OpenCV

    boundary = boundary_pixels_inside(target, ignore_index, inside)
    dist2 = squared_boundary_distance(boundary)
    out = np.searchsorted(band_thresholds(bands), dist2, side="right").astype(np.int64)
    out[target == ignore_index] = -1
    if inside is not None:
        out[~inside.astype(bool)] = -1
    return out


class BandMap:
    """The ``band`` map of one augmented mask (a picklable :data:`ExtraInputFn`).

    Args:
        bands: increasing positive distances in pixels (e.g. ``(3, 8)``).
        ignore_index: void label.
    """

    def __init__(self, bands: Sequence[float], ignore_index: int) -> None:
        self.bands, self.ignore_index = tuple(float(b) for b in bands), ignore_index

    def __call__(self, mask: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        """``mask (H, W)`` -> ``(H, W)`` int64 band indices (-1: void or padding)."""
        ins = None if inside is None else inside[None]
        return distance_bands(np.asarray(mask)[None], self.bands, self.ignore_index, ins)[0]

    def __repr__(self) -> str:
        return f"BandMap(bands={self.bands}, ignore_index={self.ignore_index})"
