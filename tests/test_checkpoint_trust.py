"""Checkpoints cannot carry code: every command that reads one refuses a pickle that would run
code (and the code never runs); earlier versions' checkpoints load safely; a trusted file is
converted only with ``--trust``."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.utils.io import UntrustedCheckpointError, load_checkpoint, rng_state, set_rng_state

from .conftest import TRAINED_NAME, copy_run, load_tool

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"
RUN_NAME = TRAINED_NAME  # the name tools/compare.py gives seed 0 of ce


class Payload:
    """Unpickling this runs ``os.system``: what a shared checkpoint could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def poisoned(trained_run, tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the session's finished run (1 epoch of CE named as tools/compare.py names seed
    0, checkpoint_last.pt kept) whose two checkpoints would run code; and the marker file that
    code creates. Written once (two 137 MB checkpoints): each test reads a copy of it."""
    run = trained_run.folder
    where = tmp_path_factory.mktemp("poisoned") / RUN_NAME
    copy_run(run, where.parent, where.name)
    marker = where.parent / f"{where.name}_MARKER"
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        state = torch.load(run / name, weights_only=True)
        state["extra"] = Payload(marker)
        torch.save(state, where / name)
    return where, marker


def _link_big(src: str, dst: str) -> str:
    """Hard-link the checkpoints (every command here refuses them before writing anything, and
    a writer replaces a checkpoint, never rewrites it in place), copy the rest."""
    if os.path.getsize(src) >= 2**20:
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


def _poisoned_copy(poisoned: tuple[Path, Path], where: Path) -> tuple[Path, Path]:
    """A copy of the :func:`poisoned` run at ``where``, and the marker file its code would
    create (none exists before)."""
    run, marker = poisoned
    assert not marker.exists(), "the checkpoint's code ran in an earlier test"
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run, where, copy_function=_link_big)
    return where, marker


def _image(tmp: Path) -> Path:
    path = tmp / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), np.uint8)).save(path)
    return path


def _argv(command: str, run: Path, tmp: Path, sets: list[str]) -> tuple[str, list[str]]:
    if command == "predict_seg":
        return "predict_seg", [str(run), str(_image(tmp)), "--out", str(tmp / "pred")]
    if command == "eval_seg":
        return "eval_seg", [str(run / "config.yaml"), "--checkpoint",
                            str(run / "checkpoint_best.pt"), "--out", str(tmp / "eval")]
    if command == "train_seg --resume":
        return "train_seg", [str(run / "config.yaml"), "--resume", str(run)]
    if command == "export":
        return "export", [str(run), "--format", "onnx", "--out", str(tmp / "model.onnx")]
    if command == "margin gaps":
        return "margin", ["gaps", str(run), "--out", str(tmp / "gaps.json")]
    if command == "compare (reuse)":
        # a finished run whose test metrics lack a key: compare evaluates its best checkpoint
        metrics = json.loads((run / "test_metrics.json").read_text())
        del metrics["pre_ts"]["ece_band"]
        (run / "test_metrics.json").write_text(json.dumps(metrics))
        out = run.parent.parent
        return "compare", [str(SETUP), "--methods", "ce", "--out", str(out), "--set", *sets]
    raise AssertionError(command)


COMMANDS = ["predict_seg", "eval_seg", "train_seg --resume", "margin gaps", "compare (reuse)",
            "export"]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_checkpoint_that_would_run_code_is_refused(command, trained_run, poisoned, tmp_path,
                                                    capsys):
    where = tmp_path / "out" / "runs" / RUN_NAME
    run, marker = _poisoned_copy(poisoned, where)
    tool, argv = _argv(command, run, tmp_path, trained_run.sets)
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip()
    assert not marker.exists(), "the checkpoint's code ran"
    assert rc == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in err, err
    assert "could run code" in last and "convert_checkpoint.py" in last and "--trust" in last
    assert f"{RUN_NAME}/checkpoint_" in last


def test_library_load_refuses_it_too(poisoned, tmp_path):
    run, marker = _poisoned_copy(poisoned, tmp_path / "lib")
    with pytest.raises(UntrustedCheckpointError, match=r"os\.system|posix\.system"):
        load_checkpoint(run / "checkpoint_best.pt")
    assert not marker.exists()


def test_checkpoint_holds_only_safe_types(trained_run):
    """What the trainer writes reads back with torch.load(weights_only=True) as it is."""
    run = trained_run.folder
    state = torch.load(run / "checkpoint_last.pt", weights_only=True)
    assert set(state) >= {"model", "optimizer", "scheduler", "criterion", "rng", "config",
                          "epoch"}
    numpy_state = state["rng"]["numpy"]
    assert isinstance(numpy_state["key"], torch.Tensor) and numpy_state["key"].numel() == 624


def test_rng_state_round_trip_is_exact():
    np.random.seed(3)  # noqa: NPY002
    np.random.standard_normal()  # noqa: NPY002  (leaves a cached Gaussian: has_gauss = 1)
    state = rng_state()
    want = (np.random.random(5), torch.rand(3))  # noqa: NPY002
    np.random.seed(99)  # noqa: NPY002
    torch.manual_seed(99)
    set_rng_state(state)
    got = (np.random.random(5), torch.rand(3))  # noqa: NPY002
    assert np.array_equal(want[0], got[0]) and torch.equal(want[1], got[1])


def _legacy(path: Path) -> None:
    """Rewrite a checkpoint as an earlier version wrote it: NumPy's RNG state as the tuple of
    ``np.random.get_state()`` (an array inside)."""
    state = torch.load(path, weights_only=True)
    n = state["rng"]["numpy"]
    state["rng"]["numpy"] = (n["bit_generator"], n["key"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"])
    torch.save(state, path)


def test_an_earlier_versions_checkpoint_loads_safely_and_resumes(trained_run, tmp_path):
    """Its only non-plain content (a uint32 array) is allowed, and nothing else: the resume from
    it draws the same random numbers as from the current form."""
    run = trained_run.folder
    current = load_checkpoint(run / "checkpoint_last.pt")
    old = tmp_path / "old.pt"
    shutil.copyfile(run / "checkpoint_last.pt", old)
    _legacy(old)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(old, weights_only=True)  # not plain: an array inside
    state = load_checkpoint(old)
    assert torch.equal(state["rng"]["numpy"]["key"], current["rng"]["numpy"]["key"])
    draws = []
    for s in (current, state):
        set_rng_state(s["rng"])
        draws.append(np.random.random(4))  # noqa: NPY002
    assert np.array_equal(*draws)


def test_convert_checkpoint_needs_trust_and_then_writes_a_safe_file(trained_run, tmp_path, capsys):
    """A checkpoint holding a NumPy scalar (written by other code): refused by the loader,
    converted with --trust, then loaded safely with the same content."""
    run = trained_run.folder
    path = tmp_path / "other.pt"
    state = torch.load(run / "checkpoint_best.pt", weights_only=True)
    state["score"] = np.float64(0.5)
    torch.save(state, path)
    with pytest.raises(UntrustedCheckpointError, match="convert_checkpoint.py .* --trust"):
        load_checkpoint(path)
    convert = load_tool("convert_checkpoint")
    assert convert.main([str(path)]) == 2
    assert "--trust" in capsys.readouterr().err
    assert convert.main([str(path), "--trust"]) == 0
    converted = load_checkpoint(path)
    assert converted["score"] == 0.5 and isinstance(converted["score"], float)
    for key, value in state["model"].items():
        assert torch.equal(converted["model"][key], value)
