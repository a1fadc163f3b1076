"""Is a network under-confident on its validation split, and what to do when it is.

A margin penalty (CALS-ALM, CALS-HR, MbLS) bounds the logit gaps, so it can only *lower*
confidence. A network that is already under-confident on held-out data cannot be helped by one;
a post-hoc calibrator fitted on the validation split can (temperature scaling with ``T < 1``
raises every confidence). The evidence is the interval of the validation temperature
(:mod:`cals_seg.losses.temperature_stats`, also what the ``margin: auto`` rule reads): the mean
calibration gap of the split (mean confidence minus accuracy) with its standard error, the image
being the sampling unit, turned into the temperatures ``T_lo <= T_hat <= T_hi`` whose mean
confidence equals the accuracy plus, exactly and minus ``z`` standard errors. Under-confident
means ``T_hi < 1``: the whole interval lies below 1::

    evidence = ValidationTemperature(num_classes, ignore_index)
    infer.evaluate(val_loader, [evidence])              # or any pass that sees (logits, target)
    t_hat, interval = evidence.compute()
    line = confidence_advice(t_hat, interval, run="runs/x")   # None unless interval[1] < 1

The statistics are O(bins) float64 sums (all-reduced under torch.distributed), so one pass over
the validation split of any size gives them; nothing is kept per pixel.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cals_seg.losses.temperature_stats import (
    IMAGE_SUM_KEYS,
    INTERVAL_Z,
    NUM_BINS,
    effective_margin_sums,
    gap_and_accuracy,
    image_sums,
    solve_temperature,
    temperature_interval,
)
from cals_seg.utils.distributed import all_reduce_sum_

# The key of test_metrics.json (and of an evaluation's metrics.json) that holds the record of
# :func:`under_confidence`; absent when the network is not under-confident.
KEY = "under_confident"
# The post-hoc calibrators suggested per task family: one temperature, and (segmentation) one per
# distance band of the predicted boundaries; eval_seg fits both and reports each.
CALIBRATORS = {"segmentation": ("ts", "boundary_ts")}


class ValidationTemperature:
    """A consumer of ``(logits (N, K, *S), target (N, *S))`` batches that accumulates the
    temperature statistics over the valid positions, and :meth:`compute` gives ``(T_hat, (T_lo,
    T_hi))``. Each row of a batch is one image (for classification: one sample). ``z``: the
    interval's half-width in standard errors (2, as the ``margin_z`` of ``margin: auto``);
    ``device``: where the sums live (the logits' device; under torch.distributed every rank's
    must be one the process group reduces on)."""

    def __init__(self, num_classes: int, ignore_index: int = -100, z: float = INTERVAL_Z,
                 device: torch.device | str | None = None) -> None:
        if num_classes < 2:
            raise ValueError(f"Expected num_classes >= 2, but got {num_classes}.")
        self.num_classes, self.ignore_index, self.z = num_classes, ignore_index, float(z)
        f64 = {"dtype": torch.float64, "device": device}
        self._hist = torch.zeros(NUM_BINS, **f64)
        self._correct = torch.zeros((), **f64)
        self._sums = torch.zeros(len(IMAGE_SUM_KEYS), **f64)

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor) -> None:
        n, k = logits.shape[:2]
        if k != self.num_classes:
            raise ValueError(f"Expected {self.num_classes} classes, but the logits have {k}.")
        x = logits.detach().float().reshape(n, k, -1)
        y = target.reshape(n, -1).long()
        valid = y != self.ignore_index
        hist, _, correct = effective_margin_sums(x, y, valid)
        sums, _ = image_sums(x, y, valid)
        dev = self._hist.device
        self._hist += hist.to(dev)
        self._correct += correct.to(dev)
        self._sums += sums.to(dev)

    def __call__(self, logits: Tensor, target: Tensor) -> None:
        self.update(logits, target)

    def compute(self) -> tuple[float, tuple[float, float]] | None:
        """``(T_hat, (T_lo, T_hi))`` over everything seen (summed over processes first), or None
        when no valid position was seen. The interval is ``(1/16, 16)`` (no evidence) with fewer
        than two images."""
        hist, correct, sums = self._hist.clone(), self._correct.clone(), self._sums.clone()
        all_reduce_sum_([hist, correct, sums])  # no-op on one process
        if float(hist.sum()) <= 0:
            return None
        _, gap_se, acc, _ = gap_and_accuracy(sums)
        t_hat = solve_temperature(hist, float(correct), self.num_classes)
        lo, hi = temperature_interval(hist, acc, gap_se, self.z, self.num_classes)
        return t_hat, (lo, hi)


def confidence_advice(temperature: float, interval: Sequence[float], run: str = "RUN",
                      family: str = "segmentation") -> str | None:
    """One line for a network whose validation temperature interval lies below 1
    (under-confident), None otherwise (the interval contains 1 or lies above it).

    Args:
        temperature: the validation temperature ``T_hat`` (printed).
        interval: ``(T_lo, T_hi)``; the line is given when ``T_hi < 1``.
        run: the run folder, for the command the line gives.
        family: the task family (``segmentation``: the command fits ``ts`` and ``boundary_ts``
            with ``tools/eval_seg.py``; otherwise temperature scaling, which training already fits
            on validation: the post-TS results).
    """
    lo, hi = (float(v) for v in interval)
    if not hi < 1.0:
        return None
    head = (f"under-confident on the validation split (T = {float(temperature):.2f}, interval "
            f"[{lo:.2f}, {hi:.2f}] below 1): a margin penalty (CALS-ALM, MbLS) only lowers "
            "confidence and cannot help; fit a post-hoc calibrator on validation instead: ")
    calibrators = CALIBRATORS.get(family)
    if calibrators is None:
        return head + ("temperature scaling (the run's post-TS results, fitted on "
                       "validation: `post_ts` of its test metrics)")
    return head + (f"python tools/eval_seg.py {shlex.quote(str(run))} --calibrators "
                   f"{' '.join(calibrators)}")


def under_confidence(temperature: float, interval: Sequence[float], run: str = "RUN",
                     family: str = "segmentation") -> dict[str, Any] | None:
    """The record written under :data:`KEY` in a metrics file: ``{"T", "T_interval", "advice"}``
    when :func:`confidence_advice` gives a line, else None."""
    advice = confidence_advice(temperature, interval, run, family)
    if advice is None:
        return None
    return {"T": float(temperature), "T_interval": [float(v) for v in interval],
            "advice": advice}


def measured_under_confidence(infer: Any, loader: Any, num_classes: int, ignore_index: int,
                              run: str = "RUN", family: str = "segmentation",
                              progress: bool = False) -> dict[str, Any] | None:
    """One pass of ``infer`` (a :class:`cals_seg.evaluation.stream.Inference`) over the
    validation ``loader`` into :class:`ValidationTemperature`; the :func:`under_confidence`
    record when the interval lies below 1, else None."""
    evidence = ValidationTemperature(num_classes, ignore_index, device=infer.device)
    infer.evaluate(loader, [evidence], progress, desc="val T")
    found = evidence.compute()
    return None if found is None else under_confidence(*found, run=run, family=family)


__all__ = ["CALIBRATORS", "KEY", "ValidationTemperature", "confidence_advice",
           "measured_under_confidence", "under_confidence"]
