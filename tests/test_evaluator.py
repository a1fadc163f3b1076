"""One evaluation, owned by one object (issue 60): the Evaluator's plan comes from the config's
``eval`` section, which the flags write; its numbers equal the library's passes composed by
hand; a folder holds one evaluation; the trainer's final test runs the config's plan.

- ``--set eval.calibrators=[ts]`` gives the evaluation ``--calibrators ts`` gives (every
  number), and so do the conformal and shift keys and their flags.
- The Evaluator's numbers equal those of the engine's calls made by hand in the same order
  (temperature, calibrators, one test pass), to 1e-9.
- An evaluation into a folder that held another one removes the files the earlier one wrote
  and this one does not (only those of the manifest); metrics.json records the plan.
- A plan key with a bad value is refused in one line naming the key, before any work.
- Training with ``eval.calibrators`` in the config: test_metrics.json holds the calibrators.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest

from cals_seg.commands import eval_seg

from .conftest import SEG_SETUP, copy_run, tiny_seg_sets, untrained_seg_run

pytestmark = pytest.mark.usefixtures("undrawn_figures")

# Bookkeeping that differs between two evaluations of the same numbers.
VOLATILE = {"fit_seconds", "file", "network_passes", "plan", "loaded", "fitted_for"}


def _close(a, b, path: str = "") -> list[str]:
    """Where two metrics trees differ beyond 1e-9, the keys of :data:`VOLATILE` aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - VOLATILE
        return [d for k in sorted(keys) for d in (
            _close(a[k], b[k], f"{path}.{k}") if k in a and k in b else [f"{path}.{k}: one side"])]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: lengths"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _close(x, y, f"{path}[{i}]")]
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        same = a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9 * max(
            1.0, abs(a), abs(b))
        return [] if same else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A random-weight run of the tiny synthetic setup (6 validation, 4 test images)."""
    root = tmp_path_factory.mktemp("evaluator")
    return untrained_seg_run(root / "run", root / "synthetic", sets=[
        "data.synthetic={num_train: 12, num_test: 4, image_size: 32}", "data.crop_size=32",
        "data.val_fraction=0.5"])


def _eval(args: list) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = eval_seg.main([str(a) for a in args])
    assert code == 0
    out = Path(args[args.index("--out") + 1])
    return json.loads((out / "metrics.json").read_text())


def test_the_config_keys_and_the_flags_are_one_plan(run, tmp_path):
    common = [run, "--num-maps", "0"]
    # vector on 10 L-BFGS iterations (of 100): the two plans are compared, not the fit
    flags = _eval([*common, "--out", tmp_path / "flags", "--calibrators", "ts", "vector",
                   "--calibrator-param", "vector.max_iter=10",
                   "--conformal", "alpha=0.3", "mode=risk,class", "--shift", "fog:1"])
    keys = _eval([*common, "--out", tmp_path / "keys", "--set", "eval.calibrators=[ts, vector]",
                  "eval.calibrator_params={vector: {max_iter: 10}}",
                  "eval.conformal={alpha: 0.3, mode: [risk, class]}", "eval.shift=[fog:1]"])
    assert not _close(flags, keys), _close(flags, keys)[:5]
    assert flags["plan"] == keys["plan"]
    assert flags["plan"]["calibrators"] == ["ts", "vector"]
    assert set(flags["calibrators"]) == {"ts", "vector"} and "coverage" in flags["conformal"][
        "risk"] and list(flags["shift"]) == ["fog:1"]


def test_the_evaluator_equals_the_engine_by_hand(run, tmp_path):
    """The numbers of Evaluator.run() are those of the engine's functions called in the order
    the evaluator documents (no cache, fits made here), to 1e-9."""
    from dataclasses import replace

    from cals_seg.calibrators import calibrator_key
    from cals_seg.evaluation.engine import (
        fit_post_temperature,
        load_or_fit_calibrators,
        run_test_pass,
    )
    from cals_seg.evaluation.evaluator import EvalPlan, Evaluator
    from cals_seg.evaluation.stream import evaluation_loader
    from cals_seg.runs.run import load_run

    loaded = load_run(copy_run(run, tmp_path), with_data=True)
    plan = replace(EvalPlan.from_config(loaded.config), calibrators=("ts", "vector"),
                   fits=tmp_path / "fits", fits_why="a test", refit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = Evaluator(loaded, plan, say=lambda line: None).run().metrics
        task, infer = loaded.task, loaded.inference
        val = evaluation_loader(task.val_set, plan.batch_size)
        keys = {n: calibrator_key(loaded, n, {}, task.val_set.ids, precision=infer.amp,
                                  protocol=infer.protocol) for n in plan.calibrators}
        cals, _ = load_or_fit_calibrators(list(plan.calibrators), tmp_path / "by_hand",
                                          task.num_classes, infer, val, task.ignore_index,
                                          True, keys=keys)
        t = fit_post_temperature(infer, val, task.ignore_index)
        want = run_test_pass(infer, evaluation_loader(task.test_set, plan.batch_size),
                             lambda: task.meters(plan.n_bins, test=True), t, cals)
    assert got["temperature"] == pytest.approx(t, rel=1e-12)
    for key in ("pre_ts", "post_ts", "calibrators"):
        assert not _close(got[key], want[key]), (key, _close(got[key], want[key])[:5])


def test_a_folder_holds_one_evaluation(run, tmp_path):
    out = tmp_path / "out"
    first = _eval([run, "--out", out, "--calibrators", "ts", "vector", "--num-maps", "2",
                   "--calibrator-param", "vector.max_iter=10"])
    assert (out / "reliability_vector.png").is_file() and (out / "maps").is_dir()
    assert first["plan"]["calibrators"] == ["ts", "vector"]
    fits = sorted(p.name for p in (out / "calibrators").glob("*.pt"))
    assert fits == ["ts.pt", "vector.pt"]  # --out elsewhere: the fits live with it
    (out / "notes.txt").write_text("mine")  # not the tool's: kept
    maps = sorted(p.name for p in (out / "maps").iterdir())
    second = _eval([run, "--out", out, "--calibrators", "ts", "--num-maps", "1"])
    assert second["plan"]["calibrators"] == ["ts"] and "vector" not in second["calibrators"]
    assert not (out / "reliability_vector.png").exists()
    assert sorted(p.name for p in (out / "calibrators").glob("*.pt")) == ["ts.pt"]
    assert len(list((out / "maps").iterdir())) == 1 < len(maps)
    assert (out / "notes.txt").read_text() == "mine"
    manifest = json.loads((out / ".cals_seg_outputs.json").read_text())
    assert "reliability_vector.png" not in manifest and "metrics.json" in manifest


@pytest.mark.parametrize("item, named", [
    ("eval.calibrators=[nope]", "eval.calibrators"),
    ("eval.calibrator_params={ts: {bogus: 1}}", "eval.calibrator_params.ts.bogus"),
    ("eval.calibrator_params={nope: {}}", "eval.calibrator_params.nope"),
    ("eval.conformal={alpha: 2}", "eval.conformal"),
    ("eval.conformal={score: nope, alpha: 0.1}", "eval.conformal"),
    ("eval.shift=[fog:9]", "eval.shift"),
    ("eval.shift=[nope:1]", "eval.shift"),
    ("eval.shift_seed=-1", "eval.shift_seed"),
    ("eval.calibrator_fit_shift=true", "eval.calibrator_fit_shift"),
])
def test_a_bad_plan_key_is_one_line_before_any_work(run, tmp_path, capsys, item, named):
    out = tmp_path / "out"
    assert eval_seg.main([str(run), "--out", str(out), "--set", item]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "Traceback" not in err[0], err
    assert not (out / "metrics.json").exists()


def test_the_final_test_runs_the_configs_plan(tmp_path):
    """A config with eval.calibrators and eval.conformal: the trainer's final test evaluates
    them (test_metrics.json), fitted as the run's own; eval_seg of the run in place runs the
    same plan and gives the same numbers."""
    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    sets = [*tiny_seg_sets(tmp_path / "synthetic"), "model.encoder_name=tu-mobilenetv3_small_050",
            f"output_dir={tmp_path / 'runs'}", "name=planned", "eval.calibrators=[ts, vector]",
            "eval.calibrator_params={vector: {max_iter: 10}}", "eval.conformal={alpha: 0.4}"]
    cfg = load_config(SEG_SETUP, sets, "ce")
    seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        test = fit(cfg, build_task(cfg))
    assert set(test["calibrators"]) == {"ts", "vector"} and "risk" in test["conformal"]
    folder = cfg.run_dir
    assert (folder / "calibrators" / "vector.pt").is_file()
    saved = json.loads((folder / "test_metrics.json").read_text())
    assert saved["plan"]["calibrators"] == ["ts", "vector"]
    again = _eval([folder, "--out", folder / "eval_test"])  # the run's own plan, in place
    for key in ("pre_ts", "post_ts", "calibrators"):
        assert not _close(again[key], saved[key]), (key, _close(again[key], saved[key])[:5])
    assert all(again["calibrator_fits"][n]["loaded"] for n in ("ts", "vector"))
    shutil.rmtree(folder)


@pytest.mark.parametrize("item, named", [
    ("eval.calibrators=[lts]", "eval.calibrators lts"),
    ("eval.calibrators=[boundary_ts]", "eval.calibrators boundary_ts"),
    ("eval.conformal={alpha: 0.1, mode: band}", "mode=band"),
    ("eval.shift=[fog:1]", "eval.shift"),
])
def test_a_plan_a_classification_run_cannot_run_is_refused_up_front(cls_run, tmp_path, capsys,
                                                                     item, named):
    """A classification run's plan (from its config or --set) with a spatial calibrator, a
    spatial conformal mode or an image corruption: one line before any work, naming it."""
    from cals_seg.commands import eval_cls

    out = tmp_path / "out"
    assert eval_cls.main([str(cls_run), "--out", str(out), "--set", item]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (out / "metrics.json").exists()


def test_a_run_of_the_other_family_names_the_right_tool(cls_run, run, tmp_path, capsys):
    """eval_seg of a classification run and eval_cls of a segmentation run: one line each,
    naming the tool that takes it."""
    from cals_seg.commands import eval_cls

    assert eval_seg.main([str(cls_run), "--out", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tools/eval_cls.py" in err[0], err
    assert eval_cls.main([str(run), "--out", str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tools/eval_seg.py" in err[0], err


def test_a_text_run_is_checked_as_classification(text_run, tmp_path, capsys):
    from cals_seg.commands import eval_cls

    out = tmp_path / "out"
    assert eval_cls.main([str(text_run), "--out", str(out), "--set", "eval.shift=[fog:1]"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.shift" in err[0], err
