"""``margin: auto``: the margin of CALS-ALM / CALS-HR steered by the validation calibration.

Kept beside the core: on unseen data it ended worse than cross-entropy (docs/margin.md); it is
here for those who want to try it. Importing this module registers the rule as ``auto`` in
:data:`~cals_seg.losses.registry.MARGIN_RULES`, so that ``margin: auto`` in a loss config (with
``contrib: [auto_margin]``), or ``build_loss("cals_alm", K, margin="auto")`` in Python, builds
the loss at ``margin_init`` with an :class:`AutoMargin` attached (``criterion.margin_rule``).

A margin ``m`` bounds every logit gap ``d_ik <= m``; once the constraint holds, the top-label
confidence is at most ``cap(m) = 1 / (1 + (K - 1) e^-m)``. Shrinking ``m`` by a factor ``1/T``
therefore acts on the network like temperature scaling by ``T`` acts on its logits. The rule is
a feedback loop on that analogy, run after each validation pass, that moves the margin only on
evidence: the validation temperature ``T_hat`` and its interval ``[T_lo, T_hi]`` (image-level
standard error, ``margin_z`` wide; :mod:`cals_seg.losses.temperature_stats`) and the largest
validation gap ``G``::

    # in this order, the first that applies:
    epoch < margin_warmup                               -> keep     "warmup"
    balanced skill < margin_skill or within its noise   -> keep     "at chance"
    T_lo <= 1 <= T_hi                                   -> keep     "calibrated within noise"
    T_lo > 1 (over-confident) and still learning        -> keep     "still learning"
    T_lo > 1:  m <- step(min(m, clip(m / T_lo, margin_min, min(margin_max, G))))   "over-confident"
    T_hi < 1:  m <- step(max(m, clip(m / T_hi, margin_min, min(margin_max, G))))   "under-confident"
    step(t)  = clip(t, m / margin_rate, m * margin_rate)

The margin moves towards the end of the temperature interval nearest 1, not to ``T_hat``: as
far as the evidence reaches. "Still learning": the validation accuracy (a ratio estimator over
images, ``a_j / n_j``) rose over the last ``margin_patience`` epochs by more than its noise,
``acc_t - acc_{t-W} > z sqrt(se_t^2 + se_{t-W}^2)``, or fewer than ``W`` epochs were seen; then
the margin may grow but not shrink. The balanced skill is that of the mean per-class recall
``BA`` against its chance level ``1 / K'`` (``K'`` classes present in validation), so a
majority class (segmentation's background) predicted everywhere has skill 0 and a network that
segments some foreground passes: ``skill = (BA - 1/K') / (1 - 1/K')``, noise ``CHANCE_Z
sqrt((1/K')(1 - 1/K') sum_k 1/n_k) / K'``. A move puts the margin in force with
``criterion.set_margin``, which restates in units of the new margin what CALS-ALM measures in
units of the old one (``lambda`` and ``zbar_prev``).

In a training loop of one's own, next to the loss (the trainer does the same)::

    import cals_seg.contrib.auto_margin  # registers `auto`
    criterion = build_loss("cals_alm", K, margin="auto", margin_init=10.0).to(device)
    rule = criterion.margin_rule         # or AutoMargin(K, ...).attach(CALSALMLoss(K, ...))
    ...
            criterion.observe(logits, y)
            rule.observe(logits, y)
    stats = criterion.update_multipliers(epoch)
    stats |= rule.step(criterion, epoch)  # margin, margin_temperature, ..., margin_reason

The rule of the previous version (:func:`next_margin`, towards ``m / T_hat`` on every pass, and
its majority-class chance gate :func:`beyond_chance`) is kept here for ``cals_alm_bands``
(:mod:`cals_seg.contrib.cals_bands`), which steers one margin per distance band with it.

The rule's state is saved with the loss's (``criterion.state_dict()``): ``margin_rule.margin``
(the margin in force), ``margin_rule.track`` (the accuracy and its standard error of the last
``margin_patience`` epochs) and ``margin_rule.seen``. A checkpoint written when the rule lived
inside the loss (``margin_value``, ``margin_track``, ``margin_seen`` beside the multipliers;
the first version without the two last) loads into a loss with the rule attached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.losses import AdaptiveLoss
from cals_seg.losses.margin_rules import ATTRIBUTE, MarginRule, MarginSettings
from cals_seg.losses.registry import MARGIN_RULES
from cals_seg.losses.temperature_stats import (
    IMAGE_SUM_KEYS,
    INTERVAL_Z,
    NUM_BINS,
    class_counts,
    effective_margin_sums,
    gap_and_accuracy,
    image_sums,
    largest_gap_bound,
    solve_temperature,
    temperature_interval,
)
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_finite, check_int

MARGIN_Z = INTERVAL_Z  # default margin_z: half-width of the intervals in standard errors (~95%)
MARGIN_PATIENCE = 2  # default margin_patience: epochs over which "still learning" is judged
CHANCE_Z = 3.0  # the accuracy must also exceed chance by this many binomial standard deviations
REASONS = ("warmup", "at chance", "calibrated within noise", "still learning", "over-confident",
           "under-confident")
# What a checkpoint of the rule inside the loss held, and where it lives now (in the rule).
LEGACY_KEYS = {"margin_value": "margin", "margin_track": "track", "margin_seen": "seen"}


def balanced_skill(class_correct: Tensor, counts: Tensor) -> tuple[float, float, float]:
    """The skill of the mean per-class recall over the ``K'`` classes present in validation.

    ``BA = mean_k correct_k / n_k``, ``chance = 1 / K'`` (the balanced accuracy of any
    prediction that ignores the input, a majority class predicted everywhere included),
    ``skill = (BA - chance) / (1 - chance)`` and the noise ``CHANCE_Z sqrt(chance (1 - chance)
    sum_k 1 / n_k) / K'`` (binomial, in BA units).

    Args:
        class_correct: ``(K,)`` correct valid positions per ground-truth class.
        counts: ``(K,)`` valid positions per class (``class_counts``).

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
        acc, acc_se: this epoch's accuracy and its standard error (``gap_and_accuracy``).
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


