"""The RAPS conformal score against an independent reference (plain loops in float64 on hand
cases), its registration, and the conformal sets of classification inputs ``(N, K)``: the same
code as the segmentation sets (a 1 x 1 image per input), their coverage on exchangeable
synthetic logits for every score."""

from __future__ import annotations

import math

import pytest
import torch

from cals_seg.errors import UserError
from cals_seg.evaluation.conformal import (
    FIXED_POINT,
    ConformalSets,
    as_spatial,
    flat_risk_sum,
    image_risk_curves,
    score_cells,
)
from cals_seg.evaluation.conformal_eval import ConformalTestView
from cals_seg.evaluation.conformal_score import SCORES, class_scores, refuse_onnx
from cals_seg.evaluation.conformal_scores.aps import aps_scores, pixel_uniforms
from cals_seg.evaluation.conformal_scores.raps import RAPS, raps_scale, raps_scores


def reference_raps(p: list[float], u: float, lam: float, k_reg: int) -> list[float]:
    """RAPS of one position by its definition, one class at a time: the classes ranked by
    decreasing probability (ties: the lower index first), ``o_k`` the 1-based rank of ``k``,
    ``sum of the probabilities ranked before k + u p_k + lam max(0, o_k - k_reg)``."""
    k = len(p)
    order = sorted(range(k), key=lambda j: (-p[j], j))
    out = []
    for c in range(k):
        rank = order.index(c) + 1
        before = 0.0
        for j in order[: rank - 1]:
            before += p[j]
        out.append(before + u * p[c] + lam * max(0, rank - k_reg))
    return out


HAND = [  # (probabilities, u): a peaked one, a flat one, ties, K below and above k_reg
    ([0.5, 0.2, 0.1, 0.08, 0.05, 0.04, 0.02, 0.01], 0.3),
    ([0.125] * 8, 0.9),
    ([0.3, 0.3, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0], 0.5),
    ([0.7, 0.2, 0.1], 0.25),
    ([0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.55], 0.01),
]


@pytest.mark.parametrize(("lam", "k_reg"), [(0.01, 5), (0.2, 2), (0.0, 5), (1.5, 0)])
def test_raps_equals_the_reference_on_hand_cases(lam, k_reg):
    for p, u in HAND:
        probs = torch.tensor(p, dtype=torch.float64).view(1, -1, 1)
        got = raps_scores(probs, torch.tensor([[u]], dtype=torch.float64), lam, k_reg)
        scale = raps_scale(len(p), lam, k_reg)
        want = reference_raps(p, u, lam, k_reg)
        assert scale == pytest.approx(1 + lam * max(0, len(p) - k_reg), abs=0)
        assert got.dtype == torch.float64 and got.shape == (1, len(p), 1)
        for c, w in enumerate(want):
            assert float(got[0, c, 0]) * scale == pytest.approx(w, abs=1e-12), (p, c)
            assert 0.0 <= float(got[0, c, 0]) <= 1.0


def test_raps_is_aps_plus_the_rank_penalty_and_aps_below_k_reg():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(4, 9, 6, generator=gen, dtype=torch.float64), dim=1)
    u = pixel_uniforms(probs.float(), seed=3)
    raps = raps_scores(probs, u, 0.05, 3) * raps_scale(9, 0.05, 3)
    aps = aps_scores(probs, u)
    rank = probs.argsort(dim=1, descending=True, stable=True).argsort(dim=1) + 1
    torch.testing.assert_close(raps - aps, 0.05 * (rank - 3).clamp(min=0).double(),
                               rtol=0, atol=1e-12)
    small = probs[:, :4]  # K <= k_reg: no penalty, the scale is 1: APS itself
    torch.testing.assert_close(raps_scores(small, u, 0.05, 5), aps_scores(small, u),
                               rtol=0, atol=0)


