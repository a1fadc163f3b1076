"""Penalty-Lagrangian functions P(z; rho, lambda) and their derivatives P' = dP/dz.

Paper appendix "Penalty functions for ALM" (Birgin et al. 2005, section 3.2). Every P satisfies
P' >= 0 and P'(0) = lambda. All functions are elementwise and broadcast: ``z`` is any tensor,
``rho`` and ``lam`` broadcast against it (per class: shape ``(1, K, 1)`` for ``z (N, K, S)``).

    PHR: P  = lambda z + rho z^2 / 2          if lambda + rho z >= 0, else -lambda^2 / (2 rho)
         P' = max(0, lambda + rho z)
    P2:  P  = lambda z + lambda rho z^2 + rho^2 z^3 / 6  (z >= 0),  lambda z / (1 - rho z)  (z < 0)
         P' = lambda + 2 lambda rho z + rho^2 z^2 / 2    (z >= 0),  lambda / (1 - rho z)^2  (z < 0)
    P3:  P  = lambda z + lambda rho z^2                   (z >= 0),  lambda z / (1 - rho z)  (z < 0)
         P' = lambda + 2 lambda rho z                     (z >= 0),  lambda / (1 - rho z)^2  (z < 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cals_seg.losses._functional import GapTerms, elementwise_gap_terms

PenaltyFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def phr(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """PHR value, computed as ``z_c (lambda + rho z_c / 2)`` with ``z_c = max(z, -lambda/rho)``:
    equal to ``lambda z + rho z^2 / 2`` where ``lambda + rho z >= 0`` and to
    ``-lambda^2 / (2 rho)`` elsewhere, without a branch and without cancellation."""
    zc = torch.maximum(z, -lam / rho)
    return torch.addcmul(lam, zc, rho * 0.5).mul_(zc)


def phr_grad(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """PHR derivative ``max(0, lambda + rho z)``, computed in place in ``z``."""
    return z.mul_(rho).add_(lam).clamp_(min=0.0)


def phr_gap_terms(rho: Tensor, lam: Tensor, margin: float | Tensor) -> GapTerms:
    """PHR as a function of the gaps ``t = l - max_j l_j`` (``z = -t / m - 1``), for
    :func:`cals_seg.losses._functional.ce_penalty`: the derivative in the distance is affine in
    ``t`` before the clamp, ``P'(z) / m = max(0, (lambda - rho) / m - (rho / m^2) t)``, and the
    value follows from it, ``P = (P'^2 - lambda^2) / (2 rho)`` (both branches): three passes
    over a block for ``P'``, three for ``sum_k P``."""
    inv_m = margin.reciprocal() if torch.is_tensor(margin) else 1.0 / margin
    a, b = (lam - rho) * inv_m, rho * (-inv_m * inv_m)
    weight = rho.reciprocal() * (0.5 / (inv_m * inv_m))
    floor = (lam * lam * 0.5 / rho).sum()  # sum_k lambda_k^2 / (2 rho_k)

    def terms(t: Tensor) -> tuple[Tensor, Tensor]:
        if torch.compiler.is_compiling():
            # No logits-sized term read twice from five inputs (the logits, their maximum,
            # lambda, rho, m): inductor would store it (a logits-sized buffer and one more
            # pass) instead of computing it inside the loop of the reductions. So the value
            # squares its own copy of P' (written in another order: not merged with it).
            value = (a + b * t).clamp(min=0.0).square().mul(weight).sum(dim=1, keepdim=True)
            return (t * b + a).clamp(min=0.0), value.sub(floor)
        grad = t.mul_(b).add_(a).clamp_(min=0.0)
        return grad, (grad * weight).mul_(grad).sum(dim=1, keepdim=True).sub_(floor)

    return terms


def _split(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # Both branches are evaluated by torch.where; clamping keeps the unused one finite.
    return z >= 0, z.clamp(min=0.0), z.clamp(max=0.0)


def p2(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """P2 value (Kort and Bertsekas)."""
    pos, zp, zn = _split(z)
    high = lam * zp + lam * rho * zp**2 + rho**2 * zp**3 / 6.0
    low = lam * zn / (1.0 - rho * zn)
    return torch.where(pos, high, low)


def p2_grad(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """P2 derivative."""
    pos, zp, zn = _split(z)
    high = lam + 2.0 * lam * rho * zp + rho**2 * zp**2 / 2.0
    low = lam / (1.0 - rho * zn) ** 2
    return torch.where(pos, high, low)


def p3(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """P3 value (Nakayama et al.)."""
    pos, zp, zn = _split(z)
    high = lam * zp + lam * rho * zp**2
    low = lam * zn / (1.0 - rho * zn)
    return torch.where(pos, high, low)


def p3_grad(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
    """P3 derivative."""
    pos, zp, zn = _split(z)
    high = lam + 2.0 * lam * rho * zp
    low = lam / (1.0 - rho * zn) ** 2
    return torch.where(pos, high, low)


@dataclass(frozen=True)
class Penalty:
    """A penalty-Lagrangian function: its value and its derivative w.r.t. z."""

    name: str
    value: PenaltyFn
    derivative: PenaltyFn
    of_gaps: Callable[[Tensor, Tensor, float | Tensor], GapTerms] | None = None

    def gap_terms(self, rho: Tensor, lam: Tensor, margin: float | Tensor) -> GapTerms:
        """The penalty with per-class ``rho``, ``lam (1, K, 1)`` and margin ``m`` as a function
        of the gaps (:data:`cals_seg.losses._functional.GapTerms`): :attr:`of_gaps` where the
        penalty has one (PHR), else from :attr:`value` and :attr:`derivative`."""
        if self.of_gaps is not None:
            return self.of_gaps(rho, lam, margin)
        return elementwise_gap_terms(lambda z: self.value(z, rho, lam),
                                     lambda z: self.derivative(z, rho, lam), margin)


def _autograd_derivative(value: PenaltyFn) -> PenaltyFn:
    """P' of an elementwise P by autograd (d/dz sum P = P' elementwise)."""

    def derivative(z: Tensor, rho: Tensor, lam: Tensor) -> Tensor:
        with torch.enable_grad():
            zz = z.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(value(zz, rho, lam).sum(), zz)
        return grad

    return derivative


PENALTIES: dict[str, Penalty] = {
    "phr": Penalty("phr", phr, phr_grad, phr_gap_terms),
    "p2": Penalty("p2", p2, p2_grad),
    "p3": Penalty("p3", p3, p3_grad),
}


def get_penalty(penalty: str | Penalty | PenaltyFn) -> Penalty:
    """Resolve a penalty given by name (``"phr"``, ``"p2"``, ``"p3"``), as a :class:`Penalty`,
    or as a plain elementwise callable ``P(z, rho, lam)`` whose derivative is taken by autograd.
    """
    if isinstance(penalty, Penalty):
        return penalty
    if isinstance(penalty, str):
        key = penalty.lower()
        if key not in PENALTIES:
            raise ValueError(
                f"Unknown penalty {penalty!r}; expected one of {sorted(PENALTIES)} or a callable "
                "P(z, rho, lam)."
            )
        return PENALTIES[key]
    if callable(penalty):
        name = getattr(penalty, "__name__", "custom")
        return Penalty(name, penalty, _autograd_derivative(penalty))
    raise ValueError(
        f"Expected `penalty` to be a name in {sorted(PENALTIES)} or a callable, but got "
        f"{type(penalty).__name__}."
    )
