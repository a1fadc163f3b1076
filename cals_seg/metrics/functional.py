"""Machinery shared by the meters: argument and input checks, exact binning, DDP reduction.

A reader who wants a metric's definition opens ``calibration.py`` or ``segmentation.py``; this
file holds what both need and can be skipped on a first read.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from cals_seg.utils.distributed import all_reduce_sum_, is_distributed
from cals_seg.utils.validation import check_finite

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# Fine confidence histogram used by the adaptive ECE (see ``fine_cell``).
FINE_UNIFORM_LOG2 = 16  # uniform cells of width 2^-16 below the tail
FINE_TAIL_LOG2 = 12  # the tail [1 - 2^-12, 1) ...
FINE_ULP_LOG2 = 24  # ... is resolved in steps of 2^-24, the float32 spacing just below 1
_TAIL_START = 1.0 - 2.0**-FINE_TAIL_LOG2
_NUM_UNIFORM = 2**FINE_UNIFORM_LOG2 - 2 ** (FINE_UNIFORM_LOG2 - FINE_TAIL_LOG2)  # cells below tail
_NUM_TAIL = 2 ** (FINE_ULP_LOG2 - FINE_TAIL_LOG2)  # one cell per 2^-24 step in the tail
NUM_FINE_CELLS = _NUM_UNIFORM + _NUM_TAIL + 1  # + one cell for a confidence of exactly 1.0


def _is_integer_tensor(t: Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _labels(target: Tensor, num_classes: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Valid mask and labels with void positions set to 0, after a range check.

    The check is one ``aminmax`` of the labels with void positions zeroed; the positions and
    values at fault are only looked up when it fails.
    """
    target = target.long()
    valid = target != ignore_index
    labels = torch.where(valid, target, 0)
    if labels.numel():
        low, high = torch.aminmax(labels)
        if int(low) < 0 or int(high) >= num_classes:
            bad = valid & ((target < 0) | (target >= num_classes))
            values = torch.unique(target[bad]).tolist()
            more = f" (and {len(values) - 10} more)" if len(values) > 10 else ""
            raise ValueError(
                f"Expected `target` values in [0, {num_classes}) or `ignore_index`={ignore_index}"
                f", but got {int(bad.sum())} positions with values {values[:10]}{more}."
            )
    return labels, valid


