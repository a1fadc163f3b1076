"""tools/margin.py: logit-gap statistics against a float64 computation over every gap, and the
sweep's recommendation against the rule applied to the runs' own history files."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from cals_seg.config.schema import load_config
from cals_seg.evaluation.stream import unpack_batch
from cals_seg.runs.margin_choice import confidence_cap, recommend
from cals_seg.tasks import build_task
from cals_seg.utils.io import load_checkpoint, read_jsonl

from ._undrawn import children_undrawn
from .conftest import TRAINED_NAME, copy_run, load_tool
from .test_pipeline import ROOT

MARGINS = (0.05, 0.1, 0.2, 0.4)
SWEEP_MARGINS = ("0.1", "3")


def _train_here(out, margin: str, sets: list[str]) -> str:
    """Train, in this process, the cals_alm run of ``margin`` that the sweep below would train
    in a subprocess (``run_one``): the same config (the sweep's ``--set`` values, its name,
    folder and seed), so that the sweep reuses it (it compares the config first, and reports a
    run trained with another as failed); its figures undrawn. Returns the run's folder name."""
    import warnings

    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    from .conftest import figures_undrawn

    name = f"synthetic_deeplabv3_cals_alm_m{margin}"
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", [
        "train.threads=1", "train.epochs=1", *sets, f"loss.params.margin={margin}",
        f"name={name}", f"name={name}_seed0", f"output_dir={out / 'runs'}", "train.seed=0",
        "train.progress=false"], "cals_alm")
    seed_everything(cfg.train.seed)
    with warnings.catch_warnings(), figures_undrawn():
        warnings.simplefilter("ignore")
        fit(cfg, build_task(cfg))
    return f"{name}_seed0"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, trained_run):
    """The sweep at the shared runs' tiny settings (conftest.tiny_seg_sets, one epoch): its ce
    run is a copy of the shared one (trained with these settings under the name the sweep gives
    it) and its cals_alm margins runs trained here with the config the sweep gives each, which
    the sweep reuses (no training subprocess: ``run_one``'s is run by tests/test_compare.py)."""
    tmp = tmp_path_factory.mktemp("margin")
    sets = trained_run.sets
    out = tmp / "sweep"
    copy_run(trained_run.folder, out / "runs")
    here = [_train_here(out, margin, sets) for margin in SWEEP_MARGINS]
    printed = io.StringIO()
    # the runs' figures (subprocesses, were a run not reused) are not what this file checks
    with children_undrawn(), contextlib.redirect_stdout(printed):
        rc = load_tool("margin").main(
            ["sweep", str(ROOT / "configs" / "synthetic_deeplabv3.yaml"), "--margins",
             *SWEEP_MARGINS, "--epochs", "1", "--jobs", "3", "--out", str(out), "--set", *sets]
        )
    print(printed.getvalue())
    for name in (TRAINED_NAME, *here):  # not trained again: the config matched
        assert f"reusing {out / 'runs' / name}" in printed.getvalue()
    return rc, out


def _all_gaps(run_dir):
    """Every (valid pixel, class) gap of the validation split, float64, one image at a time."""
    cfg = load_config(run_dir / "config.yaml")
    task = build_task(cfg)
    task.model.load_state_dict(load_checkpoint(run_dir / "checkpoint_best.pt")["model"])
    task.model.eval()
    rows = []
    with torch.no_grad():
        for i in range(len(task.val_set)):
            x, y = unpack_batch(task.val_set[i])
            logits = task.model(x[None])[0].double().numpy()  # (K, H, W)
            k = logits.shape[0]
            flat = logits.reshape(k, -1).T[y.numpy().reshape(-1) != task.ignore_index]
            rows.append(flat.max(axis=1, keepdims=True) - flat)
    return np.concatenate(rows), task.num_classes


