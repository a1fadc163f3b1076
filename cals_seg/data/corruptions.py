"""Image corruptions of the ImageNet-C benchmark, as seeded data transforms (masks untouched).

The corruptions and their five severities follow Hendrycks and Dietterich, "Benchmarking Neural
Network Robustness to Common Corruptions and Perturbations" (ICLR 2019; the parameters of their
public ``make_imagenet_c`` script, for 224-pixel images), the protocol Kamann and Rother (CVPR
2020) applied to semantic segmentation. Where albumentations implements a corruption as
ImageNet-C does, it is used; where its version differs (shot noise in linear light, salt and
pepper per pixel instead of per channel value, a uniform motion-blur line, circle fog, brightness
in RGB), the corruption is written here from the paper's definition:

==================  =======  ====================================  ==============================
name                family   parameter per severity 1..5           implementation
==================  =======  ====================================  ==============================
gaussian_noise      noise    std .08 .12 .18 .26 .38 (of 1)         ``A.GaussNoise``
shot_noise          noise    photons 60 25 12 5 3                   Poisson(x c) / c, here
impulse_noise       noise    amount .03 .06 .09 .17 .27             salt & pepper per value, here
defocus_blur        blur     (radius, alias) (3,.1) (4,.5) (6,.5)   ``A.Defocus``
                             (8,.5) (10,.5)
glass_blur          blur     (sigma, delta, iterations) (.7,1,2)    ``A.GlassBlur`` (exact mode)
                             (.9,2,1) (1,2,3) (1.1,3,2) (1.5,4,2)
motion_blur         blur     (radius, sigma) (10,3) (15,5) (15,8)   Gaussian-weighted one-sided
                             (15,12) (20,15)                        line at an angle in
                                                                    [-45, 45] degrees, here
zoom_blur           blur     zooms 1..1.11 step .01, 1.16 .01,      ``A.ZoomBlur``
                             1.21 .02, 1.26 .02, 1.31 .03
fog                 weather  (strength, decay) (1.5,2) (2,2)        plasma fractal (diamond-
                             (2.5,1.7) (2.5,1.5) (3,1.4)            square), here
brightness          weather  V + .1 .2 .3 .4 .5 (HSV)               here
contrast            digital  factor .4 .3 .2 .1 .05 around the      here
                             per-channel mean
jpeg_compression    digital  quality 25 18 15 10 7                 ``A.ImageCompression``
pixelate            digital  scale .6 .5 .4 .3 .25 (area down,      ``A.Downscale``
                             nearest up)
==================  =======  ====================================  ==============================

Left out: snow, frost and spatter (ImageNet-C draws them with ImageMagick effects and photo
overlays that albumentations does not hold) and elastic_transform (it moves pixels, so the
masks would have to move too). The held-out corruptions ImageNet-C kept for validation
(``speckle_noise``: std .15 .2 .35 .45 .6 of the multiplicative noise; ``gaussian_blur``: sigma
1 2 3 4 6; ``saturate``: (factor, shift) of HSV saturation (.3,0) (.1,0) (2,0) (5,.1) (20,.2)) are
:data:`FIT_CORRUPTIONS`, the set the drift-fitted calibrators are fitted on, disjoint from the
benchmark's.

Every corruption registers itself where it is defined (``@register_corruption(name, family,
fit=False)``, in :data:`CORRUPTION_REGISTRY`); :data:`CORRUPTIONS`, :data:`FAMILIES` and
:data:`FIT_CORRUPTIONS` are views of the registry, and ``--shift NAME:S`` accepts its benchmark
names. A new corruption is one new file in ``cals_seg/data/`` (the registry imports the folder's
modules the first time its names are read).

Seeding: the corruption of image ``index`` draws from a generator seeded with
``(seed, crc32(name), severity, index)``, so every method evaluated with the same seed sees the
same corrupted images, whatever the loader's order or workers::

    tf = Corruption("fog", 3, seed=0)
    corrupted = tf.apply(image, index=7)          # uint8 (H, W, 3) -> uint8 (H, W, 3)
    test = corrupted_dataset(task.test_set, tf)    # the split with corrupted images
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from cals_seg.errors import UserError
from cals_seg.utils.registry import Registry

SEVERITIES = (1, 2, 3, 4, 5)
Image = np.ndarray
CorruptFn = Callable[[Image, int, np.random.Generator], Image]


def _float(image: Image) -> np.ndarray:
    return image.astype(np.float32) / 255.0


def _uint8(x: np.ndarray) -> Image:
    return (np.clip(x, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _album(make: Callable[[Any, Any], Any], params: Sequence[Any]) -> CorruptFn:
    """A corruption done by the albumentations transform ``make(A, params[severity - 1])``
    (``A``: the albumentations module, imported at the first call, so importing this module
    stays light), seeded from the generator."""

    def apply(image: Image, severity: int, rng: np.random.Generator) -> Image:
        import albumentations as A

        transform = make(A, params[severity - 1])
        transform.set_random_seed(int(rng.integers(2**31 - 1)))
        return transform(image=image)["image"]

    return apply


SHOT_PHOTONS = (60, 25, 12, 5, 3)
IMPULSE_AMOUNT = (0.03, 0.06, 0.09, 0.17, 0.27)
MOTION = ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15))
FOG = ((1.5, 2.0), (2.0, 2.0), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4))
BRIGHTNESS = (0.1, 0.2, 0.3, 0.4, 0.5)
CONTRAST = (0.4, 0.3, 0.2, 0.1, 0.05)
SPECKLE = (0.15, 0.2, 0.35, 0.45, 0.6)
SATURATE = ((0.3, 0.0), (0.1, 0.0), (2.0, 0.0), (5.0, 0.1), (20.0, 0.2))


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class CorruptionEntry:
    """A registered corruption: ``fn(image uint8 (H, W, 3), severity, rng) -> uint8 (H, W, 3)``,
    its ImageNet-C family (``noise``, ``blur``, ``weather``, ``digital``) and whether it is held
    out for fitting (``fit``: a :data:`FIT_CORRUPTIONS` one, never a benchmark one)."""

    fn: CorruptFn
    family: str
    fit: bool = False


# Every corruption, registered where it is defined (below, in the order of the module docstring's
# table); a new file in cals_seg/data/ registering one is found the first time names are read.
CORRUPTION_REGISTRY: Registry[CorruptionEntry] = Registry("corruption", discover="cals_seg.data")


def register_corruption(name: str, family: str, fit: bool = False) -> Callable[[CorruptFn],
                                                                                CorruptFn]:
    """Decorator: register ``fn(image, severity, rng) -> image`` as the corruption ``name``.

    Args:
        name: the name of ``--shift NAME:SEVERITY`` (unique).
        family: its family (the ``all`` tables group by it).
        fit: held out for fitting the drift calibrators (:data:`FIT_CORRUPTIONS`) instead of a
            benchmark corruption (:data:`CORRUPTIONS`, what ``--shift`` accepts).

    Returns:
        The decorator, which returns ``fn`` unchanged.
    """

    def add(fn: CorruptFn) -> CorruptFn:
        CORRUPTION_REGISTRY.register(name, CorruptionEntry(fn, family, bool(fit)))
        return fn

    return add


def corruption_families() -> dict[str, tuple[str, ...]]:
    """``{family: benchmark corruption names}`` in registration order (:data:`FAMILIES`)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, entry in CORRUPTION_REGISTRY.items():
        if not entry.fit:
            out[entry.family] = (*out.get(entry.family, ()), name)
    return out


