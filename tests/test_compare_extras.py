"""tools/compare.py with --conformal, --shift, --ensemble and run folders given instead of
configs (an imported network): the tables hold eval_seg's numbers for each run, means over seeds
and over corruptions against sums written here. No run is trained: finished runs are made with
random weights, and compare reuses them."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import torch

from ._commands_cheap import clean_figures_left_out, networks_built_once, seeded_networks
from .conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
CE = ROOT / "configs" / "synthetic_deeplabv3_ce.yaml"
# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn), eval_seg's
# clean ones not made, and a run's network built once for all the commands loading it
# (tests/_commands_cheap.py): this file checks numbers, messages and which files are written.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*temperature.json", "ignore:The validation NLL is minimal",
        "ignore:.*search boundary:UserWarning", "ignore:.*have no validation pixel"),
    pytest.mark.usefixtures("undrawn_figures", "cheaper_commands"),
]


@pytest.fixture(scope="module")
def cheaper_commands():
    with networks_built_once(), clean_figures_left_out():
        yield
EXACT = 1e-9  # relative: the tables hold eval_seg's numbers (times 100), not near ones


def _sets(tmp_path: Path) -> list[str]:
    return [f"data.root={tmp_path / 'data'}",
            "data.synthetic={num_train: 20, num_test: 3, image_size: 32}", "data.crop_size=32",
            "data.val_fraction=0.5",
            "train.amp=none", "train.threads=1", "train.progress=false", "eval.num_maps=0",
            "train.device=cpu", "eval.batch_size=4", "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]


def _finished_run(tmp_path: Path, out: Path, seed: int) -> Path:
    """OUT/runs/<name>_seed<seed> as compare would have left it (config, best checkpoint,
    test_metrics.json of one test pass), random weights of ``seed``."""
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.runs.run import Run, load_run
    from cals_seg.tasks.segmentation import build_model
    from cals_seg.training.engine import make_loader

    name = f"synthetic_deeplabv3_ce_seed{seed}"
    cfg = load_config(CE, [*_sets(tmp_path), f"name={name}", f"output_dir={out / 'runs'}",
                           f"train.seed={seed}"])
    run = out / "runs" / name
    run.mkdir(parents=True)
    save_config(cfg, run / "config.yaml")
    torch.manual_seed(seed)
    with seeded_networks():
        model = build_model(cfg)
    torch.save({"model": model.state_dict(), "num_classes": 11, "epoch": 0},
               run / "checkpoint_best.pt")
    loaded = load_run(run, with_data=True)
    test = loaded.test(make_loader(loaded.task.test_set, 4, False, 0), progress=False)
    Run(run).write_test_metrics({"pre_ts": test["pre_ts"], "post_ts": None, "temperature": 1.0,
                                 "score_metric": "miou", "precision": "none"})
    return run


def _csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_given_run_folder_with_conformal_and_shift(tmp_path, capsys):
    """A run folder given instead of a config: evaluated by eval_seg (calibrators, shift), its
    conformal evaluation after no calibrator and after ts, every number equal to eval_seg's."""
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.evaluation.shift import metric
    from cals_seg.tasks.segmentation import build_model

    cfg = load_config(CE, _sets(tmp_path))
    run = tmp_path / "mine"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    torch.manual_seed(3)
    with seeded_networks():
        model = build_model(cfg)
    torch.save({"model": model.state_dict(), "num_classes": 11, "epoch": 0},
               run / "checkpoint_best.pt")
    out = tmp_path / "cmp"
    argv = [str(run), "--out", str(out), "--calibrators", "ts", "--conformal", "alpha=0.3",
            "mode=risk,band", "--shift", "fog:1", "contrast:1", "contrast:3",
            "--calibrator-fit-shift"]
    assert load_tool("compare").main(argv) == 0, capsys.readouterr().err
    # the metrics.json eval_seg wrote for compare; eval_seg --conformal itself on the same run
    ref = json.loads((out / "eval" / "mine" / "mine" / "metrics.json").read_text())
    ref_dir = tmp_path / "ref"
    assert load_tool("eval_seg").main([str(run), "--out", str(ref_dir), "--num-maps", "0",
                                       "--conformal", "alpha=0.3", "mode=risk,band"]) == 0
    ref["conformal"] = json.loads((ref_dir / "metrics.json").read_text())["conformal"]
    assert set(ref["shift"]) == {"fog:1", "contrast:1", "contrast:3"}
    results = {r["method"]: r for r in _csv(out / "results.csv")}
    ece = 100 * ref["pre_ts"]["ece"]
    assert float(results["mine"]["ece_mean"]) == pytest.approx(ece, rel=EXACT)
    cal = {r["calibration"]: r for r in _csv(out / "calibrators.csv")}
    ece = 100 * ref["calibrators"]["ts"]["ece"]
    assert float(cal["ts"]["ece_mean"]) == pytest.approx(ece, rel=EXACT)

    conformal = {(r["calibration"], r["mode"]): r for r in _csv(out / "conformal.csv")}
    assert set(conformal) == {("uncalibrated", "risk"), ("uncalibrated", "band"),
                              ("ts", "risk"), ("ts", "band")}
    for mode in ("risk", "band"):
        want, got = ref["conformal"][mode], conformal[("uncalibrated", mode)]
        assert float(got["risk_mean"]) == pytest.approx(100 * want["risk"], rel=EXACT)
        assert float(got["coverage_mean"]) == pytest.approx(100 * want["coverage"], rel=EXACT)
        assert float(got["set_size_mean"]) == pytest.approx(want["set_size"], rel=EXACT)
        assert float(got["multi_mean"]) == pytest.approx(100 * want["multi"], rel=EXACT)
        assert float(got["coverage_boundary_mean"]) == pytest.approx(
            100 * want["coverage_band"][0], rel=EXACT)
        assert got["seeds"] == "1" and float(got["alpha"]) == 0.3
        assert float(got["calibration_images_mean"]) == want["calibration_images"] >= 1
    assert "| mine | ts | band | lac | 0.3 | 1 |" in (out / "conformal.md").read_text()

    shift = {(r["calibration"], r["corruption"]): r for r in _csv(out / "shift.csv")}
    for corruption in ("fog:1", "contrast:3"):
        for calibration, view in (("uncalibrated", "pre_ts"), ("ts+drift", "calibrators")):
            want = ref["shift"][corruption][view]
            want = want["ts+drift"] if view == "calibrators" else want
            got = shift[(calibration, corruption)]
            for key in ("ece", "ece_band_weighted", "nll", "miou", "ece_boundary"):
                value = metric(want, key)
                assert float(got[f"{key}_mean"]) == pytest.approx(value, rel=EXACT), key
    # the mean over the corruptions at severity 1, summed here
    want = statistics.fmean(ref["shift"][c]["calibrators"]["ts"]["ece_band_weighted"]
                            for c in ("fog:1", "contrast:1"))
    got = shift[("ts", "mean at severity 1")]
    assert float(got["ece_band_weighted_mean"]) == pytest.approx(want, rel=EXACT)
    assert float(shift[("uncalibrated", "clean")]["ece_mean"]) == pytest.approx(
        ref["pre_ts"]["ece"], rel=EXACT)
    # clean-fitted and drift-fitted side by side
    order = [r["calibration"] for r in _csv(out / "shift.csv") if r["corruption"] == "fog:1"]
    assert order.index("ts+drift") == order.index("ts") + 1
    assert "mean at severity 3" in (out / "shift.md").read_text()
    assert (out / "shift_ece_severity.png").stat().st_size > 0
    # a second call reuses every evaluation
    capsys.readouterr()
    assert load_tool("compare").main(argv) == 0
    printed = capsys.readouterr().out
    assert "reusing" in printed and "$ tools/eval_seg.py" not in printed
    assert "conformal 0.3" not in printed


