"""Training criteria: cross-entropy, the calibration baselines, CALS-ALM / CALS-HR, and the
spatial losses SVLS, NACL and CRaC (the region-adaptive CALS-ALM, ``cals_alm_bands``, is the
opt-in contrib module ``cals_bands``).

Every loss takes logits ``(N, K, *S)`` and targets ``(N, *S)``, excludes ``ignore_index``
positions from every mean and returns a scalar, so it is a drop-in for ``F.cross_entropy``
(the spatial losses need ``(N, K, H, W)`` and refuse other shapes). Like ``F.cross_entropy``
it raises at the call on a target outside ``[0, K)`` that is not ``ignore_index``, without a
host synchronisation on an accelerator (:func:`cals_seg.losses._base.assert_labels`).
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Any

from cals_seg.losses._adaptive import AdaptiveLoss
from cals_seg.losses._base import SegLoss, bad_labels_message
from cals_seg.losses.margin_rules import split_rule_params
from cals_seg.losses.penalties import PENALTIES, Penalty, get_penalty
from cals_seg.losses.registry import LOSSES

# The built-in losses register themselves in this order (that of the docs' tables and the
# tools' choices); a new file in this folder registers itself after them (LOSSES discovers it).
# isort: off
from cals_seg.losses.ce import CrossEntropyLoss
from cals_seg.losses.label_smoothing import LabelSmoothingLoss
from cals_seg.losses.focal import FocalLoss, FocalLossSD
from cals_seg.losses.confidence_penalty import ConfidencePenaltyLoss
from cals_seg.losses.mbls import MbLSLoss
from cals_seg.losses.cals import CALSALMLoss, CALSHRLoss
from cals_seg.losses.svls import SVLSLoss
from cals_seg.losses.nacl import NACLLoss
from cals_seg.losses.crac import CRaCLoss
# isort: on


def build_loss(name: str, num_classes: int, ignore_index: int = -100, **params: Any) -> SegLoss:
    """Create a loss by name, e.g. ``build_loss("cals_alm", 21, ignore_index=255, margin=10)``.

    Args:
        name: a registered loss name (:data:`LOSSES`).
        num_classes: K.
        ignore_index: the void label, excluded from every mean.
        **params: the loss's keyword arguments (checked against its signature and types). For
            CALS-ALM / CALS-HR, ``margin`` may name a registered margin rule
            (:mod:`cals_seg.losses.margin_rules`; ``"auto"`` once its module is imported) and
            the ``margin_*`` keys are then its settings.

    Returns:
        The loss module; with a margin rule, built at the rule's ``margin_init`` with the rule
        attached as ``loss.margin_rule``.

    Raises:
        ValueError: unknown name (the valid names are listed) or unknown parameter.
    """
    cls = LOSSES.lookup(name)
    rule_cls, params, rule_params = split_rule_params(cls, params)  # margin: auto
    if rule_cls is not None:
        rule_hints = typing.get_type_hints(rule_cls.settings_type)
        for key, value in rule_params.items():
            _check_number(value, rule_hints.get(key), f"loss.params.{key}")
        rule = rule_cls(num_classes, ignore_index=ignore_index, **rule_params)
        params["margin"] = float(rule.margin)

    accepted = [
        p for p in inspect.signature(cls).parameters if p not in ("num_classes", "ignore_index")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"Unknown parameter(s) {unknown} for loss {name!r}; it takes {accepted}.")
    hints = typing.get_type_hints(cls.__init__)
    for settings_type in getattr(cls, "settings_types", ()):  # keywords declared by dataclasses
        hints.update(typing.get_type_hints(settings_type))
    for key, value in params.items():
        _check_number(value, hints.get(key), f"loss.params.{key}")
    loss = cls(num_classes=num_classes, ignore_index=ignore_index, **params)
    return loss if rule_cls is None else rule.attach(loss)


def _check_number(value: Any, hint: Any, key: str) -> None:
    """Numeric parameters must be numbers: ``margin: ten`` is a message, not a TypeError deep
    inside the loss."""
    if typing.get_origin(hint) in (collections.abc.Sequence, list, tuple):  # bands: [3, 8]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{key}: expected a list of numbers, got {value!r}.")
        for item in value:
            _check_number(item, typing.get_args(hint)[0], key)
        return
    options = set(typing.get_args(hint)) or {hint}
    if value is None and type(None) in options:
        return
    words = [o for o in options if typing.get_origin(o) is typing.Literal]  # margin: "auto"
    allowed = {w for o in words for w in typing.get_args(o)}
    if isinstance(value, str) and value in allowed:
        return
    options -= set(words)
    if options & {float, int} and not options - {float, int, type(None)}:
        wanted = float if float in options else int
        if isinstance(value, bool) or not isinstance(value, int | float) or (
            wanted is int and not isinstance(value, int)
        ):
            also = "".join(f" or {w!r}" for w in sorted(allowed))
            raise ValueError(f"{key}: expected {'a number' if wanted is float else 'an integer'}"
                             f"{also}, got {value!r}.")
    elif hint is bool and not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}.")


__all__ = [
    "bad_labels_message",
    "LOSSES",
    "AdaptiveLoss",
    "PENALTIES",
    "CALSALMLoss",
    "CALSHRLoss",
    "ConfidencePenaltyLoss",
    "CRaCLoss",
    "CrossEntropyLoss",
    "FocalLoss",
    "FocalLossSD",
    "LabelSmoothingLoss",
    "MbLSLoss",
    "NACLLoss",
    "Penalty",
    "SegLoss",
    "SVLSLoss",
    "build_loss",
    "get_penalty",
]
