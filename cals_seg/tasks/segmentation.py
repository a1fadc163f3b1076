"""Segmentation datasets in VOC layout and the smp model: ``data.name`` ``voc``, ``synthetic``.

To add a dataset in another layout: write its ``Dataset`` (items ``{"image": (3, H, W),
"mask": (H, W)}``) in ``cals_seg/data/``, and here a builder registered under its name that
returns :func:`segmentation_task` of its three splits.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import Config
from ..data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
from ..data.transforms import eval_transform, train_transform
from ..data.voc import VOC_CLASSES, VOCSegmentation, paper_split
from ..models import build_segmentation_model
from . import SegmentationTask, class_names_or_default, generate_embedded, register_dataset


def segmentation_task(cfg: Config, splits: dict[str, list[str]],
                      class_names: Sequence[str]) -> SegmentationTask:
    """VOC-layout datasets of ``splits`` (``{"train", "val", "test": ids}`` under
    ``data.root``) with the config's transforms, and the smp model."""
    d, m = cfg.data, cfg.model
    model = build_segmentation_model(
        m.arch, m.encoder_name, m.encoder_weights, d.num_classes, **m.params
    )
    train_tf = train_transform(d.crop_size, scale_range=tuple(d.scale_range),
                               color_jitter=d.color_jitter, ignore_index=d.ignore_index)
    # smp networks need sides divisible by their output stride: evaluation pads with void
    stride = getattr(getattr(model, "encoder", None), "output_stride", 1)
    multiple = stride if getattr(model, "requires_divisible_input_shape", False) else 1
    eval_tf = eval_transform(d.eval_size, ignore_index=d.ignore_index, multiple=multiple)
    common = dict(num_classes=d.num_classes, ignore_index=d.ignore_index)
    sets = {
        split: VOCSegmentation(d.root, splits[split], train_tf if split == "train" else eval_tf,
                               **common)
        for split in ("train", "val", "test")
    }
    return SegmentationTask(
        sets["train"], sets["val"], sets["test"], model, d.num_classes, d.ignore_index,
        class_names_or_default(class_names, d.num_classes),
    )


@register_dataset("voc", family="segmentation")
def voc(cfg: Config) -> SegmentationTask:
    """PASCAL VOC 2012 with the paper's split: ``train.txt`` 80/20 train/val, ``val.txt`` test."""
    d = cfg.data
    split = paper_split(d.root, val_fraction=d.val_fraction, seed=d.split_seed)
    return segmentation_task(cfg, split, VOC_CLASSES)


@register_dataset("synthetic", family="segmentation")
def synthetic(cfg: Config) -> SegmentationTask:
    """The embedded dataset (VOC layout), generated at ``data.root`` when missing
    (``data.synthetic`` holds the generator's keyword arguments), with the paper's split."""
    d = cfg.data
    generate_embedded(cfg, generate_synthetic_voc, len(SYNTHETIC_CLASSES), "the synthetic dataset")
    split = paper_split(d.root, val_fraction=d.val_fraction, seed=d.split_seed)
    return segmentation_task(cfg, split, SYNTHETIC_CLASSES)
