"""Embedded defaults for classification and text: generated on a CPU in seconds, no download.

**Long-tailed images** (:func:`generate_synthetic_images`), an ImageFolder tree read by
:func:`cals_seg.data.classification.image_folder_splits`::

    <root>/{train,val,test}/<class>/<index>.png     RGB, lossless
    <root>/synthetic_cls.json                       generator parameters (written last)

Each image is one object on a cluttered, noisy background. The 10 classes come in four shape
families (discs, boxes, triangles, crosses) whose members differ only by a mean colour that is
close relative to the per-object colour noise, so classes inside a family are genuinely
confusable; a faint look-alike of a random class is blended into the background as clutter.
Training counts follow an exponential (Pareto-like) profile as in ImageNet-LT: class ``k`` has
``round(max_train * (min_train / max_train) ** (k / (K - 1)))`` images (300 ... 10 by default:
3 many-shot, 5 medium-shot and 2 few-shot classes by the >100 / 20-100 / <20 convention); the
validation (20 per class) and test (50 per class) splits are balanced.

**Topic corpus** (:func:`generate_synthetic_corpus`), the 20 Newsgroups "bydate" layout read by
:func:`cals_seg.data.text.twenty_news_paper_split`::

    <root>/20news-bydate-{train,test}/<group>/<number>     one post per file
    <root>/synthetic_text.json

Six groups over one vocabulary of pronounceable pseudo-words: shared function words (most of
every post), words of the group, and words shared by the group and its sibling (``comp.*``,
``rec.*`` and ``sci.*`` come in pairs), so siblings are confusable. Each post mixes its group's
words at a random strength with some of its sibling's and a little of a random group's; short,
weak posts are ambiguous. Posts carry headers, sometimes a quoted passage from another group
(``> ...`` after an ``In article ... writes:`` line) and a signature after ``-- ``, which the
20news reader strips.

Both generators are deterministic: item ``i`` of a split depends only on ``(seed, split, class,
i)``, and the same arguments give byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image

from cals_seg.errors import DataError
from cals_seg.utils.validation import check_int

GENERATOR_VERSION = 1
IMAGE_META = "synthetic_cls.json"
TEXT_META = "synthetic_text.json"

# name, shape, mean RGB. Index = label = frequency rank; families interleaved so every family
# has a head class and tail classes that look like it.
IMAGE_CLASSES: tuple[tuple[str, str, tuple[int, int, int]], ...] = (
    ("red_disc", "disc", (200, 70, 60)),
    ("blue_box", "box", (60, 90, 190)),
    ("green_triangle", "triangle", (70, 170, 70)),
    ("yellow_cross", "cross", (210, 200, 60)),
    ("orange_disc", "disc", (205, 120, 55)),
    ("teal_box", "box", (60, 140, 175)),
    ("olive_triangle", "triangle", (125, 165, 60)),
    ("pink_disc", "disc", (200, 85, 125)),
    ("violet_box", "box", (115, 80, 190)),
    ("khaki_cross", "cross", (185, 180, 105)),
)
TEXT_GROUPS: tuple[str, ...] = (
    "comp.graphics",
    "comp.sys.hardware",
    "rec.autos",
    "rec.motorcycles",
    "sci.med",
    "sci.space",
)
_COLOUR_STD = 24.0  # per-object colour draw around the class mean (per channel)
_PIXEL_NOISE_STD = 12.0


def long_tail_counts(num_classes: int, max_count: int, min_count: int) -> list[int]:
    """``round(max * (min / max) ** (k / (K - 1)))`` for ``k = 0 .. K - 1`` (decreasing)."""
    k = np.arange(num_classes) / max(num_classes - 1, 1)
    return [int(round(max_count * (min_count / max_count) ** f)) for f in k]


def _check_meta(root: Path, meta_name: str, meta: dict[str, Any], overwrite: bool,
                folders: list[Path]) -> bool:
    """True when ``root`` already holds this dataset; clears a stale one when allowed."""
    meta_path = root / meta_name
    if meta_path.is_file():
        if json.loads(meta_path.read_text()) == meta:
            return True
        if not overwrite:
            raise DataError(
                f"'{root}' holds a synthetic dataset generated with other parameters. Pass "
                "overwrite=True to replace it, or choose another root."
            )
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        meta_path.unlink()
    elif any(f.exists() for f in folders):
        raise DataError(
            f"'{root}' holds data not written by this generator; refusing to write into it. "
            "Choose another root."
        )
    return False


# ----------------------------------------------------------------------------- images
def _shape_mask(shape: str, size: int, rng: np.random.Generator, radius: float) -> np.ndarray:
    """``(size, size)`` uint8 mask of one randomly posed shape."""
    mask = np.zeros((size, size), dtype=np.uint8)
    cx, cy = rng.uniform(0.35 * size, 0.65 * size, size=2)
    angle = float(rng.uniform(0, 180))
    aspect = float(rng.uniform(1.0, 1.5))
    a, b = radius * np.sqrt(aspect), radius / np.sqrt(aspect)
    if shape == "disc":
        cv2.ellipse(mask, (round(cx), round(cy)), (round(a), round(b)), angle, 0, 360, 1, -1)
    elif shape == "box":
        corners = cv2.boxPoints(((cx, cy), (1.7 * a, 1.7 * b), angle))
        cv2.fillPoly(mask, [np.round(corners).astype(np.int32)], 1)
    elif shape == "triangle":
        theta = np.deg2rad(angle) + np.arange(3) * 2 * np.pi / 3 + rng.uniform(-0.2, 0.2, 3)
        points = np.stack([cx + a * np.cos(theta), cy + a * np.sin(theta)], axis=1)
        cv2.fillPoly(mask, [np.round(points).astype(np.int32)], 1)
    else:  # cross
        for extra in (0.0, 90.0):
            corners = cv2.boxPoints(((cx, cy), (2 * a, 0.8 * b), angle + extra))
            cv2.fillPoly(mask, [np.round(corners).astype(np.int32)], 1)
    return mask


def render_object_image(label: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One ``(size, size, 3)`` uint8 image of class ``label`` (drawn at 2x, then downsampled)."""
    big = 2 * size
    grey = rng.uniform(70, 180) + rng.normal(0, 12, size=3)
    coarse = grey + rng.normal(0, 18, size=(4, 4, 3))
    image = cv2.resize(coarse.astype(np.float32), (big, big), interpolation=cv2.INTER_CUBIC)
    # Clutter: a faint, small look-alike of a random class.
    _, shape, rgb = IMAGE_CLASSES[rng.integers(len(IMAGE_CLASSES))]
    clutter = _shape_mask(shape, big, rng, rng.uniform(0.1, 0.18) * big)[:, :, None]
    colour = np.asarray(rgb) + rng.normal(0, _COLOUR_STD, 3)
    alpha = rng.uniform(0.25, 0.5) * clutter
    image = image * (1 - alpha) + colour[None, None, :] * alpha
    # The object: class colour with per-object noise and a linear shading.
    _, shape, rgb = IMAGE_CLASSES[label]
    mask = _shape_mask(shape, big, rng, rng.uniform(0.2, 0.32) * big).astype(bool)
    colour = np.asarray(rgb) + rng.normal(0, _COLOUR_STD, 3)
    yy, xx = np.mgrid[0:big, 0:big] / big - 0.5
    direction = rng.normal(0, 0.2, size=2)
    shading = 1.0 + direction[0] * xx + direction[1] * yy
    image[mask] = (colour[None, None, :] * shading[:, :, None])[mask]
    image = cv2.resize(image.astype(np.float32), (size, size), interpolation=cv2.INTER_AREA)
    image = image + rng.normal(0, _PIXEL_NOISE_STD, image.shape)
    return np.clip(np.round(image), 0, 255).astype(np.uint8)


