"""Post-hoc temperature scaling (Guo et al., ICML 2017), fitted with bounded memory.

One scalar ``T > 0`` divides every logit; it is chosen on the validation set to minimise the
pixel-level negative log-likelihood over valid positions (``target != ignore_index``)::

    NLL(T) = sum_{i in V} [ logsumexp_k(l_ik / T) - l_{i,y_i} / T ]

``NLL`` is convex in ``beta = 1 / T`` (a log-sum-exp of linear functions minus a linear function),
hence unimodal in ``log T``: a grid minimum brackets the true minimum between its two neighbours.

The validation logits are never cached. :func:`fit_temperature` takes a zero-argument callable
that re-runs the model and yields ``(logits, target)`` batches; each call is one sweep
("pass") over the validation set. Every pass evaluates a whole grid of temperatures at once, so
the state is ``O(num_grid)`` float64 sums whatever the number of pixels, and the cost is
``passes`` forward sweeps of the model plus ``passes * num_grid`` softmax-normalisers per valid
position. Under DDP the per-pass sums are all-reduced, so every rank fits the same ``T`` from
its own shard of the validation set.

Typical use::

    def val_batches():
        for x, y in val_loader:
            yield model(x.to(device)), y.to(device)

    T = fit_temperature(val_batches, ignore_index=255)
    calibrated = torch.nn.Sequential(model, TemperatureScaler(T))

The module that applies ``T`` is the ``ts`` calibrator (:mod:`cals_seg.calibrators.ts`;
``TemperatureScaler(T)`` builds it from a known ``T``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int

Batches = Callable[[], Iterable[tuple[Tensor, Tensor]]]

# Work tensors hold at most this many float64 elements (32 MiB): chunks of positions are sized so
# that (grid temperatures) x (positions) x (classes) stays below it.
_CHUNK_ELEMENTS = 2**22


def _valid_rows(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Flatten one batch to ``(P, K)`` logits and ``(P,)`` targets of its valid positions.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``; returns ``(P, K)`` and ``(P,)`` with ``P``
        the number of positions whose target is not ``ignore_index``.
    """
    if logits.dim() < 2:
        raise ValueError(
            f"Expected `logits` of shape (N, K, *S), but got shape {tuple(logits.shape)}."
        )
    expected = (logits.shape[0], *logits.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(
            f"Expected `target` of shape {expected} to match `logits` {tuple(logits.shape)}, "
            f"but got {tuple(target.shape)}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"Expected floating-point `logits`, but got {logits.dtype}.")
    k = logits.shape[1]
    rows = logits.detach().movedim(1, -1).reshape(-1, k)
    labels = target.detach().reshape(-1).to(device=rows.device, dtype=torch.long)
    valid = labels != ignore_index
    rows, labels = rows[valid], labels[valid]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= k):
        raise ValueError(
            f"Expected valid `target` values in [0, {k}), but got values in "
            f"[{int(labels.min())}, {int(labels.max())}] (ignore_index={ignore_index})."
        )
    return rows, labels


def _grid_nll(rows: Tensor, labels: Tensor, inv_t: Tensor) -> Tensor:
    """Summed NLL of ``softmax(rows / T)`` for every temperature of a grid, in float64.

    ``NLL_g = sum_i logsumexp_k(rows_ik * inv_t_g) - inv_t_g * rows_{i, labels_i}``, computed
    over chunks of positions so that the ``(G, chunk, K)`` work tensor stays bounded.

    Shape:
        rows: ``(P, K)``; labels: ``(P,)``; inv_t: ``(G,)`` float64 (``1 / T``); returns ``(G,)``.
    """
    g, k = inv_t.numel(), rows.shape[1]
    out = torch.zeros(g, dtype=torch.float64, device=rows.device)
    step = max(1, _CHUNK_ELEMENTS // (g * k))
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


@torch.no_grad()
def _sweep(batches: Batches, temperatures: Tensor, ignore_index: int) -> tuple[Tensor, int]:
    """One pass over ``batches()``: summed NLL at every temperature and the valid count.

    Shape:
        temperatures: ``(G,)`` float64; returns a ``(G,)`` float64 CPU tensor and an int.
    """
    inv_t = 1.0 / temperatures
    total: Tensor | None = None
    count: Tensor | None = None
    for logits, target in batches():
        rows, labels = _valid_rows(logits, target, ignore_index)
        if total is None:
            total = torch.zeros_like(inv_t, device=rows.device)
            count = torch.zeros((), dtype=torch.int64, device=rows.device)
        if labels.numel():
            total += _grid_nll(rows, labels, inv_t.to(rows.device))
            count += labels.numel()
    if total is None:  # no batch on this rank; still take part in the all-reduce
        total = torch.zeros_like(inv_t)
        count = torch.zeros((), dtype=torch.int64)
    all_reduce_sum_([total, count])
    return total.cpu(), int(count)


def _check_fit_args(t_min: float, t_max: float, num_grid: int, passes: int) -> None:
    if not (t_min > 0 and math.isfinite(t_min)):
        raise ValueError(f"Expected `t_min` to be a positive finite float, but got {t_min}.")
    if not (t_max > t_min and math.isfinite(t_max)):
        raise ValueError(f"Expected `t_max` to be finite and > t_min={t_min}, but got {t_max}.")
    check_int("num_grid", num_grid, 3)
    check_int("passes", passes)


def _parabola_vertex(x: list[float], f: list[float]) -> float:
    """Abscissa of the parabola through three points, or ``x[1]`` when it is not a minimum.

    ``x0 < x1 < x2`` with ``f1 <= f0, f2``; the result is clamped to ``[x0, x2]``.
    """
    (x0, x1, x2), (f0, f1, f2) = x, f
    num = (x1 - x0) ** 2 * (f1 - f2) - (x1 - x2) ** 2 * (f1 - f0)
    den = (x1 - x0) * (f1 - f2) - (x1 - x2) * (f1 - f0)
    if not den < 0:  # collinear or concave (flat within rounding): keep the grid point
        return x1
    return min(max(x1 - 0.5 * num / den, x0), x2)


# Not split (over 80 lines): most of it is the docstring; the code is 42 lines of one algorithm.
def fit_temperature(
    batches: Batches,
    ignore_index: int = -100,
    t_min: float = 0.05,
    t_max: float = 20.0,
    num_grid: int = 33,
    passes: int = 3,
) -> float:
    """Fit the temperature that minimises the validation NLL, streaming over the data.

    Pass 1 evaluates the summed NLL (float64) at ``num_grid`` log-spaced temperatures in
    ``[t_min, t_max]``. Each later pass evaluates ``num_grid`` log-spaced temperatures over the
    bracket formed by the best point's two grid neighbours (valid because the NLL is unimodal in
    ``log T``), shrinking the bracket by a factor ``(num_grid - 1) / 2`` per pass. A parabola in
    ``log T`` through the final best point and its neighbours gives the result, clamped to the
    bracket. With the defaults the last grid spacing is about ``7e-4`` in ``log T``; the
    parabolic step makes the result far more precise than that.

    Cost: exactly ``passes`` calls of ``batches`` (each a forward sweep of the model) and
    ``passes * num_grid`` log-sum-exps over ``K`` per valid position, in float64. Memory: the
    current batch plus ``O(num_grid)`` sums; work tensors are chunked to 32 MiB.

    The whole fit runs under ``torch.no_grad()``, so a generator that calls the model inside
    ``batches()`` builds no autograd graph.

    Args:
        batches: zero-argument callable returning a *fresh* iterable of ``(logits, target)``
            batches over the same validation data each time it is called.
        ignore_index: target value of void positions, excluded from the NLL.
        t_min: smallest temperature searched (> 0).
        t_max: largest temperature searched (> t_min).
        num_grid: temperatures evaluated per pass (>= 3; odd keeps the previous best on the grid).
        passes: sweeps over the data (>= 1).

    Returns:
        The fitted temperature. If the minimum lies at ``t_min`` or ``t_max`` the boundary is
        returned with a warning (e.g. a model that is right everywhere wants ``T -> 0``). If the
        NLL does not depend on ``T`` at all (all logits of every position equal), 1.0.

    Raises:
        ValueError: on invalid arguments, mismatched shapes, targets outside ``[0, K)``, no valid
            position at all, non-finite logits, or a callable that yields different data on
            different calls (e.g. it returns an already exhausted generator).

    Shape:
        logits: ``(N, K, *S)`` (``(N, K)`` for classification); target: ``(N, *S)`` integer.
    """
    _check_fit_args(t_min, t_max, num_grid, passes)
    lo, hi = math.log(t_min), math.log(t_max)
    first_count = None
    for p in range(passes):
        log_t = torch.linspace(lo, hi, num_grid, dtype=torch.float64)
        nll, count = _sweep(batches, log_t.exp(), ignore_index)
        if first_count is None:
            if count == 0:
                raise ValueError(
                    "Expected at least one valid position (target != ignore_index="
                    f"{ignore_index}), but `batches()` yielded none."
                )
            first_count = count
        elif count != first_count:
            raise ValueError(
                f"Expected `batches()` to yield the same data on every call, but pass {p + 1} "
                f"saw {count} valid positions and pass 1 saw {first_count}. It must return a "
                "fresh iterable each time (not an exhausted generator)."
            )
        if not bool(torch.isfinite(nll).all()):
            raise ValueError("The NLL is not finite: `logits` contain NaN or infinite values.")
        if p == 0 and float(nll.max() - nll.min()) == 0.0:
            return 1.0  # every position has equal logits: any temperature is optimal
        best = int(nll.argmin())
        left, right = max(best - 1, 0), min(best + 1, num_grid - 1)
        lo, hi = float(log_t[left]), float(log_t[right])

    log_best = float(log_t[best])
    at_bound = (best == 0 and log_best <= math.log(t_min) + 1e-9) or (
        best == num_grid - 1 and log_best >= math.log(t_max) - 1e-9
    )
    if at_bound:
        warnings.warn(
            f"The validation NLL is minimal at the search boundary T={math.exp(log_best):.4g}; "
            f"the optimum may lie outside [t_min={t_min}, t_max={t_max}].",
            stacklevel=2,
        )
        return math.exp(log_best)
    if 0 < best < num_grid - 1:
        idx = [best - 1, best, best + 1]
        log_best = _parabola_vertex([float(log_t[i]) for i in idx], [float(nll[i]) for i in idx])
    return math.exp(log_best)


def nll_at_temperature(batches: Batches, temperature: float, ignore_index: int = -100) -> float:
    """Mean NLL of ``softmax(logits / temperature)`` over all valid positions, streaming.

    ``NLL = (1 / |V|) sum_{i in V} [logsumexp_k(l_ik / T) - l_{i,y_i} / T]``, accumulated in
    float64 over one call of ``batches`` (all-reduced under DDP).

    Args:
        batches: zero-argument callable returning an iterable of ``(logits, target)``.
        temperature: ``T > 0``.
        ignore_index: target value of void positions.

    Returns:
        The mean NLL over valid positions.

    Raises:
        ValueError: if ``temperature <= 0``, shapes mismatch, or there is no valid position.

    Shape:
        logits: ``(N, K, *S)``; target: ``(N, *S)``.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(
            f"Expected `temperature` to be a positive finite float, but got {temperature}."
        )
    total, count = _sweep(
        batches, torch.tensor([float(temperature)], dtype=torch.float64), ignore_index
    )
    if count == 0:
        raise ValueError(
            f"Expected at least one valid position (target != ignore_index={ignore_index}), "
            "but `batches()` yielded none."
        )
    return float(total[0]) / count