def benchmark_corruptions() -> tuple[str, ...]:
    """The benchmark corruptions' names, in registration order (:data:`CORRUPTIONS`)."""
    return tuple(n for n, entry in CORRUPTION_REGISTRY.items() if not entry.fit)


def fit_corruptions() -> tuple[str, ...]:
    """The corruptions held out for fitting, in registration order (:data:`FIT_CORRUPTIONS`)."""
    return tuple(n for n, entry in CORRUPTION_REGISTRY.items() if entry.fit)


# The derived views of the registry, read from it at each access (a module ``__getattr__``), so
# that a corruption registered later is in them.
if TYPE_CHECKING:  # what static readers see; at run time __getattr__ computes them
    CORRUPTIONS: tuple[str, ...]
    FAMILIES: dict[str, tuple[str, ...]]
    FIT_CORRUPTIONS: tuple[str, ...]
_VIEWS: dict[str, Callable[[], Any]] = {"CORRUPTIONS": benchmark_corruptions,
                                        "FAMILIES": corruption_families,
                                        "FIT_CORRUPTIONS": fit_corruptions}


def __getattr__(name: str) -> Any:
    """``CORRUPTIONS`` / ``FAMILIES`` / ``FIT_CORRUPTIONS``: the registry's current views."""
    if name in _VIEWS:
        return _VIEWS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- the corruptions
