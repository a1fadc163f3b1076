"""The run as one object: its file names (spelt in one module), its folder checks, and the one
test pass (raw, post-TS and calibrated views from one pass) against meters fed by hand."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cals_seg.calibrators import build_calibrator
from cals_seg.errors import RunExistsError
from cals_seg.evaluation.engine import calibrated_test, fit_calibrators, run_test_pass
from cals_seg.evaluation.stream import Inference
from cals_seg.metrics import CalibrationMeter, SegmentationMeter
from cals_seg.runs import run as run_mod
from cals_seg.runs.run import Run

ROOT = Path(__file__).resolve().parents[1]
VOID = 255
RUN_FILE_NAMES = ("config.yaml", "history.jsonl", "checkpoint_last.pt", "checkpoint_best.pt",
                  "test_metrics.json", "temperature.json", "metrics.json")


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docs]


def test_run_file_names_are_spelt_in_one_module():
    """Outside docstrings (and the tools' --help texts, which must not import torch), the names
    of a run's files appear in cals_seg/runs/run.py only."""
    found = {}
    for path in sorted((ROOT / "cals_seg").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("cals_seg/runs/run.py", "cals_seg/commands/_cli.py"):
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            for name in RUN_FILE_NAMES:
                if name in node.value:
                    found.setdefault(rel, []).append((node.lineno, name))
    assert found == {}
    spelt = {c.value for c in _string_constants(ast.parse(Path(run_mod.__file__).read_text()))}
    assert set(RUN_FILE_NAMES) <= spelt


def test_run_paths_and_files(tmp_path):
    run = Run(tmp_path / "r")
    assert run.config_file == tmp_path / "r" / "config.yaml"
    assert run.history_file.name == "history.jsonl"
    assert (run.last.name, run.best.name) == ("checkpoint_last.pt", "checkpoint_best.pt")
    assert run.checkpoint_file("best") == run.best and run.checkpoint_file("last") == run.last
    assert run.test_metrics.name == "test_metrics.json"
    assert run.temperature_file.name == "temperature.json"
    assert run.plots.name == "plots" and run.calibrator_file("ts") == run.path / "calibrators/ts.pt"
    assert Run.eval_metrics(run.eval_dir("test")) == run.path / "eval_test" / "metrics.json"
    assert run.holds_run() == [] and not run.finished() and run.trained_precision() is None
    run.check_start(resume=False)  # nothing there: a new run may start
    run.path.mkdir()
    run.append_history({"epoch": 0, "precision": "bf16"})
    run.append_history({"epoch": 1, "precision": "bf16"})
    assert run.trained_precision() == "bf16"
    with pytest.raises(RunExistsError, match=r"history.jsonl.*--resume"):
        run.check_start(resume=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint_last.pt"):
        run.check_start(resume=True)
    run.trim_history(1)
    assert [h["epoch"] for h in run.history()] == [0]
    run.write_test_metrics({"precision": "none", "pre_ts": {"ece": float("nan")}})
    # the training's precision (history), not the test pass's inference precision
    assert run.finished() and run.trained_precision() == "bf16"
    assert json.loads(run.test_metrics.read_text())["pre_ts"]["ece"] is None  # standard JSON
    run.write_temperature(1.5)
    assert run.read_temperature() == 1.5
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        (run.path / name).write_bytes(b"x")
    run.drop_checkpoints("best")
    assert not run.last.exists() and run.best.exists()
    run.drop_checkpoints("none")
    assert not run.best.exists()


def test_resolve_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Run.resolve(tmp_path / "nothing")
    (tmp_path / "checkpoint_best.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint \(checkpoint_last.pt\)"):
        Run.resolve(tmp_path, "last", need_config=False)
    with pytest.raises(FileNotFoundError, match="has no config.yaml"):
        Run.resolve(tmp_path)
    (tmp_path / "checkpoint_best.pt").unlink()
    (tmp_path / "checkpoint_last.pt").write_bytes(b"x")
    run, file = Run.resolve(tmp_path, "best", need_config=False)  # an interrupted run: last
    assert run.path == tmp_path and file.name == "checkpoint_last.pt"


# ----------------------------------------------------------------------------- the test pass
def _data(k: int):
    torch.manual_seed(0)
    model = nn.Conv2d(3, k, 3, padding=1)
    model.weight.data *= 3

    def split(n, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 3, 12, 12, generator=g)
        with torch.no_grad():
            y = model(x).argmax(dim=1)
        flip = torch.rand(n, 12, 12, generator=g) < 0.3
        y[flip] = torch.randint(0, k, (int(flip.sum()),), generator=g)
        y[:, 0] = VOID
        return DataLoader(TensorDataset(x, y), batch_size=4)

    return model, split(10, 1), split(7, 2)


def _meters(k: int):
    return {"calibration": CalibrationMeter(k, ignore_index=VOID),
            "segmentation": SegmentationMeter(k, VOID)}


def _by_hand(k, loader, transform):
    """Meters fed ``transform(logits, x)`` batch by batch, outside the evaluation code."""
    meters = _meters(k)
    with torch.no_grad():
        for x, y in loader:
            out = transform(x)
            for m in meters.values():
                m.update(out, y)
    result = {}
    for m in meters.values():
        result.update(m.compute())
    return result


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
        else:
            assert json.dumps(a[key]) == json.dumps(b[key]), key


def test_one_test_pass_equals_each_view_fed_by_hand():
    k, t = 3, 1.7
    model, val, test = _data(k)
    cal = build_calibrator("vector", k)
    fit_calibrators({"vector": cal}, model, val, torch.device("cpu"), VOID)
    infer = Inference(model, torch.device("cpu"))
    out = run_test_pass(infer, test, lambda: _meters(k), temperature=t, calibrators={"vector": cal})
    _same(out["pre_ts"], _by_hand(k, test, lambda x: model(x)))
    _same(out["post_ts"], _by_hand(k, test, lambda x: model(x) / t))
    _same(out["calibrators"]["vector"], _by_hand(k, test, lambda x: cal(model(x))))
    # no temperature, no calibrators: only the raw view
    bare = run_test_pass(infer, test, lambda: _meters(k))
    assert bare["post_ts"] is None and bare["calibrators"] == {}
    assert json.dumps(bare["pre_ts"]) == json.dumps(out["pre_ts"])


def test_calibrated_test_fits_t_on_validation_only():
    k = 3
    model, val, test = _data(k)

    class Task:
        ignore_index = VOID

        @staticmethod
        def meters(n_bins, test=False):
            return _meters(k)

    from cals_seg.calibrators.ts import fit_temperature

    infer = Inference(model, torch.device("cpu"))
    out = calibrated_test(infer, Task, val, test)
    with torch.no_grad():
        t = fit_temperature(lambda: ((model(x), y) for x, y in val), ignore_index=VOID)
    assert out["temperature"] == t and set(out) == {"temperature", "pre_ts", "post_ts"}
    _same(out["post_ts"], _by_hand(k, test, lambda x: model(x) / t))
    off = calibrated_test(infer, Task, val, test, temperature_scaling=False)
    assert off["temperature"] == 1.0 and off["post_ts"] is None


def test_the_ts_calibrator_at_the_post_ts_temperature_is_read_from_the_views():
    """A ``ts`` calibrator whose T is the post-TS T, bit for bit, is not metered again: its
    numbers are the post-TS view's (the raw view's for the argmax meters, as Calibrated feeds
    them), equal to the same calibrator metered on its own; another T is metered on its own."""
    from cals_seg.calibrators import TemperatureScaling

    class Metered(TemperatureScaling):  # another type: never taken for the post-TS view
        pass

    k, t = 3, 1.7
    model, _, test = _data(k)
    infer = Inference(model, torch.device("cpu"))
    same, own, other = (cls(k) for cls in (TemperatureScaling, Metered, TemperatureScaling))
    for cal, value in ((same, t), (own, t), (other, 1.3)):
        cal.temperature.fill_(value)
    out = run_test_pass(infer, test, lambda: _meters(k), temperature=t,
                        calibrators={"ts": same, "own": own, "other": other})
    cals = out["calibrators"]
    assert list(cals) == ["ts", "own", "other"]
    assert json.dumps(cals["ts"]) == json.dumps(cals["own"])
    _same(cals["other"], _by_hand(k, test, lambda x: model(x) / 1.3))
    assert cals["ts"]["ece"] == out["post_ts"]["ece"]
