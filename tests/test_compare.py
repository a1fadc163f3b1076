"""tools/compare.py on tiny runs: table with mean/std over seeds, failed runs reported, reuse."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from cals_seg.training.study import backfill_test_metrics

from ._commands_cheap import networks_built_once, seeded_networks
from ._undrawn import children_undrawn
from .conftest import TRAINED_NAME, copy_run, load_tool
from .test_pipeline import ROOT

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
# So are the figures of the runs compare trains in subprocesses (tests/_undrawn). The
# networks compare builds in this process (each run's data prepared, test metrics checked,
# calibrators fitted) are built once (tests/_commands_cheap.py); the runs trained here are seeded.
pytestmark = pytest.mark.usefixtures("undrawn_figures", "undrawn_children", "networks_once")


@pytest.fixture(scope="module")
def networks_once():
    with networks_built_once():
        yield


@pytest.fixture(scope="module")
def undrawn_children():
    with children_undrawn():
        yield


def _compare():
    return load_tool("compare")


def _train_as_compare_would(config: Path, seed: int, out: Path, sets: list[str]) -> None:
    """``out/runs/<name>_seed<seed>`` trained in this process with the config compare's
    ``run_one`` gives its subprocess (``cals_seg.training.study``), so that compare reuses it."""
    import warnings

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    name = f"{load_config(config, sets).name}_seed{seed}"
    cfg = load_config(config, [*sets, f"name={name}", f"output_dir={out / 'runs'}",
                               f"train.seed={seed}", "train.progress=false"])
    seed_everything(cfg.train.seed)
    with warnings.catch_warnings(), seeded_networks():
        warnings.simplefilter("ignore")
        fit(cfg, build_task(cfg))


def _leftover_with_another_config(config: Path, seed: int, out: Path, sets: list[str]) -> None:
    """``out/runs/<name>_seed<seed>/config.yaml`` of ``config`` with ``sets``: a run folder
    that an earlier call with other values left (stopped before its first checkpoint)."""
    from cals_seg.config.schema import load_config, save_config

    name = f"{load_config(config, sets).name}_seed{seed}"
    cfg = load_config(config, [*sets, f"name={name}", f"output_dir={out / 'runs'}",
                               f"train.seed={seed}", "train.progress=false"])
    (out / "runs" / name).mkdir(parents=True)
    save_config(cfg, out / "runs" / name / "config.yaml")


def test_compare_two_methods_two_seeds_and_a_failure(tmp_path, capsys, trained_run):
    # the shared runs' tiny settings (conftest.tiny_seg_sets, no confidence maps: the runs are
    # subprocesses that draw); seed 0 of ce is a copy of the shared one-epoch run, trained with
    # these settings under the name compare gives it, and the two seeds of cals_alm are trained
    # here, in this process, as compare would train them: compare reuses them, and trains the
    # others (seed 1 of ce and seed 0 of the failing method) in subprocesses, two at a time
    sets = trained_run.sets
    copy_run(trained_run.folder, tmp_path / "cmp" / "runs")
    for seed in (0, 1):
        _train_as_compare_would(ROOT / "configs" / "synthetic_deeplabv3_cals_alm.yaml", seed,
                                tmp_path / "cmp", sets)
    bad = tmp_path / "broken.yaml"
    text = (ROOT / "configs" / "synthetic_deeplabv3.yaml").read_text()
    # a failure no rule can see before training: the run diverges (the rules refuse a bad
    # value before any run starts, see test_compare_refuses_a_bad_config_before_any_run)
    bad.write_text(re.sub(r"lr: [0-9.e-]+", "lr: 1.0e+6",
                          text.replace("name: synthetic_deeplabv3", "name: broken")
                          .replace("method: cals_alm", "method: mbls")))
    # its seed 1 fails without a training: a folder of that name left by an earlier call with
    # another config (never overwritten; compare trains two runs, seed 0 of it and seed 1 of ce)
    _leftover_with_another_config(bad, 1, tmp_path / "cmp", [*sets, "train.epochs=2"])
    configs = [str(ROOT / "configs" / "synthetic_deeplabv3_ce.yaml"),
               str(ROOT / "configs" / "synthetic_deeplabv3_cals_alm.yaml"), str(bad)]
    out = tmp_path / "cmp"
    compare = _compare()
    rc = compare.main([*configs, "--out", str(out), "--seeds", "0", "1", "--jobs", "2",
                       "--set", *sets])
    assert rc == 1  # one method failed on every seed
    text = (out / "results.md").read_text()
    assert "| ce | 2 |" in text and "| cals_alm | 2 |" in text and " ± " in text
    assert "Failed runs" in text and "mbls, seed 0" in text and "optim.lr" in text
    assert "mbls, seed 1" in text and "another config (differs in train.epochs)" in text
    assert not (out / "runs" / "broken_seed1" / "checkpoint_best.pt").exists()
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["method"] for r in rows] == ["ce", "cals_alm", "mbls"]
    assert float(rows[0]["ece_mean"]) > 0 and rows[2]["failed"] == "2"
    for name in ("ece_vs_score.png", "reliability_grid.png", "lambda_curves_cals_alm.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "lambda_curves_ce.png").exists()
    run0 = out / "runs" / TRAINED_NAME  # the shared run's copy: reused, never trained again
    assert "reusing " + str(run0) in capsys.readouterr().out
    for run in (run0, out / "runs" / "synthetic_deeplabv3_ce_seed1"):
        assert (run / "checkpoint_best.pt").is_file()  # for eval_seg
    # a run compare trained is finished: no resume point needed
    assert not (out / "runs" / "synthetic_deeplabv3_ce_seed1" / "checkpoint_last.pt").exists()
    # a second call reuses the finished runs
    capsys.readouterr()
    compare.main(configs[:2] + ["--out", str(out), "--seeds", "0", "1", "--set", *sets,
                                "--calibrators", "ts", "boundary_ts"])
    assert capsys.readouterr().out.count("reusing") == 4
    # --calibrators: post-hoc calibrators fitted on each run's validation split, one table
    cal = (out / "calibrators.md").read_text()
    for row in ("| ce | uncalibrated | 2 |", "| ce | post-TS | 2 |", "| ce | ts | 2 |",
                "| cals_alm | boundary_ts | 2 |"):
        assert row in cal, row
    assert "band-weighted ECE" in cal and "AURC" in cal
    assert (out / "runs" / "synthetic_deeplabv3_ce_seed1" / "calibrators" / "ts.pt").is_file()
    cal_rows = {(r["method"], r["calibration"]): r
                for r in csv.DictReader((out / "calibrators.csv").open())}
    ts, post = cal_rows[("ce", "ts")], cal_rows[("ce", "post-TS")]
    assert float(ts["ece_mean"]) == pytest.approx(float(post["ece_mean"]), abs=1e-9)
    assert cal_rows[("ce", "boundary_ts")]["miou_mean"] == cal_rows[("ce", "uncalibrated")][
        "miou_mean"]
    # a finished run is never reused for a different config: reported, not overwritten
    before = (out / "runs" / "synthetic_deeplabv3_cals_alm_seed0" / "test_metrics.json").read_text()
    rc = compare.main([configs[1], "--out", str(out), "--seeds", "0",
                       "--set", *sets, "loss.params.margin=2.5"])
    assert rc == 1
    text = (out / "results.md").read_text()
    assert "trained with another config (differs in loss.params)" in text
    after = (out / "runs" / "synthetic_deeplabv3_cals_alm_seed0" / "test_metrics.json").read_text()
    assert after == before
    # boundary and interior ECE columns come from the test metrics' bands
    assert "boundary ECE" in text and "interior ECE" in text
    assert "band-weighted ECE" in text
    assert float(rows[0]["ece_boundary_mean"]) > 0 and float(rows[0]["ece_interior_mean"]) >= 0
    # a run finished before the region metrics existed: they are added once, the rest kept
    path = run0 / "test_metrics.json"
    full = json.loads(path.read_text())
    old = json.loads(path.read_text())
    dropped = ["ece_band", "count_band", "reliability_band", "ece_size", "aurc", "ece_over"]
    for view in ("pre_ts", "post_ts"):
        for key in dropped:
            del old[view][key]
    old["pre_ts"]["ece"] = 0.5  # a kept value is not recomputed
    path.write_text(json.dumps(old))
    assert backfill_test_metrics(run0) == sorted(dropped)
    new = json.loads(path.read_text())
    assert new["added_keys"] == sorted(dropped) and new["pre_ts"]["ece"] == 0.5
    for view in ("pre_ts", "post_ts"):
        assert new[view]["count_band"] == full[view]["count_band"]
        for key in ("ece_band", "ece_size"):
            for a, b in zip(new[view][key], full[view][key], strict=True):
                assert (a is None and b is None) or a == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert backfill_test_metrics(run0) == []  # nothing missing any more


def test_compare_refuses_a_bad_config_before_any_run(tmp_path, capsys):
    bad = tmp_path / "broken.yaml"
    text = (ROOT / "configs" / "synthetic_deeplabv3.yaml").read_text()
    bad.write_text(re.sub(r"margin: [0-9.]+", "margin: -1.0", text).replace(
        "method: cals_alm", "method: mbls"))
    out = tmp_path / "cmp"
    rc = _compare().main([str(bad), "--out", str(out), "--set", f"data.root={tmp_path / 'd'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: loss.params.margin: ") and "\n" not in err, err
    assert not (out / "runs").exists()


def test_results_table_has_aurc_and_the_time_ratio_to_ce(tmp_path):
    """The study table's AURC, median training seconds per epoch (first epoch left out) and the
    ratio of each row's mean to the ce row's, against values worked out by hand."""
    from cals_seg.training.tables import epoch_time, summarise, write_results

    def metrics(aurc: float) -> dict:
        view = {"miou": 0.4, "ece": 0.02, "aece": 0.02, "nll": 0.3, "aurc": aurc,
                "ece_band": [0.03, 0.01]}
        return {"pre_ts": view, "post_ts": view, "temperature": 1.0}

    # the first epoch (warm-up) is left out; the median of the rest
    assert epoch_time([{"train_time": 100.0}, {"train_time": 2.0}, {"train_time": 4.0},
                       {"train_time": 3.0}]) == 3.0
    assert epoch_time([{"train_time": 5.0}]) == 5.0  # a one-epoch run: its only epoch
    assert epoch_time([{"epoch": 0}]) is None
    rows = {
        "ce": {"summaries": [summarise(metrics(0.10), "miou", [{"train_time": t} for t in (9, 2)]),
                             summarise(metrics(0.20), "miou", [{"train_time": t} for t in (9, 4)])],
               "failed": []},
        "svls": {"summaries": [summarise(metrics(0.05), "miou",
                                         [{"train_time": t} for t in (9, 6, 9, 7)])],
                 "failed": []},
        "old": {"summaries": [summarise(metrics(0.05), "miou", None)], "failed": []},
    }
    write_results(tmp_path, rows, "mIoU")
    table = {r["method"]: r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert float(table["ce"]["aurc_mean"]) == pytest.approx(15.0)  # percent
    assert float(table["ce"]["epoch_time_mean"]) == pytest.approx(3.0)
    assert float(table["svls"]["time_ratio_mean"]) == pytest.approx(7.0 / 3.0)
    assert float(table["ce"]["time_ratio_mean"]) == pytest.approx(1.0)
    assert table["old"]["time_ratio_mean"] == ""  # not timed: no ratio
    text = (tmp_path / "results.md").read_text()
    assert "| AURC |" in text and "| time / CE |" in text and "2.33x" in text
