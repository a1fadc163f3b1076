"""Boundary bands, object sizes, the over / under-confidence split and risk-coverage (AURC).

Every metric is checked against an independent float64 reference written here with loops:
boundary pixels by a loop over the 8 neighbours, distances by a loop over all boundary pixels,
components by a breadth-first search, ECE per group by a loop over the bins, AURC by a sort.
The only input shared with the meters is ``torch.softmax`` of the float32 logits (the meters'
documented definition of the confidence).
"""

from __future__ import annotations

import math
from collections import deque
from fractions import Fraction

import numpy as np
import pytest
import torch

from cals_seg.metrics import (
    BoundaryCalibrationMeter,
    CalibrationMeter,
    ObjectSizeCalibrationMeter,
)
from cals_seg.metrics.regions import (
    boundary_bands,
    boundary_pixels,
    component_areas,
    squared_boundary_distance,
)

from ._dist import run_distributed

VOID = 255
NEIGHBOURS = [(di, dj) for di in (-1, 0, 1) for dj in (-1, 0, 1) if (di, dj) != (0, 0)]


# ------------------------------------------------------------------------------- references


def ref_boundary(t: np.ndarray) -> np.ndarray:
    """Loop over pixels and their 8 neighbours inside the image. ``t``: (H, W)."""
    h, w = t.shape
    out = np.zeros((h, w), dtype=bool)
    for i in range(h):
        for j in range(w):
            if t[i, j] == VOID:
                continue
            for di, dj in NEIGHBOURS:
                a, b = i + di, j + dj
                if 0 <= a < h and 0 <= b < w and t[a, b] != t[i, j]:
                    out[i, j] = True
    return out


def ref_dist2(boundary: np.ndarray) -> np.ndarray:
    """Exact squared distances (float64 holding integers, inf without a boundary pixel), by a
    loop over all boundary pixels."""
    h, w = boundary.shape
    ii, jj = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    best = np.full((h, w), np.inf)
    for bi, bj in zip(*np.nonzero(boundary), strict=True):
        best = np.minimum(best, (ii - bi) ** 2 + (jj - bj) ** 2)
    return best


def ref_band(d2: float, bands) -> int:
    """Band of a squared distance, comparing d with each edge as exact rationals."""
    if d2 == math.inf:
        return len(bands)
    return sum(1 for b in bands if Fraction(int(d2)) >= Fraction(b) ** 2)


def ref_areas(t: np.ndarray, background: int | None) -> np.ndarray:
    """8-connected component area of each pixel by breadth-first search (0: void/background)."""
    h, w = t.shape
    out = np.zeros((h, w), dtype=np.int64)
    seen = np.zeros((h, w), dtype=bool)
    for i in range(h):
        for j in range(w):
            c = t[i, j]
            if seen[i, j] or c == VOID or c == background:
                continue
            queue, members = deque([(i, j)]), []
            seen[i, j] = True
            while queue:
                a, b = queue.popleft()
                members.append((a, b))
                for di, dj in NEIGHBOURS:
                    x, y = a + di, b + dj
                    if 0 <= x < h and 0 <= y < w and not seen[x, y] and t[x, y] == c:
                        seen[x, y] = True
                        queue.append((x, y))
            for a, b in members:
                out[a, b] = len(members)
    return out


def ref_group_metrics(conf, hit, group, num_groups, n_bins=15) -> dict:
    """Per group: count, ECE with its over / under split, acc, conf, reliability; bin loops."""
    out = {k: [] for k in ("count", "ece", "ece_over", "ece_under", "acc", "conf", "rel")}
    for g in range(num_groups):
        c, a = conf[group == g], hit[group == g]
        m = len(c)
        over = under = 0.0
        rel = {"count": [], "confidence": [], "accuracy": []}
        for b in range(n_bins):
            sel = ((c > b / n_bins) | (b == 0)) & (c <= (b + 1) / n_bins)
            n = int(sel.sum())
            rel["count"].append(n)
            rel["confidence"].append(c[sel].mean() if n else 0.0)
            rel["accuracy"].append(a[sel].mean() if n else 0.0)
            if n:
                gap = c[sel].mean() - a[sel].mean()
                if gap > 0:
                    over += n / m * gap
                else:
                    under -= n / m * gap
        out["count"].append(m)
        out["ece"].append(over + under if m else None)
        out["ece_over"].append(over if m else None)
        out["ece_under"].append(under if m else None)
        out["acc"].append(a.mean() if m else None)
        out["conf"].append(c.mean() if m else None)
        out["rel"].append(rel)
    return out


