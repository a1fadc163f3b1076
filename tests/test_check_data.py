"""tools/check_data.py: a clean tree passes, each planted problem is found (exit 1, file named)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cals_seg.config.schema import load_config
from cals_seg.data.checks import check_splits
from cals_seg.tasks.segmentation import segmentation_splits

from ._trees import H, W, cityscapes_tree, folder_tree, stripes, write_image, write_png
from .conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "configs" / "folder_deeplabv3.yaml"
SETS = ["data.num_classes=3", "data.class_names=[sky, ground, thing]"]


def _check(root: Path, tmp_path: Path, *sets: str, config: Path = FOLDER) -> tuple[int, str, dict]:
    """Run the tool in-process; returns the exit status, its output and the JSON report."""
    report = tmp_path / "report.json"
    tool = load_tool("check_data")
    argv = [str(config), "--no-progress", "--json", str(report), "--set",
            f"data.root={root}", *(SETS if config == FOLDER else []), *sets]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main(argv)
    data = json.loads(report.read_text()) if report.is_file() else {}
    return code, out.getvalue() + err.getvalue(), data


def test_clean_tree_passes_with_counts_histogram_and_sizes(tmp_path):
    root = folder_tree(tmp_path / "data", {"train": 4, "val": 2, "test": 3})
    write_image(root / "images" / "test" / "big.png", 99, size=(30, 50))
    write_png(root / "masks" / "test" / "big.png", np.zeros((30, 50), np.uint8))
    code, text, report = _check(root, tmp_path)
    assert code == 0, text
    assert report["ok"] and report["problems"] == []
    assert [report["splits"][s]["samples"] for s in ("train", "val", "test")] == [4, 2, 4]
    assert "OK: nothing found" in text and "train: 4 image/mask pairs" in text
    # the histogram, against the masks written by the tree (stripes cycling from an offset)
    for split, count in (("train", 4), ("val", 2)):
        pixels, images = np.zeros(3, int), np.zeros(3, int)
        void = 0
        for i in range(count):
            mask = stripes([0, 1, 2, 255, 0, 1][i % 3:])
            for k in range(3):
                pixels[k] += int((mask == k).sum())
                images[k] += int((mask == k).any())
            void += int((mask == 255).sum())
        stats = report["splits"][split]
        assert stats["class_pixels"] == pixels.tolist() and stats["class_images"] == images.tolist()
        assert stats["void_pixels"] == void
    assert report["splits"]["test"]["min_size"] == [W, H]
    assert report["splits"]["test"]["max_size"] == [50, 30]
    assert "image sizes 40x24 .. 50x30 (WxH)" in text
    for name in ("sky", "ground", "thing"):
        assert name in text


def test_image_without_mask(tmp_path):
    root = folder_tree(tmp_path / "data")
    (root / "masks" / "val" / "val_001.png").unlink()
    code, text, report = _check(root, tmp_path)
    assert code == 1 and "without a mask" in text and "val_001" in text


def test_mask_without_image_is_a_warning_only(tmp_path):
    root = folder_tree(tmp_path / "data")
    write_png(root / "masks" / "train" / "stray.png", np.zeros((H, W), np.uint8))
    code, text, report = _check(root, tmp_path)
    assert code == 0 and "stray.png" in " ".join(report["warnings"])
    # training says it once and goes on
    from cals_seg.tasks import build_task

    cfg = load_config(FOLDER, [f"data.root={root}", *SETS, "model.encoder_weights=null",
                               "model.encoder_name=resnet18"])
    with pytest.warns(UserWarning, match="mask.*without an image.*stray.png"):
        build_task(cfg)


def test_size_mismatch(tmp_path):
    root = folder_tree(tmp_path / "data")
    write_png(root / "masks" / "test" / "test_001.png", np.zeros((H, W + 2), np.uint8))
    code, text, report = _check(root, tmp_path)
    assert code == 1
    (problem,) = [p for p in report["problems"] if "different sizes" in p]
    assert "test_001" in problem and f"is {W}x{H} but mask" in problem
    assert f"is {W + 2}x{H} (WxH)" in problem


def test_label_value_outside_the_classes(tmp_path):
    root = folder_tree(tmp_path / "data")
    mask = stripes([0, 1, 2])
    mask[0, 0] = 7
    write_png(root / "masks" / "train" / "train_002.png", mask)
    code, text, report = _check(root, tmp_path)
    assert code == 1
    assert any("train_002.png" in p and "[7]" in p for p in report["problems"])


def test_unreadable_image(tmp_path):
    root = folder_tree(tmp_path / "data")
    bad = next((root / "images" / "val").iterdir())
    bad.write_bytes(bad.read_bytes()[:40])  # truncated
    code, text, report = _check(root, tmp_path)
    assert code == 1 and any(bad.name in p and "Cannot read" in p for p in report["problems"])


def test_ids_listed_twice_and_in_two_splits(tmp_path):
    root = tmp_path / "data"
    for i in range(5):
        write_image(root / "images" / f"a{i}.png", i)
        write_png(root / "masks" / f"a{i}.png", stripes([0, 1, 2]))
    (root / "train.txt").write_text("a0\na1\na1\na2\n")
    (root / "test.txt").write_text("a3\na0\n")
    code, text, report = _check(root, tmp_path, "data.split_files={train: train.txt, test: "
                                "test.txt}")
    assert code == 1
    problems = " ".join(report["problems"])
    assert "lists 1 id(s) twice: a1" in problems
    assert "of another split (train): a0" in problems


def test_split_file_id_without_files_and_blank_lines(tmp_path):
    root = tmp_path / "data"
    for i in range(4):
        write_image(root / "images" / f"a{i}.jpg", i)
        write_png(root / "masks" / f"a{i}.png", stripes([0, 1, 2]))
    (root / "train.txt").write_text("a0\n\na1\na2\nmissing_one\n")
    (root / "test.txt").write_text("a3\n")
    code, text, report = _check(root, tmp_path, "data.split_files={train: train.txt, test: "
                                "test.txt}", "data.val_fraction=0.34")
    assert code == 1 and "missing_one" in " ".join(report["problems"])
    assert "blank line(s) 2" in " ".join(report["warnings"])


def test_validation_split_all_void(tmp_path):
    root = folder_tree(tmp_path / "data")
    for path in (root / "masks" / "val").iterdir():
        write_png(path, np.full((H, W), 255, np.uint8))
    code, text, report = _check(root, tmp_path)
    assert code == 1 and any("every pixel of the 2 validation images is void" in p
                             for p in report["problems"])


def test_class_absent_from_training_is_a_warning(tmp_path):
    root = folder_tree(tmp_path / "data")
    for path in (root / "masks" / "train").iterdir():
        write_png(path, stripes([0, 1]))
    code, text, report = _check(root, tmp_path)
    assert code == 0 and any("never occur in the train split: thing" in w
                             for w in report["warnings"])


def test_cityscapes_tree_and_unknown_label_id(tmp_path):
    root = cityscapes_tree(tmp_path / "data")
    config = ROOT / "configs" / "cityscapes_deeplabv3.yaml"
    code, text, report = _check(root, tmp_path, "data.val_fraction=0.34", config=config)
    assert code == 0, text
    counts = report["splits"]["train"]["class_pixels"]
    assert counts[0] > 0 and counts[13] > 0 and counts[10] > 0  # road, car, sky
    assert sum(counts) == counts[0] + counts[13] + counts[10]
    mask = next((root / "gtFine" / "val" / "frankfurt").iterdir())
    write_png(mask, np.full((H, W), 34, np.uint8))
    code, text, report = _check(root, tmp_path, "data.val_fraction=0.34", config=config)
    assert code == 1 and any(mask.name in p and "[34]" in p for p in report["problems"])


def test_bad_config_exits_2(tmp_path):
    root = folder_tree(tmp_path / "data")
    code, text, _ = _check(root, tmp_path, "data.class_names=[a, b]")
    assert code == 2 and "data.class_names" in text
    code, text, _ = _check(tmp_path / "nowhere", tmp_path)
    assert code == 2 and "does not exist" in text
    code, text, _ = _check(root, tmp_path, "data.num_clases=3")
    assert code == 2 and "unknown key" in text
    code, text, _ = _check(root, tmp_path, config=ROOT / "configs" / "synthetic_cls.yaml")
    assert code == 2 and "not a segmentation dataset" in text


def test_library_check_on_a_plain_dataset():
    """Any dataset of {"image": (3, H, W), "mask": (H, W)} items with ids can be checked."""
    import torch

    class Plain(torch.utils.data.Dataset):
        ids = ["a", "b"]

        def __len__(self):
            return 2

        def __getitem__(self, i):
            mask = torch.full((4, 6), i, dtype=torch.long)
            return {"image": torch.zeros(3, 4, 6), "mask": mask}

    report = check_splits({"train": Plain(), "val": Plain(), "test": Plain()}, ["x", "y"], 2,
                          255, progress=False)
    assert report.ok and report.splits["train"].class_pixels.tolist() == [24, 24]


def test_help_answers_without_importing_torch():
    code = ("import runpy, sys; sys.argv = ['check_data.py', '--help']\n"
            "try:\n    runpy.run_path('tools/check_data.py', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Exit status" in result.stdout


@pytest.mark.parametrize("split", ["train", "test"])
def test_training_refuses_listing_problems_before_the_first_epoch(tmp_path, split):
    root = folder_tree(tmp_path / "data")
    next((root / "masks" / split).iterdir()).unlink()
    cfg = load_config(FOLDER, [f"data.root={root}", *SETS, "model.encoder_weights=null"])
    assert segmentation_splits(cfg)[split].problems  # listed, not raised, for check_data
    from cals_seg.tasks import build_task

    with pytest.raises(ValueError, match=f"without a mask.*{split}_00"):
        build_task(cfg)
