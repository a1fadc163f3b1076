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

from torch import Tensor

from cals_seg.losses.penalties import Penalty, PenaltyFn, get_penalty


class ALMRules:
    """Mixin of the losses whose multipliers follow the safeguarded ALM rules: call
    :meth:`_set_alm_rules` in ``__init__``; :meth:`_step_rhos` in the update."""

    def _set_alm_rules(
        self,
        penalty: str | Penalty | PenaltyFn,
        lambda_init: float,
        rho_init: float,
        gamma: float,
        tau: float,
        rho_period: int,
        lambda_min: float,
        lambda_max: float,
        rho_min: float,
        rho_max: float,
    ) -> None:
        """Check the settings and keep them as ``penalty``, ``gamma``, ``tau``, ``rho_period``,
        ``lambda_min``, ``lambda_max``, ``rho_min`` and ``rho_max``.

        Raises:
            ValueError: ``lambda_init < 0``, ``rho_init <= 0``, ``rho_period`` not a positive
                integer, or bounds out of order (``0 <= lambda_min <= lambda_max``,
                ``0 < rho_min <= rho_max``); an unknown penalty.
        """
        if lambda_init < 0 or rho_init <= 0:
            raise ValueError("Expected `lambda_init` >= 0 and `rho_init` > 0, but got "
                             f"{lambda_init} and {rho_init}.")
        if not isinstance(rho_period, int) or isinstance(rho_period, bool) or rho_period < 1:
            raise ValueError(
                f"Expected `rho_period` to be a positive integer, but got {rho_period!r}."
            )
        if not (0 <= lambda_min <= lambda_max and 0 < rho_min <= rho_max):
            raise ValueError("Expected 0 <= lambda_min <= lambda_max and 0 < rho_min <= rho_max.")
        self.penalty = get_penalty(penalty)
        self.gamma, self.tau, self.rho_period = float(gamma), float(tau), rho_period
        self.lambda_min, self.lambda_max = float(lambda_min), float(lambda_max)
        self.rho_min, self.rho_max = float(rho_min), float(rho_max)

    def _step_rhos(self, epoch: int, rhos: Tensor, zbar: Tensor, zbar_prev: Tensor,
                   has_prev: bool) -> None:
        """The ``rho`` rule after epoch ``epoch`` (0-based), in place on ``rhos`` (any shape,
        the shape of ``zbar`` and ``zbar_prev``): grown by ``gamma`` where the constraint did
        not shrink enough, ``zbar > tau max(0, zbar_prev)``, every ``rho_period`` epochs once
        ``has_prev``; clipped to ``[rho_min, rho_max]``."""
        if (epoch + 1) % self.rho_period == 0 and has_prev:
            worse = zbar > self.tau * zbar_prev.clamp(min=0.0)
            rhos.copy_(rhos.where(~worse, rhos * self.gamma).clamp_(self.rho_min, self.rho_max))
