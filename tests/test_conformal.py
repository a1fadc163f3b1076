"""Conformal prediction sets: scores, threshold rules, guarantees, streaming, DDP, the meter.

The guarantee tests draw labels from the given probabilities (so the probabilities are
exactly calibrated), build a pool of 600 such images once, and repeat 200 random
calibration / test splits of the pool. Conditional on the pool, a uniformly random split makes
the images exchangeable, so each theorem holds exactly for the mean over splits; what the test
allows beyond it is the Monte-Carlo error of 200 splits: 3 standard errors of the mean
(``3 sd / sqrt(200)`` of the per-split values, about a 1 in 700 chance of a false alarm per
assertion for a valid method).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from cals_seg.evaluation.conformal import (
    ConformalSets,
    aps_scores,
    coverage_needed,
    crc_threshold,
    image_risk_curves,
    image_scores,
    lac_scores,
    parse_mode,
    pixel_uniforms,
    quantile_threshold,
    score_cells,
)
from cals_seg.metrics.conformal import PredictionSetMeter
from cals_seg.metrics.regions import boundary_bands

from ._dist import run_distributed

K, H, W = 4, 12, 12
POOL, N_CAL, SPLITS, GRID = 600, 200, 200, 2**10
ALPHAS = (0.01, 0.05, 0.1)
BANDS = (1.0, 2.0)


def _pool(seed: int = 0, n: int = POOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with blocky class regions, a per-image sharpness (so images differ in
    difficulty) and pixel noise; labels sampled from their softmax (true calibration)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.zeros(n, K, H, W)
    cls = torch.randint(0, K, (n, 2, 2), generator=g)
    for a in range(2):
        for b in range(2):
            rows, cols = slice(a * H // 2, (a + 1) * H // 2), slice(b * W // 2, (b + 1) * W // 2)
            base[torch.arange(n), cls[:, a, b], rows, cols] += 1.5
    sharp = 0.5 + 3.0 * torch.rand(n, 1, 1, 1, generator=g)
    logits = sharp * (base + 0.5 * torch.randn(n, K, H, W, generator=g))
    probs = logits.softmax(dim=1).permute(0, 2, 3, 1).reshape(-1, K)
    y = torch.multinomial(probs, 1, generator=g).view(n, H, W)
    return logits, y


@pytest.fixture(scope="module")
def pool():
    return _pool()


def _splits(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(POOL) for _ in range(SPLITS)]


def _true_cells(cs: ConformalSets, logits, y):
    cells, yy, valid = cs.cells(logits, y)
    return cells.gather(1, yy.unsqueeze(1)).squeeze(1), yy, valid


def _check_mean(values: np.ndarray, upper: float, lower: float | None = None) -> None:
    se = values.std(ddof=1) / math.sqrt(len(values))
    mean = values.mean()
    assert mean <= upper + 3 * se, (mean, upper, se)
    if lower is not None:
        assert mean >= lower - 3 * se, (mean, lower, se)


# --------------------------------------------------------------------------------------------
# Hand cases and loop references.
# --------------------------------------------------------------------------------------------


def test_lac_and_aps_hand_case():
    p = torch.tensor([0.5, 0.3, 0.2]).view(1, 3, 1)
    assert torch.allclose(lac_scores(p).view(-1), torch.tensor([0.5, 0.7, 0.8]))
    s = aps_scores(p, torch.tensor([[0.5]])).view(-1)
    assert torch.allclose(s, torch.tensor([0.25, 0.65, 0.9]))
    # ties broken by class index: p = (0.4, 0.4, 0.2), u = 1: 0.4, 0.8, 1.0
    s = aps_scores(torch.tensor([0.4, 0.4, 0.2]).view(1, 3, 1), torch.tensor([[1.0]]))
    assert torch.allclose(s.view(-1), torch.tensor([0.4, 0.8, 1.0]))


def _aps_loop(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    n, k, q = p.shape
    out = np.zeros_like(p, dtype=np.float64)
    for i in range(n):
        for j in range(q):
            order = sorted(range(k), key=lambda c: (-p[i, c, j], c))
            mass = 0.0
            for c in order:
                out[i, c, j] = mass + u[i, j] * p[i, c, j]
                mass += p[i, c, j]
    return np.clip(out, 0, 1)


def test_aps_and_sets_against_loops():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 4, 4, generator=g) * 2
    probs = logits.softmax(dim=1).reshape(3, 5, 16)
    u = pixel_uniforms(probs, seed=7)
    assert ((u > 0) & (u < 1)).all()
    ref = _aps_loop(probs.double().numpy(), u.numpy())
    np.testing.assert_allclose(aps_scores(probs, u).double().numpy(), ref, atol=1e-6)
    for score in ("lac", "aps"):
        cs = ConformalSets(5, 0.1, score=score, seed=7, grid=GRID)
        cs.threshold_index.fill_(GRID // 2)
        sets = cs.sets(logits).reshape(3, 5, 16).numpy()
        s = 1 - probs.double().numpy() if score == "lac" else ref
        for i in range(3):
            for c in range(5):
                for j in range(16):  # in the set iff score <= 1/2 (up to float32 rounding)
                    if abs(s[i, c, j] - 0.5) > 1e-6:
                        assert sets[i, c, j] == (s[i, c, j] <= 0.5)


def test_uniforms_do_not_depend_on_the_batch():
    probs = torch.randn(4, 3, 25).softmax(dim=1)
    whole = pixel_uniforms(probs, 1)
    assert torch.equal(torch.cat([pixel_uniforms(probs[:1], 1), pixel_uniforms(probs[1:], 1)]),
                       whole)
    assert not torch.equal(pixel_uniforms(probs, 2), whole)
    assert abs(float(whole.mean()) - 0.5) < 0.1


def test_score_cells_are_exact():
    s = torch.tensor([0.0, 0.5, 0.5 + 2**-20, 1.0])
    assert score_cells(s, 4).tolist() == [0, 2, 3, 4]


def test_crc_threshold_against_rational_loop():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        curves = np.sort(rng.integers(0, 2**32, (n, 17)), axis=1)[:, ::-1].copy()
        curves[:, -1] = 0
        risk = curves.sum(axis=0)
        alpha = float(rng.choice([0.01, 0.05, 0.1, 0.3, 0.5]))
        ref = next((g for g in range(17)
                    if Fraction(n, n + 1) * Fraction(int(risk[g]), 2**32 * n)
                    + Fraction(1, n + 1) <= Fraction(str(alpha))), 16)
        assert crc_threshold(risk.tolist(), n, alpha) == ref
    assert crc_threshold([5, 0], 0, 0.1) == 1


def test_quantile_threshold_against_sorting():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 60))
        s = rng.integers(0, 9, n)
        alpha = float(rng.choice([0.01, 0.05, 0.1, 0.3]))
        k = math.ceil((n + 1) * (1 - Fraction(str(alpha))))
        ref = 8 if k > n else int(np.sort(s)[k - 1])
        assert quantile_threshold(np.bincount(s, minlength=9).tolist(), alpha) == ref


def test_image_curves_and_scores_against_loops():
    rng = np.random.default_rng(2)
    cells = torch.from_numpy(rng.integers(0, 9, (3, 20)))
    valid = torch.from_numpy(rng.random((3, 20)) < 0.8)
    valid[2] = False
    group = torch.from_numpy(rng.integers(0, 3, (3, 20)))
    curves, totals = image_risk_curves(cells, valid, group, 2, grid=8)  # group 2: dropped
    for i in range(3):
        for g in range(2):
            m = valid[i] & (group[i] == g)
            assert int(totals[i, g]) == int(m.sum())
            for t in range(9):
                miss = int((m & (cells[i] > t)).sum())
                ref = math.ceil(Fraction(miss, int(m.sum())) * 2**32) if m.any() else 0
                assert int(curves[i, g, t]) == ref
    tau = 0.7
    s = image_scores(cells, valid, tau, grid=8)
    assert int(s[2]) == -1
    for i in range(2):
        need = math.ceil(Fraction(str(tau)) * int(valid[i].sum()))
        ref = next(t for t in range(9) if int((valid[i] & (cells[i] <= t)).sum()) >= need)
        assert int(s[i]) == ref
    assert coverage_needed(torch.tensor([10]), 0.9).tolist() == [9]  # not 10 (0.9*10 > 9)


def test_bad_arguments_are_refused():
    for mode in ("image", "image:0", "image:x", "risky", "class:1"):
        with pytest.raises(ValueError, match="mode"):
            parse_mode(mode)
    with pytest.raises(ValueError, match="alpha"):
        ConformalSets(3, 1.5)
    with pytest.raises(ValueError, match="score"):
        ConformalSets(3, 0.1, score="no_such_score")
    with pytest.raises(ValueError, match="grid"):
        ConformalSets(3, 0.1, grid=1000)


# --------------------------------------------------------------------------------------------
# Guarantees over 200 random calibration / test splits.
# --------------------------------------------------------------------------------------------


def _pixel_losses(true_cell: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Reference per-image loss curves ``(N, GRID + 1)`` in float64 (NaN where ``mask`` is
    empty): the fraction of the masked pixels whose cell exceeds each grid index."""
    t = np.arange(GRID + 1)
    out = np.full((len(true_cell), GRID + 1), np.nan)
    for i, (c, m) in enumerate(zip(true_cell, mask, strict=True)):
        if m.any():
            out[i] = (c[m][:, None] > t[None, :]).mean(axis=0)
    return out


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_risk_control_over_random_splits(pool, score):
    logits, y = pool
    cs = ConformalSets(K, 0.1, "risk", score, grid=GRID)
    true_cell, yy, valid = _true_cells(cs, logits, y)
    curves, _ = image_risk_curves(true_cell, valid, torch.zeros_like(yy), 1, GRID)
    curves = curves[:, 0].numpy()
    losses = _pixel_losses(true_cell.numpy(), valid.numpy())
    splits = _splits()
    sums = [curves[perm[:N_CAL]].sum(axis=0).tolist() for perm in splits]
    for alpha in ALPHAS:
        risks = []
        for perm, risk_sum in zip(splits, sums, strict=True):
            g = crc_threshold(risk_sum, N_CAL, alpha)
            risks.append(losses[perm[N_CAL:], g].mean())
        _check_mean(np.array(risks), alpha, alpha - 2 / (N_CAL + 1))