def conf_hit(logits: torch.Tensor, target: torch.Tensor):
    """Top-label confidence (float32 softmax, as float64) and correctness, per pixel (N, H, W)."""
    p = torch.softmax(logits.float(), dim=1)
    conf = p.amax(dim=1).double().numpy()
    hit = (logits.argmax(dim=1) == target).numpy().astype(np.float64)
    return conf, hit


def make_maps(n=3, k=4, h=37, w=45, seed=0, void=0.05):
    """Label maps made of blobs (so components and boundaries have structure), with void."""
    rng = np.random.default_rng(seed)
    t = np.zeros((n, h, w), dtype=np.int64)
    for i in range(n):
        for _ in range(8):
            c = rng.integers(1, k)
            y0, x0 = rng.integers(0, h), rng.integers(0, w)
            t[i, y0 : y0 + rng.integers(1, 15), x0 : x0 + rng.integers(1, 15)] = c
        t[i][rng.random((h, w)) < void] = VOID
    return torch.from_numpy(t)


def make_logits(target: torch.Tensor, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, h, w = target.shape
    logits = torch.randn(n, k, h, w, generator=g) * 2
    onehot = torch.nn.functional.one_hot(target.clamp(max=k - 1), k).permute(0, 3, 1, 2)
    return logits + 2.5 * onehot * (torch.rand(n, 1, h, w, generator=g) < 0.7)


def assert_groups(got: dict, want: dict, suffix: str, rel: float = 1e-9) -> None:
    assert got[f"count_{suffix}"] == want["count"]
    for key in ("ece", "ece_over", "ece_under", "acc", "conf"):
        for a, b in zip(got[f"{key}_{suffix}"], want[key], strict=True):
            assert (a is None) == (b is None), key
            if b is not None:
                assert a == pytest.approx(b, rel=rel, abs=1e-13), key
    for r, w in zip(got[f"reliability_{suffix}"], want["rel"], strict=True):
        assert r["count"] == w["count"]
        assert r["confidence"] == pytest.approx(w["confidence"], rel=rel, abs=1e-13)
        assert r["accuracy"] == pytest.approx(w["accuracy"], rel=rel, abs=1e-13)


# ----------------------------------------------------------------------------- boundaries


def test_boundary_pixels_hand_computed():
    t = np.array([[0, 0, 0, 0],
                  [0, 0, 0, 0],
                  [0, 0, 1, 1],
                  [0, 0, 1, VOID]])  # fmt: skip
    want = np.array([[0, 0, 0, 0],
                     [0, 1, 1, 1],
                     [0, 1, 1, 1],
                     [0, 1, 1, 0]], dtype=bool)  # fmt: skip
    assert (boundary_pixels(t[None], VOID)[0] == want).all()
    # No boundary: distance inf everywhere, every pixel in the last band.
    assert np.isinf(squared_boundary_distance(np.zeros((1, 3, 4), dtype=bool))).all()


def test_boundary_and_distances_against_brute_force():
    maps = [make_maps(n=2, h=23, w=31, seed=s).numpy() for s in range(3)]
    far = np.zeros((1, 150, 120), dtype=np.int64)
    far[0, 0, 0] = 1  # one corner object: distances up to sqrt(149^2 + 119^2)
    uniform = np.full((1, 9, 7), 2, dtype=np.int64)
    sparse = np.zeros((1, 500, 450), dtype=np.int64)  # 30 lone pixels: long, varied distances
    sparse.reshape(-1)[np.random.default_rng(0).integers(0, sparse.size, 30)] = 1
    for t in [*maps, far, uniform, sparse]:
        b = boundary_pixels(t, VOID)
        d2 = squared_boundary_distance(b)
        for i in range(len(t)):
            assert (b[i] == ref_boundary(t[i])).all()
            assert np.array_equal(d2[i], ref_dist2(b[i]))  # exact, inf included


def test_bands_are_exact_at_the_edges():
    # Squared distances that sit exactly on an edge, or one below, for integer and non-integer
    # (irrational squared) edges.
    bands = (1.0, math.sqrt(2.0), 2.5, 3.0, 8.0)
    meter = BoundaryCalibrationMeter(3, bands=bands, ignore_index=VOID)
    d2 = np.array([0, 1, 2, 3, 6, 7, 8, 9, 63, 64, 65, np.inf])
    got = np.searchsorted(meter.thresholds, d2, side="right")
    want = [ref_band(v, bands) for v in d2]
    assert got.tolist() == want
    # sqrt(2.0) in float64 is slightly above sqrt(2): d^2 = 2 is below it, in band 1.
    assert want[2] == 1 and want[9] == 5 and want[8] == 4


def test_boundary_meter_hand_computed():
    # One row: classes 0 | 1, boundary at columns 5 and 6; d = 5 4 3 2 1 0 0 1 2 3 4 5.
    target = torch.tensor([[[0] * 6 + [1] * 6]])
    logits = torch.zeros(1, 2, 1, 12)
    logits[0, 0, 0, :] = math.log(3.0)  # p = (0.75, 0.25): predicts 0, confidence 0.75
    meter = BoundaryCalibrationMeter(2, bands=(3.0,), ignore_index=VOID)
    meter.update(logits, target)
    out = meter.compute()
    assert out["band_edges"] == [0.0, 3.0, None]
    assert out["count_band"] == [6, 6]  # d < 3: columns 3..8
    assert out["acc_band"] == [0.5, 0.5]  # columns 3-5 right, 6-8 wrong; 0-2 right, 9-11 wrong
    assert out["ece_band"] == pytest.approx([0.25, 0.25], abs=1e-7)
    assert out["ece_over_band"] == pytest.approx([0.25, 0.25], abs=1e-7)
    assert out["ece_under_band"] == [0.0, 0.0]


@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.5, 2.0, 5.0)])
def test_boundary_meter_against_loop_reference(bands):
    k = 4
    target = make_maps(n=3, k=k, seed=1)
    logits = make_logits(target, k, seed=2)
    meter = BoundaryCalibrationMeter(k, bands=bands, ignore_index=VOID)
    meter.update(logits, target)
    out = meter.compute()
    conf, hit = conf_hit(logits, target)
    t = target.numpy()
    group = np.full(t.shape, len(bands) + 1)
    for i in range(len(t)):
        d2 = ref_dist2(ref_boundary(t[i]))
        group[i] = np.vectorize(lambda v: ref_band(v, bands))(d2)
    valid = t != VOID
    want = ref_group_metrics(conf[valid], hit[valid], group[valid], len(bands) + 1)
    assert_groups(out, want, "band")
    assert out["band_edges"] == [0.0, *bands, None]
    # Band-weighted ECE: a float64 loop over the pixels of each band.
    weighted = sum(n * e for n, e in zip(want["count"], want["ece"], strict=True) if n)
    assert out["ece_band_weighted"] == pytest.approx(weighted / valid.sum(), abs=1e-9)
    assert out["ece_band_weighted"] >= cal_ece(logits, target) - 1e-12
    # The bands partition the valid pixels: their bins add up to CalibrationMeter's.
    cal = CalibrationMeter(k, ignore_index=VOID, classwise=False)
    cal.update(logits, target)
    total = np.sum([r["count"] for r in out["reliability_band"]], axis=0)
    assert total.tolist() == cal.compute()["reliability"]["count"]


