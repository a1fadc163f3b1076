"""tools/eval_cls.py: classification and text runs evaluated with the calibrators without
space, conformal sets and reliability diagrams (the library eval_seg uses), its numbers checked
against the training's test pass and against sets recomputed by a plain loop, and its bad
inputs refused in one line before any network pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .conftest import load_tool

# The figures are saved undrawn (tests/conftest.py: figures_undrawn): numbers, messages, files.
pytestmark = pytest.mark.usefixtures("undrawn_figures")


def run_eval(argv: list[str], capsys) -> tuple[int, str, str]:
    code = load_tool("eval_cls").main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_image_run_calibrators_sets_and_diagrams(cls_run, tmp_path, capsys):
    """The issue's command on the image setup: metrics.json holds pre_ts / post_ts and one
    entry per calibrator (as eval_seg's), the conformal sets with coverage, set size, coverage
    per class, threshold and calibration inputs; the uncalibrated numbers are the training's
    test pass, and the sets' numbers those of the saved fit applied by a plain loop."""
    out = tmp_path / "eval"
    # vector and dirichlet with 10 L-BFGS iterations (of 100; each a pass over validation): their
    # numbers are checked for their keys and files here, their fits in test_calibrators.py
    code, stdout, err = run_eval([cls_run, "--calibrators", "ts", "vector", "dirichlet",
                                  "--calibrator-param", "vector.max_iter=10",
                                  "dirichlet.max_iter=10", "--conformal", "alpha=0.1",
                                  "score=aps", "--out", out], capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert m["family"] == "classification" and m["split"] == "test"
    assert set(m["calibrators"]) == {"ts", "vector", "dirichlet"}
    for name, block in {"pre_ts": m["pre_ts"], "post_ts": m["post_ts"],
                        **m["calibrators"]}.items():
        assert {"acc", "ece", "aece", "nll", "reliability"} <= set(block), name
        assert (out / f"reliability_{name}.png").is_file()
    assert m["calibrators"]["ts"]["ece"] == m["post_ts"]["ece"]  # the same fit, to the bit
    assert m["calibrators"]["ts"]["acc"] == m["pre_ts"]["acc"]  # T keeps the argmax
    trained = json.loads((Path(cls_run) / "test_metrics.json").read_text())
    for key in ("acc", "ece", "aece", "nll", "count"):
        assert m["pre_ts"][key] == pytest.approx(trained["pre_ts"][key], rel=1e-9, abs=1e-12)
    assert m["temperature"] == pytest.approx(trained["temperature"], rel=1e-9)
    # the sets: metrics.json["conformal"][MODE] as eval_seg's, its numbers also at the top
    c = m["conformal"]
    r = c["risk"]
    for key in ("coverage", "set_size", "coverage_class", "threshold", "calibration_images"):
        assert c[key] == r[key], key
    assert r["score"] == "aps" and r["alpha"] == 0.1 and r["guarantee"]
    from cals_seg.evaluation.conformal_fit import choose_every

    every, _ = choose_every({"alpha": 0.1, "calibrator": None, "every": None}, 40)
    assert r["every"] == every and r["calibration_images"] == 40 // every >= 9  # 40 val inputs
    assert len(r["coverage_class"]) == 10 and not any(k.endswith("_band") for k in r)
    from cals_seg.evaluation.conformal_fit import load_conformal
    from cals_seg.runs.run import load_run

    cs = load_conformal(out / "calibrators" / "conformal_risk_aps_a0.1_s0.json", 10)
    run = load_run(cls_run, with_data=True)
    covered, sizes, per_class = [], [], {}
    with torch.no_grad():
        for i in range(len(run.task.test_set)):  # one input at a time, no loader, no meter
            x, y = run.task.test_set[i]
            s = cs.sets(run.model(x[None]).float())[0]
            covered.append(bool(s[y]))
            sizes.append(int(s.sum()))
            per_class.setdefault(y, []).append(bool(s[y]))
    assert r["coverage"] == pytest.approx(sum(covered) / len(covered), abs=1e-12)
    assert r["set_size"] == pytest.approx(sum(sizes) / len(sizes), abs=1e-12)
    assert r["coverage_class"] == pytest.approx(
        [sum(per_class[k]) / len(per_class[k]) for k in range(10)], abs=1e-12)
    assert "| risk | aps | 0.1 |" in (out / "conformal.md").read_text()
    assert "| dirichlet |" in (out / "calibrators.md").read_text()
    # --out elsewhere: the fits live with the evaluation, the run is left as it is
    assert sorted(p.name for p in (out / "calibrators").iterdir()) == [
        "conformal_risk_aps_a0.1_s0.json", "dirichlet.pt", "ts.pt", "vector.pt"]
    assert not (Path(cls_run) / "calibrators").exists()
    assert "test: acc" in stdout


def test_text_run_raps_per_class_sets(text_run, tmp_path, capsys):
    """The text setup: RAPS sets in both modes (class: one threshold per class) and the
    calibrators; no guarantee per class on 10 calibration posts is said, not fatal."""
    out = tmp_path / "eval"
    code, _, err = run_eval([text_run, "--calibrators", "ts", "vector", "dirichlet",
                             "--conformal", "alpha=0.1", "score=raps", "mode=risk,class",
                             "every=1", "--out", out], capsys)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["calibrators"]) == {"ts", "vector", "dirichlet"}
    c = m["conformal"]
    assert list(c)[:2] == ["risk", "class"] and c["mode"] == "risk"
    assert c["risk"]["calibration_images"] == 30 and c["risk"]["guarantee"]
    assert isinstance(c["class"]["threshold"], list) and len(c["class"]["threshold"]) == 6
    assert len(c["class"]["coverage_class"]) == 6 and 0 < c["risk"]["set_size"] <= 6
    assert c["class"]["guarantee"] is False and "no guarantee" in err  # 5 posts per group


def test_bad_inputs_are_refused_in_one_line(cls_run, untrained_run, tmp_path, capsys,
                                            monkeypatch):
    """A segmentation run names eval_seg; a spatial calibrator, an unknown --calibrator-param
    key and a spatial conformal mode are refused before the run is loaded, listing what is
    valid."""
    code, _, err = run_eval([untrained_run, "--out", tmp_path / "e"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "is a segmentation run" in err and f"tools/eval_seg.py {untrained_run}" in err
    import cals_seg.runs.run as run_module

    def no_load(*args, **kwargs):
        raise AssertionError("the run was loaded")

    monkeypatch.setattr(run_module, "load_run", no_load)
    for argv, expected in (
            (["--calibrators", "lts"], "--calibrators lts: a spatial calibrator"),
            (["--calibrator-param", "dirichlet.lamb=1"],
             "unknown parameter 'lamb' of calibrator dirichlet; valid keys are ['lam', 'mu', "
             "'max_iter']"),
            (["--calibrator-param", "boundary_ts.t_max=5"], "--calibrator-param boundary_ts"),
            (["--conformal", "alpha=0.1", "mode=band"], "the modes are ['risk', 'class']"),
            (["--conformal", "alpha=0.1", "calibrator=lts"], "calibrator= lts: a spatial")):
        code, _, err = run_eval([cls_run, *argv, "--out", tmp_path / "e"], capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (argv, err)
        assert expected in err, (argv, err)
        if "spatial" in expected:
            assert "use one of ['ts', 'vector', 'dirichlet'" in err
    assert not (tmp_path / "e").exists()


def test_flat_calibrators_are_those_without_space():
    from cals_seg.commands.eval_cls import flat_calibrators

    found = flat_calibrators()
    assert {"ts", "vector", "dirichlet"} <= set(found)
    assert not {"lts", "boundary_ts", "boundary_ts_fine", "image_ts"} & set(found)


def test_sample_ids_name_images_and_texts(cls_run, text_run):
    """The ids a fit records: image paths relative to the data root; texts by content."""
    from cals_seg.evaluation.evaluator import sample_ids, with_ids
    from cals_seg.runs.run import load_run

    image = load_run(cls_run, with_data=True)
    ids = sample_ids(image.task.val_set, image.config.data.root)
    assert len(ids) == 40 and ids[0].startswith("val/") and ids[0].endswith(".png")
    text = load_run(text_run, with_data=True)
    val = with_ids(text.task.val_set, text.config.data.root)
    assert len(val.ids) == len(val) == 30 and len(set(val.ids)) == 30
    assert val.ids == sample_ids(load_run(text_run, with_data=True).task.val_set)  # stable
    assert val[0][1] == text.task.val_set[0][1] and val.vocab is text.task.val_set.vocab