@pytest.mark.parametrize("score", ["lac", "aps"])
def test_image_coverage_over_random_splits(pool, score):
    logits, y = pool
    tau = 0.9
    cs = ConformalSets(K, 0.1, f"image:{tau}", score, grid=GRID)
    true_cell, _, valid = _true_cells(cs, logits, y)
    s = image_scores(true_cell, valid, tau, GRID).numpy()
    losses = _pixel_losses(true_cell.numpy(), valid.numpy())
    for alpha in ALPHAS:
        rates = []
        for perm in _splits():
            cal, test = perm[:N_CAL], perm[N_CAL:]
            g = quantile_threshold(np.bincount(s[cal], minlength=GRID + 1).tolist(), alpha)
            rates.append((1 - losses[test, g] < tau - 1e-12).mean())
        rates = np.array(rates)
        _check_mean(rates, alpha)
        if alpha == 0.1:
            assert rates.mean() > alpha / 3  # not trivially conservative


@pytest.mark.parametrize(("mode", "score"), [("class", "lac"), ("band", "aps")])
def test_group_conditional_risk_over_random_splits(pool, mode, score):
    logits, y = pool
    cs = ConformalSets(K, 0.1, mode, score, bands=BANDS, grid=GRID)
    true_cell, yy, valid = _true_cells(cs, logits, y)
    group = cs.pixel_groups(logits, true_cell, yy)
    if mode == "band":  # the groups are the bands of the predicted map
        ref = boundary_bands(logits.argmax(dim=1).numpy(), BANDS).reshape(POOL, -1)
        assert np.array_equal(group.numpy(), ref)
    curves, totals = image_risk_curves(true_cell, valid, group, cs.num_groups, GRID)
    losses = [_pixel_losses(true_cell.numpy(), (valid & (group == g)).numpy())
              for g in range(cs.num_groups)]
    curves, present = curves.numpy(), (totals > 0).numpy()
    splits = _splits()
    sums = [[(curves[perm[:N_CAL], g].sum(axis=0).tolist(), int(present[perm[:N_CAL], g].sum()))
             for g in range(cs.num_groups)] for perm in splits]
    for alpha in ALPHAS:
        per_group = [[] for _ in range(cs.num_groups)]
        for perm, split_sums in zip(splits, sums, strict=True):
            for g, (risk_sum, n_g) in enumerate(split_sums):
                t = crc_threshold(risk_sum, n_g, alpha)
                values = losses[g][perm[N_CAL:], t]  # NaN: a test image without the group
                per_group[g].append(np.nanmean(values))
        for g in range(cs.num_groups):
            assert (totals[:, g] > 0).float().mean() > 0.9  # every group is populated
            _check_mean(np.array(per_group[g]), alpha, alpha - 2 / (0.9 * N_CAL + 1))