def cal_ece(logits: torch.Tensor, target: torch.Tensor) -> float:
    meter = CalibrationMeter(logits.shape[1], ignore_index=VOID, classwise=False)
    meter.update(logits, target)
    return meter.compute()["ece"]


def test_band_weighted_ece_cannot_cancel():
    """Band 0 over-confident, band 1 under-confident by the same amount: the pooled ECE
    cancels to 0, the band-weighted ECE is the band ECE; an empty band is skipped."""
    # One boundary column between class 0 (columns 0-5) and class 1 (columns 6-11).
    target = torch.zeros(1, 12, 12, dtype=torch.int64)
    target[..., 6:] = 1
    meter = BoundaryCalibrationMeter(2, bands=(3.0, 50.0), ignore_index=VOID)
    band = torch.from_numpy(boundary_bands(target.numpy(), (3.0, 50.0), VOID))
    assert set(band.unique().tolist()) == {0, 1}  # band 2 (d >= 50) is empty
    # Confidence 0.8 everywhere; accuracy 0.6 near the boundary (over) and 1.0 inside (under).
    rng = np.random.default_rng(0)
    pred = target.clone()
    near = (band == 0).nonzero().tolist()
    rng.shuffle(near)
    for idx in near[: int(0.4 * len(near))]:
        pred[tuple(idx)] = 1 - pred[tuple(idx)]
    gap = math.log(0.8 / 0.2)
    logits = torch.stack([(pred == 0).float() * gap, (pred == 1).float() * gap], dim=1)
    meter.update(logits, target)
    out = meter.compute()
    n0, n1 = out["count_band"][:2]
    acc0 = out["acc_band"][0]
    assert out["count_band"][2] == 0 and out["ece_band"][2] is None
    want = (n0 * abs(0.8 - acc0) + n1 * 0.2) / (n0 + n1)
    assert out["ece_band_weighted"] == pytest.approx(want, abs=1e-6)
    assert out["ece_band_weighted"] > cal_ece(logits, target) + 0.05