def generate_synthetic_images(
    root: str | os.PathLike,
    max_train: int = 300,
    min_train: int = 10,
    num_val: int = 20,
    num_test: int = 50,
    image_size: int = 32,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write the long-tailed image set (module docstring) as an ImageFolder tree at ``root``.

    An existing set with the same parameters is reused as is.

    Args:
        root: output folder (``root/{train,val,test}/<class>/*.png``).
        max_train: training images of the head class.
        min_train: training images of the rarest class.
        num_val: validation images per class (balanced).
        num_test: test images per class (balanced).
        image_size: side of the square images (>= 16).
        seed: generator seed.
        overwrite: replace a set generated with other parameters.

    Returns:
        ``Path(root)``.

    Raises:
        ValueError: bad arguments, or ``root`` holds other data and ``overwrite`` is False.
    """
    for name, value, low in (("max_train", max_train, 1), ("min_train", min_train, 1),
                             ("num_val", num_val, 1), ("num_test", num_test, 1),
                             ("image_size", image_size, 16)):
        check_int(name, value, low)
    if min_train > max_train:
        raise DataError(f"Expected min_train <= max_train, but got {min_train} > {max_train}.")
    root = Path(root)
    names = [name for name, _, _ in IMAGE_CLASSES]
    counts = {
        "train": long_tail_counts(len(names), max_train, min_train),
        "val": [num_val] * len(names),
        "test": [num_test] * len(names),
    }
    meta = {"generator_version": GENERATOR_VERSION, "counts": counts, "image_size": image_size,
            "seed": seed, "classes": names}
    splits = [root / s for s in counts]
    if _check_meta(root, IMAGE_META, meta, overwrite, splits):
        return root
    for split_code, (split, per_class) in enumerate(counts.items()):
        for label, (name, count) in enumerate(zip(names, per_class, strict=True)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rng = np.random.default_rng([seed, split_code, label, i])
                image = render_object_image(label, image_size, rng)
                Image.fromarray(image).save(folder / f"{i:04d}.png", optimize=False)
    (root / IMAGE_META).write_text(json.dumps(meta, indent=2) + "\n")  # last: marks completion
    return root


# ----------------------------------------------------------------------------- text
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pseudo_words(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct pronounceable words of 2-3 consonant-vowel syllables (+ a coda)."""
    words: set[str] = set()
    ordered = []
    while len(ordered) < count:
        syllables = int(rng.integers(2, 4))
        word = "".join(
            _CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
            for _ in range(syllables)
        )
        if rng.random() < 0.4:
            word += _CONSONANTS[rng.integers(len(_CONSONANTS))]
        if word not in words:
            words.add(word)
            ordered.append(word)
    return ordered


def _zipf(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


class _TopicModel:
    """Word distributions of the groups: common words, own words, words shared with a sibling."""

    def __init__(self, seed: int, num_common: int = 300, num_own: int = 80,
                 num_pair: int = 80) -> None:
        rng = np.random.default_rng([seed, 99])
        k = len(TEXT_GROUPS)
        words = _pseudo_words(num_common + k * num_own + (k // 2) * num_pair + 200, rng)
        self.common = words[:num_common]
        start = num_common
        self.own = [words[start + g * num_own: start + (g + 1) * num_own] for g in range(k)]
        start += k * num_own
        self.pair = [words[start + p * num_pair: start + (p + 1) * num_pair] for p in range(k // 2)]
        self.names = words[-200:]  # user names and hosts for headers and signatures
        self.common_p = _zipf(num_common)
        self.own_p, self.pair_p = _zipf(num_own), _zipf(num_pair)

    def topic_words(self, group: int, rng: np.random.Generator, n: int) -> list[str]:
        """``n`` words of a group: 60% its own words, 40% the words shared with its sibling."""
        own, pair = self.own[group], self.pair[group // 2]
        from_own = rng.random(n) < 0.6
        i_own = rng.choice(len(own), size=n, p=self.own_p)
        i_pair = rng.choice(len(pair), size=n, p=self.pair_p)
        return [own[a] if o else pair[b] for o, a, b in zip(from_own, i_own, i_pair, strict=True)]

    def sibling(self, group: int) -> int:
        return group ^ 1

    def post(self, group: int, rng: np.random.Generator) -> str:
        """One post of ``group``: headers, optional quote, body, signature."""
        k = len(TEXT_GROUPS)
        length = int(rng.integers(30, 150))
        strength = rng.uniform(0.05, 0.3)
        sibling = strength * rng.uniform(0.0, 0.7)
        source = rng.choice(4, size=length, p=[strength, sibling, 0.03,
                                               1 - strength - sibling - 0.03])
        other = int(rng.integers(k))
        pools = [
            iter(self.topic_words(group, rng, length)),
            iter(self.topic_words(self.sibling(group), rng, length)),
            iter(self.topic_words(other, rng, length)),
            iter(self.common[i] for i in rng.choice(len(self.common), length, p=self.common_p)),
        ]
        body = [next(pools[s]) for s in source]
        user, host = (self.names[i] for i in rng.choice(len(self.names), 2, replace=False))
        subject = " ".join(self.topic_words(group, rng, 3))
        lines = [f"From: {user}@{host}.edu", f"Subject: Re: {subject}",
                 f"Organization: {host} university", f"Lines: {length // 12 + 1}", ""]
        if rng.random() < 0.3:  # a quoted passage of another group
            quoted = self.topic_words(int(rng.integers(k)), rng, 24)
            lines.append(f"In article <{host}.{rng.integers(1000, 9999)}>, {user}@{host} writes:")
            lines += ["> " + " ".join(quoted[i:i + 12]) for i in range(0, len(quoted), 12)]
            lines.append("")
        lines += [" ".join(body[i:i + 12]) for i in range(0, len(body), 12)]
        lines += ["", "-- ", f"{user} {' '.join(self.topic_words(int(rng.integers(k)), rng, 4))}"]
        return "\n".join(lines) + "\n"


def generate_synthetic_corpus(
    root: str | os.PathLike,
    num_train: int = 250,
    num_test: int = 120,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write the six-group topic corpus (module docstring) in the 20news-bydate layout.

    Args:
        root: output folder (``root/20news-bydate-{train,test}/<group>/<number>``).
        num_train: training posts per group (validation is carved out of them by the reader).
        num_test: test posts per group.
        seed: generator seed.
        overwrite: replace a corpus generated with other parameters.

    Returns:
        ``Path(root)``.
    """
    check_int("num_train", num_train, 1)
    check_int("num_test", num_test, 1)
    root = Path(root)
    meta = {"generator_version": GENERATOR_VERSION, "num_train": num_train,
            "num_test": num_test, "seed": seed, "groups": list(TEXT_GROUPS)}
    splits = {"train": num_train, "test": num_test}
    folders = [root / f"20news-bydate-{s}" for s in splits]
    if _check_meta(root, TEXT_META, meta, overwrite, folders):
        return root
    model = _TopicModel(seed)
    number = 10000
    for split_code, (split, count) in enumerate(splits.items()):
        for group, name in enumerate(TEXT_GROUPS):
            folder = root / f"20news-bydate-{split}" / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                rng = np.random.default_rng([seed, split_code, group, i])
                (folder / str(number)).write_text(model.post(group, rng))
                number += 1
    (root / TEXT_META).write_text(json.dumps(meta, indent=2) + "\n")
    return root
