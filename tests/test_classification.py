"""Image classification: loaders of every layout, their errors, transforms, timm models, the
embedded long-tailed set, long-tail group metrics, and 2-epoch runs of the embedded configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.calibrators.ts import TemperatureScaler
from cals_seg.config.schema import load_config
from cals_seg.data.classification import (
    ImageClassification,
    classification_eval_transform,
    classification_train_transform,
    image_folder,
    image_folder_splits,
    imagenet_paper_split,
    per_class_holdout,
    read_split_file,
    tiny_imagenet,
    tiny_imagenet_paper_split,
)
from cals_seg.data.synthetic_cls import generate_synthetic_images, long_tail_counts
from cals_seg.evaluation.stream import Scaled, evaluate
from cals_seg.metrics import CalibrationMeter
from cals_seg.metrics.groups import ShotGroupMeter, shot_groups
from cals_seg.models.classification import WeightsUnavailableError, build_classification_model
from cals_seg.tasks import build_task

from .conftest import load_tool, recomputed_test_accuracy

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]
def _png(path: Path, value: int = 0, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8)).save(path)


def _folder_tree(root: Path, classes=("cat", "dog"), per_split=None) -> Path:
    per_split = per_split or {"train": 3, "val": 2, "test": 2}
    for split, n in per_split.items():
        for c in classes:
            for i in range(n):
                _png(root / split / c / f"{i}.png", 10 * i)
    return root


# ----------------------------------------------------------------------------- ImageFolder
def test_image_folder_reads_every_split(tmp_path):
    root = _folder_tree(tmp_path)
    splits = image_folder_splits(root)
    assert splits["classes"] == ["cat", "dog"]
    assert [len(splits[s]) for s in ("train", "val", "test")] == [6, 4, 4]
    assert sorted({label for _, label in splits["train"]}) == [0, 1]
    ds = ImageClassification(splits["val"], classification_eval_transform(8), 2, ["cat", "dog"])
    image, label = ds[3]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32 and label == 1
    assert ds.class_counts() == [2, 2]


def test_image_folder_missing_class_folder_is_named(tmp_path):
    root = _folder_tree(tmp_path)
    for f in (root / "test" / "dog").iterdir():
        f.unlink()
    (root / "test" / "dog").rmdir()
    with pytest.raises(ValueError, match="'dog'.*test"):
        image_folder_splits(root)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        image_folder(root, "nowhere")


def test_unreadable_image_names_the_file(tmp_path):
    bad = tmp_path / "train" / "cat" / "broken.png"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not an image")
    samples, classes = image_folder(tmp_path, "train")
    ds = ImageClassification(samples, classification_eval_transform(8), 1, classes)
    with pytest.raises(ValueError, match="broken.png"):
        ds[0]


# ----------------------------------------------------------------------------- split files
def test_split_file_reads_and_rejects_bad_lines(tmp_path):
    _png(tmp_path / "train" / "n1" / "a.jpg")
    _png(tmp_path / "train" / "n2" / "b.jpg")
    good = tmp_path / "lt_train.txt"
    good.write_text("train/n1/a.jpg 0\n\ntrain/n2/b.jpg 1\n")
    samples = read_split_file(good, tmp_path, num_classes=2)
    assert [label for _, label in samples] == [0, 1]
    assert Path(samples[1][0]) == tmp_path / "train" / "n2" / "b.jpg"

    unknown = tmp_path / "unknown.txt"
    unknown.write_text("train/n1/a.jpg 0\ntrain/n2/b.jpg 7\n")
    with pytest.raises(ValueError, match=r"unknown.txt, line 2: label 7"):
        read_split_file(unknown, tmp_path, num_classes=2)
    missing = tmp_path / "missing.txt"
    missing.write_text("train/n1/a.jpg 0\ntrain/n1/gone.jpg 0\n")
    with pytest.raises(ValueError, match=r"missing.txt, line 2: image .*gone.jpg"):
        read_split_file(missing, tmp_path, num_classes=2)
    malformed = tmp_path / "malformed.txt"
    malformed.write_text("train/n1/a.jpg\n")
    with pytest.raises(ValueError, match=r"malformed.txt, line 1"):
        read_split_file(malformed, tmp_path, num_classes=2)


# ----------------------------------------------------------------------------- Tiny-ImageNet
def _tiny_tree(root: Path, wnids=("n01", "n02", "n03"), train=6, val=3) -> Path:
    (root / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    lines = []
    for w in wnids:
        for i in range(train):
            _png(root / "train" / w / "images" / f"{w}_{i}.JPEG")
        for i in range(val):
            name = f"val_{w}_{i}.JPEG"
            _png(root / "val" / "images" / name)
            lines.append(f"{name}\t{w}\t0\t0\t8\t8")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def test_tiny_imagenet_layout_and_paper_split(tmp_path):
    root = _tiny_tree(tmp_path)
    tiny = tiny_imagenet(root)
    assert tiny["classes"] == ["n01", "n02", "n03"]
    assert len(tiny["train"]) == 18 and len(tiny["val"]) == 9
    split = tiny_imagenet_paper_split(root, per_class=2, seed=0)
    assert len(split["train"]) == 12 and len(split["val"]) == 6 and split["test"] == tiny["val"]
    assert np.bincount([y for _, y in split["val"]]).tolist() == [2, 2, 2]
    assert not set(split["train"]) & set(split["val"])
    assert tiny_imagenet_paper_split(root, per_class=2, seed=0)["val"] == split["val"]
    assert tiny_imagenet_paper_split(root, per_class=2, seed=1)["val"] != split["val"]


def test_tiny_imagenet_bad_annotation_is_named(tmp_path):
    root = _tiny_tree(tmp_path)
    ann = root / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text() + "val_x.JPEG\tn99\t0\t0\t8\t8\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt, line 10: unknown wnid 'n99'"):
        tiny_imagenet(root)


def test_holdout_needs_enough_samples():
    with pytest.raises(ValueError, match="cannot hold out 3"):
        per_class_holdout([("a", 0), ("b", 0), ("c", 0)], 3, seed=0)


def test_imagenet_val_split_20_80_per_class(tmp_path):
    root = _folder_tree(tmp_path, ("n1", "n2"), {"train": 2, "val": 10})
    split = imagenet_paper_split(root, val_fraction=0.2, seed=0)
    assert np.bincount([y for _, y in split["val"]]).tolist() == [2, 2]
    assert np.bincount([y for _, y in split["test"]]).tolist() == [8, 8]
    assert not set(split["val"]) & set(split["test"])
    assert imagenet_paper_split(root, 0.2, seed=0)["val"] == split["val"]


# ----------------------------------------------------------------------------- transforms, models
def test_transforms_and_timm_model():
    image = np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    train = classification_train_transform(32, (0.5, 1.0), 0.4, random_erasing=0.5)
    assert train(image).shape == (3, 32, 32)
    assert classification_eval_transform(32, 36)(image).shape == (3, 32, 32)
    # a constant image comes out as ((v / 255 - mean) / std) per channel, everywhere
    flat = np.full((40, 50, 3), (30, 120, 250), dtype=np.uint8)
    out = classification_eval_transform(32, 36)(flat)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet statistics
    for c, v in enumerate((30, 120, 250)):
        torch.testing.assert_close(out[c], torch.full((32, 32), (v / 255 - mean[c]) / std[c]),
                                   rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="at least image_size"):
        classification_eval_transform(32, 16)
    model = build_classification_model("resnet18", num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="not a timm model"):
        build_classification_model("resnet_does_not_exist", 7)
    with pytest.raises(FileNotFoundError, match="no_such.pth"):
        build_classification_model("resnet18", 7, "no_such.pth")


def test_pretrained_offline_is_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(WeightsUnavailableError, match="encoder_weights"):
        build_classification_model("resnet18", 7, "imagenet")


def test_classification_config_rejects_void_label_255(tmp_path):
    cfg = load_config(ROOT / "configs" / "synthetic_cls_ce.yaml", [
        "data.ignore_index=255", f"data.root={tmp_path / 'data'}",
        "data.synthetic={max_train: 8, min_train: 2, num_val: 1, num_test: 1, image_size: 16}"])
    with pytest.raises(ValueError, match="-100"):
        build_task(cfg)


# ----------------------------------------------------------------------------- embedded set
# 101 ... 2 training images per class (281 in all): still one class of each shot group (many
# > 100, medium 20-100, few < 20), the smallest set that has all three.
SMALL = {"max_train": 101, "min_train": 2, "num_val": 4, "num_test": 6, "image_size": 16}


def test_synthetic_set_is_long_tailed_and_deterministic(tmp_path):
    counts = long_tail_counts(10, 101, 2)
    assert counts[0] == 101 and counts[-1] == 2 and counts == sorted(counts, reverse=True)
    a = generate_synthetic_images(tmp_path / "a", **SMALL)
    b = generate_synthetic_images(tmp_path / "b", **SMALL)
    files = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert len(files) == sum(counts) + 10 * (4 + 6)
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files[::37])
    splits = image_folder_splits(a)
    train_counts = np.bincount([y for _, y in splits["train"]], minlength=10)
    assert sorted(train_counts.tolist(), reverse=True) == counts
    assert generate_synthetic_images(a, **SMALL) == a  # reused as is
    with pytest.raises(ValueError, match="other parameters"):
        generate_synthetic_images(a, **{**SMALL, "seed": 3})


# ----------------------------------------------------------------------------- groups
def test_shot_groups_thresholds():
    groups = shot_groups([300, 101, 100, 20, 19, 0])
    assert groups == {"many": [0, 1], "medium": [2, 3], "few": [4, 5]}


def test_group_metrics_equal_meters_on_the_group_subsets():
    torch.manual_seed(0)
    k, n = 5, 400
    x = torch.randn(n, 8)
    y = torch.randint(0, k, (n,))
    y[::17] = -100
    model = torch.nn.Linear(8, k)
    loader = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=64)
    counts = [500, 150, 50, 10, 3]
    meters = {"pre_ts": ShotGroupMeter(counts, 15, -100), "post_ts": ShotGroupMeter(counts, 15)}
    evaluate(model, loader, torch.device("cpu"),
             [meters["pre_ts"], Scaled(TemperatureScaler(2.0), [meters["post_ts"]])])
    out = {key: meter.compute() for key, meter in meters.items()}
    with torch.no_grad():
        logits = model(x)
    for key, t in (("pre_ts", 1.0), ("post_ts", 2.0)):
        for name, classes in (("many", [0, 1]), ("medium", [2]), ("few", [3, 4])):
            keep = torch.isin(y, torch.tensor(classes))
            meter = CalibrationMeter(k, 15, classwise=False)
            meter.update(logits[keep] / t, y[keep])
            ref, got = meter.compute(), out[key]["groups"][name]
            assert got["classes"] == classes and got["count"] == int(keep.sum())
            for metric in ("acc", "ece", "aece", "nll"):
                assert got[metric] == pytest.approx(ref[metric], abs=1e-9), (key, name, metric)
    valid = y != -100
    acc = [(logits[valid & (y == c)].argmax(1) == c).float().mean().item() for c in range(k)]
    assert out["pre_ts"]["per_class_acc"] == pytest.approx(acc)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("method", ["ce", "cals_alm"])
def test_two_epoch_run_of_embedded_config(tmp_path, method, capsys):
    overrides = [
        f"name=run_{method}", f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
        f"data.synthetic={json.dumps(SMALL)}", "data.image_size=16", "train.epochs=2",
        "train.batch_size=96", "eval.batch_size=64", "train.progress=false", "train.threads=1",
        "train.amp=none",  # float32, like the per-sample recomputation below
    ]  # batches of 96: 3 SGD steps an epoch (a step of the setup's ResNet-18 costs most)
    config = ROOT / "configs" / f"synthetic_cls_{method}.yaml"
    code = load_tool("train_cls").main([str(config), "--set", *overrides])
    assert code == 0, capsys.readouterr().err
    run = tmp_path / "runs" / f"run_{method}"
    for name in ("config.yaml", "history.jsonl", "checkpoint_last.pt", "checkpoint_best.pt",
                 "test_metrics.json", "plots/reliability_pre_ts.png",
                 "plots/reliability_post_ts.png", "plots/training_curves.png"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0, 1]
    assert all("val_acc" in h and "val_ece" in h for h in history)
    if method == "cals_alm":
        assert all(len(h["lambda"]) == 10 and len(h["rho"]) == 10 for h in history)
        assert (run / "plots" / "lambda_curves.png").is_file()
    test = json.loads((run / "test_metrics.json").read_text())
    assert test["best_metric"] == "acc"
    acc, n = recomputed_test_accuracy(run)
    assert test["pre_ts"]["acc"] == pytest.approx(acc, abs=1e-12)
    assert test["post_ts"]["acc"] == pytest.approx(acc, abs=1e-12)  # T never changes the argmax
    assert test["pre_ts"]["count"] == n
    counts = test["pre_ts"]["class_counts"]
    assert sorted(counts, reverse=True) == long_tail_counts(10, 101, 2)
    for key in ("pre_ts", "post_ts"):
        block = test[key]
        for metric in ("acc", "ece", "aece", "cwce", "nll"):
            assert 0.0 <= block[metric] <= (100.0 if metric == "nll" else 1.0)
        assert len(block["per_class_acc"]) == 10
        groups = block["groups"]
        assert set(groups) == {"many", "medium", "few"}
        assert sum(g["num_classes"] for g in groups.values()) == 10
        assert sum(g["count"] for g in groups.values()) == 60  # 6 test images x 10 classes
        assert {name: g["classes"] for name, g in groups.items()} == shot_groups(counts)
        assert all(g["ece"] is not None and g["acc"] is not None for g in groups.values())
    out = capsys.readouterr().out
    assert "acc" in out and "many" in out


# ----------------------------------------------------------------------------- paper configs
VISION = ("tinyimagenet_resnet50", "imagenet_resnet50", "imagenet_lt_resnet50")
METHODS = ("ce", "ls", "fl", "mbls", "cals_hr", "cals_alm")


@pytest.mark.parametrize("prefix", VISION + ("20news_gpcn", "synthetic_cls", "synthetic_text"))
def test_configs_exist_with_the_paper_margins(prefix):
    from cals_seg.losses import build_loss

    text = prefix in ("20news_gpcn", "synthetic_text")
    for method in METHODS:
        cfg = load_config(ROOT / "configs" / f"{prefix}_{method}.yaml")
        assert cfg.name == f"{prefix}_{method}" and cfg.loss.name == method
        assert cfg.data.ignore_index == -100 and cfg.train.best_metric == "acc"
        if method in ("mbls", "cals_hr", "cals_alm"):
            assert cfg.loss.params["margin"] == (6.0 if text else 10.0)
        build_loss(cfg.loss.name, cfg.data.num_classes, -100, **cfg.loss.params)


def _split_file_tree(root: Path) -> Path:
    _folder_tree(root, ("n1", "n2"), {"train": 3, "val": 4})
    for split, folder in (("train", "train"), ("val", "val"), ("test", "val")):
        lines = [f"{folder}/n{c + 1}/{i}.png {c}" for c in range(2) for i in range(2)]
        (root / f"ImageNet_LT_{split}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.mark.parametrize("prefix", VISION)
def test_paper_configs_build_on_tiny_trees(tmp_path, prefix):
    if prefix == "tinyimagenet_resnet50":
        root, sizes = _tiny_tree(tmp_path), (12, 6, 9)
    elif prefix == "imagenet_resnet50":
        root, sizes = _folder_tree(tmp_path, ("n1", "n2", "n3"), {"train": 2, "val": 5}), (6, 3, 12)
    else:
        root, sizes = _split_file_tree(tmp_path), (4, 4, 4)
    k = 2 if prefix == "imagenet_lt_resnet50" else 3
    cfg = load_config(ROOT / "configs" / f"{prefix}_cals_alm.yaml", [
        f"data.root={root}", f"data.num_classes={k}", "data.val_per_class=2", "data.image_size=32",
        "data.eval_size=36", "data.num_workers=0",
    ])
    task = build_task(cfg)
    assert (len(task.train_set), len(task.val_set), len(task.test_set)) == sizes
    assert task.family == "classification" and task.ignore_index == -100
    image, label = task.train_set[0]
    assert image.shape == (3, 32, 32) and isinstance(label, int)
    task.model.eval()
    assert task.model(torch.stack([image, task.test_set[0][0]])).shape == (2, k)
    wrong = load_config(ROOT / "configs" / f"{prefix}_ce.yaml", [
        f"data.root={root}", "data.num_classes=5", "data.val_per_class=2"])
    if prefix != "imagenet_lt_resnet50":  # split files carry labels only: K is the config's
        with pytest.raises(ValueError, match="the config says 5"):
            build_task(wrong)