# ----------------------------------------------------------------------------- object sizes


@pytest.mark.parametrize("background", [0, None])
def test_component_areas_against_bfs(background):
    t = make_maps(n=3, k=4, h=29, w=33, seed=3).numpy()
    got = component_areas(t, 4, VOID, background)
    for i in range(len(t)):
        assert np.array_equal(got[i], ref_areas(t[i], background))


def test_size_meter_hand_computed():
    # A 2x2 object of class 1 (area 4), a diagonal pair of class 2 (8-connected: area 2) and a
    # lone class-1 pixel (area 1); class 0 is background.
    target = torch.tensor([[[1, 1, 0, 2],
                            [1, 1, 2, 0],
                            [0, 0, 0, 1]]])  # fmt: skip
    logits = torch.nn.functional.one_hot(target, 3).permute(0, 3, 1, 2).float() * 10
    meter = ObjectSizeCalibrationMeter(3, areas=(2, 4), ignore_index=VOID, background_index=0)
    meter.update(logits, target)
    out = meter.compute()
    assert out["size_edges"] == [0, 2, 4, None]
    assert out["count_size"] == [1, 2, 4]
    assert out["acc_size"] == [1.0, 1.0, 1.0]


def test_size_meter_against_loop_reference():
    k = 4
    target = make_maps(n=3, k=k, seed=5)
    logits = make_logits(target, k, seed=6)
    areas = (5, 40, 150)
    meter = ObjectSizeCalibrationMeter(k, areas=areas, ignore_index=VOID, background_index=0)
    meter.update(logits, target)
    out = meter.compute()
    conf, hit = conf_hit(logits, target)
    t = target.numpy()
    area = np.stack([ref_areas(x, 0) for x in t])
    group = np.array([sum(a >= e for e in areas) for a in area.ravel()]).reshape(area.shape)
    keep = area > 0
    want = ref_group_metrics(conf[keep], hit[keep], group[keep], len(areas) + 1)
    assert_groups(out, want, "size")


# ------------------------------------------------------------------- over / under confidence


@pytest.mark.parametrize("seed", range(4))
def test_ece_is_over_plus_under_exactly(seed):
    k = 5
    target = make_maps(n=2, k=k, seed=seed)
    logits = make_logits(target, k, seed=seed) * (0.5 + seed)  # under- to over-confident
    cal = CalibrationMeter(k, ignore_index=VOID)
    cal.update(logits, target)
    out = cal.compute()
    assert out["ece"] == out["ece_over"] + out["ece_under"]
    conf, hit = conf_hit(logits, target)
    valid = target.numpy() != VOID
    want = ref_group_metrics(conf[valid], hit[valid], np.zeros(valid.sum()), 1)
    for key in ("ece", "ece_over", "ece_under"):
        assert out[key] == pytest.approx(want[key][0], rel=1e-9, abs=1e-14), key
    band = BoundaryCalibrationMeter(k, ignore_index=VOID)
    band.update(logits, target)
    b = band.compute()
    for e, o, u in zip(b["ece_band"], b["ece_over_band"], b["ece_under_band"], strict=True):
        assert e is None or e == o + u