def prepare_logits(
    logits: Tensor, target: Tensor, num_classes: int, ignore_index: int, inputs: str = "logits"
) -> tuple[Tensor, Tensor, Tensor]:
    """Check ``logits`` / ``target`` and flatten the spatial dimensions.

    float16 / bfloat16 logits are upcast to float32; float32 and float64 are used as they are.
    ``inputs`` says what the scores are (:func:`as_logits`): logits are refused when they look
    like probabilities, and probabilities are turned into logits ``log p``.

    Shape:
        - logits: ``(N, K, *S)``, any number of spatial dims (zero included).
        - target: ``(N, *S)``, integer class indices or ``ignore_index``.
        - returns: logits ``(N, K, P)``, labels ``(N, P)`` (int64, 0 at void positions) and the
          valid mask ``(N, P)``, with ``P = prod(S)`` (1 when there are no spatial dims).

    Raises:
        ValueError: on a non-floating ``logits``, a non-integer ``target``, mismatched shapes, a
            wrong class dimension, or labels outside ``[0, K)`` other than ``ignore_index``.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(
            f"Expected `logits` to be a floating point tensor of shape (N, K, *S), but got {got}."
        )
    if logits.dim() < 2 or logits.shape[1] != num_classes:
        raise ValueError(
            f"Expected `logits` of shape (N, K={num_classes}, *S), but got {tuple(logits.shape)}."
        )
    n, k = logits.shape[:2]
    spatial = tuple(logits.shape[2:])
    _check_target(target, (n, *spatial), f"`logits` of shape {tuple(logits.shape)}")
    tol = probability_tolerance(logits.dtype)
    if logits.dtype in _LOW_PRECISION:
        logits = logits.float()
    p = math.prod(spatial)
    labels, valid = _labels(target.reshape(n, p), num_classes, ignore_index)
    return as_logits(logits.reshape(n, k, p), inputs, tol), labels, valid


# --------------------------------------------------------------------------------------------
# Logits or probabilities.
# --------------------------------------------------------------------------------------------

INPUTS = ("logits", "probs")
# Positions examined by the probability test: evenly spaced over the batch, so the test costs
# O(K * PROBE_POSITIONS) whatever the image size.
PROBE_POSITIONS = 4096


def check_inputs_arg(value: object) -> None:
    """Raise ``ValueError`` unless ``inputs`` is ``"logits"`` or ``"probs"``."""
    if value not in INPUTS:
        raise ValueError(f"Expected `inputs` to be one of {list(INPUTS)}, but got {value!r}.")


def probability_tolerance(dtype: torch.dtype) -> float:
    """How far from 1 a row of probabilities of ``dtype`` may sum: ``max(1e-3, 4 eps)``
    (1e-3 for float32 / float64, 3.9e-3 for float16, 3.1e-2 for bfloat16)."""
    return max(1e-3, 4 * torch.finfo(dtype).eps)


def looks_like_probabilities(scores: Tensor, tol: float) -> bool:
    """Whether every probed position of ``scores`` is a probability vector: all K values
    ``>= 0`` and ``|sum_k s_k - 1| <= tol``.

    The probe is ``min(N P, PROBE_POSITIONS)`` positions evenly spaced over the flattened
    ``(N, P)`` grid (every position for small batches). False for an empty batch; NaN fails the
    test (it is reported later, by the finiteness check).

    Shape:
        - scores: ``(N, K, P)``.
    """
    n, k, p = scores.shape
    total = n * p
    if total == 0:
        return False
    m = min(total, PROBE_POSITIONS)
    flat = torch.arange(m, device=scores.device, dtype=torch.int64) * total // m
    probe = scores[flat // p, :, flat % p].double()  # (m, K)
    ok = (probe.amin() >= 0) & ((probe.sum(dim=1) - 1).abs().amax() <= tol)
    return bool(ok)


def as_logits(scores: Tensor, inputs: str, tol: float | None = None) -> Tensor:
    """Scores as logits, refusing probabilities passed as logits.

    Rule: with ``inputs="logits"`` the scores are refused (``ValueError`` naming the fix) when
    :func:`looks_like_probabilities` holds, i.e. every probed position is non-negative and sums
    to 1 over the K classes within :func:`probability_tolerance` of the input's dtype; softmaxing
    them again would flatten every confidence towards ``1 / K`` silently. Logits that are
    non-negative but do not sum to 1 (or have one negative value) pass. With ``inputs="probs"``
    the scores must pass that test (else ``ValueError``) and are returned as
    ``log(max(p, tiny))``, whose softmax is ``p`` again (up to rounding), so every metric is the
    one of the probabilities.

    Args:
        scores: ``(N, K, P)`` float32 / float64 (``prepare_logits`` has upcast the rest).
        inputs: ``"logits"`` or ``"probs"``.
        tol: the sum tolerance (default: that of ``scores.dtype``; ``prepare_logits`` passes
            the one of the dtype before the upcast).
    """
    if tol is None:
        tol = probability_tolerance(scores.dtype)
    if inputs == "logits":
        if looks_like_probabilities(scores, tol):
            raise ValueError(
                "Expected logits, but got probabilities (every probed position is non-negative "
                "and sums to 1 over the classes): pass the model's outputs before the softmax, "
                "or build the meter with inputs='probs'."
            )
        return scores
    if inputs == "probs":
        if scores.numel() and not looks_like_probabilities(scores, tol):
            raise ValueError(
                "Expected probabilities (non-negative, summing to 1 over the classes) because "
                "the meter was built with inputs='probs', but got other values; pass "
                "softmax(logits, dim=1), or build the meter with inputs='logits' (the default)."
            )
        return scores.clamp_min(torch.finfo(scores.dtype).tiny).log_()
    check_inputs_arg(inputs)
    return scores


def prepare_predictions(
    preds: Tensor, target: Tensor, num_classes: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Check integer predictions ``(N, *S)`` against ``target`` ``(N, *S)``; flatten both.

    Returns predictions ``(N, P)``, labels ``(N, P)`` (0 at void positions), both int64, and
    the valid mask ``(N, P)``.
    """
    if preds.dim() < 1 or not _is_integer_tensor(preds):
        raise ValueError(
            "Expected `preds` to be floating logits (N, K, *S) or integer class indices (N, *S), "
            f"but got {preds.dtype} of shape {tuple(preds.shape)}."
        )
    _check_target(target, tuple(preds.shape), f"`preds` of shape {tuple(preds.shape)}")
    bad = (preds < 0) | (preds >= num_classes)
    if bool(bad.any()):
        values = torch.unique(preds[bad]).tolist()[:10]
        raise ValueError(
            f"Expected `preds` values in [0, {num_classes}), but got {int(bad.sum())} positions "
            f"with values {values}."
        )
    n, p = preds.shape[0], math.prod(preds.shape[1:])
    labels, valid = _labels(target.reshape(n, p), num_classes, ignore_index)
    return preds.reshape(n, p).long(), labels, valid


