"""The randomised RAPS score (Angelopoulos, Bates, Malik and Jordan, ICLR 2021, "Uncertainty
Sets for Image Classifiers using Conformal Prediction").

RAPS is APS plus a penalty on the rank of the class: with the classes sorted by decreasing
probability (ties by index) and ``o_k`` the rank of class ``k`` (1 for the most probable),

    RAPS_k = sum_{j ranked before k} p_j + u p_k + lam * max(0, o_k - k_reg)

with the same seeded ``u`` as APS (:func:`~cals_seg.evaluation.conformal_scores.aps.
pixel_uniforms`). The penalty keeps classes ranked past ``k_reg`` out of the sets unless the
network is unsure enough, which shortens APS's long tails of small probabilities (the paper's
defaults for ImageNet: ``lam = 0.01``, ``k_reg = 5``).

The thresholds live on a grid over ``[0, 1]`` (:mod:`cals_seg.evaluation.conformal`), but RAPS
reaches ``1 + lam * max(0, K - k_reg)``: the score returned is RAPS divided by that largest
value ``C``. Dividing by a constant is increasing, so a class is in a set at threshold
``lambda`` of the divided score exactly when it is at ``C lambda`` of RAPS: the same sets, the
same guarantee (the resolution of the grid on RAPS itself is ``C / 4096``).

``--conformal score=raps`` has no place for the parameters: it uses :attr:`RAPS.lam` and
:attr:`RAPS.k_reg`. Other values are a subclass registered under another name::

    @SCORES.register("raps_strong")
    class StrongRAPS(RAPS):
        name, lam, k_reg = "raps_strong", 0.1, 2
"""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.evaluation.conformal_score import SCORES, ConformalScore
from cals_seg.evaluation.conformal_scores.aps import APS, pixel_uniforms

LAM = 0.01  # the rank penalty per rank past k_reg (the paper's ImageNet default)
K_REG = 5  # ranks up to k_reg are not penalised


def raps_scale(num_classes: int, lam: float = LAM, k_reg: int = K_REG) -> float:
    """``C = 1 + lam * max(0, K - k_reg)``: the largest RAPS score of ``K`` classes (the
    probability mass is at most 1, the largest rank is ``K``)."""
    return 1.0 + lam * max(0, num_classes - k_reg)


def raps_scores(probs: Tensor, u: Tensor, lam: float = LAM, k_reg: int = K_REG) -> Tensor:
    """Randomised RAPS scores divided by :func:`raps_scale` (module docstring), computed in
    float64.

    Shape:
        - probs: ``(N, K, P)``; u: ``(N, P)`` in ``(0, 1)``; returns ``(N, K, P)`` in
          ``[0, 1]``, of the dtype of ``probs``.
    """
    if not (lam >= 0 and isinstance(k_reg, int) and k_reg >= 0):
        raise ValueError(f"Expected lam >= 0 and an integer k_reg >= 0, but got lam={lam!r}, "
                         f"k_reg={k_reg!r}.")
    k = probs.shape[1]
    p, order = probs.to(torch.float64).sort(dim=1, descending=True, stable=True)
    rank = torch.arange(1, k + 1, device=probs.device, dtype=torch.float64).view(1, k, 1)
    penalty = lam * (rank - k_reg).clamp(min=0.0)
    sorted_scores = (p.cumsum(dim=1) - p) + u.unsqueeze(1) * p + penalty
    out = torch.empty_like(sorted_scores).scatter_(1, order, sorted_scores)
    return (out / raps_scale(k, lam, k_reg)).to(probs.dtype).clamp_(0.0, 1.0)


@SCORES.register("raps")
class RAPS(ConformalScore):
    """Randomised RAPS: APS with a rank penalty, ``lam`` per rank past ``k_reg`` (the paper's
    defaults, 0.01 and 5); ``u`` is APS's :func:`pixel_uniforms` of ``seed``. Exported to pt2
    only, as APS."""

    name = "raps"
    onnx_refusal = APS.onnx_refusal.replace("APS", "RAPS")
    lam: float = LAM
    k_reg: int = K_REG

    @classmethod
    def scores(cls, probs: Tensor, seed: int = 0) -> Tensor:
        return raps_scores(probs, pixel_uniforms(probs, seed), cls.lam, cls.k_reg)


__all__ = ["K_REG", "LAM", "RAPS", "raps_scale", "raps_scores"]
