"""Per-pixel prediction sets with a finite-sample guarantee (conformal prediction).

Definitions: docs/conformal.md. A pixel's *score* for class ``k`` is a number in ``[0, 1]``,
small when ``k`` is plausible; its *set* is every class whose score is at most a threshold
``lambda``. The threshold is fitted on calibration images that nothing else was fitted on, by
one of four rules, each with its theorem (the images, not the pixels, are the exchangeable
units):

- ``risk`` (conformal risk control, Angelopoulos et al., ICLR 2024, Theorem 1): the per-image
  loss ``L_i(lambda)`` is the fraction of image ``i``'s valid pixels whose class is not in
  their set, non-increasing in ``lambda``, in ``[0, B = 1]``, and 0 at ``lambda = 1``. With
  ``R_n(lambda) = (1/n) sum_i L_i(lambda)`` over the ``n`` calibration images,
  ``lambda_hat = inf{lambda : (n / (n + 1)) R_n(lambda) + B / (n + 1) <= alpha}`` gives
  ``E[L_test(lambda_hat)] <= alpha``; when the ``L_i`` have no large jumps it is also
  ``>= alpha - 2B / (n + 1)`` (their Theorem 2).
- ``image:TAU`` (split conformal on a per-image score, Vovk et al. 2005; Lei et al. 2018): the
  image score ``S_i`` is the smallest ``lambda`` at which image ``i``'s coverage reaches
  ``TAU``; with ``k = ceil((n + 1)(1 - alpha))``, ``lambda_hat`` is the ``k``-th smallest
  ``S_i`` (all classes when ``k > n``), and ``P(coverage_test >= TAU) >= 1 - alpha``.
- ``class`` (Mondrian risk control): one threshold per class ``c``, the ``risk`` rule applied
  to ``L_i^c`` (the fraction of image ``i``'s pixels of class ``c`` left out of their sets)
  over the ``n_c`` calibration images holding class ``c``; the set of a pixel is
  ``{k : s_k <= lambda_k}``. Guarantee per class, among images holding it.
- ``band``: one threshold per distance band around the *predicted* boundaries (the bands of
  :func:`cals_seg.metrics.regions.boundary_bands`, computed on the argmax map, so they are
  known at test time); the ``risk`` rule per band over the images having pixels in it.

Exact arithmetic: thresholds live on the grid ``lambda_g = g / G`` (``G = 2^12`` by default;
a pixel's score ``s`` goes to cell ``ceil(s G)``, exact for float32 ``s`` since ``G`` is a
power of two, and ``s <= lambda_g`` iff its cell is ``<= g``). Restricting ``lambda`` to a
finite grid that holds ``lambda = 1`` keeps every theorem (Angelopoulos et al. allow any closed
set of ``lambda``). A per-image loss is stored as ``ceil(2^32 L_i(lambda_g))``, an integer: an
upper bound of ``L_i`` by less than ``2^-32`` (the guarantee holds for the rounded-up loss, so
for the true one), summed in int64. The state is therefore integers of a fixed size (one risk
curve per group, or one histogram of image scores), whatever the number of pixels, and its
DDP sum is exact: N processes give bit for bit the threshold of one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from cals_seg.evaluation.conformal_score import (  # noqa: F401 (re-exported here)
    GRID,
    SCORES,
    class_scores,
    lac_scores,
    score_cells,
)
from cals_seg.evaluation.conformal_scores.aps import (  # noqa: F401 (re-exported here)
    aps_scores,
    pixel_uniforms,
)
from cals_seg.metrics.functional import prepare_logits, sum_over_ranks
from cals_seg.metrics.regions import boundary_bands

MODES = ("risk", "image", "class", "band")
FIXED_POINT = 2**32  # a per-image loss L is stored as ceil(L * FIXED_POINT)

# --------------------------------------------------------------------------------------------
# Threshold rules on summed integer states.
# --------------------------------------------------------------------------------------------


def rational(x: float) -> Fraction:
    """The decimal a user wrote for ``x`` as an exact fraction (``0.3`` is ``3/10``, not the
    binary float just below it), so that ``ceil(0.7 * 40)`` is 28."""
    return Fraction(repr(float(x)))


def crc_threshold(risk_sum: Sequence[int], n: int, alpha: float) -> int:
    """The conformal-risk-control grid index: the smallest ``g`` with
    ``(n / (n + 1)) R_n(g) + 1 / (n + 1) <= alpha``, ``R_n(g) = risk_sum[g] / (2^32 n)``,
    decided on integers: ``b (risk_sum[g] + 2^32) <= a (n + 1) 2^32`` for ``alpha = a / b``
    (:func:`rational`).
    The last index (all classes, zero loss) when no ``g`` qualifies or ``n = 0``.

    Args:
        risk_sum: ``sum_i ceil(2^32 L_i(g / G))`` for ``g = 0..G``, non-increasing (each
            ``L_i`` is), which the search relies on.
        n: calibration images.
        alpha: target risk in ``(0, 1)``.
    """
    last = len(risk_sum) - 1
    if n == 0:
        return last
    a = rational(alpha)
    bound = a.numerator * (n + 1) * FIXED_POINT
    lo, hi = 0, last  # risk_sum is non-increasing: bisect for the first index that qualifies
    while lo < hi:
        mid = (lo + hi) // 2
        if a.denominator * (int(risk_sum[mid]) + FIXED_POINT) <= bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


def quantile_threshold(hist: Sequence[int], alpha: float) -> int:
    """Split-conformal quantile of per-image scores kept as a histogram over grid cells: the
    ``k``-th smallest, ``k = ceil((n + 1)(1 - alpha))`` (exact, :func:`rational`), or the last index
    when ``k > n``. ``P(S_test <= result) >= k / (n + 1) >= 1 - alpha``."""
    counts = [int(c) for c in hist]
    n = sum(counts)
    k = math.ceil((1 - rational(alpha)) * (n + 1))
    if k > n:
        return len(counts) - 1
    seen = 0
    for g, c in enumerate(counts):
        seen += c
        if seen >= k:
            return g
    return len(counts) - 1  # unreachable: seen == n >= k


def guarantee_images(alpha: float) -> int:
    """The fewest calibration images ``n`` for which a threshold at level ``alpha`` can be
    anything but "every class": ``ceil(1 / alpha) - 1`` (exact, :func:`rational`).

    Both rules need ``alpha (n + 1) >= 1``. Split conformal (``image:TAU``) takes the
    ``k``-th smallest score, ``k = ceil((n + 1)(1 - alpha))``, which exists iff ``k <= n``,
    i.e. ``(n + 1)(1 - alpha) <= n``. Risk control (``risk``, and per group ``class`` /
    ``band``) accepts ``g`` when ``(n R_n(g) + 1) / (n + 1) <= alpha``: with
    ``R_n >= 0`` some ``g`` below the last qualifies only if ``1 / (n + 1) <= alpha``. Below
    that ``n`` each set holds every class: coverage 1, a guarantee that says nothing.
    For ``class`` / ``band`` the ``n`` is per group (the images holding the class / having
    pixels in the band).
    """
    a = rational(alpha)
    if not 0 < a < 1:
        raise ValueError(f"Expected `alpha` in (0, 1), but got {alpha!r}.")
    return math.ceil(1 / a) - 1


def guarantee_status(alpha: float, kind: str, per_group: Sequence[int],
                     group_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Whether a fit on these calibration counts has a guarantee worth the name.

    Args:
        alpha: the level.
        kind: ``risk``, ``image``, ``class`` or ``band``.
        per_group: calibration images per group (one entry for ``risk`` / ``image``).
        group_names: names of the groups for the warning (default: their indices).

    Returns:
        ``{"guarantee": bool, "needs_images": N}`` (``N`` per group for ``class`` /
        ``band``), with ``"groups_without_guarantee"`` (indices) for the grouped kinds and,
        when there is no guarantee, a one-line ``"warning"`` naming ``N``, the images there are
        and the fixes (more calibration images, or a larger alpha).
    """
    need = guarantee_images(alpha)
    counts = [int(c) for c in per_group]
    short = [g for g, c in enumerate(counts) if c < need]
    out: dict[str, Any] = {"guarantee": not short, "needs_images": need}
    grouped = kind in ("class", "band")
    if grouped:
        out["groups_without_guarantee"] = short
    if not short:
        return out
    fewest = min(counts[g] for g in short)
    fix = "give more validation images"
    if fewest:
        # 1 / (n + 1) rounded up on 4 decimals: the alpha written is enough
        fix += f" or a larger alpha (>= {math.ceil(Fraction(10**4, fewest + 1)) / 10**4:g})"
    if grouped:
        what = "classes" if kind == "class" else "bands"
        names = [str(group_names[g]) if group_names else str(g) for g in short]
        listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        every = ("those classes are in every pixel's set" if kind == "class"
                 else "those bands' pixels get every class")
        out["warning"] = (f"no guarantee at alpha={alpha:g} for {len(short)} of {len(counts)} "
                          f"{what} ({listed}): each needs {need} calibration images holding "
                          f"it, the fewest have {fewest} ({every}); {fix}")
    else:
        out["warning"] = (f"no guarantee at alpha={alpha:g}: {counts[0]} calibration image(s), "
                          f"it needs {need} (every set holds every class); {fix}")
    return out


