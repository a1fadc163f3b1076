"""Margin rules: objects that move the margin of CALS-ALM or CALS-HR between epochs.

The paper's losses keep their margin fixed (``margin: 10``). A margin rule watches the
validation pass beside the loss and, after the multiplier update, puts the next margin in force
with ``criterion.set_margin``. Rules register by name in
:data:`~cals_seg.losses.registry.MARGIN_RULES`; a ``loss.params.margin`` that names one
(``margin: auto``) builds the loss at the rule's ``margin_init`` with the rule attached
(:func:`cals_seg.losses.build_loss`). The core registers none: ``auto``, the evidence rule, is
kept beside it in ``cals_seg.contrib.auto_margin`` (opt in with ``contrib: [auto_margin]`` in a
config, or ``import cals_seg.contrib.auto_margin``). A training loop drives the rule next to the
loss::

    criterion = build_loss("cals_alm", K, margin="auto")
    rule = criterion.margin_rule
    for epoch in range(epochs):
        train_one_epoch(model, criterion, ...)
        with torch.no_grad():
            for x, y in val_loader:
                logits = model(x)
                criterion.observe(logits, y)
                rule.observe(logits, y)
        stats = criterion.update_multipliers(epoch)
        stats |= rule.step(criterion, epoch)  # the margin of the next epoch, and why

Attached, the rule is a submodule of the loss (``criterion.margin_rule``): its state (the margin
in force, and what else it keeps) is saved by ``criterion.state_dict()`` under ``margin_rule.``
and restored by ``load_state_dict``, which puts the restored margin back in force.

Also here: the settings every rule shares (:class:`MarginSettings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from cals_seg.errors import UserError
from cals_seg.losses._class_adaptive import ClassAdaptiveLoss
from cals_seg.losses.registry import MARGIN_RULES
from cals_seg.utils.validation import check_int

MARGIN_RATE = 1.25  # default margin_rate: the margin moves by at most this factor per epoch
MARGIN_SKILL = 0.1  # default margin_skill: the skill above chance needed to move the margin
ATTRIBUTE = "margin_rule"  # where an attached rule lives on its loss (and in its state_dict)


def starting_margin(margin: object, margin_init: float) -> tuple[bool, float]:
    """``(auto, m0)``: whether ``margin`` is ``"auto"`` and the margin in force at the start
    (``margin_init`` with ``"auto"``; else ``margin``).

    Raises:
        ValueError: ``margin`` is neither a positive number nor ``"auto"``.
    """
    if margin == "auto":
        return True, float(margin_init)
    if isinstance(margin, str | bool) or not isinstance(margin, int | float):
        raise ValueError(f"Expected `margin` to be a number or 'auto', but got {margin!r}.")
    if not margin > 0:
        raise ValueError(f"Expected `margin` > 0, but got {margin}.")
    return False, float(margin)


@dataclass
class MarginSettings:
    """The settings of a margin rule (the keyword arguments of a :class:`MarginRule`, and of
    ``cals_alm_bands``; ``loss.params`` keys in a config), with their defaults: the start
    ``margin_init``, the range ``[margin_min, margin_max]``, the epochs ``margin_warmup``
    without a move, the largest factor ``margin_rate`` of one move (``inf``: none) and the
    validation skill above chance ``margin_skill`` below which the margin is kept."""

    margin_init: float = 10.0
    margin_min: float = 1.0
    margin_max: float = 20.0
    margin_warmup: int = 0
    margin_rate: float = MARGIN_RATE
    margin_skill: float = MARGIN_SKILL

    def check(self) -> None:
        """Raises:
            ValueError: not ``0 < margin_min <= margin_init <= margin_max``; ``margin_warmup``
                not an integer >= 0; ``margin_rate <= 1``; ``margin_skill`` outside ``[0, 1)``.
        """
        if not 0 < self.margin_min <= self.margin_init <= self.margin_max:
            raise ValueError("Expected 0 < margin_min <= margin_init <= margin_max, but got "
                             f"{self.margin_min}, {self.margin_init}, {self.margin_max}.")
        check_int("margin_warmup", self.margin_warmup, 0)
        if not self.margin_rate > 1:
            raise ValueError(
                "Expected `margin_rate` > 1 (the largest factor of one epoch's margin change; "
                f"inf for none), but got {self.margin_rate!r}."
            )
        if not 0 <= self.margin_skill < 1:
            raise ValueError(
                "Expected 0 <= `margin_skill` < 1 (the validation skill above chance needed to "
                f"move the margin), but got {self.margin_skill!r}."
            )

    def start(self, margin: object) -> tuple[bool, float]:
        """``(auto, m0)`` of :func:`starting_margin`, the settings checked when ``margin`` is
        ``"auto"`` (``cals_alm_bands``, whose margins move inside the loss)."""
        auto, m0 = starting_margin(margin, self.margin_init)
        if auto:
            self.check()
        return auto, m0

    def keep(self, owner: object) -> None:
        """Keep the settings on ``owner`` as attributes, ``margin_init`` aside: floats, and ints
        for ``margin_warmup`` and ``margin_patience``."""
        for name, value in vars(self).items():
            if name != "margin_init":
                whole = name in ("margin_warmup", "margin_patience")
                setattr(owner, name, value if whole else float(value))


class MarginRule(nn.Module):
    """Base of the rules that move a :class:`ClassAdaptiveLoss`'s margin between epochs.

    A subclass sets :attr:`settings_type` (a :class:`MarginSettings` dataclass: its fields are
    the rule's keyword arguments, checked here) and implements :meth:`observe` (one validation
    batch) and :meth:`step` (after ``criterion.update_multipliers``: the next margin, by
    ``criterion.set_margin``, and the history entries).

    Args:
        num_classes: K.
        ignore_index: the void label (never observed).
        **settings: the fields of :attr:`settings_type`, kept as attributes
            (:meth:`MarginSettings.keep`).

    Buffers (in ``state_dict``): ``margin``, the margin in force (0-dim float64).
    """

    settings_type: ClassVar[type[MarginSettings]] = MarginSettings
    log_keys: ClassVar[tuple[str, ...]] = ("margin",)

    def __init__(self, num_classes: int, ignore_index: int = -100, **settings: Any) -> None:
        super().__init__()
        unknown = sorted(set(settings) - set(self.settings_names()))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) "
                            f"{unknown}; it takes {self.settings_names()}.")
        chosen = self.settings_type(**settings)
        chosen.check()
        chosen.keep(self)
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self.register_buffer("margin", torch.tensor(float(chosen.margin_init),
                                                    dtype=torch.float64))

    @classmethod
    def settings_names(cls) -> list[str]:
        """The keyword arguments of the rule (the fields of :attr:`settings_type`)."""
        return [f.name for f in dataclasses.fields(cls.settings_type)]

    def observe(self, logits: Tensor, target: Tensor) -> None:
        """Accumulate one validation batch: logits ``(N, K, *S)``, target ``(N, *S)``."""
        raise NotImplementedError

    def step(self, criterion: ClassAdaptiveLoss, epoch: int) -> dict[str, Any]:
        """After ``criterion.update_multipliers(epoch)``: decide the margin of the next epoch,
        put it in force (``criterion.set_margin``), and return the history entries (keys among
        :attr:`log_keys`, and the criterion's multipliers as now in force)."""
        raise NotImplementedError

    def attach(self, loss: ClassAdaptiveLoss) -> ClassAdaptiveLoss:
        """Make the rule ``loss.margin_rule`` (a submodule: saved, loaded and moved with the
        loss), put its margin in force, and again after every ``loss.load_state_dict``.
        Returns ``loss``.

        Raises:
            TypeError: ``loss`` has no margin a rule can move (not CALS-ALM / CALS-HR).
        """
        if not isinstance(loss, ClassAdaptiveLoss):
            raise TypeError(f"A margin rule moves the margin of CALS-ALM or CALS-HR, not of "
                            f"{type(loss).__name__}.")
        loss.set_margin(float(self.margin), convert=False)
        loss.add_module(ATTRIBUTE, self)
        loss.register_load_state_dict_post_hook(_margin_back_in_force)
        return loss


def _margin_back_in_force(loss: nn.Module, incompatible: Any) -> None:
    """After ``loss.load_state_dict``: the restored margin of its rule is the margin in force
    (the multipliers were saved at that margin: nothing is converted)."""
    loss.set_margin(float(getattr(loss, ATTRIBUTE).margin), convert=False)


def margin_rule_of(criterion: nn.Module) -> MarginRule | None:
    """The rule attached to ``criterion`` (:meth:`MarginRule.attach`), or None."""
    rule = getattr(criterion, ATTRIBUTE, None)
    return rule if isinstance(rule, MarginRule) else None


def margin_rule_class(name: str) -> type[MarginRule]:
    """The rule registered as ``name`` (``loss.params.margin``).

    Raises:
        UserError: ``name`` is not registered: for a rule kept beside the core, how to opt in;
            otherwise the valid values.
    """
    if name in MARGIN_RULES:
        return MARGIN_RULES[name]
    hint = MARGIN_RULES.beside_hint(name)  # `auto`: the evidence rule, in cals_seg/contrib/
    if hint is not None:
        raise UserError(f"loss.params.margin: {hint}.")
    names = " or ".join(repr(n) for n in sorted({*MARGIN_RULES, *MARGIN_RULES.beside}))
    raise UserError(f"loss.params.margin: expected a number or {names}, got {name!r}.")


def split_rule_params(loss_cls: type, params: dict[str, Any]
                      ) -> tuple[type[MarginRule] | None, dict[str, Any], dict[str, Any]]:
    """``(rule class, the loss's params, the rule's settings)`` when ``params["margin"]`` is a
    name and ``loss_cls`` has a margin a rule can move (the loss's params then lack
    ``margin``); else ``(None, params, {})``.

    Raises:
        UserError: an unknown rule name (:func:`margin_rule_class`).
    """
    movable = isinstance(loss_cls, type) and issubclass(loss_cls, ClassAdaptiveLoss)
    if not (movable and isinstance(params.get("margin"), str)):
        return None, params, {}
    rule_cls = margin_rule_class(params["margin"])
    names = set(rule_cls.settings_names())
    return (rule_cls, {k: v for k, v in params.items() if k != "margin" and k not in names},
            {k: v for k, v in params.items() if k in names})


__all__ = [
    "MARGIN_RULES",
    "MarginRule",
    "MarginSettings",
    "margin_rule_class",
    "margin_rule_of",
    "split_rule_params",
    "starting_margin",
]
