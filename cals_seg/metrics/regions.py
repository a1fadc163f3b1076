"""Calibration by image region: near / far from class boundaries, and by object size.

Definitions: docs/design.md, "Where the confidence is wrong". Both meters give every valid pixel
of an image a *group* from its target mask alone (a distance band, or an object-size bucket),
then keep per group the top-label bins of ``CalibrationMeter``: a count, a correct count and a
confidence sum per ``(group, bin)``. The state is ``G x n_bins`` sums whatever the number of
pixels, and DDP sync is a sum over ranks, as for the other meters.

The masks are analysed on the CPU with OpenCV (an exact Euclidean distance transform, and
8-connected components), one image at a time; the logits stay where they are.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import cv2
import numpy as np
import torch
from torch import Tensor

from cals_seg.metrics._base import Meter
from cals_seg.metrics.calibration import ece_split, reliability_data
from cals_seg.metrics.distance import int_thresholds, label_map_bands
from cals_seg.metrics.functional import (
    BLOCK_ELEMENTS,
    bin_index,
    max_argmax,
    position_block,
    prepare_logits,
)
from cals_seg.metrics.registry import register_meter
from cals_seg.utils.validation import check_finite, check_int, check_tensors

# --------------------------------------------------------------------------------------------
# Groups from the target masks (numpy, CPU).
# --------------------------------------------------------------------------------------------


def boundary_pixels(
    target: np.ndarray, ignore_index: int, inside: np.ndarray | None = None
) -> np.ndarray:
    """Valid pixels with at least one of their 8 neighbours inside the image of another value.

    The one boundary rule of the toolkit (the region meters, ``boundary_ts`` and the band
    losses). A void neighbour counts as different (its value ``ignore_index`` differs from a
    valid label); neighbours outside the image do not count. ``inside`` marks the pixels of the
    image proper (``False`` on padding added by an augmentation: neither a boundary pixel nor a
    neighbour); ``None``: every pixel. Each of the four neighbour directions compares the
    overlapping slices once and marks both pixels of a differing pair.

    Shape:
        - target: ``(N, H, W)`` integer; inside: ``(N, H, W)`` bool or None; returns
          ``(N, H, W)`` bool.
    """
    t = target
    ok = None if inside is None else inside.astype(bool)
    out = np.zeros(t.shape, dtype=bool)
    whole, head, tail = slice(None), slice(1, None), slice(None, -1)
    for a, b in (
        ((whole, head, whole), (whole, tail, whole)),
        ((whole, whole, head), (whole, whole, tail)),
        ((whole, head, head), (whole, tail, tail)),
        ((whole, head, tail), (whole, tail, head)),
    ):
        diff = t[a] != t[b]
        if ok is not None:
            diff &= ok[a] & ok[b]
        out[a] |= diff
        out[b] |= diff
    out &= t != ignore_index
    return out if ok is None else out & ok


def band_thresholds(bands: Sequence[float]) -> np.ndarray:
    """Integer thresholds on squared distances: ``d < b  <=>  D < ceil(b^2)`` for an integer
    ``D = d^2``, with ``ceil`` of the exact rational ``b^2``.

    Shape:
        - returns ``(len(bands),)`` float64 holding integers.
    """
    return np.array(int_thresholds(bands), dtype=np.float64)


def squared_boundary_distance(boundary: np.ndarray) -> np.ndarray:
    """Exact squared Euclidean distance (in pixels^2) of every pixel to the nearest boundary
    pixel of its image; ``inf`` in an image without boundary pixels.

    ``cv2.distanceTransform(DIST_L2, DIST_MASK_PRECISE)`` is the exact Euclidean transform
    (Felzenszwalb-Huttenlocher), returned as float32 ``d = sqrt(D)`` of an integer ``D``; with
    float32's relative error ``2^-24`` on ``d``, ``d^2`` in float64 is within ``D 2^-23`` of
    ``D``, so ``round(d^2)`` is ``D`` exactly for ``D < 2^22`` (distances below 2048 pixels).
    The tests check it against a brute-force loop.

    Shape:
        - boundary: ``(N, H, W)`` bool; returns ``(N, H, W)`` float64 holding integers or inf.
    """
    out = np.full(boundary.shape, np.inf)
    for i, b in enumerate(boundary):
        if b.any():
            d = cv2.distanceTransform(
                (~b).astype(np.uint8), cv2.DIST_L2, cv2.DIST_MASK_PRECISE, dstType=cv2.CV_32F
            ).astype(np.float64)
            out[i] = np.rint(d * d)
    return out


def boundary_bands(
    label_map: np.ndarray,
    bands: Sequence[float],
    ignore_index: int | None = None,
    inside: np.ndarray | None = None,
) -> np.ndarray:
    """Distance band of every pixel from the class boundaries of ``label_map``.

    The boundary rule of :func:`boundary_pixels` and the exact distances of
    :func:`squared_boundary_distance`; with ``edges = [0, *bands, inf]`` a pixel is in band
    ``i`` when ``edges[i] <= d < edges[i + 1]``, decided on integers (:func:`band_thresholds`).
    ``label_map`` may be a ground truth (void pixels: ``ignore_index``) or a predicted map
    (``ignore_index=None``: no void). ``inside`` as in :func:`boundary_pixels`.

    Shape:
        - label_map: ``(N, H, W)`` integer; returns ``(N, H, W)`` int64 in ``[0, len(bands)]``.
    """
    void = -1 if ignore_index is None else ignore_index
    if ignore_index is None and label_map.size and int(label_map.min()) < 0:
        raise ValueError("Expected a predicted `label_map` of class indices >= 0.")
    dist2 = squared_boundary_distance(boundary_pixels(label_map, void, inside))
    return np.searchsorted(band_thresholds(bands), dist2, side="right").astype(np.int64)


def component_areas(
    target: np.ndarray, num_classes: int, ignore_index: int, background_index: int | None = None
) -> np.ndarray:
    """Area (pixels) of the 8-connected component of its class that each valid pixel is in.

    Components are taken per image and per class present in it
    (``cv2.connectedComponentsWithStats`` of the class mask); void pixels, and pixels of
    ``background_index`` when given, get area 0.

    Shape:
        - target: ``(N, H, W)`` integer; returns ``(N, H, W)`` int64.
    """
    out = np.zeros(target.shape, dtype=np.int64)
    for i, t in enumerate(target):
        for c in np.unique(t):
            if c == ignore_index or c == background_index or not 0 <= c < num_classes:
                continue
            mask = t == c
            _, labels, stats, _ = cv2.connectedComponentsWithStats(
                mask.astype(np.uint8), connectivity=8, ltype=cv2.CV_32S
            )
            out[i][mask] = stats[labels[mask], cv2.CC_STAT_AREA]
    return out


def _small(group: np.ndarray, last: int) -> np.ndarray:
    """``group`` (values ``<= last + 1``) as uint8 where they fit: an eighth of the bytes."""
    return group.astype(np.uint8 if last < 254 else np.int64)


class BandGroups:
    """Picklable ``fn(mask (H, W), inside=None) -> (H, W)`` uint8: the distance band of every
    pixel (:func:`boundary_bands`), the groups of ``BoundaryCalibrationMeter(bands=bands,
    ignore_index=ignore_index)``. ``inside`` is accepted for the data-loading seam and
    ignored: the meter measures distances in the evaluated mask as it is."""

    def __init__(self, bands: Sequence[float], ignore_index: int) -> None:
        self.bands, self.ignore_index = tuple(bands), ignore_index

    def __call__(self, mask: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        m = np.asarray(mask).astype(np.int64)[None]
        return _small(boundary_bands(m, self.bands, self.ignore_index)[0], len(self.bands))


class SizeGroups:
    """Picklable ``fn(mask (H, W), inside=None) -> (H, W)`` uint8: the object-size bucket of
    every pixel (:func:`component_areas`; void and ``background_index`` pixels get
    ``len(areas) + 1``, no bucket), the groups of ``ObjectSizeCalibrationMeter``."""

    def __init__(self, num_classes: int, areas: Sequence[int], ignore_index: int,
                 background_index: int | None) -> None:
        self.num_classes, self.areas = num_classes, tuple(areas)
        self.ignore_index, self.background_index = ignore_index, background_index

    def __call__(self, mask: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        m = np.asarray(mask).astype(np.int64)[None]
        area = component_areas(m, self.num_classes, self.ignore_index, self.background_index)[0]
        group = np.searchsorted(np.array(self.areas), area, side="right")
        group[area == 0] = len(self.areas) + 1  # void and background: no bucket
        return _small(group, len(self.areas))


# --------------------------------------------------------------------------------------------
# Grouped top-label bins.
# --------------------------------------------------------------------------------------------


_BLOCK_ELEMENTS = BLOCK_ELEMENTS  # logits per block on the CPU (position_block; tests shrink it)


def _grouped_update(
    x: Tensor, y: Tensor, valid: Tensor, group: Tensor, num_groups: int, n_bins: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per ``(group, bin)``: count, correct count and confidence sum of one batch.

    Confidence, prediction and bins are those of ``CalibrationMeter`` (``torch.softmax`` in
    float32, top label, exact equal-width bins), so the groups' bins add up to its bins over
    the grouped pixels. Positions whose ``group`` is ``num_groups`` (or more), and void ones,
    are dropped. The logits go in blocks of positions (:func:`position_block`: cache-sized on
    the CPU, bitwise the softmax of the whole tensor; elsewhere one block).

    Shape:
        - x: ``(N, K, P)`` logits, y / valid / group: ``(N, P)`` (from ``prepare_logits``;
          ``group`` any integer dtype); returns three ``(num_groups, n_bins)`` tensors (int64,
          int64, float64).
    """
    n, k, npos = x.shape
    dev = x.device
    cells = num_groups * n_bins
    g = group.to(dev).reshape(valid.shape)
    drop = (g >= num_groups).logical_or_(~valid)
    first = g.to(torch.int32, copy=True).mul_(n_bins)  # group * n_bins, then + bin
    conf_all = torch.empty((n, npos), dtype=x.dtype, device=dev)
    block = position_block(x, _BLOCK_ELEMENTS)
    for start in range(0, npos, block):
        end = min(start + block, npos)
        xb = x[:, :, start:end]
        maxima, pred = max_argmax(xb)
        if not bool(xb.amin(dim=1).add_(maxima).sum().isfinite()):
            check_finite(xb)
        conf = xb.contiguous().softmax(dim=1).amax(dim=1)  # (contiguous: 3x faster, same bits)
        conf_all[:, start:end] = conf
        cell = first[:, start:end]
        cell.add_(bin_index(conf, n_bins)).masked_fill_(drop[:, start:end], cells)
        cell.mul_(2).add_(pred == y[:, start:end])
    hits = torch.bincount(first.reshape(-1), minlength=2 * cells + 2)
    hits = hits[: 2 * cells].view(num_groups, n_bins, 2)
    weights = conf_all.to(torch.float64).reshape(-1)
    conf_sum = torch.bincount(first.bitwise_right_shift_(1).reshape(-1), weights=weights,
                              minlength=cells + 1)[:cells]
    return hits.sum(dim=2), hits[..., 1].clone(), conf_sum.view(num_groups, n_bins)


