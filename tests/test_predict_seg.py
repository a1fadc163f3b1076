"""tools/predict_seg.py: calibrated maps of unlabelled images from a run directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from cals_seg.config.schema import load_config
from cals_seg.tasks.segmentation import build_model

from .conftest import UNTRAINED_T, copy_run, fake_run, load_tool

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "configs" / "synthetic_deeplabv3.yaml"
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
T_RUN = UNTRAINED_T
STEP = 1 / 65535  # the storage precision of the 16-bit PNGs


@pytest.fixture(scope="module")
def run_dir(untrained_run, tmp_path_factory) -> Path:
    """A copy of the session's run directory with a random-weight model, its config.yaml and a
    fitted temperature (T_RUN): predict_seg saves its far-from-validation reference into it."""
    return copy_run(untrained_run, tmp_path_factory.mktemp("predict"))


@pytest.fixture()
def inputs(tmp_path) -> Path:
    """a.jpg (64 x 48), b.png (53 x 37, not a multiple of the stride), bad.jpg, c.jpg."""
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(folder / "a.jpg")
    Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).save(folder / "b.png")
    (folder / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(folder / "c.jpg")
    return folder


def _reference(run: Path, image_path: Path, temperature: float):
    """softmax(model(x) / T) with a plain forward pass and numpy normalisation."""
    cfg = load_config(run / "config.yaml")
    model = build_model(cfg).eval()
    model.load_state_dict(torch.load(run / "checkpoint_best.pt")["model"])
    pixels = np.asarray(Image.open(image_path).convert("RGB"), dtype=np.float32) / 255
    x = torch.from_numpy(((pixels - MEAN) / STD).astype(np.float32)).permute(2, 0, 1)[None]
    with torch.no_grad():
        p = torch.softmax(model(x) / temperature, dim=1)[0]
    return p.max(dim=0).values.numpy(), p.argmax(dim=0).numpy(), -(p * p.log()).sum(0).numpy()


def _read16(path: Path) -> np.ndarray:
    array = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert array.dtype == np.uint16
    return array / 65535


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]


def test_writes_every_output_and_names_the_unreadable_file(run_dir, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = load_tool("predict_seg").main([str(run_dir), str(inputs), "--out", str(out),
                                        "--threshold", "0.3", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "bad.jpg" in err and "cannot read" in err
    for name, (h, w) in (("a", (48, 64)), ("b", (37, 53)), ("c", (40, 40))):
        for kind in ("label", "confidence", "entropy", "overlay"):
            assert (out / f"{name}_{kind}.png").is_file(), (name, kind)
        label = Image.open(out / f"{name}_label.png")
        assert label.mode == "P" and label.size == (w, h)
        assert Image.open(out / f"{name}_overlay.png").size == (w, h)
    assert not list(out.glob("bad_*"))
    lines = {Path(x["input"]).name: x for x in _lines(out)}
    assert set(lines) == {"a.jpg", "b.png", "bad.jpg", "c.jpg"} and "error" in lines["bad.jpg"]

    # the saved confidence is softmax(logits / T) of the run's temperature, to 16-bit precision
    conf, label, entropy = _reference(run_dir, inputs / "a.jpg", T_RUN)
    saved = _read16(out / "a_confidence.png")
    assert np.abs(saved - conf).max() <= STEP
    assert (np.asarray(Image.open(out / "a_label.png")) == label).mean() > 0.999
    assert np.abs(_read16(out / "a_entropy.png") * math.log(11) - entropy).max() <= STEP * 3
    a = lines["a.jpg"]
    assert a["temperature"] == T_RUN and (a["height"], a["width"]) == (48, 64)
    assert a["mean_confidence"] == pytest.approx(conf.mean(), abs=1e-5)
    assert a["low_confidence_fraction"] == pytest.approx((conf < 0.3).mean(), abs=1e-3)
    assert sum(a["class_areas"].values()) == pytest.approx(1.0)
    assert set(a["outputs"]) == {"label", "confidence", "entropy", "overlay"}


def test_temperature_one_is_honoured(run_dir, inputs, tmp_path):
    out = tmp_path / "out"
    rc = load_tool("predict_seg").main([str(run_dir / "checkpoint_best.pt"),
                                        str(inputs / "a.jpg"), "--out", str(out),
                                        "--temperature", "1", "--no-progress"])
    assert rc == 0
    conf, _, _ = _reference(run_dir, inputs / "a.jpg", 1.0)
    assert np.abs(_read16(out / "a_confidence.png") - conf).max() <= STEP
    calibrated, _, _ = _reference(run_dir, inputs / "a.jpg", T_RUN)
    assert np.abs(calibrated - conf).max() > 10 * STEP  # the check can tell them apart
    assert _lines(out)[0]["temperature"] == 1.0


def test_calibrator_boundary_ts_gives_the_confidence_maps(run_dir, tmp_path, capsys):
    """--calibrator boundary_ts: the saved confidence is the softmax maximum of the logits
    divided by the temperature of each pixel's predicted band (bands by a brute-force loop)."""
    import shutil

    from cals_seg.calibrators import build_calibrator, calibrator_key, save_calibrator
    from cals_seg.runs.run import load_run

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run_dir / "config.yaml", run / "config.yaml")
    cfg = load_config(run / "config.yaml")
    model = build_model(cfg).eval()
    model.load_state_dict(torch.load(run_dir / "checkpoint_best.pt")["model"])
    with torch.no_grad():  # a head that predicts several classes, so that there are boundaries
        torch.manual_seed(0)
        model.segmentation_head[0].weight.normal_(0, 3)
        model.segmentation_head[0].bias.zero_()
    fake_run(run, cfg, epoch=None, model=model)
    pixels = np.zeros((96, 96, 3), dtype=np.uint8)
    pixels[30:70, 20:60] = 230
    pixels[:, 80:] = 120
    Image.fromarray(pixels).save(tmp_path / "a.png")
    out = tmp_path / "out"
    args = [str(run), str(tmp_path / "a.png"), "--out", str(out), "--no-progress"]
    assert load_tool("predict_seg").main([*args, "--calibrator", "dirichlet"]) == 2
    assert "--calibrators dirichlet" in capsys.readouterr().err
    cal = build_calibrator("boundary_ts", 11, bands=(2.0, 5.0))
    cal.temperatures.copy_(torch.tensor([3.0, 0.5, 1.5]))  # far apart: a wrong band shows
    save_calibrator(cal, run / "calibrators" / "boundary_ts.pt")  # no record: refused
    assert load_tool("predict_seg").main([*args, "--calibrator", "boundary_ts"]) == 2
    assert "records nothing of what it was fitted for" in capsys.readouterr().err
    record = calibrator_key(load_run(run, family="segmentation"), "boundary_ts").record()
    save_calibrator(cal, run / "calibrators" / "boundary_ts.pt", fitted_for=record)
    assert load_tool("predict_seg").main([*args, "--calibrator", "boundary_ts"]) == 0

    x = torch.from_numpy(((pixels / 255 - MEAN) / STD).astype(np.float32)).permute(2, 0, 1)[None]
    with torch.no_grad():
        logits = model(x)[0]
    pred = logits.argmax(dim=0).numpy()
    h, w = pred.shape
    boundary = np.zeros((h, w), dtype=bool)
    for i in range(h):
        for j in range(w):
            boundary[i, j] = bool((pred[max(i - 1, 0):i + 2, max(j - 1, 0):j + 2] != pred[i, j]
                                   ).any())
    bi, bj = np.nonzero(boundary)
    ii, jj = np.mgrid[:h, :w]
    d2 = ((ii[..., None] - bi) ** 2 + (jj[..., None] - bj) ** 2).min(axis=-1)
    band = np.where(d2 < 4, 0, np.where(d2 < 25, 1, 2))
    assert set(np.unique(band).tolist()) == {0, 1, 2}
    t = torch.tensor([3.0, 0.5, 1.5])[torch.from_numpy(band)]
    conf = torch.softmax(logits / t, dim=0).max(dim=0).values.numpy()
    assert np.abs(_read16(out / "a_confidence.png") - conf).max() <= STEP
    plain = torch.softmax(logits, dim=0).max(dim=0).values.numpy()
    assert np.abs(plain - conf).max() > 10 * STEP  # the check can tell them apart
    assert _lines(out)[0]["calibrator"] == "boundary_ts"


