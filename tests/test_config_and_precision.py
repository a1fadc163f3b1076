"""Setup files with a methods table, --set groups, train.amp auto, and the run directory."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch

from cals_seg.config.schema import ConfigError, load_config
from cals_seg.runs.run import Run
from cals_seg.utils import precision

from .conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SETUPS = sorted(p.stem for p in CONFIGS.glob("*.yaml"))


# ----------------------------------------------------------------------------- setup files
def test_every_setup_file_resolves_each_method_to_its_loss():
    assert len(SETUPS) == 13  # 12 setups + the under-confident regime of the synthetic one
    for setup in SETUPS:
        raw = (CONFIGS / f"{setup}.yaml").read_text()
        methods = load_config(CONFIGS / f"{setup}.yaml").name  # the default method
        assert methods.startswith(setup + "_")
        import yaml

        table = yaml.safe_load(raw)["methods"]
        for method, loss in table.items():
            cfg = load_config(CONFIGS / f"{setup}_{method}.yaml")
            assert cfg.name == f"{setup}_{method}"
            assert cfg.loss.name == loss["name"] and cfg.loss.params == loss.get("params", {})
            assert load_config(CONFIGS / f"{setup}.yaml", method=method) == cfg


def test_documented_command_names_and_alias():
    # the card's command: configs/voc_deeplabv3_cals.yaml (cals = cals_alm)
    cfg = load_config(CONFIGS / "voc_deeplabv3_cals.yaml")
    assert cfg.name == "voc_deeplabv3_cals_alm" and cfg.loss.name == "cals_alm"
    assert cfg.loss.params["margin"] == 10.0
    m5 = load_config(CONFIGS / "synthetic_cls_cals_alm_m5.yaml")
    assert m5.loss.name == "cals_alm" and m5.loss.params["margin"] == 5.0
    assert m5.name == "synthetic_cls_cals_alm_m5"
    # cals_alm is the paper's m = 10 in the synthetic segmentation setups too; the evidence rule
    # and the other fixed margin are named
    for setup in ("synthetic_deeplabv3", "synthetic_deeplabv3_short"):
        assert load_config(CONFIGS / f"{setup}_cals.yaml").loss.params["margin"] == 10.0
        assert load_config(CONFIGS / f"{setup}_cals_alm_auto.yaml").loss.params["margin"] == "auto"
        m6 = load_config(CONFIGS / f"{setup}_cals_alm_m6.yaml")
        assert m6.name == f"{setup}_cals_alm_m6" and m6.loss.params["margin"] == 6.0
    short = load_config(CONFIGS / "synthetic_deeplabv3_short_ce.yaml")
    assert short.name == "synthetic_deeplabv3_short_ce" and short.train.epochs == 20


def test_setup_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown method 'dice'; valid methods are \["):
        load_config(CONFIGS / "synthetic_deeplabv3_dice.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(CONFIGS / "nowhere_ce.yaml")
    with pytest.raises(ConfigError, match="names the method 'ce', but --method says 'ls'"):
        load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml", method="ls")
    plain = tmp_path / "plain.yaml"
    plain.write_text("data: {name: synthetic}\nloss: {name: ce}\n")
    with pytest.raises(ConfigError, match="no `methods` table"):
        load_config(plain, method="ce")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(empty)
    both = tmp_path / "both.yaml"
    both.write_text("methods: {ce: {name: ce}}\nmethod: ce\nloss: {name: ls}\n")
    with pytest.raises(ConfigError, match="must not also set `loss`"):
        load_config(both)


def test_overrides_apply_after_the_method_in_order():
    cfg = load_config(CONFIGS / "synthetic_deeplabv3_cals_alm.yaml",
                      ["loss.params.rho_init=2", "loss.params.margin=3", "train.epochs=4",
                       "train.epochs=5"])
    assert cfg.loss.params["margin"] == 3 and cfg.train.epochs == 5
    assert cfg.loss.params["rho_init"] == 2  # earlier overrides of the method's loss are kept


@pytest.mark.parametrize("tool", ["train_seg", "train_cls", "eval_seg", "compare", "demo"])
def test_repeated_set_groups_merge_in_order(tool, monkeypatch):
    module = load_tool(tool)
    seen = {}

    def fake_parse(self, argv=None, namespace=None):
        seen["args"] = real(self, argv, namespace)
        raise SystemExit(0)

    import argparse

    real = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", fake_parse)
    argv = {"eval_seg": ["c.yaml", "--checkpoint", "x.pt"],
            "compare": ["c.yaml", "--out", "o"], "demo": []}.get(tool, ["c.yaml"])
    with pytest.raises(SystemExit):
        module.main([*argv, "--set", "data.name=voc", "data.root=X", "--set", "train.amp=none"])
    assert seen["args"].set == ["data.name=voc", "data.root=X", "train.amp=none"]


# ----------------------------------------------------------------------------- precision
@pytest.mark.parametrize("native", [False, True])
def test_auto_resolves_by_the_native_bf16_probe(native, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    cpu = torch.device("cpu")
    assert precision.cpu_has_native_bf16() is native
    assert precision.resolve_amp("auto", cpu) == ("bf16" if native else "none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert precision.resolve_amp("bf16", cpu) == "bf16"  # asked for: kept, but warned
    assert bool(caught) is not native
    if caught:
        assert "emulated" in str(caught[0].message) and "train.amp=auto" in str(caught[0].message)


def test_avx2_kernels_mean_no_native_bf16(monkeypatch):
    # oneDNN may report bf16 while ATen is capped at AVX2 (ATEN_CPU_CAPABILITY=avx2)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    assert precision.resolve_amp("auto", torch.device("cpu")) == "none"


def test_resolve_amp_errors_and_fp16_only_on_cuda():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        precision.resolve_amp("fp16", cpu)
    with pytest.raises(ValueError, match=r"train.amp: expected one of \['auto'"):
        precision.resolve_amp("fp8", cpu)
    assert precision.resolve_amp("none", cpu) == "none"
    assert precision.resolve_amp("fp16", torch.device("cuda")) == "fp16"
    with pytest.raises(ValueError, match="resolved precision"):
        precision.autocast_context(cpu, "auto")


def test_compare_sees_a_run_of_another_resolved_precision(tmp_path, monkeypatch):
    from cals_seg.training.study import config_differences

    cfg = load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml",
                      [f"output_dir={tmp_path}", "name=r"])
    from cals_seg.config.schema import save_config

    run = Run(tmp_path / "r")
    run.path.mkdir()
    save_config(cfg, run.config_file)
    here = precision.resolve_amp("auto", torch.device("cpu"), warn=False)
    there = "bf16" if here == "none" else "none"
    run.test_metrics.write_text(json.dumps({"precision": here}))
    assert config_differences(run.path, cfg) == []
    run.test_metrics.write_text(json.dumps({"precision": there}))
    assert config_differences(run.path, cfg) == [
        f"train.amp (resolved: {there} there, {here} here)"
    ]


def test_compare_reads_one_data_folder_spelled_two_ways_as_the_same(tmp_path, monkeypatch):
    """A run saved with data.root absolute (or through a link, or relative) is reused by a
    study that spells the same folder another way; another folder is still a difference."""
    from cals_seg.config.schema import save_config
    from cals_seg.training.study import config_differences

    data = tmp_path / "work" / "data" / "synthetic"
    data.mkdir(parents=True)
    other = tmp_path / "elsewhere" / "synthetic"
    other.mkdir(parents=True)
    (tmp_path / "link").symlink_to(data.parent, target_is_directory=True)
    monkeypatch.chdir(tmp_path / "work")
    spellings = [str(data), "data/synthetic", "./data/synthetic", "data/../data/synthetic",
                 str(tmp_path / "link" / "synthetic"), str(data) + "/"]
    rng = random.Random(0)
    for i in range(12):
        saved_root, expected_root = rng.choice(spellings), rng.choice(spellings)
        run = Run(tmp_path / f"r{i}")
        run.path.mkdir()
        save_config(load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml",
                                [f"output_dir={tmp_path}", f"data.root={saved_root}"]),
                    run.config_file)
        expected = load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml",
                               [f"output_dir={tmp_path}", f"data.root={expected_root}"])
        assert config_differences(run.path, expected) == [], (saved_root, expected_root)
        moved = load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml",
                            [f"output_dir={tmp_path}", f"data.root={other}"])
        assert config_differences(run.path, moved) == ["data.root"]


# ----------------------------------------------------------------------------- run directory
def test_a_folder_holding_any_run_file_is_refused(tmp_path):
    cfg = load_config(CONFIGS / "synthetic_deeplabv3_ce.yaml", [f"output_dir={tmp_path}"])
    run = Run(cfg.run_dir)
    run.check_start(resume=False)  # nothing there yet
    run.path.mkdir(parents=True)
    run.check_start(resume=False)  # an empty folder is fine
    with pytest.raises(FileNotFoundError, match="holds no run"):
        run.check_start(resume=True)
    (run.path / "history.jsonl").write_text('{"epoch": 0}\n')
    with pytest.raises(FileExistsError, match=r"history.jsonl.*--resume"):
        run.check_start(resume=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint_last.pt"):
        run.check_start(resume=True)


def test_the_config_is_checked_before_any_data_is_built(tmp_path, capsys):
    """The training command checks the config first: a bad value is refused before the
    embedded dataset is generated."""
    code = load_tool("train_seg").main([
        str(CONFIGS / "synthetic_deeplabv3.yaml"), "--method", "ce", "--set",
        "train.best_mode=maximize", f"data.root={tmp_path / 'data'}",
        f"output_dir={tmp_path / 'runs'}"])
    assert code == 2 and "best_mode" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()


def test_history_trim_and_best_repair(tmp_path):
    from cals_seg.utils.io import load_checkpoint, save_checkpoint

    run = Run(tmp_path)
    for epoch in range(3):
        run.append_history({"epoch": epoch})
    run.trim_history(2)
    assert [h["epoch"] for h in run.history()] == [0, 1]
    save_checkpoint({"model": {}, "epoch": 0}, run.best)
    last = {"model": {}, "epoch": 1, "best_epoch": 1}  # died before the best file was written
    run.repair_best(last)
    assert load_checkpoint(run.best)["epoch"] == 1
    run.repair_best({"model": {}, "epoch": 2, "best_epoch": 1})  # not improving: untouched
    assert load_checkpoint(run.best)["epoch"] == 1


def test_best_checkpoint_link_survives_the_next_last(tmp_path):
    from cals_seg.utils.io import link_checkpoint, load_checkpoint, save_checkpoint

    run = Run(tmp_path)
    save_checkpoint({"model": {}, "epoch": 3}, run.last)
    link_checkpoint(run.last, run.best)
    save_checkpoint({"model": {}, "epoch": 4}, run.last)  # the next epoch replaces last
    assert load_checkpoint(run.best)["epoch"] == 3 and load_checkpoint(run.last)["epoch"] == 4
    assert not list(tmp_path.glob(".*.tmp"))


def test_cached_yaml_parse_hands_out_fresh_copies():
    """The parse of a setup file is cached: what one load returns may be changed by its caller
    without touching what the next load of the same text returns."""
    from cals_seg.config.schema import _yaml_load

    text = "train: {epochs: 3, milestones: [1, 2]}\nname: x\n"
    first = _yaml_load(text)
    first["train"]["milestones"].append(99)
    first["name"] = "changed"
    assert _yaml_load(text) == {"train": {"epochs": 3, "milestones": [1, 2]}, "name": "x"}