def test_ensemble_of_the_seeds_with_shift_and_cost(tmp_path, capsys):
    """--ensemble ce: the seeds compare finished make one ensemble, evaluated by eval_seg
    --ensemble (clean and shifted), with its measured cost; a row name that is not one of the
    comparison's is refused before anything runs, naming the rows."""
    out = tmp_path / "cmp"
    runs = [_finished_run(tmp_path, out, s) for s in (0, 1)]
    argv = [str(CE), "--out", str(out), "--seeds", "0", "1", "--set", *_sets(tmp_path),
            "--shift", "gaussian_noise:2", "--ensemble"]
    assert load_tool("compare").main([*argv, "nonesuch"]) != 0
    err = capsys.readouterr().err
    assert "--ensemble nonesuch" in err and "its rows: ce" in err
    assert not (out / "ensemble.csv").exists()
    argv.append("ce")
    assert load_tool("compare").main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.count("reusing") >= 2  # nothing trained
    ref_dir = tmp_path / "ref"
    assert load_tool("eval_seg").main([*map(str, runs), "--ensemble", "--out", str(ref_dir),
                                       "--num-maps", "0", "--shift", "gaussian_noise:2"]) == 0
    ref = json.loads((ref_dir / "metrics.json").read_text())
    ens = _csv(out / "ensemble.csv")
    assert [r["ensemble"] for r in ens] == ["ce ensemble"] and ens[0]["members"] == "2"
    assert float(ens[0]["ece"]) == pytest.approx(ref["pre_ts"]["ece"], rel=EXACT)
    assert ens[0]["forward_passes_per_image"] == "2"
    assert float(ens[0]["seconds_per_image"]) > 0 and float(ens[0]["cost_ratio"]) > 0
    assert "| ce (one run, 2 seeds) |" in (out / "ensemble.md").read_text()
    shift = {(r["method"], r["calibration"], r["corruption"]): r
             for r in _csv(out / "shift.csv")}
    got = shift[("ce ensemble", "uncalibrated", "gaussian_noise:2")]
    want = ref["shift"]["gaussian_noise:2"]["pre_ts"]["ece"]
    assert float(got["ece_mean"]) == pytest.approx(want, rel=EXACT)
    # the single runs: mean over the two seeds of their own eval_seg evaluations
    single = [json.loads((out / "eval" / "ce" / r.name / "metrics.json").read_text())
              for r in runs]
    row = shift[("ce", "uncalibrated", "gaussian_noise:2")]
    assert row["seeds"] == "2"
    assert float(row["nll_mean"]) == pytest.approx(statistics.fmean(
        m["shift"]["gaussian_noise:2"]["pre_ts"]["nll"] for m in single), rel=EXACT)
    assert float(row["nll_std"]) == pytest.approx(statistics.stdev(
        m["shift"]["gaussian_noise:2"]["pre_ts"]["nll"] for m in single), rel=EXACT)


