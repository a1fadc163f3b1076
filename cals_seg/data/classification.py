"""Image classification data: ImageFolder trees, split files, Tiny-ImageNet, the paper's splits.

Every reader returns a list of ``(path, label)`` samples (labels in ``[0, K)``) and the class
names; :class:`ImageClassification` turns such a list into a dataset of
``(float32 image (3, h, w), int label)`` items through an albumentations pipeline.

Layouts on disk (docs/design.md, "Evaluation protocol"):

- ImageFolder: ``root/<split>/<class>/<image>``; classes are the sorted folder names of the
  training split, and every split must have the same class folders.
- Split files (ImageNet-LT): one ``<path relative to root> <integer label>`` per line.
- Tiny-ImageNet: ``wnids.txt``, ``train/<wnid>/images/*.JPEG`` and
  ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt`` (``<file>\\t<wnid>\\t...``).
- ImageNet: ``train/<wnid>/*`` and the official validation set as ``val/<wnid>/*`` (the usual
  class-folder arrangement of ILSVRC-2012 val).

The paper's protocols (appendix "Dataset description"): Tiny-ImageNet holds 50 random training
images per class out as validation and tests on the official val; ImageNet splits its official
val 20 / 80 into validation / test (Minderer et al. 2021); ImageNet-LT uses its own val file (20
per class) and test file (the ImageNet val). Every random choice is a function of a seed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor
from torch.utils.data import Dataset

from cals_seg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from cals_seg.errors import DataError, MissingPathError
from cals_seg.utils.paths import check_id, read_lines

if TYPE_CHECKING:
    import albumentations as A

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
Sample = tuple[str, int]


# ----------------------------------------------------------------------------- transforms
class ClassificationTransform:
    """An ``A.Compose`` applied to an RGB uint8 image, returning a float32 tensor.

    The compose is exposed as ``.compose`` so that :mod:`cals_seg.training.engine` reseeds its
    RNG per
    epoch (exact resume).

    Shape:
        input ``(H, W, 3)`` uint8; output ``(3, h, w)`` float32, ImageNet-normalised.
    """

    def __init__(self, transforms: list[A.BasicTransform]) -> None:
        import albumentations as A  # (about a second of imports: when a pipeline is built)

        self.compose = A.Compose(transforms)

    def __call__(self, image: np.ndarray) -> Tensor:
        return self.compose(image=image)["image"].float()

    def __repr__(self) -> str:
        return f"ClassificationTransform({self.compose!r})"


def classification_train_transform(
    image_size: int,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    color_jitter: float = 0.4,
    random_erasing: float = 0.0,
) -> ClassificationTransform:
    """Training augmentation: random resized crop, horizontal flip, colour jitter (brightness,
    contrast and saturation by ``1 +- color_jitter``, hue untouched; skipped when 0), then
    normalisation and, with probability ``random_erasing``, one rectangle of 2-33% of the area
    set to 0 (the dataset mean after normalisation)."""
    import albumentations as A
    from albumentations.pytorch import ToTensorV2

    ops: list[A.BasicTransform] = [
        A.RandomResizedCrop(size=(image_size, image_size), scale=tuple(crop_scale)),
        A.HorizontalFlip(p=0.5),
    ]
    if color_jitter > 0:
        s = float(color_jitter)
        ops.append(A.ColorJitter(brightness=s, contrast=s, saturation=s, hue=0.0, p=0.8))
    ops.append(A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD))
    if random_erasing > 0:
        ops.append(A.Erasing(p=float(random_erasing), fill=0.0))
    ops.append(ToTensorV2())
    return ClassificationTransform(ops)


def classification_eval_transform(
    image_size: int, resize: int | None = None
) -> ClassificationTransform:
    """Evaluation: shorter side resized to ``resize`` (default ``image_size``), centre crop of
    ``image_size``, normalisation."""
    resize = image_size if resize is None else resize
    if resize < image_size:
        raise ValueError(
            f"Expected the eval resize ({resize}) to be at least image_size ({image_size})."
        )
    import albumentations as A
    from albumentations.pytorch import ToTensorV2

    return ClassificationTransform(
        [
            A.SmallestMaxSize(max_size=resize),
            A.CenterCrop(height=image_size, width=image_size),
            A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
            ToTensorV2(),
        ]
    )


# ----------------------------------------------------------------------------- dataset
def read_rgb(path: str | os.PathLike) -> np.ndarray:
    """Decode an image file to an RGB uint8 array ``(H, W, 3)``.

    Raises:
        ValueError: the file is missing or not a readable image (the message names it).
    """
    from cals_seg.data.images import read_rgb as read_upright

    return read_upright(path)  # the one reader: every mode, 16-bit scaled, EXIF orientation


class ImageClassification(Dataset):
    """``(image, label)`` items from a list of ``(path, label)`` samples.

    Args:
        samples: image paths and integer labels in ``[0, num_classes)``.
        transform: a :class:`ClassificationTransform` (or any callable on an RGB uint8 array
            returning a tensor).
        num_classes: K, used to check the labels.
        class_names: display names, ``K`` of them.

    Shape:
        item: ``image (3, h, w)`` float32, ``label`` int.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        transform: Any,
        num_classes: int,
        class_names: Sequence[str] | None = None,
    ) -> None:
        for path, label in samples:
            if not 0 <= label < num_classes:
                raise DataError(f"Label {label} of {path} is outside [0, {num_classes}).")
        self.samples = list(samples)
        self.transform = transform
        self.num_classes = num_classes
        self.class_names = list(class_names or [f"class {k}" for k in range(num_classes)])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        path, label = self.samples[index]
        return self.transform(read_rgb(path)), label

    @property
    def targets(self) -> list[int]:
        """The label of every sample, in order."""
        return [label for _, label in self.samples]

    def class_counts(self) -> list[int]:
        """Number of samples of each class (length K)."""
        return np.bincount(self.targets, minlength=self.num_classes).tolist()


