"""Image/mask pairs on disk as a segmentation dataset: the base of the Cityscapes, ADE20K and
folder layouts, and the seeded hold-out that makes a validation split.

A layout module finds the pairs of a split (:class:`SplitFiles`: id -> image and mask paths,
plus the problems found while listing them) and subclasses :class:`PairedSegmentation` with the
one thing that differs between layouts, how a mask file becomes class indices
(:meth:`PairedSegmentation.decode_mask`)::

    files = SplitFiles({"a": (Path("img/a.jpg"), Path("ann/a.png"))})
    ds = PairedSegmentation(files, num_classes=5)
    ds[0]["image"].shape, ds[0]["mask"].shape     # (3, H, W), (H, W)

Listing problems (ids without files, images without masks, ids listed twice) do not raise here:
:func:`cals_seg.tasks.segmentation.segmentation_task` refuses a split that has any before
training starts, and ``tools/check_data.py`` reports them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from cals_seg.data import images
from cals_seg.data.images import read_stored
from cals_seg.data.transforms import eval_transform
from cals_seg.errors import DataError
from cals_seg.utils.paths import os_error

IMAGE_SUFFIXES: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
MASK_SUFFIXES: tuple[str, ...] = (".png", ".bmp", ".tif", ".tiff")  # lossless formats only


@dataclass
class SplitFiles:
    """The files of one split and what was wrong while listing them.

    Attributes:
        pairs: sample id -> ``(image path, mask path)``, in a fixed (sorted or listed) order.
        problems: messages naming the files; any of them makes training wrong (an id without
            its image, an image without its mask, an id listed twice).
        warnings: messages about things that do not change training (a mask without an image,
            a blank line in a split file).
    """

    pairs: dict[str, tuple[Path, Path]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def subset(self, ids: Iterable[str], notes: bool = True) -> SplitFiles:
        """The same split restricted to ``ids``, with its problems and warnings (``notes``)
        or without them (for the second part of a split cut in two, so nothing is said twice)."""
        return SplitFiles({i: self.pairs[i] for i in ids},
                          list(self.problems) if notes else [],
                          list(self.warnings) if notes else [])


def hold_out(ids: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split ``ids`` into ``(kept, held out)``: ``round(fraction * n)`` ids picked by a
    permutation of ``numpy.random.default_rng(seed)``; both parts keep the order of ``ids``.

    This is the rule of :func:`cals_seg.data.voc.paper_split` (VOC's 1171 / 293).

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"Expected `val_fraction` to be in [0, 1), but got {fraction}.")
    n_val = round(fraction * len(ids))
    order = np.random.default_rng(seed).permutation(len(ids))
    is_val = np.zeros(len(ids), dtype=bool)
    is_val[order[:n_val]] = True
    kept = [i for i, v in zip(ids, is_val, strict=True) if not v]
    held = [i for i, v in zip(ids, is_val, strict=True) if v]
    return kept, held


def shown(items: Sequence[Any], limit: int = 5) -> str:
    """``a, b, c, ...`` with at most ``limit`` items and the total when cut."""
    head = ", ".join(str(i) for i in items[:limit])
    return head + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def read_pixels(path: Path, what: str) -> tuple[str, np.ndarray]:
    """Decode an image file fully, upright (:mod:`cals_seg.data.images`); every decoding failure
    becomes a DataError naming the file.

    Returns:
        The PIL mode and the stored pixels as a ``uint8`` (or, for 16-bit/32-bit files, wider
        integer) array: ``(H, W)`` for one channel, ``(H, W, C)`` otherwise.
    """
    return read_stored(path, what)


def read_rgb(path: Path, what: str = "image") -> np.ndarray:
    """An image file as RGB ``uint8 (H, W, 3)``, by the one reader's rules
    (:func:`cals_seg.data.images.read_rgb`: every mode, 16-bit scaled, EXIF orientation)."""
    return images.read_rgb(path, what)


def index_mask(path: Path) -> np.ndarray:
    """The class indices stored in a mask file: a grey (``L``), palette (``P``, the indices,
    never the colours), 1-bit or 16-bit PNG, or an RGB file whose three channels are equal.

    Returns:
        ``int64`` array ``(H, W)``.

    Raises:
        ValueError: an unreadable file, or an RGB mask holding colours (naming ``data.palette``).
    """
    mode, pixels = read_pixels(path, "mask")
    if pixels.ndim == 3:
        rgb = pixels[..., :3]
        if mode in ("RGB", "RGBA") and (rgb == rgb[..., :1]).all():
            return rgb[..., 0].astype(np.int64)
        raise DataError(
            f"Mask '{path}' is a colour ({mode}) image, not class indices. Save the masks as "
            "grey or palette PNGs whose values are the classes, or give the colour of each class "
            "in data.palette (and data.void_colours) to decode the colours exactly."
        )
    return pixels.astype(np.int64)


def check_labels(num_classes: int, ignore_index: int) -> None:
    """The label rule of every segmentation dataset: ``num_classes >= 1`` classes and a void
    label in ``[num_classes, 255]`` (masks are 8-bit).

    Raises:
        ValueError: naming the argument.
    """
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(
            f"Expected `num_classes` to be a positive integer, but got {num_classes}."
        )
    if not 0 <= ignore_index <= 255 or ignore_index < num_classes:
        raise ValueError(
            f"Expected `ignore_index` to be in [num_classes, 255] = [{num_classes}, 255], "
            f"but got {ignore_index}."
        )


def valid_labels(labels: np.ndarray, path: Path, num_classes: int,
                 ignore_index: int) -> np.ndarray:
    """``labels`` as ``uint8 (H, W)`` after refusing values that are neither a class
    (``[0, num_classes)``) nor the void label: the one mask-value rule.

    Raises:
        DataError: naming the mask file, the values and the fix.
    """
    values = np.unique(labels)
    bad = values[((values < 0) | (values >= num_classes)) & (values != ignore_index)]
    if bad.size:
        raise DataError(
            f"Mask '{path}' contains values {bad.tolist()} outside [0, {num_classes}) "
            f"that are not the void label {ignore_index}. Fix the mask, or set "
            "data.num_classes / data.ignore_index to match the dataset."
        )
    return labels.astype(np.uint8)


def size_mismatch(image_path: Path | str, image_size: Sequence[int], mask_path: Path | str,
                  mask_size: Sequence[int]) -> str | None:
    """The one message for an image and a mask of different sizes (``(width, height)`` each),
    or None when they match."""
    (w, h), (mw, mh) = tuple(image_size), tuple(mask_size)
    if (w, h) == (mw, mh):
        return None
    return (f"image '{image_path}' is {w}x{h} but mask '{mask_path}' is {mw}x{mh} (WxH): "
            "different sizes; re-export the mask at the image size, or remove the pair")


class SegmentationSamples(Dataset):
    """What every image/mask dataset shares: ``len``, the sample dict of ``[i]`` and image
    sizes. A subclass sets ``ids`` and ``transform`` and gives ``image_path``, ``mask_path``,
    ``load_image`` (``uint8 (H, W, 3)``) and ``load_mask`` (validated ``uint8 (H, W)``)."""

    ids: list[str]
    transform: Callable[..., dict[str, Any]]

    def image_path(self, sample_id: str) -> Path:
        raise NotImplementedError

    def mask_path(self, sample_id: str) -> Path:
        raise NotImplementedError

    def load_image(self, sample_id: str) -> np.ndarray:
        raise NotImplementedError

    def load_mask(self, sample_id: str) -> np.ndarray:
        raise NotImplementedError

    def image_size(self, sample_id: str) -> tuple[int, int]:
        """``(width, height)`` of an image, from its header (nothing is decoded)."""
        return images.image_size(self.image_path(sample_id))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """``{"image": float32 (3, H, W), "mask": int64 (H, W), "id": str}`` after the
        transform, plus what the transform adds (e.g. ``"band"``).

        Raises:
            DataError: the image and its mask differ in size, naming both files.
        """
        sample_id = self.ids[index]
        image = self.load_image(sample_id)
        mask = self.load_mask(sample_id)
        if image.shape[:2] != mask.shape:
            raise DataError(size_mismatch(self.image_path(sample_id), image.shape[1::-1],
                                          self.mask_path(sample_id), mask.shape[::-1]))
        out = self.transform(image=image, mask=mask)
        extras = {k: v for k, v in out.items() if k not in ("image", "mask")}  # e.g. "band"
        return {
            "image": torch.as_tensor(out["image"], dtype=torch.float32),
            "mask": torch.as_tensor(out["mask"]).long(),
            "id": sample_id,
            **extras,
        }


class PairedSegmentation(SegmentationSamples):
    """Segmentation samples from image/mask file pairs, with validated labels.

    Subclasses override :meth:`decode_mask`; the default reads index masks as they are
    (:func:`index_mask`).

    Args:
        files: the split's pairs (:class:`SplitFiles`); its problems are kept in
            :attr:`problems` for the caller to refuse or report.
        transform: ``transform(image=uint8 (H, W, 3), mask=uint8 (H, W)) -> dict`` with
            ``"image"`` and ``"mask"``; ``None``: ``eval_transform(None)``.
        num_classes: valid labels are ``0 .. num_classes - 1``.
        ignore_index: the void label, in ``[num_classes, 255]``.

    Shape:
        ``sample["image"]``: ``(3, H, W)`` float32, normalised with the ImageNet mean/std.
        ``sample["mask"]``: ``(H, W)`` int64, values in ``[0, num_classes)`` or ``ignore_index``.
        ``sample["id"]``: ``str``.

    Raises:
        ValueError: at construction for bad ``num_classes`` / ``ignore_index``; at load time for
            an unreadable file, a mask value outside the classes, or image and mask of
            different sizes (each names the file).
    """

    def __init__(
        self,
        files: SplitFiles,
        transform: Callable[..., dict[str, Any]] | None = None,
        num_classes: int = 2,
        ignore_index: int = 255,
    ) -> None:
        check_labels(num_classes, ignore_index)
        self.files = files
        self.ids = list(files.pairs)
        self.problems = list(files.problems)
        self.warnings = list(files.warnings)
        self.transform = transform if transform is not None else eval_transform(None)
        self.num_classes = num_classes
        self.ignore_index = ignore_index

    def image_path(self, sample_id: str) -> Path:
        """Path of the image of ``sample_id``."""
        return self.files.pairs[sample_id][0]

    def mask_path(self, sample_id: str) -> Path:
        """Path of the mask file of ``sample_id``."""
        return self.files.pairs[sample_id][1]

    def load_image(self, sample_id: str) -> np.ndarray:
        """Raw RGB image, not normalised: ``uint8 (H, W, 3)``."""
        return read_rgb(self.image_path(sample_id))

    def decode_mask(self, path: Path) -> np.ndarray:
        """Class indices of a mask file before validation: ``int64 (H, W)``; void pixels hold
        ``self.ignore_index``. Layouts with another encoding override this."""
        return index_mask(path)

    def load_mask(self, sample_id: str) -> np.ndarray:
        """Validated label mask.

        Returns:
            ``uint8 (H, W)``; values in ``[0, num_classes)`` or ``ignore_index``.

        Raises:
            ValueError: a value outside the classes, naming the file and the values.
        """
        path = self.mask_path(sample_id)
        return valid_labels(self.decode_mask(path), path, self.num_classes, self.ignore_index)


def duplicates(ids: Iterable[str]) -> list[str]:
    """The ids that occur more than once, in first-occurrence order."""
    seen: set[str] = set()
    twice: list[str] = []
    for i in ids:
        if i in seen and i not in twice:
            twice.append(i)
        seen.add(i)
    return twice


def find_by_stem(folder: Path, suffixes: Sequence[str]) -> tuple[dict[str, Path], list[str]]:
    """Files directly in ``folder`` whose suffix (any case) is one of ``suffixes``, by stem.

    Returns:
        ``({stem: path}, problems)``; a stem with two such files (``a.jpg`` and ``a.png``) is a
        problem naming both, and is left out.
    """
    found: dict[str, list[Path]] = {}
    problems: list[str] = []
    if folder.is_dir():
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as err:
            raise DataError(str(os_error(err, folder, "list the folder"))) from None
        for entry in entries:
            path = Path(entry.path)
            try:
                is_file = entry.is_file()
            except OSError as err:  # a symbolic-link loop, a file without permission
                problems.append(str(os_error(err, path, "read")))
                continue
            if is_file and path.suffix.lower() in suffixes:
                found.setdefault(path.stem, []).append(path)
    problems += [f"two files for the id '{stem}': {shown([str(p) for p in paths])}"
                 for stem, paths in found.items() if len(paths) > 1]
    return {stem: paths[0] for stem, paths in found.items() if len(paths) == 1}, problems


def pair_by_stem(image_folder: Path, mask_folder: Path, where: str,
                 image_suffixes: Sequence[str] = IMAGE_SUFFIXES,
                 mask_suffixes: Sequence[str] = MASK_SUFFIXES, noun: str = "mask") -> SplitFiles:
    """The image/mask pairs of two folders, matched by file stem (:func:`find_by_stem`): the
    one pairing rule of the ADE20K and folder layouts.

    Problems: no image, images without their ``noun`` (mask, annotation), two files of one stem.
    Warnings: masks without an image (training does not use them).

    Args:
        where: the split as messages name it (``'training'``, a folder).
        noun: what the layout calls a mask.
    """
    images, problems = find_by_stem(image_folder, image_suffixes)
    masks, mask_problems = find_by_stem(mask_folder, mask_suffixes)
    files = SplitFiles(problems=problems + mask_problems)
    if not images:
        files.problems.append(f"no image ({', '.join(image_suffixes)}) in '{image_folder}'")
    article = "an" if noun[0] in "aeiou" else "a"
    without = [str(p) for stem, p in images.items() if stem not in masks]
    if without:
        files.problems.append(f"{len(without)} image(s) of {where} without {article} {noun} "
                              f"in '{mask_folder}': {shown(without)}")
    orphans = [str(p) for stem, p in masks.items() if stem not in images]
    if orphans:
        files.warnings.append(f"{len(orphans)} {noun}(s) of {where} without an image: "
                              f"{shown(orphans)}")
    files.pairs = {stem: (path, masks[stem]) for stem, path in images.items() if stem in masks}
    return files
