"""The full data check behind ``tools/check_data.py``: read every split once and report.

Training runs only the cheap part (the file listing: missing files, images without masks, ids
listed twice) before its first epoch; :func:`check_splits` also decodes every image and mask::

    report = check_splits({"train": ds_train, "val": ds_val, "test": ds_test},
                          class_names=names, num_classes=K, ignore_index=255)
    print(report.format()); report.ok        # False: something would make training wrong

Problems (``report.problems``, each naming its files): listing problems, an empty split, ids or
image files listed twice within or across splits, unreadable files, mask values outside the
classes, image and mask of different sizes, a validation split without a valid pixel.
Warnings: files without their partner that training does not use, blank lines in split files,
classes absent from the training or the validation split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from cals_seg.data.paired import duplicates, shown

SPLITS = ("train", "val", "test")
MAX_LISTED = 20  # file problems listed one by one per split; the rest are counted


@dataclass
class SplitStats:
    """What one pass over a split found.

    Attributes:
        samples: image/mask pairs in the split.
        class_pixels: ``(K,)`` pixels of each class.
        class_images: ``(K,)`` images holding at least one pixel of each class.
        void_pixels: pixels of the void label.
        min_size, max_size: smallest and largest ``(width, height)`` (by area) of the images
            read, ``None`` when none was.
    """

    samples: int
    class_pixels: np.ndarray
    class_images: np.ndarray
    void_pixels: int = 0
    min_size: tuple[int, int] | None = None
    max_size: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "class_pixels": self.class_pixels.tolist(),
                "class_images": self.class_images.tolist(), "void_pixels": self.void_pixels,
                "min_size": self.min_size, "max_size": self.max_size}


@dataclass
class DataReport:
    """The outcome of :func:`check_splits`: statistics per split, problems and warnings."""

    class_names: list[str]
    splits: dict[str, SplitStats]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing would make training wrong (warnings allowed)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "class_names": self.class_names,
                "splits": {k: v.to_dict() for k, v in self.splits.items()},
                "problems": self.problems, "warnings": self.warnings}

    def format(self) -> str:
        """A plain-text report: split sizes and image-size ranges, the class histogram per
        split (pixels as a share of the split's labelled pixels, and images), then the
        warnings and problems."""
        lines = []
        for split, s in self.splits.items():
            sizes = ("" if s.min_size is None else
                     f", image sizes {s.min_size[0]}x{s.min_size[1]} .. "
                     f"{s.max_size[0]}x{s.max_size[1]} (WxH)")
            labelled = int(s.class_pixels.sum())
            void = s.void_pixels / max(labelled + s.void_pixels, 1)
            lines.append(f"{split}: {s.samples} image/mask pairs{sizes}, {labelled} labelled "
                         f"pixels, {void:.1%} void")
        width = max([len(n) for n in self.class_names] + [5])
        head = f"{'class':<{width}}" + "".join(f"  {split + ' px':>10} {split + ' img':>9}"
                                               for split in self.splits)
        lines += ["", head]
        for k, name in enumerate(self.class_names):
            row = f"{name:<{width}}"
            for s in self.splits.values():
                share = s.class_pixels[k] / max(int(s.class_pixels.sum()), 1)
                row += f"  {share:>10.2%} {int(s.class_images[k]):>9d}"
            lines.append(row)
        lines += [""] + [f"warning: {w}" for w in self.warnings]
        lines += [f"problem: {p}" for p in self.problems]
        verdict = ("OK: nothing found that would make training wrong" if self.ok else
                   f"{len(self.problems)} problem(s) would make training wrong")
        return "\n".join(lines + [verdict])


def _ids_twice(datasets: Mapping[str, Any]) -> list[str]:
    """Ids listed twice within a split, and image files used by two splits."""
    problems = []
    owner: dict[str, str] = {}
    for split, ds in datasets.items():
        twice = duplicates(ds.ids)
        if twice:
            problems.append(f"the {split} split lists {len(twice)} id(s) twice: {shown(twice)}")
        paths = [str(ds.image_path(i)) if hasattr(ds, "image_path") else None for i in ds.ids]
        shared = [p for p in dict.fromkeys(paths) if p is not None and owner.get(p, split) != split]
        if shared:
            problems.append(f"{len(shared)} image(s) of the {split} split are also in the "
                            f"{owner[shared[0]]} split: {shown(shared)}")
        for p in paths:
            if p is not None:
                owner.setdefault(p, split)
    return problems


def _scan(ds: Any, split: str, num_classes: int, ignore_index: int, bar: tqdm,
          problems: list[str]) -> SplitStats:
    stats = SplitStats(len(ds.ids), np.zeros(num_classes, np.int64),
                       np.zeros(num_classes, np.int64))
    errors: list[str] = []
    for index, sample_id in enumerate(ds.ids):
        bar.update(1)
        try:
            if hasattr(ds, "load_image") and hasattr(ds, "load_mask"):
                image, mask = ds.load_image(sample_id), ds.load_mask(sample_id)
            else:  # any Dataset of {"image": (3, H, W), "mask": (H, W)} items
                item = ds[index]
                image = np.asarray(item["image"]).transpose(1, 2, 0)
                mask = np.asarray(item["mask"])
        except ValueError as err:  # unreadable file, label outside the classes: names the file
            errors.append(f"{split}: {err}")
            continue
        height, width = image.shape[:2]
        if mask.shape != (height, width):
            where = (f"'{ds.image_path(sample_id)}' and '{ds.mask_path(sample_id)}'"
                     if hasattr(ds, "mask_path") else f"id '{sample_id}'")
            errors.append(f"{split}: image and mask of different sizes, {width}x{height} vs "
                          f"{mask.shape[1]}x{mask.shape[0]} (WxH): {where}")
        counts = np.bincount(np.asarray(mask, np.int64).ravel(), minlength=256)
        stats.class_pixels += counts[:num_classes]
        stats.class_images += counts[:num_classes] > 0
        stats.void_pixels += int(counts[ignore_index]) if ignore_index < counts.size else 0
        area = width * height
        if stats.min_size is None or area < stats.min_size[0] * stats.min_size[1]:
            stats.min_size = (width, height)
        if stats.max_size is None or area > stats.max_size[0] * stats.max_size[1]:
            stats.max_size = (width, height)
    problems += errors[:MAX_LISTED]
    if len(errors) > MAX_LISTED:
        problems.append(f"{split}: {len(errors) - MAX_LISTED} more file problem(s) like these")
    return stats


def check_splits(
    datasets: Mapping[str, Any],
    class_names: Sequence[str],
    num_classes: int,
    ignore_index: int,
    progress: bool = True,
) -> DataReport:
    """Read every image and mask of every split once and report (module docstring).

    Args:
        datasets: ``{"train", "val", "test": dataset}``; a dataset has ``ids`` and either
            ``load_image(id) -> (H, W, 3)`` and ``load_mask(id) -> (H, W)`` (the toolkit's
            segmentation datasets) or items ``{"image": (3, H, W), "mask": (H, W)}``;
            ``problems`` / ``warnings`` lists from its listing are included.
        class_names: ``num_classes`` names for the histogram.
        num_classes: labels ``0 .. num_classes - 1`` are classes.
        ignore_index: the void label.
        progress: show a tqdm progress bar.

    Returns:
        The :class:`DataReport`.
    """
    problems: list[str] = []
    warnings: list[str] = []
    for split, ds in datasets.items():
        problems += getattr(ds, "problems", [])
        warnings += getattr(ds, "warnings", [])
        if len(ds.ids) == 0:
            problems.append(f"the {split} split is empty")
    problems += _ids_twice(datasets)
    total = sum(len(ds.ids) for ds in datasets.values())
    stats: dict[str, SplitStats] = {}
    with tqdm(total=total, desc="check_data", unit="img", disable=not progress,
              dynamic_ncols=True) as bar:
        for split, ds in datasets.items():
            bar.set_postfix_str(split)
            stats[split] = _scan(ds, split, num_classes, ignore_index, bar, problems)
    names = list(class_names)
    for split in ("train", "val"):
        s = stats.get(split)
        if s is None or s.samples == 0:
            continue
        absent = [names[k] for k in np.flatnonzero(s.class_pixels == 0)]
        if absent:
            warnings.append(f"{len(absent)} class(es) never occur in the {split} split: "
                            f"{shown(absent, 10)}")
    val = stats.get("val")
    if val is not None and val.samples and not val.class_pixels.any():
        problems.append(f"every pixel of the {val.samples} validation images is void "
                        f"({ignore_index}): nothing to validate on")
    return DataReport(names, stats, list(dict.fromkeys(problems)),
                      list(dict.fromkeys(warnings)))