# --------------------------------------------------------------------------------------------
# Streaming, memory, DDP.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["risk", "image:0.9", "class", "band"])
def test_streaming_equals_one_shot(pool, mode):
    logits, y = pool[0][:60], pool[1][:60]
    one = ConformalSets(K, 0.1, mode, "aps", bands=BANDS, grid=GRID)
    one.update(logits, y)
    fit = one.fit()
    many = ConformalSets(K, 0.1, mode, "aps", bands=BANDS, grid=GRID)
    for a in range(0, 60, 7):
        many.update(logits[a:a + 7], y[a:a + 7])
    assert many.fit() == fit
    for name, buf in one.named_buffers():
        assert torch.equal(buf, dict(many.named_buffers())[name])
    assert fit["calibration_images"] == 60


def _state_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def test_state_size_does_not_grow_with_pixels():
    """2.5e7 calibration pixels streamed in chunks of 1e6: the state keeps its size."""
    cs = ConformalSets(2, 0.1, "risk", "lac")
    size = _state_bytes(cs)
    assert size == 8 * ((cs.grid + 1) + 1 + 1 + 1)  # risk curve, images, seen, threshold
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 1000, 1000, generator=g)
    y = (x[:, 1] > x[:, 0] + 0.5).long()
    seen = 0
    while seen < 25 * 10**6:  # the same chunk 25 times (drawing new ones only costs time)
        cs.update(x, y)
        seen += x[0, 0].numel()
        assert _state_bytes(cs) == size
    assert seen == 25 * 10**6
    assert cs.fit()["calibration_images"] == 25


