"""Albumentations pipelines for segmentation: image and mask move together.

Every pipeline is called as ``transform(image=uint8 (H, W, 3), mask=uint8 (H, W))`` and returns
``{"image": float32 tensor (3, h, w) normalised with the ImageNet mean/std, "mask": int64 tensor
(h, w)}``. Masks are only ever resized with nearest-neighbour interpolation and padded with the void
label, so no label value is invented.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np
import torch

if TYPE_CHECKING:
    import albumentations as A

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
VOID_LABEL = 255


class SegmentationTransform:
    """An ``A.Compose`` whose output mask is cast to ``int64`` (what ``F.cross_entropy`` expects).

    Args:
        transforms: albumentations transforms; the last ones should be ``Normalize`` and
            ``ToTensorV2``.

    Shape:
        input ``image (H, W, 3)`` uint8, ``mask (H, W)`` uint8;
        output ``image (3, h, w)`` float32, ``mask (h, w)`` int64.
    """

    def __init__(self, transforms: list[A.BasicTransform]) -> None:
        import albumentations as A  # (about a second of imports: when a pipeline is built)

        self.compose = A.Compose(transforms)
        self.extras: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {}

    def add_extra_inputs(self, fns: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]]
                         ) -> None:
        """Also output ``fn(mask, inside)`` under each name: ``mask (h, w)`` after augmentation,
        ``inside (h, w)`` bool, False on the padding the augmentation added
        (:mod:`cals_seg.data.extra_inputs`)."""
        if not self.extras:
            self.compose.add_targets({"_inside": "mask"})  # moves with the mask, padded != 1
        self.extras.update(fns)

    def __call__(self, *, image: np.ndarray, mask: np.ndarray) -> dict[str, Any]:
        if not self.extras:
            out = self.compose(image=image, mask=mask)
            return {"image": out["image"].float(), "mask": torch.as_tensor(out["mask"]).long()}
        out = self.compose(image=image, mask=mask, _inside=np.ones(mask.shape[:2], np.uint8))
        result = {"image": out["image"].float(), "mask": torch.as_tensor(out["mask"]).long()}
        aug_mask = result["mask"].numpy()
        inside = np.asarray(out["_inside"]) == 1
        for name, fn in self.extras.items():
            result[name] = torch.as_tensor(fn(aug_mask, inside))
        return result

    def __repr__(self) -> str:
        return f"SegmentationTransform({self.compose!r})"


def _normalise_and_tensor() -> list[A.BasicTransform]:
    import albumentations as A
    from albumentations.pytorch import ToTensorV2

    return [A.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD), ToTensorV2()]


def train_transform(
    crop_size: int,
    scale_range: tuple[float, float] = (0.5, 2.0),
    hflip: bool = True,
    color_jitter: float = 0.2,
    ignore_index: int = VOID_LABEL,
) -> SegmentationTransform:
    """Training augmentation: random scale, pad, random crop, flip, colour jitter.

    The image is padded with 0 and the mask with ``ignore_index`` (void), so padding never
    counts as a class.

    Args:
        crop_size: side of the square output crop.
        scale_range: range of the random scale factor (one factor for both sides).
        hflip: random horizontal flip with probability 0.5.
        color_jitter: brightness/contrast/saturation jitter strength (hue: a tenth of it),
            applied with probability 0.5; 0 switches it off. The same meaning as
            ``data.color_jitter`` for classification.
        ignore_index: the mask value of padded pixels.

    Returns:
        A pipeline producing ``image (3, crop_size, crop_size)`` and
        ``mask (crop_size, crop_size)``.
    """
    if crop_size < 1:
        raise ValueError(f"Expected `crop_size` to be a positive integer, but got {crop_size}.")
    low, high = scale_range
    if not 0 < low <= high:
        raise ValueError(f"Expected `scale_range` to be (low, high) with 0 < low <= high, but got "
                         f"{scale_range}.")
    import albumentations as A

    steps: list[A.BasicTransform] = []
    if (low, high) != (1.0, 1.0):
        steps.append(A.RandomScale(scale_limit=(low - 1.0, high - 1.0),
                                   interpolation=cv2.INTER_LINEAR,
                                   mask_interpolation=cv2.INTER_NEAREST, p=1.0))
    steps += [
        A.PadIfNeeded(min_height=crop_size, min_width=crop_size, border_mode=cv2.BORDER_CONSTANT,
                      fill=0, fill_mask=ignore_index),
        A.RandomCrop(height=crop_size, width=crop_size),
    ]
    if hflip:
        steps.append(A.HorizontalFlip(p=0.5))
    if color_jitter < 0:
        raise ValueError(f"Expected `color_jitter` to be a strength >= 0, but got {color_jitter}.")
    if color_jitter > 0:
        s = float(color_jitter)
        steps.append(A.ColorJitter(brightness=s, contrast=s, saturation=s, hue=min(s / 10, 0.5),
                                   p=0.5))
    return SegmentationTransform(steps + _normalise_and_tensor())


def _shrink_longest_side(array: np.ndarray, max_size: int, interpolation: int,
                         **_: Any) -> np.ndarray:
    """Resize so the longest side is at most ``max_size`` (never enlarges)."""
    height, width = array.shape[:2]
    scale = max_size / max(height, width)
    if scale >= 1.0:
        return array
    size = (max(1, round(width * scale)), max(1, round(height * scale)))  # cv2 wants (w, h)
    return cv2.resize(array, size, interpolation=interpolation)


def eval_transform(
    size: int | None, upscale: bool = False, ignore_index: int = VOID_LABEL, multiple: int = 1
) -> SegmentationTransform:
    """Deterministic evaluation pipeline giving every image the same ``(size, size)`` shape.

    The toolkit's own segmentation evaluation uses ``eval_transform(None)`` (normalisation
    only) and makes the network input with :mod:`cals_seg.evaluation.inference`, so that masks
    are never
    resized; a ``size`` here shrinks the mask too, and metrics taken on its output are not on
    the original pixels.

    Images whose longest side exceeds ``size`` are shrunk to it (bilinear image, nearest mask);
    then image and mask are padded at the bottom/right to ``size x size`` with 0 and
    ``ignore_index`` (void), so
    the padding is excluded from every metric and ``out[:h, :w]`` recovers the resized image.

    Args:
        size: output side, or ``None`` for normalisation and conversion to tensors only.
        upscale: also enlarge images whose longest side is below ``size`` (default: pad only, so
            no label is duplicated by resizing).
        ignore_index: the mask value of padded pixels.
        multiple: also pad (bottom/right, void) to sides divisible by it: the output stride of
            a network that needs it, so that images of any size can be evaluated.

    Returns:
        A pipeline producing ``image (3, size, size)`` and ``mask (size, size)``.
    """
    import albumentations as A

    to_multiple = [] if multiple <= 1 else [A.PadIfNeeded(
        min_height=None, min_width=None, pad_height_divisor=multiple, pad_width_divisor=multiple,
        position="top_left", border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=ignore_index)]
    if size is None:
        return SegmentationTransform(to_multiple + _normalise_and_tensor())
    if size < 1:
        raise ValueError(f"Expected `size` to be a positive integer or None, but got {size}.")
    if upscale:
        resize: A.BasicTransform = A.LongestMaxSize(max_size=size, interpolation=cv2.INTER_LINEAR,
                                                    mask_interpolation=cv2.INTER_NEAREST)
    else:
        resize = A.Lambda(
            image=partial(_shrink_longest_side, max_size=size, interpolation=cv2.INTER_LINEAR),
            mask=partial(_shrink_longest_side, max_size=size, interpolation=cv2.INTER_NEAREST),
            name="shrink_longest_side",
        )
    pad = A.PadIfNeeded(min_height=size, min_width=size, position="top_left",
                        border_mode=cv2.BORDER_CONSTANT, fill=0, fill_mask=ignore_index)
    return SegmentationTransform([resize, pad, *to_multiple, *_normalise_and_tensor()])
