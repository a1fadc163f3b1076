"""Tests of cals_seg.data: VOC loader, paper split, transforms, synthetic generator."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.data import (
    VOC_CLASSES,
    VOCSegmentation,
    eval_transform,
    paper_split,
    read_split,
    train_transform,
    voc_palette,
)
from cals_seg.data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc, num_classes
from cals_seg.data.transforms import IMAGENET_MEAN, IMAGENET_STD

from .conftest import load_tool

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers / fixtures
def _voc_dirs(root: Path) -> Path:
    voc = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / sub).mkdir(parents=True, exist_ok=True)
    return voc


def _write_pair(voc: Path, sample_id: str, image: np.ndarray, mask: np.ndarray) -> None:
    Image.fromarray(image).save(voc / "JPEGImages" / f"{sample_id}.jpg", quality=95)
    png = Image.fromarray(mask).convert("P")
    png.putpalette(voc_palette().tobytes())
    png.save(voc / "SegmentationClass" / f"{sample_id}.png")


def _write_split(voc: Path, name: str, ids: list[str]) -> None:
    (voc / "ImageSets" / "Segmentation" / f"{name}.txt").write_text("".join(f"{i}\n" for i in ids))


def _masks() -> dict[str, np.ndarray]:
    """Hand-made index masks (H=12, W=10) with object labels, a void outline and label 20."""
    a = np.zeros((12, 10), np.uint8)
    a[3:9, 2:7] = 15  # person: palette colour (192, 128, 128), index 15
    a[2, 1:8] = 255
    a[9, 1:8] = 255
    b = np.full((12, 10), 1, np.uint8)
    b[:, 5:] = 20
    b[6, :] = 255
    return {"2007_000001": a, "2007_000002": b}


@pytest.fixture()
def voc_root(tmp_path: Path) -> Path:
    voc = _voc_dirs(tmp_path)
    rng = np.random.default_rng(0)
    for sample_id, mask in _masks().items():
        _write_pair(voc, sample_id, rng.integers(0, 256, (12, 10, 3), dtype=np.uint8), mask)
    _write_split(voc, "train", list(_masks()))
    _write_split(voc, "val", ["2007_000002"])
    return tmp_path


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- VOC loader
def test_loader_shapes_dtypes_and_palette_indices(voc_root: Path) -> None:
    ds = VOCSegmentation(voc_root, "train")
    assert len(ds) == 2
    for index, (sample_id, expected) in enumerate(_masks().items()):
        sample = ds[index]
        assert sample["id"] == sample_id
        assert sample["image"].shape == (3, 12, 10) and sample["image"].dtype == torch.float32
        assert sample["mask"].shape == (12, 10) and sample["mask"].dtype == torch.int64
        # Palette indices, not colours: 15 stays 15 and void stays 255.
        np.testing.assert_array_equal(sample["mask"].numpy(), expected)
    with Image.open(ds.mask_path("2007_000001")) as png:
        assert png.mode == "P"
    raw = ds.load_image("2007_000001")
    assert raw.dtype == np.uint8 and raw.shape == (12, 10, 3)
    expected_image = (raw / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(ds[0]["image"].permute(1, 2, 0).numpy(), expected_image, atol=1e-5)


def test_loader_accepts_three_roots_and_collates(voc_root: Path) -> None:
    for root in (voc_root, voc_root / "VOCdevkit", voc_root / "VOCdevkit" / "VOC2012"):
        assert VOCSegmentation(root, ["2007_000002"]).ids == ["2007_000002"]
    batch = next(iter(torch.utils.data.DataLoader(VOCSegmentation(voc_root, "train"),
                                                  batch_size=2)))
    assert batch["image"].shape == (2, 3, 12, 10) and batch["mask"].shape == (2, 12, 10)
    assert batch["id"] == list(_masks())


def test_voc_palette_and_classes() -> None:
    palette = voc_palette()
    assert palette.shape == (256, 3) and palette.dtype == np.uint8
    assert palette[0].tolist() == [0, 0, 0] and palette[1].tolist() == [128, 0, 0]
    assert palette[15].tolist() == [192, 128, 128] and palette[255].tolist() == [224, 224, 192]
    assert len(VOC_CLASSES) == 21 and VOC_CLASSES[15] == "person"


# --------------------------------------------------------------------------- validation errors
def test_bad_mask_value_is_reported(voc_root: Path) -> None:
    voc = voc_root / "VOCdevkit" / "VOC2012"
    mask = _masks()["2007_000001"].copy()
    mask[0, 0], mask[0, 1] = 30, 21
    _write_pair(voc, "2007_000001", np.zeros((12, 10, 3), np.uint8), mask)
    ds = VOCSegmentation(voc_root, "train")
    with pytest.raises(ValueError, match=r"2007_000001\.png.*\[21, 30\]"):
        ds[0]
    assert ds[1]["mask"].max() == 255  # other samples still load
    # The same mask is fine when the declared classes cover it.
    assert VOCSegmentation(voc_root, "train", num_classes=31)[0]["mask"][0, 0] == 30


def test_rgb_mask_is_rejected(voc_root: Path) -> None:
    voc = voc_root / "VOCdevkit" / "VOC2012"
    rgb = voc_palette()[_masks()["2007_000001"]]
    Image.fromarray(rgb).save(voc / "SegmentationClass" / "2007_000001.png")
    with pytest.raises(ValueError, match="mode RGB"):
        VOCSegmentation(voc_root, "train")[0]


def test_truncated_jpeg_is_reported(voc_root: Path) -> None:
    voc = voc_root / "VOCdevkit" / "VOC2012"
    path = voc / "JPEGImages" / "2007_000002.jpg"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(
        path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    ds = VOCSegmentation(voc_root, "train")
    with pytest.raises(ValueError, match=r"2007_000002\.jpg.*truncated"):
        ds[1]


def test_size_mismatch_is_reported(voc_root: Path) -> None:
    voc = voc_root / "VOCdevkit" / "VOC2012"
    Image.fromarray(np.zeros((12, 11, 3), np.uint8)).save(voc / "JPEGImages" / "2007_000002.jpg")
    with pytest.raises(ValueError, match=r"11x12.*10x12"):
        VOCSegmentation(voc_root, "train")[1]


def test_missing_split_file_and_missing_files(voc_root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"test\.txt.*not found.*\['train', 'val'\]"):
        read_split(voc_root, "test")
    with pytest.raises(ValueError, match="No VOC layout"):
        VOCSegmentation(tmp_path / "nowhere", "train")
    voc = voc_root / "VOCdevkit" / "VOC2012"
    _write_split(voc, "broken", ["2007_000001", "2007_000009"])
    with pytest.raises(ValueError, match=r"2 image/mask file.*2007_000009\.jpg"):
        VOCSegmentation(voc_root, "broken")
    (voc / "SegmentationClass" / "2007_000001.png").unlink()
    with pytest.raises(ValueError, match=r"2007_000001\.png"):
        VOCSegmentation(voc_root, ["2007_000001"])


# --------------------------------------------------------------------------- paper split
def test_paper_split_sizes_and_determinism(tmp_path: Path) -> None:
    voc = _voc_dirs(tmp_path)
    train_ids = [f"2008_{i:06d}" for i in range(1464)]
    _write_split(voc, "train", train_ids)
    _write_split(voc, "val", [f"2009_{i:06d}" for i in range(1449)])
    split = paper_split(tmp_path)
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == (1171, 293, 1449)
    assert not set(split["train"]) & set(split["val"])
    assert sorted(split["train"] + split["val"]) == train_ids
    assert split["train"] == sorted(split["train"])  # file order kept
    assert paper_split(tmp_path / "VOCdevkit", seed=0) == split
    assert paper_split(tmp_path, seed=1)["val"] != split["val"]
    with pytest.raises(ValueError, match="val_fraction"):
        paper_split(tmp_path, val_fraction=1.0)


# --------------------------------------------------------------------------- transforms
def test_train_transform_never_invents_labels_and_pads_with_void() -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    mask = rng.choice(np.array([0, 3, 7, 255], np.uint8), size=(30, 40))
    transform = train_transform(48, scale_range=(0.5, 2.0))
    for _ in range(20):
        out = transform(image=image, mask=mask)
        assert out["image"].shape == (3, 48, 48) and out["image"].dtype == torch.float32
        assert out["mask"].shape == (48, 48) and out["mask"].dtype == torch.int64
        assert set(out["mask"].unique().tolist()) <= {0, 3, 7, 255}

    # No scaling: the 30x40 image is padded to 48x48; the padding is void and black.
    plain = np.ones((30, 40), np.uint8)
    out = train_transform(48, scale_range=(1.0, 1.0), hflip=False, color_jitter=False)(
        image=image, mask=plain)
    pad = out["mask"] == 255
    assert int(pad.sum()) == 48 * 48 - 30 * 40 and int((out["mask"] == 1).sum()) == 30 * 40
    black = -torch.tensor(IMAGENET_MEAN) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(out["image"][:, pad].T, black.expand(int(pad.sum()), 3))


def test_eval_transform_fixed_shape_and_void_padding() -> None:
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    mask = rng.choice(np.array([0, 5, 255], np.uint8), size=(30, 40))
    out = eval_transform(48)(image=image, mask=mask)  # pad only, at the bottom/right
    assert out["mask"].shape == (48, 48) and out["image"].shape == (3, 48, 48)
    np.testing.assert_array_equal(out["mask"][:30, :40].numpy(), mask)
    assert (out["mask"][30:] == 255).all() and (out["mask"][:, 40:] == 255).all()
    for transform in (eval_transform(20), eval_transform(48, upscale=True)):
        out = transform(image=image, mask=mask)  # resized long side (nearest for the mask)
        assert out["mask"].shape == out["image"].shape[1:] == (transform_size := out["mask"].shape)
        assert transform_size[0] == transform_size[1]
        assert set(out["mask"].unique().tolist()) <= {0, 5, 255}
    out = eval_transform(None)(image=image, mask=mask)
    np.testing.assert_array_equal(out["mask"].numpy(), mask)


# --------------------------------------------------------------------------- synthetic dataset
def test_synthetic_generator_is_deterministic_and_voc_readable(tmp_path: Path) -> None:
    kwargs = {"num_train": 4, "num_test": 2, "image_size": 32, "seed": 3}
    first = generate_synthetic_voc(tmp_path / "a", **kwargs)
    second = generate_synthetic_voc(tmp_path / "b", **kwargs)
    assert _digest(first) == _digest(second)
    other = generate_synthetic_voc(tmp_path / "c", **{**kwargs, "seed": 4})
    assert _digest(other) != _digest(first)

    assert len(SYNTHETIC_CLASSES) == num_classes == 11
    split = paper_split(first)
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == (3, 1, 2)
    ds = VOCSegmentation(first, "trainval", num_classes=num_classes)
    for sample in ds:
        mask = sample["mask"].numpy()
        assert sample["image"].shape == (3, 32, 32) and mask.shape == (32, 32)
        # Void borders: two different labels are never 4-neighbours.
        for a, b in ((mask[:, 1:], mask[:, :-1]), (mask[1:], mask[:-1])):
            assert not ((a != b) & (a != 255) & (b != 255)).any()
    with Image.open(ds.mask_path(ds.ids[0])) as png:
        assert png.getpalette()[:6] == [0, 0, 0, 128, 0, 0]


def test_synthetic_reuse_and_overwrite(tmp_path: Path) -> None:
    root = generate_synthetic_voc(tmp_path, num_train=2, num_test=1, image_size=32)
    stamp = _digest(root)
    assert generate_synthetic_voc(tmp_path, num_train=2, num_test=1, image_size=32) == root
    assert _digest(root) == stamp
    with pytest.raises(ValueError, match="num_train=2 on disk vs 3.*--overwrite"):
        generate_synthetic_voc(tmp_path, num_train=3, num_test=1, image_size=32)
    generate_synthetic_voc(tmp_path, num_train=3, num_test=1, image_size=32, overwrite=True)
    assert len(read_split(root, "train")) == 3


def test_make_synthetic_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = load_tool("make_synthetic")
    root = module.main(["--root", str(tmp_path), "--num-train", "5", "--num-test", "2",
                        "--image-size", "32", "--seed", "1"])
    assert "4 train / 1 val / 2 test" in capsys.readouterr().out
    assert len(read_split(root, "val")) == 2