def test_strict_stops_at_the_unreadable_file(run_dir, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = load_tool("predict_seg").main([str(run_dir), str(inputs), "--out", str(out),
                                        "--strict", "--no-progress"])
    assert rc == 2 and "bad.jpg" in capsys.readouterr().err
    assert (out / "b_confidence.png").is_file() and not (out / "c_confidence.png").exists()


def test_slide_options_and_their_errors(run_dir, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    rc = load_tool("predict_seg").main([str(run_dir), str(inputs / "a.jpg"),
                                        str(inputs / "b.png"), "--out", str(out), "--mode",
                                        "slide", "--window", "32", "--stride", "16",
                                        "--no-progress"])
    assert rc == 0
    assert cv2.imread(str(out / "b_confidence.png"), cv2.IMREAD_UNCHANGED).shape == (37, 53)
    rc = load_tool("predict_seg").main([str(run_dir), str(inputs), "--out", str(out),
                                        "--mode", "slide", "--window", "32", "--stride", "64"])
    assert rc == 2 and "eval.stride" in capsys.readouterr().err
    rc = load_tool("predict_seg").main([str(run_dir.parent / "nothing"), str(inputs),
                                        "--out", str(out)])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_a_4000x3000_photo_gets_every_output_at_its_size(run_dir, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(1)
    coarse = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    cv2.imwrite(str(folder / "photo.jpg"), cv2.resize(coarse, (4000, 3000)))
    out = tmp_path / "out"
    rc = load_tool("predict_seg").main([str(run_dir), str(folder), "--out", str(out),
                                        "--resize", "256", "--no-progress"])
    assert rc == 0
    for kind in ("label", "confidence", "entropy", "overlay"):
        assert Image.open(out / f"photo_{kind}.png").size == (4000, 3000), kind
    (line,) = _lines(out)
    assert (line["width"], line["height"]) == (4000, 3000) and line["seconds"] > 0


def test_label_pngs_use_the_dataset_palette():
    from cals_seg.data.voc import voc_palette
    from cals_seg.evaluation.predict import label_palette

    colours = [[1, 2, 3], [250, 0, 7]]
    palette = label_palette(colours)
    assert palette.shape == (256, 3) and palette.dtype.name == "uint8"
    assert palette[:2].tolist() == colours
    assert (palette[2:] == voc_palette()[2:]).all()
    assert (label_palette(None) == voc_palette()).all()


def test_finiteness_check_flags_every_non_finite_value():
    """FiniteLogits (every evaluation pass and predict_seg's photos) checks logits with one
    min/max pass (inference.all_finite): a NaN or an infinity at the first, a middle or the last
    position is found in every float type; extreme finite values and an empty batch pass."""
    from cals_seg.evaluation.inference import FiniteLogits, NonFiniteLogitsError, all_finite

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        big = torch.finfo(dtype).max
        clean = torch.zeros(2, 3, 17, 19, dtype=dtype)
        clean[0, 1, 2, 3], clean[1, 2, 4, 5] = big, -big
        assert bool(all_finite(clean)) and bool(torch.isfinite(clean).all())
        FiniteLogits(defer=False).observe(clean)
        for position in (0, clean.numel() // 2 + 1, clean.numel() - 1):
            for value in (float("nan"), float("inf"), float("-inf")):
                bad = clean.clone()
                bad.view(-1)[position] = value
                assert not bool(all_finite(bad)), (dtype, position, value)
                with pytest.raises(NonFiniteLogitsError):
                    FiniteLogits(defer=False).observe(bad)
                deferred = FiniteLogits(defer=True)
                deferred.observe(clean)
                deferred.observe(bad)
                with pytest.raises(NonFiniteLogitsError, match="in 1 of 2 batches"):
                    deferred.check()
    assert bool(all_finite(torch.zeros(0, 11, 8, 8)))
    FiniteLogits(defer=False).observe(torch.zeros(0, 11, 8, 8))