class _RegionCalibrationMeter(Meter):
    """Top-label calibration per group of pixels; subclasses define the groups."""

    suffix = "group"  # metric keys are "<stat>_<suffix>"

    def __init__(
        self, num_classes: int, num_groups: int, n_bins: int, ignore_index: int, inputs: str
    ) -> None:
        super().__init__(num_classes, ignore_index, inputs, n_bins)
        self.num_groups = num_groups
        for name, dtype in (("bin_count", torch.int64), ("bin_correct", torch.int64),
                            ("bin_conf", torch.float64)):  # fmt: skip
            self.add_state(name, torch.zeros(num_groups, n_bins, dtype=dtype))

    def _groups(self, target: np.ndarray) -> np.ndarray:
        """Group of every pixel ``(N, H, W)`` int64; ``num_groups`` drops a pixel."""
        fn = self.group_fn()
        return np.stack([fn(t) for t in target]) if len(target) else target.astype(np.int64)

    def group_fn(self) -> Callable[..., np.ndarray]:
        """The ground-truth analysis of one mask as a picklable function ``fn(mask (H, W),
        inside=None) -> (H, W)`` uint8 groups (``num_groups``: no group), the one
        :meth:`update` runs when it is not given ``groups``. Run it where the data is loaded
        (e.g. ``SegmentationTransform.add_extra_inputs({"groups": meter.group_fn()})``, the
        seam of :mod:`cals_seg.data.extra_inputs`) and pass the collated maps to
        ``update(logits, target, groups=...)``: the evaluation's main process then only
        bins."""
        raise NotImplementedError

    def group_map(self, target: Tensor) -> Tensor:
        """Group of every pixel of ``target (N, H, W)``: ``(N, H, W)`` int64 on the CPU (what
        :meth:`update` computes when it is not given ``groups``)."""
        return torch.from_numpy(self._groups(target.detach().cpu().numpy().astype(np.int64)))

    def _check_groups(self, groups: Tensor, target: Tensor) -> Tensor:
        if not isinstance(groups, Tensor) or groups.is_floating_point() or groups.is_complex():
            got = groups.dtype if isinstance(groups, Tensor) else type(groups).__name__
            raise ValueError(f"Expected `groups` to be an integer tensor (N, H, W), but got {got}.")
        if tuple(groups.shape) != tuple(target.shape):
            raise ValueError(
                f"Expected `groups` of the target's shape {tuple(target.shape)}, but got "
                f"{tuple(groups.shape)}; pass the maps of {type(self).__name__}.group_fn()."
            )
        if groups.numel():
            low, high = torch.aminmax(groups.to(torch.int64))
            if int(low) < 0 or int(high) > self.num_groups:
                raise ValueError(
                    f"Expected `groups` values in [0, {self.num_groups}] (the last: no group), "
                    f"but got values in [{int(low)}, {int(high)}]; pass the maps of "
                    f"{type(self).__name__}.group_fn() built with the same arguments."
                )
        return groups

    def batch_stats(self, logits: Tensor, target: Tensor, groups: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """The sums of one batch: logits ``(N, K, H, W)``, target ``(N, H, W)``; raises
        ``ValueError`` on bad input. Pass logits (the softmax is applied here), or
        probabilities to a meter built with ``inputs="probs"``. ``groups``: ``(N, H, W)``
        integer, the maps of :meth:`group_fn` for this target (computed here when None)."""
        if not isinstance(logits, Tensor) or logits.dim() != 4:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"Expected `logits` of shape (N, K, H, W), but got {shape}.")
        x, y, valid = prepare_logits(
            logits, target, self.num_classes, self.ignore_index, self.inputs
        )
        group = self.group_map(target) if groups is None else self._check_groups(groups, target)
        count, correct, conf = _grouped_update(x, y, valid, group, self.num_groups, self.n_bins)
        return {"bin_count": count, "bin_correct": correct, "bin_conf": conf}

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor, groups: Tensor | None = None) -> None:
        """Add one batch (shapes: the class docstring); ``groups`` as in :meth:`batch_stats`.
        Raises ``ValueError`` on bad input, before any state changes."""
        check_tensors(logits, target, "meter.update")  # e.g. a model's output dict, named
        stats = self.batch_stats(logits, target) if groups is None else self.batch_stats(
            logits, target, groups=groups)
        for name, value in stats.items():
            getattr(self, name).add_(value)

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """Per group (lists of ``G``): ``count``, ``ece``, ``ece_over``, ``ece_under``,
        ``acc``, ``conf`` (None for an empty group) and ``reliability`` (the dict of
        ``CalibrationMeter``), under the keys ``<stat>_<suffix>``, plus ``<suffix>_edges``."""
        s = {k: v.cpu() for k, v in states.items()}
        rows: dict[str, list] = {k: [] for k in
                                 ("count", "ece", "ece_over", "ece_under", "acc", "conf",
                                  "reliability")}  # fmt: skip
        for g in range(self.num_groups):
            count, correct, conf = s["bin_count"][g], s["bin_correct"][g], s["bin_conf"][g]
            m = int(count.sum())
            ece, over, under = ece_split(count, correct, conf)
            rows["count"].append(m)
            rows["ece"].append(ece)
            rows["ece_over"].append(over)
            rows["ece_under"].append(under)
            rows["acc"].append(float(correct.sum()) / m if m else None)
            rows["conf"].append(float(conf.sum()) / m if m else None)
            rows["reliability"].append(reliability_data(count, correct, conf, self.n_bins))
        out: dict[str, Any] = {f"{self.suffix}_edges": self._edges()}
        out.update({f"{k}_{self.suffix}": v for k, v in rows.items()})
        return out


