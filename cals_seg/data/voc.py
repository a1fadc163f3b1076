"""PASCAL VOC 2012 semantic segmentation: layout, split files and a validating dataset.

The on-disk layout is the unmodified VOC one (docs/design.md, "Evaluation protocol")::

    VOCdevkit/VOC2012/JPEGImages/<id>.jpg
    VOCdevkit/VOC2012/SegmentationClass/<id>.png      palette PNG, index = class, 255 = void
    VOCdevkit/VOC2012/ImageSets/Segmentation/<split>.txt

The embedded synthetic dataset (:mod:`cals_seg.data.synthetic`) is written in the same layout, so
this module reads both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cals_seg.data.images import read_rgb, read_stored
from cals_seg.data.paired import SegmentationSamples, check_labels, hold_out, valid_labels
from cals_seg.data.transforms import eval_transform
from cals_seg.errors import DataError
from cals_seg.utils.paths import check_id, read_lines

VOC_CLASSES: tuple[str, ...] = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
    "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa",
    "train", "tvmonitor",
)  # fmt: skip

IMAGE_DIR = "JPEGImages"
MASK_DIR = "SegmentationClass"
SPLIT_DIR = os.path.join("ImageSets", "Segmentation")


def voc_palette(num_entries: int = 256) -> np.ndarray:
    """The standard VOC colour map: the bits of the class index interleaved into R, G and B.

    Bit ``3j`` of the index becomes bit ``7 - j`` of red, bit ``3j + 1`` of green and bit ``3j + 2``
    of blue, so index 0 is black, 1 is dark red (128, 0, 0) and 255 (void) is (224, 224, 192).

    Args:
        num_entries: number of palette entries (256 for a full PNG palette).

    Returns:
        ``uint8`` array of shape ``(num_entries, 3)``.
    """
    index = np.arange(num_entries, dtype=np.int64)
    palette = np.zeros((num_entries, 3), dtype=np.int64)
    for bit in range(8):
        for channel in range(3):
            palette[:, channel] |= ((index >> (3 * bit + channel)) & 1) << (7 - bit)
    return palette.astype(np.uint8)


def resolve_voc_root(root: str | os.PathLike) -> Path:
    """Find the ``VOC2012`` folder from any of the three usual roots.

    Accepted: the folder that contains ``VOCdevkit``, the ``VOCdevkit`` folder itself, or the
    ``VOC2012`` folder (anything that directly holds ``JPEGImages`` or ``ImageSets``).

    Args:
        root: one of the three folders above.

    Returns:
        The path of the folder holding ``JPEGImages``, ``SegmentationClass`` and ``ImageSets``.

    Raises:
        ValueError: when none of the three layouts is found under ``root``.
    """
    root = Path(root)
    candidates = [root / "VOCdevkit" / "VOC2012", root / "VOC2012", root]
    for candidate in candidates:
        if (candidate / IMAGE_DIR).is_dir() or (candidate / "ImageSets").is_dir():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise DataError(
        f"No VOC layout found under '{root}' (looked for JPEGImages/ or ImageSets/ in: {tried}). "
        "Pass the folder containing VOCdevkit, VOCdevkit itself or VOC2012, or generate the "
        "embedded dataset with `python tools/make_synthetic.py --root data/synthetic`."
    )


def read_split(root: str | os.PathLike, name: str) -> list[str]:
    """Read the image ids of ``ImageSets/Segmentation/<name>.txt`` (one id per line).

    Args:
        root: VOC root (any form accepted by :func:`resolve_voc_root`).
        name: split name, e.g. ``"train"`` or ``"val"``.

    Returns:
        The ids in file order; blank lines are skipped.

    Raises:
        ValueError: when the split file does not exist (the message lists the splits that do).
    """
    split_dir = resolve_voc_root(root) / SPLIT_DIR
    path = split_dir / f"{name}.txt"
    if not path.is_file():
        available = sorted(p.stem for p in split_dir.glob("*.txt")) if split_dir.is_dir() else []
        raise DataError(
            f"Split file '{path}' not found. Available splits: {available or 'none'}. "
            "Use one of them, or restore the file from the VOC archive."
        )
    return [check_id(line.split()[0], f"split file '{path}' line {number}")
            for number, line in enumerate(read_lines(path), start=1) if line.strip()]


def paper_split(
    root: str | os.PathLike, val_fraction: float = 0.2, seed: int = 0
) -> dict[str, list[str]]:
    """The paper's split: ``train.txt`` cut into train / val, the official ``val.txt`` as test.

    A permutation from ``numpy.random.default_rng(seed)`` picks ``round(val_fraction * n)``
    validation ids out of the ``n`` ids of ``train.txt``; both parts keep the file order. On VOC2012
    this gives 1171 train / 293 val / 1449 test ids.

    Args:
        root: VOC root (any form accepted by :func:`resolve_voc_root`).
        val_fraction: fraction of ``train.txt`` held out for validation, in ``[0, 1)``.
        seed: seed of the permutation.

    Returns:
        ``{"train": [...], "val": [...], "test": [...]}``.

    Raises:
        ValueError: for a bad ``val_fraction`` or a missing split file.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"Expected `val_fraction` to be in [0, 1), but got {val_fraction}.")
    train, val = hold_out(read_split(root, "train"), val_fraction, seed)
    return {"train": train, "val": val, "test": read_split(root, "val")}


