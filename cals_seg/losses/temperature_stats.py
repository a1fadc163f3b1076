"""The validation temperature of a network, from O(bins) sums over its validation logits.

A margin ``m`` bounds every logit gap ``d_ik <= m``; once the constraint holds, the top-label
confidence is at most ``cap(m) = 1 / (1 + (K - 1) e^-m)``. Dividing every gap by ``T`` acts like
temperature scaling by ``T``, so the temperature that would match the mean validation
confidence to the accuracy, and its interval, say whether a network is over-confident
(``T > 1``), under-confident (``T < 1``) or calibrated within the noise of its validation set::

    m_eff(i) = log(K - 1) - log sum_{k != top} exp(l_ik - l_i,top)   # cap(m_eff(i)) = conf(i)
    conf(T)  = mean_i cap(m_eff(i) / T)                               # validation, valid pixels
    gap      = sum_j (c_j - a_j) / sum_j n_j        # per image j: confidence sum, correct, pixels
    se(gap)  = sqrt(J / (J - 1) sum_j (c_j - a_j - gap n_j)^2) / sum_j n_j     # J images
    T_lo, T_hat, T_hi = the T with conf(T) = acc + z se, acc, acc - z se
    G        = the largest validation gap (a margin above it binds on no pixel)

The sampling unit of the interval is the image (for classification each sample is one): the
pixels of one image are correlated, so a pixel-level binomial error would be far too small.
``se(gap)`` is the standard error of a ratio estimator over J clusters (the delta method), and
reduces to ``std_j(c_j - a_j) / sqrt(J)`` when every image has one position.

``m_eff`` is the margin that would give pixel ``i``'s confidence if all its gaps were equal, so
``cap(m_eff / T)`` is its confidence with every gap scaled by ``1/T`` (exact when the
non-top logits are equal, an approximation otherwise). The statistics are a histogram of
``m_eff`` (bins of :data:`BIN_WIDTH`, the last one open), one of the largest gap, the number of
correct pixels, the number of pixels and of correct pixels per class, and ten per-image sums
(:func:`image_sums`): O(bins) and O(K) float64 sums, so everything computed from them is exact
under torch.distributed (sums all-reduced first; the counts exactly, the confidence sums up to
float64 rounding) and deterministic.

Used by the under-confidence hint after training and evaluation
(:mod:`cals_seg.evaluation.confidence_regime`), the margins of ``cals_alm_bands`` and the
``margin: auto`` rule kept beside the core.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from cals_seg.losses._functional import blocks

BIN_WIDTH = 0.05  # nats of m_eff per histogram bin
NUM_BINS = 800  # covers m_eff in [0, 40); larger values fall in the last bin
T_RANGE = (1.0 / 16.0, 16.0)  # the solve is clipped to this range of temperatures
INTERVAL_Z = 2.0  # default half-width of the temperature interval in standard errors (~95%)
# The per-image sums of :func:`image_sums`, in this order (c: confidence sum, a: correct count,
# n: valid positions of one image; images without a valid position are not counted).
IMAGE_SUM_KEYS = ("images", "n", "c", "a", "nn", "cc", "aa", "cn", "an", "ca")


def _bin(values: Tensor) -> Tensor:
    return (values / BIN_WIDTH).floor_().clamp_(0, NUM_BINS - 1).long()


def effective_margin_sums(
    logits: Tensor, target: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Histograms of ``m_eff`` and of the largest gap ``max_k d_ik``, and the number of correct
    top-1 predictions, over valid positions.

    Args:
        logits: ``(N, K, S)`` float32 or float64.
        target: ``(N, S)`` int64 (void positions may hold any value).
        valid: ``(N, S)`` bool.

    Returns:
        ``hist (NUM_BINS,)``, ``gap_hist (NUM_BINS,)`` float64 counts and ``correct ()``
        float64.
    """
    k = logits.shape[1]
    hist = torch.zeros(NUM_BINS, dtype=torch.float64, device=logits.device)
    gap_hist = torch.zeros(NUM_BINS, dtype=torch.float64, device=logits.device)
    correct = torch.zeros((), dtype=torch.float64, device=logits.device)
    log_others = math.log(k - 1)
    for im, pos in blocks(logits):
        x = logits[im, :, pos]  # (n, K, s)
        ok = valid[im, pos]
        mx, top = x.max(dim=1, keepdim=True)
        others = (x - mx).scatter_(1, top, float("-inf"))
        m_eff = log_others - torch.logsumexp(others, dim=1)  # (n, s), >= 0 up to rounding
        largest = mx.squeeze(1) - x.amin(dim=1)
        hist += torch.bincount(_bin(m_eff[ok]), minlength=NUM_BINS).to(torch.float64)
        gap_hist += torch.bincount(_bin(largest[ok]), minlength=NUM_BINS).to(torch.float64)
        correct += (top.squeeze(1) == target[im, pos])[ok].sum().to(torch.float64)
    return hist, gap_hist, correct


