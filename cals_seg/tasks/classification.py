"""Image classification datasets and the timm model: ``data.name`` ``imagefolder``,
``split_files``, ``tiny_imagenet``, ``imagenet``, ``imagenet_lt``, ``synthetic_cls``.

Classification is the flattened special case of segmentation: the model maps a batch to logits
``(N, K)``, the targets are ``(N,)``, and the same trainer, criterion and meters run on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cals_seg.config.rules import check_ignore_index, check_model_names, check_num_classes
from cals_seg.config.schema import Config
from cals_seg.data.classification import (
    IMAGENET_LT_FILES,
    ImageClassification,
    classification_eval_transform,
    classification_train_transform,
    image_folder_splits,
    imagenet_paper_split,
    split_file_splits,
    tiny_imagenet_paper_split,
)
from cals_seg.data.synthetic_cls import IMAGE_CLASSES, generate_synthetic_images
from cals_seg.models.classification import build_classification_model
from cals_seg.tasks.base import ClassificationTask, generate_embedded, register_dataset


def check_classification_config(cfg: Config, classes: Sequence[str]) -> None:
    """The rules of :mod:`cals_seg.config.rules` for what a classification builder found: no
    class label may be void, and the data must have ``data.num_classes`` classes."""
    check_ignore_index(cfg)
    check_num_classes(cfg, len(classes), f"{cfg.data.root} ({list(classes)[:5]}...)")


def image_task(cfg: Config, splits: dict[str, Any]) -> ClassificationTask:
    """Datasets of ``splits`` (``{"train", "val", "test": [(path, label)], "classes": names}``)
    with albumentations transforms, and the timm model."""
    d, m = cfg.data, cfg.model
    check_model_names(cfg)  # model.arch timm, a timm model
    classes = splits["classes"]
    check_classification_config(cfg, classes)
    train_tf = classification_train_transform(
        d.image_size, tuple(d.crop_scale), d.color_jitter, d.random_erasing
    )
    eval_tf = classification_eval_transform(d.image_size, d.eval_size)
    k = d.num_classes
    sets = {
        split: ImageClassification(splits[split], tf, k, classes)
        for split, tf in (("train", train_tf), ("val", eval_tf), ("test", eval_tf))
    }
    model = build_classification_model(m.encoder_name, k, m.encoder_weights, **m.params)
    return ClassificationTask(
        sets["train"], sets["val"], sets["test"], model, k, d.ignore_index, list(classes)
    )


def _image_dataset(name: str, splits: Callable[[Config], dict[str, Any]]) -> None:
    register_dataset(name, family="classification")(lambda cfg: image_task(cfg, splits(cfg)))


def _synthetic_splits(cfg: Config) -> dict[str, Any]:
    generate_embedded(cfg, generate_synthetic_images, len(IMAGE_CLASSES),
                      "the synthetic image set")
    return image_folder_splits(cfg.data.root)


# root/{train,val,test}/<class>/*
_image_dataset("imagefolder", lambda cfg: image_folder_splits(cfg.data.root))
# `<path> <label>` list files named by data.split_files
_image_dataset("split_files", lambda cfg: split_file_splits(
    cfg.data.root, cfg.data.split_files, cfg.data.num_classes))
_image_dataset("tiny_imagenet", lambda cfg: tiny_imagenet_paper_split(
    cfg.data.root, cfg.data.val_per_class, cfg.data.split_seed))
_image_dataset("imagenet", lambda cfg: imagenet_paper_split(
    cfg.data.root, cfg.data.val_fraction, cfg.data.split_seed))
_image_dataset("imagenet_lt", lambda cfg: split_file_splits(
    cfg.data.root, {**IMAGENET_LT_FILES, **cfg.data.split_files}, cfg.data.num_classes))
_image_dataset("synthetic_cls", _synthetic_splits)
