"""Bad inputs, resumes and crashes (issue 13): nothing silently wrong, nothing lost.

Two tables. ``ERRORS``: inputs a command must refuse with ONE line naming the key and the fix
(exit code 2, no traceback), before any training where the input is checkable. ``BEHAVIOURS``:
runs that must end right (a resume that extends the schedule, a kill at the worst instant, a
mixed-size test split, a huge image). Each id starts with the issue's item number; ``own-`` ids
are defects found after the issue.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.config.schema import load_config
from cals_seg.data.voc import voc_palette
from cals_seg.tasks import build_task
from cals_seg.training import trainer as trainer_mod
from cals_seg.training.engine import seed_everything
from cals_seg.training.trainer import fit
from cals_seg.utils.io import load_checkpoint, read_jsonl

from .conftest import TRAINED_NAME, copy_run, load_tool

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"


def _sets(tmp: Path, name: str, method: str = "ce", **extra: str) -> list[str]:
    sets = {
        "name": name, "output_dir": str(tmp / "runs"), "data.root": str(tmp / "synthetic"),
        "data.synthetic": "{num_train: 8, num_test: 4, image_size: 32}", "data.crop_size": "32",
        "model.params": "{encoder_output_stride: 16, decoder_channels: 16}",
        "train.batch_size": "4", "eval.batch_size": "4", "train.threads": "1",
        "train.progress": "false", "train.epochs": "1", "eval.temperature_scaling": "false",
        "eval.num_maps": "0",
    }
    sets.update(extra)
    return ["--method", method, "--set", *(f"{k}={v}" for k, v in sets.items())]


def _cfg(tmp: Path, name: str, method: str = "ce", **extra: str):
    args = _sets(tmp, name, method, **extra)
    return load_config(SETUP, args[3:], method)


def _fit(cfg, resume=None):
    seed_everything(cfg.train.seed)
    return fit(cfg, build_task(cfg), resume=resume)


def _voc_tree(root: Path, train: list[tuple[int, int]], test: list[tuple[int, int]],
              void: bool = False) -> Path:
    """A tiny VOC2012 tree: random images, blocky masks of 11 classes (all void if ``void``)."""
    base = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, sizes in (("train", train), ("val", test)):
        ids = [f"{split}_{i}" for i in range(len(sizes))]
        for sample_id, (w, h) in zip(ids, sizes, strict=True):
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
                base / "JPEGImages" / f"{sample_id}.jpg")
            mask = np.full((h, w), 255, np.uint8) if void else np.kron(
                rng.integers(0, 11, (h // 8 + 1, w // 8 + 1)), np.ones((8, 8)))[:h, :w]
            png = Image.fromarray(mask.astype(np.uint8), mode="P")
            png.putpalette(voc_palette().reshape(-1).tolist())
            png.save(base / "SegmentationClass" / f"{sample_id}.png")
        (base / "ImageSets/Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return root


def _voc(tmp: Path, name: str, **extra: str) -> list[str]:
    return _sets(tmp, name, **{"data.name": "voc", "data.root": str(tmp / name / "voc"),
                               **extra})


# Training ends with plots; the cases check messages and files, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")


@pytest.fixture()
def finished(trained_run, tmp_path) -> tuple[Path, Path]:
    """This test's folder and the session's finished 1-epoch CE run (read only: a case that
    changes it works on :func:`_copy_run`)."""
    return tmp_path, trained_run.folder


def _copy_run(finished, name: str) -> Path:
    """A copy of the finished run at ``runs/NAME`` in the test's folder."""
    tmp, run = finished
    return copy_run(run, tmp / "runs", name)


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:1000])
    return path