@register_meter("boundary", families=("segmentation",))
class BoundaryCalibrationMeter(_RegionCalibrationMeter):
    """Calibration in distance bands around the class boundaries of the ground truth.

    Per image, a valid pixel (``y != ignore_index``) is a *boundary pixel* when at least one of
    its 8 neighbours inside the image has another target value (a void neighbour counts as
    different). ``d(p)`` is the exact Euclidean distance, in pixels, from ``p`` to the nearest
    boundary pixel of the same image (0 on the boundary, ``inf`` in an image without one).
    With ``edges = [0, *bands, inf]``, ``p`` is in band ``i`` when
    ``edges[i] <= d(p) < edges[i + 1]``, decided exactly on integers: ``d^2`` is an integer
    ``D`` (from OpenCV's exact transform, see :func:`squared_boundary_distance`) and
    ``d < b  <=>  D < ceil(b^2)``, with ``ceil(b^2)`` computed from the exact rational value
    of ``b``. Each band then gets ``CalibrationMeter``'s top-label ECE (the same 15 bins:
    ``(b/n, (b+1)/n]``, 0 in the first), its over / under-confident split, accuracy, mean
    confidence and reliability data. The last band is the *interior*.

    State: int64 ``bin_count``, ``bin_correct`` and float64 ``bin_conf``, ``(B + 1, n_bins)``
    each, i.e. ``24 (B + 1) n_bins`` bytes: 1080 bytes for the default two bands and 15 bins,
    whatever the number of pixels. Exact under DDP (``compute`` sums copies over ranks; call
    it on every rank).

    Args:
        num_classes: K >= 2.
        bands: increasing positive finite distances in pixels (default ``(3.0, 8.0)``: bands
            ``[0, 3)``, ``[3, 8)``, ``[8, inf)``).
        n_bins: equal-width confidence bins.
        ignore_index: target value of void pixels.
        inputs: ``"logits"`` (default) or ``"probs"``, with the rule of
            :class:`~cals_seg.metrics.CalibrationMeter` (logits that look like probabilities
            raise ``ValueError``).

    Shape:
        - logits: ``(N, K, H, W)`` floating; target: ``(N, H, W)`` integer.

    Example:
        >>> meter = BoundaryCalibrationMeter(num_classes=3, ignore_index=255)
        >>> meter.update(torch.randn(2, 3, 16, 16), torch.randint(0, 3, (2, 16, 16)))
        >>> meter.compute()["band_edges"]
        [0.0, 3.0, 8.0, None]
    """

    suffix = "band"

    def __init__(
        self,
        num_classes: int,
        bands: Sequence[float] = (3.0, 8.0),
        n_bins: int = 15,
        ignore_index: int = -100,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        bands = tuple(bands)
        ok = all(isinstance(b, int | float) and not isinstance(b, bool) for b in bands)
        if not ok or not all(0 < b < math.inf for b in bands) or any(
            b >= c for b, c in zip(bands, bands[1:], strict=False)
        ):
            raise ValueError(
                f"Expected `bands` to be increasing positive finite distances, but got {bands!r}."
            )
        super().__init__(num_classes, len(bands) + 1, n_bins, ignore_index, inputs)
        self.bands = tuple(float(b) for b in bands)
        self.thresholds = band_thresholds(bands)  # d < b  <=>  D < ceil(b^2), D = d^2

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, bands={self.bands}, n_bins={self.n_bins}, "
                f"ignore_index={self.ignore_index}")  # fmt: skip

    def _edges(self) -> list[float | None]:
        return [0.0, *self.bands, None]

    def group_fn(self) -> Callable[..., np.ndarray]:
        """Band of every pixel of one mask (:class:`BandGroups`); see the base class."""
        return BandGroups(self.bands, self.ignore_index)

    def group_map(self, target: Tensor) -> Tensor:
        """The bands of ``target (N, H, W)``: OpenCV's exact transform on the CPU; off the CPU
        the exact bounded torch transform of :mod:`cals_seg.metrics.distance` on the device
        (no copy to the host), equal to it."""
        if target.device.type == "cpu":
            return super().group_map(target)
        return label_map_bands(target.long(), self.bands, self.ignore_index)

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """The per-band dict of :meth:`_RegionCalibrationMeter.compute_states` plus
        ``ece_band_weighted`` (None without a valid pixel): the band ECEs averaged with their
        pixel counts as weights, ``sum_b n_b ECE_b / sum_b n_b`` over the non-empty bands.

        It equals the ECE of bins split by band as well as by confidence, so it is never below
        the pooled ECE: an over-confident band and an under-confident one do not cancel."""
        out = super().compute_states(states)
        counts = out["count_band"]
        total = sum(counts)
        out["ece_band_weighted"] = (
            sum(n * e for n, e in zip(counts, out["ece_band"], strict=True) if n) / total
            if total else None
        )
        return out


