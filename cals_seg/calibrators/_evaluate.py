"""Fit calibrators on validation and evaluate them on test in one pass of the network."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ._base import Calibrator

# Meters that only read the argmax: fed the raw logits when the calibrator cannot change it, so
# that their numbers (mIoU, accuracies) are bit-identical to the uncalibrated ones.
ARGMAX_METERS = ("segmentation",)


class Calibrated:
    """Meters fed a calibrator's output: ``update(logits, target, image)`` calls
    ``calibrator(logits, image)`` once and feeds every meter; when the calibrator cannot change
    the argmax, the meters named in ``argmax_meters`` get the raw logits instead.

    Args:
        calibrator: a fitted calibrator (in eval mode).
        meters: ``{name: meter}`` with ``update(logits, target)``.
        argmax_meters: names of the meters that only read the argmax.
    """

    def __init__(self, calibrator: Calibrator, meters: Mapping[str, Any],
                 argmax_meters: Sequence[str] = ARGMAX_METERS) -> None:
        self.calibrator = calibrator
        self.meters = dict(meters)
        self.raw = set() if calibrator.changes_argmax else set(argmax_meters)

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor, image: Tensor | None = None) -> None:
        calibrated = self.calibrator(logits, image if self.calibrator.needs_image else None)
        for name, meter in self.meters.items():
            meter.update(logits if name in self.raw else calibrated, target)


def fit_calibrators(
    calibrators: Mapping[str, Calibrator],
    model: nn.Module,
    val_loader: DataLoader,
    device: torch.device,
    ignore_index: int,
    amp: str = "none",
    protocol: Any = None,
) -> dict[str, dict[str, Any]]:
    """Fit each calibrator on ``model``'s logits over ``val_loader`` (re-running the model for
    every pass; nothing is cached); returns ``{name: fit_info}``. The test split is never
    involved."""
    from cals_seg.evaluation import predict

    def batches():
        return predict(model, val_loader, device, amp, protocol=protocol, with_inputs=True)

    out = {}
    for name, calibrator in calibrators.items():
        calibrator.to(device)
        out[name] = calibrator.fit(batches, ignore_index=ignore_index)
        calibrator.eval()
    return out


def evaluate_calibrators(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    calibrators: Mapping[str, Calibrator],
    meters: Callable[[], Mapping[str, Any]],
    amp: str = "none",
    protocol: Any = None,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Metrics of the raw logits and of every calibrator, from ONE pass over ``loader``.

    Args:
        model: the network.
        loader: the split to evaluate (the test split).
        device: where the model and meters run.
        calibrators: ``{name: fitted calibrator}``.
        meters: returns a fresh ``{name: meter}`` set (e.g. ``lambda: task.meters(15,
            test=True)``: pooled, per-band and per-size metrics); one set per calibrator.
        amp, protocol, progress: as :func:`cals_seg.evaluation.predict`.

    Returns:
        ``{"uncalibrated": metrics, name: metrics, ...}``, each the merged ``compute()`` dicts
        of one meter set.
    """
    from cals_seg.evaluation import compute, evaluate

    raw = {k: m.to(device) for k, m in meters().items()}
    sets = {name: {k: m.to(device) for k, m in meters().items()} for name in calibrators}
    consumers = [Calibrated(c.to(device).eval(), sets[name]) for name, c in calibrators.items()]
    evaluate(model, loader, device, list(raw.values()), amp, progress, desc="test",
             protocol=protocol, image_consumers=consumers)
    out = {"uncalibrated": compute(raw)}
    out.update({name: compute(s) for name, s in sets.items()})
    return out
