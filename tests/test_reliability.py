"""Never lose a user's file, never show a traceback (issue 35): one case per class and per tool.

Classes (docs/reliability.md, "Guarantees"): paths from data stay inside their roots; no tool
overwrites a file it did not create; every image mode is converted the same way by every reader
or refused; one process owns a run folder; one line for every error a user can cause; a command
doing several things reports the one it cannot do and goes on. Where a class has many members
the cases are generated: image modes x readers, path forms x id sources, path forms x writers.
Every case that runs a tool compares a checksum of the input tree before and after.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.commands._cli import interrupted, one_line
from cals_seg.config.schema import ConfigError, load_config, save_config
from cals_seg.data import images
from cals_seg.data.checks import sample_problems, split_file_ids
from cals_seg.data.classification import read_rgb as classification_read
from cals_seg.data.folder import read_stem_list
from cals_seg.data.paired import find_by_stem
from cals_seg.data.paired import read_rgb as paired_read
from cals_seg.data.voc import VOCSegmentation, read_split, voc_palette
from cals_seg.errors import DataError, UserError
from cals_seg.evaluation.predict import UnreadableImageError, read_image
from cals_seg.runs.run import Run
from cals_seg.utils.io import save_checkpoint, write_json
from cals_seg.utils.lock import LOCK_FILE, RunLock, RunLockedError
from cals_seg.utils.memory import MemoryEstimateError, check_batch_memory
from cals_seg.utils.paths import (
    MANIFEST,
    OutputCollisionError,
    OutputFolder,
    UnsafePathError,
    check_id,
    inside,
    read_lines,
)

from ._figures_skipped import figures_skipped
from .conftest import copy_run, load_tool

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"
# The runs' and eval_seg's figures are saved undrawn: the cases check files, messages, trees.
pytestmark = pytest.mark.usefixtures("undrawn_figures")


def tree_sum(root: Path) -> str:
    """SHA-256 of every file under ``root`` (relative path and bytes), links not followed."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def assert_one_line(err: str) -> None:
    err = err.strip()
    assert err.startswith("error: "), err
    assert "\n" not in err and "Traceback" not in err, err


# =============================================================== 3. image modes x readers
RNG = np.random.default_rng(35)
RGB8 = RNG.integers(0, 256, (6, 10, 3), dtype=np.uint8)
GREY8 = RNG.integers(0, 256, (6, 10), dtype=np.uint8)
GREY16 = RNG.integers(0, 65536, (6, 10), dtype=np.uint16)
PALETTE = RNG.integers(0, 256, (256, 3), dtype=np.uint8)


def _save(path: Path, image: Image.Image, orientation: int | None = None) -> Path:
    if orientation is None:
        image.save(path)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        image.save(path, exif=exif)
    return path


def _palette_image() -> Image.Image:
    image = Image.fromarray(GREY8, mode="L").convert("P")
    image.putpalette(PALETTE.reshape(-1).tolist())
    return image


