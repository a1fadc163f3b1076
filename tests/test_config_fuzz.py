"""Config fuzzing: for every key of every shipped setup file, generated wrong values through the
real tools (train_seg, train_cls, eval_seg, predict_seg, compare), in-process.

Each case must end in one of two ways: exit status 2 with ONE line ``error: ...`` naming the key
(a ``*.params.<name>`` key may be named as its section plus the name), or, for a value valid after
all, a run that reaches its work (the first epoch, the test pass, the first prediction, the first
training job). Never a traceback, never another exit status, and never a run on a value that the
rule table refuses (:func:`cals_seg.config.checks.check_config` without the data and run paths,
which a
tool checks only where it reads or writes them).

Values per key, from its type (the config dataclasses, or the shipped value for ``params``):
malformed YAML, empty (null), empty string, wrong type, negative, zero, huge, NaN, a file where a
folder is wanted and the reverse, missing paths, unknown names.

``make test`` runs every case through every tool with the work stopped where it starts
(:data:`STOP`); ``-m slow`` runs the first epoch / the test pass / the predictions for real
(``test_fuzz_runs_the_work``) and a sample through subprocesses.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import subprocess
import sys
import time
import traceback
import typing
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cals_seg.config import schema as config_mod
from cals_seg.config.schema import load_config

from ._networks import build_networks_once
from .conftest import copy_run, load_tool

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SETUP_FILES = sorted(CONFIGS.glob("*.yaml"))
BASE = {  # family -> (setup file, tiny settings); {tmp} is the test's folder
    "segmentation": ("synthetic_deeplabv3.yaml", [
        "data.root={tmp}/data_seg", "data.synthetic={num_train: 8, num_test: 4, image_size: 32}",
        "data.crop_size=32", "model.params={encoder_output_stride: 16, decoder_channels: 16}",
        "model.encoder_name=tu-mobilenetv3_small_050",  # a tenth of ResNet-18's weights to draw
        "train.batch_size=4", "eval.batch_size=4", "eval.num_maps=0",
        "eval.temperature_scaling=false"]),
    "classification": ("synthetic_cls.yaml", [
        "data.root={tmp}/data_cls", "data.synthetic={max_train: 12, min_train: 4, num_val: 2, "
        "num_test: 2, image_size: 16}", "data.image_size=16", "train.batch_size=8",
        "eval.batch_size=16", "eval.temperature_scaling=false"]),
    "text": ("synthetic_text.yaml", [
        "data.root={tmp}/data_text", "data.synthetic={num_train: 20, num_test: 5}",
        "data.val_count=20", "train.batch_size=16", "eval.temperature_scaling=false"]),
}
COMMON = ["train.epochs=1", "train.threads=1", "train.progress=false", "train.amp=none"]
TOOLS = {"segmentation": ["train_seg", "eval_seg", "predict_seg", "compare"],
         "classification": ["train_cls", "compare"], "text": ["train_cls", "compare"]}
FOLDER_KEYS = ("data.root", "output_dir")
FILE_KEYS = ("model.encoder_weights", "model.glove_path")


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


class Reached(Exception):  # noqa: N818  (a sentinel, not an error)
    """The tool got past every check and started its work."""


# --------------------------------------------------------------------------- the cases
def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("synthetic", "split_files") and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def family_of(dataset: str) -> str:
    """``segmentation``, ``classification`` (images) or ``text``, from the dataset registry."""
    from cals_seg.tasks import DATASETS

    return DATASETS[dataset].kind


def setup_keys() -> dict[tuple[str, str], tuple[Any, str]]:
    """(family, key) -> (a shipped value, the ``--set`` items of its loss section), over every
    setup file; the loss keys come from the methods tables."""
    keys: dict[tuple[str, str], tuple[Any, str]] = {}
    for path in SETUP_FILES:
        data = config_mod._yaml_load(path.read_text())
        methods = data.pop("methods")
        data.pop("method", None)
        family = family_of(data["data"]["name"])
        for key, value in _flat(data).items():
            keys.setdefault((family, key), (value, ""))
        for entry in methods.values():
            loss = {k: v for k, v in entry.items() if k != "contrib"}  # contrib: top-level key
            for key, value in _flat({"loss": loss}).items():
                keys.setdefault((family, key), (value, _loss_items(entry, key)))
    return keys


def _loss_items(loss: dict[str, Any], key: str) -> str:
    """The ``--set`` items that give a base config the shipped loss section of ``key`` (so
    that its parameter is one the loss takes), as one tab-separated string."""
    opt_in = f"contrib={json.dumps(loss['contrib'])}" if loss.get("contrib") else ""
    if key == "loss.name":
        return opt_in
    params = json.dumps(loss.get("params", {}))
    return "\t".join(filter(None, (opt_in, f"loss.name={loss['name']}",
                                    f"loss.params={params}")))


def _field_type(key: str) -> Any:
    node: Any = config_mod.Config
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None  # inside params / synthetic / split_files
        node = typing.get_type_hints(node).get(part)
    return node


def _kind(key: str, shipped: Any) -> str:
    tp = _field_type(key)
    if tp is not None:
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        tp = args[0]
        origin = typing.get_origin(tp)
        if origin is list:
            return "list"
        if origin is dict:
            return "dict"
        return {int: "int", float: "float", str: "str", bool: "bool"}.get(tp, "str")
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str),
                        ("list", list), ("dict", dict)):
        if isinstance(shipped, types):
            return kind
    return "str"


def wrong_values(key: str, shipped: Any, tmp: Path) -> list[str]:
    """YAML texts given as ``--set key=<text>``."""
    values = ["{oops", "", '""']  # malformed YAML, null, empty string
    kind = _kind(key, shipped)
    if kind in ("int", "float"):
        values += ["abc", "[1, 2]", "true", "-1", "0", "1000000000000"]
        values += [".nan", "-0.5", "1.0e+30"] if kind == "float" else ["2.5"]
    elif kind == "str":
        values += ["123", "[a, b]", "no_such_value"]
    elif kind == "bool":
        values += ["maybe", "2"]
    elif kind == "list":
        values += ["5", "[]", "[-1, 2]", "[0, 0]", "[1000000000000, 1000000000001]", "[a, b]"]
    elif kind == "dict":
        values += ["5", "[1, 2]", "{no_such_key: 1}"]
    if key in FOLDER_KEYS:
        values += [str(tmp / "a_file"), str(tmp / "a_file" / "below")]
    if key in FILE_KEYS:
        values += [str(tmp / "a_folder"), str(tmp / "missing.pth")]
    if key == "data.split_files":
        values += [f"{{train: {tmp / 'a_folder'}, val: x.txt, test: x.txt}}"]
    return values


def cases(tmp: Path) -> list[tuple[str, str, str, str]]:
    """(family, key, loss items, value) without repeats."""
    out = []
    for (family, key), (shipped, loss) in sorted(setup_keys().items()):
        for value in wrong_values(key, shipped, tmp):
            out.append((family, key, loss, value))
    return out


# --------------------------------------------------------------------------- running a case
_MODULES: dict[str, Any] = {}


def tool_module(name: str) -> Any:
    if name not in _MODULES:
        _MODULES[name] = load_tool(name)
    return _MODULES[name]


# Where each tool's work starts (patched to raise Reached): module, attribute.
STOP = {
    "train_seg": ("cals_seg.training.trainer", "train_one_epoch"),
    "train_cls": ("cals_seg.training.trainer", "train_one_epoch"),
    "eval_seg": ("tool", "evaluate_run"),
    "predict_seg": ("cals_seg.evaluation.inference", "predict_image"),
    "compare": ("cals_seg.training.study", "run_one"),
}


def _stop(tool: str, monkeypatch, after_work: bool) -> None:
    """Stop the tool where its work starts, or (``after_work``) once the first epoch has been
    trained and validated; compare always stops before training (its runs are subprocesses of
    the training tools, fuzzed above)."""
    where, name = STOP[tool]
    module = tool_module(tool) if where == "tool" else importlib.import_module(where)
    if after_work and tool != "compare":
        if tool.startswith("train"):
            real_validate = module.validate

            def validate(*args, **kwargs):
                real_validate(*args, **kwargs)
                raise Reached

            monkeypatch.setattr(module, "validate", validate)
        return

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(module, name, reached)


def _argv(tool: str, family: str, key: str, loss: str, value: str, env: dict[str, Any],
          index: int) -> list[str]:
    tmp = env["tmp"]
    items = [*filter(None, loss.split("\t")), f"{key}={value}"]
    if tool in ("eval_seg", "predict_seg"):
        run = env["run"]
        if tool == "eval_seg":
            return [str(run / "config.yaml"), "--checkpoint", str(run / "checkpoint_best.pt"),
                    "--out", str(tmp / "out" / f"eval{index}"), "--set", *items]
        return [str(run), str(env["image"]), "--out", str(tmp / "out" / f"pred{index}"),
                "--no-progress", "--set", *items]
    setup, tiny = BASE[family]
    sets = [_fill(s, tmp) for s in tiny] + COMMON
    if tool == "compare":
        return [str(CONFIGS / setup), "--methods", "ce", "--out",
                str(tmp / "out" / f"cmp{index}"), "--set", *sets, *items]
    return [str(CONFIGS / setup), "--method", "ce", "--set", *sets, f"name=case{index}",
            f"output_dir={tmp / 'runs' / f'case{index}'}", *items]


def run_case(tool: str, argv: list[str]) -> tuple[str, str]:
    """``(outcome, text)``: ``ran``, ``refused`` (exit 2, stderr), ``exit <n>`` or
    ``traceback``."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with warnings.catch_warnings(), redirect_stderr(err), redirect_stdout(out):
            warnings.simplefilter("ignore")
            rc = tool_module(tool).main(argv)
    except Reached:
        return "ran", ""
    except SystemExit as exit_info:  # argparse
        rc = exit_info.code
    except Exception:
        return "traceback", traceback.format_exc(limit=-3)
    text = err.getvalue().strip()
    if rc == 0:
        return "ran", text
    if rc == 2:
        return "refused", text
    return f"exit {rc}", text


