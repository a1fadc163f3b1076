"""The safeguarded augmented-Lagrangian rules shared by CALS-ALM (paper Alg. 2), its
region-adaptive variant ``cals_alm_bands`` and CRaC: the checks of their settings and the step
of the penalty parameters ``rho``.

After each validation pass, with ``zbar`` the mean constraint value of this epoch and
``zbar_prev`` the previous one (per class, or per region and class)::

    lambda <- clip(mean P'(z; rho, lambda), lambda_min, lambda_max)
    rho    <- clip(gamma rho, rho_min, rho_max)  where zbar > tau max(0, zbar_prev),
              every rho_period epochs once a previous zbar exists

The ``lambda`` rule needs each loss's own sums; the checks and the ``rho`` step are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from cals_seg.losses.penalties import Penalty, PenaltyFn, get_penalty
from cals_seg.utils.validation import check_int


@dataclass
class ALMSettings:
    """The settings of the safeguarded ALM rules: the constructor keywords of every loss that
    follows them (``cals_alm``, ``cals_alm_bands``, ``crac``; ``loss.params`` keys in a config),
    with their defaults. Checked when built.

    Raises:
        ValueError: ``lambda_init < 0``, ``rho_init <= 0``, ``rho_period`` not a positive
            integer, or bounds out of order (``0 <= lambda_min <= lambda_max``,
            ``0 < rho_min <= rho_max``); an unknown penalty.
    """

    penalty: str | Penalty | PenaltyFn = "phr"
    lambda_init: float = 1e-6
    rho_init: float = 1.0
    gamma: float = 1.2
    tau: float = 0.9
    rho_period: int = 10
    lambda_min: float = 1e-6
    lambda_max: float = 1e6
    rho_min: float = 1.0
    rho_max: float = 10.0

    def __post_init__(self) -> None:
        if self.lambda_init < 0 or self.rho_init <= 0:
            raise ValueError("Expected `lambda_init` >= 0 and `rho_init` > 0, but got "
                             f"{self.lambda_init} and {self.rho_init}.")
        check_int("rho_period", self.rho_period)
        if not (0 <= self.lambda_min <= self.lambda_max and 0 < self.rho_min <= self.rho_max):
            raise ValueError("Expected 0 <= lambda_min <= lambda_max and 0 < rho_min <= rho_max.")
        get_penalty(self.penalty)


class ALMRules:
    """Mixin of the losses whose multipliers follow the safeguarded ALM rules: call
    :meth:`_set_alm_rules` in ``__init__``; :meth:`_step_rhos` in the update."""

    def _set_alm_rules(self, alm: ALMSettings) -> None:
        """Keep the (checked) settings as ``penalty`` (a :class:`Penalty`), ``gamma``, ``tau``,
        ``rho_period``, ``lambda_min``, ``lambda_max``, ``rho_min`` and ``rho_max``."""
        self.penalty = get_penalty(alm.penalty)
        self.gamma, self.tau, self.rho_period = float(alm.gamma), float(alm.tau), alm.rho_period
        self.lambda_min, self.lambda_max = float(alm.lambda_min), float(alm.lambda_max)
        self.rho_min, self.rho_max = float(alm.rho_min), float(alm.rho_max)

    def _step_rhos(self, epoch: int, rhos: Tensor, zbar: Tensor, zbar_prev: Tensor,
                   has_prev: bool) -> None:
        """The ``rho`` rule after epoch ``epoch`` (0-based), in place on ``rhos`` (any shape,
        the shape of ``zbar`` and ``zbar_prev``): grown by ``gamma`` where the constraint did
        not shrink enough, ``zbar > tau max(0, zbar_prev)``, every ``rho_period`` epochs once
        ``has_prev``; clipped to ``[rho_min, rho_max]``."""
        if (epoch + 1) % self.rho_period == 0 and has_prev:
            worse = zbar > self.tau * zbar_prev.clamp(min=0.0)
            rhos.copy_(rhos.where(~worse, rhos * self.gamma).clamp_(self.rho_min, self.rho_max))