def test_raps_is_registered_seeded_and_refused_by_onnx():
    assert "raps" in SCORES and SCORES["raps"] is RAPS
    assert (RAPS.lam, RAPS.k_reg) == (0.01, 5)  # the paper's defaults; score=raps uses them
    from cals_seg.commands._conformal import parse_conformal

    assert parse_conformal(["alpha=0.1", "score=raps"])["score"] == "raps"
    probs = torch.softmax(torch.randn(2, 12, 5, generator=torch.Generator().manual_seed(1)),
                          dim=1)
    got = class_scores(probs, "raps", seed=7)
    assert got.dtype == torch.float32 and got.shape == probs.shape
    torch.testing.assert_close(got, raps_scores(probs, pixel_uniforms(probs, 7)), rtol=0,
                               atol=0)
    assert not torch.equal(got, class_scores(probs, "raps", seed=8))  # u follows the seed
    with pytest.raises(UserError, match="score=raps: the RAPS randomisation.*--format pt2"):
        refuse_onnx("raps")
    with pytest.raises(UserError, match=r"score=aps: .*or score=lac\.$"):
        refuse_onnx("aps")  # the segmentation export's refusal names the same choices


def test_classification_sets_hold_the_classes_under_the_threshold():
    """ConformalSets on ``(N, K)`` logits: the threshold fitted, and a class in a set exactly
    when its RAPS score (the reference, undivided) is at most ``C * threshold``."""
    gen = torch.Generator().manual_seed(2)
    k = 8
    logits, target = 2 * torch.randn(200, k, generator=gen), torch.randint(0, k, (200,),
                                                                          generator=gen)
    cs = ConformalSets(k, 0.2, score="raps", seed=4)
    cs.update(logits, target)
    fit = cs.fit()
    assert fit["calibration_images"] == 200 and fit["guarantee"]
    test = 2 * torch.randn(30, k, generator=gen)
    sets = cs.sets(test)
    assert sets.shape == (30, k) and sets.dtype == torch.bool
    probs = test[:, :, None].softmax(dim=1)  # as the sets compute them: (N, K, 1), float32
    u = pixel_uniforms(probs, 4)[:, 0]  # (its bits: another layout may round otherwise)
    scale = raps_scale(k)
    for i in range(30):
        want = reference_raps(probs[i, :, 0].double().tolist(), float(u[i]), 0.01, 5)
        for c in range(k):
            cell = math.ceil(float(torch.tensor(want[c] / scale, dtype=torch.float64)
                                   .float()) * cs.grid)
            assert bool(sets[i, c]) == (min(cell, cs.grid) <= int(cs.threshold_index[0])), (i, c)


def test_flat_risk_sums_equal_the_per_image_curves():
    """One position per image: the histogram path gives the per-image curves' sum bit for bit
    (``risk`` and ``class`` groups), and the 2-D batch equals its 4-D view."""
    gen = torch.Generator().manual_seed(3)
    n, k, grid = 57, 5, 64
    cells = torch.randint(0, grid + 1, (n, 1), generator=gen)
    valid = torch.rand(n, 1, generator=gen) > 0.1
    for groups, group in ((1, torch.zeros(n, 1, dtype=torch.int64)),
                          (k, torch.randint(0, k, (n, 1), generator=gen))):
        curves, totals = image_risk_curves(cells, valid, group, groups, grid)
        summed, images = flat_risk_sum(cells, valid, group, groups, grid)
        assert torch.equal(summed, curves.sum(dim=0)) and torch.equal(images, (totals > 0).sum(0))
        assert int(summed.max()) <= n * FIXED_POINT
    logits, target = torch.randn(n, k, generator=gen), torch.randint(0, k, (n,), generator=gen)
    for mode in ("risk", "class"):
        flat, spatial = ConformalSets(k, 0.1, mode, "aps"), ConformalSets(k, 0.1, mode, "aps")
        flat.update(logits, target)
        spatial.update(*as_spatial(logits, target))
        assert torch.equal(flat.risk_sum, spatial.risk_sum) and flat.fit() == spatial.fit()
    with pytest.raises(ValueError, match=r"\(N, K, H, W\) or \(N, K\)"):
        ConformalSets(k, 0.1).update(torch.randn(3, k, 2), torch.zeros(3, 2, dtype=torch.int64))