def coverage_needed(total: Tensor, tau: float) -> Tensor:
    """``ceil(tau * total)`` exactly (tau as :func:`rational`): covered pixels an image needs
    for coverage ``>= tau``. int64 tensor of the shape of ``total``."""
    t = rational(tau)
    num = total.to(torch.int64) * t.numerator
    return torch.div(num + t.denominator - 1, t.denominator, rounding_mode="floor")


# --------------------------------------------------------------------------------------------
# Per-image statistics (one batch) and the streaming calibration state.
# --------------------------------------------------------------------------------------------


def image_risk_curves(cells: Tensor, valid: Tensor, group: Tensor, num_groups: int,
                      grid: int = GRID) -> tuple[Tensor, Tensor]:
    """Each image's fixed-point loss curve per group: ``ceil(2^32 m_ig(g) / t_ig)`` where
    ``t_ig`` counts image ``i``'s valid pixels of group ``g`` and ``m_ig(g)`` those whose
    true-class cell exceeds ``g`` (left out of the set at threshold ``g / grid``).

    Shape:
        - cells: ``(N, P)`` int64, the true class's cell; valid / group: ``(N, P)``;
          returns ``(N, num_groups, grid + 1)`` int64 (0 where ``t_ig = 0``) and the
          ``(N, num_groups)`` int64 counts ``t_ig``.
    """
    n = cells.shape[0]
    width = grid + 1
    out = torch.zeros(n, num_groups, width, dtype=torch.int64, device=cells.device)
    totals = torch.zeros(n, num_groups, dtype=torch.int64, device=cells.device)
    for i in range(n):  # one image at a time: memory num_groups * (grid + 1)
        keep = valid[i] & (group[i] < num_groups)
        key = group[i][keep] * width + cells[i][keep]
        hist = torch.bincount(key, minlength=num_groups * width).view(num_groups, width)
        total = hist.sum(dim=1, keepdim=True)
        if total.numel() and int(total.max()) >= 2**31:
            raise ValueError("Expected fewer than 2^31 valid pixels per image.")
        missed = total - hist.cumsum(dim=1)
        curve = torch.div(missed * FIXED_POINT + total - 1, total.clamp(min=1),
                          rounding_mode="floor")
        out[i] = curve.masked_fill_(total == 0, 0)
        totals[i] = total[:, 0]
    return out, totals


