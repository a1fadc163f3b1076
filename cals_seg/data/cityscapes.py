"""Cityscapes (fine annotations) as distributed, with the official 19 training classes.

Layout under ``data.root`` (the unpacked ``leftImg8bit_trainvaltest.zip`` and
``gtFine_trainvaltest.zip``)::

    leftImg8bit/{train,val,test}/<city>/<city>_<seq>_<frame>_leftImg8bit.png
    gtFine/{train,val,test}/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png
    gtFine/.../<city>_<seq>_<frame>_gtFine_labelTrainIds.png      (optional, see below)

Labels: a ``*_gtFine_labelTrainIds.png`` (written by cityscapesScripts'
``createTrainIdLabelImgs.py``) is read as it is where present; otherwise the ``labelIds`` mask
is mapped with :data:`LABEL_TO_TRAIN`, the official table (cityscapesScripts'
``helpers/labels.py``): the 19 evaluated classes get train ids 0-18, every other label id
(unlabeled, ego vehicle, parking, rail track, guard rail, bridge, tunnel, polegroup, caravan,
trailer, license plate ``-1`` ...) is void.

Splits (:func:`cityscapes_split`): the official ``val`` (500 images) is the test set, since the
official test masks are withheld; a seeded ``data.val_fraction`` of ``train`` (2975 images) is
the validation split, the rest trains (``val_fraction: 0.1``, seed 0: 2677 train / 298 val).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cals_seg.data.paired import PairedSegmentation, SplitFiles, hold_out, index_mask, shown
from cals_seg.errors import DataError

CITYSCAPES_CLASSES: tuple[str, ...] = (
    "road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
    "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train",
    "motorcycle", "bicycle",
)  # fmt: skip

# label id -> train id for the 19 evaluated classes; every other id (-1 .. 33) is void.
LABEL_TO_TRAIN: dict[int, int] = {
    7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11,
    25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18,
}  # fmt: skip
IMAGE_SUFFIX = "_leftImg8bit.png"
LABEL_SUFFIX = "_gtFine_labelIds.png"
TRAIN_ID_SUFFIX = "_gtFine_labelTrainIds.png"


def label_to_train_ids(label_ids: np.ndarray, void: int = 255) -> np.ndarray:
    """Map Cityscapes label ids to train ids.

    A ``uint8`` mask stores the license plate's id ``-1`` as 255; both are void.

    Args:
        label_ids: integer array of label ids (``-1 .. 33``, or 255 for ``-1``).
        void: the value of every id outside the 19 classes.

    Returns:
        ``int64`` array of the same shape: ``0 .. 18`` or ``void``.

    Raises:
        ValueError: a value that is no Cityscapes label id (the values are listed).
    """
    ids = np.asarray(label_ids).astype(np.int64)
    ids = np.where(ids == 255, -1, ids)
    bad = np.unique(ids[(ids < -1) | (ids > 33)])
    if bad.size:
        raise DataError(f"values {bad.tolist()} are not Cityscapes label ids (-1 .. 33)")
    table = np.full(35, void, dtype=np.int64)  # index: label id + 1
    for label, train in LABEL_TO_TRAIN.items():
        table[label + 1] = train
    return table[ids + 1]


def _images(root: Path, split: str) -> dict[str, Path]:
    """``{<city>_<seq>_<frame>: image path}`` of ``leftImg8bit/<split>``, sorted by id."""
    folder = root / "leftImg8bit" / split
    found: dict[str, Path] = {}
    if folder.is_dir():
        for city in sorted(e.name for e in os.scandir(folder) if e.is_dir()):
            for name in sorted(os.listdir(folder / city)):
                if name.endswith(IMAGE_SUFFIX):
                    found[name[: -len(IMAGE_SUFFIX)]] = folder / city / name
    return dict(sorted(found.items()))


def cityscapes_files(root: str | os.PathLike, split: str) -> SplitFiles:
    """The image/mask pairs of an official split (``train``, ``val``), preferring
    ``*_labelTrainIds.png`` over ``*_labelIds.png`` per image.

    Problems: a missing ``leftImg8bit/<split>`` folder or no image in it, and images without
    a mask (named). Warnings: masks without an image.

    Raises:
        ValueError: ``root`` is not a Cityscapes root (no ``leftImg8bit/`` and ``gtFine/``).
    """
    root = Path(root)
    if not (root / "leftImg8bit").is_dir() or not (root / "gtFine").is_dir():
        raise DataError(
            f"data.root '{root}' is not a Cityscapes root: it needs leftImg8bit/ and gtFine/ "
            "(unzip leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip into it)."
        )
    files = SplitFiles()
    images = _images(root, split)
    if not images:
        files.problems.append(f"no *{IMAGE_SUFFIX} image under '{root / 'leftImg8bit' / split}'")
    missing = []
    for sample_id, image in images.items():
        ann = root / "gtFine" / split / image.parent.name
        train_ids = ann / f"{sample_id}{TRAIN_ID_SUFFIX}"
        label_ids = ann / f"{sample_id}{LABEL_SUFFIX}"
        mask = train_ids if train_ids.is_file() else label_ids
        if mask.is_file():
            files.pairs[sample_id] = (image, mask)
        else:
            missing.append(str(label_ids))
    if missing:
        files.problems.append(f"{len(missing)} image(s) of '{split}' without their mask: "
                              f"{shown(missing)}")
    masks = (root / "gtFine" / split).glob(f"*/*{LABEL_SUFFIX}")
    orphans = sorted(str(m) for m in masks if m.name[: -len(LABEL_SUFFIX)] not in images)
    if orphans:
        files.warnings.append(f"{len(orphans)} mask(s) of '{split}' without their image: "
                              f"{shown(orphans)}")
    return files


def cityscapes_split(
    root: str | os.PathLike, val_fraction: float = 0.1, seed: int = 0
) -> dict[str, SplitFiles]:
    """``{"train", "val", "test"}``: ``train`` cut by :func:`cals_seg.data.paired.hold_out`
    into train / val, the official ``val`` as test."""
    pool = cityscapes_files(root, "train")
    train, val = hold_out(list(pool.pairs), val_fraction, seed)
    return {"train": pool.subset(train), "val": pool.subset(val, notes=False),
            "test": cityscapes_files(root, "val")}


class CityscapesSegmentation(PairedSegmentation):
    """Cityscapes pairs with masks in train ids (``0 .. 18``, void ``ignore_index``).

    Args: as :class:`cals_seg.data.paired.PairedSegmentation`, with ``num_classes`` 19.
    """

    def decode_mask(self, path: Path) -> np.ndarray:
        raw = index_mask(path)
        if path.name.endswith(TRAIN_ID_SUFFIX):
            return np.where(raw == 255, self.ignore_index, raw)
        try:
            return label_to_train_ids(raw, void=self.ignore_index)
        except ValueError as err:
            raise DataError(f"Mask '{path}': {err}; restore it from gtFine_trainvaltest.zip.") \
                from None
