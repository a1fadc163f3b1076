"""Streaming pixel-level calibration metrics (docs/design.md, "Metrics").

``_calibration_update`` turns one batch into sufficient statistics (counts and sums),
``_calibration_compute`` turns accumulated statistics into metric values, and
``CalibrationMeter`` only stores the statistics as buffers. Every statistic is a sum, so the
state never grows with the number of pixels and DDP sync is a sum over ranks.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from cals_seg.metrics._base import Meter
from cals_seg.metrics.functional import (
    BLOCK_ELEMENTS,
    NUM_FINE_CELLS,
    _edge_thresholds,
    bin_index,
    fine_cell,
    max_argmax,
    position_block,
    prepare_logits,
)
from cals_seg.metrics.registry import register_meter
from cals_seg.utils.validation import check_finite

# Per-image values whose sums over images are kept (``<name>_image_mean`` in ``compute``).
IMAGE_KEYS = ("ece", "mce", "acc", "nll", "brier", "cwce")


def _bincount(index: Tensor, size: int, weights: Tensor | None = None) -> Tensor:
    """``bincount`` of a flat index whose value ``size`` marks positions to drop."""
    w = None if weights is None else weights.reshape(-1)
    out = torch.bincount(index.reshape(-1), weights=w, minlength=size + 1)[:size]
    return out if w is None else out.to(w.dtype)  # (empty input gives int64 even with weights)


def _above(x: Tensor, threshold: float) -> Tensor:
    """``x > threshold`` as a uint8 tensor, for float32 / float64 ``x`` without NaN and a
    ``threshold > 0`` of its dtype: compared as integers, since the bit patterns of
    non-negative floats are ordered as their values (and a negative value, -0.0 included, is a
    negative integer). On the CPU the integer comparison and ``nonzero`` of uint8 measured
    faster than the float comparison and ``nonzero`` of bool (0.6 against 0.8 ms and 2.9
    against 4.2 ms on a block of a million values, one thread).

    Shape:
        - x: any shape (any strides); returns: the same shape, uint8 (0 or 1).
    """
    itype = torch.int32 if x.dtype == torch.float32 else torch.int64
    bits = int(torch.tensor(threshold, dtype=x.dtype).view(itype))
    return x.view(itype).gt(bits).view(torch.uint8)


def _classwise_rest_sums(q: Tensor, n_bins: int, out: Tensor, rest: Tensor | None = None) -> None:
    """Add to ``out[i, k, b]`` the float64 sum of ``q[i, k, j]`` over the positions ``j`` with
    ``bin(q[i, k, j]) = b``, for ``b >= 1``; ``out[..., 0]`` gets the float64 total of ``q``
    (the caller subtracts the other bins from it at the end).

    No scatter over all ``N K P`` values: a value is in bin 0 exactly when it is ``<= t_1``, the
    largest value of its dtype not above ``1 / n`` (``bin_index``'s edges), and since the values
    of a position sum to at most 1, fewer than ``n`` of them are above it. Only those go through
    an ``index_add``; with the arg-max already taken out of ``q`` that is one or two per
    position in practice. ``rest``, the float sum of each position's values, narrows the search:
    a float sum of non-negative terms is at least its largest term (rounding is monotone), so a
    position with ``rest <= t_1`` has every value in bin 0, and only the others are searched when
    they are fewer than half (a trained network's confident pixels: most of them). The values
    found are the same either way (added in another order).

    Shape:
        - q: ``(N, K, B)`` float32 / float64 (a block of positions, void positions set to 0;
          the arg-max may be left in); out: ``(N, K, n_bins)`` float64, updated in place;
          rest: ``(N, B)``, ``q.sum(dim=1)``.
    """
    n, k, npos = q.shape
    out[:, :, 0] += q.sum(dim=2, dtype=torch.float64)
    if n_bins == 1:
        return
    t1 = _edge_thresholds(n_bins, q.dtype)[0]
    uncertain = _above(rest, t1) if rest is not None else None
    # counted first: the positions are listed only when the narrowed search is taken
    if uncertain is not None and 2 * int(uncertain.sum(dtype=torch.int64)) < n * npos:
        image, pos = uncertain.nonzero(as_tuple=True)
        searched = q[image, :, pos]  # (m, K): the values of the uncertain positions
        which, cls = _above(searched, t1).nonzero(as_tuple=True)
        values = searched[which, cls]
        rows = image[which].mul_(k).add_(cls)  # i * K + k
    else:
        flat = q.reshape(n * k, npos)
        rows, cols = _above(flat, t1).nonzero(as_tuple=True)  # row = i * K + k
        values = flat[rows, cols]
    cell = rows.mul_(n_bins).add_(bin_index(values, n_bins))
    out.view(-1).index_add_(0, cell, values.to(torch.float64))


def _classwise_prob_sums(p: Tensor, invalid: Tensor, n_bins: int) -> Tensor:
    """``out[i, k, b]``: float64 sum of ``p[i, k, j]`` over the valid positions ``j`` of image
    ``i`` with ``bin(p[i, k, j]) = b`` (:func:`_classwise_rest_sums` over blocks of
    ``_SUM_BLOCK`` positions). The void positions of ``p`` are set to 0 here (in place).

    Shape:
        - p: ``(N, K, P)`` float32 or float64; invalid: ``(N, P)`` bool.
        - returns: ``(N, K, n_bins)`` float64.
    """
    n, k, npos = p.shape
    inv_n, inv_j = invalid.nonzero(as_tuple=True)
    if inv_n.numel():
        p[inv_n, :, inv_j] = 0.0
    out = torch.zeros((n, k, n_bins), dtype=torch.float64, device=p.device)
    for start in range(0, npos, _SUM_BLOCK):
        _classwise_rest_sums(p[:, :, start:start + _SUM_BLOCK], n_bins, out)
    out[:, :, 0] -= out[:, :, 1:].sum(dim=2)
    return out


_SUM_BLOCK = 16384  # positions per block of _classwise_prob_sums
_BLOCK_ELEMENTS = BLOCK_ELEMENTS  # logits per block of _calibration_update (tests shrink it)


# Not split (over 80 lines): the block loop keeps every (N, K, block) temporary in the cache;
# helpers would only pass a dozen per-position buffers back and forth.
def _calibration_update(
    logits: Tensor,
    target: Tensor,
    num_classes: int,
    n_bins: int = 15,
    ignore_index: int = -100,
    classwise: bool = True,
    inputs: str = "logits",
) -> dict[str, Tensor]:
    """Sufficient statistics of one batch (sums over its valid positions).

    With ``p = softmax(logits)`` (``torch.softmax`` in float32, or float64 for float64 logits),
    top-label confidence ``c = max_k p_k``, prediction ``argmax_k logits_k``, correctness
    ``a = [pred == y]`` and ``bin(x) = clip(ceil(x n) - 1, 0, n - 1)`` computed exactly:

    - ``bin_count / bin_correct / bin_conf``: per bin, sum of 1, a, c.
    - ``nll_sum``: sum of ``-log softmax(l)_y = (max_j l_j - l_y) + log1p(r / c)``, the
      log-sum-exp form of ``log_softmax`` with the arg-max term taken out:
      ``sum_{j != pred} exp(l_j - max) = r / c`` where ``r = sum_{j != pred} p_j``. Evaluated in
      float64 from float32 ``l``, ``r`` and ``c``; unlike ``-log p_y`` it stays finite when
      ``p_y`` underflows, and unlike ``log(sum_j ...)`` in float32 it keeps its relative
      precision when ``p_y`` is within 1e-7 of 1.
    - ``brier_sum``: sum of ``sum_k (p_k - [y == k])^2 = (1 - p_y)^2 + sum_{k != y} p_k^2``,
      with ``sum_{k != y} p_k^2`` from ``sum_{j != pred} p_j^2`` (no cancellation when ``p_y``
      is close to 1).
    - ``fine_count / fine_correct / fine_conf``: the fine histogram of ``c`` (``fine_cell``).
    - ``cw_prob / cw_hits`` (classwise): per class k and bin b, the sum of ``p_k`` over positions
      with ``bin(p_k) = b``, and the number of those positions with ``y == k``.
    - ``image_sums``: per-image ECE, MCE, accuracy, NLL, Brier and CWCE (``IMAGE_KEYS``) summed
      over the images of the batch that have a valid position; ``num_images`` counts those.

    Every pass over the ``(N, K, P)`` logits (maximum and arg-max, finiteness, softmax, its
    maximum, the gathers at the label, the class-wise values, ``r`` and ``r2``) runs in one
    loop over blocks of positions (:func:`position_block`: about 4 MiB of logits on the CPU,
    read from the cache by every pass after the first; bitwise the softmax of the whole
    tensor); what a block leaves per position (cells, the confidence) is a ``(N, P)`` buffer,
    and the histograms are flat ``bincount`` s over ``N * n_bins`` (top label),
    ``N * K * n_bins`` (classwise) and ``NUM_FINE_CELLS`` cells at the end. The class-wise sums
    of ``p_k`` scatter only the values other than the arg-max above the first bin edge
    (:func:`_classwise_rest_sums`; the arg-max's ``c`` goes to the bin of ``c`` with the
    top-label cells). Temporaries of size ``(N, K, *S)``: none on the CPU besides a
    float16 / bfloat16 input's float32 upcast (the block's are a few MiB); off the CPU (one
    block) the float32 probabilities and a float32 arg-max temporary.

    ``inputs="probs"``: ``logits`` holds probabilities, used as the logits ``log p``
    (``cals_seg.metrics.functional.as_logits``).

    Shape:
        - logits: ``(N, K, *S)`` floating (float16 / bfloat16 are upcast to float32).
        - target: ``(N, *S)`` integer, ``ignore_index`` marks void positions.
    """
    x, y, valid = prepare_logits(logits, target, num_classes, ignore_index, inputs)
    n, k, npos = x.shape
    dev = x.device
    f64, i32 = torch.float64, torch.int32
    invalid = ~valid
    top_cells, cw_cells = n * n_bins, n * k * n_bins
    idt = i32 if cw_cells < 2**31 - 1 else torch.int64
    # Per position, filled block by block: (top-label cell << 1) + correct, (fine cell << 1) +
    # correct, the confidence; with classwise the (image, label, bin(p_y)) and
    # (image, pred, bin(c)) cells. Void positions hold the drop cell.
    top = torch.empty((n, npos), dtype=i32, device=dev)
    fine = torch.empty((n, npos), dtype=i32, device=dev)
    conf_all = torch.empty((n, npos), dtype=x.dtype, device=dev)
    ycell = torch.empty((n, npos), dtype=idt, device=dev) if classwise else None
    pcell = torch.empty((n, npos), dtype=idt, device=dev) if classwise else None
    rest_nkb = torch.zeros((n, k, n_bins), dtype=f64, device=dev) if classwise else None
    nll_n = torch.zeros(n, dtype=f64, device=dev)
    brier_n = torch.zeros(n, dtype=f64, device=dev)
    image = torch.arange(n, device=dev, dtype=i32).unsqueeze(1)
    image_k = image.to(idt) * k  # i * K
    block = position_block(x, _BLOCK_ELEMENTS) if npos > 1 else 1
    for start in range(0, npos, block):
        end = min(start + block, npos)
        xb, yb, vb = x[:, :, start:end], y[:, start:end], invalid[:, start:end]
        maxima, pred = max_argmax(xb)
        if not bool(xb.amin(dim=1).add_(maxima).sum().isfinite()):
            check_finite(xb)  # raises on NaN / inf (before pred = K is used as an index)
        x_y = xb.gather(1, yb.unsqueeze(1)).squeeze(1)
        if npos == 1:  # (N, K) and (N, K, 1): torch's contiguous last-dimension kernel
            p = torch.softmax(xb.reshape(n, k), dim=1).view(n, k, 1)
        else:
            p = xb.contiguous().softmax(dim=1)  # (the contiguous kernel: 3x faster, same bits)
        conf = p.amax(dim=1)  # = p[pred] exactly: exp(0) = 1 is the largest numerator
        p_y = p.gather(1, yb.unsqueeze(1)).squeeze(1)
        # q = p with q_pred = 0 (and 0 at void positions): r = sum q = (s - 1) / s, s = 1 / c
        q = p.scatter_(1, pred.unsqueeze(1), 0.0)
        inv_n, inv_j = vb.nonzero(as_tuple=True)
        if inv_n.numel():
            q[inv_n, :, inv_j] = 0.0
        rest = q.sum(dim=1)
        if rest_nkb is not None:
            _classwise_rest_sums(q, n_bins, rest_nkb, rest)
        rest_sq = q.mul_(q).sum(dim=1)  # sum_{j != pred} p_j^2
        del p, q
        conf64, p_y64 = conf.to(f64), p_y.to(f64)
        nll = maxima.to(f64).sub_(x_y)  # max_j l_j - l_y
        nll.add_(rest.to(f64).div_(conf64).log1p_()).masked_fill_(vb, 0.0)
        nll_n += nll.sum(dim=1)
        # sum_{k != y} p_k^2 = sum_{j != pred} p_j^2 + c^2 - p_y^2 (the last two cancel exactly
        # when pred == y, where c = p_y).
        brier = torch.sub(1.0, p_y64)
        brier.mul_(brier).add_(rest_sq).addcmul_(conf64, conf64).addcmul_(p_y64, p_y64, value=-1)
        brier_n += brier.masked_fill_(vb, 0.0).sum(dim=1)
        correct = (pred == yb).logical_and_(~vb)
        b_conf = bin_index(conf, n_bins)
        cell = b_conf.add(image * n_bins).masked_fill_(vb, top_cells)
        top[:, start:end] = cell.mul_(2).add_(correct)
        fcell = fine_cell(conf).masked_fill_(vb, NUM_FINE_CELLS)
        fine[:, start:end] = fcell.mul_(2).add_(correct)
        conf_all[:, start:end] = conf
        if ycell is not None and pcell is not None:
            cell = yb.to(idt, copy=True).add_(image_k).mul_(n_bins).add_(bin_index(p_y, n_bins))
            ycell[:, start:end] = cell.masked_fill_(vb, cw_cells)
            cell = pred.to(idt).add_(image_k).mul_(n_bins).add_(b_conf)
            pcell[:, start:end] = cell.masked_fill_(vb, cw_cells)

    conf64 = conf_all.to(f64)
    del conf_all
    hits = _bincount(top, 2 * top_cells).view(n, n_bins, 2)
    conf_nb = _bincount(top.bitwise_right_shift_(1), top_cells, conf64).view(n, n_bins)
    del top
    count_nb = hits.sum(dim=2)
    correct_nb = hits[..., 1]
    fhits = _bincount(fine, 2 * NUM_FINE_CELLS).view(NUM_FINE_CELLS, 2)
    stats: dict[str, Tensor] = {
        "bin_count": count_nb.sum(dim=0),
        "bin_correct": correct_nb.sum(dim=0),
        "bin_conf": conf_nb.sum(dim=0),
        "fine_count": fhits.sum(dim=1),
        "fine_correct": fhits[:, 1].clone(),
        "fine_conf": _bincount(fine.bitwise_right_shift_(1), NUM_FINE_CELLS, conf64),
    }
    del fine

    cwce_n = torch.zeros(n, dtype=f64, device=dev)
    count_n = count_nb.sum(dim=1)
    denom = count_n.clamp(min=1).to(f64)
    if rest_nkb is not None and ycell is not None and pcell is not None:
        hits_nkb = _bincount(ycell, cw_cells).view(n, k, n_bins)
        # The arg-max values (c, in the bin of c) and the rest; bin 0 of the rest is its
        # total minus its other bins.
        rest_nkb[:, :, 0] -= rest_nkb[:, :, 1:].sum(dim=2)
        prob_nkb = _bincount(pcell, cw_cells, conf64).view(n, k, n_bins).add_(rest_nkb)
        stats["cw_prob"] = prob_nkb.sum(dim=0)
        stats["cw_hits"] = hits_nkb.sum(dim=0)
        cwce_n = (hits_nkb - prob_nkb).abs().sum(dim=2).mean(dim=1) / denom

    stats["nll_sum"] = nll_n.sum()
    stats["brier_sum"] = brier_n.sum()

    # Per-image values (images without a valid position are skipped).
    gap_nb = (correct_nb - conf_nb).abs()
    per_bin = gap_nb / count_nb.clamp(min=1)
    per_image = torch.stack(
        [
            gap_nb.sum(dim=1) / denom,
            per_bin.amax(dim=1),
            correct_nb.sum(dim=1) / denom,
            nll_n / denom,
            brier_n / denom,
            cwce_n,
        ],
        dim=1,
    )
    has = count_n > 0
    stats["image_sums"] = (per_image * has.unsqueeze(1)).sum(dim=0)
    stats["num_images"] = has.sum()
    return stats


def _adaptive_ece(count: Tensor, correct: Tensor, conf: Tensor, n_bins: int) -> float:
    """Adaptive ECE from the fine histogram: equal-mass bins with boundary cells split pro rata.

    The sorted confidences are the cells in order. ``array_split`` sizes give the bin
    boundaries ``P_0 = 0 < ... < P_n = m`` in sorted position; the sum of a quantity over the
    first ``x`` sorted samples is interpolated linearly inside the cell that holds position
    ``x``. A bin's sums are differences of these cumulative functions at its two boundaries.
    """
    m = int(count.sum())
    q, r = divmod(m, n_bins)
    sizes = torch.tensor([q + 1] * r + [q] * (n_bins - r), dtype=torch.int64)
    bounds = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
    # Pad a last cell (count 1, sums 0) so that position m is inside a cell.
    cnt = torch.cat([count.cpu(), torch.ones(1, dtype=torch.int64)])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), cnt.cumsum(0)[:-1]])
    cell = torch.searchsorted(starts, bounds, right=True) - 1
    frac = (bounds - starts[cell]).double() / cnt[cell].double()

    def cumulative(values: Tensor) -> Tensor:
        v = torch.cat([values.cpu().double(), torch.zeros(1, dtype=torch.float64)])
        before = torch.cat([torch.zeros(1, dtype=torch.float64), v.cumsum(0)[:-1]])
        return before[cell] + frac * v[cell]

    acc_sums = cumulative(correct).diff()
    conf_sums = cumulative(conf).diff()
    return float((acc_sums - conf_sums).abs().sum() / m)


def _ratio(num: Tensor, den: int) -> float | None:
    return float(num) / den if den > 0 else None


def ece_split(
    bin_count: Tensor, bin_correct: Tensor, bin_conf: Tensor
) -> tuple[float | None, float | None, float | None]:
    """``(ece, ece_over, ece_under)`` from per-bin count, correct count and confidence sum.

    ``ece_over = sum_{b: conf(B_b) > acc(B_b)} |B_b| / m * (conf(B_b) - acc(B_b))`` (the
    over-confident bins), ``ece_under`` the same sum over the other bins, and ``ece`` is
    computed as ``ece_over + ece_under``, so the equality holds exactly in floating point. A
    bin's ``|B_b| (conf - acc)`` is its ``conf sum - correct count``. None when ``m = 0``.

    Shape:
        - bin_count, bin_correct: ``(n_bins,)`` integer; bin_conf: ``(n_bins,)`` float64.
    """
    count = int(bin_count.sum())
    if count == 0:
        return None, None, None
    excess = bin_conf.double() - bin_correct.double()  # |B_b| (conf(B_b) - acc(B_b))
    over = float(excess.clamp(min=0).sum()) / count
    under = float(excess.neg().clamp(min=0).sum()) / count
    return over + under, over, under


def reliability_data(
    bin_count: Tensor, bin_correct: Tensor, bin_conf: Tensor, n_bins: int
) -> dict[str, list]:
    """Reliability-diagram data: bin edges, and per bin the count, mean confidence, accuracy
    (0.0 for an empty bin). Shapes as in :func:`ece_split`."""
    nonempty = bin_count > 0
    safe = bin_count.clamp(min=1).double()
    return {
        "bin_edges": [b / n_bins for b in range(n_bins + 1)],
        "count": bin_count.tolist(),
        "confidence": torch.where(nonempty, bin_conf.double() / safe, 0.0).tolist(),
        "accuracy": torch.where(nonempty, bin_correct.double() / safe, 0.0).tolist(),
    }


# Coverages at which the risk-coverage curve is reported: 1/100, 2/100, ..., 1.
RISK_COVERAGE_POINTS = 100


def _risk_coverage(count: Tensor, correct: Tensor) -> dict[str, Any]:
    """AURC, its error bound and the risk-coverage curve from the fine histogram.

    The cells are taken from the most to the least confident; inside a cell the errors are
    spread pro rata (the cumulative error count is linear in the position). For a cell that
    holds ``n`` positions, ``e`` of them wrong, after ``S`` positions and ``E`` errors of the
    more confident cells, that gives

        sum_{t=1..n} (E + t e / n) / (S + t) = e + (E - S e / n) (H(S + n) - H(S))

    with ``H`` the harmonic numbers (``digamma(x + 1) - digamma(1)``), so
    ``aurc = (1 / m) sum_i risk(i)`` needs no loop. The true cumulative error count inside the
    cell, in any order of its positions, is within ``e (n - e) / n`` of the pro-rata one, so

        |aurc - exact| <= (1 / m) sum_cells e (n - e) / n * (H(S + n) - H(S))  (= aurc_bound)

    over every cell but the one of exactly 1.0 (ties, where pro rata is the definition).

    Shape:
        - count, correct: ``(NUM_FINE_CELLS,)`` int64, cells in increasing confidence.
    """
    f64 = torch.float64
    n_all = count.flip(0).to(f64)
    e_all = (count - correct).flip(0).to(f64)
    tied = torch.zeros_like(n_all, dtype=torch.bool)
    tied[0] = True  # the cell of exactly 1.0, now first
    keep = n_all > 0
    n, e, tied = n_all[keep], e_all[keep], tied[keep]
    m = float(n.sum())
    before = n.cumsum(0) - n  # S
    errors_before = e.cumsum(0) - e  # E
    harmonic = torch.special.digamma(before + n + 1) - torch.special.digamma(before + 1)
    aurc = (e.sum() + ((errors_before - before * e / n) * harmonic).sum()) / m
    spread = torch.where(tied, 0.0, e * (n - e) / n)
    bound = (spread * harmonic).sum() / m
    # Risk at coverage c: cumulative errors, interpolated pro rata, over the first c m positions.
    coverage = torch.arange(1, RISK_COVERAGE_POINTS + 1, dtype=f64) / RISK_COVERAGE_POINTS
    position = coverage * m
    cell = torch.searchsorted(n.cumsum(0), position).clamp(max=len(n) - 1)  # cell holding it
    cum_errors = errors_before[cell] + (position - before[cell]) * e[cell] / n[cell]
    return {
        "aurc": float(aurc),
        "aurc_bound": float(bound),
        "risk_coverage": {"coverage": coverage.tolist(), "risk": (cum_errors / position).tolist()},
    }


def _calibration_compute(states: dict[str, Tensor], n_bins: int) -> dict[str, Any]:
    """Metric values from accumulated statistics (see ``CalibrationMeter.compute``)."""
    s = {name: t.cpu() for name, t in states.items()}
    count = int(s["bin_count"].sum())
    bin_count, bin_correct, bin_conf = s["bin_count"], s["bin_correct"].double(), s["bin_conf"]
    gap = (bin_correct - bin_conf).abs()
    nonempty = bin_count > 0
    safe = bin_count.clamp(min=1).double()
    ece, ece_over, ece_under = ece_split(bin_count, bin_correct, bin_conf)
    out: dict[str, Any] = {
        "count": count,
        "ece": ece,
        "ece_over": ece_over,
        "ece_under": ece_under,
        "aece": None,
        "mce": float((gap / safe)[nonempty].max()) if count else None,
        "cwce": None,
        "classwise_ece": None,
        "nll": _ratio(s["nll_sum"], count),
        "brier": _ratio(s["brier_sum"], count),
        "acc": _ratio(bin_correct.sum(), count),
        "conf": _ratio(bin_conf.sum(), count),
    }
    out.update(aurc=None, aurc_bound=None, risk_coverage=None)
    if count:
        out["aece"] = _adaptive_ece(s["fine_count"], s["fine_correct"], s["fine_conf"], n_bins)
        out.update(_risk_coverage(s["fine_count"], s["fine_correct"]))
    if "cw_prob" in s and count:
        per_class = (s["cw_hits"].double() - s["cw_prob"]).abs().sum(dim=1) / count
        out["classwise_ece"] = per_class.tolist()
        out["cwce"] = float(per_class.mean())
    num_images = int(s["num_images"])
    out["num_images"] = num_images
    for i, key in enumerate(IMAGE_KEYS):
        value = _ratio(s["image_sums"][i], num_images)
        out[f"{key}_image_mean"] = None if key == "cwce" and "cw_prob" not in s else value
    out["reliability"] = reliability_data(bin_count, bin_correct, bin_conf, n_bins)
    return out


@register_meter("calibration", build=lambda task, n_bins, test: CalibrationMeter(
    task.num_classes, n_bins, task.ignore_index, classwise=test))
class CalibrationMeter(Meter):
    """Pixel-level calibration metrics with O(K * n_bins + fine_bins) state, exact over DDP.

    Definitions (docs/design.md, "Metrics"), over the valid positions ``i``
    (``y_i != ignore_index``), ``m`` of them, with ``p = softmax(l)``, ``c_i = max_k p_ik``,
    ``a_i = [argmax_k l_ik == y_i]`` and ``n = n_bins`` equal-width bins ``(b/n, (b+1)/n]``
    (0 in the first bin, 1.0 in the last; a float32 confidence is binned by its exact value):

    - ``ece  = sum_b |B_b| / m * |acc(B_b) - conf(B_b)|``; ``mce = max_{b: B_b != {}}
      |acc(B_b) - conf(B_b)|``. ``ece_over`` is the part of that sum from the bins where
      ``conf(B_b) > acc(B_b)`` (over-confident), ``ece_under`` the rest; ``ece`` is computed as
      ``ece_over + ece_under``, so the equality is exact in floating point.
    - ``aece``: sort the ``c_i``, split them into ``n`` bins with ``numpy.array_split`` sizes,
      same weighted sum. Streamed: a fine histogram of ``c`` (cells of width 2^-16 below
      ``1 - 2^-12``, one cell per float32 value in ``[1 - 2^-12, 1)``, one cell for exactly 1.0;
      each holds a count, a correct count and a confidence sum) is cut at the ``array_split``
      positions, a cell that straddles a cut being split pro rata. Only these ``n - 1`` boundary
      cells differ from the sort, by their spread in confidence (at most 2^-16, none in the
      saturated tail) and by which of their tied / near-tied samples are correct; where both
      bins at a cut are over-confident the split cancels exactly. Against the exact sort (ties
      split by position), 15 bins, the tests measure: 0 (float64 rounding) on 9e5 random
      over-confident pixels, with 40% of confidences exactly 1.0, and with 36% in
      ``(1 - 1e-5, 1)`` plus 30% exactly 1.0; 6.4e-6 on 1e6 calibrated pixels (labels drawn
      from the softmax, signs alternating between bins; 1.5e-6 with 50 bins). Requirement:
      1e-4.
    - ``aurc``: area under the risk-coverage curve of selective prediction, ``(1 / m)
      sum_{i=1..m} E(i) / i`` with ``E(i)`` the errors among the ``i`` most confident positions
      (tied confidences averaged over their orders); ``risk_coverage`` is the curve ``E(c m) /
      (c m)`` at ``c = 0.01, 0.02, ..., 1``. Streamed from the same fine histogram, the errors
      being spread pro rata inside a cell. A cell of ``n`` positions, ``e`` of them wrong, can
      move the cumulative error count by at most ``e (n - e) / n`` from pro rata, so the error is
      at most ``aurc_bound = (1 / m) sum_cells e (n - e) / n (H(S + n) - H(S))`` (``S``
      positions before the cell, ``H`` the harmonic numbers; the cell of exactly 1.0 holds ties
      and adds nothing). The bound counts the tail cells too, which for float32 confidences hold
      one value each (no error), so it is conservative. Against the exact sort the tests
      measure, 6 classes: errors 5e-8 / 7e-9 (calibrated, 2e5 / 1e6 pixels; bound 1.2e-5),
      1.9e-7 / 5.2e-7 (over-confident; bound 1.2e-4), 4e-9 / 2e-9 (40% of confidences exactly
      1.0, 30% tied in the tail; bound 2e-4 / 9e-4). The tests require 1e-4.
    - ``cwce``: for each class k the ECE of ``p_k`` against ``[y == k]`` over all valid positions
      with the same bins, ``sum_b |sum_{i in B_kb} ([y_i == k] - p_ik)| / m``; mean over all K.
    - ``nll = mean_i -log softmax(l_i)_{y_i}`` (log-sum-exp form: finite when ``p_y``
      underflows, accurate when it saturates); ``brier = mean_i sum_k (p_ik - [y_i == k])^2``
      (sum over the K classes, mean over positions, so it lies in [0, 2]); ``acc = mean_i a_i``;
      ``conf = mean_i c_i``.
    - ``<metric>_image_mean``: the metric computed on each image (one of the N items of a batch)
      and averaged over images with at least one valid position (the paper's protocol), for
      ece, mce, acc, nll, brier and cwce.

    Probabilities are ``torch.softmax`` in float32 (float16 / bfloat16 logits are upcast; float64
    logits stay float64). Counts are int64 and sums float64, so nothing saturates at 2^24.

    State (registered buffers, independent of the number of pixels): int64 ``bin_count``,
    ``bin_correct`` (n), ``fine_count``, ``fine_correct`` (F), ``num_images``; float64
    ``bin_conf`` (n), ``fine_conf`` (F), ``nll_sum``, ``brier_sum``, ``image_sums`` (6); with
    ``classwise`` also ``cw_hits`` (int64) and ``cw_prob`` (float64), ``(K, n)`` each. Here
    ``F = NUM_FINE_CELLS = 69617``, so the state is ``8 * (3n + 3F + 9 + 2Kn)`` bytes: 1.68 MB
    for K = 21, n = 15.

    DDP: ``compute`` sums copies of the states over ranks (one ``all_reduce`` for the int64 and
    one for the float64 states) and must be called on every rank; the buffers are left as they
    are, so ``compute`` can be called repeatedly and ``update`` continued afterwards.

    Args:
        num_classes: K >= 2.
        n_bins: number of equal-width bins (and of adaptive bins), >= 1.
        ignore_index: target value of void positions (255 in VOC).
        classwise: also accumulate the class-wise ECE (costs a pass over ``(N, K, *S)``).
        inputs: what ``update`` receives: ``"logits"`` (default) or ``"probs"`` (softmax
            outputs, same metrics). Logits that look like probabilities (at up to 4096 evenly
            spaced positions every value is >= 0 and the K values sum to 1 within 1e-3, 4e-3 in
            float16, 3e-2 in bfloat16) raise ``ValueError``: softmaxing probabilities again
            would silently flatten every confidence towards 1 / K.

    Shape:
        - logits: ``(N, K, *S)`` floating, any number of spatial dims (``(N, K)`` is allowed).
        - target: ``(N, *S)`` integer.

    Example:
        >>> meter = CalibrationMeter(num_classes=21, ignore_index=255)
        >>> meter.update(torch.randn(2, 21, 8, 8), torch.randint(0, 21, (2, 8, 8)))
        >>> sorted(meter.compute())[:3]
        ['acc', 'acc_image_mean', 'aece']
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        ignore_index: int = -100,
        classwise: bool = True,
        inputs: Literal["logits", "probs"] = "logits",
    ) -> None:
        super().__init__(num_classes, ignore_index, inputs, n_bins)
        if not isinstance(classwise, bool):
            raise ValueError(f"Expected `classwise` to be a bool, but got {classwise!r}.")
        self.classwise = classwise
        i64, f64 = torch.int64, torch.float64
        shapes = {
            "bin_count": ((n_bins,), i64),
            "bin_correct": ((n_bins,), i64),
            "bin_conf": ((n_bins,), f64),
            "fine_count": ((NUM_FINE_CELLS,), i64),
            "fine_correct": ((NUM_FINE_CELLS,), i64),
            "fine_conf": ((NUM_FINE_CELLS,), f64),
            "nll_sum": ((), f64),
            "brier_sum": ((), f64),
            "image_sums": ((len(IMAGE_KEYS),), f64),
            "num_images": ((), i64),
        }
        if classwise:
            shapes["cw_prob"] = ((num_classes, n_bins), f64)
            shapes["cw_hits"] = ((num_classes, n_bins), i64)
        for name, (shape, dtype) in shapes.items():
            self.add_state(name, torch.zeros(shape, dtype=dtype))

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, n_bins={self.n_bins}, "
            f"ignore_index={self.ignore_index}, classwise={self.classwise}, inputs={self.inputs}"
        )

    def batch_stats(self, logits: Tensor, target: Tensor) -> dict[str, Tensor]:
        """The sums of one batch. See the class docstring for shapes; raises ``ValueError`` on
        bad input. The softmax is applied here: pass logits, or build the meter with
        ``inputs="probs"``."""
        return _calibration_update(
            logits, target, self.num_classes, self.n_bins, self.ignore_index, self.classwise,
            self.inputs,
        )

    def compute_states(self, states: dict[str, Tensor]) -> dict[str, Any]:
        """Metric values from summed states, as a JSON-serialisable dict.

        Keys: ``count`` (valid positions), ``ece``, ``ece_over``, ``ece_under``, ``aece``,
        ``aurc``, ``aurc_bound``, ``risk_coverage = {"coverage": 100 floats, "risk": 100
        floats}``, ``mce``, ``cwce`` (None when
        ``classwise=False``), ``classwise_ece`` (list of K, or None), ``nll``, ``brier``, ``acc``,
        ``conf``, ``num_images``, ``{ece, mce, acc, nll, brier, cwce}_image_mean``, and
        ``reliability = {"bin_edges": n + 1 floats, "count": n ints, "confidence": n floats,
        "accuracy": n floats}`` (mean confidence / accuracy per bin, 0.0 for empty bins).
        Values are Python floats, or None when no valid position was seen.
        """
        return _calibration_compute(states, self.n_bins)
