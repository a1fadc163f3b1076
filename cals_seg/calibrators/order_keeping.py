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

Fit: temperature scaling is the special case ``B_c = I / T, mu_c = 0`` (``out = (l - l_c) /
T``), and the fit never ends worse than it on held-out validation images:

1. ``T``: the ``ts`` fit on all validation images (:func:`fit_temperature`, 3 passes);
2. the coefficients are written relative to it, ``B_c,jj = exp(a_cj) / T``, ``B_c,ij =
   softplus(r_cij) / T`` (i != j) and ``mu_cj = softplus(b_cj)``, and fitted on the validation
   images not held out (image ``j`` in loader order is held out when ``j % holdout_every ==
   holdout_every - 1``) by minimising::

       mean NLL(fit images) + lam / K * (sum_cj log(T B_c,jj)^2 + sum_{c, i != j} (T B_c,ij)^2
                                         + sum_cj mu_cj^2)

   (an L2 pull towards TS, where all three sums vanish) for each ``lam`` of ``lams`` in turn,
   strongest first, each stage started where the previous ended (full-batch L-BFGS in float64,
   at most ``max_iter`` iterations per stage, one streaming pass over the validation batches
   per objective evaluation, all-reduced under DDP). The first stage starts at ``a = 0``,
   ``r = b = 0`` (``softplus(0) = log 2``: a start at TS itself, ``r, b -> -inf``, would leave
   them without gradient);
3. TS is scored on the held-out images in the counting pass, and every objective evaluation
   also scores the held-out images (same pass, no gradient); the calibrator keeps the
   coefficients with the lowest held-out mean NLL, TS's included, so the held-out NLL is at
   most TS's by construction. The stages stop after the first one (past the first) that did
   not lower the best held-out NLL.

With ``holdout_every=0`` nothing is held out: the last iterate of the last stage is kept
(``lams=(0,), holdout_every=0`` is the authors' unregularised fit). An expert without
fitting pixels feels only the penalty and tends to TS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    accumulate_nll,
    check_finite_nll,
    check_same_data,
    iterate,
    lbfgs_stages,
    summed_nll,
    valid_rows,
    with_holdout,
)
from cals_seg.calibrators._export import ExpertAffine
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.errors import UserError
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int

MODES = ("argmax", "order")
LAMS = (1.0, 0.1, 0.01, 0.001)


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


