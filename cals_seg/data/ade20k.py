"""ADE20K as released for the MIT Scene Parsing Benchmark (``ADEChallengeData2016.zip``).

Layout under ``data.root`` (the ``ADEChallengeData2016`` folder, or the folder holding it)::

    images/{training,validation}/ADE_<split>_<n>.jpg
    annotations/{training,validation}/ADE_<split>_<n>.png     grey PNG, 0 = other, 1-150 classes

Labels follow the usual ``reduce_zero_label`` convention: the annotation value ``v`` in
``1 .. 150`` is class ``v - 1`` and ``0`` ("other objects", not one of the 150 classes) is void.

Splits (:func:`ade20k_split`): the official ``validation`` (2000 images) is the test set, a
seeded ``data.val_fraction`` of ``training`` (20210 images) the validation split
(``val_fraction: 0.1``, seed 0: 18189 train / 2021 val).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cals_seg.data.paired import (
    PairedSegmentation,
    SplitFiles,
    hold_out,
    index_mask,
    pair_by_stem,
)
from cals_seg.errors import DataError

# The 150 classes in annotation order (value 1 .. 150): the first name of each entry of the
# benchmark's objectInfo150 table.
ADE20K_CLASSES: tuple[str, ...] = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass",
    "cabinet", "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain",
    "chair", "car", "water", "painting", "sofa", "shelf", "house", "sea", "mirror", "rug",
    "field", "armchair", "seat", "fence", "desk", "rock", "wardrobe", "lamp", "bathtub",
    "railing", "cushion", "base", "box", "column", "signboard", "chest of drawers", "counter",
    "sand", "sink", "skyscraper", "fireplace", "refrigerator", "grandstand", "path", "stairs",
    "runway", "case", "pool table", "pillow", "screen door", "stairway", "river", "bridge",
    "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench",
    "countertop", "stove", "palm", "kitchen island", "computer", "swivel chair", "boat", "bar",
    "arcade machine", "hovel", "bus", "towel", "light", "truck", "tower", "chandelier", "awning",
    "streetlight", "booth", "television receiver", "airplane", "dirt track", "apparel", "pole",
    "land", "bannister", "escalator", "ottoman", "bottle", "buffet", "poster", "stage", "van",
    "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything", "swimming pool",
    "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven", "ball",
    "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake",
    "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light",
    "tray", "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board",
    "shower", "radiator", "glass", "clock", "flag",
)  # fmt: skip


def reduce_zero_label(annotation: np.ndarray, void: int = 255) -> np.ndarray:
    """ADE20K annotation values to classes: ``v -> v - 1`` for ``v >= 1``, ``0 -> void``.

    Args:
        annotation: integer array of annotation values.
        void: the label of value 0.

    Returns:
        ``int64`` array of the same shape.
    """
    values = np.asarray(annotation).astype(np.int64)
    return np.where(values == 0, void, values - 1)


def resolve_ade20k_root(root: str | os.PathLike) -> Path:
    """The folder holding ``images/`` and ``annotations/``: ``root`` itself or
    ``root/ADEChallengeData2016``.

    Raises:
        ValueError: neither holds both folders.
    """
    root = Path(root)
    for candidate in (root, root / "ADEChallengeData2016"):
        if (candidate / "images").is_dir() and (candidate / "annotations").is_dir():
            return candidate
    raise DataError(
        f"data.root '{root}' is not an ADE20K root: neither it nor '{root}/ADEChallengeData2016' "
        "holds images/ and annotations/ (unzip ADEChallengeData2016.zip and point data.root "
        "at it)."
    )


def ade20k_files(root: str | os.PathLike, split: str) -> SplitFiles:
    """The image/mask pairs of ``images/<split>`` and ``annotations/<split>``, by file stem.

    Problems: no image, images without an annotation, two images of one stem. Warnings:
    annotations without an image.
    """
    root = resolve_ade20k_root(root)
    return pair_by_stem(root / "images" / split, root / "annotations" / split, f"'{split}'",
                        (".jpg", ".jpeg", ".png"), (".png",), noun="annotation")


def ade20k_split(
    root: str | os.PathLike, val_fraction: float = 0.1, seed: int = 0
) -> dict[str, SplitFiles]:
    """``{"train", "val", "test"}``: ``training`` cut by :func:`cals_seg.data.paired.hold_out`
    into train / val, ``validation`` as test."""
    pool = ade20k_files(root, "training")
    train, val = hold_out(list(pool.pairs), val_fraction, seed)
    return {"train": pool.subset(train), "val": pool.subset(val, notes=False),
            "test": ade20k_files(root, "validation")}


class ADE20KSegmentation(PairedSegmentation):
    """ADE20K pairs with the zero label reduced (``0 .. 149``, void ``ignore_index``).

    Args: as :class:`cals_seg.data.paired.PairedSegmentation`, with ``num_classes`` 150.
    """

    def decode_mask(self, path: Path) -> np.ndarray:
        raw = index_mask(path)
        bad = np.unique(raw[(raw < 0) | (raw > self.num_classes)])
        if bad.size:
            raise DataError(
                f"Mask '{path}' contains annotation values {bad.tolist()} outside 0 .. "
                f"{self.num_classes} (0 = void, v = class v - 1); restore it from "
                "ADEChallengeData2016.zip."
            )
        return reduce_zero_label(raw, void=self.ignore_index)