def _ddp_fn(rank: int, world: int, path: str) -> None:
    logits, y = _pool(n=40)
    out = {}
    for mode in ("risk", "image:0.9", "class", "band"):
        cs = ConformalSets(K, 0.1, mode, "aps", bands=BANDS, grid=GRID)
        for i in range(rank, 40, world):
            cs.update(logits[i:i + 1], y[i:i + 1])
        out[mode] = cs.fit()
        meter = PredictionSetMeter(K, bands=BANDS, num_groups=cs.num_groups, tau=cs.tau)
        for i in range(rank, 40, world):
            meter.update(cs.sets(logits[i:i + 1]), y[i:i + 1])
        out[mode + " test"] = meter.compute()
    with open(f"{path}.{rank}", "w") as f:
        json.dump(out, f)


def test_two_processes_give_the_threshold_of_one(tmp_path):
    path = str(tmp_path / "res")
    run_distributed(_ddp_fn, 2, path, start_method="fork")
    _ddp_fn(0, 1, path + "_one")
    one = json.load(open(path + "_one.0"))
    assert one["risk"]["threshold"] < 1.0  # a non-trivial threshold
    assert one["class"]["calibration_images"] == 40
    for rank in range(2):
        got = json.load(open(f"{path}.{rank}"))
        for key, value in one.items():
            if key.endswith("test"):  # float64 sums in another order: the counts exactly
                assert got[key]["risk"] == pytest.approx(value["risk"], rel=1e-12)
                for k in ("pixels", "count_band", "count_class", "images", "coverage"):
                    assert got[key][k] == value[k]
            else:
                assert got[key] == value


