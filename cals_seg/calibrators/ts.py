"""``ts``: one temperature for every logit (Guo et al., ICML 2017), the toolkit's one temperature
scaling: the calibrator and its fit.

One scalar ``T > 0`` divides every logit, ``forward(l) = l / T`` (the argmax is unchanged); it is
chosen on the validation set to minimise the pixel-level negative log-likelihood over valid
positions (``target != ignore_index``)::

    NLL(T) = sum_{i in V} [ logsumexp_k(l_ik / T) - l_{i,y_i} / T ]

``NLL`` is convex in ``beta = 1 / T`` (a log-sum-exp of linear functions minus a linear function),
hence unimodal in ``log T``: a grid minimum brackets the true minimum between its two neighbours
(:mod:`cals_seg.calibrators._grid`).

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
    calibrated = torch.nn.Sequential(model, TemperatureScaling.fixed(T))

:class:`TemperatureScaling` is the registered ``ts`` calibrator (fitted by
:func:`fit_temperature`, three passes); :meth:`TemperatureScaling.fixed` builds it from a known
``T`` for any number of classes (``nn.Sequential(model, TemperatureScaling.fixed(T))`` is the
calibrated model). ``TemperatureScaler(T)``, the older name of that, is a deprecated alias.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    check_finite_nll,
    check_positions,
    check_same_data,
    iterate,
    valid_rows,
)
from cals_seg.calibrators._grid import grid_nll, parabola_vertex
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.utils.distributed import all_reduce_sum_
from cals_seg.utils.validation import check_int, check_positive_float

# What fit_temperature streams: a zero-argument callable returning (logits, target) batches.
PairBatches = Callable[[], Iterable[tuple[Tensor, Tensor]]]


@torch.no_grad()
def _sweep(batches: PairBatches, temperatures: Tensor, ignore_index: int) -> tuple[Tensor, int]:
    """One pass over ``batches()``: summed NLL at every temperature and the valid count.

    Shape:
        temperatures: ``(G,)`` float64; returns a ``(G,)`` float64 CPU tensor and an int.
    """
    inv_t = 1.0 / temperatures
    total: Tensor | None = None
    count: Tensor | None = None
    for logits, target in batches():
        rows, labels = valid_rows(logits, target, ignore_index)
        if total is None:
            total = torch.zeros_like(inv_t, device=rows.device)
            count = torch.zeros((), dtype=torch.int64, device=rows.device)
        if labels.numel():
            total += grid_nll(rows, labels, inv_t.to(rows.device))
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


# Not split (over 80 lines): most of it is the docstring; the code is 42 lines of one algorithm.
def fit_temperature(
    batches: PairBatches,
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
            check_positions(count, ignore_index)
        first_count = check_same_data(first_count, count)
        check_finite_nll(nll)
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
        log_best = parabola_vertex([float(log_t[i]) for i in idx], [float(nll[i]) for i in idx])
    return math.exp(log_best)


def nll_at_temperature(batches: PairBatches, temperature: float, ignore_index: int = -100) -> float:
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
    check_positions(count, ignore_index)
    return float(total[0]) / count


@CALIBRATORS.register("ts")
class TemperatureScaling(Calibrator):
    """One temperature ``T`` (buffer ``temperature``, 1.0 until fitted).

    ``T`` is a buffer (saved in ``state_dict``, moved by ``.to``), not a parameter: :meth:`fit`
    sets it from the validation NLL, not the optimiser.

    Args:
        num_classes: K >= 2 (None: any K, as :meth:`fixed` builds it).

    Shape:
        - logits: ``(N, K, *S)`` -> same shape.
    """

    name = "ts"
    changes_argmax = False

    temperature: Tensor

    def __init__(self, num_classes: int | None) -> None:
        super().__init__(num_classes)
        self.register_buffer("temperature", torch.tensor(1.0))

    @classmethod
    def fixed(cls, temperature: float = 1.0) -> TemperatureScaling:
        """The calibrator with a given temperature, for any number of classes:
        ``forward(l) = l / T`` (argmax unchanged).

        Args:
            temperature: ``T > 0``, finite.

        Raises:
            ValueError: ``T`` not a finite number > 0.
        """
        check_positive_float("temperature", temperature)
        scaler = cls(None)
        scaler.temperature.fill_(float(temperature))
        return scaler

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Fit ``T`` on the validation NLL (three passes over ``batches``)."""
        t = fit_temperature(lambda: ((l, y) for l, y, _ in iterate(batches)), ignore_index)
        self.temperature.fill_(t)
        self.fit_info = {"temperature": t, "passes": 3}
        return self.fit_info

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        if self.num_classes is not None:  # a fixed temperature divides any tensor
            self.check_input(logits, image)
        return logits / self.temperature.to(logits.dtype)

    def extra_repr(self) -> str:
        if self.num_classes is None:
            return f"temperature={float(self.temperature):.4f}"
        return super().extra_repr()


class TemperatureScaler(TemperatureScaling):
    """Deprecated alias of :meth:`TemperatureScaling.fixed` (``TemperatureScaler(T)`` is
    ``TemperatureScaling.fixed(T)``); it will be removed in the next release.

    Args:
        temperature: ``T > 0``, finite.

    Shape:
        logits: ``(N, K, *S)`` -> same shape.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        warnings.warn("TemperatureScaler(T) is deprecated; use TemperatureScaling.fixed(T) "
                      "(the same module).", DeprecationWarning, stacklevel=2)
        check_positive_float("temperature", temperature)
        super().__init__(None)
        self.temperature.fill_(float(temperature))


__all__ = ["TemperatureScaler", "TemperatureScaling", "fit_temperature", "nll_at_temperature"]
