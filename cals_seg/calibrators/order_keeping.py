"""``cms_ap`` and ``cms_op``: class-conditional affine calibrators that keep the argmax, or the
whole class order (Kirscher et al., "Rethinking Post-Hoc Calibration in Semantic
Segmentation", TMLR 2026, arXiv:2607.01902: their CMSap and CMSop).

Each pixel is routed to the *expert* of its predicted class ``c = argmax_k l_k``; the expert is an
affine map on non-negative logit gaps, with non-negative coefficients, so the calibrated logits
keep the decision. With ``l`` the logits of one pixel (only differences of logits enter, so both
maps are translation invariant: adding a constant to every logit changes nothing):

- ``cms_ap`` (argmax-preserving): the gaps to the top class ``g_j = l_c - l_j >= 0`` for the
  ``K - 1`` competitors ``j != c`` (in class order), and::

      out_c = 0,     out_j = -(B_c g + mu_c)_j

- ``cms_op`` (order-preserving): the classes sorted by decreasing logit (ties by class index,
  as ``argmax``), the gaps between consecutive ranks ``g_i = l_(i) - l_(i+1) >= 0``, and::

      out_(1) = 0,   out_(i+1) = out_(i) - (B_c g + mu_c)_i

with, per expert, ``B_c`` a ``(K-1) x (K-1)`` matrix with positive diagonal and non-negative
off-diagonal entries and ``mu_c >= 0``. Then ``out_c > out_j`` wherever ``l_c > l_j`` (a
competitor's calibrated gap is at least ``B_jj g_j > 0``), so the argmax (``cms_ap``) or the
whole ranking (``cms_op``) is the network's: mIoU and every segmentation number are unchanged.
At ``B_c = I, mu_c = 0`` both maps return ``l - l_c``, the network's probabilities.

Fit: the mean validation NLL of ``softmax(out)`` over all valid pixels, no regulariser (the
authors' default), by full-batch L-BFGS in float64 through :func:`lbfgs_fit` (one streaming
pass over the validation batches per objective evaluation, all-reduced under DDP), so the result
is the full-batch optimum of the authors' reference fit without holding the pixels. The
coefficients are parameterised as ``B_jj = exp(a_j)``, ``B_ij = softplus(r_ij)`` (i != j),
``mu = softplus(b)``, starting at ``a = r = b = 0`` (a start next to the identity, ``r = b =
-12``, leaves the off-diagonals and biases without gradient).
One first pass counts the validation pixels of each expert; an expert without any keeps the
identity. The NLL is convex in ``(B, mu)`` (the logits are linear in them) over a convex set, so
the optimum does not depend on the parameterisation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    iterate,
    lbfgs_fit,
    valid_rows,
)
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int

MODES = ("argmax", "order")
# Where the raw off-diagonal and bias parameters start: softplus(0) = log 2. A start next to 0
# (softplus(-12) = 6e-6) leaves them without gradient (sigmoid(-12)) and the fit stalls 0.18
# nats above the optimum on the test data; from 0 it ends within 2e-9 of it.
RAW_FLOOR = 0.0


def competitors(num_classes: int, device: torch.device | None = None) -> Tensor:
    """``(K, K-1)`` int64: row ``c`` holds the classes other than ``c``, increasing."""
    k = num_classes
    idx = torch.arange(k, device=device)
    return torch.stack([idx[idx != c] for c in range(k)])


def order_keeping_logits(rows: Tensor, weight: Tensor, bias: Tensor, mode: str) -> Tensor:
    """Calibrated logits of ``rows`` (module docstring).

    Shape:
        - rows: ``(P, K)``; weight: ``(K, K-1, K-1)`` (``B_c``); bias: ``(K, K-1)`` (``mu_c``);
          returns ``(P, K)`` in the dtype of ``rows``.
    """
    k = rows.shape[1]
    top = rows.argmax(dim=1)
    out = torch.zeros_like(rows)
    if mode == "argmax":
        comp = competitors(k, rows.device)
        for c in range(k):
            sel = (top == c).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            r = rows.index_select(0, sel)
            gaps = r[:, c:c + 1] - r[:, comp[c]]
            part = torch.zeros_like(r)
            part[:, comp[c]] = -(gaps @ weight[c].T + bias[c])
            out = out.index_copy(0, sel, part)
        return out
    values, perm = torch.sort(rows, dim=1, descending=True, stable=True)
    gaps = values[:, :-1] - values[:, 1:]
    for c in range(k):
        sel = (top == c).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        steps = gaps.index_select(0, sel) @ weight[c].T + bias[c]
        ranked = torch.cat([steps.new_zeros(steps.shape[0], 1), -steps.cumsum(dim=1)], dim=1)
        part = torch.zeros_like(ranked).scatter(1, perm.index_select(0, sel), ranked)
        out = out.index_copy(0, sel, part)
    return out


def _effective(a: Tensor, r: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, mu)`` from the raw parameters: ``diag exp(a)``, off-diagonal ``softplus(r)``."""
    eye = torch.eye(a.shape[1], dtype=torch.bool, device=a.device)
    weight = torch.where(eye, torch.diag_embed(a.exp()), F.softplus(r))
    return weight, F.softplus(b)