def largest_gap_bound(gap_hist: Tensor) -> float:
    """An upper bound of the largest validation gap: the right edge of the highest non-empty
    bin of ``gap_hist``. A margin at or above it binds on no validation pixel (inert)."""
    nonzero = torch.nonzero(gap_hist).flatten()
    return float(int(nonzero[-1]) + 1) * BIN_WIDTH if len(nonzero) else 0.0


def confidence_cap(margin: Tensor | float, num_classes: int) -> Tensor:
    """``1 / (1 + (K - 1) e^-m)``: the largest top-label confidence with every gap ``<= m``."""
    m = torch.as_tensor(margin, dtype=torch.float64)
    return torch.sigmoid(m - math.log(num_classes - 1))


def mean_confidence(hist: Tensor, num_classes: int, temperature: float) -> float:
    """``mean_i cap(m_eff(i) / T)`` from the histogram (bin centres; the open last bin at its
    left edge)."""
    centres = (torch.arange(NUM_BINS, dtype=torch.float64, device=hist.device) + 0.5) * BIN_WIDTH
    centres[-1] = (NUM_BINS - 1) * BIN_WIDTH
    conf = confidence_cap(centres / temperature, num_classes)
    return float((hist * conf).sum() / hist.sum())


def _confidence_curve(hist: Tensor, num_classes: int) -> Callable[[float], float]:
    """:func:`mean_confidence` as a function of ``T`` for one histogram, for the 62 evaluations
    of a bisection: the non-empty bins copied to the host once (one device sync, not one per
    evaluation), then ``sum_b h_b / (1 + (K - 1) e^(-c_b / T)) / sum_b h_b`` over them in
    float64 NumPy (equal to :func:`mean_confidence` up to float64 rounding: the empty bins add
    exact zeros)."""
    counts = hist.detach().to("cpu", torch.float64).numpy()
    keep = np.flatnonzero(counts)
    weights = counts[keep]
    centres = (keep + 0.5) * BIN_WIDTH
    centres[keep == NUM_BINS - 1] = (NUM_BINS - 1) * BIN_WIDTH  # the open last bin
    total, shift = float(weights.sum()), math.log(num_classes - 1)
    return lambda t: float((weights / (1.0 + np.exp(shift - centres / t))).sum() / total)


def solve_temperature(hist: Tensor, correct: float, num_classes: int) -> float:
    """The ``T`` in :data:`T_RANGE` with ``mean_confidence(T) = accuracy`` (bisection on
    ``log T``; ``mean_confidence`` decreases in ``T``), clipped to the range's ends."""
    n = float(hist.sum())
    if n <= 0:
        raise ValueError("solve_temperature: the histogram is empty")
    return solve_temperature_at(hist, correct / n, num_classes)