gaussian_noise = register_corruption("gaussian_noise", "noise")(_album(
    lambda A, s: A.GaussNoise(std_range=(s, s), mean_range=(0, 0), per_channel=True, p=1.0),
    (0.08, 0.12, 0.18, 0.26, 0.38)))


@register_corruption("shot_noise", "noise")
def shot_noise(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``Poisson(x c) / c`` with ``x`` in [0, 1] and ``c`` photons (sRGB values, as ImageNet-C)."""
    c = SHOT_PHOTONS[severity - 1]
    return _uint8(rng.poisson(_float(image) * c) / c)


@register_corruption("impulse_noise", "noise")
def impulse_noise(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """Salt and pepper on a fraction ``amount`` of the values (each channel of each pixel drawn
    on its own), half white, half black."""
    amount = IMPULSE_AMOUNT[severity - 1]
    out = image.copy()
    hit = rng.random(image.shape) < amount
    salt = rng.random(image.shape) < 0.5
    out[hit & salt] = 255
    out[hit & ~salt] = 0
    return out


@register_corruption("speckle_noise", "noise", fit=True)
def speckle_noise(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``x + x N(0, s^2)``."""
    x = _float(image)
    return _uint8(x + x * rng.normal(0.0, SPECKLE[severity - 1], x.shape))


defocus_blur = register_corruption("defocus_blur", "blur")(_album(
    lambda A, c: A.Defocus(radius=(c[0], c[0]), alias_blur=(c[1], c[1]), p=1.0),
    ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5))))
glass_blur = register_corruption("glass_blur", "blur")(_album(
    lambda A, c: A.GlassBlur(sigma=c[0], max_delta=c[1], iterations=c[2], mode="exact", p=1.0),
    ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2))))


def motion_kernel(radius: int, sigma: float, angle_deg: float) -> np.ndarray:
    """``(2 radius + 1, 2 radius + 1)`` kernel: Gaussian weights ``exp(-t^2 / 2 sigma^2)`` at
    ``t = 0..radius`` along a one-sided line at ``angle_deg``, splatted bilinearly, sum 1."""
    size = 2 * radius + 1
    kernel = np.zeros((size, size), np.float64)
    angle = np.deg2rad(angle_deg)
    for t in range(radius + 1):
        w = np.exp(-(t * t) / (2.0 * sigma * sigma))
        x, y = radius + t * np.cos(angle), radius - t * np.sin(angle)
        x0, y0 = int(np.floor(x)), int(np.floor(y))
        fx, fy = x - x0, y - y0
        for dy, wy in ((0, 1 - fy), (1, fy)):
            for dx, wx in ((0, 1 - fx), (1, fx)):
                if 0 <= y0 + dy < size and 0 <= x0 + dx < size:
                    kernel[y0 + dy, x0 + dx] += w * wy * wx
    return kernel / kernel.sum()


