"""Tests for the plotting helpers: each writes a readable PNG of a sensible size."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from cals_seg.visualization import plotting
from cals_seg.visualization.plotting import (
    plot_calibration_map,
    plot_multiplier_curves,
    plot_reliability_diagram,
    plot_reliability_grid,
    plot_training_curves,
    voc_palette,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path, min_side: int = 200, max_side: int = 4000) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    pixels = imread(path)
    h, w = pixels.shape[:2]
    assert min_side <= h <= max_side and min_side <= w <= max_side
    assert pixels.std() > 0  # not a blank canvas
    return pixels


def _reliability(n_bins: int = 15, empty: tuple[int, ...] = (0, 1, 2)) -> dict:
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    count = np.array([10 ** (b % 7) for b in range(n_bins)])
    count[list(empty)] = 0
    conf = np.where(count > 0, (edges[:-1] + edges[1:]) / 2, 0.0)
    acc = np.where(count > 0, 0.9 * conf, 0.0)
    return {
        "bin_edges": edges.tolist(),
        "count": count.tolist(),
        "confidence": conf.tolist(),
        "accuracy": acc.tolist(),
    }


def _history(epochs: int = 6, k: int = 8, cals: bool = True) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for e in range(epochs):
        entry = {"epoch": e, "train_loss": 1.0 / (e + 1), "val_ece": 0.1 - 0.01 * e}
        entry |= {"train_penalty": -0.01, "train_images_per_s": 900.0, "train_time": 3.0}
        entry["val_miou"] = 0.1 * e
        if cals:
            entry["lambda"] = (10.0 ** rng.uniform(-6, 1, k)).tolist()
            entry["rho"] = np.full(k, 1.0 + 0.1 * e).tolist()
        out.append(entry)
    return out


def test_voc_palette():
    pal = voc_palette()
    assert pal.shape == (256, 3) and pal.dtype == np.uint8
    assert pal[0].tolist() == [0, 0, 0]
    assert pal[1].tolist() == [128, 0, 0]
    assert pal[15].tolist() == [192, 128, 128]  # person
    assert pal[255].tolist() == [224, 224, 192]  # void
    assert len({tuple(c) for c in pal}) == 256


def test_reliability_diagram_with_empty_bins(tmp_path):
    rel = _reliability()
    path = tmp_path / "sub" / "rel.png"
    shown = plot_reliability_diagram(rel, path, title="test")
    _check_png(path)
    # the numbers drawn on the figure, recomputed bin by bin
    n = sum(rel["count"])
    ece = sum(c * abs(a - f) for c, a, f in zip(rel["count"], rel["accuracy"],
                                                rel["confidence"], strict=True)) / n
    acc = sum(c * a for c, a in zip(rel["count"], rel["accuracy"], strict=True)) / n
    conf = sum(c * f for c, f in zip(rel["count"], rel["confidence"], strict=True)) / n
    assert shown["ece"] == pytest.approx(ece, rel=1e-12)
    assert shown["accuracy"] == pytest.approx(acc, rel=1e-12)
    assert shown["confidence"] == pytest.approx(conf, rel=1e-12)
    assert plot_reliability_diagram(rel, path, ece=0.05)["ece"] == 0.05  # a given ECE wins


def test_reliability_diagram_all_empty_and_rejects_bad_dicts(tmp_path):
    empty = _reliability(n_bins=10, empty=tuple(range(10)))
    plot_reliability_diagram(empty, tmp_path / "empty.png")
    _check_png(tmp_path / "empty.png")
    bad = _reliability()
    del bad["count"]
    with pytest.raises(ValueError, match="count"):
        plot_reliability_diagram(bad, tmp_path / "bad.png")
    bad = _reliability()
    bad["accuracy"] = bad["accuracy"][:-1]
    with pytest.raises(ValueError, match="accuracy"):
        plot_reliability_diagram(bad, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_ece_from_bins_matches_definition():
    rel = _reliability()
    arr = plotting._check_reliability(rel)
    count = np.asarray(rel["count"], dtype=float)
    gap = np.abs(np.asarray(rel["accuracy"]) - np.asarray(rel["confidence"]))
    assert plotting._ece(arr) == pytest.approx((count * gap).sum() / count.sum())


def test_reliability_grid(tmp_path):
    items = [(f"method {i}", _reliability(empty=(i,))) for i in range(5)]
    plot_reliability_grid(items, tmp_path / "grid.png", ncols=3)
    pixels = _check_png(tmp_path / "grid.png")
    assert pixels.shape[1] > pixels.shape[0]  # 3 wide x 2 high
    with pytest.raises(ValueError):
        plot_reliability_grid([], tmp_path / "none.png")


def test_multiplier_curves(tmp_path):
    history = _history(k=12)
    names = [f"name{c}" for c in range(12)]
    assert plot_multiplier_curves(history, tmp_path / "lam.png", class_names=names, top=3)
    _check_png(tmp_path / "lam.png")
    # Fewer classes than 2 * top, no rho (CALS-HR), a CE epoch in between.
    hr = [{"epoch": 0}, *({"epoch": e, "lambda": [1.0, 2.0, 3.0]} for e in (1, 2))]
    assert plot_multiplier_curves(hr, tmp_path / "hr.png", top=5)
    _check_png(tmp_path / "hr.png")
    with pytest.raises(ValueError, match="class_names"):
        plot_multiplier_curves(history, tmp_path / "x.png", class_names=["a"])


def test_multiplier_curves_without_lambda_writes_nothing(tmp_path):
    path = tmp_path / "lam.png"
    assert plot_multiplier_curves(_history(cals=False), path) is False
    assert plot_multiplier_curves([], path) is False
    assert not path.exists()


def test_training_curves(tmp_path):
    history = _history(cals=False)
    assert set(plotting._train_terms(history[0], "train_")) == {"train_loss", "train_penalty"}
    assert plot_training_curves(history, tmp_path / "curves.png", keys=("val_ece", "absent"))
    _check_png(tmp_path / "curves.png")
    assert not plot_training_curves([{"epoch": 0}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def _map_inputs(h: int = 48, w: int = 64):
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    target = rng.integers(0, 21, (h, w))
    target[:3] = 255
    pred = np.where(rng.random((h, w)) < 0.8, np.where(target == 255, 0, target), 3)
    conf = rng.random((h, w))
    return image, target, pred, conf


def test_calibration_map(tmp_path):
    image, target, pred, conf = _map_inputs()
    shown = plot_calibration_map(image, target, pred, conf, tmp_path / "map.png", title="img 0")
    pixels = _check_png(tmp_path / "map.png")
    assert pixels.shape[1] > 3 * pixels.shape[0]  # six panels side by side
    valid = wrong = 0
    conf_sum = 0.0
    for i in range(target.shape[0]):  # loop reference of the numbers shown in the titles
        for j in range(target.shape[1]):
            if target[i, j] == 255:
                continue
            valid += 1
            if pred[i, j] != target[i, j]:
                wrong += 1
                conf_sum += conf[i, j]
    assert shown["valid"] == valid == 45 * 64
    assert shown["error_rate"] == pytest.approx(wrong / valid, rel=1e-12)
    assert shown["mean_confidence_on_errors"] == pytest.approx(conf_sum / wrong, rel=1e-12)
    # Tensors, a custom palette, class names and another ignore_index are accepted.
    names = [f"c{i}" for i in range(21)]
    target_t = torch.from_numpy(np.where(target == 255, -1, target))
    plot_calibration_map(
        torch.from_numpy(image), target_t, torch.from_numpy(pred), torch.from_numpy(conf),
        tmp_path / "map2.png", class_names=names, ignore_index=-1,
        palette=np.zeros((256, 3), np.uint8),
    )  # fmt: skip
    _check_png(tmp_path / "map2.png")


@pytest.mark.parametrize("which", ["image", "target", "pred", "confidence", "dtype", "range"])
def test_calibration_map_rejects_bad_inputs(tmp_path, which):
    image, target, pred, conf = _map_inputs()
    if which == "image":
        image = image[..., :2]
    elif which == "target":
        target = target[:-1]
    elif which == "pred":
        pred = pred.T
    elif which == "confidence":
        conf = conf[:, :-1]
    elif which == "dtype":
        image = image.astype(np.float32)
    else:
        conf = conf + 1.5
    with pytest.raises(ValueError):
        plot_calibration_map(image, target, pred, conf, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_no_pyplot_state(tmp_path):
    plot_reliability_diagram(_reliability(), tmp_path / "r.png")
    if "matplotlib.pyplot" in sys.modules:  # another test module may have imported it
        assert sys.modules["matplotlib.pyplot"].get_fignums() == []