def names_key(message: str, key: str) -> bool:
    if key in message:
        return True
    section, _, leaf = key.rpartition(".")
    return section.endswith(("params", "synthetic", "split_files")) and section in message \
        and leaf in message


def rule_refuses(argv_config: str, sets: list[str], method: str | None) -> bool:
    """Whether the rule table (types, ranges, choices, names, devices; no data or run paths)
    refuses the config these arguments give."""
    try:
        from cals_seg.config.checks import check_config

        cfg = load_config(argv_config, sets, method)
        check_config(cfg, reads_data=False, writes_run=False)
    except TypeError:  # an older check_config (no rule table): nothing to compare with
        return False
    except ValueError:
        return True
    return False


def check_case(tool: str, family: str, key: str, loss: str, value: str, env: dict[str, Any],
               index: int) -> str | None:
    """None when the case ends right, else what went wrong."""
    argv = _argv(tool, family, key, loss, value, env, index)
    outcome, text = run_case(tool, argv)
    label = f"{tool} --set {key}={value!r}"
    if outcome == "traceback":
        return f"{label}: traceback {text.strip().splitlines()[-1][:200]}"
    if outcome == "refused":
        lines = text.splitlines()
        one_line = len(lines) == 1 and lines[0].startswith("error: ")
        usage = bool(lines) and lines[0].startswith("usage:") and ": error: " in lines[-1]
        if not (one_line or usage):  # argparse's own usage errors end with their one line
            return f"{label}: not one line: {text[:300]!r}"
        if not names_key(lines[-1], key):
            return f"{label}: the message does not name {key}: {lines[-1][:200]}"
        return None
    if outcome != "ran":
        return f"{label}: {outcome}: {text[-200:]}"
    # ran: the rule table must accept the value as this tool was given it
    if "--set" in argv:
        i = argv.index("--set")
        sets = argv[i + 1:]
        if tool in ("eval_seg", "predict_seg"):
            run = env["run"]
            config_path, method_arg = str(run / "config.yaml"), None
        else:
            config_path, method_arg = argv[0], "ce"
        if rule_refuses(config_path, sets, method_arg):
            return f"{label}: ran, but the rule table refuses the value"
    return None


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def env(tmp_path_factory, trained_run) -> dict[str, Any]:
    """The tiny data of each family, a finished segmentation run (a copy of the session's
    one-epoch run, for eval_seg and predict_seg), an image, a file and a folder for the path
    values."""
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "a_file").write_text("not a folder\n")
    (tmp / "a_folder").mkdir()
    from cals_seg.tasks import build_task

    for setup, tiny in BASE.values():  # generate each family's data once
        sets = [_fill(s, tmp) for s in tiny] + COMMON
        build_task(load_config(CONFIGS / setup, sets, "ce"))
    image = tmp / "photo.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), np.uint8)).save(image)
    run = copy_run(trained_run.folder, tmp / "runs")
    return {"tmp": tmp, "run": run, "image": image}