# mode -> (file name, writer, expected RGB by an independent rule, or None: refused)
MODES = {
    "RGB": ("rgb.png", lambda: Image.fromarray(RGB8), lambda: RGB8),
    "1": ("bits.png", lambda: Image.fromarray(GREY8 > 127),
          lambda: np.repeat(np.where(GREY8 > 127, 255, 0)[..., None], 3, 2)),
    "L": ("grey.png", lambda: Image.fromarray(GREY8, mode="L"),
          lambda: np.repeat(GREY8[..., None], 3, 2)),
    "LA": ("greyalpha.png", lambda: Image.fromarray(np.dstack([GREY8, GREY8[::-1]]), mode="LA"),
           lambda: np.repeat(GREY8[..., None], 3, 2)),
    "P": ("palette.png", _palette_image, lambda: PALETTE[GREY8]),
    "RGBA": ("alpha.png", lambda: Image.fromarray(np.dstack([RGB8, GREY8]), mode="RGBA"),
             lambda: RGB8),  # the alpha channel is dropped, never composited
    "CMYK": ("cmyk.jpg", None, None),  # JPEG: lossy, compared against PIL's own decode below
    "CMYK-tiff": ("cmyk.tif", lambda: Image.fromarray(
        np.dstack([RGB8, np.zeros_like(GREY8)]), mode="CMYK"), lambda: 255 - RGB8),
    "I;16": ("sixteen.png", lambda: Image.fromarray(GREY16),
             lambda: np.repeat(np.rint(GREY16 / 257.0).astype(np.uint8)[..., None], 3, 2)),
    "I-16-bit-values": ("int32.tif", lambda: Image.fromarray(GREY16.astype(np.int32)),
                        lambda: np.repeat(np.rint(GREY16 / 257.0).astype(np.uint8)[..., None],
                                          3, 2)),
    "I-beyond-16-bit": ("int32big.tif",
                        lambda: Image.fromarray(GREY16.astype(np.int32) * 4 + 70000), None),
    "F": ("float.tif", lambda: Image.fromarray(GREY8.astype(np.float32) / 255), None),
}
MODES.pop("CMYK")  # K = 0 TIFF keeps the case exact (255 - C); JPEG CMYK adds nothing


def _voc_reader(path: Path) -> np.ndarray:
    root = path.parent
    (root / "JPEGImages").mkdir(exist_ok=True)
    (root / "SegmentationClass").mkdir(exist_ok=True)
    target = root / "JPEGImages" / "x.jpg"  # the extension is the layout's; PIL reads content
    target.write_bytes(path.read_bytes())
    Image.fromarray(np.zeros(GREY8.shape[::-1] if "rot" in path.name else GREY8.shape,
                             np.uint8), mode="L").save(root / "SegmentationClass" / "x.png")
    return VOCSegmentation(root, ["x"], num_classes=2).load_image("x")


READERS = {
    "train-eval-voc": _voc_reader,
    "train-eval-folder": paired_read,
    "predict_seg": read_image,
    "classification": classification_read,
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("reader", list(READERS))
def test_image_mode_is_converted_the_same_by_every_reader_or_refused(mode, reader, tmp_path):
    name, write, expected = MODES[mode]
    path = _save(tmp_path / name, write())
    before = tree_sum(tmp_path)
    if expected is None:
        with pytest.raises((DataError, UnreadableImageError)) as info:
            READERS[reader](path)
        named = "x.jpg" if reader == "train-eval-voc" else name  # the VOC copy's name
        assert named in str(info.value) and "\n" not in str(info.value)
        return
    out = READERS[reader](path)
    assert out.dtype == np.uint8 and out.shape == (*GREY8.shape, 3)
    np.testing.assert_array_equal(out, expected())
    if reader != "train-eval-voc":
        assert tree_sum(tmp_path) == before


# EXIF orientation -> the array an upright reader must return (np.rot90: counter-clockwise)
ORIENTATIONS = {3: lambda a: np.rot90(a, 2), 6: lambda a: np.rot90(a, -1),
                8: lambda a: np.rot90(a, 1), 2: lambda a: a[:, ::-1]}


@pytest.mark.parametrize("orientation", list(ORIENTATIONS))
@pytest.mark.parametrize("reader", list(READERS))
def test_exif_orientation_is_applied_by_every_reader(orientation, reader, tmp_path):
    path = _save(tmp_path / "rot.png", Image.fromarray(RGB8), orientation)
    if reader == "train-eval-voc":  # the mask is stored upright-sized: it must match
        root = tmp_path
        (root / "JPEGImages").mkdir()
        (root / "SegmentationClass").mkdir()
        (root / "JPEGImages" / "x.jpg").write_bytes(path.read_bytes())
        upright = ORIENTATIONS[orientation](RGB8)
        Image.fromarray(np.zeros(upright.shape[:2], np.uint8), mode="L").save(
            root / "SegmentationClass" / "x.png")
        ds = VOCSegmentation(root, ["x"], num_classes=2)
        out = ds.load_image("x")
        assert ds.image_size("x") == (upright.shape[1], upright.shape[0])
        assert ds[0]["image"].shape[1:] == upright.shape[:2]  # image and mask agree
    else:
        out = READERS[reader](path)
    np.testing.assert_array_equal(out, ORIENTATIONS[orientation](RGB8))


@pytest.mark.parametrize("mode", ["I;16", "F", "RGB"])
def test_check_data_reports_image_modes_like_the_readers(mode, tmp_path):
    """check_data's pass over a VOC split accepts what the readers convert and names a mode
    they refuse."""
    root = tmp_path / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / sub).mkdir(parents=True)
    name, write, _ = MODES[mode]
    source = _save(tmp_path / name, write())
    (root / "JPEGImages" / "x.jpg").write_bytes(source.read_bytes())  # PIL reads the content
    Image.fromarray(np.zeros(GREY8.shape, np.uint8), mode="L").save(
        root / "SegmentationClass" / "x.png")
    ds = VOCSegmentation(root, ["x"], num_classes=2)
    problems, count = sample_problems(ds)
    if mode == "F":
        assert count == 1 and "mode F" in problems[0] and "x.jpg" in problems[0]
    else:
        assert count == 0, problems