def flat_risk_sum(cells: Tensor, valid: Tensor, group: Tensor, num_groups: int,
                  grid: int = GRID) -> tuple[Tensor, Tensor]:
    """:func:`image_risk_curves` summed over the images when each image has one position (a
    classification batch): image ``i``'s loss at ``g`` is 1 when its true-class cell exceeds
    ``g``, 0 otherwise, so the summed curve of group ``c`` is ``2^32`` times the number of its
    images whose cell exceeds ``g``: one histogram instead of a ``(N, G, grid + 1)`` tensor,
    equal to the per-image sum bit for bit.

    Shape:
        - cells / valid / group: ``(N, 1)``; returns ``(num_groups, grid + 1)`` int64 (the
          summed curves) and ``(num_groups,)`` int64 (images per group).
    """
    width = grid + 1
    keep = valid.reshape(-1) & (group.reshape(-1) < num_groups)
    key = group.reshape(-1)[keep] * width + cells.reshape(-1)[keep]
    hist = torch.bincount(key, minlength=num_groups * width).view(num_groups, width)
    total = hist.sum(dim=1, keepdim=True)
    return (total - hist.cumsum(dim=1)) * FIXED_POINT, total[:, 0]


def as_spatial(logits: Tensor, target: Tensor | None = None
               ) -> tuple[Tensor, Tensor | None]:
    """A classification batch as the segmentation case of 1 x 1 images: logits ``(N, K)`` to
    ``(N, K, 1, 1)`` and targets ``(N,)`` to ``(N, 1, 1)`` (views); 4-D logits (and their
    targets) are returned as they are. The one place where the conformal sets and their meter
    take one label per input."""
    if isinstance(logits, Tensor) and logits.dim() == 2:
        logits = logits[:, :, None, None]
        if target is not None and target.dim() == 1:
            target = target[:, None, None]
    return logits, target


