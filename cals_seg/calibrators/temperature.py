"""Where :func:`fit_temperature` and :func:`nll_at_temperature` were defined: they live in
:mod:`cals_seg.calibrators.ts` now, with the ``ts`` calibrator they fit. This module only names
them again while ``cals_seg``'s public map (``cals_seg.fit_temperature``) points here."""

from cals_seg.calibrators.ts import fit_temperature, nll_at_temperature

__all__ = ["fit_temperature", "nll_at_temperature"]
