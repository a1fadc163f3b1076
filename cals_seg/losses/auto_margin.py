"""``margin: auto``: the margin of CALS-ALM / CALS-HR steered by the validation calibration.

A margin ``m`` bounds every logit gap ``d_ik <= m``; once the constraint holds, the top-label
confidence is at most ``cap(m) = 1 / (1 + (K - 1) e^-m)``. Shrinking ``m`` by a factor ``1/T``
therefore acts on the network like temperature scaling by ``T`` acts on its logits. The rule is
a feedback loop on that analogy, run after each validation pass, that moves the margin only on
evidence (docs/design.md, "margin: auto")::

    m_eff(i) = log(K - 1) - log sum_{k != top} exp(l_ik - l_i,top)   # cap(m_eff(i)) = conf(i)
    conf(T)  = mean_i cap(m_eff(i) / T)                               # validation, valid pixels
    gap      = sum_j (c_j - a_j) / sum_j n_j        # per image j: confidence sum, correct, pixels
    se(gap)  = sqrt(J / (J - 1) sum_j (c_j - a_j - gap n_j)^2) / sum_j n_j     # J images
    T_lo, T_hat, T_hi = the T with conf(T) = acc + z se, acc, acc - z se      # z = margin_z
    G        = the largest validation gap (a margin above it binds on no pixel)
    # in this order, the first that applies:
    epoch < margin_warmup                               -> keep     "warmup"
    balanced skill < margin_skill or within its noise   -> keep     "at chance"
    T_lo <= 1 <= T_hi                                   -> keep     "calibrated within noise"
    T_lo > 1 (over-confident) and still learning        -> keep     "still learning"
    T_lo > 1:  m <- step(min(m, clip(m / T_lo, margin_min, min(margin_max, G))))   "over-confident"
    T_hi < 1:  m <- step(max(m, clip(m / T_hi, margin_min, min(margin_max, G))))   "under-confident"
    step(t)  = clip(t, m / margin_rate, m * margin_rate)

The sampling unit of the interval is the image (for classification each sample is one): the
pixels of one image are correlated, so a pixel-level binomial error would be far too small.
``se(gap)`` is the standard error of a ratio estimator over J clusters (the delta method), and
reduces to ``std_j(c_j - a_j) / sqrt(J)`` when every image has one position. The margin moves
towards the end of the temperature interval nearest 1, not to ``T_hat``: as far as the evidence
reaches. "Still learning": the validation accuracy (the same ratio estimator, ``a_j / n_j``)
rose over the last ``margin_patience`` epochs by more than its noise,
``acc_t - acc_{t-W} > z sqrt(se_t^2 + se_{t-W}^2)``, or fewer than ``W`` epochs were seen; then
the margin may grow but not shrink. The balanced skill is that of the mean per-class recall
``BA`` against its chance level ``1 / K'`` (``K'`` classes present in validation), so a
majority class (segmentation's background) predicted everywhere has skill 0 and a network that
segments some foreground passes: ``skill = (BA - 1/K') / (1 - 1/K')``, noise ``CHANCE_Z
sqrt((1/K')(1 - 1/K') sum_k 1/n_k) / K'``.

``m_eff`` is the margin that would give pixel ``i``'s confidence if all its gaps were equal, so
``cap(m_eff / T)`` is its confidence with every gap scaled by ``1/T`` (exact when the
non-top logits are equal, an approximation otherwise). The statistics are a histogram of
``m_eff`` (bins of :data:`BIN_WIDTH`, the last one open), one of the largest gap, the number of
correct pixels, the number of pixels and of correct pixels per class, and ten per-image sums
(:func:`image_sums`): O(bins) and O(K) float64 sums, so the rule is exact under
torch.distributed (sums all-reduced before the solve; the counts exactly, the confidence sums up
to float64 rounding) and deterministic. The rule of the previous version (:func:`next_margin`,
:func:`beyond_chance`, majority-class chance) is kept for the per-band losses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cals_seg.losses._functional import blocks
from cals_seg.utils.validation import check_int

BIN_WIDTH = 0.05  # nats of m_eff per histogram bin
NUM_BINS = 800  # covers m_eff in [0, 40); larger values fall in the last bin
T_RANGE = (1.0 / 16.0, 16.0)  # the solve is clipped to this range of temperatures
MARGIN_RATE = 1.25  # default margin_rate: the margin moves by at most this factor per epoch
MARGIN_SKILL = 0.1  # default margin_skill: the skill above chance needed to move the margin
CHANCE_Z = 3.0  # the accuracy must also exceed chance by this many binomial standard deviations
MARGIN_Z = 2.0  # default margin_z: half-width of the intervals in standard errors (about 95%)
MARGIN_PATIENCE = 2  # default margin_patience: epochs over which "still learning" is judged
# The per-image sums of :func:`image_sums`, in this order (c: confidence sum, a: correct count,
# n: valid positions of one image; images without a valid position are not counted).
IMAGE_SUM_KEYS = ("images", "n", "c", "a", "nn", "cc", "aa", "cn", "an", "ca")
REASONS = ("warmup", "at chance", "calibrated within noise", "still learning", "over-confident",
           "under-confident")


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
    lo, hi = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    if mean_confidence(hist, num_classes, math.exp(lo)) <= accuracy:
        return T_RANGE[0]
    if mean_confidence(hist, num_classes, math.exp(hi)) >= accuracy:
        return T_RANGE[1]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if mean_confidence(hist, num_classes, math.exp(mid)) > accuracy:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def image_sums(logits: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The per-image sums of the evidence rule and the correct positions per class.

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


def balanced_skill(class_correct: Tensor, counts: Tensor) -> tuple[float, float, float]:
    """The skill of the mean per-class recall over the ``K'`` classes present in validation.

    ``BA = mean_k correct_k / n_k``, ``chance = 1 / K'`` (the balanced accuracy of any
    prediction that ignores the input, a majority class predicted everywhere included),
    ``skill = (BA - chance) / (1 - chance)`` and the noise ``CHANCE_Z sqrt(chance (1 - chance)
    sum_k 1 / n_k) / K'`` (binomial, in BA units).

    Args:
        class_correct: ``(K,)`` correct valid positions per ground-truth class.
        counts: ``(K,)`` valid positions per class (:func:`class_counts`).

    Returns:
        ``(skill, BA - chance, noise)``; ``(0, 0, 0)`` with fewer than two classes present.

    Raises:
        ValueError: no position counted.
    """
    if float(counts.sum()) <= 0:
        raise ValueError("balanced_skill: no validation position was counted")
    present = counts > 0
    kp = int(present.sum())
    if kp < 2:
        return 0.0, 0.0, 0.0
    recall = class_correct[present] / counts[present]
    chance = 1.0 / kp
    excess = float(recall.sum()) / kp - chance
    noise = CHANCE_Z * math.sqrt(chance * (1.0 - chance) * float((1.0 / counts[present]).sum()))
    return excess / (1.0 - chance), excess, noise / kp


def still_learning(acc: float, acc_se: float | None, past: list[tuple[float, float | None]],
                   patience: int, z: float) -> tuple[bool, float | None, float | None]:
    """Whether the validation accuracy is still rising beyond its noise.

    Args:
        acc, acc_se: this epoch's accuracy and its standard error (:func:`gap_and_accuracy`).
        past: the ``(acc, se)`` of earlier epochs, oldest first (at least the last
            ``patience``).
        patience: ``W``, the epochs looked back (0: never "still learning").
        z: the interval's half-width in standard errors.

    Returns:
        ``(learning, rise, noise)`` with ``rise = acc - acc_{t-W}`` and ``noise = z sqrt(se_t^2
        + se_{t-W}^2)``; learning when fewer than ``W`` epochs were seen (rise and noise None)
        or ``rise > noise``.
    """
    if patience == 0:
        return False, None, None
    if len(past) < patience:
        return True, None, None
    old, old_se = past[-patience]
    rise = acc - old
    if acc_se is None or old_se is None:
        return True, rise, None
    noise = z * math.sqrt(acc_se * acc_se + old_se * old_se)
    return rise > noise, rise, noise


def evidence_step(margin: float, t_low: float, t_high: float, ceiling: float, learning: bool,
                  margin_min: float, margin_max: float, rate: float) -> tuple[float, str]:
    """The move of the evidence rule once the warm-up and the chance gate are passed (module
    docstring): ``(new margin, reason)``.

    ``T_lo <= 1 <= T_hi``: kept ("calibrated within noise"). ``T_lo > 1``: over-confident; kept
    while ``learning`` ("still learning"), else towards ``clip(m / T_lo, margin_min,
    min(margin_max, G))`` but never up. ``T_hi < 1``: under-confident, towards ``clip(m / T_hi,
    ...)`` but never down (a margin above the largest gap ``G`` is inert and kept). Each step by
    at most a factor ``rate`` and within ``[margin_min, margin_max]``.
    """
    high = max(min(margin_max, ceiling), margin_min)
    if t_low > 1.0:
        if learning:
            return margin, "still learning"
        target = min(margin, min(max(margin / t_low, margin_min), high))
        reason = "over-confident"
    elif t_high < 1.0:
        target = max(margin, min(max(margin / t_high, margin_min), high))
        reason = "under-confident"
    else:
        return margin, "calibrated within noise"
    stepped = min(max(target, margin / rate), margin * rate)
    new = min(max(stepped, margin_min), margin_max)
    return new, reason if new != margin else f"{reason}, at a bound"


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


def skill_above_chance(correct: float, counts: Tensor) -> tuple[float, float, float]:
    """How far the validation accuracy is above chance.

    ``chance = max_k n_k / n`` (the accuracy of always predicting the majority class, at least
    ``1/K``), ``skill = (accuracy - chance) / (1 - chance)`` and the binomial noise threshold
    ``CHANCE_Z * sqrt(chance (1 - chance) / n)`` (in accuracy units).

    Args:
        correct: number of correct top-1 predictions over the valid positions.
        counts: ``(K,)`` valid positions per class (:func:`class_counts`, summed).

    Returns:
        ``(skill, accuracy - chance, noise)``; ``skill = 0`` when one class holds every
        position (nothing to learn above chance).

    Raises:
        ValueError: no position counted.
    """
    n = float(counts.sum())
    if n <= 0:
        raise ValueError("skill_above_chance: no validation position was counted")
    chance = float(counts.max()) / n
    excess = correct / n - chance
    noise = CHANCE_Z * math.sqrt(chance * (1.0 - chance) / n)
    skill = excess / (1.0 - chance) if chance < 1.0 else 0.0
    return skill, excess, noise


def beyond_chance(correct: float, counts: Tensor, min_skill: float) -> tuple[bool, float]:
    """Whether the validation accuracy is clearly above chance: ``skill >= min_skill`` and
    ``accuracy - chance > noise`` (:func:`skill_above_chance`). Returns ``(open, skill)``."""
    skill, excess, noise = skill_above_chance(correct, counts)
    return (skill >= min_skill and excess > noise), skill


def next_margin(
    margin: float,
    t_hat: float,
    ceiling: float,
    margin_min: float,
    margin_max: float,
    rate: float,
) -> float:
    """One step of the rule: ``target = clip(m / T_hat, margin_min, min(margin_max, G))``, then
    ``clip(target, m / rate, m * rate)`` (and ``[margin_min, margin_max]``).

    With ``m`` in ``[margin_min, margin_max]`` the result lies between ``m`` and ``target``, so
    it is in bounds and ``1 / rate <= result / m <= rate``.

    Args:
        margin: the margin in force ``m`` (> 0).
        t_hat: the temperature estimate (> 0, :func:`solve_temperature`).
        ceiling: ``G``, the largest validation gap (:func:`largest_gap_bound`).
        margin_min, margin_max: the margin's range.
        rate: the largest factor of one step (> 1; ``inf`` for none).

    Returns:
        The margin for the next epoch.
    """
    high = max(min(margin_max, ceiling), margin_min)
    target = min(max(margin / t_hat, margin_min), high)
    stepped = min(max(target, margin / rate), margin * rate)
    return min(max(stepped, margin_min), margin_max)


def starting_margin(margin: object, margin_init: float) -> tuple[bool, float]:
    """``(auto, m0)``: whether ``margin`` is ``"auto"`` and the margin in force at the start
    (``margin_init`` with ``"auto"``, checked by :func:`check_auto_margin`; else ``margin``).

    Raises:
        ValueError: ``margin`` is neither a positive number nor ``"auto"``.
    """
    auto = margin == "auto"
    if auto:  # checked with the rule's other settings (check_auto_margin)
        return True, float(margin_init)
    value = margin
    if isinstance(value, str | bool) or not isinstance(value, int | float):
        raise ValueError(f"Expected `margin` to be a number or 'auto', but got {margin!r}.")
    if not value > 0:
        raise ValueError(f"Expected `margin` > 0, but got {value}.")
    return auto, float(value)


def check_auto_margin(margin_min: float, margin_init: float, margin_max: float,
                      margin_warmup: int, margin_rate: float, margin_skill: float) -> None:
    """The settings of the rule (module docstring).

    Raises:
        ValueError: not ``0 < margin_min <= margin_init <= margin_max``; ``margin_warmup`` not
            an integer >= 0; ``margin_rate <= 1``; ``margin_skill`` outside ``[0, 1)``.
    """
    if not 0 < margin_min <= margin_init <= margin_max:
        raise ValueError("Expected 0 < margin_min <= margin_init <= margin_max, but got "
                         f"{margin_min}, {margin_init}, {margin_max}.")
    check_int("margin_warmup", margin_warmup, 0)
    if not margin_rate > 1:
        raise ValueError(
            "Expected `margin_rate` > 1 (the largest factor of one epoch's margin change; inf "
            f"for none), but got {margin_rate!r}."
        )
    if not 0 <= margin_skill < 1:
        raise ValueError(
            "Expected 0 <= `margin_skill` < 1 (the validation skill above chance needed to move "
            f"the margin), but got {margin_skill!r}."
        )


@dataclass
class MarginSettings:
    """The ``margin: auto`` settings (the constructor keywords of the losses with that rule;
    defaults of :class:`~cals_seg.losses.CALSALMLoss`). Checked by :meth:`start`, only when the
    margin is ``"auto"``."""

    margin_init: float = 10.0
    margin_min: float = 1.0
    margin_max: float = 20.0
    margin_warmup: int = 0
    margin_rate: float = MARGIN_RATE
    margin_skill: float = MARGIN_SKILL

    def start(self, margin: object) -> tuple[bool, float]:
        """``(auto, m0)`` of :func:`starting_margin`, with the settings checked
        (:func:`check_auto_margin`) when ``margin`` is ``"auto"``."""
        auto, m0 = starting_margin(margin, self.margin_init)
        if auto:
            check_auto_margin(self.margin_min, self.margin_init, self.margin_max,
                              self.margin_warmup, self.margin_rate, self.margin_skill)
        return auto, m0

    def keep(self, loss: object) -> None:
        """Keep the rule's settings on ``loss`` as attributes: ``margin_min``, ``margin_max``,
        ``margin_rate``, ``margin_skill`` (floats) and ``margin_warmup`` (an int); with
        :class:`EvidenceSettings` also ``margin_z`` (a float) and ``margin_patience`` (an
        int)."""
        for name, value in vars(self).items():
            if name != "margin_init":
                whole = name in ("margin_warmup", "margin_patience")
                setattr(loss, name, value if whole else float(value))


@dataclass
class EvidenceSettings(MarginSettings):
    """The settings of the evidence rule of CALS-ALM and CALS-HR (module docstring):
    :class:`MarginSettings` and ``margin_z`` (the intervals' half-width in standard errors,
    2) and ``margin_patience`` (the epochs over which the validation accuracy must have
    stopped rising beyond its noise before the margin may shrink, 2)."""

    margin_z: float = MARGIN_Z
    margin_patience: int = MARGIN_PATIENCE

    def start(self, margin: object) -> tuple[bool, float]:
        """As :meth:`MarginSettings.start`, with ``margin_z`` and ``margin_patience`` checked.

        Raises:
            ValueError: ``margin_z`` not a number > 0, ``margin_patience`` not an integer
                >= 0, or a setting of :meth:`MarginSettings.start`.
        """
        auto, m0 = super().start(margin)
        if auto:
            z = self.margin_z
            if isinstance(z, bool) or not isinstance(z, int | float) or not 0 < z < math.inf:
                raise ValueError("Expected `margin_z` > 0 (the half-width of the margin rule's "
                                 f"intervals in standard errors, e.g. 2), but got {z!r}.")
            check_int("margin_patience", self.margin_patience, 0)
        return auto, m0