@register_corruption("motion_blur", "blur")
def motion_blur(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """The image convolved with :func:`motion_kernel` at an angle drawn in [-45, 45] degrees."""
    radius, sigma = MOTION[severity - 1]
    kernel = motion_kernel(radius, sigma, float(rng.uniform(-45.0, 45.0)))
    blurred = cv2.filter2D(image.astype(np.float32), -1, kernel.astype(np.float32),
                           borderType=cv2.BORDER_REFLECT)
    return np.clip(blurred + 0.5, 0, 255).astype(np.uint8)


zoom_blur = register_corruption("zoom_blur", "blur")(_album(
    lambda A, c: A.ZoomBlur(max_factor=(c[0], c[0]), step_factor=(c[1], c[1]), p=1.0),
    ((1.11, 0.01), (1.16, 0.01), (1.21, 0.02), (1.26, 0.02), (1.31, 0.03))))
gaussian_blur = register_corruption("gaussian_blur", "blur", fit=True)(_album(
    lambda A, s: A.GaussianBlur(blur_limit=0, sigma_limit=(s, s), p=1.0), (1, 2, 3, 4, 6)))


def plasma_fractal(size: int, decay: float, rng: np.random.Generator) -> np.ndarray:
    """``(size, size)`` diamond-square fractal in [0, 1] (``size`` a power of two, wrapped
    edges); the random amplitude starts at 100 and is divided by ``decay`` at each halving."""
    grid = np.zeros((size, size), np.float64)
    step, amplitude = size, 100.0
    while step >= 2:
        half = step // 2
        corners = grid[0:size:step, 0:size:step]
        # squares: each centre is the mean of its four corners plus noise
        mean = (corners + np.roll(corners, -1, 0) + np.roll(corners, -1, 1)
                + np.roll(np.roll(corners, -1, 0), -1, 1)) / 4
        grid[half:size:step, half:size:step] = mean + rng.uniform(-amplitude, amplitude,
                                                                  mean.shape)
        # diamonds: each edge midpoint is the mean of its two corners and two centres
        corners = grid[0:size:step, 0:size:step]
        centres = grid[half:size:step, half:size:step]
        top = (corners + np.roll(corners, -1, 1) + centres + np.roll(centres, 1, 0)) / 4
        left = (corners + np.roll(corners, -1, 0) + centres + np.roll(centres, 1, 1)) / 4
        grid[0:size:step, half:size:step] = top + rng.uniform(-amplitude, amplitude, top.shape)
        grid[half:size:step, 0:size:step] = left + rng.uniform(-amplitude, amplitude, left.shape)
        step, amplitude = half, amplitude / decay
    grid -= grid.min()
    return grid / grid.max()


@register_corruption("fog", "weather")
def fog(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``(x + s F) max(x) / (max(x) + s)`` with ``F`` the plasma fractal (side: the next power
    of two >= the image's longest side, at least 256) cropped to the image."""
    strength, decay = FOG[severity - 1]
    x = _float(image)
    h, w = x.shape[:2]
    size = max(256, 1 << int(np.ceil(np.log2(max(h, w)))))
    x_max = x.max()
    x = x + strength * plasma_fractal(size, decay, rng)[:h, :w, None]
    return _uint8(x * x_max / (x_max + strength))


def _hsv(image: Image) -> np.ndarray:
    return cv2.cvtColor(_float(image), cv2.COLOR_RGB2HSV)  # H in [0, 360), S, V in [0, 1]


def _rgb(hsv: np.ndarray) -> Image:
    return _uint8(cv2.cvtColor(hsv.astype(np.float32), cv2.COLOR_HSV2RGB))


@register_corruption("brightness", "weather")
def brightness(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """HSV value ``V + b`` clipped to [0, 1]."""
    hsv = _hsv(image)
    hsv[..., 2] = np.clip(hsv[..., 2] + BRIGHTNESS[severity - 1], 0.0, 1.0)
    return _rgb(hsv)


@register_corruption("saturate", "weather", fit=True)
def saturate(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """HSV saturation ``S a + b`` clipped to [0, 1]."""
    a, b = SATURATE[severity - 1]
    hsv = _hsv(image)
    hsv[..., 1] = np.clip(hsv[..., 1] * a + b, 0.0, 1.0)
    return _rgb(hsv)


@register_corruption("contrast", "digital")
def contrast(image: Image, severity: int, rng: np.random.Generator) -> Image:
    """``(x - m) c + m`` with ``m`` each channel's mean over the image."""
    x = _float(image)
    mean = x.mean(axis=(0, 1), keepdims=True)
    return _uint8((x - mean) * CONTRAST[severity - 1] + mean)


jpeg_compression = register_corruption("jpeg_compression", "digital")(_album(
    lambda A, q: A.ImageCompression(compression_type="jpeg", quality_range=(q, q), p=1.0),
    (25, 18, 15, 10, 7)))
pixelate = register_corruption("pixelate", "digital")(_album(
    lambda A, s: A.Downscale(scale_range=(s, s), interpolation_pair={
        "downscale": cv2.INTER_AREA, "upscale": cv2.INTER_NEAREST}, p=1.0),
    (0.6, 0.5, 0.4, 0.3, 0.25)))


def corruption_function(name: str) -> CorruptFn:
    """``fn(image uint8 (H, W, 3), severity, rng) -> uint8 (H, W, 3)`` of a corruption name.

    Raises:
        UserError: an unknown name (the valid ones listed).
    """
    entry = CORRUPTION_REGISTRY.get(name)
    if entry is None:
        raise UserError(f"unknown corruption {name!r}; valid names are "
                        f"{list(benchmark_corruptions())} (held out for fitting: "
                        f"{list(fit_corruptions())}).")
    return entry.fn


def check_severity(severity: int) -> int:
    if isinstance(severity, bool) or not isinstance(severity, int) or severity not in SEVERITIES:
        raise UserError(f"corruption severity: expected an integer 1-5, got {severity!r}.")
    return severity


@dataclass(frozen=True)
class Corruption:
    """One corruption at one severity, seeded per image; a data transform on images only.

    ``tf.apply(image, index)`` is a pure function of ``(image, name, severity, seed, index)``;
    ``tf(image=..., mask=..., index=i)`` returns the mask unchanged (the same object).

    Shape:
        ``image (H, W, 3)`` uint8 -> ``(H, W, 3)`` uint8.
    """

    name: str
    severity: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_severity(self.severity)
        corruption_function(self.name)

    @property
    def key(self) -> str:
        """``NAME:SEVERITY``, the key of ``metrics.json["shift"]``."""
        return f"{self.name}:{self.severity}"

    def generator(self, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(self.name.encode()), self.severity,
                                      int(index)])

    def apply(self, image: Image, index: int) -> Image:
        image = np.ascontiguousarray(image)
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"corruption {self.key}: expected a uint8 (H, W, 3) image, got "
                             f"{image.dtype} {image.shape}.")
        out = corruption_function(self.name)(image, self.severity, self.generator(index))
        return np.ascontiguousarray(out, dtype=np.uint8)

    def __call__(self, *, image: Image, mask: np.ndarray | None = None, index: int = 0
                 ) -> dict[str, Any]:
        return {"image": self.apply(image, index), "mask": mask}


@dataclass(frozen=True)
class DriftMixture:
    """The corruption of image ``index`` drawn from ``names`` with a severity drawn from
    ``severities`` (0: the clean image), per image and seeded: the validation data of
    calibrators fitted for drift (Tomani et al., CVPR 2021: a range of strengths)."""

    names: tuple[str, ...] = field(default_factory=fit_corruptions)
    severities: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.names:
            corruption_function(name)
        for s in self.severities:
            if s != 0:
                check_severity(s)

    def choice(self, index: int) -> Corruption | None:
        rng = np.random.default_rng([self.seed, 0xD41F7, int(index)])
        name = self.names[int(rng.integers(len(self.names)))]
        severity = int(self.severities[int(rng.integers(len(self.severities)))])
        return None if severity == 0 else Corruption(name, severity, self.seed)

    def apply(self, image: Image, index: int) -> Image:
        chosen = self.choice(index)
        return image if chosen is None else chosen.apply(image, index)

    @property
    def key(self) -> str:
        return f"drift({','.join(self.names)};{','.join(map(str, self.severities))})"


class _CorruptedLoader:
    """``load_image`` of a dataset copy: the original image, corrupted by its index."""

    def __init__(self, load: Callable[[str], Image], corruption: Corruption | DriftMixture,
                 ids: Sequence[str]) -> None:
        self.load, self.corruption = load, corruption
        self.index = {sample_id: i for i, sample_id in enumerate(ids)}

    def __call__(self, sample_id: str) -> Image:
        return self.corruption.apply(self.load(sample_id), self.index[sample_id])


def corrupted_dataset(dataset: Any, corruption: Corruption | DriftMixture) -> Any:
    """A shallow copy of a segmentation dataset whose images are corrupted before its own
    transform (the masks, ids and transform unchanged); ``dataset`` itself is not modified.

    Raises:
        UserError: a dataset without ``ids`` and ``load_image`` (not an image/mask split).
    """
    if not (hasattr(dataset, "ids") and callable(getattr(dataset, "load_image", None))):
        raise UserError(f"corruptions apply to image/mask segmentation splits; "
                        f"{type(dataset).__name__} has no ids / load_image.")
    out = copy.copy(dataset)
    out.load_image = _CorruptedLoader(dataset.load_image, corruption, dataset.ids)
    out.corruption = corruption
    return out


def parse_shifts(items: Sequence[str], seed: int = 0) -> list[Corruption]:
    """``NAME:SEVERITY`` items, ``all:S`` (every benchmark corruption at S) and ``all`` (every
    one at every severity) to corruptions, duplicates dropped, in the order given.

    Raises:
        UserError: a malformed item, an unknown name or a severity outside 1-5.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"--shift-seed {seed!r}: expected an integer >= 0, e.g. --shift-seed 0.")
    benchmark = benchmark_corruptions()  # the registered ones (--shift's choices)
    out: dict[str, Corruption] = {}
    for item in items:
        name, sep, sev = item.partition(":")
        if name == "all" and not sep:
            pairs = [(n, s) for n in benchmark for s in SEVERITIES]
        else:
            if not sep:
                raise UserError(f"--shift {item!r}: expected NAME:SEVERITY (severity 1-5), "
                                "all:SEVERITY or all, e.g. fog:3.")
            # one ASCII digit: int() also reads other scripts' digits ("²" is refused by it
            # with a traceback, "٣" is 3), spaces and "+3"
            if sev not in {str(s) for s in SEVERITIES}:
                raise UserError(f"--shift {item!r}: severity must be one of the digits 1-5, "
                                f"e.g. {name or 'fog'}:3.")
            severity = int(sev)
            if name != "all" and name not in benchmark:
                raise UserError(f"--shift {item!r}: unknown corruption {name!r}; valid names "
                                f"are {list(benchmark)} and all.")
            pairs = [(n, severity) for n in (benchmark if name == "all" else (name,))]
        for n, s in pairs:
            c = Corruption(n, s, seed)
            out.setdefault(c.key, c)
    return list(out.values())


__all__ = [
    "CORRUPTIONS",
    "CORRUPTION_REGISTRY",
    "FAMILIES",
    "FIT_CORRUPTIONS",
    "SEVERITIES",
    "Corruption",
    "CorruptionEntry",
    "DriftMixture",
    "corrupted_dataset",
    "benchmark_corruptions",
    "corruption_families",
    "corruption_function",
    "fit_corruptions",
    "motion_kernel",
    "parse_shifts",
    "plasma_fractal",
    "register_corruption",
]
