"""Miniature dataset trees in the Cityscapes, ADE20K and folder layouts, written by the tests.

Every image is a few dozen pixels of seeded noise; every mask is drawn by hand or from a seeded
generator, so each test knows the labels it should read back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

H, W = 24, 40  # image and mask size (rows, columns)


def write_png(path: Path, array: np.ndarray, mode: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode).save(path)
    return path


def write_image(path: Path, seed: int, size: tuple[int, int] = (H, W)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    if path.suffix.lower() in (".jpg", ".jpeg"):
        image.save(path, quality=95)
    else:
        image.save(path)
    return path


def stripes(values: list[int], size: tuple[int, int] = (H, W)) -> np.ndarray:
    """A ``uint8`` mask of vertical stripes cycling through ``values``."""
    columns = np.array([values[c % len(values)] for c in range(size[1])], dtype=np.uint8)
    return np.broadcast_to(columns, size).copy()


# ----------------------------------------------------------------------------- Cityscapes
CITYSCAPES_TRAIN = {"aachen": 3, "bochum": 3}  # city -> images in train
CITYSCAPES_VAL = {"frankfurt": 2}


def cityscapes_id(city: str, i: int) -> str:
    return f"{city}_{i:06d}_000019"


def cityscapes_tree(root: Path) -> Path:
    """``leftImg8bit/{train,val}`` and ``gtFine/{train,val}`` with labelIds masks; every mask
    uses the label ids of road (7), car (26), sky (23), unlabeled (0) and the license plate
    (-1, stored as 255)."""
    seed = 0
    for split, cities in (("train", CITYSCAPES_TRAIN), ("val", CITYSCAPES_VAL)):
        for city, count in cities.items():
            for i in range(count):
                stem = cityscapes_id(city, i)
                write_image(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png", seed)
                mask = stripes([7, 26, 23, 7, 0, 255][i % 3:] + [7, 26, 23])
                write_png(root / "gtFine" / split / city / f"{stem}_gtFine_labelIds.png", mask)
                seed += 1
    return root


# ----------------------------------------------------------------------------- ADE20K
ADE_TRAIN, ADE_VAL = 5, 2


def ade20k_tree(root: Path) -> Path:
    """``ADEChallengeData2016/{images,annotations}/{training,validation}`` under ``root``;
    annotations cycle through 0 (void), 1, 2, 3 and 150."""
    base = root / "ADEChallengeData2016"
    for split, prefix, count in (("training", "train", ADE_TRAIN),
                                 ("validation", "val", ADE_VAL)):
        for i in range(count):
            stem = f"ADE_{prefix}_{i + 1:08d}"
            write_image(base / "images" / split / f"{stem}.jpg", i)
            write_png(base / "annotations" / split / f"{stem}.png",
                      stripes([1, 2, 0, 3, 150, 1][i % 2:]))
    return root


# ----------------------------------------------------------------------------- folder
FOLDER_CLASSES = ["sky", "ground", "thing"]
FOLDER_SUFFIXES = (".jpg", ".PNG", ".webp", ".tif", ".bmp", ".jpeg")


def folder_tree(root: Path, counts: dict[str, int] | None = None, split_first: bool = False
                ) -> Path:
    """Index masks (classes 0-2, void 255) in ``images/<split>`` + ``masks/<split>`` (or
    ``<split>/images`` + ``<split>/masks``); image extensions cycle through
    :data:`FOLDER_SUFFIXES`."""
    counts = counts or {"train": 4, "val": 2, "test": 2}
    seed = 0
    for split, count in counts.items():
        for i in range(count):
            stem = f"{split}_{i:03d}"
            suffix = FOLDER_SUFFIXES[seed % len(FOLDER_SUFFIXES)]
            images = root / split / "images" if split_first else root / "images" / split
            masks = root / split / "masks" if split_first else root / "masks" / split
            write_image(images / f"{stem}{suffix}", seed)
            write_png(masks / f"{stem}.png", stripes([0, 1, 2, 255, 0, 1][i % 3:]))
            seed += 1
    return root
