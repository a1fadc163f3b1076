"""Shared math of the margin-based losses (MbLS, CALS-HR, CALS-ALM).

Notation (DESIGN.md section 2): logits ``l (N, K, S)``, valid positions ``V``,

    d_ik = max_j l_ij - l_ik        (the max is NOT detached)
    z_ik = d_ik / m - 1              (normalised constraint, z <= 0 is satisfied)

:func:`class_penalty` returns ``(1 / (|V| K)) * sum_{i in V} sum_k f_k(z_ik)`` with an analytic
backward: with ``g_ik = f_k'(z_ik) / (|V| K m)`` on valid positions (0 elsewhere),

    d penalty / d l_ik = -g_ik + [k == argmax_j l_ij] * sum_c g_ic

so backward keeps only the logits (already alive for the cross-entropy) and the ``(N, 1, S)``
arg-max index, never an ``(N, K, S)`` float temporary of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ElementFn = Callable[[Tensor], Tensor]


def normalised_constraint(logits: Tensor, margin: float) -> tuple[Tensor, Tensor]:
    """``z = (max_j l_j - l) / m - 1`` and the arg-max index.

    Shape:
        logits: ``(N, K, S)``. Returns ``z (N, K, S)`` (a new tensor) and ``idx (N, 1, S)``.
    """
    mx, idx = logits.max(dim=1, keepdim=True)
    return _constraint_from_max(logits, mx, margin), idx


def _constraint_from_max(logits: Tensor, mx: Tensor, margin: float) -> Tensor:
    # z = (mx / m - 1) - l / m in one pass over the logits.
    return torch.add(mx.mul(1.0 / margin).sub_(1.0), logits, alpha=-1.0 / margin)


def _valid_class_sum(values: Tensor, valid: Tensor) -> Tensor:
    """``sum_{i in V} values_ik`` as one GEMV per image: ``(N, K, S) @ (N, S, 1) -> (K,)``."""
    return torch.bmm(values, valid.to(values.dtype).unsqueeze(2)).sum(dim=(0, 2))


class _ClassPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, valid, margin, value_fn, grad_fn):  # type: ignore[override]
        z, idx = normalised_constraint(logits, margin)
        values = value_fn(z)
        del z
        denom = valid.sum().clamp(min=1) * logits.shape[1]
        ctx.save_for_backward(logits, idx, valid)
        ctx.margin, ctx.grad_fn, ctx.denom = margin, grad_fn, denom
        return _valid_class_sum(values, valid).sum() / denom

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, idx, valid = ctx.saved_tensors
        z = _constraint_from_max(logits, torch.gather(logits, 1, idx), ctx.margin)
        g = ctx.grad_fn(z)
        del z
        # -g_ik = -f'(z_ik) * valid_i * grad_out / (|V| K m); the arg-max class gets sum_c g_ic.
        weight = valid.unsqueeze(1).to(g.dtype) * (-grad_out / (ctx.denom * ctx.margin))
        g.mul_(weight)
        total = g.sum(dim=1, keepdim=True)
        g.scatter_add_(1, idx, total.neg_())
        return g, None, None, None, None


def class_penalty(
    logits: Tensor, valid: Tensor, margin: float, value_fn: ElementFn, grad_fn: ElementFn
) -> Tensor:
    """Mean over valid positions and classes of ``f(z)``, with the analytic backward above.

    Args:
        logits: ``(N, K, S)`` floating point.
        valid: ``(N, S)`` bool, True where the target is not ``ignore_index``.
        margin: m > 0.
        value_fn: elementwise ``f(z)`` on ``z (N, K, S)``; may modify its argument in place.
            Values at void positions must be finite (they are multiplied by 0).
        grad_fn: elementwise ``f'(z)``; may modify its argument in place and must return a
            tensor it owns (the backward writes the gradient into it).

    Returns:
        0-dim tensor; 0 with a zero gradient when no position is valid.
    """
    return _ClassPenalty.apply(logits, valid, float(margin), value_fn, grad_fn)


def ce_sum(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Summed cross-entropy over valid positions (``logits (N, K, S)``, ``target (N, S)``)."""
    return torch.nn.functional.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="sum"
    )
