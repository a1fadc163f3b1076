"""``margin: auto``: the margin of CALS-ALM / CALS-HR steered by the validation calibration.

A margin ``m`` bounds every logit gap ``d_ik <= m``; once the constraint holds, the top-label
confidence is at most ``cap(m) = 1 / (1 + (K - 1) e^-m)``. Shrinking ``m`` by a factor ``1/T``
therefore acts on the network like temperature scaling by ``T`` acts on its logits. The rule is
a feedback loop on that analogy, run after each validation pass (docs/design.md, "margin:
auto")::

    m_eff(i) = log(K - 1) - log sum_{k != top} exp(l_ik - l_i,top)   # cap(m_eff(i)) = conf(i)
    T_hat    = the T > 0 with  mean_i cap(m_eff(i) / T) = accuracy   # validation, valid pixels
    G        = the largest validation gap (a margin above it binds on no pixel)
    target   = clip(m / T_hat, margin_min, min(margin_max, G))
    m        <- clip(target, m / margin_rate, m * margin_rate)        # a bounded step
    # only after margin_warmup epochs and when the accuracy is clearly above chance:
    #   skill >= margin_skill  and  accuracy - chance > 3 sqrt(chance (1 - chance) / n);
    # otherwise m is kept

with ``chance`` the majority-class rate of the valid validation positions (at least ``1/K``) and
``skill = (accuracy - chance) / (1 - chance)`` (0 at chance, 1 when every position is right).

``m_eff`` is the margin that would give pixel ``i``'s confidence if all its gaps were equal, so
``cap(m_eff / T)`` is its confidence with every gap scaled by ``1/T`` (exact when the
non-top logits are equal, an approximation otherwise). ``T_hat > 1`` means the validation
pixels are over-confident on average: the margin shrinks. ``T_hat < 1`` means under-confident:
it grows, up to ``margin_max`` where the penalty is inert, so a network that is not
over-confident is left alone. A network at chance level says nothing about the calibration it
will end with (it is often over-confident and wrong everywhere, ``T_hat`` at the top of its
range), so it does not move the margin; the rate limit bounds what one noisy validation pass can
do. The statistics are a histogram of ``m_eff`` (bins of :data:`BIN_WIDTH`, the last one open),
one of the largest gap, the number of correct pixels and the number of pixels per class: O(bins)
and O(K) float64 sums, so the rule is exact under torch.distributed (sums all-reduced before the
solve) and deterministic.
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
    accuracy = correct / n
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
        ``margin_rate``, ``margin_skill`` (floats) and ``margin_warmup`` (an int)."""
        for name, value in vars(self).items():
            if name != "margin_init":
                setattr(loss, name, value if name == "margin_warmup" else float(value))
