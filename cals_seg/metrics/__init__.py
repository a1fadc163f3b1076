"""Streaming evaluators whose state does not grow with the number of pixels.

Definitions: docs/design.md, "Metrics".

``CalibrationMeter``: ECE, adaptive ECE, class-wise ECE, MCE, NLL, Brier, accuracy, per-image
means and reliability-diagram data. ``SegmentationMeter``: confusion matrix, IoU, mIoU,
accuracies. ``BoundaryCalibrationMeter`` / ``ObjectSizeCalibrationMeter``: ECE, its
over / under-confident split, accuracy and reliability data per distance band around the class
boundaries / per object-size bucket. ``ShotGroupMeter``: per-class accuracy and many / medium /
few-shot calibration of a long-tailed classifier. ``PredictionSetMeter`` (in
:mod:`cals_seg.metrics.conformal`): risk, coverage and size of prediction sets, by region. All are
:class:`Meter` s (``nn.Module`` s with declared states and ``reset / update / compute``) and give
the same numbers on one process or N DDP processes. ``METERS`` names them (the keys of a task's
meters).
"""

from cals_seg.metrics._base import Meter, MeterState
from cals_seg.metrics.calibration import CalibrationMeter
from cals_seg.metrics.groups import ShotGroupMeter
from cals_seg.metrics.regions import (
    BoundaryAwareECEMeter,  # ba_ece, the field's ring metric
    BoundaryCalibrationMeter,
    ObjectSizeCalibrationMeter,
)
from cals_seg.metrics.segmentation import SegmentationMeter
from cals_seg.utils.registry import Registry

METERS: Registry[type[Meter]] = Registry("meter")
for _name, _cls in (
    ("calibration", CalibrationMeter),
    ("segmentation", SegmentationMeter),
    ("boundary", BoundaryCalibrationMeter),
    ("size", ObjectSizeCalibrationMeter),
    ("rings", BoundaryAwareECEMeter),
    ("groups", ShotGroupMeter),
):
    METERS.register(_name, _cls)

__all__ = [
    "BoundaryAwareECEMeter",
    "METERS",
    "BoundaryCalibrationMeter",
    "CalibrationMeter",
    "Meter",
    "MeterState",
    "ObjectSizeCalibrationMeter",
    "SegmentationMeter",
    "ShotGroupMeter",
]