# ----------------------------------------------------------------------------- layouts
def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _list_images(folder: Path) -> list[str]:
    return sorted(e.path for e in os.scandir(folder) if e.is_file() and _is_image(e.name))


def _subfolders(folder: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_dir() and not e.name.startswith("."))


def class_subfolders(folder: Path, names: Sequence[str] | None, what: str = "class") -> list[str]:
    """The class names of a ``folder/<name>/...`` split: its sub-folders, checked against
    ``names`` (the training split's) when given.

    Raises:
        ValueError: a name of ``names`` has no folder, or a folder is not in ``names``.
    """
    found = _subfolders(folder)
    names = found if names is None else list(names)
    missing = [c for c in names if c not in found]
    extra = [c for c in found if c not in names]
    if missing:
        raise DataError(f"{what.capitalize()} folder {missing[0]!r} is missing from {folder} "
                         f"({missing}).")
    if extra:
        raise DataError(f"{folder} has {what} folder(s) {extra} that the training split lacks.")
    return names


def image_folder(
    root: str | os.PathLike, split: str, classes: Sequence[str] | None = None
) -> tuple[list[Sample], list[str]]:
    """Samples of ``root/<split>/<class>/<image>``.

    Args:
        root: the tree's root.
        split: sub-folder name (``train``, ``val``, ``test``).
        classes: the class folders expected (e.g. those of the training split); ``None``: the
            sorted folders found.

    Returns:
        ``(samples, classes)`` with labels indexing ``classes``.

    Raises:
        FileNotFoundError: ``root/<split>`` does not exist.
        ValueError: a class folder of ``classes`` is missing from this split, or this split has
            a class folder not in ``classes``, or the split holds no image.
    """
    folder = Path(root) / split
    if not folder.is_dir():
        raise MissingPathError(f"Image folder {folder} does not exist.")
    classes = class_subfolders(folder, classes)
    samples = [
        (path, label) for label, c in enumerate(classes) for path in _list_images(folder / c)
    ]
    if not samples:
        raise DataError(f"{folder} holds no image (extensions {IMAGE_EXTENSIONS}).")
    return samples, list(classes)