def _size_meter(task: Any, n_bins: int, test: bool) -> ObjectSizeCalibrationMeter:
    """The object-size meter of a segmentation task's test pass: class 0 is not an object when
    it is named background."""
    names = task.class_names[:1]
    background = 0 if names and names[0].lower() in ("background", "_background_") else None
    return ObjectSizeCalibrationMeter(task.num_classes, n_bins=n_bins,
                                      ignore_index=task.ignore_index, background_index=background)


@register_meter("size", families=("segmentation",), test_only=True, build=_size_meter)
class ObjectSizeCalibrationMeter(_RegionCalibrationMeter):
    """Calibration by the area of the ground-truth object each pixel belongs to.

    Per image and per class present (``background_index`` and void excluded), the target mask
    of the class is cut into 8-connected components; a pixel's *object area* is the number of
    pixels of its component. With ``edges = [0, *areas, inf]`` a pixel is in bucket ``i`` when
    ``edges[i] <= area < edges[i + 1]`` (integers, exact). The default ``areas = (32**2,
    96**2)`` are COCO's small / medium / large. Pixels of ``background_index`` and void pixels
    are in no bucket. Each bucket gets the same numbers as a band of
    :class:`BoundaryCalibrationMeter`. Areas are measured in the evaluated image (after the
    evaluation transform; an object cut by a crop is smaller).

    State: ``24 (A + 1) n_bins`` bytes (1080 for the defaults), independent of the pixels;
    exact under DDP.

    Args:
        num_classes: K >= 2.
        areas: increasing positive integer areas in pixels.
        n_bins: equal-width confidence bins.
        ignore_index: target value of void pixels.
        background_index: a class whose pixels are not objects (None: every class is).
        inputs: ``"logits"`` (default) or ``"probs"``, as in :class:`BoundaryCalibrationMeter`.

    Shape:
        - logits: ``(N, K, H, W)`` floating; target: ``(N, H, W)`` integer.
    """

    suffix = "size"

    def __init__(
        self,
        num_classes: int,
        areas: Sequence[int] = (32**2, 96**2),
        n_bins: int = 15,
        ignore_index: int = -100,
        background_index: int | None = None,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        areas = tuple(areas)
        ok = all(isinstance(a, int) and not isinstance(a, bool) and a > 0 for a in areas)
        if not ok or any(a >= b for a, b in zip(areas, areas[1:], strict=False)):
            raise ValueError(
                f"Expected `areas` to be increasing positive integers, but got {areas!r}."
            )
        if background_index is not None:
            check_int("background_index", background_index, 0)
        super().__init__(num_classes, len(areas) + 1, n_bins, ignore_index, inputs)
        self.areas, self.background_index = areas, background_index

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, areas={self.areas}, n_bins={self.n_bins}, "
                f"ignore_index={self.ignore_index}, background_index={self.background_index}")

    def _edges(self) -> list[float | None]:
        return [0, *self.areas, None]

    def group_fn(self) -> Callable[..., np.ndarray]:
        """Size bucket of every pixel of one mask (:class:`SizeGroups`); see the base class."""
        return SizeGroups(self.num_classes, self.areas, self.ignore_index, self.background_index)


