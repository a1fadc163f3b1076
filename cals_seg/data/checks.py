"""Every data check, in one module: the messages of each rule written once, and the three
places they are checked from.

- **Training, before the first epoch** (:func:`check_task_data`): no split empty, enough
  training samples for a batch (per process under torch.distributed), a validation split with a
  valid pixel; for VOC layouts (``voc``, ``synthetic``) also the split files
  (:func:`check_split_files`) and every image/mask pair (:func:`check_voc_data`: mask values,
  mask mode, image and mask sizes, each problem named with its file); a warning for evaluation
  images large enough to take minutes (:func:`warn_large_images`).
- **The full report of** ``tools/check_data.py`` (:func:`check_splits`): every split read once,
  every problem listed, with statistics::

      report = check_splits({"train": ds_train, "val": ds_val, "test": ds_test},
                            class_names=names, num_classes=K, ignore_index=255)
      print(report.format()); report.ok        # False: something would make training wrong

- **Loading a sample**: the datasets refuse a mask value outside the classes and an image and
  mask of different sizes with the same words (:func:`cals_seg.data.paired.valid_labels`,
  :func:`cals_seg.data.paired.size_mismatch`).

Listing problems (files missing, images without masks, ids listed twice: ``dataset.problems``)
are found when a dataset is built; a segmentation task refuses them when it is built
(:func:`refuse_listing_problems`) and the report lists them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from cals_seg.data import images
from cals_seg.data.paired import duplicates, shown, size_mismatch
from cals_seg.errors import DataError
from cals_seg.utils.paths import check_id, read_lines

SPLITS = ("train", "val", "test")
SPLIT_FILES = ("train", "val")  # VOC: train.txt holds train + validation; val.txt the test set
SHOWN = 5  # problems named in one refusal
MAX_LISTED = 20  # file problems the report lists one by one per split; the rest are counted
# An evaluation image above this many pixels gets a warning (a 4000 x 3000 image takes
# minutes per forward pass of a ResNet encoder on a CPU).
LARGE_IMAGE_PIXELS = 2048 * 2048
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


# ----------------------------------------------------------------------------- the messages
def empty_split(split: str) -> str:
    """An empty split, and where its samples come from."""
    return (f"The {split} split is empty; check the split files under data.root (for VOC "
            "layouts, ImageSets/Segmentation/train.txt holds train + validation, val.txt the "
            "test set) and data.val_fraction")


def void_validation(images: int, ignore_index: int) -> str:
    """A validation split whose every pixel is void."""
    return (f"every pixel of the {images} validation images is void ({ignore_index}): nothing "
            "to validate or select the best epoch on; check the masks, or raise "
            "data.val_fraction")


def _refusal(message: str) -> DataError:
    """A message of this module as the one-line error of a command (a sentence)."""
    return DataError(f"{message[0].upper()}{message[1:]}.")


# ----------------------------------------------------------------------------- one sample
def read_pair(dataset: Any, index: int, decode_image: bool = True
              ) -> tuple[tuple[int, int], np.ndarray, str | None]:
    """Read sample ``index`` of ``dataset`` once: its image size, its validated mask and the
    size problem, if any.

    A toolkit dataset (``image_path``, ``load_mask``) gives its mask through ``load_mask`` (the
    mask rules, each error naming the file) and its image by ``load_image`` (``decode_image``)
    or by its header only; any other dataset by its items ``{"image": (3, H, W),
    "mask": (H, W)}``.

    Returns:
        ``((width, height), mask (H, W), problem or None)``.

    Raises:
        ValueError: an unreadable file or a mask that breaks a rule, naming the file.
    """
    sample_id = dataset.ids[index]
    if hasattr(dataset, "load_mask") and hasattr(dataset, "image_path"):
        image_path, mask_path = dataset.image_path(sample_id), dataset.mask_path(sample_id)
        if decode_image:
            height, width = dataset.load_image(sample_id).shape[:2]
        else:
            try:
                width, height = dataset.image_size(sample_id)
                mode = images.header_mode(image_path)
            except UNREADABLE as err:
                raise DataError(f"Cannot read image '{image_path}' ({type(err).__name__}: "
                                f"{err}): restore it, or remove it from the split") from err
            if mode not in images.READABLE_MODES:  # the one reader's rule, found from the header
                raise DataError(f"image {image_path} has mode {mode}, which has no RGB "
                                "conversion (float or unknown); save it as 8-bit or 16-bit "
                                "RGB/grey")
        mask = dataset.load_mask(sample_id)
    else:
        item = dataset[index]
        height, width = np.asarray(item["image"]).shape[-2:]
        mask = np.asarray(item["mask"])
        image_path = mask_path = f"id {sample_id}"
    return (width, height), mask, size_mismatch(image_path, (width, height), mask_path,
                                                mask.shape[::-1])


# ----------------------------------------------------------------------------- VOC layouts
def split_file_ids(path: str | Path) -> list[str]:
    """The ids of a split file, refusing blank lines between ids and repeated ids.

    Raises:
        DataError: naming the file, the line and the fix.
    """
    path = Path(path)
    lines = read_lines(path)
    while lines and not lines[-1].strip():  # blank lines at the end are harmless
        lines.pop()
    seen: dict[str, int] = {}
    ids = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            raise DataError(f"{path}, line {number}: a blank line between ids (a split file "
                            "lists one id per line); remove it.")
        sample_id = check_id(line.split()[0], f"{path}, line {number}")
        if sample_id in seen:
            raise DataError(f"{path}, line {number}: id {sample_id!r} is listed again (first on "
                            f"line {seen[sample_id]}); a repeated id counts twice and can land "
                            "in both train and validation. Remove the repeat.")
        seen[sample_id] = number
        ids.append(sample_id)
    return ids


def check_split_files(root: str | Path) -> None:
    """Every split file of a VOC root (:func:`split_file_ids`), and no id in both ``train.txt``
    and ``val.txt``.

    Raises:
        DataError: naming the file and the id.
    """
    folder = Path(root) / "ImageSets" / "Segmentation"
    ids = {name: split_file_ids(folder / f"{name}.txt") for name in SPLIT_FILES
           if (folder / f"{name}.txt").is_file()}
    if len(ids) == 2:
        both = sorted(set(ids["train"]) & set(ids["val"]))
        if both:
            raise DataError(
                f"{folder}/train.txt and val.txt share {len(both)} id(s) ({', '.join(both[:SHOWN])}"
                f"{', ...' if len(both) > SHOWN else ''}): val.txt is the test set, so the test "
                "would score images the model trained on. Remove them from one of the files."
            )


def sample_problems(dataset: Any, limit: int = SHOWN) -> tuple[list[str], int]:
    """Problems of the images and masks of a dataset (:func:`read_pair`, image headers only):
    unreadable files, masks that break the mask rules, images and masks of different sizes.

    Returns:
        Up to ``limit`` problems (each naming its file) and the number of problems found.
    """
    found: list[str] = []
    count = 0
    for index in range(len(dataset.ids)):
        try:
            problem = read_pair(dataset, index, decode_image=False)[2]
        except ValueError as err:
            problem = str(err).rstrip(".")
        if problem is not None:
            count += 1
            if len(found) < limit:
                found.append(problem)
    return found, count


def check_samples(dataset: Any, split: str) -> None:
    """Refuse a split with any image or mask problem (:func:`sample_problems`).

    Raises:
        DataError: the number of problems and the first ones, each with its file.
    """
    found, count = sample_problems(dataset)
    if count:
        more = f" (and {count - len(found)} more)" if count > len(found) else ""
        raise DataError(
            f"The {split} split has {count} bad sample(s): {'; '.join(found)}{more}. Fix or "
            "re-export those files, remove their ids from the split file, or set "
            "data.num_classes / data.ignore_index to match the masks."
        )


def is_voc_layout(dataset: Any) -> bool:
    """A VOC-layout dataset (``voc`` and the embedded ``synthetic``): index masks and
    ``ImageSets/Segmentation`` split files. The other layouts are checked
    when their files are listed and by :func:`check_splits` (``tools/check_data.py``)."""
    from cals_seg.data.voc import VOCSegmentation

    return isinstance(dataset, VOCSegmentation)


def check_voc_data(task: Any, splits: tuple[str, ...] = SPLITS) -> None:
    """The split files and every sample of the splits of a task whose datasets are in VOC
    layout (other datasets are left to their listing and to :func:`check_splits`).

    Raises:
        DataError: the first problem found, named with its file.
    """
    roots = set()
    for split in splits:
        dataset = getattr(task, f"{split}_set")
        if not is_voc_layout(dataset):
            continue
        if getattr(dataset, "root", None) is not None and dataset.root not in roots:
            roots.add(dataset.root)
            check_split_files(dataset.root)
        check_samples(dataset, split)


# ----------------------------------------------------------------------------- before training
def refuse_listing_problems(sets: Mapping[str, Any]) -> None:
    """The cheap data check run when a task is built: refuse splits whose listing found files
    missing, images without masks or ids listed twice (``dataset.problems``); warn about the
    rest (``dataset.warnings``: masks without images, blank lines in split files).

    Raises:
        ValueError: every problem, each naming its files, and the full check to run.
    """
    notes = dict.fromkeys(w for split in SPLITS for w in getattr(sets[split], "warnings", []))
    for note in notes:  # files training does not use: said once, not refused
        warnings.warn(f"data: {note}", stacklevel=3)
    problems = list(dict.fromkeys(p for split in SPLITS
                                  for p in getattr(sets[split], "problems", [])))
    if problems:
        raise DataError(
            f"the dataset has {len(problems)} problem(s): " + "; ".join(problems)
            + ". Fix the files (tools/check_data.py CONFIG lists every problem of the data)."
        )


def check_task_data(task: Any, batch_size: int, bounded_input: bool = False,
                    world_size: int = 1) -> None:
    """Refuse splits that would fail later (empty, fewer training samples than a batch, no
    valid validation label; VOC layouts: :func:`check_voc_data`) and warn about evaluation
    images large enough to take minutes (unless ``bounded_input``: the network input is
    resized or tiled). Under torch.distributed each of the ``world_size`` processes trains on
    its share of the split.

    Raises:
        DataError: naming the split (and the file) and the fix.
    """
    for split in SPLITS:
        if len(getattr(task, f"{split}_set")) == 0:
            raise _refusal(empty_split(split))
    check_voc_data(task)  # split files, mask values, image/mask sizes: each named with its file
    if len(task.train_set) // world_size < batch_size:
        share = "" if world_size == 1 else f" ({len(task.train_set) // world_size} per process)"
        raise DataError(
            f"The training split has {len(task.train_set)} samples{share}, fewer than "
            f"train.batch_size={batch_size} per process; lower train.batch_size."
        )
    val = task.val_set
    if hasattr(val, "load_mask") and not any(
        (val.load_mask(i) != task.ignore_index).any() for i in val.ids
    ):
        raise _refusal(void_validation(len(val), task.ignore_index))
    for split in ("val", "test"):
        warn_large_images(getattr(task, f"{split}_set"), split, bounded_input)


def warn_large_images(dataset: Any, split: str, bounded_input: bool = False) -> None:
    """Warn (once per split) when an image whose network input is the whole image, at its own
    size, is large enough to take minutes: reads image headers only."""
    if bounded_input or not hasattr(dataset, "image_size"):
        return
    for sample_id in dataset.ids:
        width, height = dataset.image_size(sample_id)
        if width * height > LARGE_IMAGE_PIXELS:
            warnings.warn(
                f"The {split} split holds a {width}x{height} image ({sample_id}); with "
                "eval.mode: whole and eval.resize: null the network sees it at that size, which "
                "can take minutes and gigabytes per image on a CPU. Set eval.resize (e.g. 1024) "
                "or eval.mode: slide (tiles of eval.window); the metrics stay on the original "
                "pixels either way.",
                stacklevel=2,
            )
            return


# ----------------------------------------------------------------------------- the full report
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
    unlisted: int = 0  # file problems found beyond the MAX_LISTED named one by one

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
    # Problems found but not listed one by one (``problems`` holds one "N more ... like these"
    # line for them per split).
    unlisted: int = 0
    summary_lines: int = 0

    @property
    def problem_count(self) -> int:
        """Every problem found: those listed, and those counted in a "more like these" line."""
        return len(self.problems) - self.summary_lines + self.unlisted

    @property
    def ok(self) -> bool:
        """True when nothing would make training wrong (warnings allowed)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "class_names": self.class_names,
                "splits": {k: v.to_dict() for k, v in self.splits.items()},
                "problems": self.problems, "problem_count": self.problem_count,
                "warnings": self.warnings}

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
                   f"{self.problem_count} problem(s) would make training wrong")
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


