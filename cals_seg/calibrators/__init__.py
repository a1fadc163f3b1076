"""Post-hoc calibrators: fitted on the validation split, applied to a trained network's logits.

Every calibrator is a :class:`Calibrator` (an ``nn.Module``): ``fit(batches, ignore_index)``
streams over validation batches, ``forward(logits, image=None)`` returns calibrated logits of
the same shape. ``changes_argmax`` says whether the calibrated prediction can differ from the
network's; ``needs_image`` whether ``forward`` needs the image.

    ========== =================================================== ============== ===========
    name       what                                                changes argmax needs image
    ========== =================================================== ============== ===========
    ts         one temperature                                     no             no
    vector     a scale and a bias per class                        yes            no
    dirichlet  matrix on log-probabilities, ODIR regularisation    yes            no
    lts        a temperature per pixel from a small conv net       no             yes
    selective  large temperature on pixels flagged as mispredicted no             no
    boundary_ts a temperature per predicted-boundary distance band no             no
    boundary_ts_fine boundary_ts, bands chosen on held-out val     no             no
    boundary_ts_conf a temperature per (band, confidence bin) cell  no             no
    cms_ap     per-argmax-class affine map on gaps to the top      no             no
    cms_op     per-argmax-class affine map on consecutive gaps     no (no order)  no
    ========== =================================================== ============== ===========

Example::

    cal = build_calibrator("boundary_ts", num_classes=21)
    cal.fit(lambda: ((model(x), y) for x, y in val_loader), ignore_index=255)
    probs = cal(model(x)).softmax(dim=1)
    save_calibrator(cal, "runs/my_run/calibrators/boundary_ts.pt")
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import torch

from cals_seg.calibrators._base import Batches, Calibrator
from cals_seg.calibrators._evaluate import (
    TABLE_COLUMNS,
    Calibrated,
    calibration_table,
    evaluate_calibrators,
    fit_calibrators,
    load_or_fit_calibrators,
    table_values,
)
from cals_seg.calibrators.boundary_conf_ts import BoundaryConfidenceTemperatureScaling
from cals_seg.calibrators.boundary_ts import BoundaryTemperatureScaling
from cals_seg.calibrators.boundary_ts_fine import FineBoundaryTemperatureScaling
from cals_seg.calibrators.dirichlet import DirichletCalibration
from cals_seg.calibrators.lts import LocalTemperatureScaling
from cals_seg.calibrators.order_keeping import ArgmaxKeepingScaling, OrderKeepingScaling
from cals_seg.calibrators.selective import SelectiveScaling
from cals_seg.calibrators.ts import TemperatureScaling
from cals_seg.calibrators.vector import VectorScaling
from cals_seg.errors import MissingPathError, UserError
from cals_seg.utils.registry import Registry

CALIBRATORS: Registry[type[Calibrator]] = Registry("calibrator")
for _cls in (TemperatureScaling, VectorScaling, DirichletCalibration, LocalTemperatureScaling,
             SelectiveScaling, BoundaryTemperatureScaling, ArgmaxKeepingScaling,
             OrderKeepingScaling, FineBoundaryTemperatureScaling,
             BoundaryConfidenceTemperatureScaling):
    CALIBRATORS.register(_cls.name, _cls)


def build_calibrator(name: str, num_classes: int, **params: Any) -> Calibrator:
    """A new (identity) calibrator by name, e.g. ``build_calibrator("dirichlet", 21, lam=0.01)``.

    Raises:
        ValueError: unknown name or parameter (the valid ones are listed), or a bad value.
    """
    cls = CALIBRATORS.lookup(name)
    valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self",
                                                                                "num_classes")]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise UserError(
            f"Unknown parameter(s) {unknown} for calibrator {name!r}; valid ones are {valid}."
        )
    return cls(num_classes, **params)


def save_calibrator(calibrator: Calibrator, path: str | Path) -> Path:
    """Write ``{"name", "num_classes", "params", "fit_info", "state"}`` (tensors and plain
    types only, readable with ``torch.load(weights_only=True)``) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in calibrator.state_dict().items()}
    torch.save({"name": calibrator.name, "num_classes": calibrator.num_classes,
                "params": dict(calibrator.params), "fit_info": _plain(calibrator.fit_info),
                "state": state}, path)
    return path


def load_calibrator(path: str | Path, map_location: str | torch.device = "cpu") -> Calibrator:
    """The calibrator saved by :func:`save_calibrator` at ``path``.

    Raises:
        FileNotFoundError / ValueError: no such file, or not a saved calibrator.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"{path}: no such calibrator file.")
    try:
        saved = torch.load(path, map_location=map_location, weights_only=True)
        cal = build_calibrator(saved["name"], saved["num_classes"], **saved["params"])
        cal.load_state_dict(saved["state"])
    except (KeyError, TypeError, RuntimeError, ValueError, EOFError, OSError,
            pickle.UnpicklingError) as err:  # truncated, unreadable, not a calibrator
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise UserError(f"{path} is not a saved calibrator ({reason}); refit it "
                        "(tools/eval_seg.py RUN --calibrators NAME --refit-calibrators).") from None
    cal.fit_info = saved.get("fit_info", {})
    return cal.to(map_location).eval()


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return obj


__all__ = [
    "CALIBRATORS",
    "TABLE_COLUMNS",
    "Batches",
    "ArgmaxKeepingScaling",
    "BoundaryConfidenceTemperatureScaling",
    "BoundaryTemperatureScaling",
    "Calibrated",
    "Calibrator",
    "DirichletCalibration",
    "FineBoundaryTemperatureScaling",
    "LocalTemperatureScaling",
    "OrderKeepingScaling",
    "SelectiveScaling",
    "TemperatureScaling",
    "VectorScaling",
    "build_calibrator",
    "calibration_table",
    "evaluate_calibrators",
    "fit_calibrators",
    "load_calibrator",
    "load_or_fit_calibrators",
    "save_calibrator",
    "table_values",
]