def tools(family: str, key: str, value: str, everything: bool, tmp: Path) -> list[str]:
    """The tools a case goes through: every tool of its family, or (``make test``) the training
    tool always and the others for one value in six (the rule table they share is
    the same; the slow test runs them all)."""
    if everything:
        return TOOLS[family]
    others = TOOLS[family][1:]
    pick = sum(map(ord, key + value.replace(str(tmp), ""))) % 6 == 0
    return TOOLS[family][:1] + (others if pick else [])


def _fuzz(env, monkeypatch, after_work: bool, families=tuple(BASE)) -> tuple[int, list[str]]:
    count, failures, index = 0, [], 0
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    monkeypatch.chdir(env["tmp"])  # relative paths among the values land in the test's folder
    # each network built once per set of arguments (a copy for each case): building it was
    # most of the cost of a case that reaches the work
    build_networks_once(monkeypatch)
    for family, key, loss, value in cases(env["tmp"]):
        if family not in families:
            continue
        for tool in tools(family, key, value, after_work, env["tmp"]):
            index += 1
            count += 1
            tic = time.perf_counter()
            with monkeypatch.context() as patch:
                _stop(tool, patch, after_work)
                failure = check_case(tool, family, key, loss, value, env, index)
            seconds[tool] = seconds.get(tool, 0.0) + time.perf_counter() - tic
            if failure is not None:
                failures.append(failure)
    report = {"cases": count, "failures": len(failures), "seconds":
              round(time.perf_counter() - start, 1), "per_tool": seconds,
              "first": failures[:60]}
    out = ROOT / ".pytest_cache" / f"fuzz_{'work' if after_work else 'checks'}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return count, failures


