"""cals_seg: calibrated semantic segmentation with CALS-ALM (Class Adaptive Network Calibration)."""

__version__ = "0.1.0"