def _check_target(target: Tensor, shape: tuple[int, ...], against: str) -> None:
    if not isinstance(target, Tensor) or not _is_integer_tensor(target):
        got = target.dtype if isinstance(target, Tensor) else type(target).__name__
        raise ValueError(f"Expected `target` to be an integer tensor, but got {got}.")
    if tuple(target.shape) != shape:
        raise ValueError(
            f"Expected `target` of shape (N, *S) = {shape} to match {against}, but got "
            f"{tuple(target.shape)}."
        )


# Logits per block of positions on the CPU (4 MiB of float32): see ``position_block``.
BLOCK_ELEMENTS = 2**20


def position_block(x: Tensor, elements: int | None = None) -> int:
    """Positions per block for a loop of passes over the logits ``(N, K, P)``.

    On the CPU about ``elements`` (default :data:`BLOCK_ELEMENTS`) logits, so that each pass
    over a block reads it from the cache (the whole tensor would go through the main memory
    once per pass), rounded down to a multiple of 64 positions: torch's softmax over the class
    dimension is vectorised along the positions, and blocks that start at multiples of the
    vector width give bitwise the softmax of the whole tensor. Off the CPU: every position
    (one kernel per pass).
    """
    n, k, npos = x.shape
    if x.device.type != "cpu":
        return max(npos, 1)
    per = (elements or BLOCK_ELEMENTS) // max(n * k, 1)
    return max(64, per - per % 64)