def test_scale_16_hand_cases():
    np.testing.assert_array_equal(images.scale_16(np.array([0, 128, 129, 257, 65535, 65278])),
                                  [0, 0, 1, 1, 255, 254])


# ================================================ 1. path forms x id sources, x writers
FORMS = {
    "absolute": "/etc/passwd",
    "climbing": "../../outside",
    "climbing-inside-a-name": "a/../../b",
    "windows-drive": "C:\\Windows\\x",
    "windows-share": "\\\\host\\share\\x",
    "home": "~/x",
    "backslash-climb": "..\\..\\x",
}


def _voc_split_tree(tmp: Path, line: str) -> Path:
    base = tmp / "VOC2012"
    (base / "ImageSets" / "Segmentation").mkdir(parents=True)
    (base / "JPEGImages").mkdir()
    (base / "ImageSets" / "Segmentation" / "train.txt").write_text(f"ok_id\n{line}\n")
    return base


def _source_voc_split(tmp: Path, bad: str):
    base = _voc_split_tree(tmp, bad)
    return lambda: read_split(base, "train"), "train.txt' line 2"


def _source_voc_checks(tmp: Path, bad: str):
    base = _voc_split_tree(tmp, bad)
    path = base / "ImageSets" / "Segmentation" / "train.txt"
    return lambda: split_file_ids(path), "train.txt, line 2"


def _source_folder_split(tmp: Path, bad: str):
    path = tmp / "train.txt"
    path.write_text(f"a.jpg\n{bad}\n")
    return lambda: read_stem_list(path), "train.txt' line 2"


def _source_ids_argument(tmp: Path, bad: str):
    base = _voc_split_tree(tmp, "ok")
    return lambda: VOCSegmentation(base, ["ok", bad], num_classes=2), "ids"


ID_SOURCES = {"voc-split-file": _source_voc_split, "check_data-split-file": _source_voc_checks,
              "folder-split-file": _source_folder_split, "dataset-ids": _source_ids_argument}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("source", list(ID_SOURCES))
def test_an_id_that_leaves_the_data_root_is_refused_naming_file_and_line(form, source,
                                                                         tmp_path):
    call, where = ID_SOURCES[source](tmp_path, FORMS[form])
    before = tree_sum(tmp_path)
    with pytest.raises(UnsafePathError) as info:
        call()
    message = str(info.value)
    assert where in message and "\n" not in message, message
    assert tree_sum(tmp_path) == before


def _writer_calibration_maps(out: Path, name: str) -> None:
    from cals_seg.evaluation.reports import calibration_maps

    class OneImage:
        def load_image(self, _):
            return RGB8

        def load_mask(self, _):
            return np.zeros(RGB8.shape[:2], np.uint8)

    model = torch.nn.Conv2d(3, 2, 1)
    calibration_maps(model, OneImage(), [name], out, torch.device("cpu"), ["a", "b"], 255)