def exchangeable(seed: int, n: int, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs whose labels are drawn from the softmax of their own logits: calibration
    and test points are exchangeable, the only assumption of the guarantee."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(n, k, generator=gen)
    labels = torch.multinomial(logits.softmax(dim=1), 1, generator=gen).view(-1)
    return logits, labels


def coverage_se(n_cal: int, n_test: int, alpha: float, seeds: int) -> tuple[float, float]:
    """The expected coverage of split conformal at level ``alpha`` with ``n_cal`` calibration
    points, ``ceil((n + 1)(1 - alpha)) / (n + 1)``, and the standard error of the mean test
    coverage over ``seeds`` independent draws: per draw, the variance of the Beta law of the
    coverage given the calibration points, ``l (n + 1 - l) / ((n + 1)^2 (n + 2))`` with
    ``l = n + 1 - ceil((n + 1)(1 - alpha))``, plus the test sampling's ``c (1 - c) / n_test``."""
    m = n_cal + 1
    covered = math.ceil(m * (1 - alpha) - 1e-9)
    expected, miss = covered / m, m - covered
    var = miss * (m - miss) / (m * m * (n_cal + 2)) + expected * (1 - expected) / n_test
    return expected, math.sqrt(var / seeds)


@pytest.mark.parametrize("score", ["lac", "aps", "raps"])
def test_classification_coverage_within_three_standard_errors(score):
    """The cheap version of benchmarks/cls_coverage.py: over 3 seeds of exchangeable synthetic
    logits (300 calibration, 1000 test inputs, K = 10), the mean test coverage of ``score`` at
    alpha = 0.1 lies within 3 standard errors of its expectation (itself within
    ``1 / (n + 1)`` of 0.9), and of 0.9; the set size, the coverage per class and the
    threshold are reported by the same consumer eval_cls uses."""
    k, alpha, seeds = 10, 0.1, 3
    coverages, sizes = [], []
    for seed in range(seeds):
        cal_logits, cal_labels = exchangeable(100 + seed, 300, k)
        test_logits, test_labels = exchangeable(200 + seed, 1000, k)
        cs = ConformalSets(k, alpha, "risk", score, seed=seed)
        cs.update(cal_logits, cal_labels)
        fit = {**cs.fit()}
        assert fit["calibration_images"] == 300 and fit["guarantee"]

        class Task:
            num_classes, ignore_index = k, -100

        view = ConformalTestView({"risk": cs}, {"risk": fit}, None, Task, torch.device("cpu"),
                                 None, None, 0)
        for i in range(0, 1000, 250):  # streamed in batches, as a test pass
            view.update(test_logits[i:i + 250], test_labels[i:i + 250], None)
        r = view.results()["risk"]
        assert len(r["coverage_class"]) == k and r["images"] == 1000
        assert 0 <= r["threshold"] <= 1 and r["set_size"] >= 1 - r["empty"]
        coverages.append(r["coverage"])
        sizes.append(r["set_size"])
    mean = sum(coverages) / seeds
    expected, se = coverage_se(300, 1000, alpha, seeds)
    assert 1 - alpha <= expected <= 1 - alpha + 1 / 301
    assert abs(mean - expected) <= 3 * se, (score, coverages, expected, se)
    assert abs(mean - (1 - alpha)) <= 3 * se + 1 / 301, (score, coverages)
    assert 1 < sum(sizes) / seeds < k  # informative sets


def test_score_cells_of_raps_stay_on_the_grid():
    probs = torch.softmax(5 * torch.randn(3, 40, 2, generator=torch.Generator().manual_seed(5)),
                          dim=1)
    cells = score_cells(class_scores(probs, "raps"))
    assert int(cells.min()) >= 0 and int(cells.max()) <= 2**12
