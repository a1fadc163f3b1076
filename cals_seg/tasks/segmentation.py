"""Segmentation datasets in VOC layout and the smp model: ``data.name`` ``voc``, ``synthetic``.

To add a dataset in another layout: write its ``Dataset`` (items ``{"image": (3, H, W),
"mask": (H, W)}``) in ``cals_seg/data/``, and here a builder registered under its name that
returns :func:`segmentation_task` of its three splits.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..checks import check_eval_protocol
from ..config import Config
from ..data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
from ..data.transforms import eval_transform, train_transform
from ..data.voc import VOC_CLASSES, VOCSegmentation, paper_split
from ..errors import ConfigError
from ..inference import EvalProtocol, input_multiple
from ..models import build_segmentation_model
from . import SegmentationTask, class_names_or_default, generate_embedded, register_dataset


def segmentation_task(cfg: Config, splits: dict[str, list[str]],
                      class_names: Sequence[str]) -> SegmentationTask:
    """VOC-layout datasets of ``splits`` (``{"train", "val", "test": ids}`` under
    ``data.root``) with the config's transforms, and the smp model."""
    d = cfg.data
    model = build_model(cfg, cfg.model.encoder_weights)
    train_tf = train_transform(d.crop_size, scale_range=tuple(d.scale_range),
                               color_jitter=d.color_jitter, ignore_index=d.ignore_index)
    # Evaluation samples are the unmodified images and masks (normalised only); the protocol
    # makes the network input (resize / pad / tiles) and brings the logits back to their size.
    protocol = eval_protocol(cfg, model)
    eval_tf = eval_transform(None, ignore_index=d.ignore_index)
    common = dict(num_classes=d.num_classes, ignore_index=d.ignore_index)
    sets = {
        split: VOCSegmentation(d.root, splits[split], train_tf if split == "train" else eval_tf,
                               **common)
        for split in ("train", "val", "test")
    }
    return SegmentationTask(
        sets["train"], sets["val"], sets["test"], model, d.num_classes, d.ignore_index,
        class_names_or_default(class_names, d.num_classes), protocol,
    )


def eval_protocol(cfg: Config, model: nn.Module) -> EvalProtocol:
    """The evaluation protocol of ``cfg.eval`` for ``model`` (whose output stride sets the
    padding multiple); ``eval.batch_size`` tiles per forward pass in slide mode.

    Raises:
        ConfigError: a bad ``eval.mode`` / ``window`` / ``stride`` / ``resize`` / ``pad``, or a
            ``data.eval_size`` (a segmentation split is evaluated at its own resolution).
    """
    d, e = cfg.data, cfg.eval
    if d.eval_size is not None:
        raise ConfigError(
            f"data.eval_size: {d.eval_size} would shrink the masks of a segmentation split; "
            "metrics are now taken at each image's own resolution. Set data.eval_size: null "
            f"and choose the network input with eval.pad: {d.eval_size} (pad, the paper's VOC "
            f"protocol), eval.resize: {d.eval_size} (longest side), or eval.mode: slide (tiles)."
        )
    check_eval_protocol(cfg)
    return EvalProtocol(mode=e.mode, resize=e.resize, pad=e.pad, window=e.window,
                        stride=e.stride, multiple=input_multiple(model),
                        tile_batch=max(1, e.batch_size))


def build_model(cfg: Config, encoder_weights: str | None = None) -> nn.Module:
    """The config's smp model with ``encoder_weights`` (``None``: random, for loading a
    checkpoint without downloading anything)."""
    m = cfg.model
    return build_segmentation_model(m.arch, m.encoder_name, encoder_weights,
                                    cfg.data.num_classes, **m.params)


CLASS_NAMES = {"voc": VOC_CLASSES, "synthetic": SYNTHETIC_CLASSES}


def class_names(cfg: Config) -> list[str]:
    """The class names of ``cfg``'s dataset, without reading the data."""
    return class_names_or_default(CLASS_NAMES.get(cfg.data.name), cfg.data.num_classes)


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
