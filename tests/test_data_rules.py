"""Data problems of a VOC-layout dataset, by rule, before the first epoch: each refused with one
line naming the file (exit status 2), through tools/train_seg.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from cals_seg.data.checks import split_file_ids
from cals_seg.errors import DataError

from .conftest import load_tool
from .test_bad_inputs import SETUP, _voc, _voc_tree

BASE = "VOCdevkit/VOC2012"


def _split(root: Path, name: str) -> Path:
    return root / BASE / "ImageSets/Segmentation" / f"{name}.txt"


def blank_line(root: Path) -> str:
    path = _split(root, "train")
    ids = path.read_text().split()
    path.write_text("\n".join(ids[:3]) + "\n\n" + "\n".join(ids[3:]) + "\n")
    return r"train.txt, line 4: a blank line between ids"


def repeated_id(root: Path) -> str:
    path = _split(root, "train")
    path.write_text(path.read_text() + "train_2\n")
    return r"train.txt, line 9: id 'train_2' is listed again \(first on line 3\)"


def id_in_train_and_test(root: Path) -> str:
    path = _split(root, "val")
    path.write_text(path.read_text() + "train_5\n")
    return r"train.txt and val.txt share 1 id\(s\) \(train_5\).*the test set"


def id_without_files(root: Path) -> str:
    path = _split(root, "train")
    path.write_text(path.read_text() + "ghost\n")
    return r"missing under .*JPEGImages/ghost.jpg"


def mask_value_outside_classes(root: Path) -> str:
    mask = root / BASE / "SegmentationClass" / "train_3.png"
    png = Image.open(mask)
    pixels = np.array(png)
    pixels[0, 0] = 40  # 11 classes, void 255
    out = Image.fromarray(pixels, mode="P")
    out.putpalette(png.getpalette())
    out.save(mask)
    return r"train_3.png' contains values \[40\] outside \[0, 11\)"


def size_mismatch(root: Path) -> str:
    image = root / BASE / "JPEGImages" / "val_1.jpg"
    Image.fromarray(np.zeros((40, 32, 3), np.uint8)).save(image)
    return r"The test split has 1 bad sample.*val_1.jpg' is 32x40 but mask .*val_1.png' is 32x32"


def rgb_mask(root: Path) -> str:
    mask = root / BASE / "SegmentationClass" / "train_0.png"
    Image.open(mask).convert("RGB").save(mask)
    return r"train_0.png' has mode RGB, not a palette"


CASES = [blank_line, repeated_id, id_in_train_and_test, id_without_files,
         mask_value_outside_classes, size_mismatch, rgb_mask]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_data_problem_is_refused_before_training(case, tmp_path, capsys):
    name = case.__name__
    root = _voc_tree(tmp_path / name / "voc", [(32, 32)] * 8, [(32, 32)] * 2)
    pattern = case(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = load_tool("train_seg").main([str(SETUP), *_voc(tmp_path, name)])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("error: ") and "\n" not in err, err
    import re

    assert re.search(pattern, err), err
    assert not (tmp_path / "runs" / name).exists() or not any(
        (tmp_path / "runs" / name).glob("history.jsonl"))


def test_blank_lines_at_the_end_are_fine(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("a\nb\n\n\n")
    assert split_file_ids(path) == ["a", "b"]
    path.write_text("a\n\nb\n")
    with pytest.raises(DataError, match="line 2"):
        split_file_ids(path)


# --------------------------------------------------------------------------- one message each
# Each data rule is written once (cals_seg.data.checks, cals_seg.data.paired): the same words
# reach the user from every place that checks it: the check before training
# (check_task_data), the full report of tools/check_data.py (check_splits) and, for a sample,
# loading it (dataset[i]).
def _planted(case: str, tmp_path: Path) -> tuple[Any, dict, str]:
    """A VOC tree with one planted problem: (task-like splits, the report, the message)."""
    from types import SimpleNamespace

    from cals_seg.data.checks import check_splits, empty_split, void_validation
    from cals_seg.data.paired import size_mismatch
    from cals_seg.tasks.segmentation import segmentation_splits

    void = case == "void_val"
    root = _voc_tree(tmp_path / "p" / "voc", [(32, 32)] * 8, [(32, 32)] * 2, void=void)
    base = root / BASE
    sets = {"data.val_fraction": "0.0"} if case == "empty_val" else {}
    if case == "size":
        Image.fromarray(np.zeros((40, 32, 3), np.uint8)).save(base / "JPEGImages" / "val_1.jpg")
    if case == "mask_value":
        mask_value_outside_classes(root)
    args = _voc(tmp_path, "p", **sets)
    from cals_seg.config.schema import load_config

    cfg = load_config(SETUP, args[3:], "ce")
    splits = segmentation_splits(cfg)
    task = SimpleNamespace(train_set=splits["train"], val_set=splits["val"],
                           test_set=splits["test"], ignore_index=255)
    report = check_splits(splits, [str(k) for k in range(11)], 11, 255, progress=False)
    if case == "empty_val":
        message = empty_split("val")
    elif case == "void_val":
        message = void_validation(len(splits["val"]), 255)
    elif case == "size":
        test = splits["test"]
        message = size_mismatch(test.image_path("val_1"), (32, 40), test.mask_path("val_1"),
                                (32, 32))
    else:
        with pytest.raises(DataError) as info:
            splits["train"].load_mask("train_3")
        message = str(info.value).rstrip(".")
    return task, report, message


@pytest.mark.parametrize("case", ["empty_val", "void_val", "size", "mask_value"])
def test_each_data_message_is_the_same_from_every_entry_point(case, tmp_path):
    from cals_seg.data.checks import check_task_data

    task, report, message = _planted(case, tmp_path)
    with pytest.raises(DataError) as info:
        check_task_data(task, batch_size=2)
    refusal = str(info.value)
    assert message[1:] in refusal and "\n" not in refusal, (refusal, message)
    assert any(message in p for p in report.problems), (report.problems, message)
    assert not report.ok
    if case in ("size", "mask_value"):  # the dataset refuses the sample with the same words
        split = task.test_set if case == "size" else task.train_set
        index = split.ids.index("val_1" if case == "size" else "train_3")
        with pytest.raises(DataError) as info:
            split[index]
        assert message in str(info.value), (str(info.value), message)
