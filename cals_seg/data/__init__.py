"""Datasets and transforms: VOC-layout segmentation data and the embedded synthetic dataset."""

from cals_seg.data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
from cals_seg.data.transforms import SegmentationTransform, eval_transform, train_transform
from cals_seg.data.voc import (
    VOC_CLASSES,
    VOCSegmentation,
    paper_split,
    read_split,
    resolve_voc_root,
    voc_palette,
)

__all__ = [
    "SYNTHETIC_CLASSES",
    "VOC_CLASSES",
    "SegmentationTransform",
    "VOCSegmentation",
    "eval_transform",
    "generate_synthetic_voc",
    "paper_split",
    "read_split",
    "resolve_voc_root",
    "train_transform",
    "voc_palette",
]
