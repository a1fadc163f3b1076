"""The docs run: every fenced ``python`` block of README.md, docs/*.md and docs/studies/*.md, and
every shell command of their ``bash`` blocks (the studies' commands too: a table's command that no
longer parses fails here), taken from the files themselves, so a doc that drifts from the code
fails here.

Python blocks (15 at the time of writing: 13 run, 2 compiled only). Each block runs on its own,
in a fresh namespace, in a fresh working folder. A block that uses objects of the reader's own
(a model, loaders, a trained run) says so on the line before its fence, with a marker that is
invisible once rendered::

    <!-- doc-test: with loop (why) -->            run it with the names of the tiny "loop" setup
    <!-- doc-test: with loaders; replace "a" by "b" -->   ... after this tiny-settings edit
    <!-- doc-test: compile-only (why) -->         needs a GPU, a download or real data: compiled
    <!-- doc-test: registers loss NAME (why) -->  the whole new file of an "Extending" step: run
                                                  it, then the entry must be registered and work
                                                  (``loss``, ``dataset``, ``corruption``, ``meter``)

The setups (``CONTEXTS``) are tiny: a 1-layer model, two batches of 16 x 16 images, or the run
trained below. A block without a marker runs with nothing given: its imports must be complete
(``test_a_snippet_without_its_import_fails`` removes one and sees the NameError).

Shell commands (every line of the ``bash`` blocks, continuation lines joined): a ``tools/``
script, a ``cals-*`` command, ``torchrun`` or a ``benchmarks/`` / ``examples/`` script is parsed
by its own argparse parser on the given words (``parse_args`` intercepted: nothing runs), and a
setup file it names is loaded with its ``--method`` and ``--set`` (so a method or key that no
longer exists fails); ``make`` targets must exist in the Makefile, ``pip install`` extras in
pyproject.toml, ``bash`` scripts must parse. README's train -> eval -> predict chain runs for real
on the embedded data at tiny sizes, and the commands the docs' defects were found with run and
show their fixes (the flag named in the error, a finished run refused on ``--resume``, the
calibration maps of the test split).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from .conftest import figures_undrawn

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "studies").glob("*.md"))]


def doc_name(path: Path) -> str:
    """``README.md``, ``api.md``, ``studies/margin.md``: a doc as the tests name it."""
    return path.relative_to(ROOT / "docs").as_posix() if path.parent != ROOT else path.name

# Where every shell command must be runnable or parsed (the others' bash blocks are too).
COMMAND_DOCS = ("README.md", "training.md")
EXPECTED_PYTHON_BLOCKS = 18
MARKER = re.compile(r"<!--\s*doc-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
TINY = [  # the embedded data and DeepLabV3 at sizes that train in seconds on one core
    "data.synthetic={num_train: 8, num_test: 4, image_size: 32}", "data.crop_size=32",
    "train.epochs=1", "train.batch_size=4", "eval.batch_size=4", "train.progress=false",
    "train.threads=1", "train.amp=none", "train.device=cpu",
    "model.params={encoder_output_stride: 16, decoder_channels: 16}",
]


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    marker: str = ""
    replacements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def compile_only(self) -> bool:
        return self.marker.startswith("compile-only")

    @property
    def context(self) -> str | None:
        m = re.match(r"with (\w+)", self.marker)
        return m.group(1) if m else None

    @property
    def registers(self) -> tuple[str, str] | None:
        """``(kind, name)`` of an "Extending" block: the entry its file registers."""
        m = re.match(r"registers (loss|dataset|corruption|meter|calibrator|score) (\w+) \(.+\)$",
                     self.marker)
        return (m.group(1), m.group(2)) if m else None


def collect_blocks() -> list[Block]:
    """Every fenced block of the docs, with the ``doc-test`` marker of the line before it."""
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = MARKER.search(lines[i - 1]) if i else None
            marker = before.group(1) if before else ""
            replacements = re.findall(r'replace "([^"]*)" by "([^"]*)"', marker)
            blocks.append(Block(doc_name(path), i + 1, m.group(1),
                                "\n".join(lines[i + 1:end]) + "\n",
                                marker, replacements))
            i = end + 1
    return blocks


BLOCKS = collect_blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def collect_commands() -> list[tuple[str, int, list[str]]]:
    """``(doc, line, words)`` of every command line of every ``bash`` block."""
    found = []
    for block in (b for b in BLOCKS if b.lang == "bash"):
        if block.doc == "external_models.md":  # commands on the reader's own network files:
            continue  # the same steps run for real in tests/test_external_model.py
        pending, start = "", 0
        for n, line in enumerate(block.code.splitlines(), block.line + 1):
            start = start or n
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            words = shlex.split(pending + line, comments=True)
            if words:
                found.append((block.doc, start, words))
            pending, start = "", 0
    return found


COMMANDS = collect_commands()


# ----------------------------------------------------------------------------- tiny setups
def _loop() -> dict:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 21, 3, padding=1)

    def batch():
        x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 21, (2, 16, 16))
        y[:, :2] = 255  # void pixels
        return x, y

    loader = [batch(), batch()]
    return {"device": torch.device("cpu"), "epochs": 2, "model": model,
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
            "train_loader": loader, "val_loader": loader, "x": loader[0][0]}


def _logits() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 21, 8, 8, generator=g) * 3
    target = torch.randint(0, 21, (2, 8, 8), generator=g)
    target[:, 0] = 255
    return {"logits": logits, "target": target, "masks": target,
            "probs": logits.softmax(dim=1), "batches": [(logits, target), (logits + 1, target)]}


def _loaders() -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=g),
                         torch.randint(0, 21, (8, 32, 32), generator=g))
    return {"train_loader": DataLoader(data, batch_size=4),
            "val_loader": DataLoader(data, batch_size=4)}


CONTEXTS = {"loop": _loop, "batches": _logits, "logits": _logits, "probs": _logits,
            "loaders": _loaders, "run": dict}


@contextlib.contextmanager
def chdir(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run_tool(name: str, argv: list[str]) -> int:
    """``tools/<name>.py ARGV`` in this process (its ``main``), the exit status."""
    import importlib

    return importlib.import_module(f"cals_seg.commands.{name}").main(argv)


def find_command(doc: str, start: list[str]) -> list[str]:
    """The words of the command of ``doc`` that begins with ``start`` (it must be there)."""
    for d, _, words in COMMANDS:
        if d == doc and words[:len(start)] == start:
            return words
    raise AssertionError(f"{doc} no longer shows a command starting with {' '.join(start)}")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder where README's first training command ran at tiny sizes (configs/ linked in):
    ``runs/synthetic_deeplabv3_cals_alm`` is a finished run; ``photo.jpg`` a new image."""
    pytest.importorskip("segmentation_models_pytorch")
    from PIL import Image

    work = tmp_path_factory.mktemp("docs")
    (work / "configs").symlink_to(ROOT / "configs")
    rng = np.random.default_rng(0)
    for folder in ("photos", "slides"):
        (work / folder).mkdir()
        Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(
            work / folder / "a.png")
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(work / "photo.jpg")
    words = find_command("README.md", ["python", "tools/train_seg.py",
                                       "configs/synthetic_deeplabv3.yaml"])
    assert words == ["python", "tools/train_seg.py", "configs/synthetic_deeplabv3.yaml"]
    # The run's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
    # checks what the documented commands print and write; tests/test_pipeline.py and
    # tests/test_contrib_auto_margin.py draw them.
    with chdir(work), contextlib.redirect_stdout(printed := io.StringIO()), figures_undrawn():
        assert run_tool("train_seg", [*words[2:], "--set", *TINY]) == 0
    (work / "train_output.txt").write_text(printed.getvalue())
    assert (work / "runs" / "synthetic_deeplabv3_cals_alm" / "test_metrics.json").is_file()
    return work


