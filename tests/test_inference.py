"""The logits path at each image's own resolution (cals_seg.evaluation.inference), the eval.*
protocol keys,
and eval_seg on a split of mixed sizes."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from cals_seg.config.checks import check_config
from cals_seg.config.schema import ConfigError, load_config
from cals_seg.data import eval_transform, voc_palette
from cals_seg.evaluation.inference import (
    EvalProtocol,
    calibrated_outputs,
    predict_image,
    segment_logits,
)
from cals_seg.tasks import build_task
from cals_seg.tasks.segmentation import eval_protocol

from .conftest import fake_run, figures_undrawn, load_tool

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"


def _net(pointwise: bool = False, k: int = 5) -> nn.Module:
    torch.manual_seed(0)
    size = 1 if pointwise else 3
    return nn.Sequential(nn.Conv2d(3, 8, size, padding=size // 2), nn.ReLU(),
                         nn.Conv2d(8, k, size, padding=size // 2)).eval()


# --------------------------------------------------------------------------- the logits path
def test_default_protocol_is_the_plain_forward_pass():
    net, x = _net(), torch.randn(2, 3, 24, 40)
    assert torch.equal(segment_logits(net, x), net(x))


def test_slide_equals_whole_when_the_window_covers_the_image():
    net, x = _net(), torch.randn(1, 3, 37, 53)
    whole = segment_logits(net, x, EvalProtocol(multiple=8))
    for window in (53, 64, 512):
        slide = segment_logits(net, x, EvalProtocol(mode="slide", window=window, stride=window,
                                                    multiple=8))
        assert torch.equal(slide, whole), window


def test_slide_averages_overlapping_tiles_at_the_image_size():
    # a pointwise network gives every tile the whole image's logits, so any tiling agrees
    net, x = _net(pointwise=True), torch.randn(2, 3, 50, 70)
    whole = segment_logits(net, x)
    for window, stride, batch in ((16, 16, 3), (16, 5, 8), (32, 20, 1)):
        p = EvalProtocol(mode="slide", window=window, stride=stride, tile_batch=batch)
        torch.testing.assert_close(segment_logits(net, x, p), whole, rtol=1e-5, atol=1e-6)
    # a 3x3 network sees the tile borders: close, not equal, and the right shape
    net = _net()
    slide = segment_logits(net, x, EvalProtocol(mode="slide", window=24, stride=16))
    assert slide.shape == (2, 5, 50, 70) and slide.isfinite().all()


def test_resize_and_pad_give_logits_at_the_original_size():
    net, x = _net(), torch.randn(1, 3, 90, 120)
    out = segment_logits(net, x, EvalProtocol(resize=40, pad=48, multiple=8))
    assert out.shape == (1, 5, 90, 120)
    # resize: the network sees 30 x 40; the logits are upsampled bilinearly before any softmax
    small = torch.nn.functional.interpolate(x, size=(30, 40), mode="bilinear",
                                            align_corners=False, antialias=True)
    fill = (-torch.tensor([0.485, 0.456, 0.406]) / torch.tensor([0.229, 0.224, 0.225]))
    padded = fill.view(1, 3, 1, 1).expand(1, 3, 48, 48).clone()
    padded[..., :30, :40] = small
    ref = torch.nn.functional.interpolate(net(padded)[..., :30, :40], size=(90, 120),
                                          mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, ref)


def test_padding_to_the_network_multiple_is_cropped_off():
    net, x = _net(), torch.randn(1, 3, 37, 53)
    out = segment_logits(net, x, EvalProtocol(multiple=16))
    assert out.shape == (1, 5, 37, 53)
    fill = (-torch.tensor([0.485, 0.456, 0.406]) / torch.tensor([0.229, 0.224, 0.225]))
    padded = fill.view(1, 3, 1, 1).expand(1, 3, 48, 64).clone()
    padded[..., :37, :53] = x
    torch.testing.assert_close(out, net(padded)[..., :37, :53])


def test_calibrated_outputs_are_the_softmax_of_scaled_logits():
    logits = torch.randn(2, 5, 300, 7) * 4  # more rows than one band of the row loop
    out = calibrated_outputs(logits, temperature=1.7, return_probs=True)
    p = torch.softmax(logits / 1.7, dim=1)
    torch.testing.assert_close(out.probs, p)
    torch.testing.assert_close(out.confidence, p.max(dim=1).values)
    assert torch.equal(out.label, (logits / 1.7).argmax(dim=1))
    torch.testing.assert_close(out.entropy, -(p * p.log()).sum(dim=1))
    with pytest.raises(ValueError, match="positive temperature"):
        calibrated_outputs(logits, 0.0)


def test_predict_image_uses_the_evaluation_normalisation_and_path():
    net = _net()
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (21, 34, 3), dtype=np.uint8)
    x = eval_transform(None)(image=image, mask=np.zeros((21, 34), np.uint8))["image"][None]
    protocol = EvalProtocol(mode="slide", window=16, stride=8, multiple=4)
    got = predict_image(net, image, temperature=2.0, protocol=protocol)
    ref = calibrated_outputs(segment_logits(net, x, protocol), 2.0)
    assert torch.equal(got.confidence, ref.confidence) and torch.equal(got.label, ref.label)
    assert got.confidence.shape == (1, 21, 34)
    batch = predict_image(net, np.stack([image, image]), protocol=protocol)
    assert batch.label.shape == (2, 21, 34)
    with pytest.raises(ValueError, match="uint8 RGB"):
        predict_image(net, image.astype(np.float32))


def test_large_or_tiled_batches_are_evaluated_one_image_at_a_time(monkeypatch):
    from torch.utils.data import DataLoader, TensorDataset

    from cals_seg.evaluation import stream as evaluation

    net = _net()
    data = TensorDataset(torch.randn(4, 3, 20, 30), torch.randint(0, 5, (4, 20, 30)))
    loader = DataLoader(data, batch_size=4)
    cpu = torch.device("cpu")
    whole = list(evaluation.predict(net, loader, cpu, protocol=EvalProtocol()))
    assert [len(t) for _, t in whole] == [4]
    slide = list(evaluation.predict(net, loader, cpu, protocol=EvalProtocol(
        mode="slide", window=30, stride=30)))
    assert [len(t) for _, t in slide] == [1, 1, 1, 1]
    torch.testing.assert_close(torch.cat([x for x, _ in slide]), whole[0][0])
    monkeypatch.setattr(evaluation, "ONE_AT_A_TIME_PIXELS", 500)  # 20 x 30 is "large" now
    assert [len(t) for _, t in evaluation.predict(net, loader, cpu,
                                                  protocol=EvalProtocol())] == [1, 1, 1, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_slide_on_cuda_matches_the_cpu():
    net, x = _net(), torch.randn(2, 3, 70, 90)
    protocol = EvalProtocol(mode="slide", window=32, stride=20, resize=60)
    cpu = segment_logits(net, x, protocol)
    gpu = segment_logits(net.cuda(), x.cuda(), protocol)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-2, atol=1e-2)  # TF32 convolutions
    out = predict_image(net, np.zeros((20, 30, 3), np.uint8), 1.5, protocol)
    assert out.confidence.device.type == "cuda" and out.label.shape == (1, 20, 30)


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "tiles"}, r"`mode`: expected one of \['whole', 'slide'\], got 'tiles'"),
    ({"window": 0}, "`window`: expected an integer >= 1, got 0"),
    ({"stride": 600}, r"`stride`: expected an integer in \[1, `window`\] = \[1, 512\]"),
    ({"resize": 0}, "`resize`: expected an integer >= 1"),
])
def test_protocol_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalProtocol(**kwargs)


# --------------------------------------------------------------------------- config keys
@pytest.mark.parametrize("override, match", [
    ("eval.mode=tiles", r"eval.mode: expected 'whole' or 'slide', got 'tiles'; e.g. "
                        r"--set eval.mode=slide"),
    ("eval.window=0", r"eval.window: expected an integer in \[1, 16384\], got 0; e.g. --set "
                      r"eval.window="),
    ("eval.stride=600", r"eval.stride: expected an integer in \[1, eval.window\] = \[1, 512\] "
                        r".*got 600; .*--set eval.stride=341"),
    ("eval.stride=0", r"eval.stride: .*got 0"),
    ("eval.resize=0", r"eval.resize: expected an integer in \[1, 16384\] or null, got 0; or "
                      r"null"),
])
def test_bad_protocol_keys_name_the_key_and_the_fix(override, match):
    cfg = load_config(SETUP, [override], "ce")
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


def test_eval_size_is_refused_where_the_protocol_is_built():
    cfg = load_config(SETUP, ["data.eval_size=512"], "ce")
    with pytest.raises(ConfigError, match=r"data.eval_size: 512 would shrink the masks.*eval.pad"):
        eval_protocol(cfg, None)


def test_voc_config_keeps_the_paper_padding():
    cfg = load_config(ROOT / "configs" / "voc_deeplabv3.yaml", [], "ce")
    check_config(cfg)
    assert cfg.data.eval_size is None and cfg.eval.pad == 512 and cfg.eval.mode == "whole"


# --------------------------------------------------------------------------- eval_seg, mixed sizes
TEST_SIZES = [(96, 96), (500, 375), (1200, 900), (96, 96)]  # (width, height)
# The same mix for eval_seg, smaller: one multiple of the output stride, two that are not (one
# of them the largest), sizes that differ within a batch of 4 (a ragged batch, image by image).
EVAL_SIZES = [(96, 96), (200, 150), (300, 225), (96, 96)]


def _mixed_tree(root: Path, test_sizes: list[tuple[int, int]] = TEST_SIZES) -> int:
    """A VOC tree whose test split (val.txt) mixes sizes (``test_sizes``, width x height);
    returns its non-void pixel count."""
    base = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    valid = 0
    splits = {"train": [(32, 32)] * 5, "val": test_sizes}
    for split, sizes in splits.items():
        ids = [f"{split}_{i}" for i in range(len(sizes))]
        for sample_id, (w, h) in zip(ids, sizes, strict=True):
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
                base / "JPEGImages" / f"{sample_id}.jpg")
            mask = rng.integers(0, 11, (h // 8 + 1, w // 8 + 1)).astype(np.uint8)
            mask = np.kron(mask, np.ones((8, 8), np.uint8))[:h, :w]
            mask[rng.random((h, w)) < 0.1] = 255
            if split == "val":
                valid += int((mask != 255).sum())
            png = Image.fromarray(mask).convert("P")
            png.putpalette(voc_palette().tobytes())
            png.save(base / "SegmentationClass" / f"{sample_id}.png")
        (base / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
    return valid


@pytest.mark.filterwarnings("ignore:The validation NLL is minimal at the search boundary")
def test_eval_seg_on_mixed_sizes_is_batch_size_invariant_on_original_pixels(tmp_path):
    valid = _mixed_tree(tmp_path / "voc", EVAL_SIZES)
    sets = [f"data.root={tmp_path / 'voc'}", "data.name=voc", "train.amp=none",
            "train.threads=1", "train.progress=false",
            "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(SETUP, sets, "ce")
    run = fake_run(tmp_path / "run", cfg)
    results = []
    for batch in (1, 4):
        out = tmp_path / f"eval_b{batch}"
        # the figures of batch 4 are those of batch 1 (drawn there): saved undrawn
        with figures_undrawn() if batch == 4 else contextlib.nullcontext():
            rc = load_tool("eval_seg").main([
                str(SETUP), "--method", "ce", "--checkpoint", str(run / "checkpoint_best.pt"),
                "--out", str(out), "--num-maps", "1", "--set", *sets,
                f"eval.batch_size={batch}"])
        assert rc == 0
        results.append(json.loads((out / "metrics.json").read_text()))
    one, four = results
    assert one["temperature"] == four["temperature"]
    for key in ("pre_ts", "post_ts"):
        assert one[key] == four[key], key
        assert one[key]["count"] == valid and one[key]["num_images"] == len(EVAL_SIZES)
    # the calibration map of the first image is drawn at its own size
    assert (tmp_path / "eval_b1" / "maps" / "val_0.png").is_file()


def test_mixed_sizes_feed_original_masks_to_the_meters(tmp_path):
    valid = _mixed_tree(tmp_path / "voc")
    cfg = load_config(SETUP, [f"data.root={tmp_path / 'voc'}", "data.name=voc",
                              "eval.mode=slide", "eval.window=256", "eval.stride=200",
                              "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"],
                      "ce")
    task = build_task(cfg)
    from cals_seg.evaluation.stream import predict
    from cals_seg.training.engine import make_loader

    sizes, count = [], 0
    loader = make_loader(task.test_set, 3, False)
    for logits, target in predict(task.model, loader, torch.device("cpu"),
                                  protocol=task.protocol):
        assert logits.shape[-2:] == target.shape[-2:]
        sizes += [tuple(target.shape[-2:])] * len(target)
        count += int((target != 255).sum())
    assert sizes == [(h, w) for w, h in TEST_SIZES] and count == valid
