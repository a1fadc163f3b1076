"""End-to-end segmentation pipeline on a tiny embedded dataset: artefacts, resume, eval_seg."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cals_seg.config.schema import ConfigError, load_config
from cals_seg.tasks import build_task
from cals_seg.training import trainer as trainer_mod
from cals_seg.training.engine import NonFiniteLossError, seed_everything, train_one_epoch
from cals_seg.training.trainer import fit
from cals_seg.utils.io import load_checkpoint
from cals_seg.utils.precision import resolve_amp

from ._figures_skipped import figures_skipped
from .conftest import figures_undrawn, load_tool

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synthetic_deeplabv3_cals_alm.yaml"


def _overrides(tmp: Path, name: str, epochs: int = 2, num_train: int = 20) -> list[str]:
    return [
        f"name={name}", f"output_dir={tmp / 'runs'}", f"data.root={tmp / 'data'}",
        f"data.synthetic={{num_train: {num_train}, num_test: 6, image_size: 32}}",
        "data.crop_size=32",
        f"train.epochs={epochs}", "train.batch_size=4", "eval.batch_size=4", "train.progress=false",
        "train.threads=1", "eval.num_maps=2",
        "loss.params={margin: auto, margin_init: 3.0}",  # the auto margin, resumed too
        "contrib=[auto_margin]",  # (kept beside the core: opted in)
        # a MobileNetV3 encoder: checkpoints of 1.6 MB, not ResNet-18's 46 MB (92 MB with the
        # optimiser), written each epoch and read by every tool
        "model.encoder_name=tu-mobilenetv3_small_050",
        "model.params={encoder_output_stride: 16, decoder_channels: 32}",
    ]


def _run(tmp: Path, name: str, epochs: int = 2, resume: Path | None = None,
         num_train: int = 20):
    cfg = load_config(CONFIG, _overrides(tmp, name, epochs, num_train))
    seed_everything(cfg.train.seed)
    return cfg, fit(cfg, build_task(cfg), resume=resume)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    # Its figures are saved undrawn: test_eval_seg_reproduces_test_metrics draws those of the
    # evaluation (reliability, multipliers, maps, ...) from this run, and
    # tests/test_contrib_auto_margin.py a training run's curves and margin evidence.
    with figures_undrawn():
        cfg, test = _run(tmp, "straight")
    return tmp, cfg, test


def test_run_directory_has_every_artefact(straight):
    tmp, cfg, test = straight
    run = cfg.run_dir
    for name in ("config.yaml", "history.jsonl", "checkpoint_last.pt", "checkpoint_best.pt",
                 "test_metrics.json", "plots/reliability_pre_ts.png",
                 "plots/reliability_post_ts.png", "plots/lambda_curves.png",
                 "plots/training_curves.png", "plots/margin_evidence.png", "temperature.json"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0, 1]
    # the precision train.amp=auto resolved to on this CPU is recorded
    used = resolve_amp("auto", torch.device("cpu"), warn=False)
    assert cfg.train.amp == "auto" and {h["precision"] for h in history} == {used}
    for h in history:
        assert len(h["lambda"]) == len(h["rho"]) == 11
        assert h["margin_temperature"] > 0 and 1.0 <= h["margin"] <= 20.0
        assert h["margin_reason"] in ("at chance", "still learning", "calibrated within noise")
        assert {"train_loss", "train_ce", "train_penalty", "val_ece", "val_miou", "lr"} <= set(h)
    metrics = json.loads((run / "test_metrics.json").read_text())
    assert metrics["temperature"] > 0 and metrics["checkpoint"] == "checkpoint_best.pt"
    # the test pass runs at the inference precision: float32 on every CPU
    assert metrics["precision"] == resolve_amp("auto", torch.device("cpu"), inference=True)
    saved_t = json.loads((run / "temperature.json").read_text())["temperature"]
    assert saved_t == metrics["temperature"]
    assert {"ece", "aece", "cwce", "miou", "ece_image_mean"} <= set(metrics["pre_ts"])
    assert {"ece_band", "ece_size", "aurc", "ece_over", "ece_under"} <= set(metrics["post_ts"])
    # temperature scaling never changes the arg-max
    assert metrics["post_ts"]["acc"] == metrics["pre_ts"]["acc"]
    assert metrics["post_ts"]["miou"] == metrics["pre_ts"]["miou"]
    # the resolved config is written and loads back to the same values
    assert load_config(run / "config.yaml") == cfg
    # the criterion state (multipliers) is in the checkpoint
    ckpt = load_checkpoint(run / "checkpoint_last.pt")
    assert torch.allclose(ckpt["criterion"]["lambdas"], torch.tensor(history[-1]["lambda"],
                                                                   dtype=torch.float64))
    assert float(ckpt["criterion"]["margin_rule.margin"]) == history[-1]["margin"]


def test_resume_reaches_the_same_result(straight, tmp_path, monkeypatch):
    _, cfg_a, test_a = straight
    real = trainer_mod.train_one_epoch
    calls = {"n": 0}

    def crash_on_second_epoch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the job is killed during epoch 2
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "train_one_epoch", crash_on_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "straight")  # same name, other output_dir: same config otherwise
    monkeypatch.setattr(trainer_mod, "train_one_epoch", real)
    run_b = tmp_path / "runs" / "straight"
    assert load_checkpoint(run_b / "checkpoint_last.pt")["epoch"] == 0
    # the command line form: the run folder alone (its own config.yaml), no CONFIG; its plots
    # are those of the straight run, drawn there
    with figures_undrawn():
        assert load_tool("train_seg").main(["--resume", str(run_b)]) == 0
    test_b = json.loads((run_b / "test_metrics.json").read_text())

    hist_a = [json.loads(x) for x in (cfg_a.run_dir / "history.jsonl").read_text().splitlines()]
    hist_b = [json.loads(x) for x in (run_b / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist_b] == [0, 1]
    for a, b in zip(hist_a, hist_b, strict=True):
        torch.testing.assert_close(torch.tensor(b["lambda"]), torch.tensor(a["lambda"]),
                                   rtol=1e-5, atol=1e-9)
        assert b["margin"] == pytest.approx(a["margin"], rel=1e-5)
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
    assert test_b["pre_ts"]["ece"] == pytest.approx(test_a["pre_ts"]["ece"], rel=1e-4, abs=1e-6)


def test_eval_seg_reproduces_test_metrics(straight, capsys):
    _, cfg, test = straight
    out = cfg.run_dir / "eval_again"
    rc = load_tool("eval_seg").main([str(cfg.run_dir / "config.yaml"), "--checkpoint",
                                 str(cfg.run_dir / "checkpoint_best.pt"), "--out", str(out)])
    assert rc == 0
    got = json.loads((out / "metrics.json").read_text())
    ref = json.loads((cfg.run_dir / "test_metrics.json").read_text())
    assert got["temperature"] == pytest.approx(ref["temperature"], rel=1e-9)
    for key in ("pre_ts", "post_ts"):
        for metric in ("ece", "aece", "cwce", "nll", "brier", "miou", "ece_image_mean"):
            assert got[key][metric] == pytest.approx(ref[key][metric], rel=1e-9, abs=1e-12)
    assert len(list((out / "maps").glob("*.png"))) == 2
    assert (out / "reliability_pre_ts.png").is_file() and (out / "lambda_curves.png").is_file()
    for name in ("ece_bands", "ece_sizes", "risk_coverage", "reliability_bands_pre_ts"):
        assert (out / f"{name}.png").is_file(), name
    assert got["pre_ts"]["count_band"] == ref["pre_ts"]["count_band"]
    assert got["pre_ts"]["aurc"] == pytest.approx(ref["pre_ts"]["aurc"], rel=1e-9)


def test_eval_seg_takes_the_run_folder(straight):
    """``eval_seg RUN`` (the run's own config and best checkpoint) gives the numbers of the
    older ``CONFIG --checkpoint FILE`` form and of test_metrics.json."""
    _, cfg, _ = straight
    out = cfg.run_dir / "eval_folder"
    with figures_skipped():  # drawn by the test above; the numbers checked here
        assert load_tool("eval_seg").main([str(cfg.run_dir), "--out", str(out), "--num-maps",
                                           "0"]) == 0
    got = json.loads((out / "metrics.json").read_text())
    ref = json.loads((cfg.run_dir / "test_metrics.json").read_text())
    assert got["family"] == ref["family"] == "segmentation"
    assert got["score_metric"] == ref["score_metric"] == "miou"
    for metric in ("ece", "nll", "miou"):
        assert got["pre_ts"][metric] == pytest.approx(ref["pre_ts"][metric], rel=1e-9)


def test_load_run_gives_what_every_tool_needs(straight):
    from cals_seg.errors import CheckpointError
    from cals_seg.runs.run import load_run

    _, cfg, _ = straight
    run = load_run(cfg.run_dir)
    assert run.checkpoint.name == "checkpoint_best.pt" and run.family == "segmentation"
    assert run.score_metric == "miou" and len(run.class_names) == cfg.data.num_classes
    assert run.temperature == json.loads((cfg.run_dir / "temperature.json").read_text())[
        "temperature"]
    assert not run.model.training and run.protocol is not None and run.task is None
    assert load_run(cfg.run_dir, "last").checkpoint.name == "checkpoint_last.pt"
    with pytest.raises(ValueError, match="classification run"):
        load_run(cfg.run_dir, family="classification")
    with pytest.raises(CheckpointError, match="does not fit the model of .*config.yaml"):
        load_run(cfg.run_dir, overrides=["model.params={decoder_channels: 16}"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(cfg.run_dir / "nothing")


def test_eval_seg_rejects_checkpoint_of_other_class_count(straight, capsys):
    _, cfg, _ = straight
    ckpt = load_checkpoint(cfg.run_dir / "checkpoint_best.pt")
    ckpt["num_classes"] = 21
    bad = cfg.run_dir / "other_classes.pt"
    torch.save(ckpt, bad)
    rc = load_tool("eval_seg").main([str(cfg.run_dir / "config.yaml"), "--checkpoint", str(bad)])
    assert rc == 2
    assert "21 classes" in capsys.readouterr().err


def test_existing_run_is_not_overwritten(straight):
    tmp, _, _ = straight
    with pytest.raises(FileExistsError, match="--resume"):
        _run(tmp, "straight")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(straight, tmp_path, monkeypatch):
    real = trainer_mod.train_one_epoch
    calls = {"n": 0}

    def nan_on_second_epoch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise NonFiniteLossError("the loss is nan")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "train_one_epoch", nan_on_second_epoch)
    with pytest.raises(NonFiniteLossError):
        _run(tmp_path, "nan", num_train=8)  # one epoch and a checkpoint: 8 images will do
    ckpt = load_checkpoint(tmp_path / "runs" / "nan" / "checkpoint_last.pt")
    assert ckpt["epoch"] == 0 and all(torch.isfinite(v).all() for v in ckpt["model"].values()
                                      if v.is_floating_point())
    assert not list((tmp_path / "runs" / "nan").glob(".*.tmp"))


@pytest.mark.parametrize("debug_checks", [False, True])
def test_train_one_epoch_raises_on_non_finite_loss(debug_checks):
    """Both paths stop with the same message; only debug_checks stops before the optimizer step
    (the default reads its device-side flag at the next check, here the end of the epoch)."""
    model = torch.nn.Conv2d(3, 4, 1)
    torch.nn.init.constant_(model.weight, float("nan"))
    before = model.bias.detach().clone()
    loader = [(torch.randn(2, 3, 4, 4), torch.randint(0, 4, (2, 4, 4)))]
    from cals_seg.losses import build_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteLossError, match="the loss is nan at step 0; stopping"):
        train_one_epoch(model, build_loss("ce", 4), loader, opt, torch.device("cpu"),
                        progress=False, debug_checks=debug_checks)
    assert torch.equal(model.bias, before) == debug_checks  # debug: no step was taken


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['epoch'\]; valid keys are"):
        load_config(CONFIG, ["train.epoch=3"])
    with pytest.raises(ConfigError, match="train.epochs: expected an integer, got"):
        load_config(CONFIG, ["train.epochs=three"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  colour: red\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: data: unknown key"):
        load_config(bad)


def test_train_seg_cli_reports_bad_config(tmp_path, capsys):
    rc = load_tool("train_seg").main([str(CONFIG), "--set", *_overrides(tmp_path, "bad"),
                                  "loss.name=dice"])
    assert rc == 2
    assert "loss.name: expected one of [" in capsys.readouterr().err


def test_bf16_autocast_on_cpu_trains_and_fp16_is_refused():
    from cals_seg.losses import build_loss
    from cals_seg.utils.precision import autocast_context, resolve_amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 4, 1))
    cpu = torch.device("cpu")
    with autocast_context(cpu, "bf16"):
        assert model(torch.randn(1, 3, 4, 4)).dtype == torch.bfloat16
    before = [p.detach().clone() for p in model.parameters()]
    loader = [(torch.randn(2, 3, 6, 6), torch.randint(0, 4, (2, 6, 6)))]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = train_one_epoch(model, build_loss("cals_alm", 4, margin=1.0), loader, opt, cpu,
                          amp="bf16", progress=False)
    assert out["loss"] > 0 and all(p.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="fp16 needs a CUDA device.*bf16"):
        resolve_amp("fp16", cpu)
    with pytest.raises(ValueError, match="train.amp: expected one of"):
        resolve_amp("fp8", cpu)
