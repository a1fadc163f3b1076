"""train.loggers: the CSV and TensorBoard files hold the history's numbers, W&B writes an offline
run, and a missing package stops the run before training with the install command."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

from cals_seg.config.schema import ConfigError, load_config
from cals_seg.tasks import build_task
from cals_seg.training.engine import seed_everything
from cals_seg.training.loggers import RunLoggers, check_loggers, flatten_record, scalar_tags
from cals_seg.training.trainer import fit

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synthetic_deeplabv3_cals_alm_auto.yaml"  # logs the margin


def _config(tmp: Path, name: str, loggers: str, epochs: int = 2):
    return load_config(CONFIG, [
        f"name={name}", f"output_dir={tmp / 'runs'}", f"data.root={tmp / 'data'}",
        "data.synthetic={num_train: 8, num_test: 4, image_size: 32}", "data.crop_size=32",
        f"train.epochs={epochs}", "train.batch_size=4", "eval.batch_size=4",
        "train.progress=false", "train.threads=1", "eval.num_maps=0",
        "model.params={encoder_output_stride: 16, decoder_channels: 16}",
        f"train.loggers={loggers}",
    ])


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loggers")
    cfg = _config(tmp, "logged", "[csv, tensorboard]")
    seed_everything(cfg.train.seed)
    task = build_task(cfg)
    fit(cfg, task)
    history = [json.loads(x) for x in (cfg.run_dir / "history.jsonl").read_text().splitlines()]
    return cfg, task, history


def test_csv_holds_the_history(logged_run):
    cfg, task, history = logged_run
    with (cfg.run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(history) == 2
    for row, h in zip(rows, history, strict=True):
        assert int(row["epoch"]) == h["epoch"] + 1  # counted from 1, as the console does
        assert float(row["val_ece"]) == h["val_ece"]  # exact: written with repr
        assert float(row["train_loss"]) == h["train_loss"]
        assert float(row["lr"]) == h["lr"]
        for name, lam in zip(task.class_names, h["lambda"], strict=True):
            assert float(row[f"lambda/{name}"]) == lam
        assert row["precision"] == h["precision"]


def test_tensorboard_event_file_holds_the_history(logged_run):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    cfg, task, history = logged_run
    acc = event_accumulator.EventAccumulator(
        str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0}
    )
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = [scalar_tags(h, task.class_names) for h in history]
    assert {"train/loss", "val/ece", "val/miou", "lr", "margin", "time"} <= tags
    assert f"lambda/{task.class_names[3]}" in tags and f"rho/{task.class_names[0]}" in tags
    for tag in expected[0]:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [h["epoch"] + 1 for h in history], tag
        for event, numbers in zip(events, expected, strict=True):
            # TensorBoard stores float32
            assert math.isclose(event.value, numbers[tag], rel_tol=1e-6, abs_tol=1e-30), tag
    assert expected[1]["val/ece"] == history[1]["val_ece"]
    # the test metrics of the best checkpoint, at the last step
    assert {"test/ece", "test_ts/ece", "test_ts/temperature"} <= tags
    images = set(acc.Tags()["images"])
    assert {"val/reliability", "multipliers", "test/reliability", "test_ts/reliability"} <= images
    assert [e.step for e in acc.Images("val/reliability")] == [1, 2]


def test_wandb_offline_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_path = tmp_path / "runs" / "w"
    run_path.mkdir(parents=True)
    names = ["c0", "c1", "c2"]
    loggers = RunLoggers(["wandb"], run_path, {"train": {"epochs": 2}}, names)
    history = []
    for epoch in range(2):
        record = {"epoch": epoch, "lr": 0.1 / (epoch + 1), "train_loss": 1.0 - 0.1 * epoch,
                  "val_ece": 0.05, "lambda": [0.1, 0.2, 0.3], "best": True, "time": 1.0}
        history.append(record)
        val = {"ece": 0.05, "reliability": {"bin_edges": [0, 0.5, 1.0], "count": [3, 5],
                                            "confidence": [0.4, 0.8], "accuracy": [0.3, 0.9]}}
        loggers.log_epoch(record, val, history)
    loggers.close()
    runs = list((run_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_path / "wandb").iterdir())
    run_id = (run_path / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(run_id)
    assert list(runs[0].glob("*.wandb")), "no W&B log file in the offline run"


@pytest.mark.parametrize("name,package", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_gives_the_install_command(tmp_path, monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import package` fail
    with pytest.raises(ConfigError) as err:
        check_loggers([name])
    message = str(err.value)
    assert f'pip install "cals_seg[{name}]"' in message and "\n" not in message
    # fit refuses before any training: no run directory is made
    cfg = _config(tmp_path, "missing", f"[{name}]")
    with pytest.raises(ConfigError, match=r"pip install"):
        fit(cfg, build_task(cfg))
    assert not cfg.run_dir.exists()


def test_unknown_logger_lists_the_valid_names():
    with pytest.raises(ConfigError, match=r"valid names are \['csv', 'tensorboard', 'wandb'\]"):
        check_loggers(["mlflow"])
    with pytest.raises(ConfigError, match="expected a list"):
        check_loggers("csv")


def test_flatten_record_names_classes():
    flat = flatten_record({"epoch": 0, "lambda": [1.0, 2.0], "margin": None, "x": [1, 2, 3]},
                          ["a", "b"])
    assert flat == {"epoch": 0, "lambda/a": 1.0, "lambda/b": 2.0, "x/0": 1, "x/1": 2, "x/2": 3}


def test_resume_continues_the_logs(logged_run):
    """A resumed run (one more epoch) appends to the CSV and TensorBoard without repeats."""
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    cfg, task, _ = logged_run
    more = _config(cfg.run_dir.parent.parent, "logged", "[csv, tensorboard]", epochs=3)
    seed_everything(more.train.seed)
    fit(more, build_task(more), resume=cfg.run_dir)
    history = [json.loads(x) for x in (cfg.run_dir / "history.jsonl").read_text().splitlines()]
    with (cfg.run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [h["epoch"] + 1 for h in history] == [1, 2, 3]
    assert float(rows[2]["val_ece"]) == history[2]["val_ece"]
    acc = event_accumulator.EventAccumulator(str(cfg.run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("val/ece")
    assert [e.step for e in events] == [1, 2, 3]
    assert math.isclose(events[2].value, history[2]["val_ece"], rel_tol=1e-6)