def test_imported_run_and_refusals(tmp_path, capsys):
    """A run made by tools/import_model.py is a row of compare --calibrators; a folder that is
    not a run, or --calibrator-fit-shift without --shift, is refused before anything runs."""
    from cals_seg.commands import import_model

    from .test_external_model import TinyNet, write_config

    torch.manual_seed(0)
    torch.save(TinyNet().state_dict(), tmp_path / "tiny.pt")
    config = write_config(tmp_path, tmp_path / "data", {
        "factory": "tests.test_external_model:tiny_net", "weights": str(tmp_path / "tiny.pt")})
    run = tmp_path / "imported"
    assert import_model.main([str(config), "--out", str(run)]) == 0, capsys.readouterr().err
    out = tmp_path / "cmp"
    compare = load_tool("compare")
    assert compare.main([str(run), "--out", str(out), "--calibrators", "ts", "boundary_ts"]) == 0
    cal = {r["calibration"] for r in _csv(out / "calibrators.csv") if r["method"] == "imported"}
    assert cal >= {"uncalibrated", "ts", "boundary_ts"}
    assert (out / "results.md").read_text().count("| imported | 1 |") == 1
    # compare's evaluation of a given run is an evaluation elsewhere: its fits live with it
    assert not (run / "calibrators" / "boundary_ts.pt").exists()
    assert list((out / "eval").rglob("calibrators/boundary_ts.pt"))
    capsys.readouterr()
    assert compare.main([str(tmp_path), "--out", str(tmp_path / "c2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a run" in err and "\n" not in err
    assert compare.main([str(run), "--out", str(tmp_path / "c3"), "--calibrators", "ts",
                         "--calibrator-fit-shift"]) == 2
    assert "--shift" in capsys.readouterr().err
    assert not (tmp_path / "c3" / "eval").exists()

