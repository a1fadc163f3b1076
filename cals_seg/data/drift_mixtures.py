"""Held-out corruptions for fitting calibrators that see the image (``image_ts``), and the
validation split with corrupted copies of every image.

The benchmark (:mod:`cals_seg.data.corruptions`) measures twelve ImageNet-C corruptions; the
drift-fitted calibrators of ``--calibrator-fit-shift`` are fitted on the three ImageNet-C held
out for validation (speckle noise, Gaussian blur, saturation), none of which lowers the contrast
or veils the image the way the benchmark's ``fog`` and ``contrast`` do. ``image_ts`` is fitted
on a mixture that covers those kinds too, with models other than the benchmark's:

==============  ==========================================================  ===================
name            model, severities 1..5                                      what it stands for
==============  ==========================================================  ===================
haze            ``J t + A (1 - t)`` (Koschmieder's scattering model),       fog, contrast
                ``t = t0 ** (0.5 + d)`` over a smooth random depth ``d`` in
                [0, 1]; mean transmission ``t0`` .7 .5 .35 .22 .12,
                airlight ``A`` drawn in [.75, .95]
low_light       ``g x ** gamma`` (under-exposure and a camera's gamma):     contrast, brightness
                ``(g, gamma)`` (.85, 1.3) (.7, 1.6) (.55, 2) (.42, 2.4)
                (.32, 2.8)
desaturate      ``(1 - a) x + a Y`` with ``Y`` the luma: ``a`` .4 .6 .8     colour, fog
                .9 1
speckle_noise   ImageNet-C's held-out noise: std .15 .2 .35 .45 .6 of       noise
                ``x + x N(0, s^2)`` (:mod:`cals_seg.data.corruptions`)
gaussian_blur   ImageNet-C's held-out blur: sigma 1 2 3 4 6                 blur, pixelate, JPEG
spatter         opaque mud blobs (thresholded smooth noise, soft edges)     occlusion
                over a fraction .03 .06 .1 .15 .22 of the image
==============  ==========================================================  ===================

``haze`` is not ImageNet-C's ``fog`` (a plasma fractal added and the image rescaled): it is the
physical model of a veil that grows with depth. ``spatter`` is ImageNet-C's held-out name, drawn
here without its liquid-drop rendering (ImageMagick effects the benchmark leaves out too).

:class:`CorruptedCopies` is the validation split with ``copies`` corrupted copies of each image
interleaved after it (item ``j`` is image ``j // (copies + 1)``, clean when ``j % (copies + 1)
== 0``); copy ``c`` of image ``i`` gets a corruption and a severity drawn uniformly (severities
1-5) from a generator seeded with ``(seed, c, i)``, and draws its noise from one seeded with
``(seed, c, i, crc32(name), severity)``: the same copies for every fit, whatever the loader.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from cals_seg.data.corruptions import (
    SEVERITIES,
    Image,
    _float,
    _uint8,
    check_severity,
    corrupted_dataset,
    corruption_function,
)
from cals_seg.errors import UserError

HAZE_TRANSMISSION = (0.7, 0.5, 0.35, 0.22, 0.12)
LOW_LIGHT = ((0.85, 1.3), (0.7, 1.6), (0.55, 2.0), (0.42, 2.4), (0.32, 2.8))
DESATURATE = (0.4, 0.6, 0.8, 0.9, 1.0)
SPATTER_FRACTION = (0.03, 0.06, 0.1, 0.15, 0.22)
MUD = (0.30, 0.22, 0.13)


def _smooth_field(h: int, w: int, cells: int, rng: np.random.Generator) -> np.ndarray:
    """``(h, w)`` float32 smooth random field in [0, 1]: uniform noise on a ``cells x cells``
    grid, resized bicubically and rescaled."""
    coarse = rng.random((cells, cells)).astype(np.float32)
    field = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
    field -= field.min()
    top = field.max()
    return field / top if top > 0 else field


def _luma(x: np.ndarray) -> np.ndarray:
    return x[..., 0] * 0.299 + x[..., 1] * 0.587 + x[..., 2] * 0.114


def haze(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``J t + A (1 - t)``, ``t = t0 ** (0.5 + d)``: ``d`` is a depth in [0, 1] (a smooth random
    field mixed with a ramp from the bottom, near, to the top, far), ``A`` an airlight."""
    x = _float(image)
    h, w = x.shape[:2]
    ramp = np.linspace(1.0, 0.0, h, dtype=np.float32)[:, None]
    depth = 0.5 * ramp + 0.5 * _smooth_field(h, w, 4, rng)
    t = HAZE_TRANSMISSION[severity - 1] ** (0.5 + depth)
    airlight = float(rng.uniform(0.75, 0.95))
    return _uint8(x * t[..., None] + airlight * (1.0 - t[..., None]))


