"""Every file a run folder may hold, damaged every way, read by every command that reads it
(issue 59): each ends in ONE line naming the file (exit status 1 or 2, no traceback) or in a
notice and the file made again from the run, and no other file of the folder changes.

The table is generated: file kind x {empty, truncated, wrong type, missing key, random bytes} x
each command that reads that kind (``eval_seg``, ``predict_seg``, ``export``, ``compare``,
``train_seg --resume``). One tiny run is shared (the session's ``trained_run``, with a
calibrator, a conformal fit and an entropy limit added once); each case works on a copy whose
checkpoints are hard links (they are only ever replaced, never written in place). The known
cases of the issue follow the table, each with its own test.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cals_seg.commands import compare, eval_seg, export, predict_seg, train_seg
from cals_seg.runs.run import Run

from ._checkpoints_once import checkpoints_read_once
from ._networks import build_networks_once
from .conftest import SEG_SETUP, TRAINED_NAME, tiny_seg_sets

pytestmark = pytest.mark.usefixtures("undrawn_figures", "no_clean_figures", "networks_once",
                                     "checkpoints_read_once")

ALPHA = "0.3"  # the conformal fit the base run holds: conformal_risk_lac_a0.3_s0.json


@dataclass(frozen=True)
class Base:
    """The shared run with every kind of file (``run``), an input image, the ``--set`` values
    it was trained with, and compare's output folder with one evaluation of it (``cmp``, kept
    pristine in ``cmp_pristine``)."""

    run: Path
    image: Path
    sets: list[str]
    cmp: Path
    cmp_pristine: Path


@pytest.fixture(scope="module")
def no_clean_figures():
    """eval_seg's figures of the clean evaluation (drawn in a forked child) left out: what is
    tested here is how the run's files are read, and the child was half of each call."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_seg, "draw_clean_figures", lambda *args, **kwargs: None)
        yield


@pytest.fixture(scope="module")
def networks_once():
    """The run's network built once (:func:`tests._networks.build_networks_once`): each
    command loading the run built it again before reading its weights from the checkpoint."""
    with pytest.MonkeyPatch.context() as patch:
        build_networks_once(patch)
        yield


@pytest.fixture(scope="module", name="checkpoints_read_once")
def _checkpoints_read_once():
    """Each checkpoint file read once (:func:`tests._checkpoints_once.read_once`): every case's
    copy of the run hard-links the base run's checkpoints, which each command read again."""
    with checkpoints_read_once():
        yield


