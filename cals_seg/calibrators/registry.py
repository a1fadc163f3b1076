"""``CALIBRATORS``: the registry of post-hoc calibrators by name, declared here once.

Each calibrator registers itself where its class is defined::

    from cals_seg.calibrators._base import Calibrator
    from cals_seg.calibrators.registry import CALIBRATORS

    @CALIBRATORS.register("ts")
    class TemperatureScaling(Calibrator):
        name = "ts"
        ...

A new calibrator is one new file in ``cals_seg/calibrators/``: the registry imports every
module of the package the first time its names are read (``discover``), after the built-ins,
which ``cals_seg/calibrators/__init__.py`` imports in their listed order (the order of the
docs' tables and of the tools' choices). This module imports nothing of the package, so a
calibrator module importing it never runs into an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cals_seg.errors import UserError
from cals_seg.utils.registry import Registry

if TYPE_CHECKING:
    from cals_seg.calibrators._base import Calibrator

# Calibrators kept beside the core: name -> the module of cals_seg/contrib/ that registers it.
CALIBRATORS: Registry[type[Calibrator]] = Registry(
    "calibrator", error=UserError, discover="cals_seg.calibrators",
    beside={"boundary_ts_conf": "boundary_conf_ts"})

__all__ = ["CALIBRATORS"]