def low_light(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``g x ** gamma``: darker, and darker still in the shadows."""
    gain, gamma = LOW_LIGHT[severity - 1]
    return _uint8(gain * _float(image) ** gamma)


def desaturate(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``(1 - a) x + a Y``: towards the grey of the same luma."""
    a = DESATURATE[severity - 1]
    x = _float(image)
    return _uint8((1.0 - a) * x + a * _luma(x)[..., None])


def spatter(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """Mud blobs: a smooth random field (cells of about an eighth of the image) thresholded at
    its ``1 - f`` quantile, edges softened over about a pixel, the blobs painted in mud."""
    x = _float(image)
    h, w = x.shape[:2]
    field = _smooth_field(h, w, 8, rng) + 0.15 * rng.random((h, w)).astype(np.float32)
    level = np.quantile(field, 1.0 - SPATTER_FRACTION[severity - 1])
    alpha = np.clip((field - level) * 20.0 + 0.5, 0.0, 1.0)
    alpha = cv2.GaussianBlur(alpha, (0, 0), 0.7)[..., None] * 0.9
    return _uint8(x * (1.0 - alpha) + np.asarray(MUD, np.float32) * alpha)


_HERE = {"haze": haze, "low_light": low_light, "desaturate": desaturate, "spatter": spatter}
IMAGE_TS_CORRUPTIONS: tuple[str, ...] = ("haze", "low_light", "desaturate", "speckle_noise",
                                         "gaussian_blur", "spatter")


def held_out_function(name: str) -> Any:
    """``fn(image uint8 (H, W, 3), severity, rng) -> uint8 (H, W, 3)`` of a held-out corruption
    (those above, or any of :mod:`cals_seg.data.corruptions`).

    Raises:
        UserError: an unknown name.
    """
    if name in _HERE:
        return _HERE[name]
    try:
        return corruption_function(name)
    except UserError:
        raise UserError(f"unknown held-out corruption {name!r}; the mixture's are "
                        f"{list(IMAGE_TS_CORRUPTIONS)}.") from None


@dataclass(frozen=True)
class HeldOutMixture:
    """Copy ``copy`` (>= 1) of every image, corrupted by one of ``names`` at one of
    ``severities``, drawn per image and seeded (module docstring); a data transform on images
    (the :func:`cals_seg.data.corruptions.corrupted_dataset` contract: ``apply``, ``key``)."""

    names: tuple[str, ...] = IMAGE_TS_CORRUPTIONS
    severities: tuple[int, ...] = SEVERITIES
    seed: int = 0
    copy: int = 1

    def __post_init__(self) -> None:
        if not self.names or not self.severities:
            raise UserError("a held-out mixture needs at least one corruption and severity.")
        for name in self.names:
            held_out_function(name)
        for s in self.severities:
            check_severity(s)

    def choice(self, index: int) -> tuple[str, int]:
        """The corruption and severity of image ``index``."""
        rng = np.random.default_rng([self.seed, 0x1A75, self.copy, int(index)])
        name = self.names[int(rng.integers(len(self.names)))]
        return name, int(self.severities[int(rng.integers(len(self.severities)))])

    def apply(self, image: Image, index: int) -> Image:
        name, severity = self.choice(index)
        rng = np.random.default_rng([self.seed, self.copy, int(index),
                                     zlib.crc32(name.encode()), severity])
        out = held_out_function(name)(np.ascontiguousarray(image), severity, rng)
        return np.ascontiguousarray(out, dtype=np.uint8)

    @property
    def key(self) -> str:
        return (f"heldout({','.join(self.names)};{','.join(map(str, self.severities))};"
                f"copy {self.copy})")


class CorruptedCopies:
    """A segmentation split with ``copies`` corrupted copies after each of its images: item
    ``j`` is image ``j // (copies + 1)``, clean when ``j % (copies + 1) == 0``, else corrupted by
    :class:`HeldOutMixture` copy ``j % (copies + 1)`` (masks unchanged).

    Raises:
        UserError: a split without ``ids`` / ``load_image`` (nothing to corrupt).
    """

    def __init__(self, dataset: Any, copies: int, names: Sequence[str] = IMAGE_TS_CORRUPTIONS,
                 severities: Sequence[int] = SEVERITIES, seed: int = 0) -> None:
        self.period = int(copies) + 1
        self.parts = [dataset] + [
            corrupted_dataset(dataset, HeldOutMixture(tuple(names), tuple(severities), seed, c))
            for c in range(1, self.period)]
        self.ids = list(getattr(dataset, "ids", range(len(dataset))))

    def __len__(self) -> int:
        return len(self.parts[0]) * self.period

    def __getitem__(self, index: int) -> Any:
        image, copy = divmod(int(index), self.period)
        return self.parts[copy][image]


__all__ = ["IMAGE_TS_CORRUPTIONS", "CorruptedCopies", "HeldOutMixture", "desaturate", "haze",
           "held_out_function", "low_light", "spatter"]
