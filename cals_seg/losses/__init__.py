"""Training criteria: cross-entropy, the calibration baselines, and CALS-ALM / CALS-HR.

Every loss takes logits ``(N, K, *S)`` and targets ``(N, *S)``, excludes ``ignore_index``
positions from every mean and returns a scalar, so it is a drop-in for ``F.cross_entropy``.
"""

from __future__ import annotations

import inspect
from typing import Any

from ._base import SegLoss
from .cals import CALSALMLoss, CALSHRLoss
from .ce import CrossEntropyLoss
from .confidence_penalty import ConfidencePenaltyLoss
from .focal import FocalLoss, FocalLossSD
from .label_smoothing import LabelSmoothingLoss
from .mbls import MbLSLoss
from .penalties import PENALTIES, Penalty, get_penalty

LOSSES: dict[str, type[SegLoss]] = {
    "ce": CrossEntropyLoss,
    "ls": LabelSmoothingLoss,
    "fl": FocalLoss,
    "flsd": FocalLossSD,
    "ecp": ConfidencePenaltyLoss,
    "mbls": MbLSLoss,
    "cals_hr": CALSHRLoss,
    "cals_alm": CALSALMLoss,
}


def build_loss(name: str, num_classes: int, ignore_index: int = -100, **params: Any) -> SegLoss:
    """Create a loss by name, e.g. ``build_loss("cals_alm", 21, ignore_index=255, margin=10)``.

    Raises:
        ValueError: unknown name (the valid names are listed) or unknown parameter.
    """
    if name not in LOSSES:
        raise ValueError(f"Unknown loss {name!r}; valid names are {sorted(LOSSES)}.")
    cls = LOSSES[name]

    accepted = [
        p for p in inspect.signature(cls).parameters if p not in ("num_classes", "ignore_index")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"Unknown parameter(s) {unknown} for loss {name!r}; it takes {accepted}.")
    return cls(num_classes=num_classes, ignore_index=ignore_index, **params)


__all__ = [
    "LOSSES",
    "PENALTIES",
    "CALSALMLoss",
    "CALSHRLoss",
    "ConfidencePenaltyLoss",
    "CrossEntropyLoss",
    "FocalLoss",
    "FocalLossSD",
    "LabelSmoothingLoss",
    "MbLSLoss",
    "Penalty",
    "SegLoss",
    "build_loss",
    "get_penalty",
]