# --------------------------------------------------------------------------- risk-coverage


def ref_aurc(conf: np.ndarray, hit: np.ndarray) -> tuple[float, np.ndarray]:
    """Exact AURC = mean_i errors(first i) / i over the pixels sorted by decreasing confidence,
    with tied confidences averaged over their orders (the cumulative error count is
    interpolated linearly inside a group of equal values). Also the cumulative errors."""
    order = np.argsort(-conf, kind="stable")
    c, err = conf[order], 1.0 - hit[order]
    m = len(c)
    cum = np.cumsum(err)
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    ends = np.r_[starts[1:], m]
    averaged = cum.copy()
    for s, e in zip(starts, ends, strict=True):
        before = cum[s - 1] if s else 0.0
        t = np.arange(1, e - s + 1)
        averaged[s:e] = before + t * (cum[e - 1] - before) / (e - s)
    return float(np.mean(averaged / np.arange(1, m + 1))), averaged


def _risk_case(kind: str, m: int = 200_000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = 6
    target = torch.randint(0, k, (1, m), generator=g)
    if kind == "calibrated":  # labels drawn from the softmax
        logits = torch.randn(1, k, m, generator=g) * 2
        target = torch.multinomial(torch.softmax(logits[0].T, 1), 1, generator=g).T
    elif kind == "overconfident":
        logits = torch.randn(1, k, m, generator=g) * 4
    else:  # saturated: many confidences exactly 1.0 or tied in the tail
        logits = torch.randn(1, k, m, generator=g)
        u = torch.rand(m, generator=g)
        logits[0, 0, u < 0.4] += 200.0
        logits[0, 0, (u >= 0.4) & (u < 0.7)] += 16.0 + torch.randint(0, 4, (1,), generator=g)
    return logits, target


@pytest.mark.parametrize("kind", ["calibrated", "overconfident", "saturated"])
def test_aurc_against_exact_sort(kind):
    logits, target = _risk_case(kind)
    cal = CalibrationMeter(6, classwise=False)
    cal.update(logits, target)
    out = cal.compute()
    p = torch.softmax(logits, dim=1)
    conf = p.amax(dim=1).double().numpy().ravel()
    hit = (logits.argmax(dim=1) == target).double().numpy().ravel()
    exact, cum = ref_aurc(conf, hit)
    error = abs(out["aurc"] - exact)
    assert error <= out["aurc_bound"] + 1e-12
    assert error < 1e-4  # measured: see CalibrationMeter's docstring
    # The curve at coverage c = q/100: errors of the first c m pixels over c m.
    m = len(conf)
    rc = out["risk_coverage"]
    assert rc["coverage"][-1] == 1.0 and len(rc["coverage"]) == 100
    for c, r in zip(rc["coverage"], rc["risk"], strict=True):
        pos = c * m
        i = int(pos)
        want = (cum[i - 1] + (pos - i) * (cum[min(i, m - 1)] - cum[i - 1])) / pos
        assert abs(r - want) <= 1e-3, c
    assert rc["risk"][-1] == pytest.approx(1.0 - out["acc"], rel=1e-12)


def test_aurc_hand_computed():
    # Confidences 0.9 (right), 0.8 (wrong), 0.7 (right): risks 0, 1/2, 1/3 -> AURC = 5/18.
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]).log()
    cal = CalibrationMeter(2, classwise=False)
    cal.update(probs, torch.tensor([0, 0, 0]))
    out = cal.compute()
    assert out["aurc"] == pytest.approx(5 / 18, rel=1e-12)
    assert out["aurc_bound"] == 0.0  # one pixel per cell: nothing to interpolate


# ---------------------------------------------------------- streaming, DDP and state size


