"""Calibrators fitted under drift: each calibrator also fitted on the validation images
corrupted by :class:`cals_seg.data.corruptions.DriftMixture` (the held-out corruptions,
severities 0-5, none of the benchmark's), reported as ``NAME+drift`` beside ``NAME``
(``eval_seg --calibrator-fit-shift``, docs/shift.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cals_seg.calibrators import calibrator_key
from cals_seg.data.corruptions import DriftMixture, corrupted_dataset
from cals_seg.evaluation.engine import load_or_fit_calibrators
from cals_seg.utils.fits import FitStore

DRIFT_SUFFIX = "+drift"


def drift_calibrators(run: Any, names: Sequence[str], folder: Path, seed: int, *,
                      loader: Callable[[Any], Iterable], refit: bool = False,
                      params: Mapping[str, Mapping[str, Any]] | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({NAME+drift: calibrator}, {NAME+drift: fit summary})``: ``names`` fitted on the
    validation split under :class:`DriftMixture` (seeded by ``seed``), or loaded from
    ``folder/drift_s<seed>/NAME.pt`` (:meth:`~cals_seg.utils.fits.FitStore.drift`) when the
    record it holds (:func:`cals_seg.calibrators.calibrator_key`: the network by content,
    classes, ids, parameters, precision, protocol, and ``after`` the mixture with its seed) is
    this use's;
    refit otherwise (the reason printed), or always with ``refit``.

    Args:
        run: a loaded run with data (``task``, ``inference``, ``config``, ...).
        loader: a dataset -> its evaluation loader, in order.
        params: ``{NAME: constructor parameters}``.

    Returns:
        the calibrators and their fit summaries (each with ``fit_data``, the mixture and seed).
    """
    task, infer = run.task, run.inference
    mixture = DriftMixture(seed=seed)
    data = f"{mixture.key} seed {mixture.seed}"
    params = params or {}
    val_ids = getattr(task.val_set, "ids", None) or list(range(len(task.val_set)))
    keys = {name: calibrator_key(run, name, params.get(name, {}), val_ids, data=data,
                                 precision=infer.amp, protocol=infer.protocol)
            for name in names}
    cals, fits = load_or_fit_calibrators(
        names, FitStore(folder).drift(mixture.seed), task.num_classes, infer,
        loader(corrupted_dataset(task.val_set, mixture)), task.ignore_index, refit, params,
        keys=keys)
    fits = {k: {**v, "fit_data": data} for k, v in fits.items()}
    return ({f"{k}{DRIFT_SUFFIX}": v for k, v in cals.items()},
            {f"{k}{DRIFT_SUFFIX}": v for k, v in fits.items()})


__all__ = ["DRIFT_SUFFIX", "drift_calibrators"]
