"""How prediction sets behave on a test split: risk, coverage and size, by region.

:class:`PredictionSetMeter` takes per-pixel prediction sets (``(N, K, H, W)`` bool, e.g. from
:class:`cals_seg.evaluation.conformal.ConformalSets`) and the target, and keeps sums of a fixed
size: overall, per true class, per distance band around the target boundaries (the bands of
:class:`~cals_seg.metrics.BoundaryCalibrationMeter`), per object-size bucket (those of
:class:`~cals_seg.metrics.ObjectSizeCalibrationMeter`) and per *group* of the conformal mode
(the true class, or the predicted-boundary band, whose threshold each pixel used). Counts are
int64, the per-image risk sums float64; DDP sync is a sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from cals_seg.metrics.functional import sum_over_ranks
from cals_seg.metrics.regions import boundary_bands, component_areas
from cals_seg.utils.validation import check_ignore_index, check_int


class PredictionSetMeter(nn.Module):
    """Empirical risk, coverage and set size of prediction sets, by region.

    For the valid pixels (``target != ignore_index``) of the images seen:

    - ``risk``: mean over images (with a valid pixel) of the fraction of their valid pixels
      whose class is not in their set: the quantity conformal risk control bounds.
    - ``coverage``: fraction of all valid pixels covered; ``set_size``: mean set size;
      ``multi``: fraction of valid pixels whose set holds more than one class;
      ``empty``: fraction with an empty set.
    - ``coverage_image_below_tau`` (with ``tau``): fraction of images whose coverage is below
      ``tau`` (decided exactly: covered ``< ceil(tau * valid)``).
    - ``<stat>_class``, ``<stat>_band``, ``<stat>_size`` (``coverage``, ``set_size``,
      ``multi``, ``count``) per true class, target-boundary band and object-size bucket
      (None for an empty one), and ``risk_group`` / ``images_group``: per group of the
      conformal mode, the mean over the images having pixels of the group of the group's
      uncovered fraction.

    State: ``O(K + bands + sizes + groups)`` numbers whatever the pixels.

    Args:
        num_classes: K >= 2.
        bands: boundary band edges (pixels), as the boundary meter's.
        areas: object-size bucket edges (pixels), as the object-size meter's.
        num_groups: groups of the conformal mode (1 for ``risk`` / ``image``).
        tau: per-image coverage level to count images below (None: not counted).
        ignore_index: target value of void pixels.
        background_index: a class that is not an object for the size buckets.

    Shape:
        - sets: ``(N, K, H, W)`` bool; target: ``(N, H, W)``; group: ``(N, H, W)`` int64.
    """

    def __init__(self, num_classes: int, bands: Sequence[float] = (3.0, 8.0),
                 areas: Sequence[int] = (32**2, 96**2), num_groups: int = 1,
                 tau: float | None = None, ignore_index: int = -100,
                 background_index: int | None = None) -> None:
        super().__init__()
        check_int("num_classes", num_classes, 2)
        check_int("num_groups", num_groups, 1)
        check_ignore_index(ignore_index)
        self.num_classes, self.bands, self.areas = num_classes, tuple(bands), tuple(areas)
        self.num_groups, self.tau, self.ignore_index = num_groups, tau, ignore_index
        self.background_index = background_index
        sizes = {"all": 1, "class": num_classes, "band": len(self.bands) + 1,
                 "size": len(self.areas) + 1, "group": num_groups}
        for region, n in sizes.items():
            self.register_buffer(f"{region}_stats", torch.zeros(n, 4, dtype=torch.int64))
        self.register_buffer("images", torch.zeros(2, dtype=torch.int64))  # seen, below tau
        self.register_buffer("risk_sum", torch.zeros(1, dtype=torch.float64))
        self.register_buffer("group_risk", torch.zeros(num_groups, dtype=torch.float64))
        self.register_buffer("group_images", torch.zeros(num_groups, dtype=torch.int64))
        self.register_buffer("empty", torch.zeros(1, dtype=torch.int64))

    def reset(self) -> None:
        """Zero every state."""
        for buf in self.buffers():
            buf.zero_()

    def _regions(self, target: np.ndarray) -> dict[str, np.ndarray]:
        area = component_areas(target, self.num_classes, self.ignore_index,
                               self.background_index)
        size = np.searchsorted(np.array(self.areas), area, side="right")
        size[area == 0] = len(self.areas) + 1
        return {"band": boundary_bands(target, self.bands, self.ignore_index), "size": size}

    @torch.no_grad()
    def update(self, sets: Tensor, target: Tensor, group: Tensor | None = None) -> None:
        """Add one batch of sets ``(N, K, H, W)`` bool with their target ``(N, H, W)`` and the
        mode's group of each pixel ``(N, H, W)`` (None: all in group 0)."""
        if sets.dim() != 4 or sets.dtype != torch.bool or sets.shape[1] != self.num_classes:
            raise ValueError(f"Expected bool `sets` of shape (N, K={self.num_classes}, H, W), "
                             f"but got {tuple(sets.shape)} {sets.dtype}.")
        if tuple(target.shape) != (sets.shape[0], *sets.shape[2:]):
            raise ValueError(f"Expected `target` of shape {(sets.shape[0], *sets.shape[2:])}, "
                             f"but got {tuple(target.shape)}.")
        dev = self.all_stats.device
        n = sets.shape[0]
        t = target.to(dev, torch.int64).reshape(n, -1)
        valid = t != self.ignore_index
        if bool(((t < 0) | (t >= self.num_classes))[valid].any()):
            raise ValueError(f"Expected target values in [0, {self.num_classes}) or "
                             f"ignore_index={self.ignore_index}.")
        s = sets.to(dev).reshape(n, self.num_classes, -1)
        y = t.masked_fill(~valid, 0)
        covered = s.gather(1, y.unsqueeze(1)).squeeze(1) & valid
        size = s.sum(dim=1).masked_fill_(~valid, 0)
        multi = (size > 1) & valid
        self.empty += ((size == 0) & valid).sum()
        g = torch.zeros_like(t) if group is None else group.to(dev, torch.int64).reshape(n, -1)
        regions = {k: torch.from_numpy(v.astype(np.int64)).to(dev).reshape(n, -1)
                   for k, v in self._regions(target.cpu().numpy().astype(np.int64)).items()}
        keys = {"all": torch.zeros_like(t), "class": y, "group": g, **regions}
        values = torch.stack([valid.long(), covered.long(), size, multi.long()], dim=-1)
        for region, key in keys.items():
            stats = getattr(self, f"{region}_stats")
            m = stats.shape[0]
            k = key.masked_fill(~valid | (key >= m) | (key < 0), m).reshape(-1)
            add = torch.zeros(m + 1, 4, dtype=torch.int64, device=dev)
            add.index_add_(0, k, values.reshape(-1, 4))
            stats += add[:m]
        count = valid.sum(dim=1)
        seen = count > 0
        cov = covered.sum(dim=1)
        self.images[0] += seen.sum()
        self.risk_sum += ((count - cov)[seen].double() / count[seen].double()).sum()
        if self.tau is not None:
            frac = Fraction(repr(float(self.tau)))
            need = (count * frac.numerator + frac.denominator - 1) // frac.denominator
            self.images[1] += (seen & (cov < need)).sum()
        gk = g.masked_fill(~valid | (g >= self.num_groups) | (g < 0), self.num_groups)
        width = self.num_groups + 1
        rows = torch.arange(n, device=dev).unsqueeze(1) * width + gk
        gc = torch.bincount(rows.reshape(-1), minlength=n * width).view(n, width)[:, :-1]
        gcov = torch.bincount(rows.reshape(-1), weights=covered.reshape(-1).double(),
                              minlength=n * width).view(n, width)[:, :-1]
        has = gc > 0
        self.group_images += has.sum(dim=0)
        miss = (gc.double() - gcov) / gc.clamp(min=1).double()
        self.group_risk += miss.masked_fill_(~has, 0.0).sum(dim=0)

    @staticmethod
    def _table(stats: Tensor) -> dict[str, list]:
        out: dict[str, list] = {"count": [], "coverage": [], "set_size": [], "multi": []}
        for count, covered, size, multi in stats.tolist():
            out["count"].append(count)
            out["coverage"].append(covered / count if count else None)
            out["set_size"].append(size / count if count else None)
            out["multi"].append(multi / count if count else None)
        return out

    @torch.no_grad()
    def compute(self) -> dict[str, Any]:
        """The dict described in the class docstring (all-reduced under DDP: a collective)."""
        names = ["all_stats", "class_stats", "band_stats", "size_stats", "group_stats",
                 "images", "risk_sum", "group_risk", "group_images", "empty"]
        s = dict(zip(names, (t.cpu() for t in sum_over_ranks([getattr(self, n) for n in names])),
                     strict=True))
        images = int(s["images"][0])
        total = self._table(s["all_stats"])
        out: dict[str, Any] = {
            "images": images,
            "pixels": total["count"][0],
            "risk": float(s["risk_sum"][0]) / images if images else None,
            "coverage": total["coverage"][0],
            "set_size": total["set_size"][0],
            "multi": total["multi"][0],
            "empty": int(s["empty"][0]) / total["count"][0] if total["count"][0] else None,
            "band_edges": [0.0, *self.bands, None],
            "size_edges": [0, *self.areas, None],
        }
        if self.tau is not None:
            out["tau"] = self.tau
            out["coverage_image_below_tau"] = int(s["images"][1]) / images if images else None
        for region in ("class", "band", "size"):
            for stat, values in self._table(s[f"{region}_stats"]).items():
                out[f"{stat}_{region}"] = values
        gi = s["group_images"].tolist()
        out["images_group"] = gi
        out["risk_group"] = [r / m if m else None
                             for r, m in zip(s["group_risk"].tolist(), gi, strict=True)]
        return out