def _meters(k: int) -> list:
    return [BoundaryCalibrationMeter(k, ignore_index=VOID),
            ObjectSizeCalibrationMeter(k, areas=(10, 60), ignore_index=VOID, background_index=0)]


def test_streaming_equals_one_shot():
    k = 4
    target = make_maps(n=5, k=k, seed=7)
    logits = make_logits(target, k, seed=8)
    one, many = _meters(k), _meters(k)
    for a, b in zip(one, many, strict=True):
        a.update(logits, target)
        for sl in (slice(0, 1), slice(1, 3), slice(3, 5)):
            b.update(logits[sl], target[sl])
        ra, rb = a.compute(), b.compute()
        assert ra.keys() == rb.keys()
        for key in ra:
            if key == "ece_band_weighted":
                assert rb[key] == pytest.approx(ra[key], rel=1e-12)
            elif key.startswith(("ece", "acc", "conf")):
                for x, y in zip(ra[key], rb[key], strict=True):
                    assert (x is None and y is None) or y == pytest.approx(x, rel=1e-12), key
            elif key.startswith("reliability"):
                for x, y in zip(ra[key], rb[key], strict=True):
                    assert x["count"] == y["count"]
                    assert x["accuracy"] == pytest.approx(y["accuracy"], rel=1e-12)
                    assert x["confidence"] == pytest.approx(y["confidence"], rel=1e-12)
            else:
                assert ra[key] == rb[key], key


def test_state_bytes_do_not_depend_on_the_pixels():
    sizes = []
    for h, w in ((8, 8), (300, 400)):
        target = make_maps(n=1, k=3, h=h, w=w, seed=9)
        for meter in _meters(3):
            meter.update(make_logits(target, 3), target)
            sizes.append(sum(b.numel() * b.element_size() for b in meter.buffers()))
    assert sizes == [1080] * 4  # 24 (B + 1) n_bins bytes, as the docstrings say


def _rank_fn(rank: int, world: int, expected: list) -> None:
    k = 4
    target = make_maps(n=4, k=k, seed=10)
    logits = make_logits(target, k, seed=11)
    meters = _meters(k)
    part = slice(0, 1) if rank == 0 else slice(1, 4)
    for m in meters:
        m.update(logits[part], target[part])
    assert [m.compute() for m in meters] == expected


def test_two_gloo_ranks_equal_one_process():
    k = 4
    target = make_maps(n=4, k=k, seed=10)
    logits = make_logits(target, k, seed=11)
    meters = _meters(k)
    for m in meters:
        m.update(logits[:1], target[:1])
        m.update(logits[1:], target[1:])
    run_distributed(_rank_fn, 2, [m.compute() for m in meters], start_method="fork")


# ---------------------------------------------------------------------------- errors, tasks


def test_constructor_and_update_errors():
    with pytest.raises(ValueError, match="bands"):
        BoundaryCalibrationMeter(3, bands=(3.0, 2.0))
    with pytest.raises(ValueError, match="bands"):
        BoundaryCalibrationMeter(3, bands=(0.0,))
    with pytest.raises(ValueError, match="areas"):
        ObjectSizeCalibrationMeter(3, areas=(10.5,))
    with pytest.raises(ValueError, match="n_bins"):
        ObjectSizeCalibrationMeter(3, n_bins=0)
    meter = BoundaryCalibrationMeter(3)
    with pytest.raises(ValueError, match=r"\(N, K, H, W\)"):
        meter.update(torch.randn(2, 3, 5), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        meter.update(torch.randn(2, 3, 5, 5), torch.full((2, 5, 5), 7))
    empty = meter.compute()
    assert empty["count_band"] == [0, 0, 0] and empty["ece_band"] == [None] * 3


def test_segmentation_test_meters_include_the_regions():
    from cals_seg.tasks import SegmentationTask

    task = SegmentationTask(None, None, None, torch.nn.Identity(), 3, VOID,
                            ["background", "a", "b"])  # fmt: skip
    assert {"boundary", "size"} <= set(task.meters(test=True))
    assert task.meters(test=True)["size"].background_index == 0
    # Validation keeps the boundary meter (val_ece_band_weighted in the history), not sizes.
    assert "boundary" in task.meters(test=False) and "size" not in task.meters(test=False)
