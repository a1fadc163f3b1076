"""The rule table of config keys, its one message format, the user-error type, ``--set`` before
CONFIG, and atomic writes of config.yaml and plots."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from matplotlib.figure import Figure

from cals_seg.commands._cli import split_set_items, training_parser
from cals_seg.config.checks import check_config
from cals_seg.config.rules import RULES, check_rules, config_keys
from cals_seg.config.schema import ConfigError, load_config, save_config
from cals_seg.errors import DataError, MissingPathError, RunExistsError, UserError
from cals_seg.training.engine import NonFiniteLossError
from cals_seg.utils import io as safe_io
from cals_seg.visualization import plotting

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"
FORMAT = re.compile(r"^[\w.]+: expected .+, got .+; .+\.$")  # key, allowed, value, fix


def _refusal(*sets: str, reads_data: bool = False, writes_run: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        check_config(load_config(SETUP, list(sets), "ce"), reads_data, writes_run)
    return str(info.value)


def test_every_key_has_one_entry_and_each_range_is_enforced_in_one_format():
    assert set(RULES) == set(config_keys())
    defaults = config_keys()
    checked = 0
    for key, rule in RULES.items():
        if rule is None:
            continue
        assert rule.ok(defaults[key]) or defaults[key] is None, key  # the defaults obey
        for bad in (-(10**15), 10**15, float("nan"), "", "?"):
            try:
                if rule.ok(bad):
                    continue
            except (TypeError, AttributeError):
                pass
            cfg = load_config(SETUP, [], "ce")
            section, _, leaf = key.rpartition(".")
            setattr(getattr(cfg, section) if section else cfg, leaf, bad)
            with pytest.raises(ConfigError) as info:
                check_rules(cfg)
            message = str(info.value)
            assert message.startswith(f"{key}: expected {rule.allowed}, got ") and \
                FORMAT.match(message), message
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("sets,pattern", [
    (["train.device=tpu"], r"^train.device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["train.device=cuda:99"], r"^train.device: expected .*cuda"),
    (["eval.stride=600"], r"^eval.stride: expected an integer in \[1, eval.window\] = \[1, 512\]"),
    (["data.ignore_index=3"], r"^data.ignore_index: expected an integer in \[data.num_classes, "
                              r"255\] = \[11, 255\]"),
    (["model.arch=segformerx"], r"^model.arch: expected an smp architecture"),
    (["model.params={decoder_channels: 16, typo_key: 1}"], r"^model.params.typo_key: expected a "
                                                          r"keyword of DeepLabV3"),
    (["model.params={in_channels: 1}"], r"^model.params.in_channels: expected a keyword"),
    (["model.params={encoder_output_stride: 7}"], r"^model.params.encoder_output_stride: "
                                                 r"expected 8 or 16, got 7"),
    (["loss.name=dice"], r"^loss.name: expected one of \["),
    (["name=../x"], r"^name: expected a folder name"),
    (["optim.milestones=[20, 10]"], r"^optim.milestones: expected a list of increasing epochs"),
    (["data.text_strip=[headers, footers]"], r"^data.text_strip: expected a list of steps"),
])
def test_rules_that_depend_on_the_consumer(sets, pattern):
    if "cuda" in sets[0] and torch.cuda.is_available() and torch.cuda.device_count() > 99:
        pytest.skip("this machine has 100 GPUs")
    message = _refusal(*sets)
    assert re.search(pattern, message) and FORMAT.match(message), message


def test_paths_by_what_they_must_be(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert "is a file: name a folder" in _refusal(f"data.root={a_file}", reads_data=True)
    message = _refusal(f"output_dir={a_file / 'below'}", writes_run=True)
    assert message.startswith("output_dir: expected a folder path") and "is a file" in message
    assert _refusal(f"model.encoder_weights={tmp_path}").startswith(
        "model.encoder_weights: expected 'imagenet', null or an existing weights file")
    missing = tmp_path / "none.pth"
    assert f"{missing} does not exist" in _refusal(f"model.encoder_weights={missing}")
    # the data paths are checked only where the data is read, the run folder where it is written
    check_config(load_config(SETUP, [f"data.root={tmp_path / 'new'}"], "ce"), reads_data=True)
    check_config(load_config(SETUP, ["data.name=voc", f"data.root={tmp_path / 'nowhere'}",
                                     "data.num_classes=21"], "ce"), reads_data=False)
    assert "does not exist" in _refusal("data.name=voc", f"data.root={tmp_path / 'nowhere'}",
                                        "data.num_classes=21", reads_data=True)


def test_set_values_that_are_not_yaml_name_the_key():
    with pytest.raises(ConfigError, match=r"^loss.params: expected a YAML value, got '\{a: 1'"):
        load_config(SETUP, ["loss.params={a: 1"], "ce")
    # the value in force (the setup file's), not the dataclass default (issue 59)
    with pytest.raises(ConfigError, match=r"yaml: train.epochs: expected an integer, got 'ten'; "
                                          r"e.g. --set train.epochs=56 \(the config file's"):
        load_config(SETUP, ["train.epochs=ten"], "ce")


def test_one_user_error_type_keeps_the_builtin_types():
    for kind, builtin in ((ConfigError, ValueError), (DataError, ValueError),
                          (MissingPathError, FileNotFoundError),
                          (RunExistsError, FileExistsError),
                          (NonFiniteLossError, RuntimeError),
                          (safe_io.CheckpointError, ValueError)):
        assert issubclass(kind, UserError) and issubclass(kind, builtin)
    from cals_seg.commands._cli import USER_ERRORS

    assert USER_ERRORS == (UserError,)  # a bug (any other exception) keeps its traceback


def test_set_items_end_where_the_config_begins():
    parser = training_parser(None)
    args = parser.parse_args(["--set", "train.epochs=1", "loss.params={a: 1}", "my.yaml"])
    assert args.config == "my.yaml" and args.set == ["train.epochs=1", "loss.params={a: 1}"]
    args = parser.parse_args(["my.yaml", "--set", "a=1", "--resume", "r", "--set", "b=2"])
    assert args.config == "my.yaml" and args.set == ["a=1", "b=2"] and args.resume == "r"
    assert split_set_items(["--set", "a=1", "--", "--set", "b=2"]) == ["--set=a=1", "--",
                                                                        "--set", "b=2"]


def test_config_yaml_and_plots_are_written_atomically(tmp_path, monkeypatch):
    """A write that dies before its rename leaves the old file whole (never half a file)."""
    cfg = load_config(SETUP, [], "ce")
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    before = path.read_text()
    plot = tmp_path / "plot.png"
    fig = Figure()
    fig.add_subplot().plot([0, 1])
    plotting._save(fig, plot)
    png = plot.read_bytes()

    def dies(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(safe_io.os, "replace", dies)
    changed = load_config(SETUP, ["train.epochs=3"], "ce")
    with pytest.raises((OSError, UserError), match="killed"):  # UserError: one line
        save_config(changed, path)
    assert path.read_text() == before
    fig = Figure()
    fig.add_subplot().plot([1, 0])
    with pytest.raises((OSError, UserError), match="killed"):  # UserError: one line
        plotting._save(fig, plot)
    assert plot.read_bytes() == png


# --------------------------------------------------------------------------- each rule once
def test_check_config_runs_each_rule_once_in_table_order(monkeypatch):
    from cals_seg.config import rules
    from cals_seg.evaluation import inference

    calls: list[str] = []

    def counted(rule):
        def run(cfg):
            calls.append(rule.__name__)
            rule(cfg)
        return run

    table = list(rules.CROSS_RULES)
    monkeypatch.setattr(rules, "CROSS_RULES", [counted(r) for r in table])
    loggers, protocols = [], []
    check_loggers, post_init = rules.check_loggers, inference.EvalProtocol.__post_init__

    def logged(names):
        loggers.append(list(names))
        check_loggers(names)

    def built(self):
        protocols.append(self)
        post_init(self)

    monkeypatch.setattr(rules, "check_loggers", logged)
    monkeypatch.setattr(inference.EvalProtocol, "__post_init__", built)
    check_config(load_config(SETUP, ["train.loggers=[csv]"], "ce"), reads_data=True)
    assert calls == [r.__name__ for r in table]  # every cross rule, once, in the table's order
    assert loggers == [["csv"]] and len(protocols) == 1


def test_the_stride_rule_is_the_protocols_own():
    """``1 <= eval.stride <= eval.window`` is written once, in EvalProtocol; the config check
    says the protocol's words under the config keys, with a fix."""
    from cals_seg.evaluation.inference import EvalProtocol

    assert RULES["eval.stride"] is None
    for stride in (600, 0):
        with pytest.raises(ValueError) as own:
            EvalProtocol(window=512, stride=stride)
        words = str(own.value).replace("`stride`", "eval.stride").replace("`window`",
                                                                          "eval.window")
        message = _refusal(f"eval.stride={stride}")
        assert message == f"{words.rstrip('.')}; e.g. --set eval.stride=341 (two thirds of the " \
            "window).", message


