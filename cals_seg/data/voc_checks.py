"""Data rules for datasets in VOC layout, checked before the first epoch.

By rule, not by case: every split file, every image and every mask is checked once, and each
problem is named with its file:

- a split file (``ImageSets/Segmentation/<split>.txt``) lists one id per line, with no blank line
  between ids and no id twice; no id is both in ``train.txt`` (train + validation) and in
  ``val.txt`` (the test set);
- every listed id has its image and its mask (checked when the dataset is built);
- a mask is a palette or grayscale PNG whose values are classes (``[0, data.num_classes)``) or the
  void label (``data.ignore_index``);
- an image and its mask have the same size.

Only headers are read for the sizes; masks are decoded (one pass over the dataset).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cals_seg.data import images
from cals_seg.errors import DataError
from cals_seg.utils.paths import check_id, read_lines

SPLIT_FILES = ("train", "val")  # train.txt: train + validation; val.txt: the test set
SHOWN = 5  # problems named in one message


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
    """Problems of the images and masks of a VOC-layout dataset: masks that are not index
    images or hold values outside the classes, images and masks of different sizes.

    Returns:
        Up to ``limit`` problems (each naming its file) and the number of problems found.
    """
    found: list[str] = []
    count = 0
    valid = set(range(dataset.num_classes)) | {dataset.ignore_index}
    for sample_id in dataset.ids:
        image_path, mask_path = dataset.image_path(sample_id), dataset.mask_path(sample_id)
        problem = None
        try:  # the one reader's rules (cals_seg.data.images): upright sizes, known modes
            image_size = images.image_size(image_path)
            image_mode = images.header_mode(image_path)
            mode, stored = images.read_stored(mask_path, "mask")
            mask_size = (stored.shape[1], stored.shape[0])
            values = np.unique(stored) if mode in ("P", "L") else None
        except DataError as err:
            problem = str(err)
        else:
            if image_mode not in images.READABLE_MODES:
                problem = (f"image {image_path} has mode {image_mode}, which has no RGB "
                           "conversion (float or unknown); save it as 8-bit or 16-bit RGB/grey")
            elif values is None:
                problem = (f"mask {mask_path} has mode {mode}, not a palette ('P') or grayscale "
                           "('L') PNG of class indices")
            elif image_size != mask_size:
                problem = (f"image {image_path} is {image_size[0]}x{image_size[1]} but mask "
                           f"{mask_path} is {mask_size[0]}x{mask_size[1]}")
            else:
                bad = sorted(set(values.tolist()) - valid)
                if bad:
                    problem = (f"mask {mask_path} holds values {bad[:8]} outside [0, "
                               f"{dataset.num_classes}) that are not the void label "
                               f"{dataset.ignore_index}")
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
    ``ImageSets/Segmentation`` split files. The other layouts have their own checks
    (``cals_seg.data.check``, ``tools/check_data.py``)."""
    from cals_seg.data.voc import VOCSegmentation

    return isinstance(dataset, VOCSegmentation)


def check_voc_data(task: Any, splits: tuple[str, ...] = ("train", "val", "test")) -> None:
    """The data rules of this module for the splits of a task whose datasets are in VOC layout
    (other datasets are left to their own checks).

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
