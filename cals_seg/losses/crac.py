"""CRaC: class- and region-adaptive constraints (Murugesan et al., MICCAI 2024).

The augmented-Lagrangian multipliers of CALS learned per class *and* per region of the
ground truth: *boundary* pixels (a 3x3 window holding another label) and *interior* pixels.
Each constraint pulls the logits towards the label proportions of the pixel's neighbourhood, as
NACL does, with a multiplier that the validation set re-estimates after every epoch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from cals_seg.losses._adaptive import AdaptiveLoss
from cals_seg.losses._alm import ALMRules, ALMSettings
from cals_seg.losses._functional import ce_sum
from cals_seg.losses._spatial import (
    SpatialLoss,
    mean_weights,
    mixed_windows,
    neighbourhood_distribution,
)
from cals_seg.losses.penalties import Penalty
from cals_seg.losses.registry import LOSSES
from cals_seg.utils.validation import check_finite

REGIONS = ("boundary", "interior")


@dataclasses.dataclass
class CRaCSettings(ALMSettings):
    """The ALM settings at the CRaC authors' published runs (``lag.rho=0.1`` in every command of
    their README): ``rho`` starts at 0.1 within [0.1, 10]; the rest as :class:`ALMSettings`."""

    rho_init: float = 0.1
    rho_min: float = 0.1


class _RegionPenalty(torch.autograd.Function):
    """``sum_{i in V} sum_k P(|t_ik - l_ik|; rho_{r(i)k}, lambda_{r(i)k}) / denom`` with an
    analytic backward, ``d/dl_ik = -sign(t_ik - l_ik) P'(|t_ik - l_ik|) / denom`` at valid
    pixels (0 where ``t = l``, as autograd's ``abs``). It keeps the logits (alive for the
    cross-entropy anyway), the target ``t`` (one logits-sized tensor) and two ``(N, H, W)`` bool
    maps, and walks the batch one image at a time: temporaries of ``(K, H, W)``. Autograd on
    the formula keeps about seven logits-sized tensors."""

    @staticmethod
    def forward(ctx, logits: Tensor, t: Tensor, boundary: Tensor, valid: Tensor,
                rhos: Tensor, lams: Tensor, penalty: Penalty, denom: Tensor) -> Tensor:
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        for i in range(logits.shape[0]):
            h = (t[i] - logits[i]).abs_()  # (K, H, W)
            p_boundary = penalty.value(h.clone(), rhos[0], lams[0])  # value may work in place
            p = torch.where(boundary[i], p_boundary, penalty.value(h, rhos[1], lams[1]))
            total += p.sum(dim=0).masked_fill_(~valid[i], 0.0).sum(dtype=torch.float64)
        ctx.save_for_backward(logits, t, boundary, valid, rhos, lams)
        ctx.penalty, ctx.denom = penalty, denom
        return (total / denom).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, t, boundary, valid, rhos, lams = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = grad_out / ctx.denom
        for i in range(logits.shape[0]):
            d = t[i] - logits[i]
            h = d.abs()
            g_boundary = ctx.penalty.derivative(h.clone(), rhos[0], lams[0])  # may work in place
            g = torch.where(boundary[i], g_boundary, ctx.penalty.derivative(h, rhos[1], lams[1]))
            grad[i] = g.mul_(d.sign_()).mul_(valid[i].to(g.dtype).mul(-scale))
        return grad, None, None, None, None, None, None, None


@LOSSES.register("crac")
class CRaCLoss(ALMRules, AdaptiveLoss, SpatialLoss):
    """Cross-entropy plus a class- and region-wise augmented-Lagrangian penalty.

    With ``q_ik`` the label proportions of pixel ``i``'s 3x3 window (zero padding outside the
    image, a void neighbour counting 1/K for every class, as :class:`NACLLoss`), ``r(i)`` its
    region (0 = boundary: the window holds a label other than the centre's, a void neighbour
    included; 1 = interior) and ``m`` the margin::

        h_ik = |q_ik - l_ik|        on the boundary,      |m q_ik - l_ik|   in the interior
        loss = CE(l, y) + (1 / (2 K |V|)) sum_{i in V} sum_k P(h_ik; rho_{r(i)k}, lambda_{r(i)k})

    (the authors' penalty is the mean over ``2K`` columns, one per region and class, the column of
    the other region holding ``h = 0`` where ``P(0) = 0``.) After epoch ``j`` (0-based), over the
    ``n`` valid validation pixels, ``n_r`` of them in region ``r``::

        lambda_rk <- clip((sum_{i in V, r(i) = r} [P'(h_ik)]  +  (n - n_r) [P'(0)]) / n,
                          lambda_min, lambda_max),    [.] = clip(., lambda_min, lambda_max)
        hbar_rk   =  (1 / n) sum_{i in V, r(i) = r} h_ik
        every rho_period epochs, once a previous hbar exists:
            rho_rk <- clip(gamma rho_rk if hbar_rk > tau max(0, hbar_prev_rk) else rho_rk,
                           rho_min, rho_max)
        hbar_prev <- hbar

    ``P'(0) = lambda_rk``: a pixel of the other region pulls the multiplier towards its current
    value, as in the authors' update (their gradient of the zero column).

    Defaults are the setting of every command the authors published (the four runs of
    Bala93/CRac's README, ACDC and FLARE with UNet and nnU-Net: ``lag.margin=5 lag.rho=0.1``):
    margin 5 and rho starting at 0.1 within [0.1, 10], on their ``spatial_bndry_cls_aug_lag``
    configuration otherwise. That YAML's own ``margin: 1`` / ``rho: 1`` (interior target ``q``
    in [0, 1], confidence near ``e / (e + K - 1)``) is never what they ran; pass
    ``margin=1, rho_init=1, rho_min=1`` to get it.

    Args:
        num_classes: K.
        margin: m, the scale of the interior target (5, the authors' published runs; their
            YAML's 1 makes both regions share ``|q - l|``).
        penalty: ``"phr"`` (authors), ``"p2"``, ``"p3"``, a :class:`Penalty` or a callable.
        lambda_init, rho_init: initial multipliers (1e-6, the authors' ``lambd_min``) and
            penalty parameters (0.1: the authors start rho at ``rho_min``).
        gamma, tau, rho_period: rho growth factor (1.2), improvement ratio (0.9) and epochs
            between rho updates (10).
        lambda_min, lambda_max, rho_min, rho_max: safeguarding intervals ([1e-6, 1e6],
            [0.1, 10]).
        ignore_index: void label.

    Shape:
        logits: ``(N, K, H, W)``; target: ``(N, H, W)``. Other shapes are refused.

    Buffers (in ``state_dict``): ``lambdas``, ``rhos``, ``hbar_prev`` ``(2, K)`` float64 (row 0
    boundary, row 1 interior) and ``has_prev`` (bool). Validation sums: ``(2, K)`` float64 and
    the two region counts.
    """

    loss_name = "crac"
    settings_types = (CRaCSettings,)
    log_keys = tuple(f"{key}_{region}" for key in ("lambda", "rho", "constraint")
                     for region in REGIONS)

    def __init__(
        self,
        num_classes: int,
        margin: float = 5.0,
        ignore_index: int = -100,
        **settings: Any,
    ) -> None:
        super().__init__(num_classes, ignore_index)
        (alm,) = self.settings(settings)
        if isinstance(margin, bool) or not isinstance(margin, int | float) or margin <= 0:
            raise ValueError(f"Expected `margin` > 0 (a number), but got {margin!r}.")
        self._set_alm_rules(alm)
        self.margin = float(margin)
        shape = (len(REGIONS), num_classes)
        self.add_state("lambdas", torch.full(shape, float(alm.lambda_init), dtype=torch.float64))
        self.add_state("rhos", torch.full(shape, float(alm.rho_init), dtype=torch.float64))
        self.add_state("hbar_prev", torch.zeros(shape, dtype=torch.float64))
        self.add_state("has_prev", torch.zeros((), dtype=torch.bool))
        self.add_statistic("_sum_grad", shape)
        self.add_statistic("_sum_h", shape)
        self.add_statistic("_region_count", len(REGIONS))

    def targets(self, target: Tensor, valid: Tensor,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``t (N, K, H, W)`` in ``dtype`` (``q`` on the boundary, ``m q`` in the interior) and
        the boundary map ``(N, H, W)`` bool."""
        k = self.num_classes
        q = neighbourhood_distribution(target, valid, k, mean_weights(3), "zeros", dtype)
        boundary = mixed_windows(target, valid, k, 3)
        if self.margin != 1.0:
            q = torch.where(boundary.unsqueeze(1), q, q * self.margin)
        return q, boundary

    def constraints(self, logits: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """``h = |t - l| (N, K, H, W)`` in the logits' dtype and the boundary map
        ``(N, H, W)`` bool."""
        t, boundary = self.targets(target, valid, logits.dtype)
        return (t - logits).abs_(), boundary

    def _region_params(self, boundary: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        """Per-pixel ``rho`` and ``lambda`` ``(N, K, H, W)`` of each pixel's region."""
        b = boundary.unsqueeze(1)
        lam = self.lambdas.to(like.dtype).view(2, 1, -1, 1, 1)
        rho = self.rhos.to(like.dtype).view(2, 1, -1, 1, 1)
        return torch.where(b, rho[0], rho[1]), torch.where(b, lam[0], lam[1])

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        n, k = logits.shape[:2]
        count = valid.sum().clamp(min=1)
        ce = ce_sum(logits.reshape(n, k, -1), target.reshape(n, -1), self.ignore_index) / count
        t, boundary = self.targets(target, valid, logits.dtype)
        like = dict(dtype=logits.dtype, device=logits.device)
        rhos = self.rhos.to(**like).view(2, -1, 1, 1)
        lams = self.lambdas.to(**like).view(2, -1, 1, 1)
        pen = _RegionPenalty.apply(logits, t, boundary, valid, rhos, lams, self.penalty,
                                   count * 2 * k)
        self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
        return ce + pen

    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        n, k = logits.shape[:2]
        check_finite(logits.reshape(n, k, -1))
        h, boundary = self.constraints(logits, target, valid)
        rho, lam = self._region_params(boundary, logits)
        grad = self.penalty.derivative(h.clone(), rho, lam).clamp_(self.lambda_min,
                                                                   self.lambda_max)
        sums_grad, sums_h, counts = [], [], []
        for in_region in (boundary & valid, ~boundary & valid):
            mask = in_region.unsqueeze(1).to(h.dtype)
            sums_grad.append((grad * mask).sum(dim=(0, 2, 3), dtype=torch.float64))
            sums_h.append((h * mask).sum(dim=(0, 2, 3), dtype=torch.float64))
            counts.append(in_region.sum().to(torch.float64))
        return {"_sum_grad": torch.stack(sums_grad), "_sum_h": torch.stack(sums_h),
                "_region_count": torch.stack(counts)}

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The lambda and rho rules after epoch ``epoch`` (0-based) (class docstring).

        Returns:
            ``lambda_boundary``, ``lambda_interior``, ``rho_boundary``, ``rho_interior`` (after
            the update) and ``constraint_boundary``, ``constraint_interior`` (``hbar``), each a
            list of K floats.
        """
        others = (n - stats["_region_count"]).view(2, 1)
        at_zero = self.penalty.derivative(torch.zeros_like(self.lambdas), self.rhos,
                                          self.lambdas.clone())
        at_zero = at_zero.clamp(self.lambda_min, self.lambda_max)
        lam = (stats["_sum_grad"] + others * at_zero) / n
        self.lambdas.copy_(lam.clamp_(self.lambda_min, self.lambda_max))
        hbar = stats["_sum_h"] / n
        self._step_rhos(epoch, self.rhos, hbar, self.hbar_prev, bool(self.has_prev))
        self.hbar_prev.copy_(hbar)
        self.has_prev.fill_(True)
        logs: dict[str, Any] = {}
        for key, values in (("lambda", self.lambdas), ("rho", self.rhos), ("constraint", hbar)):
            for row, region in enumerate(REGIONS):
                logs[f"{key}_{region}"] = values[row].tolist()
        return logs

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin:g}, penalty={self.penalty.name}"
