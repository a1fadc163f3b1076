"""``vector``: a scale and a bias per class (vector scaling, Guo et al. 2017; Kull et al. 2019).

``forward(l)_k = s_k l_k + b_k``, with ``s = 1, b = 0`` (the identity) until fitted. ``s`` and
``b`` minimise the mean validation NLL, a convex function of them, by full-batch L-BFGS in
float64 (each objective evaluation is one pass over the validation batches). A per-class scale
and bias can change the argmax.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.calibrators._base import Batches, Calibrator, lbfgs_fit, summed_nll
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.utils.validation import check_int


def vector_nll(rows: Tensor, labels: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """Summed NLL of ``softmax(scale * rows + bias)``. Shape: rows ``(P, K)``, labels ``(P,)``,
    scale / bias ``(K,)``; returns a scalar."""
    return summed_nll(rows * scale + bias, labels)


@CALIBRATORS.register("vector")
class VectorScaling(Calibrator):
    """Per-class scale ``s`` and bias ``b`` (parameters ``scale``, ``bias``).

    Args:
        num_classes: K >= 2.
        max_iter: L-BFGS iterations of the fit (each about one pass over validation).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "vector"
    changes_argmax = True

    def __init__(self, num_classes: int, max_iter: int = 100) -> None:
        check_int("max_iter", max_iter)
        super().__init__(num_classes, max_iter=max_iter)
        self.scale = nn.Parameter(torch.ones(num_classes), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_classes), requires_grad=False)

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Minimise the mean validation NLL over ``(s, b)`` from the identity."""
        device = self.scale.device
        s = torch.ones(self.num_classes, dtype=torch.float64, device=device, requires_grad=True)
        b = torch.zeros(self.num_classes, dtype=torch.float64, device=device, requires_grad=True)
        info = lbfgs_fit([s, b], lambda r, y: vector_nll(r, y, s, b), None, batches,
                         ignore_index, self.params["max_iter"])
        self.scale.data.copy_(s.detach())
        self.bias.data.copy_(b.detach())
        self.fit_info = info
        return info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        shape = (1, -1) + (1,) * (logits.dim() - 2)
        return logits * self.scale.view(shape).to(logits.dtype) + self.bias.view(shape).to(
            logits.dtype)