def max_argmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per-position maximum over classes and the first index that attains it.

    Same result as ``logits.max(dim=1)`` for finite logits, several times faster on CPU:
    ``amax`` over the class dimension is vectorised along the positions, while ``max`` with
    indices is not, and so are the float passes used for the index (comparisons that write a
    bool tensor are not). With ``d_k = l_k - max`` (exactly 0 at a maximum, and < 0 elsewhere:
    a float subtraction of two different finite values is never 0), the first maximal index is
    ``K - max_k ((sign(d_k) + 1) (K - k))``, all in float32 (exact integers below 2^24). One
    float temporary of the logits' size. A position holding NaN or inf gives an arbitrary
    index, so call ``cals_seg.utils.validation.check_finite`` before using the indices.

    Shape:
        - logits: ``(N, K, P)``; returns maxima ``(N, P)`` and int64 indices ``(N, P)``.
    """
    k = logits.shape[1]
    if k >= 2**24:
        return logits.max(dim=1)
    maxima = logits.amax(dim=1, keepdim=True)
    weights = torch.arange(k, 0, -1, dtype=logits.dtype, device=logits.device).view(1, k, 1)
    hit = torch.sub(logits, maxima).sign_().add_(1.0).mul_(weights)  # K - k at a maximum, else 0
    first = hit.amax(dim=1).neg_().add_(k)
    return maxima.squeeze(1), first.long()


def argmax_map(logits: Tensor, check: bool = False) -> Tensor:
    """``logits.argmax(dim=1)`` (the first maximal class) of finite logits, several times
    faster on the CPU: :func:`max_argmax` over blocks of positions (:func:`position_block`; no
    logits-sized temporary). Non-finite positions get some index in ``[0, K)``, or with
    ``check`` raise ``ValueError`` (:func:`cals_seg.utils.validation.check_finite`, block by
    block).

    Shape:
        - logits: ``(N, K, *S)``; returns ``(N, *S)`` int64.
    """
    n, k = logits.shape[:2]
    x = logits.reshape(n, k, math.prod(logits.shape[2:]))  # also for an empty batch (n = 0)
    out = torch.empty((n, x.shape[2]), dtype=torch.int64, device=x.device)
    block = position_block(x)
    for start in range(0, x.shape[2], block):
        xb = x[:, :, start:start + block]
        maxima, out[:, start:start + block] = max_argmax(xb)
        if check and not bool(xb.amin(dim=1).add_(maxima).sum().isfinite()):
            check_finite(xb)
    return out.clamp_(0, k - 1).view(n, *logits.shape[2:])


# --------------------------------------------------------------------------------------------
# Binning.
# --------------------------------------------------------------------------------------------


@functools.cache
def _edge_thresholds(n_bins: int, dtype: torch.dtype) -> tuple[float, ...]:
    """For b = 1..n-1, the largest value of ``dtype`` that is <= b / n (as exact rationals)."""
    out = []
    for b in range(1, n_bins):
        exact = Fraction(b, n_bins)
        if dtype == torch.float64:
            v = b / n_bins
            if Fraction(v) > exact:
                v = math.nextafter(v, 0.0)
        else:  # float32
            v32 = np.float32(b / n_bins)
            if Fraction(float(v32)) > exact:
                v32 = np.nextafter(v32, np.float32(0.0))
            v = float(v32)
        out.append(v)
    return tuple(out)


def bin_index(x: Tensor, n_bins: int) -> Tensor:
    """Equal-width bin of each value: ``clip(ceil(x * n) - 1, 0, n - 1)``, evaluated exactly.

    Membership is ``(b/n, (b+1)/n]``; 0 falls in bin 0 and 1.0 in bin ``n - 1``. A float32 value
    is binned as its exact value: ``x * n`` is formed in float64, where it is exact (24 + 29 bits
    fit in 53 for ``n < 2^29``), so no rounding can move it across an integer. float64 values go
    through ``torch.bucketize`` with, per edge ``b/n``, the largest float64 not above it (so
    ``x > t_b`` iff ``x > b/n`` as exact rationals); slower, used only for float64 logits.

    Shape:
        - x: any shape, float32 or float64, values in [0, 1].
        - returns: same shape, int32.
    """
    if n_bins == 1:
        return torch.zeros(x.shape, dtype=torch.int32, device=x.device)
    if x.dtype != torch.float64 and n_bins < 2**29:
        t = x.to(torch.float64)  # one float64 temporary, updated in place
        return t.mul_(n_bins).ceil_().to(torch.int32).clamp_(min=1).sub_(1)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    thresholds = torch.tensor(_edge_thresholds(n_bins, dtype), dtype=dtype, device=x.device)
    return torch.bucketize(x.to(dtype), thresholds, out_int32=True)


def fine_cell(conf: Tensor) -> Tensor:
    """Cell of the fine confidence histogram (``NUM_FINE_CELLS`` cells, increasing with ``conf``).

    Cells ``[i 2^-16, (i+1) 2^-16)`` below ``1 - 2^-12``; above it one cell per ``2^-24`` step
    ``[1 - j 2^-24, 1 - (j-1) 2^-24)`` -- every float32 value in that tail has its own cell,
    which is where the softmax of segmentation logits saturates -- and a last cell that holds
    exactly 1.0. All arithmetic is exact (power-of-two scalings; ``1 - c`` is exact for
    ``c >= 1/2``).

    Shape:
        - conf: any shape, float32 or float64 in [0, 1].
        - returns: same shape, int32.
    """
    # Both branches are >= 0 and truncation towards zero is floor: the tail cell is
    # floor(L - (1 - c) 2^24) = L - ceil((1 - c) 2^24), exact for float32 and float64 alike.
    tail = torch.sub(1.0, conf).mul_(-(2.0**FINE_ULP_LOG2)).add_(_NUM_UNIFORM + _NUM_TAIL)
    uniform = conf * 2.0**FINE_UNIFORM_LOG2
    return torch.where(conf >= _TAIL_START, tail, uniform).to(torch.int32)


# --------------------------------------------------------------------------------------------
# DDP.
# --------------------------------------------------------------------------------------------


def sum_over_ranks(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` summed over all ranks (plain copies when not distributed).

    The inputs are never modified. Tensors of one dtype are flattened into one buffer, so the
    whole sync is one ``all_reduce`` per dtype (int64 counts and float64 sums: two calls).
    Every rank must call this (it is a collective).
    """
    if not is_distributed():
        return [t.clone() for t in tensors]
    out: list[Tensor | None] = [None] * len(tensors)
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        all_reduce_sum_([flat])
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]
