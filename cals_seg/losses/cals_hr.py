"""CALS-HR: Class Adaptive Label Smoothing with heuristic hinge weights (Liu et al., CVPR 2023,
eq. 11); CALS-ALM, the paper's method, is in :mod:`cals_seg.losses.cals`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cals_seg.losses._class_adaptive import ClassAdaptiveLoss
from cals_seg.losses._functional import ce_penalty, hinge_gap_terms
from cals_seg.losses.registry import LOSSES

SCORE_RULES = ("weighted", "unweighted")


@LOSSES.register("cals_hr")
class CALSHRLoss(ClassAdaptiveLoss):
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
        margin: m (10 vision, 6 text). The weights multiply the hinge in logit units,
            ``relu(d - m)``, and change by at most ``mu`` per epoch, so :meth:`set_margin`
            converts nothing.
        mu, tau: schedule factors (paper: 1.1 and 1.1).
        lambda_init: initial weights (0.1, the MbLS weight the heuristic starts from).
        lambda_min, lambda_max: safeguarding interval.
        score: ``"weighted"`` (default) or ``"unweighted"``, see above.
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas``, ``penalty_prev`` (``P(j-1)``), ``lambdas_prev``
    (``lambda(j-1)``, the multipliers ``P(j-1)`` was measured with), all ``(K,)`` float64, and
    ``has_prev`` (bool).

    Raises:
        ValueError: bad ``mu``, ``tau`` or ``score``.
    """

    log_keys = ("lambda", "penalty", "score")

    def __init__(
        self,
        num_classes: int,
        margin: float = 10.0,
        mu: float = 1.1,
        tau: float = 1.1,
        lambda_init: float = 0.1,
        lambda_min: float = 1e-6,
        lambda_max: float = 1e6,
        score: str = "weighted",
        ignore_index: int = -100,
    ) -> None:
        super().__init__(num_classes, margin, lambda_init, ignore_index)
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
        # lambda_k relu(d - m) = lambda_k m relu(z), with CE in one walk over the logits
        # (cals_seg.losses._functional.ce_penalty)
        terms = hinge_gap_terms(self._per_class(self.lambdas, logits), self._margin_for(logits))
        loss, ce, pen = ce_penalty(logits, target, valid, terms)
        self.terms = {"ce": ce, "penalty": pen}
        return loss

    def _class_statistics(self) -> list[str]:
        return ["_sum_pen"]

    def _observed_functions(self, like: Tensor) -> list:
        return [lambda z: z.clamp_(min=0.0).mul_(self.margin)]

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The heuristic rule after epoch ``epoch`` (0-based); :meth:`update_multipliers` calls
        it with the statistics summed over processes.

        Returns:
            ``{"lambda": [K], "penalty": [K], "score": [K]}``: the multipliers after the update,
            this epoch's mean class hinge ``P_k`` and the score ``S_k`` the rule compared.
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
        return {**self.multipliers(), "penalty": pen.tolist(), "score": curr.tolist()}

    def multipliers(self) -> dict[str, list[float]]:
        """Current per-class ``lambda`` as a list (for logging)."""
        return {"lambda": self.lambdas.tolist()}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, score={self.score!r}"
