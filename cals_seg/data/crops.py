"""A training crop much larger than the images: every crop is mostly padding, and each step costs
as much as a crop-sized image (configs/folder_deeplabv3.yaml's ``crop_size: 512`` on small
images made an epoch 23x slower than a crop of the image size). check_data and the trainer warn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

# Warn when, at the middle of data.scale_range, the largest image covers less than this share
# of the crop.
MIN_COVERAGE = 0.25
STRIDE = 16  # the crop sizes the networks accept are multiples of it


def crop_coverage(crop_size: int, size: tuple[int, int], scale: float = 1.0) -> float:
    """Share of a ``crop_size x crop_size`` crop that an image of ``size = (W, H)`` covers at
    ``scale``: ``min(1, W s / c) * min(1, H s / c)``."""
    w, h = size
    return min(1.0, w * scale / crop_size) * min(1.0, h * scale / crop_size)


def crop_warning(crop_size: int | None, sizes: Iterable[tuple[int, int]],
                 scale_range: Sequence[float] | None = None) -> str | None:
    """The warning for a ``data.crop_size`` much larger than the training images, or None.

    Args:
        crop_size: ``data.crop_size`` (None: no cropping, nothing to say).
        sizes: ``(W, H)`` of training images (all, or a sample).
        scale_range: ``data.scale_range``; its geometric middle is the typical scale.
    """
    sizes = list(sizes)
    if not crop_size or not sizes:
        return None
    lo, hi = (scale_range or (1.0, 1.0))[:2]
    scale = math.sqrt(lo * hi) if lo > 0 and hi > 0 else 1.0
    largest = max(sizes, key=lambda s: s[0] * s[1])
    coverage = crop_coverage(crop_size, largest, scale)
    if coverage >= MIN_COVERAGE:
        return None
    side = max(largest) * scale
    better = max(STRIDE, math.ceil(side / STRIDE) * STRIDE)
    return (f"data.crop_size={crop_size} is much larger than the training images (largest "
            f"{largest[0]}x{largest[1]}, WxH): a crop is {1 - coverage:.0%} padding and each step "
            f"costs as much as a {crop_size} x {crop_size} image; use --set "
            f"data.crop_size={better} (the image size, a multiple of {STRIDE}) unless the "
            "padding is wanted.")


def sample_sizes(dataset: Any, count: int = 16) -> list[tuple[int, int]]:
    """``(W, H)`` of up to ``count`` images spread over a segmentation dataset with ``ids`` and
    ``load_image(id) -> (H, W, 3)``; empty for any other dataset."""
    ids = list(getattr(dataset, "ids", []) or [])
    if not ids or not hasattr(dataset, "load_image"):
        return []
    step = max(1, len(ids) // count)
    sizes = []
    for sample_id in ids[::step][:count]:
        image = dataset.load_image(sample_id)
        sizes.append((int(image.shape[1]), int(image.shape[0])))
    return sizes


__all__ = ["MIN_COVERAGE", "crop_coverage", "crop_warning", "sample_sizes"]