class _OrderKeeping(Calibrator):
    """Shared fit and forward of :class:`ArgmaxKeepingScaling` and :class:`OrderKeepingScaling`.

    Buffers ``weight`` ``(K, K-1, K-1)`` (identity matrices until fitted) and ``bias``
    ``(K, K-1)`` (zeros).

    Args:
        num_classes: K >= 2.
        max_iter: L-BFGS iterations of the fit (each about one pass over validation).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape and dtype.
    """

    changes_argmax = False
    mode = "argmax"

    weight: Tensor
    bias: Tensor

    def __init__(self, num_classes: int, max_iter: int = 100) -> None:
        check_int("max_iter", max_iter)
        super().__init__(num_classes, max_iter=max_iter)
        k = num_classes
        self.register_buffer("weight", torch.eye(k - 1).repeat(k, 1, 1))
        self.register_buffer("bias", torch.zeros(k, k - 1))

    def _expert_counts(self, batches: Batches, ignore_index: int) -> Tensor:
        counts = torch.zeros(self.num_classes, dtype=torch.int64, device=self.weight.device)
        for logits, target, _ in iterate(batches):
            rows, _ = valid_rows(logits, target, ignore_index)
            counts += torch.bincount(rows.argmax(dim=1), minlength=self.num_classes).to(counts)
        all_reduce_sum_([counts])
        return counts

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Minimise the mean validation NLL over ``(B_c, mu_c)`` of every expert."""
        k, device = self.num_classes, self.weight.device
        counts = self._expert_counts(batches, ignore_index)
        f64 = dict(dtype=torch.float64, device=device)
        a = torch.zeros(k, k - 1, **f64).requires_grad_(True)
        r = torch.full((k, k - 1, k - 1), RAW_FLOOR, **f64).requires_grad_(True)
        b = torch.full((k, k - 1), RAW_FLOOR, **f64).requires_grad_(True)
        mode = self.mode

        def nll(rows: Tensor, labels: Tensor) -> Tensor:
            weight, bias = _effective(a, r, b)
            z = order_keeping_logits(rows, weight, bias, mode)
            return (torch.logsumexp(z, dim=1) - z.gather(1, labels[:, None]).squeeze(1)).sum()

        info = lbfgs_fit([a, r, b], nll, None, batches, ignore_index, self.params["max_iter"])
        with torch.no_grad():
            weight, bias = _effective(a, r, b)
            empty = counts == 0
            weight[empty] = torch.eye(k - 1, **f64)
            bias[empty] = 0.0
        self.weight.copy_(weight)
        self.bias.copy_(bias)
        info["expert_pixels"] = counts.tolist()
        self.fit_info = info
        return info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self.check_input(logits, image)
        k = self.num_classes
        work = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        rows = work.movedim(1, -1).reshape(-1, k)
        out = order_keeping_logits(rows, self.weight.to(rows.dtype), self.bias.to(rows.dtype),
                                   self.mode)
        shape = (logits.shape[0], *logits.shape[2:], k)
        return out.reshape(shape).movedim(-1, 1).to(logits.dtype)


class ArgmaxKeepingScaling(_OrderKeeping):
    """``cms_ap``: class-conditional affine map on the gaps to the top class; keeps the argmax
    (module docstring)."""

    name = "cms_ap"
    mode = "argmax"


class OrderKeepingScaling(_OrderKeeping):
    """``cms_op``: class-conditional affine map on the gaps between consecutive ranks; keeps
    the whole class order (module docstring)."""

    name = "cms_op"
    mode = "order"