def _read_pixels(path: Path, what: str, sample_id: str, rgb: bool) -> tuple[str, np.ndarray]:
    """Decode an image file fully and close it; every decoding failure becomes a ValueError.

    Returns:
        The PIL mode of the file and its pixels as a writable ``uint8`` array: ``(H, W, 3)`` RGB
        when ``rgb`` is True, otherwise the stored values (palette indices for mode ``P``).
    """
    if rgb:
        return "RGB", read_rgb(path, what)
    return read_stored(path, what)


class VOCSegmentation(SegmentationSamples):
    """VOC-layout segmentation dataset returning normalised image tensors and index masks.

    File existence is checked for every id at construction (cheap ``os.path.exists``); the content
    (decodability, mask values, sizes) is validated when a sample is loaded.

    Args:
        root: the folder containing ``VOCdevkit``, ``VOCdevkit`` itself, or ``VOC2012``.
        ids: image ids, or a split name (``"train"``) to read from ``ImageSets/Segmentation``.
        transform: callable ``transform(image=uint8 (H, W, 3), mask=uint8 (H, W)) -> dict`` with
            ``"image"`` and ``"mask"`` (see :mod:`cals_seg.data.transforms`). ``None`` means
            ``eval_transform(None)``: ImageNet normalisation and conversion to tensors only.
        num_classes: valid labels are ``0 .. num_classes - 1``.
        ignore_index: the void label kept as is in the masks (255 in VOC).

    Shape:
        ``sample["image"]``: ``(3, H, W)`` float32, normalised with the ImageNet mean/std.
        ``sample["mask"]``: ``(H, W)`` int64, values in ``[0, num_classes)`` or ``ignore_index``.
        ``sample["id"]``: ``str``.

    Raises:
        ValueError: at construction, for a bad root, a missing split file or ids whose image or
            mask file is missing; at load time, for an unreadable image, an RGB (non-index) mask, a
            mask value outside ``[0, num_classes)`` other than ``ignore_index``, or image and mask
            of different sizes.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        ids: Sequence[str] | str,
        transform: Callable[..., dict[str, Any]] | None = None,
        num_classes: int = 21,
        ignore_index: int = 255,
    ) -> None:
        check_labels(num_classes, ignore_index)
        self.root = resolve_voc_root(root)
        self.ids = read_split(self.root, ids) if isinstance(ids, str) else \
            [check_id(str(i), "ids") for i in ids]
        self.transform = transform if transform is not None else eval_transform(None)
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self._check_files_exist()

    def image_path(self, sample_id: str) -> Path:
        """Path of the JPEG image of ``sample_id``."""
        return self.root / IMAGE_DIR / f"{sample_id}.jpg"

    def mask_path(self, sample_id: str) -> Path:
        """Path of the palette-PNG mask of ``sample_id``."""
        return self.root / MASK_DIR / f"{sample_id}.png"

    def _check_files_exist(self) -> None:
        missing = [
            str(path)
            for sample_id in self.ids
            for path in (self.image_path(sample_id), self.mask_path(sample_id))
            if not os.path.exists(path)
        ]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise DataError(
                f"{len(missing)} image/mask file(s) listed by the split are missing under "
                f"'{self.root}': {shown}. Restore the files, or remove those ids from the split "
                "file."
            )

    def load_image(self, sample_id: str) -> np.ndarray:
        """Raw RGB image, not normalised (for plotting).

        Returns:
            ``uint8`` array of shape ``(H, W, 3)``.
        """
        return _read_pixels(self.image_path(sample_id), "image", sample_id, rgb=True)[1]

    def load_mask(self, sample_id: str) -> np.ndarray:
        """Validated label mask: the palette indices of the PNG (never its RGB colours).

        Returns:
            ``uint8`` array of shape ``(H, W)``; values in ``[0, num_classes)`` or ``ignore_index``.
        """
        path = self.mask_path(sample_id)
        mode, mask = _read_pixels(path, "mask", sample_id, rgb=False)  # P: indices, not colours
        if mode not in ("P", "L"):
            raise DataError(
                f"Mask '{path}' has mode {mode}, not a palette ('P') or grayscale ('L') PNG "
                "whose pixel values are class indices. Convert the colours to indices (e.g. "
                "with the VOC palette) and save as a palette PNG."
            )
        return valid_labels(mask, path, self.num_classes, self.ignore_index)

