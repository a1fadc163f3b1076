"""cals_seg: calibrated semantic segmentation with CALS-ALM (Class Adaptive Network Calibration).

The public API, for use in any PyTorch training loop::

    from cals_seg import build_loss, CalibrationMeter, SegmentationMeter, fit_temperature
    from cals_seg import predict_image  # calibrated maps of new images
    (cals_seg.evaluation.inference)

Names are imported on first access, so ``import cals_seg`` is cheap (it does not even import
torch) and never pulls in the optional heavy dependencies of the tools (matplotlib,
albumentations, segmentation-models-pytorch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> submodule that defines it
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
    "BandCALSALMLoss": "cals_seg.losses",
    "CalibrationMeter": "cals_seg.metrics",
    "SegmentationMeter": "cals_seg.metrics",
    "ShotGroupMeter": "cals_seg.metrics",
    "resolve_amp": "cals_seg.utils.precision",
    "fit_temperature": "cals_seg.calibrators.temperature",
    "nll_at_temperature": "cals_seg.calibrators.temperature",
    "TemperatureScaler": "cals_seg.calibrators.ts",
    "EvalProtocol": "cals_seg.evaluation.inference",
    "Prediction": "cals_seg.evaluation.inference",
    "predict_image": "cals_seg.evaluation.inference",
    "segment_logits": "cals_seg.evaluation.inference",
    "calibrated_outputs": "cals_seg.evaluation.inference",
}

__all__ = [
    "__version__",
    "LOSSES",
    "build_loss",
    "SegLoss",
    "CrossEntropyLoss",
    "LabelSmoothingLoss",
    "FocalLoss",
    "FocalLossSD",
    "ConfidencePenaltyLoss",
    "MbLSLoss",
    "CALSHRLoss",
    "CALSALMLoss",
    "SVLSLoss",
    "NACLLoss",
    "CRaCLoss",
    "BandCALSALMLoss",
    "CalibrationMeter",
    "SegmentationMeter",
    "ShotGroupMeter",
    "resolve_amp",
    "fit_temperature",
    "nll_at_temperature",
    "TemperatureScaler",
    "EvalProtocol",
    "Prediction",
    "predict_image",
    "segment_logits",
    "calibrated_outputs",
]

if TYPE_CHECKING:  # static analysers and IDEs see the real objects
    from cals_seg.calibrators.temperature import fit_temperature, nll_at_temperature
    from cals_seg.calibrators.ts import TemperatureScaler
    from cals_seg.evaluation.inference import (
        EvalProtocol,
        Prediction,
        calibrated_outputs,
        predict_image,
        segment_logits,
    )
    from cals_seg.losses import (
        LOSSES,
        BandCALSALMLoss,
        CALSALMLoss,
        CALSHRLoss,
        ConfidencePenaltyLoss,
        CRaCLoss,
        CrossEntropyLoss,
        FocalLoss,
        FocalLossSD,
        LabelSmoothingLoss,
        MbLSLoss,
        NACLLoss,
        SegLoss,
        SVLSLoss,
        build_loss,
    )
    from cals_seg.metrics import CalibrationMeter, SegmentationMeter, ShotGroupMeter
    from cals_seg.utils.precision import resolve_amp


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cals_seg' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
