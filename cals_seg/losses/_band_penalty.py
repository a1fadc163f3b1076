"""The CALS-ALM penalty with per-band parameters, and its analytic backward.

As :func:`cals_seg.losses._functional.class_penalty`, with the margin, the multiplier and the
penalty parameter of each position taken from its band ``b(i)``::

    z_ik     = d_ik / m_b(i) - 1,        d_ik = max_j l_ij - l_ik
    penalty  = (1 / (|V| K)) sum_{i in V} sum_k P(z_ik; rho_b(i)k, lambda_b(i)k)
    g_ik     = P'(z_ik) / (|V| K m_b(i))  on valid positions, 0 elsewhere
    d penalty / d l_ik = -g_ik + [k == argmax_j l_ij] sum_c g_ic

Backward keeps the logits (alive for the cross-entropy), the ``(N, 1, S)`` maxima and the
``(N, S)`` int8 band map; both passes walk the logits in blocks, so every other temporary is
block-sized and the only logits-sized allocation is the gradient returned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.losses._base import autocast_off
from cals_seg.losses._functional import blocks
from cals_seg.losses.penalties import Penalty


def _block_params(band: Tensor, margins: Tensor, lambdas: Tensor, rhos: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``m (n, 1, s)``, ``lambda (n, K, s)``, ``rho (n, K, s)`` of a block's band map
    ``(n, s)`` (void positions, band -1, take band 0's values; they are masked out)."""
    b = band.long().clamp_(min=0)
    return (margins[b].unsqueeze(1), lambdas[b].permute(0, 2, 1), rhos[b].permute(0, 2, 1))


class _BandPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, band, margins, lambdas, rhos, penalty):  # type: ignore[override]
        with autocast_off(logits.device):
            n, k, s = logits.shape
            maxima = torch.empty((n, 1, s), dtype=logits.dtype, device=logits.device)
            total = torch.zeros((), dtype=torch.float64, device=logits.device)
            for im, pos in blocks(logits):
                x, bb = logits[im, :, pos], band[im, pos]
                mx = x.amax(dim=1, keepdim=True)
                maxima[im, :, pos] = mx
                m, lam, rho = _block_params(bb, margins, lambdas, rhos)
                z = (mx - x).div_(m).sub_(1.0)
                values = penalty.value(z, rho, lam)
                values.masked_fill_((bb < 0).unsqueeze(1), 0.0)
                total += values.sum(dim=2).sum(dim=0, dtype=torch.float64).sum()
            denom = (band >= 0).sum().clamp(min=1) * k
            ctx.save_for_backward(logits, maxima, band, margins, lambdas, rhos)
            ctx.penalty, ctx.denom = penalty, denom
            return (total / denom).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, maxima, band, margins, lambdas, rhos = ctx.saved_tensors
        with autocast_off(logits.device):
            grad = torch.empty_like(logits)
            scale = grad_out / ctx.denom
            for im, pos in blocks(logits):
                x, mx, bb = logits[im, :, pos], maxima[im, :, pos], band[im, pos]
                m, lam, rho = _block_params(bb, margins, lambdas, rhos)
                z = (mx - x).div_(m).sub_(1.0)
                g = ctx.penalty.derivative(z, rho, lam)
                # g_ik = P'(z_ik) valid_i grad_out / (|V| K m_b(i)); -g_ik, and the arg-max
                # class gets sum_c g_ic (shared between tied maxima, as amax's autograd).
                g = g.mul_(((bb >= 0).to(g.dtype) * -scale).unsqueeze(1) / m)
                is_max = (x == mx).to(g.dtype)
                share = g.sum(dim=1, keepdim=True).div_(is_max.sum(dim=1, keepdim=True)).neg_()
                grad[im, :, pos] = g.addcmul_(is_max, share)
        return grad, None, None, None, None, None


def band_penalty(logits: Tensor, band: Tensor, margins: Tensor, lambdas: Tensor, rhos: Tensor,
                 penalty: Penalty) -> Tensor:
    """Mean over valid positions and classes of ``P(z; rho, lambda)`` with per-band parameters
    (module docstring), with the analytic backward.

    Args:
        logits: ``(N, K, S)`` floating point.
        band: ``(N, S)`` integer band index, -1 on void positions.
        margins: ``(B,)``; lambdas, rhos: ``(B, K)``; all in the logits' dtype and device.
        penalty: its ``value`` and ``derivative`` (elementwise, broadcasting).

    Returns:
        0-dim tensor; 0 with a zero gradient when no position is valid.
    """
    return _BandPenalty.apply(logits, band.to(torch.int8), margins, lambdas, rhos, penalty)
