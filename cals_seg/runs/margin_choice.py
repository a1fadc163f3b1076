"""Logit gaps of a trained network and the choice of a margin from short runs (the library
behind ``tools/margin.py``).

- :func:`gap_statistics` streams ``(logits, target)`` batches into fixed histograms of the
  largest gap per position and of all N x K gaps ``d_ik = max_j l_ij - l_ik``, and reports, per
  candidate margin m, how many positions and gaps the constraint ``d <= m`` binds.
- :func:`run_summary` and :func:`recommend`: the margin with the lowest VALIDATION ECE among the
  runs whose validation score stays within a tolerance of CE's (the test split is never used).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from cals_seg.errors import UserError
from cals_seg.runs.run import HISTORY_FILE, Run

PERCENTILES = (1.0, 5.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0)


def confidence_cap(margin: float, num_classes: int) -> float:
    """The largest top-label confidence with every logit gap ``<= margin``: all K - 1 other
    logits exactly ``margin`` below the top one."""
    return 1.0 / (1.0 + (num_classes - 1) * math.exp(-margin))


def _key(q: float) -> str:
    return f"{q:g}"


class GapHistogram:
    """Streaming histogram of non-negative values: bins of ``width`` on ``[0, hi)`` plus one
    overflow bin, with each bin's count, smallest and largest value, and the exact count and
    sum. O(hi / width) memory, whatever the number of values."""

    def __init__(self, width: float = 0.01, hi: float = 200.0) -> None:
        if not (width > 0 and hi > width):
            raise UserError(f"Expected 0 < bin width < histogram max, got {width} and {hi}.")
        self.width = float(width)
        self.nbins = math.ceil(hi / width)
        self.hi = self.nbins * self.width
        self.counts = torch.zeros(self.nbins + 1, dtype=torch.int64)
        self.bin_min = torch.full((self.nbins + 1,), math.inf, dtype=torch.float64)
        self.bin_max = torch.full((self.nbins + 1,), -math.inf, dtype=torch.float64)
        self.n, self.total = 0, 0.0

    min = property(lambda self: float(self.bin_min.min()))
    max = property(lambda self: float(self.bin_max.max()))

    def update(self, values: torch.Tensor) -> None:
        values = values.reshape(-1).double().cpu()
        if values.numel() == 0:
            return
        idx = torch.div(values, self.width).floor_().clamp_(0, self.nbins).long()
        self.counts += torch.bincount(idx, minlength=self.nbins + 1)
        self.bin_min.scatter_reduce_(0, idx, values, "amin")
        self.bin_max.scatter_reduce_(0, idx, values, "amax")
        self.n += values.numel()
        self.total += float(values.sum())

    def _order_statistic(self, i: int) -> tuple[float, bool]:
        """Estimate of the i-th smallest value (0-based): its bin's centre clipped to the
        smallest and largest value seen in that bin (exact when they are equal); True when it
        lies in the overflow bin (then only the bin's range bounds it)."""
        cum = torch.cumsum(self.counts, 0)
        b = int(torch.searchsorted(cum, torch.tensor([i]), right=True))
        lo, hi = float(self.bin_min[b]), float(self.bin_max[b])
        if b >= self.nbins:
            return lo, True
        return min(max((b + 0.5) * self.width, lo), hi), False

    def percentile(self, q: float) -> tuple[float, bool]:
        """The q-th percentile with numpy's default (linear) interpolation between order
        statistics, each estimated to within half a bin; True if it reaches the overflow bin."""
        if self.n == 0:
            return math.nan, False
        r = q / 100.0 * (self.n - 1)
        lo, hi = math.floor(r), math.ceil(r)
        (a, over_a), (b, over_b) = self._order_statistic(lo), self._order_statistic(hi)
        return a + (r - lo) * (b - a), over_a or over_b

    def summary(self, percentiles: tuple[float, ...]) -> dict[str, Any]:
        values = {_key(q): self.percentile(q) for q in percentiles}
        return {
            "count": self.n,
            "mean": self.total / self.n if self.n else math.nan,
            "min": self.min if self.n else math.nan,
            "max": self.max if self.n else math.nan,
            "percentiles": {k: v for k, (v, _) in values.items()},
            "overflow": [k for k, (_, over) in values.items() if over],
        }


@torch.no_grad()
def gap_statistics(
    batches, num_classes: int, ignore_index: int, margins: list[float],
    percentiles: tuple[float, ...] = PERCENTILES, bin_width: float = 0.01, hist_max: float = 200.0,
) -> dict[str, Any]:
    """Logit-gap statistics over the valid positions of ``(logits (N, K, *S), target (N, *S))``
    batches, streamed (the memory does not grow with the number of positions)."""
    largest_hist, all_hist = GapHistogram(bin_width, hist_max), GapHistogram(bin_width, hist_max)
    caps = [confidence_cap(m, num_classes) for m in margins]
    binding_pixels = [0] * len(margins)
    binding_gaps = [0] * len(margins)
    above_cap = [0] * len(margins)
    for logits, target in batches:
        n, k = logits.shape[:2]
        flat = logits.float().reshape(n, k, -1).transpose(1, 2).reshape(-1, k)
        flat = flat[target.reshape(-1) != ignore_index]
        gaps = flat.max(dim=1, keepdim=True).values - flat  # (P, K), >= 0
        largest = gaps.max(dim=1).values
        confidence = 1.0 / torch.exp(-gaps).sum(dim=1)
        largest_hist.update(largest)
        all_hist.update(gaps)
        for j, (m, cap) in enumerate(zip(margins, caps, strict=True)):
            binding_pixels[j] += int((largest > m).sum())
            binding_gaps[j] += int((gaps > m).sum())
            above_cap[j] += int((confidence > cap).sum())
    pixels = largest_hist.n
    if pixels == 0:
        raise UserError("the split has no valid pixel (every label is ignore_index)")
    return {
        "num_classes": num_classes,
        "pixels": pixels,
        "bin_width": bin_width,
        "largest_gap": largest_hist.summary(percentiles),
        "all_gaps": all_hist.summary(percentiles),
        "margins": [
            {
                "margin": m,
                "confidence_cap": cap,
                "pixels_binding": bp / pixels,
                "gaps_binding": bg / all_hist.n,
                "pixels_above_cap": ac / pixels,
            }
            for m, cap, bp, bg, ac in zip(
                margins, caps, binding_pixels, binding_gaps, above_cap, strict=True
            )
        ],
    }


def best_epoch_line(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The line of the best epoch: the last one marked ``"best": true``."""
    best = [h for h in history if h.get("best")]
    if not best:
        raise UserError(f"the run's {HISTORY_FILE} has no line marked best")
    return best[-1]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """Validation numbers of the best epoch and the test numbers of a finished run."""
    run = Run(run_dir)
    line = best_epoch_line(run.history())
    test = run.read_test_metrics()
    pre = test["pre_ts"]
    score_key = test.get("score_metric") or _score_metric(run_dir)
    return {
        "run": str(run_dir),
        "best_epoch": line["epoch"],
        "score_name": "mIoU" if score_key == "miou" else "acc",
        "val_ece": line["val_ece"],
        "val_score": line[f"val_{score_key}"],
        "test_ece": pre["ece"],
        "test_score": pre[score_key],
        "temperature": test.get("temperature"),
    }


def recommend(
    reference: dict[str, Any], candidates: list[dict[str, Any]], max_drop: float
) -> tuple[dict[str, Any] | None, str]:
    """The candidate with the lowest validation ECE among those whose validation score is at
    most ``max_drop`` points (percent) below the reference's; ties go to the higher score, then
    the order given. Returns (choice or None, reason)."""
    name = reference["score_name"]
    floor = 100 * reference["val_score"] - max_drop
    eligible = [c for c in candidates if 100 * c["val_score"] >= floor - 1e-9]
    if not eligible:
        return None, (
            f"no margin keeps the validation {name} within {max_drop:g} points of CE's "
            f"({100 * reference['val_score']:.2f}); try larger margins or a larger --max-miou-drop"
        )
    best = min(eligible, key=lambda c: (c["val_ece"], -c["val_score"]))
    reason = (
        f"lowest validation ECE ({100 * best['val_ece']:.2f}%) among the margins whose validation "
        f"{name} is within {max_drop:g} points of CE's {100 * reference['val_score']:.2f} "
        f"(eligible: {', '.join(format(c['margin'], 'g') for c in eligible)}; "
        f"m = {best['margin']:g}: {100 * best['val_score']:.2f})"
    )
    if best["val_ece"] >= reference["val_ece"]:
        reason += f"; it does not beat CE's validation ECE ({100 * reference['val_ece']:.2f}%)"
    return best, reason


def _score_metric(run_dir: Path) -> str:
    """The headline metric of a run written before test_metrics.json recorded it."""
    from cals_seg.tasks import score_metric

    return score_metric(Run(run_dir).read_config())