# ----------------------------------------------------------------------------- python blocks
def test_collects_every_block():
    """15 python blocks (README 2, api 4, calibrators 1, conformal 1, datasets 1, external models
    2, integrations 4: 13 run, 2 only compiled); each one
    runs or says why it is only compiled; every marker is understood."""
    assert len(PYTHON) == EXPECTED_PYTHON_BLOCKS, [b.name for b in PYTHON]
    for block in BLOCKS:
        if not block.marker:
            continue
        assert block.lang == "python", f"{block.name}: a doc-test marker on a {block.lang} block"
        if block.compile_only:
            assert re.fullmatch(r"compile-only \(.+\)", block.marker), block.name
        elif block.registers is None:
            assert block.context in CONTEXTS, f"{block.name}: unknown setup {block.marker!r}"
        for old, _ in block.replacements:
            assert old in block.code, f"{block.name}: {old!r} is not in the block"
    assert sum(not b.compile_only for b in PYTHON) == 15
    # every "Extending" section's code runs and registers (none is a fragment compiled only)
    assert sorted(b.registers for b in PYTHON if b.registers) == [
        ("calibrator", "shrunk_ts"), ("dataset", "mydata"), ("loss", "ce_squared"),
        ("score", "top_ratio")]
    assert len([c for c in COMMANDS if c[0] in COMMAND_DOCS]) >= 15


