"""Boundary-Aware ECE (``ba_ece``): a hand case, a float64 loop reference, streaming equal to
one shot, two gloo ranks equal to one process, and its place in the task's meters and tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cals_seg.evaluation.engine import TABLE_COLUMNS, calibration_table
from cals_seg.metrics import BoundaryAwareECEMeter

from ._dist import run_distributed

VOID = 255
EDGES = (0.0, 3.0, 7.0, 15.0, math.inf)


def _logit(c: float) -> float:
    return math.log(c / (1 - c))


def test_hand_case():
    """Two classes split at column 10 of a 4 x 20 image; class 0 predicted everywhere with a
    confidence fixed per ring. Boundary: columns 9 and 10. Rings (d = distance to them):
    [0, 3) columns 7-12 (d 2 1 0 0 1 2, mean 1), [3, 7) columns 3-6 and 13-16 (mean 4.5),
    [7, 15) columns 0-2 and 17-19 (mean 8), [15, inf) empty; half of each ring is class 0."""
    target = torch.zeros(1, 4, 20, dtype=torch.long)
    target[..., 10:] = 1
    conf = {0: 0.9, 1: 0.7, 2: 0.55}
    ring_of_col = [2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    logits = torch.zeros(1, 2, 4, 20)
    for col, r in enumerate(ring_of_col):
        logits[0, 0, :, col] = _logit(conf[r])
    meter = BoundaryAwareECEMeter(2)
    meter.update(logits, target)
    out = meter.compute()
    assert out["count_ring"] == [24, 32, 24, 0]
    assert out["distance_ring"][:3] == pytest.approx([1.0, 4.5, 8.0], abs=1e-12)
    assert out["distance_ring"][3] is None
    ece = [0.4, 0.2, 0.05]  # |0.5 - c| in each ring (one bin each)
    assert out["ece_ring"][:3] == pytest.approx(ece, abs=1e-6)
    w = [1 / 2, 1 / 5.5, 1 / 9]
    expected = sum(a * b for a, b in zip(w, ece, strict=True)) / sum(w)
    assert out["ba_ece"] == pytest.approx(expected, abs=1e-6)
    assert out["weight_ring"] == pytest.approx([x / sum(w) for x in w] + [0.0], abs=1e-12)


def _data(n: int = 5, k: int = 4, h: int = 17, w: int = 25, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, k, (n, 1, 4, 6), generator=g).float()
    target = torch.nn.functional.interpolate(blocks, size=(h, w), mode="nearest")[:, 0].long()
    target[torch.rand(n, h, w, generator=g) < 0.08] = VOID
    target[n - 1, :, : w // 2] = 0  # one image with a large far region
    target[n - 1, :, w // 2:] = 0
    target[n - 1, 0, 0] = 1  # a single boundary pixel at a corner: distances up to ~29
    logits = torch.randn(n, k, h, w, generator=g) * 2.5
    logits[:, 0] += 30.0 * (torch.rand(n, h, w, generator=g) < 0.1)  # confidence 1.0 exactly
    return logits, target


def _reference(logits: torch.Tensor, target: torch.Tensor, n_bins: int = 15):
    """Float64 loops: boundary pixels, brute-force distances, ring ECEs, weights."""
    n, k, h, w = logits.shape
    probs = torch.softmax(logits.float(), dim=1).double().numpy()  # the meter's float32 softmax
    y = target.numpy()
    rings = len(EDGES) - 1
    count = np.zeros((rings, n_bins))
    correct = np.zeros((rings, n_bins))
    conf_sum = np.zeros((rings, n_bins))
    dsum, dcount = np.zeros(rings), np.zeros(rings)
    for a in range(n):
        boundary = []
        for i in range(h):
            for j in range(w):
                if y[a, i, j] == VOID:
                    continue
                if any(0 <= i + di < h and 0 <= j + dj < w and y[a, i + di, j + dj] != y[a, i, j]
                       for di in (-1, 0, 1) for dj in (-1, 0, 1)):
                    boundary.append((i, j))
        for i in range(h):
            for j in range(w):
                if y[a, i, j] == VOID:
                    continue
                d = min((math.hypot(i - bi, j - bj) for bi, bj in boundary), default=math.inf)
                r = next(q for q in range(rings) if EDGES[q] <= d + 1e-12 < EDGES[q + 1])
                p = probs[a, :, i, j]
                c = float(p.max())
                b = min(max(math.ceil(c * n_bins) - 1, 0), n_bins - 1)
                count[r, b] += 1
                correct[r, b] += int(int(np.argmax(logits[a, :, i, j].numpy())) == y[a, i, j])
                conf_sum[r, b] += c
                if math.isfinite(d):
                    dsum[r] += d
                    dcount[r] += 1
    eces, raw = [], []
    for r in range(rings):
        m = count[r].sum()
        e = sum(abs(correct[r, b] - conf_sum[r, b]) for b in range(n_bins)) / m if m else None
        eces.append(e)
        raw.append(1 / (dsum[r] / dcount[r] + 1) if m and dcount[r] else 0.0)
    ba = sum(wt * e for wt, e in zip(raw, eces, strict=True) if wt) / sum(raw)
    return ba, eces, count.sum(axis=1).tolist(), [s / c if c else None for s, c in
                                                   zip(dsum, dcount, strict=True)]


def test_equals_a_float64_loop_reference_and_streaming_equals_one_shot():
    logits, target = _data()
    ba, eces, counts, dbar = _reference(logits, target)
    one = BoundaryAwareECEMeter(4, ignore_index=VOID)
    one.update(logits, target)
    many = BoundaryAwareECEMeter(4, ignore_index=VOID)
    for sl in (slice(0, 1), slice(1, 3), slice(3, 5)):
        many.update(logits[sl], target[sl])
    got = one.compute()
    assert got["count_ring"] == counts and counts[3] > 0  # every ring is populated
    for a, b in zip(got["ece_ring"], eces, strict=True):
        assert a == pytest.approx(b, abs=1e-12)
    for a, b in zip(got["distance_ring"], dbar, strict=True):
        assert a == pytest.approx(b, rel=1e-12)
    assert got["ba_ece"] == pytest.approx(ba, abs=1e-12)
    streamed = many.compute()
    assert streamed["count_ring"] == got["count_ring"]
    assert streamed["ba_ece"] == pytest.approx(got["ba_ece"], abs=1e-15)
    # a batch that fails its checks leaves the state as it was
    bad = logits[:1].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError):
        many.update(bad, target[:1])
    assert many.compute() == streamed
    many.reset()
    assert many.compute()["ba_ece"] is None


def test_no_boundary_anywhere_gives_none():
    meter = BoundaryAwareECEMeter(3)
    meter.update(torch.randn(2, 3, 8, 8), torch.ones(2, 8, 8, dtype=torch.long))
    out = meter.compute()
    assert out["count_ring"] == [0, 0, 0, 128] and out["ba_ece"] is None


def _rank_fn(rank: int, world: int, expected: dict) -> None:
    torch.set_num_threads(1)
    logits, target = _data()
    meter = BoundaryAwareECEMeter(4, ignore_index=VOID)
    part = slice(0, 2) if rank == 0 else slice(2, 5)
    meter.update(logits[part], target[part])
    got = meter.compute()
    assert got["count_ring"] == expected["count_ring"]
    assert got["ba_ece"] == pytest.approx(expected["ba_ece"], abs=1e-14)
    assert got["distance_ring"] == pytest.approx(expected["distance_ring"], rel=1e-14)


def test_two_gloo_ranks_equal_one_process():
    logits, target = _data()
    meter = BoundaryAwareECEMeter(4, ignore_index=VOID)
    meter.update(logits, target)
    run_distributed(_rank_fn, 2, meter.compute(), start_method="fork")


def test_reported_beside_the_band_weighted_ece():
    from cals_seg.tasks import SegmentationTask

    keys = [k for k, _, _ in TABLE_COLUMNS]
    assert keys.index("ba_ece") == keys.index("ece_band_weighted") + 1
    table = calibration_table({"none": {"ece": 0.1, "ece_band_weighted": 0.2, "ba_ece": 0.3}})
    assert "BA-ECE" in table and "30.00" in table
    task = SegmentationTask(None, None, None, torch.nn.Identity(), 4, VOID)
    for test in (False, True):
        meters = task.meters(test=test)
        assert isinstance(meters["rings"], BoundaryAwareECEMeter)
        assert "boundary" in meters  # beside the band-weighted ECE of the band meter


def test_the_rings_of_a_mask_are_computed_once_and_follow_its_content():
    """One evaluation feeds a mask to several meters (raw, post-TS, each calibrator): the rings
    are kept for the last few masks, keyed by content; a mask changed in place, or another
    one, gets its own, and every meter's numbers equal those of a fresh meter alone."""
    from cals_seg.metrics import regions

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 20, 24, generator=gen)
    target = torch.randint(0, 3, (2, 20, 24), generator=gen)
    target[:, :3] = 255
    regions._RING_MEMO.clear()

    def fresh(y: torch.Tensor) -> dict:
        regions._RING_MEMO.clear()
        m = BoundaryAwareECEMeter(3, ignore_index=255)
        m.update(logits, y)
        return m.compute()

    want = fresh(target)
    meters = [BoundaryAwareECEMeter(3, ignore_index=255) for _ in range(4)]
    calls = []
    real = regions.squared_boundary_distance

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    regions._RING_MEMO.clear()
    try:
        regions.squared_boundary_distance = counted
        for m in meters:
            m.update(logits, target)
        assert len(calls) == 1  # one distance transform for four meters
        changed = target.clone()
        changed[0, 10:] = 1  # another mask: its own rings
        other = BoundaryAwareECEMeter(3, ignore_index=255)
        other.update(logits, changed)
        assert len(calls) == 2
    finally:
        regions.squared_boundary_distance = real
    for m in meters:
        assert m.compute()["ba_ece"] == want["ba_ece"]
    assert other.compute()["ba_ece"] == fresh(changed)["ba_ece"]
    for i in range(regions._RING_MEMO_SIZE + 3):  # memory: a few masks at most
        y = target.clone()
        y[0, 5, i] = (int(y[0, 5, i]) + 1) % 3
        BoundaryAwareECEMeter(3, ignore_index=255).update(logits, y)
    assert len(regions._RING_MEMO) == regions._RING_MEMO_SIZE