def test_fuzz_every_key_of_every_setup_file(env, monkeypatch):
    """Every case through every tool of its family, stopped where the work starts."""
    count, failures = _fuzz(env, monkeypatch, after_work=False)
    assert count > 1000
    assert not failures, f"{len(failures)} of {count} cases:\n" + "\n".join(failures[:30])


@pytest.mark.slow
def test_fuzz_runs_the_work(env, monkeypatch):
    """The same cases with the work done: the first epoch trained and validated, the test
    pass of eval_seg, the predictions of predict_seg."""
    count, failures = _fuzz(env, monkeypatch, after_work=True)
    assert not failures, f"{len(failures)} of {count} cases:\n" + "\n".join(failures[:30])


SUBPROCESS_SAMPLE = [
    ("train_seg", "train.epochs", "0"), ("train_seg", "train.device", "cuda:7"),
    ("train_seg", "data.root", "{tmp}/a_file"), ("train_seg", "loss.params", "{oops"),
]


@pytest.mark.parametrize("tool,key,value", SUBPROCESS_SAMPLE)
def test_fuzz_sample_through_a_subprocess(tool, key, value, env):
    """The tool as a user runs it: one line on stderr, exit status 2."""
    argv = _argv(tool, "segmentation", key, "", _fill(value, env["tmp"]), env, 0)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), proc.stderr


def test_every_config_key_has_a_rule_and_every_setup_key_is_fuzzed():
    from cals_seg.config.rules import RULES, config_keys

    assert set(RULES) == set(config_keys())
    fuzzed = {key for _, key in setup_keys()}
    assert len(fuzzed) >= 60 and {"train.epochs", "data.root", "loss.params.margin"} <= fuzzed



def test_reading_and_checking_a_config_evaluates_its_annotations_once(monkeypatch, tmp_path):
    """The config dataclasses' type hints are evaluated once per process
    (:func:`cals_seg.config.schema.field_types`), not again for each section of each config
    read and checked: they were most of the time of a check (5 ms of a 5.6 ms check_config)."""
    from cals_seg.config.checks import check_config

    sets = [f"data.root={tmp_path / 'data'}", "train.epochs=2"]
    check_config(load_config(CONFIGS / "synthetic_deeplabv3.yaml", sets, "ce"),
                 reads_data=False, writes_run=False)
    asked: list[Any] = []
    real = typing.get_type_hints

    def recording(obj, *args, **kwargs):
        asked.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", recording)
    cfg = load_config(CONFIGS / "synthetic_deeplabv3.yaml", sets, "ce")
    check_config(cfg, reads_data=False, writes_run=False)
    assert cfg.train.epochs == 2
    again = [obj for obj in asked if dataclasses.is_dataclass(obj)
             and obj.__module__ == config_mod.__name__]
    assert not again, again
