"""The streaming grid search of the temperature calibrators (``ts``, ``boundary_ts``,
``boundary_ts_conf``, ``selective``'s ``T_mis``): the NLL of a set of positions at a whole grid of
temperatures at once, and the refinement of one grid per group of positions.

For the positions ``V`` of one group, ``NLL(T) = sum_{i in V} [logsumexp_k(l_ik / T) -
l_{i,y_i} / T]`` is convex in ``beta = 1 / T``, hence unimodal in ``log T``: a grid minimum
brackets the true minimum between its two neighbours, and a parabola in ``log T`` through the
best point and its neighbours gives the result. This module imports no calibrator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from cals_seg.calibrators._base import check_finite_nll, check_positions, check_same_data

# Work tensors hold at most this many float64 elements (32 MiB): chunks of positions are sized so
# that (grid temperatures) x (positions) x (classes) stays below it.
CHUNK_ELEMENTS = 2**22


def grid_nll(rows: Tensor, labels: Tensor, inv_t: Tensor) -> Tensor:
    """Summed NLL of ``softmax(rows / T)`` for every temperature of a grid, in float64.

    ``NLL_g = sum_i logsumexp_k(rows_ik * inv_t_g) - inv_t_g * rows_{i, labels_i}``, computed
    over chunks of positions so that the ``(G, chunk, K)`` work tensor stays bounded.

    Shape:
        rows: ``(P, K)``; labels: ``(P,)``; inv_t: ``(G,)`` float64 (``1 / T``); returns ``(G,)``.
    """
    g, k = inv_t.numel(), rows.shape[1]
    out = torch.zeros(g, dtype=torch.float64, device=rows.device)
    step = max(1, CHUNK_ELEMENTS // (g * k))
    scale = inv_t.view(g, 1, 1)
    for start in range(0, rows.shape[0], step):
        chunk = rows[start : start + step].to(torch.float64)
        # Shift each row by its max (the NLL is shift-invariant): then exp(l' / T) <= 1 cannot
        # overflow, the row sum is >= 1 (the max term), logsumexp(l' / T) lies in [0, log K] and
        # -l'_y / T >= 0, so nothing below cancels. (2x faster than torch.logsumexp here.)
        chunk = chunk - chunk.amax(dim=1, keepdim=True)
        true_logit = chunk.gather(1, labels[start : start + step, None]).squeeze(1)
        lse = (chunk.unsqueeze(0) * scale).exp_().sum(dim=2).log_()  # (G, chunk)
        out += (lse - inv_t[:, None] * true_logit[None, :]).sum(dim=1)
    return out


def parabola_vertex(x: list[float], f: list[float]) -> float:
    """Abscissa of the parabola through three points, or ``x[1]`` when it is not a minimum.

    ``x0 < x1 < x2`` with ``f1 <= f0, f2``; the result is clamped to ``[x0, x2]``.
    """
    (x0, x1, x2), (f0, f1, f2) = x, f
    num = (x1 - x0) ** 2 * (f1 - f2) - (x1 - x2) ** 2 * (f1 - f0)
    den = (x1 - x0) * (f1 - f2) - (x1 - x2) * (f1 - f0)
    if not den < 0:  # collinear or concave (flat within rounding): keep the grid point
        return x1
    return min(max(x1 - 0.5 * num / den, x0), x2)


def refine_grids(sweep: Callable[[Tensor], tuple[Tensor, Tensor]], groups: int, t_min: float,
                 t_max: float, num_grid: int, passes: int, ignore_index: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Grid refinement of one temperature per group, all groups in the same passes.

    Pass 1 evaluates every group at ``num_grid`` temperatures log-spaced in ``[t_min,
    t_max]``; each later pass evaluates ``num_grid`` log-spaced temperatures over the bracket
    formed by the group's best point and its two grid neighbours.

    Args:
        sweep: one pass over the validation batches, ``log_t (groups, num_grid) -> (summed NLL
            (groups, num_grid) float64, valid positions per group (groups,) int64)``,
            all-reduced.
        groups: the number of groups (bands, cells).

    Returns:
        ``(log_t, nll, best, count)`` of the last pass: the grids ``(groups, num_grid)``, their
        summed NLL, the index of each group's best point ``(groups,)`` and the counts.

    Raises:
        ValueError: no valid position, a pass that saw other data, a non-finite NLL.
    """
    lo = torch.full((groups,), math.log(t_min), dtype=torch.float64)
    hi = torch.full((groups,), math.log(t_max), dtype=torch.float64)
    steps = torch.linspace(0.0, 1.0, num_grid, dtype=torch.float64)
    idx = torch.arange(groups)
    first = None
    for _ in range(passes):
        log_t = lo[:, None] + (hi - lo)[:, None] * steps[None, :]
        nll, count = sweep(log_t)
        if first is None:
            check_positions(int(count.sum()), ignore_index)
        first = check_same_data(first, count)
        check_finite_nll(nll)
        best = nll.argmin(dim=1)
        lo = log_t[idx, (best - 1).clamp(min=0)]
        hi = log_t[idx, (best + 1).clamp(max=num_grid - 1)]
    return log_t, nll, best, count


def grid_optima(log_t: Tensor, nll: Tensor, best: Tensor) -> list[float]:
    """``log T`` of every group: its best grid point, moved to the vertex of the parabola
    through it and its neighbours when it is not at the end of its grid.

    Shape:
        - log_t, nll: ``(groups, G)``; best: ``(groups,)``; returns ``groups`` floats.
    """
    g = log_t.shape[1]
    out = []
    for i in range(log_t.shape[0]):
        b = int(best[i])
        x = float(log_t[i, b])
        if 0 < b < g - 1:
            x = parabola_vertex([float(log_t[i, j]) for j in (b - 1, b, b + 1)],
                                [float(nll[i, j]) for j in (b - 1, b, b + 1)])
        out.append(x)
    return out


__all__ = ["CHUNK_ELEMENTS", "grid_nll", "grid_optima", "parabola_vertex", "refine_grids"]
