"""Datasets and transforms: VOC-layout segmentation data and the embedded synthetic dataset,
Cityscapes, ADE20K, any image/mask folder, and the data check. ``DATASETS``
(:mod:`cals_seg.data.registry`) is every dataset a config can name, with its kind; each registers
itself in its module of :mod:`cals_seg.tasks`.

The names below are imported on first access (``from cals_seg.data import VOCSegmentation``
works as usual): importing one module of the package, e.g. :mod:`cals_seg.data.corruptions`,
does not import the transforms (albumentations) or every dataset."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "ADE20K_CLASSES": "cals_seg.data.ade20k",
    "ADE20KSegmentation": "cals_seg.data.ade20k",
    "ade20k_split": "cals_seg.data.ade20k",
    "CITYSCAPES_CLASSES": "cals_seg.data.cityscapes",
    "CityscapesSegmentation": "cals_seg.data.cityscapes",
    "cityscapes_split": "cals_seg.data.cityscapes",
    "label_to_train_ids": "cals_seg.data.cityscapes",
    "ColourTable": "cals_seg.data.folder",
    "FolderSegmentation": "cals_seg.data.folder",
    "folder_split": "cals_seg.data.folder",
    "PairedSegmentation": "cals_seg.data.paired",
    "SplitFiles": "cals_seg.data.paired",
    "hold_out": "cals_seg.data.paired",
    "DATASETS": "cals_seg.data.registry",
    "SYNTHETIC_CLASSES": "cals_seg.data.synthetic",
    "generate_synthetic_voc": "cals_seg.data.synthetic",
    "SegmentationTransform": "cals_seg.data.transforms",
    "eval_transform": "cals_seg.data.transforms",
    "train_transform": "cals_seg.data.transforms",
    "VOC_CLASSES": "cals_seg.data.voc",
    "VOCSegmentation": "cals_seg.data.voc",
    "paper_split": "cals_seg.data.voc",
    "read_split": "cals_seg.data.voc",
    "resolve_voc_root": "cals_seg.data.voc",
    "voc_palette": "cals_seg.data.voc",
}

if TYPE_CHECKING:  # static analysers see the real objects; the same pairs as _EXPORTS
    from cals_seg.data.ade20k import (
        ADE20K_CLASSES as ADE20K_CLASSES,
    )
    from cals_seg.data.ade20k import (
        ADE20KSegmentation as ADE20KSegmentation,
    )
    from cals_seg.data.ade20k import (
        ade20k_split as ade20k_split,
    )
    from cals_seg.data.cityscapes import (
        CITYSCAPES_CLASSES as CITYSCAPES_CLASSES,
    )
    from cals_seg.data.cityscapes import (
        CityscapesSegmentation as CityscapesSegmentation,
    )
    from cals_seg.data.cityscapes import (
        cityscapes_split as cityscapes_split,
    )
    from cals_seg.data.cityscapes import (
        label_to_train_ids as label_to_train_ids,
    )
    from cals_seg.data.folder import (
        ColourTable as ColourTable,
    )
    from cals_seg.data.folder import (
        FolderSegmentation as FolderSegmentation,
    )
    from cals_seg.data.folder import (
        folder_split as folder_split,
    )
    from cals_seg.data.paired import (
        PairedSegmentation as PairedSegmentation,
    )
    from cals_seg.data.paired import (
        SplitFiles as SplitFiles,
    )
    from cals_seg.data.paired import (
        hold_out as hold_out,
    )
    from cals_seg.data.registry import (
        DATASETS as DATASETS,
    )
    from cals_seg.data.synthetic import (
        SYNTHETIC_CLASSES as SYNTHETIC_CLASSES,
    )
    from cals_seg.data.synthetic import (
        generate_synthetic_voc as generate_synthetic_voc,
    )
    from cals_seg.data.transforms import (
        SegmentationTransform as SegmentationTransform,
    )
    from cals_seg.data.transforms import (
        eval_transform as eval_transform,
    )
    from cals_seg.data.transforms import (
        train_transform as train_transform,
    )
    from cals_seg.data.voc import (
        VOC_CLASSES as VOC_CLASSES,
    )
    from cals_seg.data.voc import (
        VOCSegmentation as VOCSegmentation,
    )
    from cals_seg.data.voc import (
        paper_split as paper_split,
    )
    from cals_seg.data.voc import (
        read_split as read_split,
    )
    from cals_seg.data.voc import (
        resolve_voc_root as resolve_voc_root,
    )
    from cals_seg.data.voc import (
        voc_palette as voc_palette,
    )

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import the module of a public name on first access and cache the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
