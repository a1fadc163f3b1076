"""Distance bands of a mask: the band rule of ``BoundaryCalibrationMeter``, for the losses that
act per band (:mod:`cals_seg.losses.cals_bands`) and for the training data that feeds them.

NumPy on the CPU (OpenCV's exact Euclidean distance transform, imported when first used), so
that the training bands are computed where the data is loaded, not on the accelerator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

ExtraInputFn = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


def distance_bands(target: np.ndarray, bands: Sequence[float], ignore_index: int,
                   inside: np.ndarray | None = None) -> np.ndarray:
    """The band of every pixel: ``b`` with ``edges[b] <= d < edges[b + 1]``, ``edges = [0,
    *bands, inf]`` and ``d`` the exact Euclidean distance to the nearest boundary pixel of the
    same image (:func:`cals_seg.metrics.regions.boundary_bands`, with ``inside`` marking the
    image proper); -1 at void pixels and outside the image. With ``inside=None`` these are
    exactly the bands of ``BoundaryCalibrationMeter(bands=bands)``.

    Shape:
        target: ``(N, H, W)`` integer; inside: ``(N, H, W)`` or None; returns ``(N, H, W)``
        int64.
    """
    from cals_seg.metrics.regions import boundary_bands  # OpenCV

    out = boundary_bands(target, bands, ignore_index, inside)
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
