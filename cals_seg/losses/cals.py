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

from typing import Literal

import torch
from torch import Tensor

from .._validation import check_finite
from ..distributed import all_reduce_sum_
from ._auto_margin import (
    MARGIN_RATE,
    MARGIN_SKILL,
    NUM_BINS,
    beyond_chance,
    class_counts,
    effective_margin_sums,
    largest_gap_bound,
    next_margin,
    solve_temperature,
)
from ._base import SegLoss, as_float32, autocast_off, check_and_flatten
from ._functional import ce_sum, class_penalty, class_sums
from .penalties import Penalty, PenaltyFn, get_penalty


class _ClassAdaptiveLoss(SegLoss):
    """Shared machinery: margin (fixed or ``"auto"``), per-class ``lambdas``, validation sums
    and their reset."""

    def __init__(
        self,
        num_classes: int,
        margin: float | Literal["auto"],
        lambda_init: float,
        ignore_index: int,
        margin_init: float = 10.0,
        margin_min: float = 1.0,
        margin_max: float = 20.0,
        margin_warmup: int = 0,
        margin_rate: float = MARGIN_RATE,
        margin_skill: float = MARGIN_SKILL,
    ) -> None:
        super().__init__(num_classes, ignore_index)
        self.auto_margin = margin == "auto"
        if self.auto_margin:
            if not 0 < margin_min <= margin_init <= margin_max:
                raise ValueError(
                    "Expected 0 < margin_min <= margin_init <= margin_max, but got "
                    f"{margin_min}, {margin_init}, {margin_max}."
                )
            if not isinstance(margin_warmup, int) or margin_warmup < 0:
                raise ValueError(
                    f"Expected `margin_warmup` to be an integer >= 0, but got {margin_warmup!r}."
                )
            if not margin_rate > 1:
                raise ValueError(
                    f"Expected `margin_rate` > 1 (the largest factor of one epoch's margin change; "
                    f"inf for none), but got {margin_rate!r}."
                )
            if not 0 <= margin_skill < 1:
                raise ValueError(
                    "Expected 0 <= `margin_skill` < 1 (the validation skill above chance needed "
                    f"to move the margin), but got {margin_skill!r}."
                )
            margin = margin_init
            self.margin_min, self.margin_max = float(margin_min), float(margin_max)
            self.margin_warmup = margin_warmup
            self.margin_rate, self.margin_skill = float(margin_rate), float(margin_skill)
        elif isinstance(margin, str):
            raise ValueError(f"Expected `margin` to be a number or 'auto', but got {margin!r}.")
        if margin <= 0:
            raise ValueError(f"Expected `margin` > 0, but got {margin}.")
        if lambda_init < 0:
            raise ValueError(f"Expected `lambda_init` >= 0, but got {lambda_init}.")
        self.margin = float(margin)  # the margin in force (a Python float: no device sync)
        k = num_classes
        self.register_buffer("lambdas", torch.full((k,), float(lambda_init), dtype=torch.float64))
        self.register_buffer("_count", torch.zeros((), dtype=torch.int64), persistent=False)
        if self.auto_margin:
            # The margin in force, saved and restored with the multipliers.
            self.register_buffer("margin_value", torch.tensor(self.margin, dtype=torch.float64))
            self.register_buffer(
                "_meff_hist", torch.zeros(NUM_BINS, dtype=torch.float64), persistent=False
            )
            self.register_buffer(
                "_gap_hist", torch.zeros(NUM_BINS, dtype=torch.float64), persistent=False
            )
            self.register_buffer("_correct", torch.zeros((), dtype=torch.float64), persistent=False)
            self.register_buffer(
                "_class_count", torch.zeros(k, dtype=torch.float64), persistent=False
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.auto_margin:
            self.margin = float(self.margin_value)

    def _all_sums(self) -> list[Tensor]:
        extra = (
            [self._meff_hist, self._gap_hist, self._correct, self._class_count]
            if self.auto_margin
            else []
        )
        return [*self._sums(), *extra]

    def _per_class(self, values: Tensor, like: Tensor) -> Tensor:
        """``(K,)`` float64 buffer -> ``(1, K, 1)`` in the dtype of the logits."""
        return values.to(dtype=like.dtype).view(1, -1, 1)

    def _sums(self) -> list[Tensor]:
        raise NotImplementedError

    def _reduce_and_reset(self) -> tuple[list[Tensor], int]:
        """All-reduce the validation sums (no-op without torch.distributed), return them and n,
        and zero the accumulators (with ``margin: auto``, the margin rule's sums come last)."""
        sums = [s.clone() for s in self._all_sums()]
        count = self._count.clone()
        all_reduce_sum_([*sums, count])
        n = int(count.item())
        for s in self._all_sums():
            s.zero_()
        self._count.zero_()
        if n == 0:
            raise RuntimeError(
                "update_multipliers() found no observed validation positions: call "
                "criterion.observe(logits, target) on the validation batches first."
            )
        return sums, n

    def _update_margin(
        self, epoch: int, hist: Tensor, gap_hist: Tensor, correct: Tensor, counts: Tensor
    ) -> dict[str, float]:
        """The ``margin: auto`` rule after epoch ``epoch`` (0-based) from this validation pass's
        statistics: ``target = clip(m / T_hat, margin_min, min(margin_max, G))`` with ``G`` the
        largest validation gap (a margin above it is inert), then ``m <- clip(target, m /
        margin_rate, m * margin_rate)``; nothing during the first ``margin_warmup`` epochs or
        while the validation accuracy is not clearly above chance
        (:func:`~cals_seg.losses._auto_margin.beyond_chance`). A change calls
        :meth:`_margin_changed`. Returns the history entries ``margin`` (the margin now in
        force), ``margin_temperature`` (``T_hat``), ``margin_ceiling`` (``G``) and
        ``margin_skill`` (the validation skill above chance)."""
        t_hat = solve_temperature(hist, float(correct), self.num_classes)
        ceiling = largest_gap_bound(gap_hist)
        learned, skill = beyond_chance(float(correct), counts, self.margin_skill)
        if epoch + 1 > self.margin_warmup and learned:
            old = self.margin
            new = next_margin(
                old, t_hat, ceiling, self.margin_min, self.margin_max, self.margin_rate
            )
            self.margin_value.fill_(new)
            self.margin = float(self.margin_value)
            if self.margin != old:
                self._margin_changed(old, self.margin)
        return {
            "margin": self.margin,
            "margin_temperature": t_hat,
            "margin_ceiling": ceiling,
            "margin_skill": skill,
        }

    def _margin_changed(self, old: float, new: float) -> None:
        """Convert what depends on the margin after ``m: old -> new`` (nothing by default)."""

    @torch.no_grad()
    def observe(self, logits: Tensor, target: Tensor) -> None:
        """Accumulate the validation statistics of one batch (no gradient, valid positions only).

        Computes in float32 (sums in float64) whatever autocast context surrounds the call.

        Shape:
            logits: ``(N, K, *S)``; target: ``(N, *S)``.

        Raises:
            ValueError: bad shapes or labels (as the forward pass), or NaN / inf logits.
        """
        with autocast_off(logits.device):
            logits3, target2, valid = check_and_flatten(
                as_float32(logits), target, self.num_classes, self.ignore_index
            )
            n, _, s = logits3.shape
            maxima = torch.empty((n, 1, s), dtype=logits3.dtype, device=logits3.device)
            fns = self._observed_functions(logits3)
            sums = class_sums(logits3, valid, self.margin, fns, maxima=maxima)
            check_finite(logits3, maxima)  # before anything is accumulated
            for total, value in zip(self._sums(), sums, strict=True):
                total += value
            if self.auto_margin:
                hist, gap_hist, correct = effective_margin_sums(logits3, target2, valid)
                self._meff_hist += hist
                self._gap_hist += gap_hist
                self._correct += correct
                self._class_count += class_counts(target2, valid, self.num_classes)
            self._count += valid.sum()

    def _observed_functions(self, like: Tensor) -> list:
        """Elementwise functions of z whose per-class sums :meth:`observe` accumulates, in the
        order of :meth:`_sums`."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        auto = " (auto)" if self.auto_margin else ""
        return f"{super().extra_repr()}, margin={self.margin:g}{auto}"


class CALSALMLoss(_ClassAdaptiveLoss):
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
            start at ``margin_init`` and after each validation pass (from epoch
            ``margin_warmup``, once the validation accuracy is clearly above chance) move ``m``
            towards ``clip(m / T_hat, margin_min, min(margin_max, G))`` by at most a factor
            ``margin_rate``, where ``T_hat`` is the temperature that would match the validation
            confidence to the accuracy and ``G`` the largest validation gap
            (:mod:`cals_seg.losses._auto_margin`). When the margin moves from ``m`` to ``m'``,
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
        margin_skill: the validation skill above chance, ``(accuracy - chance) / (1 -
            chance)`` with ``chance`` the majority-class rate, below which the ``"auto"``
            margin is kept (0.1).

    Shape:
        logits: ``(N, K, *S)`` (half precision is computed in float32); target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas (K,)``, ``rhos (K,)``, ``zbar_prev (K,)`` float64,
    ``has_prev`` (bool), and with ``margin="auto"`` the margin in force ``margin_value`` (float64).
    The validation sums are O(K) float64 (O(bins) with ``"auto"``) and not persistent.
    """

    def __init__(
        self,
        num_classes: int,
        margin: float | Literal["auto"] = 10.0,
        penalty: str | Penalty | PenaltyFn = "phr",
        lambda_init: float = 1e-6,
        rho_init: float = 1.0,
        gamma: float = 1.2,
        tau: float = 0.9,
        rho_period: int = 10,
        lambda_min: float = 1e-6,
        lambda_max: float = 1e6,
        rho_min: float = 1.0,
        rho_max: float = 10.0,
        ignore_index: int = -100,
        margin_init: float = 10.0,
        margin_min: float = 1.0,
        margin_max: float = 20.0,
        margin_warmup: int = 0,
        margin_rate: float = MARGIN_RATE,
        margin_skill: float = MARGIN_SKILL,
    ) -> None:
        super().__init__(
            num_classes, margin, lambda_init, ignore_index,
            margin_init, margin_min, margin_max, margin_warmup, margin_rate, margin_skill,
        )  # fmt: skip
        if rho_init <= 0:
            raise ValueError(f"Expected `rho_init` > 0, but got {rho_init}.")
        if not isinstance(rho_period, int) or rho_period < 1:
            raise ValueError(
                f"Expected `rho_period` to be a positive integer, but got {rho_period!r}."
            )
        if not (0 <= lambda_min <= lambda_max and 0 < rho_min <= rho_max):
            raise ValueError("Expected 0 <= lambda_min <= lambda_max and 0 < rho_min <= rho_max.")
        self.penalty = get_penalty(penalty)
        self.gamma, self.tau, self.rho_period = float(gamma), float(tau), rho_period
        self.lambda_min, self.lambda_max = float(lambda_min), float(lambda_max)
        self.rho_min, self.rho_max = float(rho_min), float(rho_max)
        k = num_classes
        self.register_buffer("rhos", torch.full((k,), float(rho_init), dtype=torch.float64))
        self.register_buffer("zbar_prev", torch.zeros(k, dtype=torch.float64))
        self.register_buffer("has_prev", torch.zeros((), dtype=torch.bool))
        self.register_buffer("_sum_grad", torch.zeros(k, dtype=torch.float64), persistent=False)
        self.register_buffer("_sum_z", torch.zeros(k, dtype=torch.float64), persistent=False)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        lam, rho = self._per_class(self.lambdas, logits), self._per_class(self.rhos, logits)
        value, derivative = self.penalty.value, self.penalty.derivative
        pen = class_penalty(
            logits,
            valid,
            self.margin,
            lambda z: value(z, rho, lam),
            lambda z: derivative(z, rho, lam),
        )
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def _sums(self) -> list[Tensor]:
        return [self._sum_grad, self._sum_z]

    def _observed_functions(self, like: Tensor) -> list:
        lam, rho = self._per_class(self.lambdas, like), self._per_class(self.rhos, like)
        return [lambda z: self.penalty.derivative(z, rho, lam), lambda z: z]

    @torch.no_grad()
    def update_multipliers(self, epoch: int) -> dict[str, list[float]]:
        """Apply the lambda and rho rules after epoch ``epoch`` (0-based) and reset the sums.

        Returns:
            ``{"lambda": [K], "rho": [K], "constraint": [K]}`` after the update (constraint is
            this epoch's mean normalised constraint zbar); with ``margin="auto"`` also
            ``margin`` (the margin for the next epoch) and ``margin_temperature``.
        """
        (sum_grad, sum_z, *auto), n = self._reduce_and_reset()
        self.lambdas.copy_((sum_grad / n).clamp_(self.lambda_min, self.lambda_max))
        zbar = sum_z / n
        if (epoch + 1) % self.rho_period == 0 and bool(self.has_prev):
            worse = zbar > self.tau * self.zbar_prev.clamp(min=0.0)
            grown = torch.where(worse, self.rhos * self.gamma, self.rhos)
            self.rhos.copy_(grown.clamp_(self.rho_min, self.rho_max))
        self.zbar_prev.copy_(zbar)
        self.has_prev.fill_(True)
        margin = self._update_margin(epoch, *auto) if self.auto_margin else {}
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


SCORE_RULES = ("weighted", "unweighted")


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
        margin_init, margin_min, margin_max, margin_warmup, margin_rate, margin_skill: the
            ``"auto"`` margin (as :class:`CALSALMLoss`). The weights multiply the hinge in
            logit units, ``relu(d - m)``, and change by at most ``mu`` per epoch, so a margin
            change converts nothing.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas``, ``penalty_prev`` (``P(j-1)``), ``lambdas_prev``
    (``lambda(j-1)``, the multipliers ``P(j-1)`` was measured with), all ``(K,)`` float64, and
    ``has_prev`` (bool).

    Raises:
        ValueError: bad ``mu``, ``tau`` or ``score``.
    """

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
        margin_init: float = 10.0,
        margin_min: float = 1.0,
        margin_max: float = 20.0,
        margin_warmup: int = 0,
        margin_rate: float = MARGIN_RATE,
        margin_skill: float = MARGIN_SKILL,
    ) -> None:
        super().__init__(
            num_classes, margin, lambda_init, ignore_index,
            margin_init, margin_min, margin_max, margin_warmup, margin_rate, margin_skill,
        )  # fmt: skip
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
        self.register_buffer("penalty_prev", torch.zeros(k, dtype=torch.float64))
        self.register_buffer("lambdas_prev", torch.zeros(k, dtype=torch.float64))
        self.register_buffer("has_prev", torch.zeros((), dtype=torch.bool))
        self.register_buffer("_sum_pen", torch.zeros(k, dtype=torch.float64), persistent=False)

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
        w = self._per_class(self.lambdas, logits) * self.margin
        pen = class_penalty(
            logits,
            valid,
            self.margin,
            lambda z: z.clamp_(min=0.0).mul_(w),
            lambda z: (z > 0).to(z.dtype).mul_(w),
        )
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def _sums(self) -> list[Tensor]:
        return [self._sum_pen]

    def _observed_functions(self, like: Tensor) -> list:
        return [lambda z: z.clamp_(min=0.0).mul_(self.margin)]

    @torch.no_grad()
    def update_multipliers(self, epoch: int) -> dict[str, list[float]]:
        """Apply the heuristic rule after epoch ``epoch`` (0-based) and reset the sums.

        Returns:
            ``{"lambda": [K], "penalty": [K], "score": [K]}``: the multipliers after the update,
            this epoch's mean class hinge ``P_k`` and the score ``S_k`` the rule compared; with
            ``margin="auto"`` also ``margin`` and ``margin_temperature``.
        """
        (sum_pen, *auto), n = self._reduce_and_reset()
        pen = sum_pen / n
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
        margin = self._update_margin(epoch, *auto) if self.auto_margin else {}
        return {**self.multipliers(), "penalty": pen.tolist(), "score": curr.tolist(), **margin}

    def multipliers(self) -> dict[str, list[float]]:
        """Current per-class ``lambda`` as a list (for logging)."""
        return {"lambda": self.lambdas.tolist()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, score={self.score!r}"
