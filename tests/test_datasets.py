"""Cityscapes, ADE20K and folder datasets on miniature trees; data.class_names; the setups."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cals_seg.config.checks import check_config
from cals_seg.config.schema import ConfigError, load_config
from cals_seg.data.ade20k import ADE20K_CLASSES, reduce_zero_label
from cals_seg.data.cityscapes import CITYSCAPES_CLASSES, label_to_train_ids
from cals_seg.data.folder import ColourTable
from cals_seg.tasks import build_task
from cals_seg.tasks.segmentation import class_names, segmentation_splits

from ._trees import (
    ADE_TRAIN,
    ADE_VAL,
    CITYSCAPES_TRAIN,
    FOLDER_CLASSES,
    H,
    W,
    ade20k_tree,
    cityscapes_id,
    cityscapes_tree,
    folder_tree,
    stripes,
    write_image,
    write_png,
)
from .conftest import load_tool

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

# The official Cityscapes label definitions (cityscapesScripts, helpers/labels.py), written out
# here independently of the loader: (name, label id, train id), 255 and -1 being "not evaluated".
OFFICIAL_LABELS = [
    ("unlabeled", 0, 255), ("ego vehicle", 1, 255), ("rectification border", 2, 255),
    ("out of roi", 3, 255), ("static", 4, 255), ("dynamic", 5, 255), ("ground", 6, 255),
    ("road", 7, 0), ("sidewalk", 8, 1), ("parking", 9, 255), ("rail track", 10, 255),
    ("building", 11, 2), ("wall", 12, 3), ("fence", 13, 4), ("guard rail", 14, 255),
    ("bridge", 15, 255), ("tunnel", 16, 255), ("pole", 17, 5), ("polegroup", 18, 255),
    ("traffic light", 19, 6), ("traffic sign", 20, 7), ("vegetation", 21, 8),
    ("terrain", 22, 9), ("sky", 23, 10), ("person", 24, 11), ("rider", 25, 12), ("car", 26, 13),
    ("truck", 27, 14), ("bus", 28, 15), ("caravan", 29, 255), ("trailer", 30, 255),
    ("train", 31, 16), ("motorcycle", 32, 17), ("bicycle", 33, 18), ("license plate", -1, -1),
]  # fmt: skip


def _cfg(config: str, root: Path, *sets: str):
    return load_config(CONFIGS / config, [f"data.root={root}", *sets])


def _folder_cfg(root: Path, *sets: str):
    return _cfg("folder_deeplabv3.yaml", root, "data.num_classes=3",
                "data.class_names=[sky, ground, thing]", *sets)


# ----------------------------------------------------------------------------- Cityscapes
def test_cityscapes_mapping_of_every_label_id_matches_the_official_table():
    ids = np.array([label for _, label, _ in OFFICIAL_LABELS])
    expected = np.array([255 if train in (255, -1) else train for *_, train in OFFICIAL_LABELS])
    assert sorted(ids.tolist()) == list(range(-1, 34))  # every label id, once
    np.testing.assert_array_equal(label_to_train_ids(ids), expected)
    # in a uint8 labelIds PNG the license plate (-1) is stored as 255
    np.testing.assert_array_equal(label_to_train_ids(np.array([255, 7], np.uint8)), [255, 0])
    assert label_to_train_ids(np.array([26]), void=250).tolist() == [13]
    assert label_to_train_ids(np.array([0]), void=250).tolist() == [250]
    # the 19 names in train-id order are the official names of train ids 0 .. 18
    named = {train: name for name, _, train in OFFICIAL_LABELS if 0 <= train < 255}
    assert list(CITYSCAPES_CLASSES) == [named[t] for t in range(19)]
    with pytest.raises(ValueError, match=r"\[34, 40\]"):
        label_to_train_ids(np.array([40, 34, 7]))


def test_cityscapes_masks_read_through_the_dataset(tmp_path):
    root = cityscapes_tree(tmp_path)
    # one mask holding every label id, and one image with a labelTrainIds file next to it
    every = np.array([label % 256 for _, label, _ in OFFICIAL_LABELS], np.uint8)
    stem = cityscapes_id("aachen", 0)
    write_png(root / "gtFine/train/aachen" / f"{stem}_gtFine_labelIds.png",
              np.resize(every, (H, W)))
    train_ids = stripes([0, 18, 255])
    stem1 = cityscapes_id("aachen", 1)
    write_png(root / "gtFine/train/aachen" / f"{stem1}_gtFine_labelTrainIds.png", train_ids)
    cfg = _cfg("cityscapes_deeplabv3.yaml", root, "data.val_fraction=0.0")
    sets = segmentation_splits(cfg)
    ds = sets["train"]
    expected = np.array([255 if t in (255, -1) else t for *_, t in OFFICIAL_LABELS], np.uint8)
    np.testing.assert_array_equal(ds.load_mask(stem), np.resize(expected, (H, W)))
    assert ds.mask_path(stem1).name.endswith("_labelTrainIds.png")
    np.testing.assert_array_equal(ds.load_mask(stem1), train_ids)
    sample = ds[0]
    assert sample["image"].shape == (3, H, W) and sample["mask"].shape == (H, W)
    # an id outside -1 .. 33 names the file
    write_png(ds.mask_path(stem), np.full((H, W), 40, np.uint8))
    with pytest.raises(ValueError, match=rf"{stem}_gtFine_labelIds\.png.*\[40\]"):
        ds.load_mask(stem)


def test_cityscapes_splits_official_val_is_test_and_a_seeded_part_of_train_validates(tmp_path):
    root = cityscapes_tree(tmp_path)
    sets = segmentation_splits(_cfg("cityscapes_deeplabv3.yaml", root,
                                    "data.val_fraction=0.34"))
    n_train = sum(CITYSCAPES_TRAIN.values())
    n_val = round(0.34 * n_train)
    assert (len(sets["train"]), len(sets["val"]), len(sets["test"])) == (n_train - n_val,
                                                                         n_val, 2)
    assert set(sets["train"].ids).isdisjoint(sets["val"].ids)
    assert set(sets["train"].ids) | set(sets["val"].ids) == {
        cityscapes_id(c, i) for c, n in CITYSCAPES_TRAIN.items() for i in range(n)}
    assert all(i.startswith("frankfurt_") for i in sets["test"].ids)
    again = segmentation_splits(_cfg("cityscapes_deeplabv3.yaml", root, "data.val_fraction=0.34"))
    assert again["val"].ids == sets["val"].ids  # fixed by the seed
    other = segmentation_splits(_cfg("cityscapes_deeplabv3.yaml", root, "data.val_fraction=0.34",
                                     "data.split_seed=3"))
    assert len(other["val"]) == n_val
    with pytest.raises(ConfigError, match="data.num_classes: Cityscapes has 19"):
        segmentation_splits(_cfg("cityscapes_deeplabv3.yaml", root, "data.num_classes=20"))
    with pytest.raises(ValueError, match="not a Cityscapes root"):
        segmentation_splits(_cfg("cityscapes_deeplabv3.yaml", tmp_path / "leftImg8bit"))


# ----------------------------------------------------------------------------- ADE20K
def test_ade20k_zero_label_becomes_void_and_classes_shift_down(tmp_path):
    assert reduce_zero_label(np.array([0, 1, 2, 150])).tolist() == [255, 0, 1, 149]
    assert len(ADE20K_CLASSES) == 150 == len(set(ADE20K_CLASSES))
    assert ADE20K_CLASSES[0] == "wall" and ADE20K_CLASSES[149] == "flag"
    root = ade20k_tree(tmp_path)
    for given in (root, root / "ADEChallengeData2016"):  # both roots are accepted
        sets = segmentation_splits(_cfg("ade20k_deeplabv3.yaml", given, "data.val_fraction=0.4"))
        assert (len(sets["train"]), len(sets["val"]), len(sets["test"])) == (3, 2, ADE_VAL)
    assert len(sets["train"]) + len(sets["val"]) == ADE_TRAIN
    assert all(i.startswith("ADE_val_") for i in sets["test"].ids)
    ds = sets["test"]
    stem = ds.ids[0]
    raw = np.array([[0, 1, 150, 75]], np.uint8).repeat(H, 0).repeat(W // 4, 1)
    write_png(ds.mask_path(stem), raw)
    expected = np.where(raw == 0, 255, raw.astype(int) - 1)
    np.testing.assert_array_equal(ds.load_mask(stem), expected)
    write_png(ds.mask_path(stem), np.full((H, W), 151, np.uint8))
    with pytest.raises(ValueError, match=rf"{stem}\.png.*\[151\]"):
        ds.load_mask(stem)


# ----------------------------------------------------------------------------- folder
@pytest.mark.parametrize("split_first", [False, True])
def test_folder_sub_folder_layouts_extensions_and_held_out_validation(tmp_path, split_first):
    root = folder_tree(tmp_path, {"train": 5, "val": 2, "test": 3}, split_first)
    sets = segmentation_splits(_folder_cfg(root))
    assert [len(sets[s]) for s in ("train", "val", "test")] == [5, 2, 3]
    suffixes = {sets[s].image_path(i).suffix for s in sets for i in sets[s].ids}
    assert suffixes == {".jpg", ".PNG", ".webp", ".tif", ".bmp", ".jpeg"}
    for s in sets:
        for i in sets[s].ids:
            np.testing.assert_array_equal(
                sets[s].load_mask(i), stripes([0, 1, 2, 255, 0, 1][int(i[-3:]) % 3:]))
            assert sets[s][sets[s].ids.index(i)]["image"].shape == (3, H, W)
    # without a val folder: a seeded 20% of train
    root2 = folder_tree(tmp_path / "noval", {"train": 10, "test": 2}, split_first)
    sets = segmentation_splits(_folder_cfg(root2))
    assert [len(sets[s]) for s in ("train", "val", "test")] == [8, 2, 2]
    assert set(sets["train"].ids).isdisjoint(sets["val"].ids)


def test_folder_split_files(tmp_path):
    for i in range(6):
        write_image(tmp_path / "images" / f"im{i}.jpg", i)
        write_png(tmp_path / "masks" / f"im{i}.png", stripes([0, 1, 2]))
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits/train.txt").write_text("im0\nim1.jpg\n\nim2\n\n")  # blank line, suffix
    (tmp_path / "splits/test.txt").write_text("im3 extra words\nim4\n")
    (tmp_path / "splits/val.txt").write_text("im5\n")
    files = "data.split_files={train: splits/train.txt, val: splits/val.txt, test: splits/test.txt}"
    sets = segmentation_splits(_folder_cfg(tmp_path, files))
    assert sets["train"].ids == ["im0", "im1", "im2"] and sets["test"].ids == ["im3", "im4"]
    assert sets["val"].ids == ["im5"]
    assert not any(sets[s].problems for s in sets)
    assert "blank line(s) 3" in sets["train"].warnings[0]
    # an id twice, an id of another split, an id without files: refused when the task is built
    (tmp_path / "splits/test.txt").write_text("im3\nim3\nim0\nghost\n")
    sets = segmentation_splits(_folder_cfg(tmp_path, files))
    problems = " ".join(sets["test"].problems)
    assert "twice: im3" in problems and "another split (train): im0" in problems
    assert "without an image" in problems and "ghost" in problems
    cfg = _folder_cfg(tmp_path, files, "model.encoder_weights=null")
    with pytest.raises(ValueError, match="problem.*ghost.*tools/check_data.py"), \
            pytest.warns(UserWarning, match="blank line"):
        build_task(cfg)
    with pytest.raises(ValueError, match="unknown key.*'tset'"):
        segmentation_splits(_folder_cfg(tmp_path, "data.split_files={train: a, tset: b}"))


def test_folder_colour_masks_are_decoded_exactly(tmp_path):
    palette = [[0, 0, 0], [128, 0, 0], [0, 128, 1]]
    void = [255, 255, 255]
    labels = np.array([[0, 1, 2, 255], [2, 2, 1, 0]], np.uint8).repeat(6, 0).repeat(10, 1)
    lookup = {0: palette[0], 1: palette[1], 2: palette[2], 255: void}
    rgb = np.zeros((*labels.shape, 3), np.uint8)
    for value, colour in lookup.items():  # written pixel by pixel, not by the decoder
        rgb[labels == value] = colour
    folder_tree(tmp_path, {"train": 2, "test": 1})
    for split, stem in (("train", "train_000"), ("train", "train_001"), ("test", "test_000")):
        write_png(tmp_path / "masks" / split / f"{stem}.png", rgb)
    sets = segmentation_splits(_folder_cfg(
        tmp_path, f"data.palette={palette}", f"data.void_colours=[{void}]",
        "data.val_fraction=0.5"))
    for s in sets:
        for i in sets[s].ids:
            np.testing.assert_array_equal(sets[s].load_mask(i), labels)
    # a colour in neither table: an error naming the file and the colour, or void if asked
    odd = rgb.copy()
    odd[0, 0] = [0, 128, 0]  # one bit away from class 2
    path = write_png(tmp_path / "masks" / "test" / "test_000.png", odd)
    with pytest.raises(ValueError, match=r"test_000\.png.*\[0, 128, 0\] \(1 px\)"):
        sets["test"].load_mask("test_000")
    relaxed = segmentation_splits(_folder_cfg(
        tmp_path, f"data.palette={palette}", f"data.void_colours=[{void}]",
        "data.unknown_colours=void"))
    expected = labels.copy()
    expected[0, 0] = 255
    np.testing.assert_array_equal(relaxed["test"].load_mask("test_000"), expected)
    assert path.is_file()
    # a colour mask without data.palette is refused with the fix
    with pytest.raises(ValueError, match="colour.*data.palette"):
        segmentation_splits(_folder_cfg(tmp_path))["test"].load_mask("test_000")
    # a palette PNG is read as its colours when data.palette is given
    from PIL import Image

    png = Image.fromarray(labels, mode="L").convert("P")
    flat = [0] * 768
    for value, colour in lookup.items():
        flat[3 * value:3 * value + 3] = colour
    png.putpalette(flat)
    png.save(tmp_path / "masks" / "test" / "test_000.png")
    np.testing.assert_array_equal(sets["test"].load_mask("test_000"), labels)


def test_colour_table_matches_a_reference_loop():
    rng = np.random.default_rng(0)
    palette = [list(map(int, c)) for c in rng.integers(0, 256, (7, 3))]
    table = ColourTable(palette, [[1, 2, 3]], ignore_index=255)
    index = rng.integers(0, 8, (9, 11))
    colours = palette + [[1, 2, 3]]
    rgb = np.array([[colours[v] for v in row] for row in index], np.uint8)
    expected = [[v if v < 7 else 255 for v in row] for row in index]
    np.testing.assert_array_equal(table(rgb), expected)


def test_palette_and_class_name_config_errors(tmp_path):
    root = folder_tree(tmp_path)
    with pytest.raises(ConfigError, match="data.palette: 2 colours for data.num_classes=3"):
        segmentation_splits(_folder_cfg(root, "data.palette=[[0, 0, 0], [1, 1, 1]]"))
    with pytest.raises(ConfigError, match=r"listed twice"):
        segmentation_splits(_folder_cfg(root, "data.palette=[[0, 0, 0], [1, 1, 1], [2, 2, 2]]",
                                        "data.void_colours=[[1, 1, 1]]"))
    with pytest.raises(ConfigError, match=r"data.palette\[1\]: expected a colour"):
        segmentation_splits(_folder_cfg(root, "data.palette=[[0, 0, 0], [1, 1], [2, 2, 2]]"))
    with pytest.raises(ConfigError, match="data.unknown_colours"):
        segmentation_splits(_folder_cfg(root, "data.palette=[[0, 0, 0], [1, 1, 1], [2, 2, 2]]",
                                        "data.unknown_colours=black"))
    with pytest.raises(ConfigError, match="void_colours is only read with data.palette"):
        segmentation_splits(_folder_cfg(root, "data.void_colours=[[1, 1, 1]]"))
    with pytest.raises(ConfigError, match="data.class_names: 2 names for data.num_classes=3"):
        check_config(_folder_cfg(root, "data.class_names=[a, b]"))
    with pytest.raises(ConfigError, match=r"data.class_names: the names \['a'\] occur twice"):
        check_config(_folder_cfg(root, "data.class_names=[a, a, b]"))
    with pytest.raises(ConfigError,
                       match="data.root: expected an existing folder, got .*does not exist"):
        segmentation_splits(_folder_cfg(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no test split"):
        segmentation_splits(_folder_cfg(folder_tree(tmp_path / "t", {"train": 3})))


def test_class_names_reach_every_dataset_and_the_display_names():
    synthetic = load_config(CONFIGS / "synthetic_deeplabv3.yaml")
    assert class_names(synthetic)[1] == "red_disc"
    names = [f"n{i}" for i in range(11)]
    named = load_config(CONFIGS / "synthetic_deeplabv3.yaml", [f"data.class_names={names}"])
    assert class_names(named) == names
    city = load_config(CONFIGS / "cityscapes_deeplabv3.yaml")
    assert class_names(city) == list(CITYSCAPES_CLASSES)
    assert class_names(load_config(CONFIGS / "ade20k_deeplabv3.yaml")) == list(ADE20K_CLASSES)
    folder = load_config(CONFIGS / "folder_deeplabv3.yaml", ["data.class_names=null"])
    assert class_names(folder) == ["class 0", "class 1", "class 2"]


def test_task_of_a_classification_dataset_takes_data_class_names(tmp_path):
    small = [f"data.root={tmp_path}", "data.synthetic={max_train: 2, min_train: 1, num_val: 1, "
             "num_test: 1, image_size: 16}"]
    cfg = load_config(CONFIGS / "synthetic_cls.yaml", small)
    own = build_task(cfg).class_names  # the folder names of the generated set
    names = [f"kind {i}" for i in range(cfg.data.num_classes)]
    assert own != names
    cfg = load_config(CONFIGS / "synthetic_cls.yaml", [*small, f"data.class_names={names}"])
    assert build_task(cfg).class_names == names


# ----------------------------------------------------------------------------- setups
@pytest.mark.parametrize("setup", ["cityscapes_deeplabv3", "ade20k_deeplabv3", "folder_deeplabv3"])
def test_setups_load_and_validate_without_data(setup):
    cfg = load_config(CONFIGS / f"{setup}.yaml")
    check_config(cfg)
    assert cfg.name == f"{setup}_cals_alm"
    for method in ("ce", "cals_alm", "cals_alm_auto"):
        assert load_config(CONFIGS / f"{setup}_{method}.yaml").name == f"{setup}_{method}"


def test_cityscapes_and_ade20k_setups_follow_the_usual_protocols():
    city = load_config(CONFIGS / "cityscapes_deeplabv3.yaml")
    assert (city.data.crop_size, city.train.batch_size, city.optim.name, city.optim.lr) == (
        769, 8, "sgd", 0.01)
    assert (city.eval.mode, city.eval.window, city.eval.stride) == ("slide", 769, 513)
    assert city.model.encoder_name == "resnet50" and city.data.num_classes == 19
    # 80k iterations of batch 8 over the 2677 training images (2975 - round(0.1 * 2975))
    assert city.train.epochs == -(-80_000 * 8 // (2975 - round(0.1 * 2975)))
    ade = load_config(CONFIGS / "ade20k_deeplabv3.yaml")
    assert (ade.data.crop_size, ade.train.batch_size, ade.data.num_classes) == (512, 16, 150)
    assert ade.train.epochs == -(-160_000 * 16 // (20210 - round(0.1 * 20210)))
    assert ade.eval.mode == "whole"


# ----------------------------------------------------------------------------- training runs
FAST = [
    "data.crop_size=32", "data.num_workers=0", "train.epochs=1", "train.batch_size=2",
    "eval.batch_size=2", "train.progress=false", "train.threads=1", "train.amp=none",
    "eval.num_maps=0", "eval.temperature_scaling=false", "model.encoder_name=resnet18",
    "model.encoder_weights=null",
    "model.params={encoder_output_stride: 16, decoder_channels: 32}",
]


def _train(tmp_path, monkeypatch, setup: str, root: Path, *sets: str) -> tuple[Path, list[str]]:
    """One short run through tools/train_seg.py; returns the run directory and the texts of
    every plot legend drawn."""
    from cals_seg.visualization import plotting

    legends: list[str] = []
    save = plotting._save

    def spy(fig, path):
        for ax in fig.axes:
            if ax.get_legend() is not None:
                legends.extend(t.get_text() for t in ax.get_legend().get_texts())
        save(fig, path)

    monkeypatch.setattr(plotting, "_save", spy)
    name = f"{setup}_run"
    argv = [str(CONFIGS / f"{setup}.yaml"), "--set", f"name={name}",
            f"output_dir={tmp_path / 'runs'}", f"data.root={root}", *FAST, *sets]
    assert load_tool("train_seg").main(argv) == 0
    return tmp_path / "runs" / name, legends


def _check_run(run: Path, legends: list[str], names: list[str]) -> dict:
    metrics = json.loads((run / "test_metrics.json").read_text())
    assert metrics["class_names"] == names
    shown_names = [t for t in legends if t in names]
    assert shown_names and set(shown_names) <= set(names)
    assert (run / "plots" / "lambda_curves.png").is_file()
    return metrics


def test_training_run_on_cityscapes_layout(tmp_path, monkeypatch):
    root = cityscapes_tree(tmp_path / "data")
    run, legends = _train(tmp_path, monkeypatch, "cityscapes_deeplabv3", root,
                          "data.val_fraction=0.34")
    _check_run(run, legends, list(CITYSCAPES_CLASSES))


def test_training_run_on_ade20k_layout(tmp_path, monkeypatch):
    root = ade20k_tree(tmp_path / "data")
    names = [f"thing {i}" for i in range(150)]  # data.class_names replaces the ADE names
    run, legends = _train(tmp_path, monkeypatch, "ade20k_deeplabv3", root,
                          "data.val_fraction=0.4", f"data.class_names={names}")
    _check_run(run, legends, names)


def test_training_run_on_folder_layout_and_predictions_name_classes(tmp_path, monkeypatch):
    root = folder_tree(tmp_path / "data")
    run, legends = _train(tmp_path, monkeypatch, "folder_deeplabv3", root,
                          f"data.class_names={FOLDER_CLASSES}")
    _check_run(run, legends, FOLDER_CLASSES)
    out = tmp_path / "pred"
    image = next((root / "images" / "test").iterdir())
    assert load_tool("predict_seg").main([str(run), str(image), "--out", str(out),
                                          "--no-progress", "--device", "cpu"]) == 0
    record = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
    assert record["class_areas"] and set(record["class_areas"]) <= set(FOLDER_CLASSES)