# --------------------------------------------------------------------------------------------
# The test-split meter.
# --------------------------------------------------------------------------------------------


def test_meter_against_loops():
    g = torch.Generator().manual_seed(4)
    sets = torch.rand(3, 3, 6, 6, generator=g) < 0.5
    y = torch.randint(0, 3, (3, 6, 6), generator=g)
    y[0, 0, :3] = 255
    group = torch.randint(0, 2, (3, 6, 6), generator=g)
    m = PredictionSetMeter(3, bands=(2.0,), areas=(4,), num_groups=2, tau=0.5,
                           ignore_index=255)
    m.update(sets[:2], y[:2], group[:2])
    m.update(sets[2:], y[2:], group[2:])
    out = m.compute()
    s, t, gr = sets.numpy(), y.numpy(), group.numpy()
    valid = t != 255
    yc = np.where(valid, t, 0)
    cov = np.take_along_axis(s, yc[:, None], 1)[:, 0] & valid
    size = s.sum(axis=1)
    per_image = [1 - cov[i][valid[i]].mean() for i in range(3)]
    assert out["risk"] == pytest.approx(np.mean(per_image), abs=1e-12)
    assert out["coverage"] == pytest.approx(cov.sum() / valid.sum(), abs=1e-12)
    assert out["set_size"] == pytest.approx(size[valid].mean(), abs=1e-12)
    assert out["multi"] == pytest.approx((size[valid] > 1).mean(), abs=1e-12)
    assert out["empty"] == pytest.approx((size[valid] == 0).mean(), abs=1e-12)
    below = [cov[i][valid[i]].sum() < math.ceil(0.5 * valid[i].sum()) for i in range(3)]
    assert out["coverage_image_below_tau"] == pytest.approx(np.mean(below))
    bands = boundary_bands(t, (2.0,), 255)
    for b in range(2):
        m_b = valid & (bands == b)
        ref = cov[m_b].mean() if m_b.any() else None
        assert out["coverage_band"][b] == pytest.approx(ref)
    for c in range(3):
        assert out["set_size_class"][c] == pytest.approx(size[valid & (t == c)].mean())
    for k in range(2):
        vals = [1 - cov[i][valid[i] & (gr[i] == k)].mean() for i in range(3)
                if (valid[i] & (gr[i] == k)).any()]
        assert out["risk_group"][k] == pytest.approx(np.mean(vals), abs=1e-12)


