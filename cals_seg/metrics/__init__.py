"""Streaming evaluators whose state does not grow with the number of pixels.

Definitions: docs/design.md, "Metrics".

``CalibrationMeter``: ECE, adaptive ECE, class-wise ECE, MCE, NLL, Brier, accuracy, per-image
means and reliability-diagram data. ``SegmentationMeter``: confusion matrix, IoU, mIoU,
accuracies. ``ShotGroupMeter``: per-class accuracy and many / medium / few-shot calibration of a
long-tailed classifier. All are ``nn.Module`` s with ``reset / update / compute`` and give the
same numbers on one process or N DDP processes.
"""

from cals_seg.metrics.calibration import CalibrationMeter
from cals_seg.metrics.groups import ShotGroupMeter
from cals_seg.metrics.segmentation import SegmentationMeter

__all__ = ["CalibrationMeter", "SegmentationMeter", "ShotGroupMeter"]
