"""Any folder of images and masks matched by file stem: ``data.name: folder``.

Three layouts are recognised under ``data.root`` (``images`` and ``masks`` are
``data.image_dir`` and ``data.mask_dir``)::

    images/<split>/<stem>.<ext>    masks/<split>/<stem>.png       sub-folders per split
    <split>/images/<stem>.<ext>    <split>/masks/<stem>.png       the same, split first
    images/<stem>.<ext>            masks/<stem>.png               + data.split_files

``<split>`` is ``train`` (or ``training``), ``val`` (``valid``, ``validation``) and ``test``
(``testing``); with ``data.split_files`` (``{train, val, test}`` text files, relative to the
root or absolute) each line names one stem. Image extensions: ``.jpg .jpeg .png .bmp .tif
.tiff .webp`` in any case; masks are lossless (``.png .bmp .tif .tiff``). Without a validation
split, a seeded ``data.val_fraction`` of train is held out (:func:`cals_seg.data.paired.hold_out`).

Masks hold class indices (grey or palette PNG: the index, never the palette colour), or RGB
colours decoded exactly with a colour table (:class:`ColourTable`, ``data.palette``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from cals_seg.data.colours import is_colour
from cals_seg.data.paired import (
    IMAGE_SUFFIXES,
    MASK_SUFFIXES,
    PairedSegmentation,
    SplitFiles,
    duplicates,
    find_by_stem,
    hold_out,
    pair_by_stem,
    read_rgb,
    shown,
)
from cals_seg.errors import DataError
from cals_seg.utils.paths import check_id, read_lines

SPLIT_NAMES: dict[str, tuple[str, ...]] = {
    "train": ("train", "training"),
    "val": ("val", "valid", "validation"),
    "test": ("test", "testing"),
}
UNKNOWN_COLOURS = ("error", "void")


class ColourTable:
    """Exact decoding of RGB colour masks: colour ``palette[k]`` is class ``k``.

    Args:
        palette: ``K`` colours ``[r, g, b]`` (integers in ``[0, 255]``, all different).
        void_colours: colours that mean void (``ignore_index``).
        ignore_index: the void label.
        unknown: ``"error"`` (a colour in neither table is an error naming the file) or
            ``"void"`` (such pixels become ``ignore_index``).

    Raises:
        ValueError: a malformed or repeated colour, or a bad ``unknown``.
    """

    def __init__(
        self,
        palette: Sequence[Sequence[int]],
        void_colours: Sequence[Sequence[int]] = (),
        ignore_index: int = 255,
        unknown: str = "error",
    ) -> None:
        if unknown not in UNKNOWN_COLOURS:
            raise DataError(
                f"data.unknown_colours: expected one of {list(UNKNOWN_COLOURS)}, got {unknown!r}."
            )
        codes = [self._code(c, f"data.palette[{k}]") for k, c in enumerate(palette)]
        voids = [self._code(c, f"data.void_colours[{i}]") for i, c in enumerate(void_colours)]
        everything = codes + voids
        twice = duplicates(str(c) for c in everything)
        if twice:
            colours = [self._rgb(int(c)) for c in twice]
            raise DataError(f"data.palette / data.void_colours: the colour(s) {colours} are "
                             "listed twice; each colour must name one class (or void).")
        labels = list(range(len(codes))) + [ignore_index] * len(voids)
        order = np.argsort(everything)
        self.codes = np.asarray(everything, dtype=np.int64)[order]
        self.labels = np.asarray(labels, dtype=np.int64)[order]
        self.num_colours = len(codes)
        self.ignore_index = ignore_index
        self.unknown = unknown

    @staticmethod
    def _code(colour: Sequence[int], key: str) -> int:
        if not is_colour(colour):
            raise DataError(f"{key}: expected a colour [r, g, b] of integers in [0, 255], got "
                             f"{colour!r}.")
        r, g, b = colour
        return (r << 16) | (g << 8) | b

    @staticmethod
    def _rgb(code: int) -> list[int]:
        return [(code >> 16) & 255, (code >> 8) & 255, code & 255]

    def __call__(self, rgb: np.ndarray, where: str = "mask") -> np.ndarray:
        """Class indices of an RGB mask.

        Shape:
            ``rgb (H, W, 3)`` uint8 -> ``(H, W)`` int64.

        Raises:
            ValueError: with ``unknown="error"``, a colour outside the tables, naming ``where``
                and the colours (with their pixel counts).
        """
        rgb = rgb.astype(np.int64)
        code = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
        pos = np.searchsorted(self.codes, code).clip(max=len(self.codes) - 1)
        known = self.codes[pos] == code
        labels = np.where(known, self.labels[pos], self.ignore_index)
        if self.unknown == "error" and not known.all():
            values, counts = np.unique(code[~known], return_counts=True)
            found = [f"{self._rgb(int(v))} ({n} px)" for v, n in zip(values, counts, strict=True)]
            raise DataError(
                f"Mask '{where}' holds {len(values)} colour(s) that are not in data.palette "
                f"(nor data.void_colours): {shown(found)}. Add them to data.palette or "
                "data.void_colours, or set data.unknown_colours: void to treat them as void."
            )
        return labels


def _split_folder(base: Path, split: str) -> Path | None:
    for name in SPLIT_NAMES[split]:
        if (base / name).is_dir():
            return base / name
    return None


def read_stem_list(path: Path) -> tuple[list[str], list[str]]:
    """The stems listed in a split file, one per line (first word; a known image extension is
    dropped), and warnings for blank lines between entries.

    Raises:
        ValueError: the file does not exist.
    """
    if not path.is_file() and not path.is_symlink():  # a broken link: read_lines says why
        raise DataError(f"data.split_files: the split file '{path}' does not exist.")
    lines = read_lines(path)
    while lines and not lines[-1].strip():
        lines.pop()
    stems, blank = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            blank.append(number)
            continue
        word = check_id(line.split()[0], f"split file '{path}' line {number}")
        stems.append(word[: -len(Path(word).suffix)] if Path(word).suffix.lower()
                     in IMAGE_SUFFIXES else word)
    warnings = [f"split file '{path}' has blank line(s) {shown(blank)} (skipped)"] if blank else []
    return stems, warnings


def _listed(root: Path, image_dir: str, mask_dir: str,
            split_files: Mapping[str, str]) -> dict[str, SplitFiles]:
    images, image_problems = find_by_stem(root / image_dir, IMAGE_SUFFIXES)
    masks, mask_problems = find_by_stem(root / mask_dir, MASK_SUFFIXES)
    out: dict[str, SplitFiles] = {}
    owner: dict[str, str] = {}
    for split in ("train", "val", "test"):
        if split not in split_files:
            continue
        path = Path(split_files[split])
        path = path if path.is_absolute() else root / path
        stems, warnings = read_stem_list(path)
        files = SplitFiles(warnings=warnings)
        twice = duplicates(stems)
        if twice:
            files.problems.append(f"split file '{path}' lists {len(twice)} id(s) twice: "
                                  f"{shown(twice)}")
        shared = sorted({s for s in stems if owner.get(s, split) != split})
        if shared:
            files.problems.append(f"split file '{path}' lists {len(shared)} id(s) of another "
                                  f"split ({owner[shared[0]]}): {shown(shared)}")
        no_image = [s for s in stems if s not in images]
        no_mask = [s for s in stems if s in images and s not in masks]
        if no_image:
            files.problems.append(f"{len(no_image)} id(s) of '{path}' without an image in "
                                  f"'{root / image_dir}': {shown(no_image)}")
        if no_mask:
            files.problems.append(f"{len(no_mask)} id(s) of '{path}' without a mask in "
                                  f"'{root / mask_dir}': {shown(no_mask)}")
        for s in stems:
            owner.setdefault(s, split)
        files.pairs = {s: (images[s], masks[s]) for s in dict.fromkeys(stems)
                       if s in images and s in masks}
        if not stems:
            files.problems.append(f"split file '{path}' lists no id")
        out[split] = files
    if out:
        out[next(iter(out))].problems[:0] = image_problems + mask_problems
    return out


def _sub_folders(root: Path, image_dir: str, mask_dir: str) -> dict[str, SplitFiles] | None:
    """The two sub-folder layouts, or ``None`` when neither has a train folder."""
    for image_base, mask_base, split_first in (
        (root / image_dir, root / mask_dir, False), (root, root, True)
    ):
        out: dict[str, SplitFiles] = {}
        for split in ("train", "val", "test"):
            if split_first:
                folder = _split_folder(root, split)
                image_folder = folder / image_dir if folder else None
                mask_folder = folder / mask_dir if folder else None
                if image_folder is None or not image_folder.is_dir():
                    continue
            else:
                image_folder = _split_folder(image_base, split)
                if image_folder is None:
                    continue
                mask_folder = mask_base / image_folder.name
            out[split] = pair_by_stem(image_folder, mask_folder, f"'{image_folder}'")
        if "train" in out:
            return out
    return None


def folder_split(
    root: str | os.PathLike,
    image_dir: str = "images",
    mask_dir: str = "masks",
    split_files: Mapping[str, str] | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
) -> dict[str, SplitFiles]:
    """``{"train", "val", "test"}`` pairs of a folder dataset (layouts: module docstring); a
    missing val split is held out of train.

    Raises:
        ValueError: no recognised layout, no train or no test split, an unknown split-file
            key or a missing split file.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.root '{root}' is not a folder.")
    if split_files:
        unknown = sorted(set(split_files) - set(SPLIT_NAMES))
        if unknown:
            raise DataError(f"data.split_files: unknown key(s) {unknown}; valid keys are "
                             f"{list(SPLIT_NAMES)}.")
        found = _listed(root, image_dir, mask_dir, split_files)
        how = "data.split_files"
    else:
        found = _sub_folders(root, image_dir, mask_dir)
        how = "sub-folders"
        if found is None:
            raise DataError(
                f"data.root '{root}': no folder dataset found. Expected "
                f"{image_dir}/train/ + {mask_dir}/train/ (and val/, test/), or "
                f"train/{image_dir}/ + train/{mask_dir}/, or {image_dir}/ + {mask_dir}/ with "
                "data.split_files: {train: train.txt, val: val.txt, test: test.txt}."
            )
    for split in ("train", "test"):
        if split not in found:
            names = "/".join(SPLIT_NAMES[split])
            raise DataError(
                f"data.root '{root}': the folder dataset ({how}) has no {split} split; add a "
                f"{names} folder (or data.split_files.{split})."
            )
    if "val" not in found:
        pool = found["train"]
        train, val = hold_out(list(pool.pairs), val_fraction, seed)
        found["train"], found["val"] = pool.subset(train), pool.subset(val, notes=False)
    return {split: found[split] for split in ("train", "val", "test")}


class FolderSegmentation(PairedSegmentation):
    """Folder pairs; masks hold class indices, or colours decoded by ``colours``.

    Args:
        colours: a :class:`ColourTable` (``data.palette``), or ``None`` for index masks.
        **kwargs: as :class:`cals_seg.data.paired.PairedSegmentation`.
    """

    def __init__(self, *args, colours: ColourTable | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if colours is not None and colours.num_colours != self.num_classes:
            raise DataError(
                f"data.palette has {colours.num_colours} colours but data.num_classes is "
                f"{self.num_classes}; give one colour per class."
            )
        self.colours = colours

    def decode_mask(self, path: Path) -> np.ndarray:
        if self.colours is None:
            return super().decode_mask(path)
        return self.colours(read_rgb(path, "mask"), str(path))
