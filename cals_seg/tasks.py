"""Build a :class:`~cals_seg.trainer.Task` (data + model) from a config.

Only this module and ``tools/`` read the config's data and model sections.
"""

from __future__ import annotations

from .config import Config
from .data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
from .data.transforms import eval_transform, train_transform
from .data.voc import VOC_CLASSES, VOCSegmentation, paper_split
from .models import build_segmentation_model
from .trainer import Task

SEGMENTATION_DATASETS = ("voc", "synthetic")


def segmentation_class_names(cfg: Config) -> list[str]:
    """Display names of the classes of a segmentation config."""
    names = list(VOC_CLASSES if cfg.data.name == "voc" else SYNTHETIC_CLASSES)
    k = cfg.data.num_classes
    return names[:k] if len(names) >= k else [f"class {i}" for i in range(k)]


def build_segmentation_datasets(cfg: Config) -> dict[str, VOCSegmentation]:
    """Train / val / test datasets of the paper split (``train.txt`` 80/20, ``val.txt`` test).

    For ``data.name: synthetic`` the embedded dataset is generated at ``data.root`` first when
    it is missing (``data.synthetic`` holds the generator's keyword arguments).
    """
    d = cfg.data
    if d.name not in SEGMENTATION_DATASETS:
        raise ValueError(
            f"data.name: unknown segmentation dataset {d.name!r}; valid names are "
            f"{list(SEGMENTATION_DATASETS)}."
        )
    if d.name == "synthetic":
        if d.num_classes != len(SYNTHETIC_CLASSES):
            raise ValueError(
                f"data.num_classes: the synthetic dataset has "
                f"{len(SYNTHETIC_CLASSES)} classes, but the config says "
                f"{d.num_classes}."
            )
        generate_synthetic_voc(d.root, **d.synthetic)
    split = paper_split(d.root, val_fraction=d.val_fraction, seed=d.split_seed)
    # segmentation: data.color_jitter > 0 switches on a light colour jitter (fixed strengths)
    train_tf = train_transform(d.crop_size, scale_range=tuple(d.scale_range),
                               color_jitter=d.color_jitter > 0)
    eval_tf = eval_transform(d.eval_size)
    common = dict(num_classes=d.num_classes, ignore_index=d.ignore_index)
    return {
        "train": VOCSegmentation(d.root, split["train"], train_tf, **common),
        "val": VOCSegmentation(d.root, split["val"], eval_tf, **common),
        "test": VOCSegmentation(d.root, split["test"], eval_tf, **common),
    }


def build_segmentation_task(cfg: Config) -> Task:
    """Datasets and the smp model of a segmentation config."""
    sets = build_segmentation_datasets(cfg)
    m = cfg.model
    model = build_segmentation_model(
        m.arch, m.encoder_name, m.encoder_weights, cfg.data.num_classes, **m.params
    )
    return Task(
        sets["train"],
        sets["val"],
        sets["test"],
        model,
        cfg.data.num_classes,
        cfg.data.ignore_index,
        segmentation_class_names(cfg),
        segmentation=True,
    )