def test_builders_refuse_with_the_words_of_the_rule_table(tmp_path):
    """A builder used without check_config calls the same rule: the same one-line message;
    the class count of a dataset (known only to its builder) has one format for every dataset."""
    from cals_seg.tasks import segmentation

    absent = f"data.root={tmp_path / 'absent'}"
    cfg = load_config(SETUP, ["data.eval_size=512", absent], "ce")
    with pytest.raises(ConfigError) as built:
        segmentation.eval_protocol(cfg, None)
    assert str(built.value) == _refusal("data.eval_size=512", absent)
    for sets, found in ((["data.name=cityscapes", "data.num_classes=11"], 19),
                        (["data.synthetic={num_train: 4}", "data.num_classes=5"], 11)):
        with pytest.raises(ConfigError) as built:
            segmentation.segmentation_splits(load_config(SETUP, [*sets, absent], "ce"))
        assert re.fullmatch(rf"data.num_classes: [\w ]+ has {found} classes, but the config says "
                            rf"\d+; set data.num_classes: {found}\.", str(built.value)), built.value
    assert not (tmp_path / "absent").exists()  # refused before any data was generated


def test_one_flattening_and_one_table_of_key_groups():
    from cals_seg.config.checks import RESUMABLE_KEYS
    from cals_seg.config.rules import KEY_GROUPS, changed_keys, flatten_config, keys_of
    from cals_seg.config.schema import config_to_dict

    keys = config_keys()
    grouped = [k for group in KEY_GROUPS.values() for k in group]
    assert len(grouped) == len(set(grouped)) and set(grouped) <= set(keys)
    assert set(RESUMABLE_KEYS) == set(keys_of("resumable", "neutral"))
    base = load_config(SETUP, [], "ce")
    flat = flatten_config(config_to_dict(base))
    assert flat == {k: getattr(getattr(base, k.split(".")[0]), k.split(".")[1]) if "." in k
                    else getattr(base, k) for k in keys}  # down to the keys of Config, no deeper
    other = load_config(SETUP, ["data.synthetic={num_train: 3, image_size: 40}",
                                "train.threads=2", "optim.lr=0.5"], "ce")
    assert changed_keys(config_to_dict(base), config_to_dict(other)) == [
        "data.synthetic", "optim.lr", "train.threads"]
    old = config_to_dict(base)
    del old["data"]["palette"]  # a config saved before the key existed: not a change
    assert changed_keys(old, config_to_dict(base)) == []