def solve_temperature_at(hist: Tensor, accuracy: float, num_classes: int) -> float:
    """The ``T`` in :data:`T_RANGE` with ``mean_confidence(T) = accuracy`` for any target
    ``accuracy`` (the ends of an interval: ``accuracy +- z se``), clipped to the range's ends."""
    if float(hist.sum()) <= 0:
        raise ValueError("solve_temperature: the histogram is empty")
    conf = _confidence_curve(hist, num_classes)
    lo, hi = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    if conf(math.exp(lo)) <= accuracy:
        return T_RANGE[0]
    if conf(math.exp(hi)) >= accuracy:
        return T_RANGE[1]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if conf(math.exp(mid)) > accuracy:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def image_sums(logits: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The per-image sums of the temperature interval and the correct positions per class.

    For each image ``j`` (a row of ``logits``) with ``n_j > 0`` valid positions: ``c_j`` the sum
    of the top-label confidences ``max_k softmax(l)_k``, ``a_j`` the number of correct top-1
    predictions. Returned summed over images, as :data:`IMAGE_SUM_KEYS`: ``[J, sum n_j, sum
    c_j, sum a_j, sum n_j^2, sum c_j^2, sum a_j^2, sum c_j n_j, sum a_j n_j, sum c_j a_j]``.

    Args:
        logits: ``(N, K, S)`` float32 or float64.
        target: ``(N, S)`` int64 (void positions may hold any value).
        valid: ``(N, S)`` bool.

    Returns:
        ``sums (10,)`` float64 and ``class_correct (K,)`` float64 (correct valid positions per
        ground-truth class).
    """
    n_img, k = logits.shape[:2]
    dev = logits.device
    conf = torch.zeros(n_img, dtype=torch.float64, device=dev)
    right = torch.zeros(n_img, dtype=torch.float64, device=dev)
    class_correct = torch.zeros(k, dtype=torch.float64, device=dev)
    for im, pos in blocks(logits):
        x = logits[im, :, pos]  # (n, K, s)
        ok = valid[im, pos]
        mx, top = x.max(dim=1, keepdim=True)
        p_top = torch.exp(-torch.logsumexp(x - mx, dim=1)).to(torch.float64)  # (n, s)
        hit = (top.squeeze(1) == target[im, pos]) & ok
        conf[im] += torch.where(ok, p_top, 0.0).sum(dim=1)
        right[im] += hit.sum(dim=1).to(torch.float64)
        class_correct += torch.bincount(target[im, pos][hit], minlength=k).to(torch.float64)
    count = valid.sum(dim=1).to(torch.float64)
    seen = count > 0
    n, c, a = count[seen], conf[seen], right[seen]
    sums = torch.stack([seen.sum().to(torch.float64), n.sum(), c.sum(), a.sum(), (n * n).sum(),
                        (c * c).sum(), (a * a).sum(), (c * n).sum(), (a * n).sum(),
                        (c * a).sum()])
    return sums, class_correct


def ratio_se(images: float, s_n: float, s_y: float, s_yy: float, s_yn: float,
             s_nn: float) -> tuple[float, float | None]:
    """The ratio ``r = sum_j y_j / sum_j n_j`` over ``J`` images and its standard error with
    the image as the sampling unit (delta method for a ratio estimator)::

        se(r) = sqrt(J / (J - 1) * sum_j (y_j - r n_j)^2) / sum_j n_j
        sum_j (y_j - r n_j)^2 = s_yy - 2 r s_yn + r^2 s_nn

    Returns:
        ``(r, se)``; ``se`` is None with fewer than two images (no error can be estimated).
    """
    r = s_y / s_n
    if images < 2:
        return r, None
    resid = max(s_yy - 2.0 * r * s_yn + r * r * s_nn, 0.0)
    return r, math.sqrt(images / (images - 1.0) * resid) / s_n


def gap_and_accuracy(sums: Tensor) -> tuple[float, float | None, float, float | None]:
    """``(gap, se(gap), acc, se(acc))`` from :func:`image_sums` (summed over batches and
    processes): ``gap = (sum c - sum a) / sum n`` (mean confidence - accuracy, > 0
    over-confident), both with :func:`ratio_se`'s image-level standard errors.

    Raises:
        ValueError: no valid position was counted.
    """
    v = dict(zip(IMAGE_SUM_KEYS, sums.tolist(), strict=True))
    if v["n"] <= 0:
        raise ValueError("gap_and_accuracy: no validation position was counted")
    gap, gap_se = ratio_se(v["images"], v["n"], v["c"] - v["a"],
                           v["cc"] - 2.0 * v["ca"] + v["aa"], v["cn"] - v["an"], v["nn"])
    acc, acc_se = ratio_se(v["images"], v["n"], v["a"], v["aa"], v["an"], v["nn"])
    return gap, gap_se, acc, acc_se


def temperature_interval(hist: Tensor, accuracy: float, se: float | None, z: float,
                         num_classes: int) -> tuple[float, float]:
    """``(T_lo, T_hi)``: the temperatures whose mean confidence ``conf(T)`` equals ``accuracy
    + z se`` and ``accuracy - z se`` (:func:`solve_temperature_at`); ``T_RANGE`` when ``se`` is
    None (no evidence). ``conf`` decreases in ``T``, so ``T_lo <= T_hi``, and ``T_lo <= 1 <=
    T_hi`` exactly when ``|conf(1) - accuracy| <= z se``."""
    if se is None:
        return T_RANGE
    return (solve_temperature_at(hist, accuracy + z * se, num_classes),
            solve_temperature_at(hist, accuracy - z * se, num_classes))


def class_counts(target: Tensor, valid: Tensor, num_classes: int) -> Tensor:
    """Number of valid positions per ground-truth class.

    Args:
        target: ``(N, S)`` int64 (void positions may hold any value).
        valid: ``(N, S)`` bool.
        num_classes: K.

    Returns:
        ``(K,)`` float64 counts.
    """
    return torch.bincount(target[valid], minlength=num_classes).to(torch.float64)