def _namespace(block: Block, request) -> dict:
    if block.context == "run":
        request.getfixturevalue("workspace")
    return {"__name__": "__doc_block__", **CONTEXTS[block.context or "run"]()}


def _exec(block: Block, code: str, namespace: dict) -> dict:
    for old, new in block.replacements:
        code = code.replace(old, new)
    exec(compile(code, block.name, "exec"), namespace)
    return namespace


def _registry(kind: str):
    from cals_seg.calibrators import CALIBRATORS
    from cals_seg.data.corruptions import CORRUPTION_REGISTRY
    from cals_seg.data.registry import DATASETS
    from cals_seg.evaluation.conformal_score import SCORES
    from cals_seg.losses import LOSSES
    from cals_seg.metrics import METERS

    return {"loss": LOSSES, "dataset": DATASETS, "corruption": CORRUPTION_REGISTRY,
            "meter": METERS, "calibrator": CALIBRATORS, "score": SCORES}[kind]


def check_registered(kind: str, name: str) -> None:
    """The entry an "Extending" file registered is used the way the tools use one: a loss built
    by name and run, a dataset named by a config (the config rules and the task family know
    it), a corruption parsed from ``--shift NAME:1`` and applied, a meter in a task's meters."""
    import torch

    from cals_seg.config import load_config
    from cals_seg.config.checks import check_config
    from cals_seg.data.corruptions import parse_shifts
    from cals_seg.losses import build_loss
    from cals_seg.tasks import SegmentationTask, task_family

    assert name in _registry(kind), f"the {kind} block did not register {name!r}"
    if kind == "loss":
        logits = torch.randn(2, 3, 4, 4, requires_grad=True)
        target = torch.randint(0, 3, (2, 4, 4))
        target[:, 0] = 255
        value = build_loss(name, 3, ignore_index=255)(logits, target)
        value.backward()
        assert value.dim() == 0 and torch.isfinite(value) and logits.grad is not None
    elif kind == "dataset":
        cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml",
                          [f"data.name={name}", "train.device=cpu"])
        check_config(cfg)
        assert task_family(cfg) == _registry(kind)[name].family
    elif kind == "calibrator":
        import tempfile

        from cals_seg.calibrators import build_calibrator, load_calibrator, save_calibrator

        gen = torch.Generator().manual_seed(0)
        batches = [(3 * torch.randn(2, 3, 6, 6, generator=gen),
                    torch.randint(0, 3, (2, 6, 6), generator=gen)) for _ in range(2)]
        cal = build_calibrator(name, 3)
        cal.fit(lambda: iter(batches), ignore_index=255)
        with tempfile.TemporaryDirectory() as tmp:
            save_calibrator(cal, Path(tmp) / f"{name}.pt")
            again = load_calibrator(Path(tmp) / f"{name}.pt", num_classes=3)
        logits = batches[0][0]
        torch.testing.assert_close(again(logits), cal(logits), rtol=0, atol=0)
        assert again(logits).shape == logits.shape
    elif kind == "score":
        from cals_seg.commands._conformal import parse_conformal
        from cals_seg.evaluation.conformal_score import SCORES, refuse_onnx

        assert parse_conformal(["alpha=0.1", f"score={name}"])["score"] == name
        probs = torch.softmax(torch.randn(2, 4, 5), dim=1)
        scores = SCORES[name].scores(probs, 0)
        assert scores.shape == probs.shape and bool(((scores >= 0) & (scores <= 1)).all())
        refuse_onnx(name)  # an ONNX-holdable score is not refused
    elif kind == "corruption":
        (shift,) = parse_shifts([f"{name}:1"])
        image = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        assert shift.apply(image, index=0).shape == image.shape
    else:
        task = SegmentationTask(None, None, None, None, 3, 255, ["a", "b", "c"])
        assert name in task.meters(test=True)


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.name)
def test_python_block(block, request, tmp_path):
    code = compile(block.code, block.name, "exec")  # every block at least compiles
    if block.compile_only:
        assert code is not None
        return
    if block.registers:  # the whole new file of an "Extending" step
        kind, name = block.registers
        registry = _registry(kind)
        assert name not in registry, f"{name!r} is registered before its block runs"
        try:
            with chdir(tmp_path):
                exec(code, {"__name__": "__doc_block__"})
            check_registered(kind, name)
        finally:  # the doc's entry must not outlive its block
            if name in registry:
                registry.unregister(name)
        return
    for package in ("lightning", "torchmetrics", "segmentation_models_pytorch"):
        if re.search(rf"^\s*(from|import) {package}\b", block.code, re.M):
            pytest.importorskip(package)
    namespace = _namespace(block, request)
    folder = request.getfixturevalue("workspace") if block.context == "run" else tmp_path
    with chdir(folder):
        ns = _exec(block, block.code, namespace)
    if block.context == "run":  # the documented path: run folder -> calibrated maps
        image, out, probs = ns["image"], ns["out"], ns["probs"]
        assert tuple(out.label.shape) == (1, *image.shape[:2])
        assert tuple(probs.shape) == (1, 11, *image.shape[:2])
        assert ns["run"].temperature is not None and ns["run"].temperature > 0