def _main(module, argv: list[str], said: list[str] | None = None) -> int:
    """``module.main(argv)``; the warnings it gives (one ``warning:`` line each in a shell)
    appended to ``said``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = module.main([str(a) for a in argv])
        except SystemExit as err:  # argparse
            code = int(err.code or 0)
    if said is not None:
        said += [f"warning: {w.message}" for w in caught]
    return code


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    """One epoch of ``ce`` on the tiny synthetic setup, named as compare names seed 0, with a
    MobileNetV3 encoder (a 5 MB checkpoint: the session's ``trained_run`` holds a 137 MB one,
    which each of the ~150 cases would read and hash), plus ``calibrators/ts.pt`` (eval_seg in
    place), the conformal fit and the entropy limit (predict_seg --conformal), and compare's
    evaluation of it."""
    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    root = tmp_path_factory.mktemp("run_files")
    sets = [*tiny_seg_sets(root / "synthetic"), "model.encoder_name=tu-mobilenetv3_small_050"]
    cfg = load_config(SEG_SETUP, [*sets, f"name={TRAINED_NAME}", f"output_dir={root / 'runs'}",
                                  "train.seed=0"], "ce")
    seed_everything(cfg.train.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(cfg, build_task(cfg))
    run = cfg.run_dir
    image = sorted((root / "synthetic").rglob("JPEGImages/*.jpg"))[0]
    assert _main(eval_seg, [run, "--split", "val", "--num-maps", "0", "--calibrators", "ts"]) == 0
    assert _main(predict_seg, [run, image, "--out", root / "pred0", "--conformal", ALPHA,
                               "--no-progress"]) == 0
    assert (run / "calibrators" / "ts.pt").is_file()
    assert list((run / "calibrators").glob("entropy_p99_*.json"))
    cmp = root / "cmp"
    assert _main(compare, [run, "--out", cmp]) == 0
    shutil.copytree(cmp, root / "cmp_pristine")
    return Base(run, image, sets, cmp, root / "cmp_pristine")


# ------------------------------------------------------------------------------ the folder
def _link_big(src: str, dst: str) -> str:
    """Hard-link the checkpoints (replaced atomically by every writer, never rewritten in
    place), copy the rest (the history is appended to, the lock file written in place)."""
    if os.path.getsize(src) >= 2**20:
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


def _copy(base: Base, where: Path) -> Path:
    copy = where / "runs" / TRAINED_NAME
    shutil.copytree(base.run, copy, copy_function=_link_big)
    return copy


_HASHES: dict[tuple[int, int, int], str] = {}


def _snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file of ``folder`` (a hard-linked checkpoint, same inode, size and
    modification time, is hashed once per session)."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _HASHES:
            _HASHES[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        out[path.relative_to(folder).as_posix()] = _HASHES[key]
    return out


# ------------------------------------------------------------------------------ the damage
CORRUPTIONS = ("empty", "truncated", "wrong_type", "missing_key", "random_bytes")

# kind -> (path in the run, format, the key a "missing key" drops)
KINDS = {
    "config": ("config.yaml", "yaml", "model"),
    "checkpoint_best": ("checkpoint_best.pt", "checkpoint", "model"),
    "checkpoint_last": ("checkpoint_last.pt", "checkpoint", "model"),
    "temperature": ("temperature.json", "json", "temperature"),
    "history": ("history.jsonl", "jsonl", "epoch"),
    "test_metrics": ("test_metrics.json", "json", "pre_ts"),
    "calibrator": ("calibrators/ts.pt", "calibrator", "state"),
    "conformal": (f"calibrators/conformal_risk_lac_a{ALPHA}_s0.json", "json", "threshold_index"),
    "entropy": ("calibrators/entropy_p99_*.json", "json", "limit_nats"),
    "compare_metrics": ("metrics.json", "json", "pre_ts"),  # in compare's output folder
}


def _damaged(path: Path, fmt: str, key: str, how: str) -> bytes:
    data = path.read_bytes()
    if how == "empty":
        return b""
    if how == "truncated":  # cut mid-way (a JSON-lines file: inside its last line)
        return data[:-25] if fmt == "jsonl" else data[: len(data) // 2]
    if how == "random_bytes":
        return np.random.default_rng(len(data)).bytes(700).replace(b"\n", b"\xff")
    buffer = io.BytesIO()
    if how == "wrong_type":
        if fmt in ("checkpoint", "calibrator"):
            torch.save([1, 2, 3], buffer)
            return buffer.getvalue()
        return {"yaml": b"- data\n- model\n", "json": b"[1, 2, 3]\n",
                "jsonl": b"[1, 2]\n\"epoch\"\n"}[fmt]
    # missing_key
    if fmt in ("checkpoint", "calibrator"):
        state = torch.load(path, weights_only=True)
        state.pop(key)
        torch.save(state, buffer)
        return buffer.getvalue()
    if fmt == "yaml":
        config = yaml.safe_load(data)
        config.pop(key)
        return yaml.safe_dump(config, sort_keys=False).encode()
    if fmt == "jsonl":
        lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        return "".join(json.dumps({k: v for k, v in line.items() if k != key}) + "\n"
                       for line in lines).encode()
    value = json.loads(data)
    value.pop(key)
    return json.dumps(value).encode()


def _damage(folder: Path, kind: str, how: str) -> Path:
    """Damage the file of ``kind`` in ``folder`` (a new file: never through a hard link)."""
    name, fmt, key = KINDS[kind]
    path = next(iter(folder.glob(name))) if "*" in name else folder / name
    if kind == "compare_metrics":
        path = next(iter(folder.rglob(name)))
    new = _damaged(path, fmt, key, how)
    path.unlink()
    path.write_bytes(new)
    return path


# ------------------------------------------------------------------------------ the commands
def _argv(command: str, kind: str, run: Path, base: Base, tmp: Path) -> tuple[object, list]:
    if command == "eval_seg":  # --out outside the run: the run's folder must not change
        extra = ["--calibrators", "ts"] if kind == "calibrator" else []
        return eval_seg, [run, "--split", "val", "--num-maps", "0", "--out", tmp / "ev", *extra]
    if command == "predict_seg":
        extra = {"calibrator": ["--calibrator", "ts"], "conformal": ["--conformal", ALPHA],
                 "entropy": []}.get(kind, [])
        ood = [] if kind == "entropy" else ["--no-ood-check"]
        return predict_seg, [run, base.image, "--out", tmp / "pred", "--no-progress", *ood,
                             *extra]
    if command == "export":
        extra = {"calibrator": ["--calibrator", "ts"],
                 "conformal": ["--calibrator", "none", "--conformal", ALPHA]}.get(kind, [])
        return export, [run, "--format", "pt2", "--out", tmp / "m.pt2", *extra]
    if command == "compare":  # a given run folder: evaluated by eval_seg into compare's folder
        return compare, [run, "--out", base.cmp if kind == "compare_metrics" else tmp / "cmp"]
    if command == "compare_config":  # the run as compare trained it: reused, not retrained
        return compare, [SEG_SETUP, "--methods", "ce", "--seeds", "0", "--out", run.parents[1],
                         "--set", *base.sets]
    assert command == "resume"  # the run tested again (no epoch trained): see _damage_case
    return train_seg, ["--resume", run]


# kind -> {command: what the command does with every damage of that kind}: "refuse" (one
# line, nothing changed), "remake" (a notice, the file made again from the run), "notice" (a
# warning naming the file, the command goes on without it).
READERS = {
    "config": dict.fromkeys(("eval_seg", "predict_seg", "export", "compare", "resume"),
                            "refuse"),
    "checkpoint_best": {"eval_seg": "refuse", "predict_seg": "refuse", "export": "refuse",
                        "compare": "refuse", "resume": "remake"},
    "checkpoint_last": {"resume": "refuse"},
    "temperature": dict.fromkeys(("eval_seg", "predict_seg", "export", "compare"), "remake"),
    "history": {"eval_seg": "notice", "compare": "notice", "resume": "remake"},
    "test_metrics": {"compare_config": "refuse"},
    "calibrator": {"eval_seg": "remake", "predict_seg": "refuse", "export": "refuse"},
    "conformal": {"predict_seg": "remake", "export": "remake"},
    "entropy": {"predict_seg": "remake"},
    "compare_metrics": {"compare": "remake"},
}
# An empty history.jsonl is an imported run's own (it trained no epoch here): read as is.
ALLOWED = {("history", "empty", "eval_seg"): "ok", ("history", "empty", "compare"): "ok"}

CASES = [pytest.param(kind, how, command, id=f"{kind}-{how}-{command}")
         for kind, commands in READERS.items() for how in CORRUPTIONS for command in commands]


@contextlib.contextmanager
def _cheap_export():
    """export without tracing the network (what is tested is the reading of the run)."""
    from cals_seg.runs import export as lib

    def program(module, path, fmt, min_size=None, what="", **kwargs):
        module.min_size = 32
        Path(path).write_bytes(b"program")
        return Path(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lib, "export_program", program)
        yield


@pytest.mark.parametrize(("kind", "how", "command"), CASES)
def test_a_damaged_run_file_ends_in_one_line_or_is_made_again(base, tmp_path, capsys, kind, how,
                                                              command):
    expect = ALLOWED.get((kind, how, command), READERS[kind][command])
    if kind == "compare_metrics":
        shutil.rmtree(base.cmp)
        shutil.copytree(base.cmp_pristine, base.cmp)
        run, damaged = base.run, _damage(base.cmp, kind, how)
    else:
        run = _copy(base, tmp_path)
        damaged = _damage(run, kind, how)
        if command == "resume":  # stopped before its test: a resume only tests (cheaper)
            (run / "test_metrics.json").unlink()
    before = _snapshot(run)
    module, argv = _argv(command, kind, run, base, tmp_path)
    capsys.readouterr()
    said: list[str] = []
    with _cheap_export():
        code = _main(module, argv, said)
    out, err = capsys.readouterr()
    err += "".join(f"{line}\n" for line in said)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith(("error:", "FAILED"))]
    if expect == "refuse":
        assert code in (1, 2), (code, err)
        assert errors and damaged.name in errors[0], err
        assert len([e for e in errors if e.startswith("error:")]) <= 1 or command == "compare", err
        assert _snapshot(run) == before  # nothing written into the run
        return
    assert code == 0, err
    assert not errors, err
    if expect == "ok":
        return
    assert damaged.name in out + err, (out, err)  # the notice names the file
    if command == "resume":  # the training went on: its files are new by design
        return
    after = _snapshot(run)
    assert set(after) == set(before), set(after) ^ set(before)
    changed = {name for name in after if after[name] != before[name]}
    assert changed <= {damaged.relative_to(run).as_posix()} if damaged.is_relative_to(run) \
        else not changed, changed


# ------------------------------------------------------------------------------ known cases
def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("content", [b"", b'{"temperature": 1.2', b"{}", b'{"temperature": NaN}'])
def test_a_damaged_temperature_is_refitted_with_a_notice(base, tmp_path, capsys, content):
    run = _copy(base, tmp_path)
    (run / "temperature.json").unlink()
    (run / "temperature.json").write_bytes(content)
    with _cheap_export():
        assert _main(export, [run, "--format", "pt2", "--out", tmp_path / "m.pt2"]) == 0
    err = capsys.readouterr().err
    notice = [line for line in err.splitlines() if line.startswith("notice:")]
    assert len(notice) == 1 and "temperature.json" in notice[0] and "refitted" in notice[0]
    assert Run(run).read_temperature() > 0  # the file is whole again


def test_a_damaged_temperature_without_its_data_is_refused_with_the_way_out(base, tmp_path,
                                                                           capsys):
    run = _copy(base, tmp_path)
    (run / "temperature.json").write_text('{"temperature": 1.')
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(str(Path(base.sets[0].split("=", 1)[1])),
                                                 str(tmp_path / "nowhere")))
    assert _main(predict_seg, [run, base.image, "--out", tmp_path / "p", "--no-ood-check"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "temperature.json is truncated" in line and "refit it" in line
    assert not (tmp_path / "p").exists()  # nothing created before the checks passed


def test_a_torn_history_line_is_dropped_on_resume(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    history = run / "history.jsonl"
    whole = history.read_text()
    history.write_text(whole + '{"epoch": 1, "lr": 0.0')  # a crash while writing epoch 2's line
    assert _main(train_seg, ["--resume", run, "--set", "train.epochs=2"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"notice: .*history.jsonl: line 2 is torn .*dropped; kept the 1 whole", err)
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    assert [h["epoch"] for h in lines] == [0, 1]


def test_a_truncated_checkpoint_names_the_other_and_its_flag(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    best = run / "checkpoint_best.pt"
    data = best.read_bytes()
    best.unlink()
    best.write_bytes(data[:1000])
    assert _main(eval_seg, [run, "--split", "val", "--num-maps", "0"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "--checkpoint last" in line and "checkpoint_last.pt" in line
    # torch's first sentence, whole (it was cut at 120 characters, mid-word: "If yo)")
    assert re.search(r"cannot be read \(RuntimeError: [^()]*(directory|\.\.\.)\)", line), line


def test_a_config_cut_short_is_said_to_be_damaged(base, tmp_path, capsys):
    """Cut at a line inside the train section: valid YAML, every section a run writes present,
    but keys missing that the checkpoint's own copy of the config holds."""
    run = _copy(base, tmp_path)
    config = run / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    train = saved["train"]
    for key in list(train)[len(train) // 2:]:
        del train[key]
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    assert _main(eval_seg, [run, "--split", "val", "--num-maps", "0"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "config.yaml is damaged" in line and "does not fit" not in line


def test_a_users_error_in_a_dataloader_worker_is_one_line(base, tmp_path, capsys, monkeypatch):
    """A test mask holding 200 (11 classes), met by a DataLoader worker during the test pass
    (the up-front check of VOC-layout data switched off, as for other layouts)."""
    from PIL import Image

    run = _copy(base, tmp_path)
    data = tmp_path / "data"
    root = Path(base.sets[0].split("=", 1)[1])
    shutil.copytree(root, data)
    mask = sorted(data.rglob("SegmentationClass/syn_test_*.png"))[1]
    png = Image.open(mask)
    pixels = np.array(png)
    pixels[0, 0] = 200
    bad = Image.fromarray(pixels, mode="P")
    bad.putpalette(png.getpalette())
    bad.save(mask)
    monkeypatch.setattr("cals_seg.data.checks.check_voc_data", lambda *a, **k: None)
    import multiprocessing

    children = set(multiprocessing.active_children())
    code = _main(eval_seg, [run, "--num-maps", "0", "--out", tmp_path / "e", "--set",
                            f"data.root={data}", "data.num_workers=1"])
    line = _error_line(capsys.readouterr().err)
    assert code == 2 and "[200]" in line and "outside [0, 11)" in line
    _end_loader_workers(children)


def _end_loader_workers(before: set) -> None:
    """End the DataLoader worker the failed test pass left (a child process started since
    ``before``): its iterator, kept alive by the error's traceback, is freed by a later garbage
    collection, whose shutdown waited 5 s (torch's MP_STATUS_CHECK_INTERVAL) for the worker to
    exit, in whichever test came next."""
    import gc
    import multiprocessing

    for child in set(multiprocessing.active_children()) - before:
        child.terminate()
        child.join()
    gc.collect()


def test_every_user_error_of_a_worker_is_known_again():
    """A worker's error comes back rebuilt from its text: as its own type when that type takes
    one message, else as a RuntimeError (CalibratorFileError, RunFileError's parts): both are
    user errors again, one line; a bug's RuntimeError is not."""
    from cals_seg.commands._cli import one_line, user_error

    text = ("Caught CalibratorFileError in DataLoader worker process 0.\nOriginal Traceback "
            "(most recent call last):\n  File \"x.py\", line 1, in f\ncals_seg.calibrators."
            "CalibratorFileError: runs/x/calibrators/ts.pt is not a saved calibrator; refit it.\n")
    found = user_error(RuntimeError(text))
    assert found is not None
    assert one_line(found) == "runs/x/calibrators/ts.pt is not a saved calibrator; refit it."
    assert user_error(RuntimeError(text.replace("CalibratorFileError", "KeyError"))) is None
    assert user_error(RuntimeError("CUDA error: out of memory")) is None


def test_a_bad_test_mask_after_training_says_resume_finishes_the_test(tmp_path):
    from cals_seg.commands._cli import after_training
    from cals_seg.errors import DataError

    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint_last.pt").write_bytes(b"x")
    (run / "history.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n')
    err = after_training(DataError("Mask 'm.png' contains values [200] outside [0, 11)."), run, 2)
    assert "--resume" in str(err) and "finishes the test" in str(err) and "\n" not in str(err)
    assert "continues the training" in str(after_training(DataError("bad."), run, 5))


def test_export_of_a_missing_run_is_a_read_problem(tmp_path, capsys):
    assert _main(export, [tmp_path / "nope", "--format", "pt2", "--out", tmp_path / "m.pt2"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "does not exist" in line and "cannot write" not in line and "'a file'" not in line
    assert not (tmp_path / "m.pt2").exists()


def test_export_names_an_unfitted_calibrator_and_an_existing_file(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    assert _main(export, [run, "--format", "pt2", "--out", tmp_path / "m.pt2",
                          "--calibrator", "boundary_ts"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "boundary_ts.pt does not exist" in line and "cannot write" not in line
    (tmp_path / "mine.pt2").write_text("mine")
    assert _main(export, [run, "--format", "pt2", "--out", tmp_path / "mine.pt2"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert "cannot write the export" not in line and "mine.pt2" in line
    assert (tmp_path / "mine.pt2").read_text() == "mine"


def test_a_refused_prediction_creates_no_folder(base, tmp_path, capsys):
    run = _copy(base, tmp_path)
    out = tmp_path / "pred"
    assert _main(predict_seg, [run, base.image, "--out", out, "--calibrator", "boundary_ts"]) == 2
    _error_line(capsys.readouterr().err)
    assert not out.exists()


def test_a_wrong_override_suggests_the_value_in_force(tmp_path, capsys):
    from cals_seg.config.schema import ConfigError, load_config

    setup = SEG_SETUP.with_name("synthetic_deeplabv3_short.yaml")
    epochs = yaml.safe_load(setup.read_text())["train"]["epochs"]
    with pytest.raises(ConfigError, match=rf"--set train.epochs={epochs} \(the config file's"):
        load_config(setup, ["train.epochs=three"], "ce")
    from cals_seg.config.checks import check_config

    with pytest.raises(ConfigError, match=rf"--set train.epochs={epochs} \(the config file's"):
        check_config(load_config(setup, ["train.epochs=0"], "ce"))  # out of range: the rules
    assert "seed" not in yaml.safe_load(setup.read_text())["train"]
    with pytest.raises(ConfigError, match=r"--set train.seed=0 \(the default\)"):
        load_config(setup, ["train.seed=many"], "ce")


def test_a_loss_and_a_meter_name_a_models_output_dict():
    from collections import OrderedDict

    from cals_seg.errors import UserError
    from cals_seg.losses import build_loss
    from cals_seg.metrics import CalibrationMeter, SegmentationMeter

    logits, target = torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))
    output = OrderedDict(out=logits, aux=logits)
    with pytest.raises(UserError, match=r"criterion\(model\(x\)\['out'\], y\)") as err:
        build_loss("ce", 3)(output, target)
    assert "OrderedDict" in str(err.value)
    for meter in (CalibrationMeter(3), SegmentationMeter(3)):
        with pytest.raises(UserError, match=r"meter.update\(model\(x\)\['out'\], y\)"):
            meter.update(output, target)
    with pytest.raises(UserError, match=r"\[0\]"):
        build_loss("ce", 3)((logits, logits), target)


# ------------------------------------------------------------------------------ options first
def _no_model(monkeypatch) -> None:
    def loaded(*args, **kwargs):
        raise AssertionError("the run was loaded before the options were checked")

    monkeypatch.setattr("cals_seg.runs.run.load_run", loaded)


@pytest.mark.parametrize(("module", "options", "valid"), [
    (eval_seg, ["--calibrators", "boundary_ts", "--calibrator-param", "boundary_ts.bandz=[2,5]"],
     "bands"),
    (eval_seg, ["--calibrator-param", "boundary_ts.bands=[5,2]"], "increasing"),
    (eval_seg, ["--calibrator-param", "nope.bands=[2]"], "boundary_ts"),
    (eval_seg, ["--conformal", "alhpa=0.1"], "alpha"),
    (eval_seg, ["--conformal", "alpha=0.1", "mode=rsk"], "risk"),
    (eval_seg, ["--shift", "fgo:1"], "fog"),
    (predict_seg, ["--conformal", "0.1", "scor=lac"], "score"),
    (export, ["--conformal", "0.1", "mode=rsk"], "risk"),
    (export, ["--calibrator", "bondary_ts"], "boundary_ts"),
], ids=["eval-param-key", "eval-param-value", "eval-param-name", "eval-conformal-key",
        "eval-conformal-mode", "eval-shift", "predict-conformal", "export-conformal",
        "export-calibrator"])
def test_a_typo_in_an_option_is_refused_before_the_run_is_loaded(base, tmp_path, capsys,
                                                                  monkeypatch, module, options,
                                                                  valid):
    _no_model(monkeypatch)
    argv = {eval_seg: [base.run, "--out", tmp_path / "e"],
            predict_seg: [base.run, base.image, "--out", tmp_path / "p"],
            export: [base.run, "--format", "pt2", "--out", tmp_path / "m.pt2"]}[module]
    assert _main(module, [*argv, *options]) == 2
    line = _error_line(capsys.readouterr().err)
    assert valid in line
    assert not any((tmp_path / name).exists() for name in ("e", "p", "m.pt2"))


# ------------------------------------------------------------------------------ fits' homes
def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_evaluation_elsewhere_keeps_its_fits_and_leaves_the_runs_own(base, tmp_path, capsys):
    """eval_seg --out elsewhere with other parameters: the fit goes to OUT/calibrators, the
    run's own (which predict_seg and export use) is unchanged; with the defaults the run's own
    fit is reused, read only; in place with the defaults it is the run's; the line says which."""
    run = _copy(base, tmp_path)
    own = run / "calibrators" / "boundary_ts.pt"
    args = [run, "--split", "val", "--num-maps", "0", "--calibrators", "boundary_ts"]
    assert _main(eval_seg, args) == 0  # in place, defaults: the run's own fit
    out = capsys.readouterr().out
    assert own.is_file() and "saved as the run's own fit" in out
    digest = _digest(own)
    elsewhere = tmp_path / "elsewhere"
    assert _main(eval_seg, [*args, "--calibrator-param", "boundary_ts.bands=[2,5]",
                            "--out", elsewhere]) == 0
    out = capsys.readouterr().out
    assert _digest(own) == digest
    fit = elsewhere / "calibrators" / "boundary_ts.pt"
    assert fit.is_file() and "for this evaluation (--out elsewhere, parameters other than" in out
    assert "left as it is" in out
    from cals_seg.calibrators import load_calibrator

    assert list(load_calibrator(fit).params["bands"]) == [2, 5]
    assert list(load_calibrator(own).params["bands"]) == [3, 8]
    # --out elsewhere with the defaults: the run's own fit, reused and not written
    again = tmp_path / "again"
    assert _main(eval_seg, [*args, "--out", again]) == 0
    metrics = json.loads((again / "metrics.json").read_text())
    assert metrics["calibrator_fits"]["boundary_ts"]["loaded"] is True
    assert not (again / "calibrators").exists() and _digest(own) == digest
    # asked for: the run's own
    assert _main(eval_seg, [*args, "--calibrator-param", "boundary_ts.bands=[2,5]", "--out",
                            elsewhere, "--save-calibrators-to-run"]) == 0
    assert list(load_calibrator(own).params["bands"]) == [2, 5]


def test_every_kind_of_fit_of_an_evaluation_elsewhere_stays_with_it(base, tmp_path):
    """eval_seg --out elsewhere fitting a calibrator under drift and conformal thresholds: the
    run's fits folder is unchanged, file by file (the conformal and drift fits, like the
    calibrators, live in OUT/calibrators); in place they are the run's own."""
    run = _copy(base, tmp_path)
    folder = run / "calibrators"

    def tree() -> dict[str, str]:
        return {p.relative_to(folder).as_posix(): _digest(p)
                for p in sorted(folder.rglob("*")) if p.is_file()}

    before = tree()
    out = tmp_path / "elsewhere"
    argv = [run, "--split", "val", "--num-maps", "0", "--calibrators", "ts", "--conformal",
            "alpha=0.4", "--shift", "fog:1", "--calibrator-fit-shift"]
    assert _main(eval_seg, [*argv, "--out", out]) == 0
    assert tree() == before
    saved = {p.relative_to(out / "calibrators").as_posix()
             for p in (out / "calibrators").rglob("*") if p.is_file()}
    assert {"conformal_risk_lac_a0.4_s0.json", "drift_s0/ts.pt"} <= saved, saved
    assert _main(eval_seg, argv) == 0  # in place, with the run's config: the run's own
    after = tree()
    assert {"conformal_risk_lac_a0.4_s0.json", "drift_s0/ts.pt"} <= set(after)
    assert {k: v for k, v in after.items() if k in before} == before  # ts.pt reused, unchanged


# ------------------------------------------------------------------------------ read first
def test_a_damaged_checkpoint_is_refused_before_the_network_is_built(base, tmp_path,
                                                                     monkeypatch):
    """load_run reads the checkpoint (and refuses a damaged one, or a config.yaml cut short
    against its copy) before it builds the network or reads the data: a refusal costs no
    network, however large."""
    from cals_seg.errors import CheckpointError, RunFileError
    from cals_seg.runs.run import load_run

    def built(*args, **kwargs):
        raise AssertionError("the network was built before the checkpoint was read")

    run = _copy(base, tmp_path)
    best = run / "checkpoint_best.pt"
    data = best.read_bytes()
    best.unlink()
    best.write_bytes(data[: len(data) // 2])
    monkeypatch.setattr("cals_seg.tasks.segmentation.build_model", built)
    monkeypatch.setattr("cals_seg.tasks.build_task", built)
    for with_data in (False, True):
        with pytest.raises(CheckpointError, match="checkpoint_best.pt"):
            load_run(run, device="cpu", amp="none", with_data=with_data)
    best.unlink()
    best.write_bytes(data)
    config = run / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    del saved["train"]["epochs"]
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    with pytest.raises(RunFileError, match="config.yaml is damaged"):
        load_run(run, device="cpu", amp="none")


def test_a_load_parses_the_runs_config_once(base, tmp_path, monkeypatch):
    """config.yaml, checked as a saved config and then against the checkpoint's own copy, is
    parsed by PyYAML once per text (the parse was most of each check)."""
    from cals_seg.runs import run as lib

    run = _copy(base, tmp_path)
    config = run / "config.yaml"
    config.write_text(config.read_text() + "# a text no other test parsed\n")
    parsed = []
    real = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda text: parsed.append(text) or real(text))
    loaded = lib.load_run(run, device="cpu", amp="none")
    assert loaded.epoch == 0
    assert parsed.count(config.read_text()) == 1