def read_split_file(
    path: str | os.PathLike, root: str | os.PathLike, num_classes: int
) -> list[Sample]:
    """Samples of an ImageNet-LT style list: ``<path relative to root> <label>`` per line.

    Blank lines and lines starting with ``#`` are skipped.

    Raises:
        FileNotFoundError: the list file does not exist.
        ValueError: a malformed line, a label outside ``[0, num_classes)`` or an image that does
            not exist (the message names the list file and the line number), or an empty list.
    """
    path, root = Path(path), Path(root)
    if not path.is_file():
        raise MissingPathError(f"Split file {path} does not exist.")
    samples = []
    for number, line in enumerate(read_lines(path), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise DataError(f"{path}, line {number}: expected '<path> <label>', got {line!r}.")
        rel, label = check_id(parts[0], f"{path}, line {number}"), int(parts[1])
        if not 0 <= label < num_classes:
            raise DataError(
                f"{path}, line {number}: label {label} is outside [0, {num_classes}) "
                f"(data.num_classes={num_classes})."
            )
        image = root / rel
        if not image.is_file():
            raise DataError(f"{path}, line {number}: image {image} does not exist.")
        samples.append((str(image), label))
    if not samples:
        raise DataError(f"Split file {path} lists no image.")
    return samples


def tiny_imagenet(root: str | os.PathLike) -> dict[str, Any]:
    """The Tiny-ImageNet-200 layout: ``{"train": samples, "val": samples, "classes": wnids}``.

    ``val`` is the official validation set (the paper's test set).

    Raises:
        FileNotFoundError: ``wnids.txt``, ``val/val_annotations.txt`` or a class folder missing.
        ValueError: an annotation line that is malformed, names an unknown wnid or a missing
            image (file and line named), or a class without training images.
    """
    root = Path(root)
    wnids_file = root / "wnids.txt"
    if not wnids_file.is_file():
        raise MissingPathError(f"{wnids_file} does not exist; is {root} a Tiny-ImageNet tree?")
    wnids = [w.strip() for w in " ".join(read_lines(wnids_file)).split() if w.strip()]
    index = {w: i for i, w in enumerate(wnids)}
    train = []
    for label, wnid in enumerate(wnids):
        folder = root / "train" / wnid / "images"
        if not folder.is_dir():
            raise MissingPathError(f"Class folder {folder} (wnid {wnid!r}) does not exist.")
        images = _list_images(folder)
        if not images:
            raise DataError(f"{folder} holds no image.")
        train += [(p, label) for p in images]
    annotations = root / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise MissingPathError(f"{annotations} does not exist.")
    val = []
    for number, line in enumerate(read_lines(annotations), start=1):
        if not line.strip():
            continue
        parts = line.split("\t") if "\t" in line else line.split()
        if len(parts) < 2:
            raise DataError(f"{annotations}, line {number}: expected '<file> <wnid> ...'.")
        name = check_id(parts[0].strip(), f"{annotations}, line {number}")
        wnid = parts[1].strip()
        if wnid not in index:
            raise DataError(f"{annotations}, line {number}: unknown wnid {wnid!r}.")
        image = root / "val" / "images" / name
        if not image.is_file():
            raise DataError(f"{annotations}, line {number}: image {image} does not exist.")
        val.append((str(image), index[wnid]))
    return {"train": train, "val": val, "classes": wnids}


# ----------------------------------------------------------------------------- splits
def per_class_holdout(
    samples: Sequence[Sample], per_class: int, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """Split off ``per_class`` random samples of every class: ``(rest, held_out)``.

    The choice depends on ``seed`` and the sample list only; both outputs keep the input order.

    Raises:
        ValueError: a class has ``per_class`` samples or fewer (nothing would be left to train).
    """
    labels = np.asarray([label for _, label in samples])
    rng = np.random.default_rng(seed)
    held = np.zeros(len(samples), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        if len(members) <= per_class:
            raise DataError(
                f"Class {label} has {len(members)} samples; cannot hold out {per_class} per class."
            )
        held[rng.choice(members, size=per_class, replace=False)] = True
    return (
        [s for s, h in zip(samples, held, strict=True) if not h],
        [s for s, h in zip(samples, held, strict=True) if h],
    )


def fraction_split(
    samples: Sequence[Sample], fraction: float, seed: int
) -> tuple[list[Sample], list[Sample]]:
    """``(first, second)``: ``round(fraction * n_k)`` random samples of every class k go to
    ``first`` (stratified, so a 20 / 80 split of ImageNet val gives 10 / 40 per class)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"Expected `fraction` in (0, 1), but got {fraction}.")
    labels = np.asarray([label for _, label in samples])
    rng = np.random.default_rng(seed)
    first = np.zeros(len(samples), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        first[rng.choice(members, size=round(fraction * len(members)), replace=False)] = True
    return (
        [s for s, f in zip(samples, first, strict=True) if f],
        [s for s, f in zip(samples, first, strict=True) if not f],
    )


def tiny_imagenet_paper_split(
    root: str | os.PathLike, per_class: int = 50, seed: int = 0
) -> dict[str, Any]:
    """Tiny-ImageNet as in the paper: ``per_class`` random training images per class as
    validation (450 / 50 per class remain / held out), the official val (50 per class) as test.

    Returns:
        ``{"train", "val", "test": samples, "classes": wnids}``.
    """
    tiny = tiny_imagenet(root)
    train, val = per_class_holdout(tiny["train"], per_class, seed)
    return {"train": train, "val": val, "test": tiny["val"], "classes": tiny["classes"]}


def imagenet_paper_split(
    root: str | os.PathLike, val_fraction: float = 0.2, seed: int = 0
) -> dict[str, Any]:
    """ImageNet as in the paper: ``train/`` for training; the official val (``val/<wnid>/``)
    split per class into ``val_fraction`` validation (10 per class at 0.2) and the rest test.

    Returns:
        ``{"train", "val", "test": samples, "classes": wnids}``.
    """
    train, classes = image_folder(root, "train")
    official, _ = image_folder(root, "val", classes)
    val, test = fraction_split(official, val_fraction, seed)
    return {"train": train, "val": val, "test": test, "classes": classes}


def image_folder_splits(root: str | os.PathLike) -> dict[str, Any]:
    """``root/{train,val,test}/<class>/*`` with the training split's classes everywhere."""
    train, classes = image_folder(root, "train")
    val, _ = image_folder(root, "val", classes)
    test, _ = image_folder(root, "test", classes)
    return {"train": train, "val": val, "test": test, "classes": classes}


def split_file_splits(
    root: str | os.PathLike, files: dict[str, Any], num_classes: int
) -> dict[str, Any]:
    """Train / val / test from list files (``files["train"]`` ...; relative to ``root`` or
    absolute). Class names are ``class <k>`` (split files carry only integer labels)."""
    missing = [s for s in ("train", "val", "test") if s not in files]
    if missing:
        raise DataError(f"data.split_files: missing {missing}; give train, val and test lists.")
    root = Path(root)
    out: dict[str, Any] = {
        s: read_split_file(root / files[s], root, num_classes) for s in ("train", "val", "test")
    }
    out["classes"] = [f"class {k}" for k in range(num_classes)]
    return out


IMAGENET_LT_FILES = {
    "train": "ImageNet_LT_train.txt",
    "val": "ImageNet_LT_val.txt",
    "test": "ImageNet_LT_test.txt",
}

