"""``boundary_ts_fine``: ``boundary_ts`` with the distance bands chosen on validation among finer
and finer sets.

One temperature per distance band from the *predicted* boundaries (exactly
:class:`~cals_seg.calibrators.boundary_ts.BoundaryTemperatureScaling`), where the bands are the
candidate set that predicts held-out validation pixels best:

1. the validation images are split by stream position (image ``j`` is held out when
   ``j % holdout_every == holdout_every - 1``, as the other held-out fits);
2. every candidate band set gets its ``boundary_ts`` temperatures on the other images;
3. the candidate with the lowest mean NLL on the held-out images is chosen (ties: the coarser,
   earlier one);
4. its temperatures are refitted on all validation images.

The test split is never seen. Default candidates: ``(3, 8)`` (``boundary_ts``), ``(1, 2, 3, 4, 6,
8, 12)`` and ``(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24)`` pixels. Cost: ``passes`` passes per
candidate, one scoring pass and ``passes`` more (13 with the defaults). Never changes the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import Batches, Calibrator, holdout_split, score_candidates
from cals_seg.calibrators._export import BandTemperatures
from cals_seg.calibrators.boundary_ts import BoundaryTemperatureScaling, predicted_bands
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.utils.validation import check_int

CANDIDATES = ((3.0, 8.0), (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
              (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0))


@CALIBRATORS.register("boundary_ts_fine")
class FineBoundaryTemperatureScaling(Calibrator):
    """One temperature per predicted-boundary band, the bands chosen on held-out validation
    images among ``candidates`` (module docstring).

    Buffers: ``temperatures`` (as many as the largest candidate has bands, the chosen ones
    first, the rest 1.0) and ``choice`` (index of the chosen candidate, int64).

    Args:
        num_classes: K >= 2.
        candidates: band sets, each increasing positive finite distances in pixels.
        holdout_every: one validation image in ``holdout_every`` scores the candidates (>= 2).
        t_min, t_max, num_grid, passes: as :class:`BoundaryTemperatureScaling`.

    Shape:
        - logits: ``(N, K, H, W)`` -> same shape.
    """

    name = "boundary_ts_fine"
    changes_argmax = False

    temperatures: Tensor
    choice: Tensor

    def __init__(self, num_classes: int,
                 candidates: Sequence[Sequence[float]] = CANDIDATES,
                 holdout_every: int = 5, t_min: float = 0.05, t_max: float = 20.0,
                 num_grid: int = 33, passes: int = 3) -> None:
        cands = [[float(b) for b in c] for c in candidates]
        if not cands:
            raise ValueError("Expected at least one candidate band set in `candidates`.")
        check_int("holdout_every", holdout_every, 2)
        for c in cands:  # the checks of boundary_ts, with its message
            BoundaryTemperatureScaling(num_classes, c, t_min, t_max, num_grid, passes)
        super().__init__(num_classes, candidates=cands, holdout_every=holdout_every,
                         t_min=float(t_min), t_max=float(t_max), num_grid=num_grid,
                         passes=passes)
        self.register_buffer("temperatures", torch.ones(max(len(c) for c in cands) + 1))
        self.register_buffer("choice", torch.zeros((), dtype=torch.int64))

    @property
    def bands(self) -> list[float]:
        """The chosen band set."""
        return self.params["candidates"][int(self.choice)]

    def _single(self, bands: Sequence[float]) -> BoundaryTemperatureScaling:
        p = self.params
        return BoundaryTemperatureScaling(self.num_classes, bands, p["t_min"], p["t_max"],
                                          p["num_grid"], p["passes"])

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Choose the band set on held-out validation images, then fit it on all of them."""
        p = self.params
        every = p["holdout_every"]
        fitted = []
        for bands in p["candidates"]:
            single = self._single(bands)
            single.fit(holdout_split(batches, every, "fit"), ignore_index)
            fitted.append(single)
        heldout, best = score_candidates(batches, every, ignore_index, fitted)
        final = self._single(p["candidates"][best])
        info = final.fit(batches, ignore_index)
        self.choice.fill_(best)
        self.temperatures.fill_(1.0)
        self.temperatures[: final.temperatures.numel()] = final.temperatures
        self.fit_info = {"bands": p["candidates"][best], "heldout_nll": heldout,
                         "temperatures": info["temperatures"],
                         "count_band": info["count_band"],
                         "passes": len(fitted) * p["passes"] + 1 + info["passes"]}
        return self.fit_info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        if logits.dim() != 4:
            raise ValueError(
                f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}."
            )
        bands = self.bands
        band = predicted_bands(logits, bands)
        temps = self.temperatures[: len(bands) + 1].to(logits.device, logits.dtype)
        return logits / temps[band].unsqueeze(1)

    def export_module(self, fmt: str = "pt2") -> torch.nn.Module:
        """The chosen bands and their temperatures as a program for export
        (:class:`~cals_seg.calibrators._export.BandTemperatures`)."""
        bands = self.bands
        return BandTemperatures(bands, self.temperatures[: len(bands) + 1])


