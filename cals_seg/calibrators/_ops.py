"""Small tensor functions shared by several calibrators and their exported forms."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def confidence_logodds(logits: Tensor) -> Tensor:
    """``u = log s - log(1 - s)`` of the top-label confidence ``s = max softmax(l)``, computed
    from the log-sum-exp of the other classes (exact for ``s`` near 1: ``u = l_top -
    logsumexp_{j != top} l_j``; ``+inf`` when the other classes have probability 0).

    Shape:
        - logits: ``(N, K, *S)``; returns ``(N, *S)`` in float32 (float64 for float64 logits).
    """
    x = logits.detach()
    x = x.double() if x.dtype == torch.float64 else x.float()
    top = x.amax(dim=1, keepdim=True)
    first = x.argmax(dim=1, keepdim=True)
    others = x.scatter(1, first, -math.inf)
    return (top - torch.logsumexp(others, dim=1, keepdim=True)).squeeze(1)


def floored_log_probs(rows: Tensor) -> Tensor:
    """``log softmax`` of ``rows (M, K)`` floored at ``log(1e-16)``, as the selective scaling
    authors' ``log(p + 1e-16)``: no ``-inf`` enters the misprediction classifier."""
    return torch.log_softmax(rows.float(), dim=1).clamp(min=math.log(1e-16))


__all__ = ["confidence_logodds", "floored_log_probs"]