def _block(doc: str, contains: str) -> Block:
    return next(b for b in PYTHON if b.doc == doc and contains in b.code)


@pytest.mark.parametrize(("doc", "contains", "line"), [
    ("README.md", "fit_temperature", "import torch"),
    ("api.md", "criterion.observe(model(images), masks)", "import torch"),  # the fixed defect
    ("integrations.md", "AdaptiveLossCallback()", "import lightning as L"),
])
def test_a_snippet_without_its_import_fails(doc, contains, line, request, tmp_path):
    """Drift the other way: a block with one import line removed raises NameError, so the run
    above proves the blocks' imports complete."""
    if "lightning" in line:
        pytest.importorskip("lightning")
    block = _block(doc, contains)
    assert line in block.code.splitlines()
    mutated = "\n".join(x for x in block.code.splitlines() if x != line)
    with chdir(tmp_path), pytest.raises(NameError):
        _exec(block, mutated, _namespace(block, request))


# ----------------------------------------------------------------------------- shell commands
class _Parsed(Exception):  # noqa: N818 (a signal, not an error)
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def parse_script(script: Path, argv: list[str]) -> argparse.Namespace:
    """``python SCRIPT ARGV`` up to its ``parse_args``: the namespace its parser makes of
    ``argv``; nothing after the parsing runs."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    assert script.is_file(), f"{script} does not exist"
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(sys, "argv", [str(script), *argv]):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except _Parsed as parsed:
            return parsed.namespace
        except ModuleNotFoundError as err:  # an optional extra that this environment lacks
            if err.name not in ("lightning", "torchmetrics", "onnx", "onnxscript"):
                raise
            pytest.skip(f"{script.name} needs {err.name} (an optional extra)")
        except SystemExit as err:
            raise AssertionError(f"{script.name} {' '.join(argv)}: refused by its parser "
                                 f"(exit {err.code})") from None
    raise AssertionError(f"{script.name} never parsed its arguments")


def check_configs(ns: argparse.Namespace) -> int:
    """Load every setup file the parsed command names, with its method(s) and --set items."""
    from cals_seg.config.schema import load_config

    configs = getattr(ns, "configs", None) or [getattr(ns, "config", None)]
    methods = getattr(ns, "methods", None) or [getattr(ns, "method", None)]
    sets = list(getattr(ns, "set", None) or [])
    loaded = 0
    for config in configs:
        if config is None or not str(config).endswith(".yaml"):
            continue
        for method in methods:
            load_config(config, sets, method)
            loaded += 1
    return loaded


def check_command(words: list[str]) -> str:
    """Parse one documented command (module docstring); returns what was checked."""
    program = words[0]
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        ns = get_args_parser().parse_args(words[1:])
        return "torchrun + " + check_command(["python", ns.training_script,
                                              *ns.training_script_args])
    if program.startswith("cals-"):
        tool = program[5:].replace("-", "_")
        assert f'{program} = "cals_seg.commands.{tool}:cli"' in (ROOT / "pyproject.toml"
                                                                 ).read_text(), program
        return check_command(["python", f"tools/{tool}.py", *words[1:]])
    if program == "python":
        ns = parse_script(ROOT / words[1], words[2:])
        return f"parsed, {check_configs(ns)} config(s) loaded"
    if program == "make":
        makefile = (ROOT / "Makefile").read_text()
        for target in words[1:]:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"no make {target}"
        return "make target"
    if program == "bash":
        subprocess.run(["bash", "-n", str(ROOT / words[1])], check=True)
        return "bash -n"
    if program == "pip":
        assert words[1] == "install", words
        import tomllib

        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
            "optional-dependencies"]
        for word in words[2:]:
            m = re.fullmatch(r"\.\[([\w,]+)\]", word)
            for extra in (m.group(1).split(",") if m else []):
                assert extra in extras, f"pip install {word}: no extra {extra!r}"
        if "--index-url" in words:
            assert words[words.index("--index-url") + 1].startswith("https://download.pytorch")
        return "pip"
    raise AssertionError(f"unknown program {program!r}: teach tests/test_docs.py to check it")


@pytest.mark.parametrize(("doc", "line", "words"), COMMANDS,
                         ids=[f"{d}:{n}" for d, n, _ in COMMANDS])
def test_shell_command_parses(doc, line, words):
    with chdir(ROOT):
        assert check_command(words)


# ----------------------------------------------------------------------------- run for real
def test_readme_eval_and_predict_run(workspace, capsys):
    """README's eval_seg and predict_seg lines on the tiny run: the maps are those README
    describes (eval.num_maps of them, named by the test images' ids, none ``_val_``)."""
    eval_words = find_command("README.md", ["python", "tools/eval_seg.py"])
    predict_words = find_command("README.md", ["python", "tools/predict_seg.py"])
    with chdir(workspace), figures_undrawn():  # names and counts (drawn in test_pipeline.py)
        assert run_tool("eval_seg", eval_words[2:]) == 0
        assert run_tool("predict_seg", predict_words[2:]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"test: ECE \d+\.\d\d%  AECE \d+\.\d\d%", printed), printed
    maps = sorted((workspace / "runs/synthetic_deeplabv3_cals_alm/eval_test/maps").glob("*.png"))
    assert len(maps) == 4  # eval.num_maps of the synthetic setup
    assert all("_test_" in m.name and "_val_" not in m.name for m in maps), maps
    assert (workspace / "predictions" / "a_confidence.png").is_file()


def test_training_prints_ece_in_percent_and_epochs_from_1(workspace):
    """The console's ECE is in %, as every table; it counts epochs from 1 as metrics.csv and
    TensorBoard do (tests/test_loggers.py checks those), history.jsonl keeps the index."""
    import json

    printed = (workspace / "train_output.txt").read_text()
    assert re.search(r"^epoch   1/1  loss \d+\.\d{4}  val ECE \d+\.\d\d%", printed, re.M), printed
    assert re.search(r"^test \(best epoch 1\): miou \S+  ECE \d+\.\d\d%  AECE \d+\.\d\d%",
                     printed, re.M), printed
    run = workspace / "runs" / "synthetic_deeplabv3_cals_alm"
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0]


