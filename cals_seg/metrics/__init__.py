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
the same numbers on one process or N DDP processes. ``METERS`` registers them by the key of a task's
meter set, with the task families that run them (:mod:`cals_seg.metrics.registry`); a task's
``meters()`` builds every entry of its family.
"""

from cals_seg.metrics._base import Meter, MeterState
from cals_seg.metrics.registry import METERS, MeterEntry, register_meter

# The built-in meters register themselves in this order (the order of a task's meter set); a new
# file in this folder registers itself after them (METERS discovers it).
# isort: off
from cals_seg.metrics.calibration import CalibrationMeter
from cals_seg.metrics.segmentation import SegmentationMeter
from cals_seg.metrics.regions import (
    BoundaryAwareECEMeter,  # ba_ece, the field's ring metric
    BoundaryCalibrationMeter,
    ObjectSizeCalibrationMeter,
)
from cals_seg.metrics.groups import ShotGroupMeter
# isort: on

__all__ = [
    "BoundaryAwareECEMeter",
    "METERS",
    "BoundaryCalibrationMeter",
    "CalibrationMeter",
    "Meter",
    "MeterEntry",
    "MeterState",
    "ObjectSizeCalibrationMeter",
    "SegmentationMeter",
    "ShotGroupMeter",
    "register_meter",
]
