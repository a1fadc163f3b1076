"""CALS-ALM: Class Adaptive Label Smoothing by an augmented Lagrangian (Liu et al., CVPR 2023).

The logit distances ``d_ik = max_j l_ij - l_ik`` of every position ``i`` should stay below a
margin ``m``; normalised, the constraints are ``z_ik = d_ik / m - 1 <= 0`` (paper eq. 9). The
training loss adds to the cross-entropy a penalty-Lagrangian ``P(z, rho_k, lambda_k)`` per
class, averaged over the K classes (eq. 10), and after every epoch the multipliers ``lambda``
and penalty parameters ``rho`` are re-estimated on the validation set (Alg. 2), visible in the
training loop::

    for epoch in range(epochs):
        train_one_epoch(model, criterion, ...)
        with torch.no_grad():
            for x, y in val_loader:
                criterion.observe(model(x), y)      # O(K) float64 sums, valid positions only
        stats = criterion.update_multipliers(epoch)  # all-reduced first under torch.distributed

The multipliers are buffers: saved by ``state_dict()``, moved by ``.to(device)``. CALS-HR, the
paper's heuristic variant (eq. 11), is in :mod:`cals_seg.losses.cals_hr`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cals_seg.losses._alm import ALMRules, ALMSettings
from cals_seg.losses._class_adaptive import ClassAdaptiveLoss
from cals_seg.losses._functional import ce_penalty
from cals_seg.losses.cals_hr import CALSHRLoss  # registered first: the order of the tables
from cals_seg.losses.registry import LOSSES


@LOSSES.register("cals_alm")
class CALSALMLoss(ALMRules, ClassAdaptiveLoss):
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
        margin: m; the constraint is ``d_ik <= m`` (paper: 10 vision, 6 text). It stays fixed
            unless :meth:`set_margin` changes it between epochs.
        penalty: ``"phr"`` (default), ``"p2"``, ``"p3"``, a :class:`Penalty`, or an elementwise
            callable ``P(z, rho, lam)`` (derivative by autograd).
        lambda_init, rho_init: initial multipliers and penalty parameters (1e-6 and 1).
        gamma: rho growth factor (1.2). tau: improvement ratio (0.9).
        rho_period: epochs between rho updates (10).
        lambda_min, lambda_max, rho_min, rho_max: safeguarding intervals.
        ignore_index: void label.

    Shape:
        logits: ``(N, K, *S)`` (half precision is computed in float32); target: ``(N, *S)``.

    Buffers (in ``state_dict``): ``lambdas (K,)``, ``rhos (K,)``, ``zbar_prev (K,)`` float64 and
    ``has_prev`` (bool). The validation sums are O(K) float64 and not persistent.
    """

    log_keys = ("lambda", "rho", "constraint")
    settings_types = (ALMSettings,)

    def __init__(
        self,
        num_classes: int,
        margin: float = 10.0,
        ignore_index: int = -100,
        **settings: Any,
    ) -> None:
        (alm,) = self.settings(settings)
        super().__init__(num_classes, margin, alm.lambda_init, ignore_index)
        self._set_alm_rules(alm)
        k = num_classes
        self.add_state("rhos", torch.full((k,), float(alm.rho_init), dtype=torch.float64))
        self.add_state("zbar_prev", torch.zeros(k, dtype=torch.float64))
        self.add_state("has_prev", torch.zeros((), dtype=torch.bool))
        self.add_statistic("_sum_grad", k)
        self.add_statistic("_sum_z", k)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        # CE and the penalty in one walk over the logits (shared max and log-sum-exp; the
        # gradient of both written at once): cals_seg.losses._functional.ce_penalty
        lam, rho = self._per_class(self.lambdas, logits), self._per_class(self.rhos, logits)
        terms = self.penalty.gap_terms(rho, lam, self._margin_for(logits))
        loss, ce, pen = ce_penalty(logits, target, valid, terms)
        self.terms = {"ce": ce, "penalty": pen}
        return loss

    def _class_statistics(self) -> list[str]:
        return ["_sum_grad", "_sum_z"]

    def _observed_functions(self, like: Tensor) -> list:
        """``P'(z; rho_k, lambda_k)`` (the next multipliers) and ``z`` (the mean constraint)."""
        lam, rho = self._per_class(self.lambdas, like), self._per_class(self.rhos, like)
        return [lambda z: self.penalty.derivative(z, rho, lam), lambda z: z]

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The lambda and rho rules after epoch ``epoch`` (0-based); :meth:`update_multipliers`
        calls it with the statistics summed over processes.

        Returns:
            ``{"lambda": [K], "rho": [K], "constraint": [K]}`` after the update (constraint is
            this epoch's mean normalised constraint zbar).
        """
        self.lambdas.copy_((stats["_sum_grad"] / n).clamp_(self.lambda_min, self.lambda_max))
        zbar = stats["_sum_z"] / n
        self._step_rhos(epoch, self.rhos, zbar, self.zbar_prev, bool(self.has_prev))
        self.zbar_prev.copy_(zbar)
        self.has_prev.fill_(True)
        return {**self.multipliers(), "constraint": zbar.tolist()}

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


__all__ = ["CALSALMLoss", "CALSHRLoss"]