def test_device_flag_is_named_as_typed(workspace, capsys):
    """training.md's ``--device cuda`` on a machine without CUDA names ``--device``."""
    import torch

    words = find_command("training.md", ["python", "tools/predict_seg.py",
                                         "runs/synthetic_deeplabv3_cals_alm/checkpoint_best.pt"])
    assert words[-2:] == ["--device", "cuda"]
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command is only parsed")
    with chdir(workspace):
        assert run_tool("predict_seg", words[2:]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --device: expected") and "use --device cpu" in err, err
    assert "train.device" not in err, err


def test_resume_of_a_finished_run_says_so(workspace, capsys):
    """README's ``train_seg --resume RUN`` on a finished run: refused, saying it is finished
    (it used to print ``epochs 2..1`` and test again)."""
    words = find_command("README.md", ["python", "tools/train_seg.py", "--resume"])
    with chdir(workspace):
        code = run_tool("train_seg", [words[2], "runs/synthetic_deeplabv3_cals_alm"])
    err = capsys.readouterr().err
    assert code == 2 and "the run is finished" in err and "train.epochs" in err, err


# ----------------------------------------------------------------------------- first-hour defects
def test_console_line_gives_ece_in_percent_and_epochs_from_1():
    from cals_seg.training.trainer import _epoch_line

    line = _epoch_line(0, 2, {"loss": 1.0}, {"ece": 0.0151}, "miou", 0.39, {}, True, 1.0, 0.0)
    assert line.startswith("epoch   1/2") and "val ECE 1.51%" in line, line


def test_device_and_amp_arguments_are_named_as_flags(workspace):
    """load_run(device=..., amp=...) is what --device / --amp give: its errors name the flag."""
    from cals_seg.errors import UserError
    from cals_seg.runs.run import load_run

    run = workspace / "runs" / "synthetic_deeplabv3_cals_alm"
    with pytest.raises(UserError) as err:
        load_run(run, device="cpu", amp="fp16")
    assert str(err.value).startswith("--amp: expected") and "--amp auto" in str(err.value)
    assert "train.amp" not in str(err.value)
    with pytest.raises(UserError, match=r"^train\.amp: expected"):  # a --set item stays a key
        load_run(run, device="cpu", overrides=["train.amp=fp16"])


def test_offline_pretrained_weights_fail_before_smp_is_called(monkeypatch):
    """Not cached and the Hub unreachable: the error comes at once (no download retries), and
    names the key and the fixes; nothing touches the network here."""
    import segmentation_models_pytorch as smp

    from cals_seg.errors import WeightsUnavailableError
    from cals_seg.models import hub
    from cals_seg.models.segmentation import build_segmentation_model

    def no_network(*args, **kwargs):
        raise AssertionError("the test touched the network")

    monkeypatch.setattr("socket.create_connection", no_network)
    monkeypatch.setattr(smp, "create_model", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not hub.hub_reachable()
    monkeypatch.setattr(hub, "is_cached", lambda repo: False)
    with pytest.raises(WeightsUnavailableError) as err:
        build_segmentation_model("deeplabv3", "resnet34", "imagenet", 3)
    message = str(err.value)
    assert message.startswith("model.encoder_weights: 'imagenet' weights of encoder 'resnet34'")
    assert "--set model.encoder_weights=null" in message
    # cached: smp reads the cache with huggingface_hub offline (no retries), then it is reset
    from huggingface_hub import constants

    seen = []
    monkeypatch.setattr(hub, "is_cached", lambda repo: repo[0] == "smp-hub/resnet34.imagenet")
    monkeypatch.setattr(smp, "create_model",
                        lambda *a, **k: seen.append(constants.HF_HUB_OFFLINE) or "model")
    saved = constants.HF_HUB_OFFLINE
    assert build_segmentation_model("deeplabv3", "resnet34", "imagenet", 3) == "model"
    assert seen == [True] and constants.HF_HUB_OFFLINE == saved


def test_check_data_warns_about_large_crops_and_offline_weights(tmp_path, monkeypatch):
    """configs/folder_deeplabv3.yaml as shipped on small images: crop 512 on 40 x 24 images, and
    ImageNet weights that this (offline) machine has not cached: two warnings, exit 0."""

    from cals_seg.models import hub

    from ._trees import folder_tree

    monkeypatch.setattr(hub, "is_cached", lambda repo: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = folder_tree(tmp_path / "data", {"train": 4, "val": 2, "test": 2})
    argv = [str(ROOT / "configs" / "folder_deeplabv3.yaml"), "--no-progress", "--set",
            f"data.root={root}", "data.num_classes=3", "data.class_names=[a, b, c]"]
    with contextlib.redirect_stdout(out := io.StringIO()):
        assert run_tool("check_data", argv) == 0
    text = out.getvalue()
    assert "warning: data.crop_size=512 is much larger than the training images (largest " \
           "40x24, WxH)" in text and "--set data.crop_size=48" in text, text
    assert "would be downloaded" in text and "model.encoder_weights=null" in text
    with contextlib.redirect_stdout(out := io.StringIO()):
        assert run_tool("check_data", [*argv, "data.crop_size=48",
                                       "model.encoder_weights=null"]) == 0
    assert "warning: data.crop_size" not in out.getvalue()
    assert "would be downloaded" not in out.getvalue()


def test_crop_warning_rule():
    from cals_seg.data.crops import crop_coverage, crop_warning

    assert crop_coverage(64, (64, 32)) == 0.5
    assert crop_coverage(64, (32, 32), scale=2.0) == 1.0
    assert crop_warning(64, [(64, 64)], [0.75, 1.25]) is None  # the synthetic setup
    assert crop_warning(512, [(500, 375)], [0.5, 2.0]) is None  # VOC
    assert crop_warning(None, [(10, 10)]) is None and crop_warning(512, []) is None
    message = crop_warning(512, [(100, 80), (200, 150)], [0.5, 2.0])
    assert "largest 200x150" in message and "89% padding" in message
    assert "--set data.crop_size=208" in message


class _Stop(Exception):  # noqa: N818 (a signal)
    pass


def test_trainer_warns_about_large_crops(tmp_path, monkeypatch, capsys):
    """The trainer says it before the first epoch (stopped here right after its checks)."""
    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training import trainer

    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", [
        *TINY, "data.crop_size=256", f"output_dir={tmp_path / 'runs'}",
        f"data.root={tmp_path / 'data'}"], "ce")

    def stop(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(trainer, "make_loader", stop)
    with pytest.raises(_Stop):
        trainer.fit(cfg, build_task(cfg))
    err = capsys.readouterr().err
    assert "warning: data.crop_size=256 is much larger than the training images (largest " \
           "32x32, WxH)" in err, err
