"""Class Adaptive Label Smoothing: CALS-ALM and CALS-HR (Liu et al., CVPR 2023).

Both add a class-wise penalty on the normalised logit distances ``z_ik = d_ik / m - 1``
(``d_ik = max_j l_ij - l_ik``) to the cross-entropy, and re-estimate their per-class multipliers
on the validation set after every epoch with the same protocol, visible in the training loop::

    for epoch in range(epochs):
        train_one_epoch(model, criterion, ...)
        with torch.no_grad():
            for x, y in val_loader:
                criterion.observe(model(x), y)      # O(K) float64 sums, valid positions only
        stats = criterion.update_multipliers(epoch)  # all-reduced first under torch.distributed

The multipliers are buffers: saved by ``state_dict()``, moved by ``.to(device)``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from cals_seg.losses._adaptive import AdaptiveLoss
from cals_seg.losses._alm import ALMRules, ALMSettings
from cals_seg.losses._functional import ce_sum, class_penalty, class_sums
from cals_seg.losses.auto_margin import (
    IMAGE_SUM_KEYS,
    NUM_BINS,
    EvidenceSettings,
    balanced_skill,
    class_counts,
    effective_margin_sums,
    evidence_step,
    gap_and_accuracy,
    image_sums,
    largest_gap_bound,
    solve_temperature,
    still_learning,
    temperature_interval,
)
from cals_seg.losses.registry import LOSSES
from cals_seg.utils.validation import check_finite


class _ClassAdaptiveLoss(AdaptiveLoss):
    """Shared machinery of CALS-ALM and CALS-HR: the margin (fixed or ``"auto"``), the per-class
    ``lambdas`` and, with ``"auto"``, the margin rule's statistics and state."""

    MARGIN_LOGS = ("margin", "margin_temperature", "margin_ceiling", "margin_skill",
                   "margin_t_low", "margin_t_high", "margin_gap", "margin_gap_se",
                   "margin_acc_rise", "margin_acc_noise", "margin_reason")

    def __init__(self, num_classes: int, margin: float | Literal["auto"], lambda_init: float,
                 ignore_index: int, auto: EvidenceSettings) -> None:
        super().__init__(num_classes, ignore_index)
        self.auto_margin, margin = auto.start(margin)
        if self.auto_margin:
            auto.keep(self)
        if lambda_init < 0:
            raise ValueError(f"Expected `lambda_init` >= 0, but got {lambda_init}.")
        self.margin = float(margin)  # the margin in force (a Python float: no device sync)
        k = num_classes
        self.add_state("lambdas", torch.full((k,), float(lambda_init), dtype=torch.float64))
        if self.auto_margin:
            # The margin in force, saved and restored with the multipliers.
            self.add_state("margin_value", torch.tensor(self.margin, dtype=torch.float64))
            self.add_statistic("_meff_hist", NUM_BINS)
            self.add_statistic("_gap_hist", NUM_BINS)
            self.add_statistic("_correct", ())
            self.add_statistic("_class_count", k)
            self.add_statistic("_img_sums", len(IMAGE_SUM_KEYS))
            self.add_statistic("_class_correct", k)
            # The validation accuracy and its standard error of the last margin_patience epochs
            # (oldest first; se -1 where none), and the number of epochs seen.
            rows = max(self.margin_patience, 1)
            self.add_state("margin_track", torch.zeros((rows, 2), dtype=torch.float64))
            self.add_state("margin_seen", torch.zeros((), dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        if self.auto_margin:  # a checkpoint of the previous rule: no accuracy track yet
            for name in ("margin_track", "margin_seen"):
                state_dict.setdefault(prefix + name, getattr(self, name).clone())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.auto_margin:
            self.margin = float(self.margin_value)

    def _margin_for(self, like: Tensor) -> float | Tensor:
        """The margin in force for the training loss: the Python float, except with ``"auto"``
        under ``torch.compile``, where it is the 0-dim ``margin_value`` buffer (the margin
        changes after each validation pass; as a float it would recompile the graph each time).
        """
        if self.auto_margin and torch.compiler.is_compiling():
            return self.margin_value.to(like.dtype)
        return self.margin

    def _per_class(self, values: Tensor, like: Tensor) -> Tensor:
        """``(K,)`` float64 buffer -> ``(1, K, 1)`` in the dtype of the logits."""
        return values.to(dtype=like.dtype).view(1, -1, 1)

    def _class_statistics(self) -> list[str]:
        """Names of the per-class sums :meth:`_observe` accumulates, in the order of
        :meth:`_observed_functions`."""
        raise NotImplementedError

    def _past_accuracies(self) -> list[tuple[float, float | None]]:
        """The tracked ``(acc, se)`` of earlier epochs, oldest first (at most
        ``margin_patience``)."""
        seen = min(int(self.margin_seen), self.margin_patience)
        rows = self.margin_track.tolist()[len(self.margin_track) - seen:] if seen else []
        return [(a, se if se >= 0 else None) for a, se in rows]

    def _remember_accuracy(self, acc: float, se: float | None) -> None:
        row = torch.tensor([acc, -1.0 if se is None else se], dtype=torch.float64)
        self.margin_track.copy_(torch.cat([self.margin_track[1:], row.view(1, 2)]))
        self.margin_seen.add_(1)

    def _update_margin(self, epoch: int, stats: dict[str, Tensor]) -> dict[str, Any]:
        """The ``margin: auto`` evidence rule after epoch ``epoch`` (0-based) from this
        validation pass's statistics (:mod:`cals_seg.losses.auto_margin`): kept during the
        first ``margin_warmup`` epochs, while the balanced skill is not clearly above chance,
        while the temperature interval ``[T_lo, T_hi]`` contains 1, and (down-moves) while the
        validation accuracy still rises beyond its noise; otherwise moved towards ``m / T_lo``
        (over-confident) or ``m / T_hi`` (under-confident), capped by the largest validation
        gap ``G``, by at most a factor ``margin_rate``. A change calls :meth:`_margin_changed`.

        Returns:
            The history entries (nothing with a fixed margin): ``margin`` (in force now),
            ``margin_temperature`` (``T_hat``), ``margin_t_low`` / ``margin_t_high`` (its
            interval), ``margin_gap`` / ``margin_gap_se`` (mean confidence - accuracy and its
            image-level standard error), ``margin_ceiling`` (``G``), ``margin_skill`` (balanced
            skill), ``margin_acc_rise`` / ``margin_acc_noise`` (the accuracy's rise over
            ``margin_patience`` epochs and its noise; None before), ``margin_reason``.
        """
        if not self.auto_margin:
            return {}
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
        old = self.margin
        if epoch + 1 <= self.margin_warmup:
            new, reason = old, "warmup"
        elif not (skill >= self.margin_skill and excess > noise):
            new, reason = old, "at chance"
        else:
            new, reason = evidence_step(old, t_low, t_high, ceiling, learning, self.margin_min,
                                        self.margin_max, self.margin_rate)
        if new != old:
            self.margin_value.fill_(new)
            self.margin = float(self.margin_value)
            self._margin_changed(old, self.margin)
        return {
            "margin": self.margin,
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

    def _margin_changed(self, old: float, new: float) -> None:
        """Convert what depends on the margin after ``m: old -> new`` (nothing by default)."""

    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        n, _, s = logits.shape
        maxima = torch.empty((n, 1, s), dtype=logits.dtype, device=logits.device)
        fns = self._observed_functions(logits)
        sums = class_sums(logits, valid, self.margin, fns, maxima=maxima)
        check_finite(logits, maxima)  # before anything is accumulated
        out = dict(zip(self._class_statistics(), sums, strict=True))
        if self.auto_margin:
            hist, gap_hist, correct = effective_margin_sums(logits, target, valid)
            sums, class_correct = image_sums(logits, target, valid)
            out.update(_meff_hist=hist, _gap_hist=gap_hist, _correct=correct,
                       _class_count=class_counts(target, valid, self.num_classes),
                       _img_sums=sums, _class_correct=class_correct)
        return out

    def _observed_functions(self, like: Tensor) -> list:
        """Elementwise functions of z whose per-class sums :meth:`_observe` accumulates, in the
        order of :meth:`_class_statistics`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        auto = " (auto)" if self.auto_margin else ""
        return f"{super().extra_repr()}, margin={self.margin:g}{auto}"


SCORE_RULES = ("weighted", "unweighted")


@LOSSES.register("cals_hr")
class CALSHRLoss(_ClassAdaptiveLoss):
    """CALS-HR: class-wise hinge penalties with heuristically scheduled weights (paper eq. 11).

    Training loss: ``CE + (1/(|V| K)) sum_{i in V} sum_k lambda_k relu(d_ik - m)``.
    After each epoch ``j``, with ``P_k(j)`` the mean of ``relu(d_ik - m)`` over the valid
    validation positions and ``lambda_k(j)`` the multiplier in force during that validation pass,
    each class is scored by ``S_k(j)`` and::

        lambda_k <- mu * lambda_k   if S_k(j) > tau S_k(j-1)
        lambda_k <- lambda_k / mu   if S_k(j) < S_k(j-1) / tau     (applied after the first test)

    ``score="weighted"`` (default, the authors' ``LogitMarginPlus``): ``S_k(j) =
    lambda_k(j) P_k(j)``, the class penalty value multiplier included; no update at all while the
    previous scores are all zero (so never after the first epoch).

    ``score="unweighted"`` (the rule of cals_seg before it followed the authors): ``S_k(j) =
    P_k(j)``; every class is updated from the second epoch on, even when the previous scores are
    all zero.

    The two agree up to the first update and can diverge from the second: ``P = 1.0, 1.2, 1.25``
    with ``lambda_init = 0.1`` gives ``lambda = 0.1, 0.11, 0.121`` weighted (0.11 * 1.25 > 1.1 *
    0.1 * 1.2) but ``0.1, 0.11, 0.11`` unweighted (1.25 < 1.1 * 1.2).

    Args:
        num_classes: K.
        margin: m (10 vision, 6 text), or ``"auto"`` (as :class:`CALSALMLoss`).
        mu, tau: schedule factors (paper: 1.1 and 1.1).
        lambda_init: initial weights (0.1, the MbLS weight the heuristic starts from).
        lambda_min, lambda_max: safeguarding interval.
        score: ``"weighted"`` (default) or ``"unweighted"``, see above.
        ignore_index: void label.
        margin_init, margin_min, margin_max, margin_warmup, margin_rate, margin_skill,
            margin_z, margin_patience: the ``"auto"`` margin (as :class:`CALSALMLoss`). The
            weights multiply the hinge in logit units, ``relu(d - m)``, and change by at most
            ``mu`` per epoch, so a margin change converts nothing.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas``, ``penalty_prev`` (``P(j-1)``), ``lambdas_prev``
    (``lambda(j-1)``, the multipliers ``P(j-1)`` was measured with), all ``(K,)`` float64, and
    ``has_prev`` (bool).

    Raises:
        ValueError: bad ``mu``, ``tau`` or ``score``.
    """

    log_keys = ("lambda", "penalty", "score", *_ClassAdaptiveLoss.MARGIN_LOGS)
    settings_types = (EvidenceSettings,)

    def __init__(
        self,
        num_classes: int,
        margin: float | Literal["auto"] = 10.0,
        mu: float = 1.1,
        tau: float = 1.1,
        lambda_init: float = 0.1,
        lambda_min: float = 1e-6,
        lambda_max: float = 1e6,
        score: str = "weighted",
        ignore_index: int = -100,
        **settings: Any,
    ) -> None:
        (auto,) = self.settings(settings)
        super().__init__(num_classes, margin, lambda_init, ignore_index, auto)
        if mu <= 1 or tau <= 0:
            raise ValueError(f"Expected `mu` > 1 and `tau` > 0, but got mu={mu}, tau={tau}.")
        if score not in SCORE_RULES:
            raise ValueError(
                f"Expected `score` to be one of {list(SCORE_RULES)}, but got {score!r}."
            )
        self.mu, self.tau = float(mu), float(tau)
        self.lambda_min, self.lambda_max = float(lambda_min), float(lambda_max)
        self.score = score
        k = num_classes
        self.add_state("penalty_prev", torch.zeros(k, dtype=torch.float64))
        self.add_state("lambdas_prev", torch.zeros(k, dtype=torch.float64))
        self.add_state("has_prev", torch.zeros((), dtype=torch.bool))
        self.add_statistic("_sum_pen", k)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # State saved before ``lambdas_prev`` existed: the unweighted rule does not read it; the
        # weighted rule needs it, so there the strict load reports it missing.
        key, lambdas = prefix + "lambdas_prev", prefix + "lambdas"
        if self.score == "unweighted" and key not in state_dict and lambdas in state_dict:
            state_dict[key] = state_dict[lambdas].clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        # lambda_k relu(d - m) = lambda_k m relu(z); derivative in z: lambda_k m [z > 0].
        margin = self._margin_for(logits)
        w = self._per_class(self.lambdas, logits) * margin
        pen = class_penalty(
            logits,
            valid,
            margin,
            lambda z: z.clamp_(min=0.0).mul_(w),
            lambda z: (z > 0).to(z.dtype).mul_(w),
        )
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def _class_statistics(self) -> list[str]:
        return ["_sum_pen"]

    def _observed_functions(self, like: Tensor) -> list:
        return [lambda z: z.clamp_(min=0.0).mul_(self.margin)]

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The heuristic rule after epoch ``epoch`` (0-based); :meth:`update_multipliers` calls
        it with the statistics summed over processes.

        Returns:
            ``{"lambda": [K], "penalty": [K], "score": [K]}``: the multipliers after the update,
            this epoch's mean class hinge ``P_k`` and the score ``S_k`` the rule compared; with
            ``margin="auto"`` also ``margin`` and ``margin_temperature``.
        """
        pen = stats["_sum_pen"] / n
        lam = self.lambdas.clone()  # in force during the validation pass just observed
        if self.score == "weighted":
            curr, prev = lam * pen, self.lambdas_prev * self.penalty_prev
            if bool(self.has_prev) and bool(prev.sum() != 0):
                # As the authors: up if curr > tau prev, then down if curr < prev / tau.
                new = torch.where(curr > prev * self.tau, lam * self.mu, lam)
                new = torch.where(curr < prev / self.tau, new / self.mu, new)
                self.lambdas.copy_(new.clamp_(self.lambda_min, self.lambda_max))
        else:
            curr, prev = pen, self.penalty_prev
            if bool(self.has_prev):
                new = torch.where(
                    curr > self.tau * prev,
                    lam * self.mu,
                    torch.where(prev > self.tau * curr, lam / self.mu, lam),
                )
                self.lambdas.copy_(new.clamp_(self.lambda_min, self.lambda_max))
        self.penalty_prev.copy_(pen)
        self.lambdas_prev.copy_(lam)
        self.has_prev.fill_(True)
        margin = self._update_margin(epoch, stats)
        return {**self.multipliers(), "penalty": pen.tolist(), "score": curr.tolist(), **margin}

    def multipliers(self) -> dict[str, list[float]]:
        """Current per-class ``lambda`` as a list (for logging)."""
        return {"lambda": self.lambdas.tolist()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, score={self.score!r}"


@LOSSES.register("cals_alm")
class CALSALMLoss(ALMRules, _ClassAdaptiveLoss):
    """CALS-ALM: cross-entropy plus a class-wise augmented-Lagrangian penalty (paper Alg. 2).

    Training loss on a batch (means over valid positions ``V`` only)::

        loss = CE(l, y) + (1 / (|V| K)) * sum_{i in V} sum_k P(z_ik; rho_k, lambda_k)

    After epoch ``j`` (0-based), from the statistics streamed by :meth:`observe` over the
    ``n`` valid validation positions::

        lambda_k <- clip(mean_i P'(z_ik; rho_k, lambda_k), lambda_min, lambda_max)
        zbar_k   =  mean_i z_ik
        if (j + 1) % rho_period == 0 and a previous zbar exists:
            rho_k <- gamma * rho_k  if zbar_k > tau * max(0, zbar_prev_k)
            rho_k <- clip(rho_k, rho_min, rho_max)
        zbar_prev <- zbar

    Args:
        num_classes: K.
        margin: m; the constraint is ``d_ik <= m`` (paper: 10 vision, 6 text), or ``"auto"``:
            start at ``margin_init`` and after each validation pass move ``m`` only on evidence
            (:mod:`cals_seg.losses.auto_margin`): not during the first ``margin_warmup``
            epochs, not while the balanced validation skill is not clearly above chance, not
            while the interval ``[T_lo, T_hi]`` of the temperature that would match the
            validation confidence to the accuracy (image-level standard error, ``margin_z``
            wide) contains 1, and not down while the validation accuracy still rises beyond its
            noise over ``margin_patience`` epochs; otherwise towards ``m / T_lo`` (down) or ``m
            / T_hi`` (up), capped by the largest validation gap ``G``, by at most a factor
            ``margin_rate``. When the margin moves from ``m`` to ``m'``,
            what is measured in units of ``m`` is converted: ``lambda_k <- clip(lambda_k m' /
            m, lambda_min, lambda_max)`` (the same force ``lambda_k / m`` on the gaps) and
            ``zbar_prev_k <- (m / m') (zbar_prev_k + 1) - 1`` (exact); ``rho`` is kept.
        penalty: ``"phr"`` (default), ``"p2"``, ``"p3"``, a :class:`Penalty`, or an elementwise
            callable ``P(z, rho, lam)`` (derivative by autograd).
        lambda_init, rho_init: initial multipliers and penalty parameters (1e-6 and 1).
        gamma: rho growth factor (1.2). tau: improvement ratio (0.9).
        rho_period: epochs between rho updates (10).
        lambda_min, lambda_max, rho_min, rho_max: safeguarding intervals.
        ignore_index: void label.
        margin_init, margin_min, margin_max, margin_warmup: the ``"auto"`` margin's start,
            range and number of epochs without update (10, 1, 20 and 0).
        margin_rate: the largest factor by which one epoch moves the ``"auto"`` margin (1.25;
            ``inf`` for none).
        margin_skill: the validation skill above chance, ``(BA - 1/K') / (1 - 1/K')`` with
            ``BA`` the mean per-class recall over the ``K'`` classes present, below which the
            ``"auto"`` margin is kept (0.1).
        margin_z: the half-width of the ``"auto"`` rule's intervals in standard errors (2).
        margin_patience: the epochs ``W`` over which the validation accuracy must have
            stopped rising beyond its noise before the ``"auto"`` margin may shrink (2; 0:
            no such rule).

    Shape:
        logits: ``(N, K, *S)`` (half precision is computed in float32); target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas (K,)``, ``rhos (K,)``, ``zbar_prev (K,)`` float64,
    ``has_prev`` (bool), and with ``margin="auto"`` the margin in force ``margin_value`` (float64)
    and the accuracy track ``margin_track (W, 2)`` / ``margin_seen``.
    The validation sums are O(K) float64 (O(bins) with ``"auto"``) and not persistent.
    """

    log_keys = ("lambda", "rho", "constraint", *_ClassAdaptiveLoss.MARGIN_LOGS)

    settings_types = (ALMSettings, EvidenceSettings)

    def __init__(
        self,
        num_classes: int,
        margin: float | Literal["auto"] = 10.0,
        ignore_index: int = -100,
        **settings: Any,
    ) -> None:
        alm, auto = self.settings(settings)
        super().__init__(num_classes, margin, alm.lambda_init, ignore_index, auto)
        self._set_alm_rules(alm)
        k = num_classes
        self.add_state("rhos", torch.full((k,), float(alm.rho_init), dtype=torch.float64))
        self.add_state("zbar_prev", torch.zeros(k, dtype=torch.float64))
        self.add_state("has_prev", torch.zeros((), dtype=torch.bool))
        self.add_statistic("_sum_grad", k)
        self.add_statistic("_sum_z", k)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        lam, rho = self._per_class(self.lambdas, logits), self._per_class(self.rhos, logits)
        value, derivative = self.penalty.value, self.penalty.derivative
        pen = class_penalty(
            logits,
            valid,
            self._margin_for(logits),
            lambda z: value(z, rho, lam),
            lambda z: derivative(z, rho, lam),
        )
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def _class_statistics(self) -> list[str]:
        return ["_sum_grad", "_sum_z"]

    def _observed_functions(self, like: Tensor) -> list:
        lam, rho = self._per_class(self.lambdas, like), self._per_class(self.rhos, like)
        return [lambda z: self.penalty.derivative(z, rho, lam), lambda z: z]

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The lambda and rho rules after epoch ``epoch`` (0-based); :meth:`update_multipliers`
        calls it with the statistics summed over processes.

        Returns:
            ``{"lambda": [K], "rho": [K], "constraint": [K]}`` after the update (constraint is
            this epoch's mean normalised constraint zbar); with ``margin="auto"`` also the
            ``margin_*`` entries of :meth:`_update_margin` (the margin for the next epoch,
            its statistic, interval and reason).
        """
        self.lambdas.copy_((stats["_sum_grad"] / n).clamp_(self.lambda_min, self.lambda_max))
        zbar = stats["_sum_z"] / n
        self._step_rhos(epoch, self.rhos, zbar, self.zbar_prev, bool(self.has_prev))
        self.zbar_prev.copy_(zbar)
        self.has_prev.fill_(True)
        margin = self._update_margin(epoch, stats)
        return {**self.multipliers(), "constraint": zbar.tolist(), **margin}

    def _margin_changed(self, old: float, new: float) -> None:
        """``z = d / m - 1`` is measured in units of the margin. Keep the penalty's linear force
        on the gaps, ``lambda_k z = (lambda_k / m) (d - m)``: ``lambda_k <- lambda_k new / old``
        (clipped to ``[lambda_min, lambda_max]``); restate the previous mean constraint at the
        new margin, exactly since ``z`` is affine in ``1 / m``: ``zbar_prev <- (old / new)
        (zbar_prev + 1) - 1``. ``rho`` stays in ``[rho_min, rho_max]``."""
        self.lambdas.mul_(new / old).clamp_(self.lambda_min, self.lambda_max)
        self.zbar_prev.add_(1.0).mul_(old / new).sub_(1.0)

    def multipliers(self) -> dict[str, list[float]]:
        """Current per-class ``lambda`` and ``rho`` as lists (for logging)."""
        return {"lambda": self.lambdas.tolist(), "rho": self.rhos.tolist()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, penalty={self.penalty.name}"
