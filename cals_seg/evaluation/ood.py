"""Images far from the validation data: a flag on the mean predictive entropy.

An image is flagged when its mean predictive entropy (over all its pixels, in nats, of the
calibrated probabilities) is above the ``q``-quantile (default 0.99) of the same statistic over
the validation images. ``predict_seg`` warns on such an image; ``eval_seg --shift`` reports the
fraction flagged on the clean and on each corrupted split (docs/shift.md)::

    ref = MeanEntropy(temperature=T)
    evaluate(model, val_loader, device, [], image_consumers=[ref])
    limit = entropy_limit(ref.values)                       # 99th percentile

``predict_seg``'s limit is saved with what it was computed for (:func:`entropy_reference`:
``<run>/calibrators/entropy_p99_<T or calibrator>.json``), reused only for that.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from cals_seg.calibrators import network_digest
from cals_seg.errors import UserError
from cals_seg.evaluation.fit_records import is_int, is_number, read_checked_json
from cals_seg.evaluation.inference import predict_image
from cals_seg.utils.distributed import gather_lists
from cals_seg.utils.fits import FitKey, file_digest, ids_digest, protocol_record
from cals_seg.utils.io import write_json

QUANTILE = 0.99


def image_mean_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean over each image's pixels of ``-sum_k p_k log p_k``, ``p = softmax(logits / T)``.

    Shape:
        ``logits (N, K, H, W)`` -> ``(N,)`` float64.
    """
    log_p = torch.log_softmax(logits.double() / temperature, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1).flatten(1).mean(dim=1)


class MeanEntropy:
    """An image consumer (``update(logits, target, inputs)``) collecting each image's mean
    predictive entropy at temperature ``T`` in ``values``."""

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = float(temperature)
        self.values: list[float] = []

    def update(self, logits: Tensor, target: Tensor | None = None, inputs: Tensor | None = None
               ) -> None:
        self.values.extend(image_mean_entropy(logits, self.temperature).tolist())

    def all_values(self) -> list[float]:
        """The values of every rank's images (under torch.distributed each rank saw a shard;
        a collective call), else :attr:`values`."""
        return gather_lists(self.values)


def entropy_limit(values: Sequence[float], quantile: float = QUANTILE) -> float:
    """The ``quantile`` of the validation images' mean entropies (linear interpolation).

    Raises:
        ValueError: no values, or a quantile outside (0, 1).
    """
    if not values:
        raise ValueError("entropy_limit: no validation images.")
    if not 0 < quantile < 1:
        raise ValueError(f"entropy_limit: quantile must be in (0, 1), got {quantile}.")
    return float(np.quantile(np.asarray(values, np.float64), quantile))


def flagged_rate(values: Sequence[float], limit: float) -> float:
    """Fraction of the images whose mean entropy is above ``limit``."""
    return float(np.mean(np.asarray(values) > limit)) if len(values) else 0.0



# --------------------------------------------------------------------------------------------
# The saved reference of predict_seg: the validation images' limit, with what it is for.
# --------------------------------------------------------------------------------------------


def read_entropy(path: Path, fix: str) -> dict[str, Any]:
    """The entropy reference saved at ``path``, validated: a JSON object with ``quantile`` in
    (0, 1), a finite ``limit_nats >= 0``, ``images >= 1``, a ``calibration`` string and a
    ``fitted_for`` object.

    Raises:
        UserError: one line naming the file, what is wrong and ``fix``.
    """
    checks = {
        "quantile": (lambda v: is_number(v) and 0 < v < 1, "a number in (0, 1)"),
        "limit_nats": (lambda v: is_number(v) and v >= 0, "a finite number >= 0"),
        "images": (lambda v: is_int(v) and v >= 1, "an integer >= 1"),
        "calibration": (lambda v: isinstance(v, str), "a string"),
        "fitted_for": (lambda v: isinstance(v, dict), "an object"),
    }
    return read_checked_json(path, fix, "an entropy reference", "entropy reference", checks,
                             error_detail=False)


