"""``dirichlet``: a matrix on log-probabilities with ODIR regularisation (Kull et al., NeurIPS
2019, "Beyond temperature scaling: obtaining well-calibrated multiclass probabilities with
Dirichlet calibration").

``forward(l) = W log softmax(l) + b`` (calibrated logits). Fitted on validation by minimising

    mean NLL + lambda / (K (K - 1)) sum_{i != j} W_ij^2 + mu / K sum_j b_j^2

(Off-Diagonal and Intercept Regularisation), a convex objective, by full-batch L-BFGS in
float64 from ``W = I, b = 0``, where the output's softmax equals the input's. Can change the
argmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.calibrators._base import Batches, Calibrator, lbfgs_fit, summed_nll
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.errors import UserError
from cals_seg.utils.validation import check_int


def dirichlet_logits(rows: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``log_softmax(rows) W^T + b``. Shape: rows ``(P, K)``, weight ``(K, K)``, bias ``(K,)``."""
    return torch.log_softmax(rows, dim=1) @ weight.T + bias


def odir_penalty(weight: Tensor, bias: Tensor, lam: float, mu: float) -> Tensor:
    """``lam / (K (K-1)) sum_{i != j} W_ij^2 + mu / K sum_j b_j^2``."""
    k = weight.shape[0]
    off = weight - torch.diag(torch.diagonal(weight))
    return lam / (k * (k - 1)) * off.pow(2).sum() + mu / k * bias.pow(2).sum()


@CALIBRATORS.register("dirichlet")
class DirichletCalibration(Calibrator):
    """Matrix ``W`` (parameter ``weight``, K x K) and bias ``b`` on log-probabilities.

    Args:
        num_classes: K >= 2.
        lam: weight of the off-diagonal penalty (``lambda`` of ODIR, >= 0).
        mu: weight of the intercept penalty (>= 0).
        max_iter: L-BFGS iterations of the fit (each about one pass over validation).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "dirichlet"
    changes_argmax = True

    def __init__(self, num_classes: int, lam: float = 1e-3, mu: float = 1e-3,
                 max_iter: int = 100) -> None:
        for key, value in (("lam", lam), ("mu", mu)):
            if not (isinstance(value, int | float) and value >= 0):
                raise UserError(f"Expected `{key}` to be a number >= 0, but got {value!r}.")
        check_int("max_iter", max_iter)
        super().__init__(num_classes, lam=float(lam), mu=float(mu), max_iter=max_iter)
        self.weight = nn.Parameter(torch.eye(num_classes), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_classes), requires_grad=False)

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Minimise the ODIR-regularised mean validation NLL over ``(W, b)``."""
        k, device = self.num_classes, self.weight.device
        w = torch.eye(k, dtype=torch.float64, device=device).requires_grad_(True)
        b = torch.zeros(k, dtype=torch.float64, device=device, requires_grad=True)
        lam, mu = self.params["lam"], self.params["mu"]

        def nll(rows: Tensor, labels: Tensor) -> Tensor:
            return summed_nll(dirichlet_logits(rows, w, b), labels)

        info = lbfgs_fit([w, b], nll, lambda: odir_penalty(w, b, lam, mu), batches,
                         ignore_index, self.params["max_iter"])
        self.weight.data.copy_(w.detach())
        self.bias.data.copy_(b.detach())
        self.fit_info = info
        return info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        logp = torch.log_softmax(logits, dim=1).movedim(1, -1)
        out = logp @ self.weight.T.to(logp.dtype) + self.bias.to(logp.dtype)
        return out.movedim(-1, 1)
