"""``boundary_ts``: one temperature per distance band from the *predicted* class boundaries.

The bands are those of :class:`cals_seg.metrics.BoundaryCalibrationMeter`, computed on the
argmax map of the logits instead of the ground truth: a pixel is a boundary pixel when one of
its 8 neighbours is predicted as another class, ``d(p)`` is the exact Euclidean distance to the
nearest boundary pixel of its image (an exact distance transform on the logits' device), and with
``edges = [0, *bands, inf]`` (default ``bands = (3, 8)``) band ``i`` holds
``edges[i] <= d < edges[i + 1]``. Band ``i`` gets its own temperature::

    forward(l)(p) = l(p) / T_{band(p)}

so the calibrator needs no ground truth at test time and never changes the argmax (the bands are
recomputed from the argmax, which the division keeps).

Fit: the validation NLL is a sum over bands of one-temperature NLLs, so each ``T_i`` is the
temperature-scaling optimum of its band's pixels, found by the same streaming grid refinement
as :func:`cals_seg.calibrators.ts.fit_temperature` (one grid per band, ``passes`` passes, a
parabola through the best point and its neighbours). A band without validation pixels gets the
temperature of all pixels (``passes`` more passes, with a warning). Void pixels of the target
are left out of the NLL, but they shape the predicted map like every other pixel, as at test
time.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import Batches, Calibrator, iterate, valid_rows
from cals_seg.calibrators._export import BandTemperatures
from cals_seg.calibrators._grid import grid_nll, grid_optima, refine_grids
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.errors import UserError
from cals_seg.metrics.distance import (
    boundary_mask,
    capped_squared_distance,
    int_thresholds,
    label_map_bands,
)
from cals_seg.metrics.functional import argmax_map
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int


def predicted_bands(logits: Tensor, bands: Sequence[float]) -> Tensor:
    """Band of every pixel from the boundaries of ``argmax(logits)``, computed on the logits'
    device (:func:`cals_seg.metrics.distance.label_map_bands`: exact distances, the bands of
    :func:`cals_seg.metrics.regions.boundary_bands`). The arg-max is
    :func:`cals_seg.metrics.functional.argmax_map` (that of ``argmax(dim=1)``, faster).

    Shape:
        - logits: ``(N, K, H, W)``; returns ``(N, H, W)`` int64 on the logits' device.
    """
    return label_map_bands(argmax_map(logits.detach()), bands)


@CALIBRATORS.register("boundary_ts")
class BoundaryTemperatureScaling(Calibrator):
    """One temperature per predicted-boundary distance band (buffer ``temperatures``,
    ``len(bands) + 1`` values, all 1.0 until fitted).

    Args:
        num_classes: K >= 2.
        bands: increasing positive finite distances in pixels (default ``(3.0, 8.0)``).
        t_min, t_max: the temperature range searched.
        num_grid: temperatures evaluated per band and pass (>= 3).
        passes: passes over the validation batches (>= 1).

    Shape:
        - logits: ``(N, K, H, W)`` -> same shape.
    """

    name = "boundary_ts"
    changes_argmax = False

    temperatures: Tensor

    def __init__(self, num_classes: int, bands: Sequence[float] = (3.0, 8.0),
                 t_min: float = 0.05, t_max: float = 20.0, num_grid: int = 33,
                 passes: int = 3) -> None:
        bands = tuple(bands)
        ok = all(isinstance(b, int | float) and not isinstance(b, bool) for b in bands)
        if not bands or not ok or not all(0 < b < math.inf for b in bands) or any(
            b >= c for b, c in zip(bands, bands[1:], strict=False)
        ):
            raise ValueError(
                f"Expected `bands` to be increasing positive finite distances, but got {bands!r}."
            )
        if not (0 < t_min < t_max < math.inf):
            raise UserError(f"Expected 0 < t_min < t_max, but got t_min={t_min}, t_max={t_max}.")
        check_int("num_grid", num_grid, 3)
        check_int("passes", passes)
        super().__init__(num_classes, bands=[float(b) for b in bands], t_min=float(t_min),
                         t_max=float(t_max), num_grid=num_grid, passes=passes)
        self.register_buffer("temperatures", torch.ones(len(bands) + 1))

    def _sweep(self, batches: Batches, log_t: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
        """Summed NLL ``(B, G)`` of every band at its grid of temperatures, and counts ``(B,)``."""
        num_bands = log_t.shape[0]
        total = torch.zeros(log_t.shape, dtype=torch.float64)
        count = torch.zeros(num_bands, dtype=torch.int64)
        for logits, target, _ in iterate(batches):
            if logits.dim() != 4:
                raise ValueError(
                    f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}."
                )
            band = predicted_bands(logits, self.params["bands"])
            rows, labels = valid_rows(logits, target, ignore_index)
            valid = target.reshape(-1).to(band.device) != ignore_index
            band = band.reshape(-1)[valid]
            for i in range(num_bands):
                sel = band == i
                if bool(sel.any()):
                    inv_t = (-log_t[i]).exp().to(rows.device)
                    total[i] += grid_nll(rows[sel], labels[sel], inv_t).cpu()
                    count[i] += int(sel.sum())
        all_reduce_sum_([total, count])
        return total, count

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Fit one temperature per band by grid refinement of its validation NLL."""
        p = self.params
        num_bands, g = len(p["bands"]) + 1, p["num_grid"]
        log_t, nll, best, count = refine_grids(
            lambda grid: self._sweep(batches, grid, ignore_index), num_bands, p["t_min"],
            p["t_max"], g, p["passes"], ignore_index)
        temps = []
        for i, x in enumerate(grid_optima(log_t, nll, best)):
            b = int(best[i])
            if not 0 < b < g - 1 and int(count[i]) and (x <= math.log(p["t_min"]) + 1e-9
                                                         or x >= math.log(p["t_max"]) - 1e-9):
                warnings.warn(f"boundary_ts: band {i}'s NLL is minimal at the search boundary "
                              f"T={math.exp(x):.4g}.", stacklevel=2)
            temps.append(math.exp(x))
        empty = [i for i in range(num_bands) if int(count[i]) == 0]
        passes, pooled = p["passes"], None
        if empty:  # a band without validation pixels gets the temperature of all pixels
            pooled = fit_temperature(lambda: ((lg, y) for lg, y, _ in iterate(batches)),
                                     ignore_index, p["t_min"], p["t_max"], g, p["passes"])
            passes += p["passes"]
            for i in empty:
                temps[i] = pooled
            warnings.warn(f"boundary_ts: band(s) {empty} have no validation pixel; they get "
                          f"the temperature of all pixels, {pooled:.4g}.", stacklevel=2)
        self.temperatures.copy_(torch.tensor(temps))
        self.fit_info = {"temperatures": temps, "pooled_temperature": pooled,
                         "count_band": count.tolist(), "passes": passes}
        return self.fit_info

    def temperature_map(self, logits: Tensor) -> Tensor:
        """The temperature of every pixel ``(N, H, W)`` (from its predicted band).

        The bands of :func:`predicted_bands` without their int64 map: the capped squared
        distance (one byte per pixel for the default bands) is compared with each threshold
        and the temperature written where it is reached (the thresholds increase), so the map
        holds exactly ``temperatures[band]``."""
        thresholds = int_thresholds(self.params["bands"])
        pred = argmax_map(logits.detach())
        dist2 = capped_squared_distance(boundary_mask(pred), max(thresholds))
        temps = self.temperatures.to(logits.device, logits.dtype)
        out = temps[0].expand(dist2.shape).clone()
        for i, t in enumerate(thresholds):
            out.masked_fill_(dist2 >= t, temps[i + 1])
        return out

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        if logits.dim() != 4:
            raise ValueError(
                f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}."
            )
        return logits / self.temperature_map(logits).unsqueeze(1)

    def export_module(self, fmt: str = "pt2") -> torch.nn.Module:
        """The bands and temperatures as a program for export
        (:class:`~cals_seg.calibrators._export.BandTemperatures`)."""
        return BandTemperatures(self.params["bands"], self.temperatures)