def test_gaps_against_float64_reference(sweep, tmp_path, capsys):
    _, out = sweep
    run_dir = out / "runs" / "synthetic_deeplabv3_ce_seed0"
    capsys.readouterr()
    width = 0.001
    rc = load_tool("margin").main(
        ["gaps", str(run_dir), "--margins", *map(str, MARGINS), "--bin-width", str(width),
         "--out", str(tmp_path / "gaps.json")]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    got = json.loads((tmp_path / "gaps.json").read_text())
    gaps, k = _all_gaps(run_dir)
    largest = gaps.max(axis=1)
    n = len(largest)
    assert got["pixels"] == n and got["num_classes"] == k == 11 and got["split"] == "val"
    assert f"{n} valid pixels" in printed and "conf. cap" in printed
    tol = width / 2 + 1e-5  # a percentile is within half a bin (float32 logits: + rounding)
    for key, values in (("largest_gap", largest), ("all_gaps", gaps.reshape(-1))):
        s = got[key]
        assert s["count"] == values.size
        assert s["mean"] == pytest.approx(values.mean(), abs=1e-5)
        assert s["max"] == pytest.approx(values.max(), abs=1e-5)
        for q, v in s["percentiles"].items():
            assert v == pytest.approx(np.percentile(values, float(q)), abs=tol), (key, q)
    assert got["all_gaps"]["min"] == 0.0  # the top class's own gap
    assert [m["margin"] for m in got["margins"]] == list(MARGINS)
    conf = 1.0 / np.exp(-gaps).sum(axis=1)
    one = 1.5 / n  # float32 vs float64 gaps: at most one pixel on the other side of m
    for row in got["margins"]:
        m = row["margin"]
        cap = 1.0 / (1.0 + (k - 1) * math.exp(-m))
        assert row["confidence_cap"] == pytest.approx(cap, rel=1e-15)
        assert row["pixels_binding"] == pytest.approx((largest > m).mean(), abs=one)
        assert row["gaps_binding"] == pytest.approx((gaps > m).mean(), abs=one / k)
        assert row["pixels_above_cap"] == pytest.approx((conf > cap).mean(), abs=one)
    # the margins straddle the gaps of this 1-epoch model: some bind, some not
    binding = [row["pixels_binding"] for row in got["margins"]]
    assert binding == sorted(binding, reverse=True) and binding[0] > binding[-1]


def test_gaps_cap_formula_hand_values():
    assert confidence_cap(6.0, 11) == pytest.approx(1 / (1 + 10 * math.exp(-6)))
    assert round(confidence_cap(6.0, 11), 3) == 0.976
    assert confidence_cap(0.0, 4) == 0.25  # every gap 0: uniform


def test_sweep_recommendation_follows_the_validation_rule(sweep, capsys):
    rc, out = sweep
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    names = ["synthetic_deeplabv3_ce_seed0"] + [
        f"synthetic_deeplabv3_cals_alm_m{m}_seed0" for m in SWEEP_MARGINS
    ]
    val = []
    for name in names:
        run_dir = out / "runs" / name
        best = [h for h in read_jsonl(run_dir / "history.jsonl") if h["best"]][-1]
        test = json.loads((run_dir / "test_metrics.json").read_text())
        val.append((best["val_ece"], best["val_miou"], test["pre_ts"]["ece"]))
        cfg = load_config(run_dir / "config.yaml")
        assert cfg.train.epochs == 1
        if name != names[0]:
            assert cfg.loss.name == "cals_alm" and cfg.loss.params["margin"] == float(
                name.split("_m")[1].split("_")[0])
    rows = res["rows"]
    assert [r["margin"] for r in rows] == [None, *map(float, SWEEP_MARGINS)]
    for row, (ece, miou, test_ece) in zip(rows, val, strict=True):
        assert (row["val_ece"], row["val_score"], row["test_ece"]) == (ece, miou, test_ece)
    ce_miou = val[0][1]
    eligible = [(ece, -miou, float(m)) for m, (ece, miou, _) in zip(SWEEP_MARGINS, val[1:],
                                                                       strict=True)
                if 100 * (ce_miou - miou) <= 1.0 + 1e-9]
    expected = min(eligible)[2] if eligible else None
    assert res["recommended_margin"] == expected
    md = (out / "results.md").read_text()
    assert "| CE (no penalty) |" in md and "val mIoU" in md and "test ECE" in md
    if expected is not None:
        assert f"recommended margin: {expected:g}" in md
        assert f"| {expected:g} (recommended) |" in md


def test_recommend_rule_on_given_numbers():
    ce = {"score_name": "mIoU", "val_score": 0.500, "val_ece": 0.030}

    def cand(m, ece, score):
        return {"margin": m, "val_ece": ece, "val_score": score}

    # m = 4 has the lowest ECE but costs 2 points; m = 6 costs 0.8; m = 8 gains
    cands = [cand(4, 0.005, 0.480), cand(6, 0.010, 0.492), cand(8, 0.020, 0.505)]
    choice, reason = recommend(ce, cands, 1.0)
    assert choice["margin"] == 6 and "within 1 points" in reason
    choice, _ = recommend(ce, cands, 2.5)
    assert choice["margin"] == 4
    choice, _ = recommend(ce, cands, 0.0)
    assert choice["margin"] == 8
    choice, reason = recommend(ce, [cand(4, 0.005, 0.40)], 1.0)
    assert choice is None and "no margin" in reason
    choice, reason = recommend(ce, [cand(10, 0.040, 0.50)], 1.0)
    assert choice["margin"] == 10 and "does not beat CE" in reason
