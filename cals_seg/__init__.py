"""cals_seg: calibrated semantic segmentation with CALS-ALM (Class Adaptive Network Calibration).

The public API, for use in any PyTorch training loop::

    from cals_seg import build_loss, CalibrationMeter, SegmentationMeter  # train and measure
    from cals_seg import build_calibrator, save_calibrator, load_calibrator  # post-hoc
    from cals_seg import ConformalSets  # prediction sets with a coverage guarantee
    from cals_seg import load_run, predict_image  # a trained run; calibrated maps of images

A calibrator is built by name (``build_calibrator("ts", K)``), fitted on validation batches
(``cal.fit(batches)``), saved and loaded (``save_calibrator`` / ``load_calibrator``).
``TemperatureScaler`` (a fixed temperature) is a deprecated alias of
``TemperatureScaling.fixed``; ``BandCALSALMLoss`` is a deprecated name of the opt-in contrib
module ``cals_bands``'s loss (its access opts in, with a warning).

Names are imported on first access, so ``import cals_seg`` is cheap (it does not even import
torch) and never pulls in the optional heavy dependencies of the tools (matplotlib,
albumentations, segmentation-models-pytorch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> submodule that defines it: the one listing of the public names (``__all__`` is
# derived from it; tests/test_doc_counts.py checks that the TYPE_CHECKING imports below, which
# static analysers need written out, name the same objects from the same modules).
_EXPORTS = {
    "LOSSES": "cals_seg.losses",
    "build_loss": "cals_seg.losses",
    "SegLoss": "cals_seg.losses",
    "CrossEntropyLoss": "cals_seg.losses",
    "LabelSmoothingLoss": "cals_seg.losses",
    "FocalLoss": "cals_seg.losses",
    "FocalLossSD": "cals_seg.losses",
    "ConfidencePenaltyLoss": "cals_seg.losses",
    "MbLSLoss": "cals_seg.losses",
    "CALSHRLoss": "cals_seg.losses",
    "CALSALMLoss": "cals_seg.losses",
    "SVLSLoss": "cals_seg.losses",
    "NACLLoss": "cals_seg.losses",
    "CRaCLoss": "cals_seg.losses",
    "CalibrationMeter": "cals_seg.metrics",
    "SegmentationMeter": "cals_seg.metrics",
    "ShotGroupMeter": "cals_seg.metrics",
    "resolve_amp": "cals_seg.utils.precision",
    "CALIBRATORS": "cals_seg.calibrators",
    "Calibrator": "cals_seg.calibrators",
    "build_calibrator": "cals_seg.calibrators",
    "save_calibrator": "cals_seg.calibrators",
    "load_calibrator": "cals_seg.calibrators",
    "TemperatureScaling": "cals_seg.calibrators.ts",
    "fit_temperature": "cals_seg.calibrators.ts",
    "nll_at_temperature": "cals_seg.calibrators.ts",
    "TemperatureScaler": "cals_seg.calibrators.ts",
    "ConformalSets": "cals_seg.evaluation.conformal",
    "load_run": "cals_seg.runs.run",
    "EvalProtocol": "cals_seg.evaluation.inference",
    "Prediction": "cals_seg.evaluation.inference",
    "predict_image": "cals_seg.evaluation.inference",
    "segment_logits": "cals_seg.evaluation.inference",
    "calibrated_outputs": "cals_seg.evaluation.inference",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # static analysers and IDEs see the real objects, re-exported (`as`); the
    # same pairs as _EXPORTS (tests/test_doc_counts.py)
    from cals_seg.calibrators import (
        CALIBRATORS as CALIBRATORS,
    )
    from cals_seg.calibrators import (
        Calibrator as Calibrator,
    )
    from cals_seg.calibrators import (
        build_calibrator as build_calibrator,
    )
    from cals_seg.calibrators import (
        load_calibrator as load_calibrator,
    )
    from cals_seg.calibrators import (
        save_calibrator as save_calibrator,
    )
    from cals_seg.calibrators.ts import (
        TemperatureScaler as TemperatureScaler,
    )
    from cals_seg.calibrators.ts import (
        TemperatureScaling as TemperatureScaling,
    )
    from cals_seg.calibrators.ts import (
        fit_temperature as fit_temperature,
    )
    from cals_seg.calibrators.ts import (
        nll_at_temperature as nll_at_temperature,
    )
    from cals_seg.evaluation.conformal import (
        ConformalSets as ConformalSets,
    )
    from cals_seg.evaluation.inference import (
        EvalProtocol as EvalProtocol,
    )
    from cals_seg.evaluation.inference import (
        Prediction as Prediction,
    )
    from cals_seg.evaluation.inference import (
        calibrated_outputs as calibrated_outputs,
    )
    from cals_seg.evaluation.inference import (
        predict_image as predict_image,
    )
    from cals_seg.evaluation.inference import (
        segment_logits as segment_logits,
    )
    from cals_seg.losses import (
        LOSSES as LOSSES,
    )
    from cals_seg.losses import (
        CALSALMLoss as CALSALMLoss,
    )
    from cals_seg.losses import (
        CALSHRLoss as CALSHRLoss,
    )
    from cals_seg.losses import (
        ConfidencePenaltyLoss as ConfidencePenaltyLoss,
    )
    from cals_seg.losses import (
        CRaCLoss as CRaCLoss,
    )
    from cals_seg.losses import (
        CrossEntropyLoss as CrossEntropyLoss,
    )
    from cals_seg.losses import (
        FocalLoss as FocalLoss,
    )
    from cals_seg.losses import (
        FocalLossSD as FocalLossSD,
    )
    from cals_seg.losses import (
        LabelSmoothingLoss as LabelSmoothingLoss,
    )
    from cals_seg.losses import (
        MbLSLoss as MbLSLoss,
    )
    from cals_seg.losses import (
        NACLLoss as NACLLoss,
    )
    from cals_seg.losses import (
        SegLoss as SegLoss,
    )
    from cals_seg.losses import (
        SVLSLoss as SVLSLoss,
    )
    from cals_seg.losses import (
        build_loss as build_loss,
    )
    from cals_seg.metrics import (
        CalibrationMeter as CalibrationMeter,
    )
    from cals_seg.metrics import (
        SegmentationMeter as SegmentationMeter,
    )
    from cals_seg.metrics import (
        ShotGroupMeter as ShotGroupMeter,
    )
    from cals_seg.runs.run import (
        load_run as load_run,
    )
    from cals_seg.utils.precision import (
        resolve_amp as resolve_amp,
    )


# Deprecated public names of experiments moved to cals_seg/contrib/: name -> (contrib module,
# the registry name of what it registers). Not in ``__all__``; an access imports the module.
_MOVED_TO_CONTRIB = {"BandCALSALMLoss": ("cals_bands", "cals_alm_bands")}


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_CONTRIB:
        import warnings

        from cals_seg.losses import LOSSES
        from cals_seg.utils.registry import enable_contrib

        module, entry = _MOVED_TO_CONTRIB[name]
        warnings.warn(f"cals_seg.{name} is deprecated: the loss {entry!r} is an opt-in "
                      f"experiment; import cals_seg.contrib.{module} (or contrib: [{module}] in "
                      f"a config) and use {name} from there.", DeprecationWarning, stacklevel=2)
        enable_contrib([module])
        return LOSSES[entry]
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cals_seg' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