# --------------------------------------------------------------------------------------------
# The commands.
# --------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*temperature.json", "ignore:The validation NLL is minimal")
def test_eval_seg_and_predict_seg_conformal(tmp_path):
    """eval_seg --conformal writes metrics.json["conformal"][MODE] and conformal.md, saves the
    fit; predict_seg --conformal reuses it and writes the set-size PNG and the sets."""
    from pathlib import Path

    import cv2
    from PIL import Image

    from cals_seg.commands._conformal import parse_conformal
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.errors import UserError
    from cals_seg.evaluation.conformal_fit import load_conformal
    from cals_seg.tasks.segmentation import build_model

    from .conftest import figures_undrawn, load_tool

    setup = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3.yaml"
    sets = [f"data.root={tmp_path / 'data'}",
            "data.synthetic={num_train: 30, num_test: 4, image_size: 32}",
            "train.amp=none", "train.threads=1", "train.progress=false", "eval.num_maps=1",
            "train.device=cpu", "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(setup, sets, "ce")
    torch.manual_seed(0)
    run = tmp_path / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    torch.save({"model": build_model(cfg).state_dict(), "num_classes": 11, "epoch": 0},
               run / "checkpoint_best.pt")
    modes = ["risk", "image:0.5", "class", "band"]
    args = [str(run), "--out", str(tmp_path / "eval"), "--save-calibrators-to-run",
            "--conformal", "alpha=0.3", f"mode={','.join(modes)}", "score=aps"]
    # The figures are saved undrawn (drawn in test_pipeline.py); the set-size maps are not
    # matplotlib's and are written as they are.
    with figures_undrawn():
        assert load_tool("eval_seg").main(args) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert list(metrics["conformal"]) == modes
    for mode, r in metrics["conformal"].items():
        for key in ("alpha", "threshold", "calibration_images", "risk", "coverage", "set_size",
                    "coverage_band", "calibration_ids"):
            assert key in r, (mode, key)
        assert r["calibration_images"] == len(r["calibration_ids"]) >= 1
        assert len(r["coverage_band"]) == 3
        assert sum(r["count_band"]) == r["pixels"]
        assert 0 <= r["set_size"] <= 11 and 0 <= r["risk"] <= 1
        # 6 validation images, no calibrator before the sets: all 6 calibrate (3 needed)
        assert r["every"] == 1 and r["calibration_images"] == 6 and r["needs_images"] == 3
        assert r["guarantee"] == (mode in ("risk", "image:0.5")), mode
        assert r["fitted_for"]["seed"] == 0 and r["fitted_for"]["params"]["every"] == 1
    assert isinstance(metrics["conformal"]["class"]["threshold"], list)
    assert "| band |" in (tmp_path / "eval" / "conformal.md").read_text()
    assert len(list((tmp_path / "eval" / "maps").glob("*_set_size_image-0.5.png"))) == 1
    saved = run / "calibrators" / "conformal_risk_aps_a0.3_s0.json"
    assert load_conformal(saved).thresholds() == metrics["conformal"]["risk"]["threshold"]

    folder = tmp_path / "images"
    folder.mkdir()
    pixels = np.random.default_rng(0).integers(0, 256, (37, 45, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "a.png")
    out = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(folder), "--out", str(out),
                                          "--conformal", "0.3", "score=aps", "--no-progress"]) == 0
    s = np.load(out / "a_sets.npz")["sets"]
    assert s.dtype == bool and s.shape == (11, 37, 45)
    size = cv2.imread(str(out / "a_set_size.png"), cv2.IMREAD_UNCHANGED)
    assert np.array_equal(size, s.sum(axis=0))
    assert (out / "a_ambiguous.png").is_file()
    line = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
    assert line["conformal"]["threshold"] == metrics["conformal"]["risk"]["threshold"]
    # No saved fit for mode=class with LAC: predict_seg fits it on the held-out images.
    assert load_tool("predict_seg").main([str(run), str(folder), "--out", str(out),
                                          "--conformal", "alpha=0.3", "mode=class",
                                          "--no-progress"]) == 0
    assert (run / "calibrators" / "conformal_class_lac_a0.3_s0.json").is_file()
    # After a calibrator fitted on the other validation images.
    with figures_undrawn():
        assert load_tool("eval_seg").main([*args[:-2], "mode=risk", "calibrator=ts"]) == 0
    after = json.loads((tmp_path / "eval" / "metrics.json").read_text())["conformal"]["risk"]
    assert after["calibrator"] == "ts" and after["calibrator_fit"]["temperature"] > 0
    # with a calibrator the sets calibrate on every 2nd validation image, it fits on the others
    assert after["every"] == 2
    assert after["calibration_ids"] == metrics["conformal"]["risk"]["calibration_ids"][1::2]
    for bad in (["alpha=2"], ["mode=wide"], ["alpha=0.1", "colour=red"], ["score=rapz"]):
        with pytest.raises(UserError, match="--conformal"):
            parse_conformal(bad)


def test_conformal_calibrator_names_are_the_calibrators():
    """--conformal calibrator= reads the registry: every registered name is accepted, and the
    refusal of another lists them all."""
    from cals_seg.calibrators import CALIBRATORS
    from cals_seg.commands._conformal import parse_conformal
    from cals_seg.errors import UserError

    for name in CALIBRATORS:
        assert parse_conformal(["alpha=0.1", f"calibrator={name}"])["calibrator"] == name
    with pytest.raises(UserError) as err:
        parse_conformal(["alpha=0.1", "calibrator=nope"])
    assert str(list(CALIBRATORS)) in str(err.value)