def _scan(ds: Any, split: str, num_classes: int, ignore_index: int, bar: Any,
          problems: list[str]) -> SplitStats:
    stats = SplitStats(len(ds.ids), np.zeros(num_classes, np.int64),
                       np.zeros(num_classes, np.int64))
    errors: list[str] = []
    for index in range(len(ds.ids)):
        bar.update(1)
        try:
            (width, height), mask, problem = read_pair(ds, index)
        except ValueError as err:  # unreadable file, label outside the classes: names the file
            errors.append(f"{split}: {err}")
            continue
        if problem is not None:
            errors.append(f"{split}: {problem}")
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
        stats.unlisted = len(errors) - MAX_LISTED
    return stats


def check_splits(
    datasets: Mapping[str, Any],
    class_names: Sequence[str],
    num_classes: int,
    ignore_index: int,
    progress: bool = True,
) -> DataReport:
    """Read every image and mask of every split once and report every problem (the module
    docstring lists them) with the statistics of each split.

    Problems (``report.problems``, each naming its files): listing problems, an empty split,
    ids or image files listed twice within or across splits, unreadable files, mask values
    outside the classes, image and mask of different sizes, a validation split without a valid
    pixel. Warnings: files without their partner that training does not use, blank lines in
    split files, classes absent from the training or the validation split.

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
    from tqdm import tqdm

    problems: list[str] = []
    notes: list[str] = []
    for split, ds in datasets.items():
        problems += getattr(ds, "problems", [])
        notes += getattr(ds, "warnings", [])
        if len(ds.ids) == 0:
            problems.append(empty_split(split))
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
            notes.append(f"{len(absent)} class(es) never occur in the {split} split: "
                         f"{shown(absent, 10)}")
    val = stats.get("val")
    if val is not None and val.samples and not val.class_pixels.any():
        problems.append(void_validation(val.samples, ignore_index))
    unlisted = [s.unlisted for s in stats.values() if s.unlisted]
    return DataReport(names, stats, list(dict.fromkeys(problems)), list(dict.fromkeys(notes)),
                      unlisted=sum(unlisted), summary_lines=len(unlisted))