def effective(a: Tensor, r: Tensor, b: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``(B, mu)`` from the raw parameters (module docstring): ``B = (diag exp(a) +
    offdiag softplus(r)) / T``, ``mu = softplus(b)``.

    Shape:
        - a: ``(K, K-1)``; r: ``(K, K-1, K-1)`` (its diagonal unused); b: ``(K, K-1)``.
    """
    eye = torch.eye(a.shape[1], dtype=torch.bool, device=a.device)
    weight = torch.where(eye, torch.diag_embed(a.exp()), F.softplus(r)) / temperature
    return weight, F.softplus(b)


def penalty(a: Tensor, r: Tensor, b: Tensor, lam: float) -> Tensor:
    """``lam / K * (sum a^2 + sum_{i != j} softplus(r)^2 + sum softplus(b)^2)``: the pull
    towards TS (module docstring)."""
    eye = torch.eye(a.shape[1], dtype=torch.bool, device=a.device)
    off = torch.where(eye, torch.zeros_like(r), F.softplus(r))
    return lam / a.shape[0] * (a.pow(2).sum() + off.pow(2).sum() + F.softplus(b).pow(2).sum())


class _OrderKeeping(Calibrator):
    """Shared fit and forward of :class:`ArgmaxKeepingScaling` and :class:`OrderKeepingScaling`.

    Buffers ``weight`` ``(K, K-1, K-1)`` (identity matrices until fitted) and ``bias``
    ``(K, K-1)`` (zeros): the effective ``B_c`` and ``mu_c``.

    Args:
        num_classes: K >= 2.
        max_iter: L-BFGS iterations per ``lam`` stage (each about one pass over validation).
        lams: the strengths of the pull towards TS, tried in turn (each >= 0).
        holdout_every: one validation image in ``holdout_every`` picks the coefficients (>= 2;
            0: none held out, the last iterate is kept).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape and dtype.
    """

    changes_argmax = False
    mode = "argmax"

    weight: Tensor
    bias: Tensor

    def __init__(self, num_classes: int, max_iter: int = 20,
                 lams: Sequence[float] = LAMS, holdout_every: int = 5) -> None:
        check_int("max_iter", max_iter)
        lams = [float(v) for v in lams] if isinstance(lams, list | tuple) else lams
        if not isinstance(lams, list) or not lams or not all(
                math.isfinite(v) and v >= 0 for v in lams):
            raise UserError(f"Expected `lams` to be a non-empty list of numbers >= 0, but got "
                            f"{lams!r}.")
        if holdout_every != 0:
            check_int("holdout_every", holdout_every, 2)
        super().__init__(num_classes, max_iter=max_iter, lams=lams, holdout_every=holdout_every)
        k = num_classes
        self.register_buffer("weight", torch.eye(k - 1).repeat(k, 1, 1))
        self.register_buffer("bias", torch.zeros(k, k - 1))

    def _count_and_score_ts(self, batches: Batches, ignore_index: int,
                            temperature: float) -> tuple[Tensor, float | None]:
        """Valid pixels per expert (all images), and TS's mean NLL on the held-out images."""
        every = self.params["holdout_every"]
        counts = torch.zeros(self.num_classes, dtype=torch.int64, device=self.weight.device)
        held_sum = torch.zeros(2, dtype=torch.float64, device=self.weight.device)
        for logits, target, _, held in with_holdout(batches, every):
            rows, _ = valid_rows(logits, target, ignore_index)
            counts += torch.bincount(rows.argmax(dim=1), minlength=self.num_classes).to(counts)
            if bool(held.any()):  # never without held-out images (every = 0)
                rows, labels = valid_rows(logits[held], target[held], ignore_index)
                z = rows.to(torch.float64) / temperature
                held_sum[0] += summed_nll(z, labels).to(held_sum)
                held_sum[1] += labels.numel()
        all_reduce_sum_([counts, held_sum])
        score = float(held_sum[0] / held_sum[1]) if every and int(held_sum[1]) else None
        return counts, score

    # Not split (over 80 lines): one algorithm, most of it the closure of the L-BFGS passes.
    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Start at TS, pull towards it with each ``lam`` in turn, keep the coefficients with
        the best held-out NLL (module docstring)."""
        k, device = self.num_classes, self.weight.device
        every = self.params["holdout_every"]
        temp = fit_temperature(lambda: ((lg, y) for lg, y, _ in iterate(batches)), ignore_index)
        counts, ts_heldout = self._count_and_score_ts(batches, ignore_index, temp)
        f64 = dict(dtype=torch.float64, device=device)
        a = torch.zeros(k, k - 1, **f64).requires_grad_(True)
        r = torch.zeros(k, k - 1, k - 1, **f64).requires_grad_(True)
        b = torch.zeros(k, k - 1, **f64).requires_grad_(True)
        params, mode = [a, r, b], self.mode

        def nll(rows: Tensor, labels: Tensor) -> Tensor:
            weight, bias = effective(a, r, b, temp)
            return summed_nll(order_keeping_logits(rows, weight, bias, mode), labels)

        with torch.no_grad():  # TS: the candidate of evaluation 0
            ts_coef = (torch.eye(k - 1, **f64).repeat(k, 1, 1) / temp, torch.zeros(k, k - 1, **f64))
        state: dict[str, Any] = {"passes": 0, "lam": None, "evaluation": 0, "fit_nll": None,
                                 "best": ts_heldout if every else math.inf, "coef": ts_coef,
                                 "trace": [ts_heldout] if every else []}

        def closure(lam: float) -> Tensor:
            for p in params:
                p.grad = None
            sums = torch.zeros(4, dtype=torch.float64, device=device)  # fit nll, n, held, n
            for logits, target, _, held in with_holdout(batches, every):
                for part, mask in ((0, ~held), (2, held)):
                    if not bool(mask.any()):
                        continue
                    rows, labels = valid_rows(logits[mask], target[mask], ignore_index)
                    accumulate_nll(sums[part], rows, labels, nll, device, backward=part == 0)
                    sums[part + 1] += labels.numel()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            all_reduce_sum_([sums, *grads])
            n_fit, n_held = int(sums[1]), int(sums[3])
            if n_fit == 0 or (every and n_held == 0):
                raise ValueError(
                    f"Expected valid positions (target != ignore_index={ignore_index}) in both "
                    f"the fitting and the held-out validation images (one in {every} held "
                    "out), but one part has none; lower `holdout_every` (0: none held out).")
            state["positions"] = check_same_data(state.get("positions"), (n_fit, n_held))
            for p, g in zip(params, grads, strict=True):
                p.grad = g / n_fit
            with torch.enable_grad():
                reg = penalty(a, r, b, lam)
                reg.backward()
            objective = sums[0] / n_fit + reg.detach()
            check_finite_nll(float(objective))
            state["passes"] += 1
            score = float(sums[2] / n_held) if every else -state["passes"]  # none held: last
            state["trace"].append(score if every else float(sums[0] / n_fit))
            if score < state["best"]:  # ties: the earlier (TS first)
                with torch.no_grad():
                    coef = tuple(c.detach().clone() for c in effective(a, r, b, temp))
                state.update(best=score, lam=lam, evaluation=state["passes"],
                             fit_nll=float(sums[0] / n_fit), coef=coef)
            return objective

        with torch.enable_grad():  # the caller may be under no_grad (an evaluation)
            stages = lbfgs_stages(params, closure, self.params["lams"], self.params["max_iter"],
                                  lambda: state["best"], early_stop=bool(every))
        weight, bias = state["coef"]
        self.weight.copy_(weight)
        self.bias.copy_(bias)
        info = {"temperature": temp, "lam": state["lam"], "evaluation": state["evaluation"],
                "fit_nll": state["fit_nll"], "passes": state["passes"] + 4, "stages": stages,
                "expert_pixels": counts.tolist(),
                "positions": list(state["positions"])}
        if every:
            info.update(heldout=f"every {every}th validation image in loader order",
                        heldout_nll=state["best"], ts_heldout_nll=ts_heldout,
                        heldout_trace=state["trace"])
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

    def export_module(self, fmt: str = "pt2") -> torch.nn.Module:
        """The experts as a program for export
        (:class:`~cals_seg.calibrators._export.ExpertAffine`; the classes ranked by ``topk``
        in ONNX, which has no stable sort)."""
        return ExpertAffine(self.weight, self.bias, self.mode, topk=fmt == "onnx")


@CALIBRATORS.register("cms_ap")
class ArgmaxKeepingScaling(_OrderKeeping):
    """``cms_ap``: class-conditional affine map on the gaps to the top class; keeps the argmax
    (module docstring)."""

    name = "cms_ap"
    mode = "argmax"


@CALIBRATORS.register("cms_op")
class OrderKeepingScaling(_OrderKeeping):
    """``cms_op``: class-conditional affine map on the gaps between consecutive ranks; keeps
    the whole class order (module docstring)."""

    name = "cms_op"
    mode = "order"