def image_scores(cells: Tensor, valid: Tensor, tau: float, grid: int = GRID) -> Tensor:
    """Per image, the smallest grid index at which its coverage reaches ``tau``
    (``covered(g) >= ceil(tau * valid pixels)``); -1 for an image without a valid pixel.

    Shape:
        - cells / valid: ``(N, P)``; returns ``(N,)`` int64.
    """
    key = cells.masked_fill(~valid, grid + 1)
    hist = torch.stack([torch.bincount(k, minlength=grid + 2)[: grid + 1] for k in key])
    covered = hist.cumsum(dim=1)
    need = coverage_needed(valid.sum(dim=1), tau)
    idx = torch.searchsorted(covered, need.unsqueeze(1)).squeeze(1)
    return idx.masked_fill(valid.sum(dim=1) == 0, -1)


def parse_mode(mode: str) -> tuple[str, float | None]:
    """``"risk" | "image:TAU" | "class" | "band"`` -> ``(kind, tau or None)``."""
    kind, _, arg = mode.partition(":")
    if kind not in MODES or (kind == "image") != bool(arg):
        raise ValueError(f"Expected `mode` risk, image:TAU (0 < TAU <= 1), class or band, but "
                         f"got {mode!r}.")
    if kind != "image":
        return kind, None
    try:
        tau = float(arg)
    except ValueError:
        tau = math.nan
    if not 0 < tau <= 1:
        raise ValueError(f"Expected TAU in (0, 1] in mode {mode!r}, e.g. image:0.9.")
    return kind, tau


