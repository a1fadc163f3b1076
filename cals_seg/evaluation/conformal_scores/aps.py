"""The randomised APS score (Romano et al. 2020) and its seeded per-pixel uniforms."""

from __future__ import annotations

import torch
from torch import Tensor

from cals_seg.evaluation.conformal_score import SCORES, ConformalScore

_MASK32 = 0xFFFFFFFF


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


@SCORES.register("aps")
class APS(ConformalScore):
    """Randomised APS: sets that adapt to how spread a pixel's probabilities are; ``u`` is
    :func:`pixel_uniforms` of ``seed``. Exported to pt2 only: its ``u`` reads the bits of the
    probabilities."""

    name = "aps"
    onnx_refusal = "the APS randomisation reads the bits of the probabilities, which ONNX cannot"

    @staticmethod
    def scores(probs: Tensor, seed: int = 0) -> Tensor:
        return aps_scores(probs, pixel_uniforms(probs, seed))


__all__ = ["APS", "aps_scores", "pixel_uniforms"]