# --------------------------------------------------------------------------- one-line errors
# id -> (tool, argv(tmp, finished), pattern of the one-line message)
ERRORS = {
    "4-best-mode-typo": ("train_seg", lambda t, f: _sets(t, "x", **{"train.best_mode": "maximize"}),
                         r"train.best_mode: expected 'max' or 'min'"),
    "4-lower-better-metric-with-max": (
        "train_seg", lambda t, f: _sets(t, "x", **{"train.best_metric": "ece"}),
        r"best_metric='ece' is lower-better.*set train.best_mode=min"),
    "5-empty-yaml": ("train_seg", lambda t, f: [str(_write(t / "empty.yaml", ""))], r"is empty"),
    "6-truncated-checkpoint-on-resume": (
        "train_seg",
        lambda t, f: _resume(_truncated_run(f, "trunc_resume")),
        r"checkpoint_last.pt cannot be read.*truncated"),
    "6-truncated-checkpoint-on-eval": (
        "eval_seg",
        lambda t, f: [str(f[1] / "config.yaml"), "--checkpoint",
                      str(_truncate(_copy_run(f, "trunc_eval") / "checkpoint_best.pt"))],
        r"checkpoint_best.pt cannot be read"),
    "8-loss-param-type": ("train_seg", lambda t, f: _sets(t, "x", "cals_alm",
                                                         **{"loss.params.margin": "ten"}),
                          r"loss.params.margin: expected a number or 'auto', got 'ten'"),
    "8-synthetic-key-typo": ("train_seg", lambda t, f: _sets(t, "x", **{
        "data.synthetic": "{num_trian: 10}", "data.root": str(t / "typo")}),
        r"data.synthetic: unknown key\(s\) \['num_trian'\]; valid keys are"),
    "9-empty-validation-split": ("train_seg", lambda t, f: _voc_empty_val(t),
                                 r"The val split is empty.*data.val_fraction"),
    "9-all-void-validation-split": (
        "train_seg", lambda t, f: _voc_void_val(t),
        r"Every pixel of the 2 validation images is void"),
    "9-unknown-best-metric-before-training": (
        "train_seg", lambda t, f: _sets(t, "x", **{"train.best_metric": "f1"}),
        r"train.best_metric: the validation split has no metric 'f1'; choose one of"),
    "10-empty-train-txt": ("train_seg", lambda t, f: _voc_empty_train(t),
                           r"The train split is empty.*train.txt"),
    "10-negative-lr": ("train_seg", lambda t, f: _sets(t, "x", **{"optim.lr": "-0.001"}),
                       r"optim.lr: expected a number > 0, got -0.001; e.g. --set optim.lr="),
    "10-zero-batch-size": ("train_seg", lambda t, f: _sets(t, "x", **{"train.batch_size": "0"}),
                           r"train.batch_size: expected an integer >= 1, got 0"),
    "10-zero-epochs": ("train_seg", lambda t, f: _sets(t, "x", **{"train.epochs": "0"}),
                       r"train.epochs: expected an integer >= 1, got 0"),
    "10-resume-empty-folder": (
        "train_seg", lambda t, f: [str(SETUP), "--resume", str(_mkdir(t / "runs" / "empty"))],
        r"--resume .*empty: the folder holds no run.*without --resume"),
    "11-diverging-run": ("train_seg", lambda t, f: _sets(t, "x", **{"optim.lr": "1.0e6"}),
                         r"(loss is nan|NaN or infinite).*lower the learning rate \(optim.lr\)"),
    "own-resume-changes-the-loss": (
        "train_seg",
        lambda t, f: _resume(_copy_run(f, "change_loss"), "loss.params={alpha: 0.1}",
                             "loss.name=ls"),
        r"trained with other settings \(loss.name: 'ce' -> 'ls'.*start a new run"),
    "own-resume-finished-run": (
        "train_seg", lambda t, f: _resume(_finished_copy(f)),
        r"has no checkpoint_last.pt \(it holds .*a finished run keeps only checkpoint_best.pt\)"),
    "own-eval-other-architecture": (
        "eval_seg",
        lambda t, f: [str(f[1] / "config.yaml"), "--checkpoint", str(f[1] / "checkpoint_best.pt"),
                      "--set", "model.params={decoder_channels: 32}"],
        r"does not fit the model of .*use the config the run was trained with"),
    "own-zero-eval-batch-size": (
        "train_seg", lambda t, f: _sets(t, "x", **{"eval.batch_size": "0"}),
        r"eval.batch_size: expected an integer >= 1"),
    "own-negative-grad-clip": (
        "train_seg", lambda t, f: _sets(t, "x", **{"train.grad_clip": "-1"}),
        r"train.grad_clip: expected a number > 0.*null for no clipping"),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _resume(run: Path, *sets: str, config: Path | None = None) -> list[str]:
    return [str(config or run / "config.yaml"), "--resume", str(run),
            *(["--set", *sets] if sets else [])]


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _truncated_run(finished, name: str) -> Path:
    run = _copy_run(finished, name)
    _truncate(run / "checkpoint_last.pt")
    return run


def _finished_copy(finished, name: str = "finished_copy") -> Path:
    run = _copy_run(finished, name)
    (run / "checkpoint_last.pt").unlink()  # what tools/compare.py leaves of a finished run
    return run


def _voc_empty_val(tmp: Path) -> list[str]:
    _voc_tree(tmp / "empty_val" / "voc", [(32, 32)] * 6, [(32, 32)] * 2)
    return _voc(tmp, "empty_val", **{"data.val_fraction": "0.0"})


def _voc_void_val(tmp: Path) -> list[str]:
    _voc_tree(tmp / "void_val" / "voc", [(32, 32)] * 8, [(32, 32)] * 2, void=True)
    return _voc(tmp, "void_val")


def _voc_empty_train(tmp: Path) -> list[str]:
    root = _voc_tree(tmp / "empty_train" / "voc", [(32, 32)] * 2, [(32, 32)] * 2)
    (root / "VOCdevkit/VOC2012/ImageSets/Segmentation/train.txt").write_text("")
    return _voc(tmp, "empty_train")


@pytest.mark.parametrize("case", list(ERRORS), ids=list(ERRORS))
def test_clear_one_line_error(case, finished, tmp_path, capsys):
    tool, argv, pattern = ERRORS[case]
    argv = argv(tmp_path, finished)
    if argv[0] == "--method":
        argv = [str(SETUP), *argv]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = load_tool(tool).main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert re.search(pattern, err), err
    # refused before any epoch: a new run directory holds no history
    assert not (tmp_path / "runs" / "x" / "history.jsonl").exists()


def test_5_negative_num_maps_is_refused(finished, capsys):
    _, run = finished
    with pytest.raises(SystemExit) as exit_info:
        load_tool("eval_seg").main([str(run / "config.yaml"), "--checkpoint",
                                    str(run / "checkpoint_best.pt"), "--num-maps", "-2"])
    assert exit_info.value.code == 2 and "expected a number >= 0" in capsys.readouterr().err


# --------------------------------------------------------------------------- behaviours
@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple:
    """A fresh 2-epoch CE run killed after epoch 1's history line, before its checkpoints
    (``trainer.save_checkpoint`` raises KeyboardInterrupt at epoch 1): its config and the two
    history lines it wrote, a fresh 2-epoch run's own (read before anything resumes it). Case 3
    resumes it; case 1 compares lr schedules with those lines."""
    tmp = tmp_path_factory.mktemp("killed")
    cfg = _cfg(tmp, "killed", **{"train.epochs": "2"})
    real = trainer_mod.save_checkpoint

    def killed_at_epoch_1(state, path):
        if state["epoch"] == 1:  # epoch 1's history line is written, its checkpoint is not
            raise KeyboardInterrupt
        real(state, path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_mod, "save_checkpoint", killed_at_epoch_1)
        with pytest.raises(KeyboardInterrupt):
            _fit(cfg)
    assert trainer_mod.save_checkpoint is real
    return cfg, read_jsonl(cfg.run_dir / "history.jsonl")


def extend_epochs_on_resume(finished, tmp: Path, killed) -> None:
    """1: a 1-epoch run resumed with train.epochs=2 runs at a fresh 2-epoch run's lr (the
    1-epoch schedule would have reached 0); the fresh run's lines: those of ``killed``."""
    run = _copy_run(finished, "extended")
    cfg = load_config(run / "config.yaml", ["train.epochs=2", f"output_dir={run.parent}"])
    _fit(cfg, resume=run)
    want = [h["lr"] for h in killed[1]]
    assert len(want) == 2
    got = [h["lr"] for h in read_jsonl(run / "history.jsonl")]
    assert got == pytest.approx(want, rel=1e-12) and got[1] > 0  # 1e-3, 5e-4


def finished_run_is_not_overwritten(finished, tmp: Path) -> None:
    """2: a run folder holding any run file (here: no checkpoint_last.pt) is refused."""
    run = _finished_copy(finished, TRAINED_NAME)  # at the folder its config names
    cfg = load_config(run / "config.yaml", [f"output_dir={run.parent}"])
    assert cfg.run_dir == run
    before = (run / "history.jsonl").read_text()
    with pytest.raises(FileExistsError, match="--resume"):
        _fit(cfg)
    assert (run / "history.jsonl").read_text() == before


def kill_between_history_and_checkpoint(finished, tmp: Path, killed) -> None:
    """3: killed after epoch 2's history line, before its checkpoints (``killed``): the resumed
    run has each epoch's line once and a best checkpoint consistent with the history."""
    cfg, before = killed
    assert [h["epoch"] for h in before] == [0, 1]
    assert [h["epoch"] for h in read_jsonl(cfg.run_dir / "history.jsonl")] == [0, 1]
    _fit(cfg, resume=cfg.run_dir)
    history = read_jsonl(cfg.run_dir / "history.jsonl")
    assert [h["epoch"] for h in history] == [0, 1]
    best = [h["epoch"] for h in history if h["best"]][-1]
    assert load_checkpoint(cfg.run_dir / "checkpoint_best.pt")["epoch"] == best


def mixed_size_test_split(finished, tmp: Path) -> None:
    """7: test images of different sizes (one not divisible by the network's stride) with
    data.eval_size: null: the run finishes and writes its test metrics."""
    _voc_tree(tmp / "mixed" / "voc", [(32, 32)] * 8, [(32, 32), (64, 32), (41, 37)])
    args = _voc(tmp, "mixed")
    cfg = load_config(SETUP, args[3:], "ce")
    assert cfg.data.eval_size is None
    test = _fit(cfg)
    assert (cfg.run_dir / "test_metrics.json").is_file() and 0 <= test["pre_ts"]["acc"] <= 1


def huge_image_warns(finished, tmp: Path) -> None:
    """12: a huge evaluation image seen whole gives a warning naming its size and the keys that
    bound the network input (eval.resize, eval.mode: slide); none when they are set."""
    from cals_seg.config.checks import bounded_input
    from cals_seg.data.checks import check_task_data

    _voc_tree(tmp / "huge" / "voc", [(32, 32)] * 8, [(32, 32), (2100, 2100)])
    cfg = load_config(SETUP, _voc(tmp, "huge")[3:], "ce")
    task = build_task(cfg)
    with pytest.warns(UserWarning, match=r"2100x2100 image .*eval.resize.*eval.mode: slide"):
        check_task_data(task, 4, bounded_input(cfg))
    cfg = load_config(SETUP, [*_voc(tmp, "huge")[3:], "eval.mode=slide"], "ce")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_task_data(task, 4, bounded_input(cfg))


BEHAVIOURS = {
    "1-extend-epochs-on-resume": extend_epochs_on_resume,
    "2-finished-run-not-overwritten": finished_run_is_not_overwritten,
    "3-kill-between-history-and-checkpoint": kill_between_history_and_checkpoint,
    "7-mixed-size-test-split": mixed_size_test_split,
    "12-huge-image-warns": huge_image_warns,
}


@pytest.mark.parametrize("case", list(BEHAVIOURS), ids=list(BEHAVIOURS))
def test_behaviour(case, finished, tmp_path, request):
    check = BEHAVIOURS[case]
    if "killed" in check.__code__.co_varnames[: check.__code__.co_argcount]:
        check(finished, tmp_path, request.getfixturevalue("killed"))
    else:
        check(finished, tmp_path)
    assert torch.get_num_threads() >= 1
