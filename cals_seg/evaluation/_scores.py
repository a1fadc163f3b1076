"""Per-pixel conformal scores: LAC and randomised APS, and their exact threshold grid cells.

Used by :mod:`cals_seg.evaluation.conformal` (docs/conformal.md). A score is a number in
``[0, 1]`` per class, small when the class is plausible.
"""

from __future__ import annotations

import torch
from torch import Tensor

SCORES = ("lac", "aps")
GRID = 2**12
_MASK32 = 0xFFFFFFFF

# --------------------------------------------------------------------------------------------
# Scores.
# --------------------------------------------------------------------------------------------


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in ``[0, 2^32)`` without int64 overflow."""
    lo = (x * (c & 0xFFFF)) & _MASK32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mixer (xor-shift / multiply rounds) on int64 values in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def pixel_uniforms(probs: Tensor, seed: int = 0) -> Tensor:
    """A number in ``(0, 1)`` per pixel, a fixed function of the seed, the pixel's position
    and the bits of its probability vector (no random state).

    The same pixel gets the same number in any batch, on any process and in any order, so
    the randomised APS score is a deterministic function of the image and streaming / DDP
    results equal one-shot ones. Conformal validity needs the score to be the same function
    for calibration and test images, which a hash is; it does not need fresh randomness.

    Shape:
        - probs: ``(N, K, P)`` float32; returns ``(N, P)`` float64.
    """
    n, k, p = probs.shape
    bits = probs.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    pos = torch.arange(p, device=probs.device, dtype=torch.int64)
    x = _hash32(pos ^ ((seed * 0x9E3779B1) & _MASK32)).expand(n, p)
    for j in range(k):
        x = _hash32(x ^ bits[:, j])
    return (x.to(torch.float64) + 0.5) / 2.0**32


def lac_scores(probs: Tensor) -> Tensor:
    """LAC score ``s_k = 1 - p_k`` (Sadinle et al. 2019).

    Shape:
        - probs: ``(N, K, P)``; returns the same shape and dtype, in ``[0, 1]``.
    """
    return (1.0 - probs).clamp_(0.0, 1.0)


def aps_scores(probs: Tensor, u: Tensor) -> Tensor:
    """Randomised APS score (Romano et al. 2020): with the classes sorted by decreasing
    probability (ties by index), ``s_k = sum_{j ranked before k} p_j + u p_k``.

    Shape:
        - probs: ``(N, K, P)``; u: ``(N, P)`` in ``(0, 1)``; returns ``(N, K, P)`` in ``[0, 1]``.
    """
    p, order = probs.to(torch.float64).sort(dim=1, descending=True, stable=True)
    before = p.cumsum(dim=1) - p
    sorted_scores = before + u.unsqueeze(1) * p
    out = torch.empty_like(sorted_scores).scatter_(1, order, sorted_scores)
    return out.to(probs.dtype).clamp_(0.0, 1.0)


def class_scores(probs: Tensor, score: str = "lac", seed: int = 0) -> Tensor:
    """Scores of every class (``"lac"`` or ``"aps"``, seeded by ``seed``).

    Shape:
        - probs: ``(N, K, P)`` float32; returns ``(N, K, P)`` float32.
    """
    if score == "lac":
        return lac_scores(probs)
    if score == "aps":
        return aps_scores(probs, pixel_uniforms(probs, seed))
    raise ValueError(f"Expected `score` to be one of {list(SCORES)}, but got {score!r}.")


def score_cells(scores: Tensor, grid: int = GRID) -> Tensor:
    """Grid cell ``ceil(s * grid)`` of each score (exact: ``grid`` is a power of two), so that
    ``s <= g / grid`` iff the cell is ``<= g``. Returns int64 in ``[0, grid]``."""
    return torch.ceil(scores.to(torch.float64) * grid).to(torch.int64).clamp_(0, grid)
