"""``LOSSES``: the registry of training criteria by ``loss.name``, and ``MARGIN_RULES``: the rules
that move the margin of CALS-ALM / CALS-HR between epochs, by the name ``loss.params.margin``
gives in place of a number (:mod:`cals_seg.losses.margin_rules`); declared here once.

Each loss registers itself where its class is defined::

    from cals_seg.losses.registry import LOSSES

    @LOSSES.register("ce")
    class CrossEntropyLoss(SegLoss): ...

A new loss is one new file in ``cals_seg/losses/``: the registry imports every module of the
package the first time its names are read (``discover``), after the built-ins, which
``cals_seg/losses/__init__.py`` imports in their listed order (the order of the docs' tables and
of the tools' choices). This module imports nothing of the package, so a loss module importing
it never runs into an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cals_seg.errors import UserError
from cals_seg.utils.registry import Registry

if TYPE_CHECKING:
    from cals_seg.losses._base import SegLoss

# Losses kept beside the core: name -> the module of cals_seg/contrib/ that registers it.
LOSSES: Registry[type[SegLoss]] = Registry("loss", error=UserError, discover="cals_seg.losses",
                                           beside={"cals_alm_bands": "cals_bands"})
MARGIN_RULES: Registry[type] = Registry("margin rule", error=UserError,
                                            beside={"auto": "auto_margin"})  # MarginRule types

__all__ = ["LOSSES", "MARGIN_RULES"]
