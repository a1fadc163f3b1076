"""``margin: auto``: the margin of CALS-ALM / CALS-HR steered by the validation calibration.

A margin ``m`` bounds every logit gap ``d_ik <= m``; once the constraint holds, the top-label
confidence is at most ``cap(m) = 1 / (1 + (K - 1) e^-m)``. Shrinking ``m`` by a factor ``1/T``
therefore acts on the network like temperature scaling by ``T`` acts on its logits. The rule is
a feedback loop on that analogy, run after each validation pass (docs/design.md, "margin:
auto")::

    m_eff(i) = log(K - 1) - log sum_{k != top} exp(l_ik - l_i,top)   # cap(m_eff(i)) = conf(i)
    T_hat    = the T > 0 with  mean_i cap(m_eff(i) / T) = accuracy   # validation, valid pixels
    m        <- clip(m / T_hat, margin_min, margin_max)               # after margin_warmup epochs

``m_eff`` is the margin that would give pixel ``i``'s confidence if all its gaps were equal, so
``cap(m_eff / T)`` is its confidence with every gap scaled by ``1/T`` (exact when the
non-top logits are equal, an approximation otherwise). ``T_hat > 1`` means the validation
pixels are over-confident on average: the margin shrinks. ``T_hat < 1`` means under-confident:
it grows, up to ``margin_max`` where the penalty is inert, so a network that is not
over-confident is left alone. The statistics are a histogram of ``m_eff`` (bins of
:data:`BIN_WIDTH`, the last one open) and a count of correct pixels: O(bins) float64 sums, so the
rule is exact under torch.distributed (sums all-reduced before the solve) and deterministic.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._functional import blocks

BIN_WIDTH = 0.05  # nats of m_eff per histogram bin
NUM_BINS = 800  # covers m_eff in [0, 40); larger values fall in the last bin
T_RANGE = (1.0 / 16.0, 16.0)  # the solve is clipped to this range of temperatures


def _bin(values: Tensor) -> Tensor:
    return (values / BIN_WIDTH).floor_().clamp_(0, NUM_BINS - 1).long()


def effective_margin_sums(
    logits: Tensor, target: Tensor, valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Histograms of ``m_eff`` and of the largest gap ``max_k d_ik``, and the number of correct
    top-1 predictions, over valid positions.

    Args:
        logits: ``(N, K, S)`` float32 or float64.
        target: ``(N, S)`` int64 (void positions may hold any value).
        valid: ``(N, S)`` bool.

    Returns:
        ``hist (NUM_BINS,)``, ``gap_hist (NUM_BINS,)`` float64 counts and ``correct ()``
        float64.
    """
    k = logits.shape[1]
    hist = torch.zeros(NUM_BINS, dtype=torch.float64, device=logits.device)
    gap_hist = torch.zeros(NUM_BINS, dtype=torch.float64, device=logits.device)
    correct = torch.zeros((), dtype=torch.float64, device=logits.device)
    log_others = math.log(k - 1)
    for im, pos in blocks(logits):
        x = logits[im, :, pos]  # (n, K, s)
        ok = valid[im, pos]
        mx, top = x.max(dim=1, keepdim=True)
        others = (x - mx).scatter_(1, top, float("-inf"))
        m_eff = log_others - torch.logsumexp(others, dim=1)  # (n, s), >= 0 up to rounding
        largest = mx.squeeze(1) - x.amin(dim=1)
        hist += torch.bincount(_bin(m_eff[ok]), minlength=NUM_BINS).to(torch.float64)
        gap_hist += torch.bincount(_bin(largest[ok]), minlength=NUM_BINS).to(torch.float64)
        correct += (top.squeeze(1) == target[im, pos])[ok].sum().to(torch.float64)
    return hist, gap_hist, correct


def largest_gap_bound(gap_hist: Tensor) -> float:
    """An upper bound of the largest validation gap: the right edge of the highest non-empty
    bin of ``gap_hist``. A margin at or above it binds on no validation pixel (inert)."""
    nonzero = torch.nonzero(gap_hist).flatten()
    return float(int(nonzero[-1]) + 1) * BIN_WIDTH if len(nonzero) else 0.0


def confidence_cap(margin: Tensor | float, num_classes: int) -> Tensor:
    """``1 / (1 + (K - 1) e^-m)``: the largest top-label confidence with every gap ``<= m``."""
    m = torch.as_tensor(margin, dtype=torch.float64)
    return torch.sigmoid(m - math.log(num_classes - 1))


def mean_confidence(hist: Tensor, num_classes: int, temperature: float) -> float:
    """``mean_i cap(m_eff(i) / T)`` from the histogram (bin centres; the open last bin at its
    left edge)."""
    centres = (torch.arange(NUM_BINS, dtype=torch.float64, device=hist.device) + 0.5) * BIN_WIDTH
    centres[-1] = (NUM_BINS - 1) * BIN_WIDTH
    conf = confidence_cap(centres / temperature, num_classes)
    return float((hist * conf).sum() / hist.sum())


def solve_temperature(hist: Tensor, correct: float, num_classes: int) -> float:
    """The ``T`` in :data:`T_RANGE` with ``mean_confidence(T) = accuracy`` (bisection on
    ``log T``; ``mean_confidence`` decreases in ``T``), clipped to the range's ends."""
    n = float(hist.sum())
    if n <= 0:
        raise ValueError("solve_temperature: the histogram is empty")
    accuracy = correct / n
    lo, hi = math.log(T_RANGE[0]), math.log(T_RANGE[1])
    if mean_confidence(hist, num_classes, math.exp(lo)) <= accuracy:
        return T_RANGE[0]
    if mean_confidence(hist, num_classes, math.exp(hi)) >= accuracy:
        return T_RANGE[1]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if mean_confidence(hist, num_classes, math.exp(mid)) > accuracy:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))
