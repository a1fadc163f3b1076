"""Datasets and transforms: VOC-layout segmentation data and the embedded synthetic dataset,
Cityscapes, ADE20K, any image/mask folder, and the data check. ``DATASETS``
(:mod:`cals_seg.data.registry`) is every dataset a config can name, with its kind; each registers
itself in its module of :mod:`cals_seg.tasks`."""

from cals_seg.data.ade20k import ADE20K_CLASSES, ADE20KSegmentation, ade20k_split
from cals_seg.data.cityscapes import (
    CITYSCAPES_CLASSES,
    CityscapesSegmentation,
    cityscapes_split,
    label_to_train_ids,
)
from cals_seg.data.folder import ColourTable, FolderSegmentation, folder_split
from cals_seg.data.paired import PairedSegmentation, SplitFiles, hold_out
from cals_seg.data.registry import DATASETS
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
    "DATASETS",
    "ADE20K_CLASSES",
    "CITYSCAPES_CLASSES",
    "SYNTHETIC_CLASSES",
    "VOC_CLASSES",
    "ADE20KSegmentation",
    "CityscapesSegmentation",
    "ColourTable",
    "FolderSegmentation",
    "PairedSegmentation",
    "SegmentationTransform",
    "SplitFiles",
    "VOCSegmentation",
    "ade20k_split",
    "cityscapes_split",
    "eval_transform",
    "folder_split",
    "generate_synthetic_voc",
    "hold_out",
    "label_to_train_ids",
    "paper_split",
    "read_split",
    "resolve_voc_root",
    "train_transform",
    "voc_palette",
]