def _writer_output_folder(out: Path, name: str) -> None:
    OutputFolder(out, "predict_seg").check_free([name])


WRITERS = {"eval_seg-maps": _writer_calibration_maps, "output-folder": _writer_output_folder}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_writer_never_writes_outside_its_folder(form, writer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside").write_text("user's file")
    before = tree_sum(tmp_path)
    with pytest.raises(UnsafePathError):
        WRITERS[writer](out, FORMS[form])
    assert tree_sum(tmp_path) == before


def test_a_link_out_of_the_root_is_refused_by_inside(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="outside"):
        inside(tmp_path / "root", "link/x.png", "test")
    assert inside(tmp_path / "root", "a/b.png", "test") == tmp_path / "root" / "a" / "b.png"
    assert check_id("2007_000032", "x") == "2007_000032"


# ===================================================== 2. no tool overwrites a user's file
@pytest.fixture(scope="module")
def model_run(untrained_run, tmp_path_factory) -> Path:
    """A copy of the session's run folder with a random-weight model and a temperature
    (predict_seg, export; predict_seg saves its far-from-validation reference into it)."""
    return copy_run(untrained_run, tmp_path_factory.mktemp("reliab_run"))


def _photos(tmp: Path) -> Path:
    folder = tmp / "photos"
    folder.mkdir(parents=True)
    Image.fromarray(RGB8).save(folder / "cat.jpg")
    Image.fromarray(RGB8).save(folder / "cat_label.png")  # the user's own file
    return folder


def _predict(run: Path, *argv: str) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_tool("predict_seg").main([str(run), *argv, "--no-progress"])


@pytest.mark.parametrize("out", ["same", "inside", "holding"])
def test_predict_seg_refuses_an_output_folder_overlapping_the_inputs(out, model_run, tmp_path,
                                                                     capsys):
    photos = _photos(tmp_path)
    target = {"same": photos, "inside": photos / "out", "holding": tmp_path}[out]
    before = tree_sum(tmp_path)
    assert _predict(model_run, str(photos), "--out", str(target)) == 2
    err = capsys.readouterr().err
    assert_one_line(err)
    assert "overlaps the input" in err
    assert tree_sum(tmp_path) == before


def test_predict_seg_replaces_only_its_own_outputs(model_run, tmp_path, capsys):
    photos = _photos(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    (out / "cat_overlay.png").write_text("the user's file")
    inputs_before, out_before = tree_sum(photos), tree_sum(out)
    assert _predict(model_run, str(photos / "cat.jpg"), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert_one_line(err)
    assert "cat_overlay.png' exists and was not written by predict_seg" in err
    assert tree_sum(out) == out_before
    (out / "cat_overlay.png").unlink()
    assert _predict(model_run, str(photos / "cat.jpg"), "--out", str(out)) == 0
    assert _predict(model_run, str(photos / "cat.jpg"), "--out", str(out)) == 0  # its own files
    assert "cat_overlay.png" in json.loads((out / MANIFEST).read_text())
    assert tree_sum(photos) == inputs_before


def test_export_refuses_to_overwrite_a_file_it_did_not_write(model_run, tmp_path, capsys):
    target = tmp_path / "model.pt2"
    target.write_text("the user's file")
    before = tree_sum(tmp_path)
    assert load_tool("export").main([str(model_run), "--format", "pt2", "--out",
                                     str(target)]) == 2
    err = capsys.readouterr().err
    assert_one_line(err)
    assert "was not written by export" in err
    assert tree_sum(tmp_path) == before


def test_export_refuses_to_overwrite_the_checkpoint(model_run, capsys):
    before = tree_sum(model_run)
    assert load_tool("export").main([str(model_run), "--format", "pt2", "--out",
                                     str(model_run / "checkpoint_best.pt")]) == 2
    assert "checkpoint_best.pt' exists" in capsys.readouterr().err
    assert tree_sum(model_run) == before


def test_output_folder_manifest_for_compare_names(tmp_path):
    """compare's tables: refused over a user's results.md, replaced when compare wrote them."""
    (tmp_path / "results.md").write_text("mine")
    with pytest.raises(OutputCollisionError, match="results.md"):
        OutputFolder(tmp_path, "compare").check_free(["results.md", "results.csv"])
    (tmp_path / "results.md").unlink()
    folder = OutputFolder(tmp_path, "compare")
    folder.check_free(["results.md"])
    folder.claim(["results.md"])
    (tmp_path / "results.md").write_text("compare's")
    OutputFolder(tmp_path, "compare").check_free(["results.md"])  # its own: no error


# ============================================== shared: a finished tiny run on synthetic data
def _sets(tmp: Path, name: str, **extra: str) -> list[str]:
    sets = {
        "name": name, "output_dir": str(tmp / "runs"), "data.root": str(tmp / "synthetic"),
        "data.synthetic": "{num_train: 8, num_test: 3, image_size: 32}", "data.crop_size": "32",
        "data.val_fraction": "0.375",
        "model.encoder_name": "tu-mobilenetv3_small_050",  # 1.6 MB, not ResNet-18's 46
        "model.params": "{encoder_output_stride: 16, decoder_channels: 16}",
        "train.batch_size": "4", "eval.batch_size": "4", "train.threads": "1",
        "train.progress": "false", "train.epochs": "1", "eval.temperature_scaling": "false",
        "eval.num_maps": "0", "train.device": "cpu", "train.amp": "none",
    }
    sets.update(extra)
    return [str(SETUP), "--method", "ce", "--set", *(f"{k}={v}" for k, v in sets.items())]


def linked_copy(run: Path, where: Path) -> Path:
    """A copy of the run folder ``run`` (no model factory) at ``where / run.name`` whose
    checkpoints are hard links to the originals: only read by a command (every write of the
    library replaces a file, never writes into one), not copied (46 MB and 92 MB)."""
    import shutil

    def link_checkpoint(src: str, dst: str) -> None:
        if src.endswith(".pt"):
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    copy = where / run.name
    shutil.copytree(run, copy, copy_function=link_checkpoint)
    return copy


@pytest.fixture()
def finished(trained_run) -> tuple[Path, Path]:
    """The folder of the session's finished 1-epoch CE run (its data under ``synthetic``) and
    the run (3 validation images; read only: a case that changes it works on a copy)."""
    return trained_run.root, trained_run.folder


def test_eval_seg_refuses_an_output_folder_inside_the_data(finished, capsys):
    tmp, run = finished
    before = tree_sum(tmp / "synthetic")
    rc = load_tool("eval_seg").main([str(run), "--out", str(tmp / "synthetic" / "eval")])
    err = capsys.readouterr().err
    assert rc == 2 and "overlaps the input" in err
    assert_one_line(err)
    assert tree_sum(tmp / "synthetic") == before


# ============================== 5. several things: one that cannot be done is reported, go on
def test_eval_seg_calibrators_one_that_cannot_be_fitted_does_not_stop_the_others(finished,
                                                                                 tmp_path,
                                                                                 capsys):
    """3 validation images: lts and selective need 5 (one in holdout_every=5 held out); ts,
    vector, dirichlet and boundary_ts are fitted and evaluated; the two are named with why."""
    tmp, run = finished
    run = linked_copy(run, tmp_path)  # the fitted calibrators are saved into the run
    out = tmp_path / "eval_cal"
    data_before = tree_sum(tmp / "synthetic")
    names = ["ts", "vector", "dirichlet", "lts", "selective", "boundary_ts"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = load_tool("eval_seg").main([str(run), "--out", str(out), "--calibrators", *names,
                                         "--calibrator-param", "vector.max_iter=5",
                                         "dirichlet.max_iter=5"])
    err = capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    skipped = metrics.get("calibrator_errors", {})
    assert rc == (1 if skipped else 0), err
    assert set(skipped) | set(metrics["calibrators"]) == set(names)
    assert {"lts", "selective"} <= set(skipped), skipped
    assert {"ts", "vector", "dirichlet"} <= set(metrics["calibrators"])
    for name in skipped:
        line = next(x for x in err.splitlines() if f"calibrator {name} skipped" in x)
        assert "holdout_every" in line and "Traceback" not in err
    assert tree_sum(tmp / "synthetic") == data_before


# ============================================================ 4. one process owns a run folder
HOLDER = textwrap.dedent("""
    import sys, time
    from cals_seg.utils.lock import RunLock
    lock = RunLock(sys.argv[1], "train").acquire()
    print("held", flush=True)
    time.sleep(120)
""")


def _hold(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_naming_the_holder_and_a_crash_frees_the_lock(tmp_path):
    proc = _hold(tmp_path / "run")
    try:
        with pytest.raises(RunLockedError, match=f"in use by process {proc.pid} \\(train\\)"):
            RunLock(tmp_path / "run").acquire()
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: the OS drops the lock
        proc.wait()
    with RunLock(tmp_path / "run") as lock:
        assert (tmp_path / "run" / LOCK_FILE).read_text().split()[0] == str(os.getpid())
        assert lock.owned


@pytest.mark.parametrize("tool", ["train_seg --resume", "eval_seg"])
def test_tools_writing_into_a_run_are_refused_while_another_process_owns_it(tool, untrained_run,
                                                                            tmp_path, capsys):
    """On a copy of the session's untrained run (a MobileNetV3 encoder: a checkpoint of 1.6 MB
    copied and summed, where the finished run's ResNet-18 ones, 46 MB and twice that with the
    optimiser, were most of this test's time)."""
    import shutil

    copy = copy_run(untrained_run, tmp_path, "run")
    shutil.copyfile(copy / "checkpoint_best.pt", copy / "checkpoint_last.pt")
    proc = _hold(copy)
    before = tree_sum(copy)  # with the holder's lock file
    try:
        if tool == "eval_seg":
            rc = load_tool("eval_seg").main([str(copy)])
        else:
            rc = load_tool("train_seg").main(["--resume", str(copy), "--set",
                                              "train.epochs=2"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    err = capsys.readouterr().err
    assert rc == 2 and f"in use by process {proc.pid}" in err
    assert_one_line(err)
    assert tree_sum(copy) == before


# ================================================================ 5. one line for every error
def test_a_run_folder_without_checkpoint_starts_again(tmp_path, capsys):
    """A run stopped before its first checkpoint (config.yaml, a history line) is trained into
    again, with or without --resume, without deleting it by hand."""
    tmp = tmp_path
    run = tmp / "runs" / "no_ckpt"
    run.mkdir(parents=True)
    save_config(load_config(SETUP, _sets(tmp, "no_ckpt")[4:], "ce"), run / "config.yaml")
    (run / "history.jsonl").write_text('{"epoch": 0}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_tool("train_seg").main(_sets(tmp, "no_ckpt")) == 0
        assert load_tool("train_seg").main(_sets(tmp, "no_ckpt")) == 2  # finished: kept
        for name in ("checkpoint_best.pt", "checkpoint_last.pt", "test_metrics.json"):
            (run / name).unlink(missing_ok=True)
        (run / "history.jsonl").write_text('{"epoch": 0}\n{"epoch": 1}\n')
        assert load_tool("train_seg").main(["--resume", str(run)]) == 0
    assert [h["epoch"] for h in Run(run).history()] == [0]
    assert (run / "checkpoint_best.pt").is_file()
    assert "already holds a run" in capsys.readouterr().err


def test_ctrl_c_during_training_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from cals_seg.training import trainer

    tmp = tmp_path

    def stop(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train_one_epoch", stop)
    assert load_tool("train_seg").main(_sets(tmp, "ctrl_c")) == 130
    err = capsys.readouterr().err.strip()
    assert err == f"interrupted (Ctrl-C): continue with --resume {tmp / 'runs' / 'ctrl_c'}."
    # and the folder can be resumed at once (it has no checkpoint yet)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.undo()
        assert load_tool("train_seg").main(["--resume", str(tmp / "runs" / "ctrl_c")]) == 0


def test_ctrl_c_in_any_tool_is_one_line(tmp_path):
    # SIGINT as a terminal delivers it (a shell started in the background ignores it, and Python
    # then installs no handler): the default handler first, then the signal
    script = ("import cals_seg.commands._cli, os, signal; "
              "signal.signal(signal.SIGINT, signal.default_int_handler); "
              "os.kill(os.getpid(), signal.SIGINT)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.stderr.strip().startswith("interrupted (Ctrl-C)")
    assert "Traceback" not in proc.stderr and proc.returncode != 0
    assert interrupted() == 130


class _Broken(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        raise DataError(f"cannot read image 'x{i}.jpg': truncated; restore it")


def test_a_data_error_in_a_loader_worker_is_one_line_without_its_traceback():
    loader = torch.utils.data.DataLoader(_Broken(), batch_size=1, num_workers=1)
    batches = iter(loader)
    try:
        with pytest.raises(DataError) as info:
            next(batches)
    finally:  # its worker stopped now: the iterator is in a reference cycle, and stopped by the
        batches._shutdown_workers()  # garbage collector it waits 5 s (in some later test)
    assert "Traceback" in str(info.value)  # what torch re-raises
    assert one_line(info.value) == "cannot read image 'x0.jpg': truncated; restore it"


def _disk_full_torch(state, tmp):
    Path(tmp).write_bytes(b"partial")
    raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")


def _disk_full_os(_text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("how", ["torch.save", "write_text"])
def test_a_failed_write_is_one_line_and_leaves_no_temporary_file(how, tmp_path, monkeypatch):
    if how == "torch.save":
        monkeypatch.setattr(torch, "save", _disk_full_torch)
        call = lambda: save_checkpoint({"a": 1}, tmp_path / "checkpoint_last.pt")  # noqa: E731
        pattern = "cannot write .*checkpoint_last.pt.*MiB free on its disk"
    else:
        monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: _disk_full_os(text))
        call = lambda: write_json(tmp_path / "m.json", {"a": 1})  # noqa: E731
        pattern = "cannot write .*m.json': No space left on device; free disk space"
    with pytest.raises(UserError, match=pattern):
        call()
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_calibrator_file_is_one_line(tmp_path):
    from cals_seg.calibrators import load_calibrator

    for content in (b"\x80\x02garbage", b"", b"PK\x03\x04 not a zip"):
        path = tmp_path / "ts.pt"
        path.write_bytes(content)
        with pytest.raises(UserError, match="is not a saved calibrator.*refit it"):
            load_calibrator(path)


def test_a_symlink_loop_in_a_folder_dataset_is_a_problem_not_a_traceback(tmp_path):
    (tmp_path / "a.png").symlink_to(tmp_path / "b.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    Image.fromarray(RGB8).save(tmp_path / "c.png")
    found, problems = find_by_stem(tmp_path, (".png",))
    assert list(found) == ["c"]
    assert len(problems) == 2 and all("symbolic link" in p for p in problems)


@pytest.mark.parametrize("content,line", [(b"\xef\xbb\xbfid_1\nid_2\n", None),
                                          (b"id_1\nid_\xe9\n", 2), (b"\xff\xfei\x00d\x00", 1)])
def test_split_file_encodings(content, line, tmp_path):
    """A BOM is dropped (no invisible character in an id); a non-UTF-8 byte (Latin-1, UTF-16)
    is one line naming the file and line."""
    path = tmp_path / "train.txt"
    path.write_bytes(content)
    if line is None:
        assert read_lines(path) == ["id_1", "id_2"]
        assert read_stem_list(path)[0] == ["id_1", "id_2"]
        return
    with pytest.raises(DataError, match=f"train.txt' line {line}: byte 0x.. is not UTF-8"):
        read_lines(path)


def test_a_split_file_without_permission_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    path = tmp_path / "train.txt"
    path.write_text("a\n")
    path.chmod(0)
    with pytest.raises(DataError, match="Permission denied; check the permissions"):
        read_lines(path)


def test_a_split_file_that_is_a_symlink_loop_is_one_line(tmp_path):
    (tmp_path / "train.txt").symlink_to(tmp_path / "loop.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "train.txt")
    with pytest.raises(DataError, match="cannot read the split file .*symbolic link points"):
        read_lines(tmp_path / "train.txt")
    with pytest.raises(DataError, match="symbolic link"):
        read_stem_list(tmp_path / "train.txt")


# As many [ as the recursion limit already overflows PyYAML's composer (two or more frames per
# level); its scanner's time grows with the square of the [ depth (2 s for 5000 of them).
@pytest.mark.parametrize("text", ["[" * sys.getrecursionlimit(), "{a: " * 5000, "- " * 5000])
def test_deeply_nested_yaml_is_one_line(text, tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="deep.yaml: invalid YAML.*nested deeper"):
        load_config(path)


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(ConfigError, match="bad.yaml: byte 0xe9 .* is not UTF-8"):
        load_config(path)


def test_a_huge_crop_is_refused_before_allocating(tmp_path, capsys):
    tmp = tmp_path
    with pytest.raises(MemoryEstimateError, match="data.crop_size: 16384 x 16384"):
        check_batch_memory(64, 16384, 11, torch.device("cpu"), "data.crop_size", "lower it")
    check_batch_memory(4, 64, 11, torch.device("cpu"), "data.crop_size", "lower it")
    rc = load_tool("train_seg").main(_sets(tmp, "huge", **{"data.crop_size": "16384",
                                                          "train.batch_size": "64"}))
    err = capsys.readouterr().err
    assert rc == 2 and "data.crop_size: 16384 x 16384 pixels x 64 image(s)" in err, err
    assert_one_line(err)
    assert not (tmp / "runs" / "huge" / "history.jsonl").exists()


def test_corrupt_image_in_a_tool_is_one_line(model_run, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    assert _predict(model_run, str(folder), "--out", str(tmp_path / "out")) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: cannot")]
    assert err and all("Traceback" not in x for x in err)


def test_voc_palette_mask_still_reads_indices(tmp_path):
    """The one reader keeps a palette mask's indices (never its colours)."""
    mask = (GREY8 % 3).astype(np.uint8)
    png = Image.fromarray(mask, mode="P")
    png.putpalette(voc_palette().reshape(-1).tolist())
    _save(tmp_path / "m.png", png)
    mode, stored = images.read_stored(tmp_path / "m.png")
    assert mode == "P"
    np.testing.assert_array_equal(stored, mask)


@pytest.mark.parametrize("form", ["absolute", "climbing"])
def test_check_data_reports_an_id_that_leaves_the_root(form, tmp_path, capsys):
    base = _voc_split_tree(tmp_path / "voc", FORMS[form])
    (base / "ImageSets" / "Segmentation" / "val.txt").write_text("ok_id\n")
    before = tree_sum(tmp_path)
    rc = load_tool("check_data").main([str(SETUP), "--no-progress", "--set", "data.name=voc",
                                       f"data.root={tmp_path / 'voc'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "train.txt' line 2" in err and "\n" not in err, err
    assert tree_sum(tmp_path) == before


@pytest.mark.parametrize("tool, fixture", [("eval_seg", "untrained_run"), ("eval_cls", "cls_run")])
def test_an_evaluation_called_in_process_leaves_the_run_unlocked(tool, fixture, request,
                                                                 tmp_path):
    """main() of an evaluation that writes into the run holds the run's lock while it works and
    drops it when it returns: a process that goes on (a test, a notebook) does not keep the run
    locked against every other process (the lock file is free to a new open file at once)."""
    import fcntl

    from .conftest import copy_run, load_tool

    run = copy_run(request.getfixturevalue(fixture), tmp_path)
    with warnings.catch_warnings(), figures_skipped():  # the lock checked, not the figures
        warnings.simplefilter("ignore")
        assert load_tool(tool).main([str(run), "--calibrators", "ts"]) == 0
    assert run.resolve() not in RunLock._held
    fd = os.open(run / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError when held
    finally:
        os.close(fd)
