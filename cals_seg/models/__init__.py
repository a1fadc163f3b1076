"""Model builders: segmentation networks from segmentation-models-pytorch."""

from cals_seg.models.segmentation import build_segmentation_model

__all__ = ["build_segmentation_model"]
