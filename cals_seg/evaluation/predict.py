"""Predictions on new, unlabelled images: reading them, naming the outputs, and writing the
label, confidence, entropy and overlay maps of one image (the library behind
``tools/predict_seg.py``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image

from cals_seg.data import images
from cals_seg.data.voc import voc_palette
from cals_seg.errors import DataError, UserError
from cals_seg.evaluation.inference import Prediction

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
SCALE_16 = 65535  # 16-bit PNG value of probability 1 (and of entropy ln K)
HIGHLIGHT = (255, 0, 255)  # low-confidence pixels in the overlay


class UnreadableImageError(UserError):
    """An input that is not a decodable image."""


def collect_inputs(inputs: list[str]) -> list[Path]:
    """Files named, and the images (by suffix) under folders named, in order, without repeats."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        else:
            files.append(path)  # a missing file is reported when it is read
    return list(dict.fromkeys(files))


def read_image(path: Path) -> np.ndarray:
    """RGB pixels ``(H, W, 3)`` uint8, EXIF orientation applied.

    Raises:
        UnreadableImageError: missing, unreadable, truncated or not an image, naming the file.
    """
    try:  # the one reader of training and evaluation: every mode, 16-bit scaled, EXIF
        return images.read_rgb(path, "input")
    except DataError as err:
        text = str(err).rstrip(".")
        raise UnreadableImageError(text[:1].lower() + text[1:]) from None


def output_names(files: list[Path]) -> list[str]:
    """One output name per input: its stem, made unique with its suffix and a counter."""
    used: set[str] = set()
    names = []
    for path in files:
        name = path.stem
        if name in used:
            name = f"{path.stem}_{path.suffix.lstrip('.')}"
        base, i = name, 1
        while name in used:
            i += 1
            name = f"{base}_{i}"
        used.add(name)
        names.append(name)
    return names


def to_16bit(values: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``values / scale`` in ``[0, 1]`` as uint16 (``round(x * 65535)``; half a step of error)."""
    return np.rint(np.clip(values / scale, 0.0, 1.0) * SCALE_16).astype(np.uint16)


def label_palette(colours: list[list[int]] | None = None) -> np.ndarray:
    """``(256, 3)`` uint8 colours of the label PNGs: the dataset's own ``data.palette`` for its
    classes where it has one, VOC's colours elsewhere."""
    palette = voc_palette().copy()
    if colours:
        palette[: len(colours)] = np.asarray(colours, dtype=np.uint8).reshape(-1, 3)
    return palette


def write_outputs(out: Path, name: str, image: np.ndarray, pred: Prediction, num_classes: int,
                  threshold: float, palette: np.ndarray | None = None) -> dict[str, str]:
    """The four files of one image; returns their paths by kind. ``palette``: ``(256, 3)``
    uint8 label colours (default :func:`label_palette`)."""
    label = pred.label[0].cpu().numpy().astype(np.uint8)
    confidence = pred.confidence[0].cpu().numpy()
    entropy = pred.entropy[0].cpu().numpy()
    paths = {kind: out / f"{name}_{kind}.png"
             for kind in ("label", "confidence", "entropy", "overlay")}
    palette = label_palette() if palette is None else palette
    label_png = Image.fromarray(label).convert("P")  # L -> P keeps the values
    label_png.putpalette(palette.tobytes())
    label_png.save(paths["label"], optimize=False)
    fast = [cv2.IMWRITE_PNG_COMPRESSION, 1]
    cv2.imwrite(str(paths["confidence"]), to_16bit(confidence), fast)
    cv2.imwrite(str(paths["entropy"]), to_16bit(entropy, math.log(num_classes)), fast)
    base = Image.fromarray(image)
    blended = Image.blend(base, Image.fromarray(palette[label]), 0.45)
    low = Image.fromarray(np.where(confidence < threshold, 255, 0).astype(np.uint8))
    highlighted = Image.blend(blended, Image.new("RGB", base.size, HIGHLIGHT), 0.6)
    overlay = np.asarray(Image.composite(highlighted, blended, low))
    cv2.imwrite(str(paths["overlay"]), cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR), fast)
    return {kind: str(p) for kind, p in paths.items()}


def summary(pred: Prediction, threshold: float, names: list[str]) -> dict[str, Any]:
    """Per-image numbers of the JSON line (exact means over all pixels, in float64)."""
    confidence, entropy = pred.confidence[0].double(), pred.entropy[0].double()
    areas = torch.bincount(pred.label[0].reshape(-1), minlength=len(names)).double()
    areas = (areas / areas.sum()).tolist()
    return {
        "mean_confidence": float(confidence.mean()),
        "low_confidence_fraction": float((confidence < threshold).double().mean()),
        "mean_entropy": float(entropy.mean()),
        "class_areas": {n: a for n, a in zip(names, areas, strict=True) if a > 0},
    }