# Rings of the last masks seen (BoundaryAwareECEMeter._rings): a batch's mask goes to every meter
# set of the pass in turn, so a few entries give one distance transform per mask; each entry is
# the (N, H, W) ring map and two per-ring vectors, so memory stays a few batches of masks.
_RING_MEMO: OrderedDict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
_RING_MEMO_SIZE = 4


@register_meter("rings", families=("segmentation",))  # ba_ece, the field's ring metric
class BoundaryAwareECEMeter(BoundaryCalibrationMeter):
    """Boundary-Aware ECE (``ba_ece``): ECE in distance rings around the ground-truth
    boundaries, each ring weighted by ``1 / (mean distance + 1)``.

    The region metric of the recent segmentation-calibration literature (Kirscher et al.,
    "Rethinking Post-Hoc Calibration in Semantic Segmentation", TMLR 2026, arXiv:2607.01902,
    and others): the valid pixels are cut into rings by their distance ``d`` to the nearest
    ground-truth boundary, ``edges = [0, 3, 7, 15, inf]`` (ring ``r`` holds
    ``edges[r] <= d < edges[r+1]``), the top-label ECE of each ring is taken with the bins of
    :class:`~cals_seg.metrics.CalibrationMeter`, and the rings are averaged with weights that
    favour the boundary::

        dbar_r = mean of d over ring r's pixels with finite d
        w_r    = 1 / (dbar_r + 1)                  (0 when the ring has no finite d)
        ba_ece = sum_r w_r ECE_r / sum_r w_r       over the non-empty rings

    Boundary pixels, distances and ring membership are those of
    :class:`BoundaryCalibrationMeter` (8-neighbour rule, a void neighbour differs, exact
    Euclidean distance decided on integers). Two points the public description leaves open are
    our choices, stated here: the weights are normalised to sum to 1 (so ``ba_ece`` is in
    ``[0, 1]`` like ECE), and a pixel of an image without boundary (``d = inf``) is in the last
    ring's ECE but not in its mean distance.

    Output (``compute``): ``ba_ece`` (None without a ring of finite mean distance),
    ``ring_edges``, and per ring ``count_ring``, ``ece_ring``, ``acc_ring``, ``conf_ring``,
    ``distance_ring`` (``dbar_r``, None when undefined) and ``weight_ring`` (normalised ``w_r``).

    State: the bins of :class:`BoundaryCalibrationMeter` for the four rings plus, per ring, the
    float64 sum of the finite distances and the int64 count of them: ``O(rings x n_bins)``
    whatever the number of pixels. Every state is a sum, so DDP sync is one all-reduce each and
    N ranks give the numbers of one process over the same images (up to float64 summation
    order of the distance sums).

    Args:
        num_classes: K >= 2.
        rings: the inner ring edges (default ``(3.0, 7.0, 15.0)``, the published ones).
        n_bins: equal-width confidence bins (15).
        ignore_index: target value of void pixels.
        inputs: ``"logits"`` or ``"probs"``, as in :class:`BoundaryCalibrationMeter`.

    Shape:
        - logits: ``(N, K, H, W)`` floating; target: ``(N, H, W)`` integer.
    """

    suffix = "ring"

    def __init__(
        self,
        num_classes: int,
        rings: Sequence[float] = (3.0, 7.0, 15.0),
        n_bins: int = 15,
        ignore_index: int = -100,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        super().__init__(num_classes, rings, n_bins, ignore_index, inputs)
        self.add_state("ring_distance_sum", torch.zeros(self.num_groups, dtype=torch.float64))
        self.add_state("ring_distance_count", torch.zeros(self.num_groups, dtype=torch.int64))

    def _rings(self, target: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ring of every pixel ``(N, H, W)``, and per ring the sum and count of the finite
        distances of its valid pixels.

        One evaluation feeds the same masks to several meter sets (raw, post-TS, each
        calibrator); the result of the last :data:`_RING_MEMO_SIZE` masks is kept, keyed by the
        mask's bytes and the rings, so each mask has one distance transform (copies are
        returned: the numbers are those of a fresh computation)."""
        key = (tuple(np.asarray(self.thresholds).tolist()), self.ignore_index, target.shape,
               target.dtype.str, hashlib.blake2b(np.ascontiguousarray(target).tobytes(),
                                                 digest_size=16).digest())
        held = _RING_MEMO.get(key)
        if held is None:
            dist2 = squared_boundary_distance(boundary_pixels(target, self.ignore_index))
            ring = np.searchsorted(self.thresholds, dist2, side="right").astype(np.int64)
            take = (target != self.ignore_index) & np.isfinite(dist2)
            r = ring[take]
            held = (ring, np.bincount(r, weights=np.sqrt(dist2[take]),
                                      minlength=self.num_groups),
                    np.bincount(r, minlength=self.num_groups))
            _RING_MEMO[key] = held
            while len(_RING_MEMO) > _RING_MEMO_SIZE:
                _RING_MEMO.popitem(last=False)
        else:
            _RING_MEMO.move_to_end(key)
        return held[0].copy(), held[1].copy(), held[2].copy()

    def group_map(self, target: Tensor) -> Tensor:
        return torch.from_numpy(self._rings(target.detach().cpu().numpy().astype(np.int64))[0])

    def batch_stats(self, logits: Tensor, target: Tensor, groups: Tensor | None = None
                    ) -> dict[str, Tensor]:
        """The bins of :class:`BoundaryCalibrationMeter` per ring, and the ring distance sums
        (one distance transform per batch; raises ``ValueError`` on bad input). ``groups``
        must be None: the rings need the distances, so they are computed here."""
        if groups is not None:
            raise ValueError("BoundaryAwareECEMeter computes its rings itself (it needs the "
                             "distances): call update(logits, target) without `groups`.")
        out = super().batch_stats(logits, target)  # checks the input first
        _, total, count = self._rings(target.detach().cpu().numpy().astype(np.int64))
        out["ring_distance_sum"] = torch.from_numpy(total).to(self.ring_distance_sum)
        out["ring_distance_count"] = torch.from_numpy(count).to(self.ring_distance_count)
        return out

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """``ba_ece`` and the per-ring numbers (class docstring)."""
        full = _RegionCalibrationMeter.compute_states(self, states)  # the rings, not the bands
        total, count = states["ring_distance_sum"].cpu(), states["ring_distance_count"].cpu()
        dbar = [float(total[r]) / int(count[r]) if int(count[r]) else None
                for r in range(self.num_groups)]
        raw = [1.0 / (d + 1.0) if d is not None and n else 0.0
               for d, n in zip(dbar, full["count_ring"], strict=True)]
        norm = sum(raw)
        out: dict[str, Any] = {k: full[k] for k in ("ring_edges", "count_ring", "ece_ring",
                                                    "acc_ring", "conf_ring")}
        out["distance_ring"] = dbar
        out["weight_ring"] = [w / norm for w in raw] if norm else [None] * self.num_groups
        out["ba_ece"] = (sum(w * e for w, e in zip(raw, full["ece_ring"], strict=True) if w)
                         / norm if norm else None)
        return out
