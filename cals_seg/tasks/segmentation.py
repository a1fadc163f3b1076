"""Segmentation datasets and the smp model: ``data.name`` ``voc``, ``synthetic``,
``cityscapes``, ``ade20k``, ``folder``.

To add a dataset in another layout, write one new file in ``cals_seg/tasks/`` (docs/datasets.md,
"Extending"): its ``Dataset`` (items ``{"image": (3, H, W), "mask": (H, W)}``; subclassing
:class:`cals_seg.data.paired.PairedSegmentation` gives the loading, the label checks and
``tools/check_data.py``) and a function ``splits(cfg, transforms) -> {"train", "val", "test":
Dataset}`` registered with :func:`segmentation_dataset` under its name and its class names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from cals_seg.config.rules import check_eval_size, check_folder, check_num_classes, check_palette
from cals_seg.config.schema import Config
from cals_seg.data.ade20k import ADE20K_CLASSES, ADE20KSegmentation, ade20k_split
from cals_seg.data.checks import refuse_listing_problems
from cals_seg.data.cityscapes import CITYSCAPES_CLASSES, CityscapesSegmentation, cityscapes_split
from cals_seg.data.folder import ColourTable, FolderSegmentation, folder_split
from cals_seg.data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
from cals_seg.data.transforms import SegmentationTransform, eval_transform, train_transform
from cals_seg.data.voc import VOC_CLASSES, VOCSegmentation, paper_split
from cals_seg.errors import ConfigError
from cals_seg.evaluation.inference import EvalProtocol, input_multiple
from cals_seg.evaluation.stream import group_fns
from cals_seg.models import build_segmentation_model
from cals_seg.tasks.base import (
    DATASETS,
    SegmentationTask,
    class_names_or_default,
    generate_embedded,
    register_dataset,
)

SPLITS = ("train", "val", "test")
Transform = Callable[..., dict[str, Any]]
SplitBuilder = Callable[[Config, Mapping[str, Transform]], dict[str, Dataset]]


def split_transforms(cfg: Config) -> dict[str, Transform]:
    """Training augmentation for ``train``; normalisation only for ``val`` and ``test`` (the
    evaluation protocol makes the network input and brings the logits back to the image), one
    transform each (:func:`add_region_groups` gives them different maps)."""
    d = cfg.data
    train_tf = train_transform(d.crop_size, scale_range=tuple(d.scale_range),
                               color_jitter=d.color_jitter, ignore_index=d.ignore_index)
    return {"train": train_tf, "val": eval_transform(None, ignore_index=d.ignore_index),
            "test": eval_transform(None, ignore_index=d.ignore_index)}


def add_region_groups(task: SegmentationTask, transforms: Mapping[str, Transform],
                      cfg: Config) -> None:
    """Make the ``val`` and ``test`` items carry the ground-truth analysis of the task's region
    meters (distance bands; object sizes on test), made by their ``group_fn()`` in the
    data-loading workers (``SegmentationTransform.add_extra_inputs``) under
    :func:`cals_seg.evaluation.stream.group_key`: the evaluation passes them to the meters
    (``update(..., groups=...)``) instead of analysing the masks in its main process. ``val``
    gets those of the validation meters, ``test`` those of the test meters; a meter whose
    maps an item lacks (another meter set, a transform of another kind) computes them itself.
    """
    probe = task
    if cfg.data.class_names is not None:  # what build_task gives the task (background class)
        probe = dataclasses.replace(task, class_names=list(cfg.data.class_names))
    for split, test in (("val", False), ("test", True)):
        transform = transforms.get(split)
        fns = group_fns(probe.meters(test=test).values())
        if fns and isinstance(transform, SegmentationTransform):
            transform.add_extra_inputs(fns)


def segmentation_task(cfg: Config, make_splits: SplitBuilder,
                      class_names: Sequence[str] | None) -> SegmentationTask:
    """The task of any segmentation dataset: ``make_splits(cfg, transforms)`` gives the
    three splits (items ``{"image": (3, H, W), "mask": (H, W)}``), built with the config's
    transforms and checked (:func:`refuse_listing_problems`), and the smp model.

    Args:
        cfg: the run's config.
        make_splits: the dataset's split builder.
        class_names: the dataset's own names (``data.class_names`` replaces them).
    """
    d = cfg.data
    # The data first: a wrong root or a missing file is reported before any weights are
    # downloaded (building datasets and transforms draws from no global random generator).
    transforms = split_transforms(cfg)
    sets = make_splits(cfg, transforms)
    refuse_listing_problems(sets)
    model = build_model(cfg, cfg.model.encoder_weights)
    protocol = eval_protocol(cfg, model)
    task = SegmentationTask(
        sets["train"], sets["val"], sets["test"], model, d.num_classes, d.ignore_index,
        class_names_or_default(class_names, d.num_classes), protocol,
    )
    add_region_groups(task, transforms, cfg)
    return task


def eval_protocol(cfg: Config, model: nn.Module) -> EvalProtocol:
    """The evaluation protocol of ``cfg.eval`` for ``model`` (whose output stride sets the
    padding multiple); ``eval.batch_size`` tiles per forward pass in slide mode.

    Raises:
        ConfigError: a bad ``eval.mode`` / ``window`` / ``stride`` / ``resize`` / ``pad``, or a
            ``data.eval_size`` (a segmentation split is evaluated at its own resolution).
    """
    e = cfg.eval
    check_eval_size(cfg)
    return EvalProtocol(mode=e.mode, resize=e.resize, pad=e.pad, window=e.window,
                        stride=e.stride, multiple=input_multiple(model),
                        tile_batch=max(1, e.batch_size))


def build_model(cfg: Config, encoder_weights: str | None = None) -> nn.Module:
    """The config's smp model with ``encoder_weights`` (``None``: random, for loading a
    checkpoint without downloading anything); with ``model.arch: external``, the network it
    names with random weights (:mod:`cals_seg.models.external`; ``tools/import_model.py``
    loads ``model.weights``, a run's checkpoint holds them)."""
    m = cfg.model
    if m.arch == "external":
        from cals_seg.models.external import build_external_model

        return build_external_model(m.factory, cfg.data.num_classes, params=m.params,
                                    encoder_name=m.encoder_name, mean=m.mean, std=m.std,
                                    output_stride=m.output_stride, output_key=m.output_key,
                                    align_corners=m.align_corners)
    return build_segmentation_model(m.arch, m.encoder_name, encoder_weights,
                                    cfg.data.num_classes, **m.params)


def segmentation_dataset(name: str, classes: Sequence[str] | None) -> Callable[[SplitBuilder],
                                                                              SplitBuilder]:
    """Decorator: ``splits(cfg, transforms)`` becomes the dataset ``data.name == name`` with
    default class names ``classes`` (its task is :func:`segmentation_task` of it), registered in
    :data:`cals_seg.data.registry.DATASETS` as a segmentation dataset.

    Args:
        name: the ``data.name`` (unique).
        classes: the dataset's own class names (``None``: ``class 0 ...``).

    Returns:
        The decorator, which returns ``splits`` unchanged.
    """

    def add(splits: SplitBuilder) -> SplitBuilder:
        register_dataset(name, family="segmentation", classes=classes, splits=splits)(
            lambda cfg: segmentation_task(cfg, splits, classes))
        return splits

    return add


def segmentation_splits(cfg: Config) -> dict[str, Dataset]:
    """The three splits of ``cfg``'s dataset without augmentation, without the model and
    without refusing listing problems (what ``tools/check_data.py`` reads).

    Raises:
        ValueError: not a segmentation dataset, or a layout that cannot be read at all.
    """
    entry = DATASETS.get(cfg.data.name)
    if entry is None or entry.splits is None:
        valid = sorted(n for n, e in DATASETS.items() if e.splits is not None)
        raise ConfigError(
            f"data.name: {cfg.data.name!r} is not a segmentation dataset; valid names are "
            f"{valid}."
        )
    eval_tf = eval_transform(None, ignore_index=cfg.data.ignore_index)
    return entry.splits(cfg, dict.fromkeys(SPLITS, eval_tf))


def class_names(cfg: Config) -> list[str]:
    """The class names of ``cfg``'s dataset, without reading the data: ``data.class_names``,
    else the dataset's own, else ``class 0 ...``."""
    if cfg.data.class_names is not None:
        return list(cfg.data.class_names)
    entry = DATASETS.get(cfg.data.name)
    return class_names_or_default(None if entry is None else entry.classes, cfg.data.num_classes)


def _existing_root(cfg: Config) -> str:
    check_folder("data.root", cfg.data.root, must_exist=True)
    return cfg.data.root


def _voc_splits(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    d = cfg.data
    split = paper_split(d.root, val_fraction=d.val_fraction, seed=d.split_seed)
    return {s: VOCSegmentation(d.root, split[s], transforms[s], num_classes=d.num_classes,
                               ignore_index=d.ignore_index) for s in SPLITS}


@segmentation_dataset("voc", VOC_CLASSES)
def voc(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    """PASCAL VOC 2012 with the paper's split: ``train.txt`` 80/20 train/val, ``val.txt`` test."""
    return _voc_splits(cfg, transforms)


@segmentation_dataset("synthetic", SYNTHETIC_CLASSES)
def synthetic(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    """The embedded dataset (VOC layout), generated at ``data.root`` when missing
    (``data.synthetic`` holds the generator's keyword arguments), with the paper's split."""
    generate_embedded(cfg, generate_synthetic_voc, len(SYNTHETIC_CLASSES), "the synthetic dataset")
    return _voc_splits(cfg, transforms)


@segmentation_dataset("cityscapes", CITYSCAPES_CLASSES)
def cityscapes(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    """Cityscapes fine: 19 train ids; a seeded ``data.val_fraction`` of ``train`` is the
    validation split, the official ``val`` the test set."""
    d = cfg.data
    check_num_classes(cfg, len(CITYSCAPES_CLASSES), "Cityscapes")
    files = cityscapes_split(_existing_root(cfg), d.val_fraction, d.split_seed)
    return {s: CityscapesSegmentation(files[s], transforms[s], num_classes=d.num_classes,
                                      ignore_index=d.ignore_index) for s in SPLITS}


@segmentation_dataset("ade20k", ADE20K_CLASSES)
def ade20k(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    """ADE20K (ADEChallengeData2016): 150 classes, annotation 0 void; a seeded
    ``data.val_fraction`` of ``training`` is the validation split, ``validation`` the test set."""
    d = cfg.data
    check_num_classes(cfg, len(ADE20K_CLASSES), "ADE20K")
    files = ade20k_split(_existing_root(cfg), d.val_fraction, d.split_seed)
    return {s: ADE20KSegmentation(files[s], transforms[s], num_classes=d.num_classes,
                                  ignore_index=d.ignore_index) for s in SPLITS}


def colour_table(cfg: Config) -> ColourTable | None:
    """The folder dataset's colour decoding (``data.palette``), or ``None`` for index masks.

    Raises:
        ConfigError: a malformed palette, or colour keys given without ``data.palette``.
    """
    d = cfg.data
    check_palette(cfg)
    if d.palette is None:
        return None
    try:
        return ColourTable(d.palette, d.void_colours, d.ignore_index, d.unknown_colours)
    except ValueError as err:
        raise ConfigError(str(err)) from None


@segmentation_dataset("folder", None)
def folder(cfg: Config, transforms: Mapping[str, Transform]) -> dict[str, Dataset]:
    """Images and masks matched by file stem (:mod:`cals_seg.data.folder`); without a val
    split, a seeded ``data.val_fraction`` of train."""
    d = cfg.data
    colours = colour_table(cfg)
    files = folder_split(_existing_root(cfg), d.image_dir, d.mask_dir, d.split_files,
                         d.val_fraction, d.split_seed)
    return {s: FolderSegmentation(files[s], transforms[s], num_classes=d.num_classes,
                                  ignore_index=d.ignore_index, colours=colours) for s in SPLITS}
