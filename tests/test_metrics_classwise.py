"""The class-wise statistics of CalibrationMeter (only the values above the first bin edge are
scattered) against a float64 loop over every probability, bins decided on exact rationals."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from cals_seg.metrics import CalibrationMeter
from cals_seg.metrics.calibration import _classwise_prob_sums

VOID = 255


def _bin(v: float, n_bins: int) -> int:
    """clip(ceil(v n) - 1, 0, n - 1) on the exact value of v."""
    return min(max(math.ceil(Fraction(v) * n_bins) - 1, 0), n_bins - 1)


def _ref_sums(p: np.ndarray, valid: np.ndarray, n_bins: int) -> np.ndarray:
    """out[i, k, b] = sum of p[i, k, j] over valid j with bin(p[i, k, j]) = b, in float64."""
    n, k, m = p.shape
    out = np.zeros((n, k, n_bins))
    for i in range(n):
        for c in range(k):
            for j in range(m):
                if valid[i, j]:
                    v = float(p[i, c, j])
                    out[i, c, _bin(v, n_bins)] += v
    return out


def _ref_hits(p: np.ndarray, y: np.ndarray, valid: np.ndarray, n_bins: int) -> np.ndarray:
    n, k, m = p.shape
    out = np.zeros((k, n_bins), dtype=np.int64)
    for i in range(n):
        for j in range(m):
            if valid[i, j]:
                c = int(y[i, j])
                out[c, _bin(float(p[i, c, j]), n_bins)] += 1
    return out


def _edge_values(n_bins: int) -> list[float]:
    """float32 values at, just below and just above every edge b / n, plus 0 and 1."""
    vals = [0.0, 1.0, float(np.nextafter(np.float32(1), np.float32(0)))]
    for b in range(1, n_bins):
        e = np.float32(b / n_bins)
        vals += [float(e), float(np.nextafter(e, np.float32(0))),
                 float(np.nextafter(e, np.float32(2)))]
    return vals


@pytest.mark.parametrize("n_bins", [1, 2, 3, 10, 15])
def test_prob_sums_at_bin_edges(n_bins):
    g = torch.Generator().manual_seed(n_bins)
    vals = torch.tensor(_edge_values(n_bins), dtype=torch.float32)
    n, k, m = 2, 4, 3 * len(vals)
    p = vals[torch.randint(0, len(vals), (n, k, m), generator=g)]
    p[:, :, : len(vals)] = vals  # every edge value once per (image, class)
    invalid = torch.rand(n, m, generator=g) < 0.3
    expected = _ref_sums(p.numpy(), (~invalid).numpy(), n_bins)
    got = _classwise_prob_sums(p.clone(), invalid, n_bins)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
    # float64 probabilities take the float64 edges
    p64 = p.double()
    p64[0, 0, 0] = 1 / n_bins if n_bins > 1 else 0.5
    expected64 = _ref_sums(p64.numpy(), (~invalid).numpy(), n_bins)
    np.testing.assert_allclose(_classwise_prob_sums(p64.clone(), invalid, n_bins).numpy(),
                               expected64, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_meter_classwise_states_random(seed):
    g = torch.Generator().manual_seed(seed)
    n, k, h, w = 2, [3, 7, 12][seed % 3], 9, 11
    n_bins = [15, 10, 4][seed % 3]
    scale = [0.3, 3.0, 30.0][seed // 2]  # flat, moderate, saturated (p = 1.0 and p = 0)
    logits = torch.randn(n, k, h, w, generator=g) * scale
    logits[0, :, 0, 0] = torch.tensor([200.0] + [-200.0] * (k - 1))  # p exactly 1.0 and 0.0
    logits[1, :, 0, 0] = 0.0  # p exactly 1 / K for every class
    target = torch.randint(0, k, (n, h, w), generator=g)
    target[torch.rand(n, h, w, generator=g) < 0.2] = VOID
    dtype = torch.bfloat16 if seed % 2 else torch.float32
    logits = logits.to(dtype)
    stats = CalibrationMeter(k, n_bins=n_bins, ignore_index=VOID).batch_stats(logits, target)
    p = torch.softmax(logits.float(), dim=1).reshape(n, k, -1).numpy()
    valid = (target != VOID).reshape(n, -1).numpy()
    y = torch.where(target == VOID, 0, target).reshape(n, -1).numpy()
    sums = _ref_sums(p, valid, n_bins)
    np.testing.assert_allclose(stats["cw_prob"].numpy(), sums.sum(axis=0), rtol=1e-12,
                               atol=1e-12)
    hits = _ref_hits(p, y, valid, n_bins)
    assert torch.equal(stats["cw_hits"], torch.from_numpy(hits))
    # per-image class-wise ECE (the sixth image sum), from per-image references
    cwce = 0.0
    for i in range(n):
        hits_i = _ref_hits(p[i:i + 1], y[i:i + 1], valid[i:i + 1], n_bins)
        m = valid[i].sum()
        cwce += np.abs(hits_i - sums[i]).sum(axis=1).mean() / m
    assert float(stats["image_sums"][5]) == pytest.approx(cwce, rel=1e-12, abs=1e-14)


def test_all_void_image_and_single_bin():
    logits = torch.randn(2, 4, 5, 5)
    target = torch.randint(0, 4, (2, 5, 5))
    target[0] = VOID
    for n_bins in (1, 15):
        stats = CalibrationMeter(4, n_bins=n_bins, ignore_index=VOID).batch_stats(logits, target)
        p = torch.softmax(logits, 1).reshape(2, 4, -1).numpy()
        valid = (target != VOID).reshape(2, -1).numpy()
        np.testing.assert_allclose(stats["cw_prob"].numpy(),
                                   _ref_sums(p, valid, n_bins).sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_above_is_the_float_comparison(dtype):
    """``_above`` compares bit patterns as integers: the same answer as ``x > t`` on every
    non-negative value, -0.0, subnormals and the values around each threshold."""
    from cals_seg.metrics.calibration import _above
    from cals_seg.metrics.functional import _edge_thresholds

    g = torch.Generator().manual_seed(1)
    tiny = torch.finfo(dtype).tiny
    for n_bins in (2, 3, 10, 15, 100):
        t = _edge_thresholds(n_bins, dtype)[0]
        tt = torch.tensor(t, dtype=dtype)
        near = torch.stack([tt, torch.nextafter(tt, torch.tensor(0.0, dtype=dtype)),
                            torch.nextafter(tt, torch.tensor(2.0, dtype=dtype))])
        fixed = torch.tensor([0.0, -0.0, tiny, tiny / 4, 1.0, 0.5, -1.0, -tiny], dtype=dtype)
        x = torch.cat([near, fixed, torch.rand(499, generator=g, dtype=dtype),
                       torch.rand(500, generator=g, dtype=dtype) * 2 * t])
        got = _above(x.view(10, -1).t(), t)  # strided, 2-D
        assert got.dtype == torch.uint8
        assert torch.equal(got.bool(), x.view(10, -1).t() > t)


@pytest.mark.parametrize("uncertain", [0.0, 0.1, 0.45, 0.55, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rest_sums_search_only_uncertain_positions(uncertain, dtype):
    """Given each position's sum, only positions whose sum is above the first edge are searched
    (when they are fewer than half): the same sums as the search of every value and as the
    float64 loop, whatever the share of uncertain positions, with edge values among them."""
    from cals_seg.metrics.calibration import _classwise_rest_sums

    for n_bins in (2, 10, 15):
        g = torch.Generator().manual_seed(n_bins + int(100 * uncertain))
        n, k, m = 3, 6, 200
        logits = torch.randn(n, k, m, generator=g, dtype=torch.float64)
        confident = torch.rand(n, m, generator=g) >= uncertain
        logits[:, 0][confident] += 40.0  # p_0 ~ 1, the other values tiny
        q = torch.softmax(logits, dim=1).to(dtype)
        q[:, 0] = 0.0  # the arg-max taken out, as the meter does
        edges = torch.tensor(_edge_values(n_bins), dtype=dtype)  # on uncertain positions only
        spots = (~confident).nonzero()[: len(edges)]
        q[spots[:, 0], 1, spots[:, 1]] = edges[: len(spots)]
        rest = q.sum(dim=1)
        searched = torch.zeros((n, k, n_bins), dtype=torch.float64)
        _classwise_rest_sums(q, n_bins, searched, rest)
        every = torch.zeros((n, k, n_bins), dtype=torch.float64)
        _classwise_rest_sums(q, n_bins, every)
        np.testing.assert_allclose(searched.numpy(), every.numpy(), rtol=1e-13, atol=0)
        searched[:, :, 0] -= searched[:, :, 1:].sum(dim=2)
        expected = _ref_sums(q.double().numpy(), np.ones((n, m), dtype=bool), n_bins)
        np.testing.assert_allclose(searched.numpy(), expected, rtol=1e-12, atol=1e-12)
