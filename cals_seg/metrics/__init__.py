"""Streaming evaluators whose state does not grow with the number of pixels.

Definitions: docs/design.md, "Metrics".

``CalibrationMeter``: ECE, adaptive ECE, class-wise ECE, MCE, NLL, Brier, accuracy, per-image
means and reliability-diagram data. ``SegmentationMeter``: confusion matrix, IoU, mIoU,
accuracies. ``BoundaryCalibrationMeter`` / ``ObjectSizeCalibrationMeter``: ECE, its
over / under-confident split, accuracy and reliability data per distance band around the class
boundaries / per object-size bucket. ``ShotGroupMeter``: per-class accuracy and many / medium /
few-shot calibration of a long-tailed classifier. All are ``nn.Module`` s with
``reset / update / compute`` and give the same numbers on one process or N DDP processes.
"""

from cals_seg.metrics.calibration import CalibrationMeter
from cals_seg.metrics.groups import ShotGroupMeter
from cals_seg.metrics.regions import (
    BoundaryAwareECEMeter,  # ba_ece, the field's ring metric
    BoundaryCalibrationMeter,
    ObjectSizeCalibrationMeter,
)
from cals_seg.metrics.segmentation import SegmentationMeter

__all__ = [
    "BoundaryAwareECEMeter",
    "BoundaryCalibrationMeter",
    "CalibrationMeter",
    "ObjectSizeCalibrationMeter",
    "SegmentationMeter",
    "ShotGroupMeter",
]