def skill_above_chance(correct: float, counts: Tensor) -> tuple[float, float, float]:
    """How far the validation accuracy is above chance.

    ``chance = max_k n_k / n`` (the accuracy of always predicting the majority class, at least
    ``1/K``), ``skill = (accuracy - chance) / (1 - chance)`` and the binomial noise threshold
    ``CHANCE_Z * sqrt(chance (1 - chance) / n)`` (in accuracy units).

    Args:
        correct: number of correct top-1 predictions over the valid positions.
        counts: ``(K,)`` valid positions per class (``class_counts``, summed).

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
    """One step of the previous rule (kept by ``cals_alm_bands``, per band): ``target = clip(m /
    T_hat, margin_min, min(margin_max, G))``, then ``clip(target, m / rate, m * rate)`` (and
    ``[margin_min, margin_max]``).

    With ``m`` in ``[margin_min, margin_max]`` the result lies between ``m`` and ``target``, so
    it is in bounds and ``1 / rate <= result / m <= rate``.

    Args:
        margin: the margin in force ``m`` (> 0).
        t_hat: the temperature estimate (> 0, ``solve_temperature``).
        ceiling: ``G``, the largest validation gap (``largest_gap_bound``).
        margin_min, margin_max: the margin's range.
        rate: the largest factor of one step (> 1; ``inf`` for none).

    Returns:
        The margin for the next epoch.
    """
    high = max(min(margin_max, ceiling), margin_min)
    target = min(max(margin / t_hat, margin_min), high)
    stepped = min(max(target, margin / rate), margin * rate)
    return min(max(stepped, margin_min), margin_max)


@dataclass
class EvidenceSettings(MarginSettings):
    """The settings of the evidence rule: :class:`MarginSettings` and ``margin_z`` (the
    intervals' half-width in standard errors, 2) and ``margin_patience`` (the epochs over which
    the validation accuracy must have stopped rising beyond its noise before the margin may
    shrink, 2; 0: no such rule)."""

    margin_z: float = MARGIN_Z
    margin_patience: int = MARGIN_PATIENCE

    def check(self) -> None:
        """Raises:
            ValueError: ``margin_z`` not a number > 0, ``margin_patience`` not an integer
                >= 0, or a setting of :meth:`MarginSettings.check`.
        """
        super().check()
        z = self.margin_z
        if isinstance(z, bool) or not isinstance(z, int | float) or not 0 < z < math.inf:
            raise ValueError("Expected `margin_z` > 0 (the half-width of the margin rule's "
                             f"intervals in standard errors, e.g. 2), but got {z!r}.")
        check_int("margin_patience", self.margin_patience, 0)


class AutoMargin(MarginRule):
    """The evidence rule of ``margin: auto`` (module docstring) for CALS-ALM and CALS-HR.

    Args:
        num_classes: K.
        ignore_index: the void label (never observed).
        margin_init, margin_min, margin_max, margin_warmup: the start, range and number of
            epochs without update (10, 1, 20 and 0).
        margin_rate: the largest factor by which one epoch moves the margin (1.25; ``inf`` for
            none).
        margin_skill: the validation skill above chance, ``(BA - 1/K') / (1 - 1/K')`` with
            ``BA`` the mean per-class recall over the ``K'`` classes present, below which the
            margin is kept (0.1).
        margin_z: the half-width of the rule's intervals in standard errors (2).
        margin_patience: the epochs ``W`` over which the validation accuracy must have
            stopped rising beyond its noise before the margin may shrink (2; 0: no such rule).

    Shape:
        logits: ``(N, K, *S)`` (each row one image); target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``margin`` (float64, the margin in force), ``track (W, 2)``
    (the validation accuracy and its standard error of the last ``W`` epochs, oldest first; se
    -1 where none) and ``seen`` (epochs seen). The validation sums are O(bins) and O(K) float64,
    not saved, all-reduced under torch.distributed before :meth:`step`.
    """

    settings_type = EvidenceSettings
    log_keys = ("margin", "margin_temperature", "margin_ceiling", "margin_skill",
                "margin_t_low", "margin_t_high", "margin_gap", "margin_gap_se",
                "margin_acc_rise", "margin_acc_noise", "margin_reason")
    margin_patience: int
    margin_z: float

    def __init__(self, num_classes: int, ignore_index: int = -100, **settings: Any) -> None:
        super().__init__(num_classes, ignore_index, **settings)
        k = num_classes
        self.register_buffer("track", torch.zeros((max(self.margin_patience, 1), 2),
                                                  dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self._statistic_names = []
        for name, shape in (("_meff_hist", NUM_BINS), ("_gap_hist", NUM_BINS), ("_correct", ()),
                            ("_class_count", k), ("_img_sums", len(IMAGE_SUM_KEYS)),
                            ("_class_correct", k)):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.float64), persistent=False)
            self._statistic_names.append(name)
        self.register_buffer("_count", torch.zeros((), dtype=torch.int64), persistent=False)

    def statistics(self) -> dict[str, Tensor]:
        """The validation sums since the last :meth:`step` (the buffers themselves), the count
        of valid positions ``_count`` included."""
        return {n: getattr(self, n) for n in (*self._statistic_names, "_count")}

    @torch.no_grad()
    def observe(self, logits: Tensor, target: Tensor) -> None:
        """Accumulate the rule's sums over the valid positions of one validation batch (no
        gradient; half precision computed in float32).

        Raises:
            ValueError: shapes that do not match, NaN / inf logits, or labels outside ``[0,
                K)`` that are not ``ignore_index``.
        """
        n, k = logits.shape[:2]
        if k != self.num_classes or tuple(target.shape) != (n, *logits.shape[2:]):
            raise ValueError(f"Expected logits (N, {self.num_classes}, *S) and target (N, *S), "
                             f"but got {tuple(logits.shape)} and {tuple(target.shape)}.")
        x = logits.detach()
        x = (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).reshape(n, k, -1)
        y = target.reshape(n, -1).long()
        valid = y != self.ignore_index
        check_finite(x)
        if bool((valid & ((y < 0) | (y >= k))).any()):
            bad = sorted(set(y[valid & ((y < 0) | (y >= k))].tolist()))
            raise ValueError(f"`target` holds values {bad} outside [0, {k}) that are not "
                             f"ignore_index={self.ignore_index}.")
        hist, gap_hist, correct = effective_margin_sums(x, y, valid)
        sums, class_correct = image_sums(x, y, valid)
        self._meff_hist += hist
        self._gap_hist += gap_hist
        self._correct += correct
        self._class_count += class_counts(y, valid, k)
        self._img_sums += sums
        self._class_correct += class_correct
        self._count += valid.sum()

    @torch.no_grad()
    def step(self, criterion: AdaptiveLoss, epoch: int) -> dict[str, Any]:
        """Sum the validation statistics over processes, decide the margin after epoch
        ``epoch`` (0-based; call it after ``criterion.update_multipliers(epoch)``), put it in
        force, zero the statistics, and return the history entries: ``margin`` (in force now),
        ``margin_temperature`` (``T_hat``), ``margin_t_low`` / ``margin_t_high`` (its
        interval), ``margin_gap`` / ``margin_gap_se`` (mean confidence - accuracy and its
        image-level standard error), ``margin_ceiling`` (``G``), ``margin_skill`` (balanced
        skill), ``margin_acc_rise`` / ``margin_acc_noise`` (the accuracy's rise over
        ``margin_patience`` epochs and its noise; None before), ``margin_reason``; and the
        criterion's multipliers, as in force after a move.

        Raises:
            RuntimeError: nothing was observed since the last step.
        """
        stats = {k: v.clone() for k, v in self.statistics().items()}
        all_reduce_sum_(list(stats.values()))
        for value in self.statistics().values():
            value.zero_()
        if int(stats.pop("_count")) == 0:
            raise RuntimeError("AutoMargin.step() found no observed validation positions: call "
                               "rule.observe(logits, target) on the validation batches first.")
        return self._decide(criterion, epoch, stats)

    def _decide(self, criterion: Any, epoch: int, stats: dict[str, Tensor]) -> dict[str, Any]:
        """The rule on statistics already summed over processes (:meth:`step`)."""
        k = self.num_classes
        hist = stats["_meff_hist"]
        t_hat = solve_temperature(hist, float(stats["_correct"]), k)
        ceiling = largest_gap_bound(stats["_gap_hist"])
        gap, gap_se, acc, acc_se = gap_and_accuracy(stats["_img_sums"])
        t_low, t_high = temperature_interval(hist, acc, gap_se, self.margin_z, k)
        skill, excess, noise = balanced_skill(stats["_class_correct"], stats["_class_count"])
        learning, rise, rise_noise = still_learning(acc, acc_se, self._past_accuracies(),
                                                    self.margin_patience, self.margin_z)
        self._remember_accuracy(acc, acc_se)
        old = criterion.margin
        if epoch + 1 <= self.margin_warmup:
            new, reason = old, "warmup"
        elif not (skill >= self.margin_skill and excess > noise):
            new, reason = old, "at chance"
        else:
            new, reason = evidence_step(old, t_low, t_high, ceiling, learning, self.margin_min,
                                        self.margin_max, self.margin_rate)
        if new != old:
            criterion.set_margin(new)
        self.margin.fill_(criterion.margin)
        return {
            **criterion.multipliers(),
            "margin": criterion.margin,
            "margin_temperature": t_hat,
            "margin_t_low": t_low,
            "margin_t_high": t_high,
            "margin_gap": gap,
            "margin_gap_se": gap_se,
            "margin_ceiling": ceiling,
            "margin_skill": skill,
            "margin_acc_rise": rise,
            "margin_acc_noise": rise_noise,
            "margin_reason": reason,
        }

    def _past_accuracies(self) -> list[tuple[float, float | None]]:
        """The tracked ``(acc, se)`` of earlier epochs, oldest first (at most
        ``margin_patience``)."""
        seen = min(int(self.seen), self.margin_patience)
        rows = self.track.tolist()[len(self.track) - seen:] if seen else []
        return [(a, se if se >= 0 else None) for a, se in rows]

    def _remember_accuracy(self, acc: float, se: float | None) -> None:
        row = torch.tensor([acc, -1.0 if se is None else se], dtype=torch.float64)
        self.track.copy_(torch.cat([self.track[1:], row.view(1, 2).to(self.track.device)]))
        self.seen.add_(1)

    def attach(self, loss: Any) -> Any:
        """As :meth:`MarginRule.attach`; a state dict of the loss with the rule's state under
        :data:`LEGACY_KEYS` (written when the rule lived in the loss) loads too."""
        loss = super().attach(loss)
        loss.register_load_state_dict_pre_hook(self._legacy_state)
        return loss

    def _legacy_state(self, loss: nn.Module, state_dict: dict[str, Any], prefix: str,
                      *args: Any) -> None:
        """``margin_value``, ``margin_track``, ``margin_seen`` beside the multipliers ->
        ``margin_rule.margin``, ``.track``, ``.seen`` (no track in the rule's first version:
        it starts empty, as then)."""
        if prefix + "margin_value" not in state_dict:
            return
        for old, new in LEGACY_KEYS.items():
            value = state_dict.pop(prefix + old, None)
            if value is None:
                value = torch.zeros_like(getattr(self, new))
            state_dict[f"{prefix}{ATTRIBUTE}.{new}"] = value

    def extra_repr(self) -> str:
        return (f"margin_min={self.margin_min:g}, margin_max={self.margin_max:g}, "
                f"margin_rate={self.margin_rate:g}, margin_patience={self.margin_patience}")


MARGIN_RULES.register("auto", AutoMargin)

__all__ = ["AutoMargin", "EvidenceSettings", "balanced_skill", "beyond_chance", "evidence_step",
           "next_margin", "skill_above_chance", "still_learning"]