class ConformalSets(nn.Module):
    """Fits a conformal threshold on calibration images (streaming) and makes the sets.

    ``update(logits, target)`` adds calibration images; ``fit()`` computes the threshold(s)
    from the summed state (all-reduced under DDP: call it on every rank); ``sets(logits)``
    returns the prediction sets of new images. Apply it to the logits *after* any calibrator,
    and calibrate on images that the calibrator (and the network) were not fitted on.

    State (int64, fixed size): ``risk_sum (G, grid + 1)`` and ``images (G,)`` for the modes
    ``risk`` (``G = 1``), ``class`` (``G = K``) and ``band`` (``G = len(bands) + 1``), or
    ``image_hist (grid + 1,)`` for ``image:TAU``, plus the image count and the fitted
    indices: about ``8 (grid + 2) G`` bytes, 32 KiB for one group at the default grid,
    whatever the number of pixels.

    Args:
        num_classes: K >= 2.
        alpha: target miscoverage in ``(0, 1)``.
        mode: ``"risk"``, ``"image:TAU"``, ``"class"`` or ``"band"`` (see the module).
        score: a registered score (:data:`~cals_seg.evaluation.conformal_score.SCORES`:
            ``"lac"``, ``"aps"``, ...).
        seed: seed of the APS randomisation (:func:`pixel_uniforms`).
        bands: band edges (pixels) of the ``band`` mode, as the boundary meter's.
        ignore_index: target value of void pixels.
        inputs: ``"logits"`` (softmax applied here) or ``"probs"``.
        grid: threshold grid size, a power of two.

    Shape:
        - logits: ``(N, K, H, W)``; target: ``(N, H, W)``; sets: ``(N, K, H, W)`` bool.
          Classification: logits ``(N, K)``, target ``(N,)``, sets ``(N, K)`` (an input is a
          1 x 1 image, :func:`as_spatial`; modes ``risk`` and ``class``).

    Example:
        >>> cs = ConformalSets(num_classes=3, alpha=0.1)
        >>> cs.update(torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4, 8, 8)))
        >>> cs.fit()["calibration_images"]
        4
    """

    def __init__(self, num_classes: int, alpha: float, mode: str = "risk",
                 score: str = "lac", seed: int = 0,
                 bands: Sequence[float] = (3.0, 8.0), ignore_index: int = -100,
                 inputs: Literal["logits", "probs"] = "logits", grid: int = GRID) -> None:
        super().__init__()
        if not (isinstance(alpha, float | int) and 0 < alpha < 1):
            raise ValueError(f"Expected `alpha` in (0, 1), but got {alpha!r}.")
        if score not in SCORES:
            raise ValueError(f"Expected `score` to be one of {list(SCORES)}, but got {score!r}.")
        if not (isinstance(grid, int) and grid >= 2 and grid & (grid - 1) == 0):
            raise ValueError(f"Expected `grid` to be a power of two >= 2, but got {grid!r}.")
        self.kind, self.tau = parse_mode(mode)
        self.num_classes, self.alpha, self.mode, self.score = num_classes, float(alpha), mode, score
        self.seed, self.ignore_index = seed, ignore_index
        self.bands = tuple(float(b) for b in bands)
        self.inputs, self.grid = inputs, grid
        groups = {"risk": 1, "image": 1, "class": num_classes, "band": len(self.bands) + 1}
        self.num_groups = groups[self.kind]
        if self.kind == "image":
            self.register_buffer("image_hist", torch.zeros(grid + 1, dtype=torch.int64))
        else:
            self.register_buffer("risk_sum",
                                 torch.zeros(self.num_groups, grid + 1, dtype=torch.int64))
            self.register_buffer("images", torch.zeros(self.num_groups, dtype=torch.int64))
        self.register_buffer("seen", torch.zeros(1, dtype=torch.int64))  # images with pixels
        self.register_buffer("threshold_index",
                             torch.full((self.num_groups,), grid, dtype=torch.int64))
        self.calibration_images = 0
        self.calibration_images_group: list[int] = [0] * self.num_groups

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, alpha={self.alpha}, mode={self.mode!r}, "
                f"score={self.score!r}")

    def reset(self) -> None:
        """Zero the calibration state (the fitted threshold stays until the next ``fit``)."""
        for name in ("image_hist", "risk_sum", "images", "seen"):
            if hasattr(self, name):
                getattr(self, name).zero_()

    # ---- scores -----------------------------------------------------------------------------

    def cells(self, logits: Tensor, target: Tensor | None = None
              ) -> tuple[Tensor, Tensor, Tensor]:
        """Grid cells of every class ``(N, K, P)``, labels and valid mask ``(N, P)`` (all
        valid, labels 0 without a target)."""
        if target is None:
            target = torch.zeros(logits.shape[0], *logits.shape[2:], dtype=torch.int64,
                                 device=logits.device)
        x, y, valid = prepare_logits(logits, target, self.num_classes, self.ignore_index,
                                     self.inputs)
        probs = x.float().softmax(dim=1)
        return score_cells(class_scores(probs, self.score, self.seed), self.grid), y, valid

    def pixel_groups(self, logits: Tensor, cells: Tensor, y: Tensor) -> Tensor:
        """Group of every pixel ``(N, P)`` int64: 0, the true class, or the predicted band."""
        if self.kind == "class":
            return y
        if self.kind == "band":
            pred = logits.argmax(dim=1).detach().cpu().numpy().astype(np.int64)
            return torch.from_numpy(boundary_bands(pred, self.bands)).to(cells.device).flatten(1)
        return torch.zeros_like(y)

    # ---- calibration ------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, logits: Tensor, target: Tensor) -> None:
        """Add calibration images: logits ``(N, K, H, W)``, target ``(N, H, W)``; or
        classification inputs, logits ``(N, K)`` and target ``(N,)`` (:func:`as_spatial`)."""
        logits, target = as_spatial(logits, target)
        if not isinstance(logits, Tensor) or logits.dim() != 4:
            shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(f"Expected `logits` of shape (N, K, H, W) or (N, K), but got "
                             f"{shape}.")
        cells, y, valid = self.cells(logits, target)
        true_cell = cells.gather(1, y.unsqueeze(1)).squeeze(1)
        self.seen += valid.any(dim=1).sum()
        if self.kind == "image":
            s = image_scores(true_cell, valid, self.tau, self.grid)
            self.image_hist.add_(torch.bincount(s[s >= 0], minlength=self.grid + 1))
            return
        group = self.pixel_groups(logits, cells, y)
        if true_cell.shape[1] == 1:  # one position per image: the summed curves at once
            summed, images = flat_risk_sum(true_cell, valid, group, self.num_groups, self.grid)
            self.risk_sum.add_(summed)
            self.images.add_(images)
            return
        curves, totals = image_risk_curves(true_cell, valid, group, self.num_groups, self.grid)
        self.risk_sum.add_(curves.sum(dim=0))
        self.images.add_((totals > 0).sum(dim=0))

    @torch.no_grad()
    def fit(self) -> dict[str, Any]:
        """Threshold(s) from the calibration state summed over ranks (a collective).

        Returns ``{"alpha", "mode", "score", "threshold", "calibration_images"}`` (and
        ``calibration_images_group``, the images holding each class / band):
        ``threshold`` a number (``risk``, ``image``) or a list per class / band, each
        ``g / grid`` (1.0 means every class), and :meth:`guarantee`'s ``guarantee``,
        ``needs_images`` (and ``warning``). Images without a valid pixel are not counted
        (they have no coverage; the test meter skips them too)."""
        if self.kind == "image":
            hist, seen = sum_over_ranks([self.image_hist, self.seen])
            idx = [quantile_threshold(hist.tolist(), self.alpha)]
            per_group = [int(hist.sum())]
        else:
            risk, images, seen = sum_over_ranks([self.risk_sum, self.images, self.seen])
            per_group = images.tolist()
            idx = [crc_threshold(risk[g].tolist(), per_group[g], self.alpha)
                   for g in range(self.num_groups)]
        n = int(seen[0])
        self.threshold_index.copy_(torch.tensor(idx, dtype=torch.int64))
        self.calibration_images = n
        self.calibration_images_group = [int(c) for c in per_group]
        out: dict[str, Any] = {"alpha": self.alpha, "mode": self.mode, "score": self.score,
                               "threshold": self.thresholds(), "calibration_images": n}
        if self.kind in ("class", "band"):
            out["calibration_images_group"] = per_group
        return {**out, **self.guarantee()}

    def guarantee(self) -> dict[str, Any]:
        """:func:`guarantee_status` of the last fit: ``{"guarantee", "needs_images"}`` (and
        ``groups_without_guarantee`` per class / band, ``warning`` when it is empty)."""
        counts = self.calibration_images_group
        if self.kind in ("risk", "image"):
            counts = [self.calibration_images]
        return guarantee_status(self.alpha, self.kind, counts)

    def thresholds(self) -> float | list[float]:
        """The fitted threshold (``risk`` / ``image``) or thresholds (per class / band)."""
        values = [int(g) / self.grid for g in self.threshold_index.tolist()]
        return values if self.kind in ("class", "band") else values[0]

    # ---- prediction -------------------------------------------------------------------------

    @torch.no_grad()
    def sets(self, logits: Tensor) -> Tensor:
        """Prediction sets ``(N, K, H, W)`` bool: class ``k`` is in a pixel's set when its cell
        is at most the threshold index of the pixel's class (``class``) or band (``band``)."""
        cells, y, _ = self.cells(logits)
        return self._sets_from_cells(logits, cells).view(logits.shape)

    def _sets_from_cells(self, logits: Tensor, cells: Tensor) -> Tensor:
        idx = self.threshold_index.to(cells.device)
        if self.kind == "class":
            return cells <= idx.view(1, -1, 1)
        if self.kind == "band":
            group = self.pixel_groups(logits, cells, cells[:, 0])
            return cells <= idx[group].unsqueeze(1)
        return cells <= idx[0]