def entropy_key(run: Any, how: str, calibrator_file: Path | None, quantile: float,
                val_ids: Sequence[Any] | None) -> FitKey:
    """What an entropy reference is for: the network (by content), classes, the validation
    ids (unknown when they cannot be read), ``name`` the calibration (T or calibrator),
    ``params`` the quantile, the precision and protocol, and ``after`` the calibrator file's
    digest."""
    names = list(run.class_names)
    return FitKey(
        "entropy", how, network_digest(run), {"num_classes": len(names), "names": names},
        split="val", ids=ids_digest(val_ids) if val_ids is not None else None,
        params={"quantile": quantile}, precision=run.precision,
        protocol=protocol_record(run.protocol),
        after={"calibrator_file": file_digest(calibrator_file) if calibrator_file else None},
        unknown=("ids",) if val_ids is None else ())


def entropy_reference(run: Any, temperature: float, calibrator_name: str | None,
                      calibrator: Any, val: Any | None, unreadable: str | None
                      ) -> dict[str, Any] | None:
    """The validation images' mean-entropy limit for ``predict_seg``: read from
    ``<run>/calibrators/entropy_p99_<T or calibrator>.json`` when the record it holds
    (:func:`entropy_key`) is this use's, else computed over ``val`` (the validation split)
    with the same calibration and saved; ``None`` (with a warning) when there is no file and
    the validation images cannot be read (``val`` None, ``unreadable`` saying why).

    Args:
        run: a loaded run (``model``, ``path``, ``run.calibrator_file``, ``protocol``,
            ``precision``, ``checkpoint``, ``class_names``).

    Returns:
        ``{"quantile", "limit_nats", "images", "calibration", "torch", "fitted_for"}``, or
        None.

    Raises:
        UserError: a file that is not a valid reference (:func:`read_entropy`) or one fitted
            for something else, while the validation images cannot be read to recompute it (a
            damaged file is recomputed, with a notice, when they can), or
            validation images whose mean entropy is not finite.
    """
    how = f"calibrator-{calibrator_name}" if calibrator_name else f"T{temperature:.4f}"
    path = run.fits.entropy(QUANTILE, how)
    cal_file = run.fits.calibrator(calibrator_name) if calibrator_name else None
    fix = (f"delete it to have it recomputed from the validation images of {run.path}, or "
           "give --no-ood-check")
    val_ids = None if val is None else getattr(val, "ids", None) or list(range(len(val)))
    if path.is_file():
        try:
            info = read_entropy(path, fix)
        except UserError as err:  # damaged: recomputed from the validation images when readable
            if val is None:
                raise
            reason = str(err).removeprefix(f"{path}: ").split("; ")[0]
        else:
            # without the data the ids cannot be checked: taken as saved
            reason = entropy_key(run, how, cal_file, QUANTILE,
                                 None if val is None else val_ids).mismatch(info["fitted_for"])
            if reason is None:
                return info
        if val is None:
            raise UserError(f"{path}: {reason}, and the validation images cannot be read to "
                            f"recompute it ({unreadable}); {fix}.")
        print(f"{path.name}: {reason}; recomputing it on the validation images.", flush=True)
    elif val is None:
        print(f"warning: no far-from-validation check: the validation images of {run.path} "
              f"could not be read ({unreadable}).", file=sys.stderr, flush=True)
        return None
    try:
        values = []
        for i in range(len(val)):
            pred = predict_image(run.model, val[i]["image"][None], temperature, run.protocol,
                                 run.precision, calibrator=calibrator)
            values.append(float(pred.entropy[0].double().mean()))
        limit = entropy_limit(values, QUANTILE)
    except (OSError, UserError, ValueError) as err:
        print(f"warning: no far-from-validation check: the validation images of {run.path} "
              f"could not be read ({str(err).splitlines()[0]}).", file=sys.stderr, flush=True)
        return None
    if not math.isfinite(limit):
        raise UserError(f"the validation images of {run.path} give a mean predictive entropy "
                        f"of {limit} (the network's outputs are not finite); check the network, "
                        "or give --no-ood-check.")
    info = {"quantile": QUANTILE, "limit_nats": limit, "images": len(values), "calibration": how,
            "torch": torch.__version__,
            "fitted_for": entropy_key(run, how, cal_file, QUANTILE, val_ids).record()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, info)
    return info


__all__ = ["QUANTILE", "MeanEntropy", "entropy_limit", "entropy_key",
           "entropy_reference", "flagged_rate", "image_mean_entropy", "read_entropy"]
