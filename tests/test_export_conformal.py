"""tools/export.py --conformal: the exported program's second output equals the sets that
predict_seg --conformal writes for the same images (pt2 for LAC and APS, one threshold and one
per class; ONNX for LAC when installed, marked slow); band mode, and APS in ONNX, are refused
with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from .conftest import load_tool, untrained_seg_run

ROOT = Path(__file__).resolve().parents[1]
# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = [
    pytest.mark.filterwarnings(
        "ignore:.*temperature.json", "ignore:The validation NLL is minimal"),
    pytest.mark.usefixtures("undrawn_figures"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A random-weight run of the synthetic setup and a folder of two images whose sides are
    no multiple of the network's stride (16). The network: tests/test_export_calibrators.py's
    two convolutions of stride 4 (model.arch external, output stride 16, random weights, its
    factory allowed for this run as a command that makes a run from a config allows it), whose
    program torch.export traces, saves and loads in a fraction of the time of a timm encoder's
    (the cost goes with the number of operations and of symbolic sizes); these tests check
    the sets, not the network."""
    from cals_seg.evaluation.inference import input_multiple
    from cals_seg.models.consent import remember
    from cals_seg.runs.run import load_run

    from .test_export_calibrators import FACTORY

    tmp = tmp_path_factory.mktemp("export_conformal")
    run = untrained_seg_run(tmp / "run", tmp / "data", sets=[
        "data.synthetic={num_train: 30, num_test: 2, image_size: 32}",
        "model.arch=external", f"model.factory={FACTORY}", "model.output_stride=16",
        "model.params={}"])
    remember(run, FACTORY)
    assert input_multiple(load_run(run, device="cpu", amp="none").model) == 16
    images = tmp / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name, shape in (("a", (37, 45, 3)), ("b", (40, 33, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(images / f"{name}.png")
    return run, images


def _predicted_sets(run: Path, images: Path, out: Path, spec: list[str]) -> dict[str, np.ndarray]:
    assert load_tool("predict_seg").main([str(run), str(images), "--out", str(out),
                                          "--conformal", *spec, "--no-progress"]) == 0
    return {p.stem: np.load(out / f"{p.stem}_sets.npz")["sets"] for p in images.glob("*.png")}


def _pixels(images: Path, stem: str) -> torch.Tensor:
    rgb = np.asarray(Image.open(images / f"{stem}.png").convert("RGB"), dtype=np.float32)
    return torch.from_numpy(rgb).permute(2, 0, 1)[None].contiguous()


def _eager_probs(run: Path, images: Path, stem: str) -> torch.Tensor:
    """``softmax`` of the run's logits of one image, as predict_seg computes them
    ``(1, K, H, W)``."""
    from cals_seg.evaluation.inference import normalise, segment_logits
    from cals_seg.runs.run import load_run

    r = load_run(run, device="cpu", amp="none", family="segmentation")
    rgb = np.asarray(Image.open(images / f"{stem}.png").convert("RGB"))
    logits = segment_logits(r.model, normalise(rgb, r.protocol), r.protocol, r.precision)
    return logits.float().softmax(dim=1)


def _export(run: Path, path: Path, fmt: str, spec: list[str], capsys) -> dict:
    assert load_tool("export").main([str(run), "--format", fmt, "--out", str(path),
                                     "--calibrator", "none", "--conformal", *spec]) == 0, \
        capsys.readouterr().err
    info = json.loads(Path(f"{path}.json").read_text())
    assert info["outputs"] == ["probs", "sets"]
    return info


@pytest.mark.parametrize("spec", [
    # LAC with one threshold is also the slow ONNX test's case; make test exports the harder one
    pytest.param(["0.3"], id="risk-lac", marks=pytest.mark.slow),
    pytest.param(["alpha=0.2", "mode=class", "score=aps"], id="class-aps")])
def test_exported_pt2_sets_equal_predict_seg(tiny, tmp_path, spec, capsys):
    run, images = tiny
    want = _predicted_sets(run, images, tmp_path / "pred", spec)
    program_file = tmp_path / "model.pt2"
    info = _export(run, program_file, "pt2", spec, capsys)
    saved = json.loads(next((run / "calibrators").glob(
        f"conformal_{info['conformal']['mode']}_{info['conformal']['score']}_a*.json"))
        .read_text())
    assert info["conformal"]["threshold"] == saved["threshold"]
    # every validation image calibrates (every=1 chosen for alpha): a threshold below "all"
    assert min(np.ravel(saved["threshold"])) < 1
    program = torch.export.load(program_file).module()
    same_bits = 0
    for stem, sets in want.items():
        probs, got = program(_pixels(images, stem))
        assert got.dtype == torch.bool and got.shape == (1, *sets.shape)
        assert torch.allclose(probs.sum(dim=1), torch.ones(1), atol=1e-5)
        # The exported network's float32 rounding differs from the eager one's in some pixels
        # (by ~1e-8); APS draws its randomisation from the probabilities' bits, so the sets are
        # compared where both programs give bit-identical probabilities (LAC: everywhere but
        # within 1e-6 of the threshold).
        eager = _eager_probs(run, images, stem)
        keep = (eager == probs).all(dim=1)[0].numpy()
        if "score=aps" not in spec:
            scores = 1 - eager[0].numpy()
            thr = np.asarray(saved["threshold"], dtype=np.float64).reshape(-1, 1, 1)
            keep |= (np.abs(scores - thr) > 1e-6).all(axis=0)
        assert np.array_equal(got[0].numpy()[:, keep], sets[:, keep]), stem
        same_bits += keep.mean()
    assert same_bits / len(want) > 0.5  # most pixels are compared


@pytest.mark.slow  # the ONNX export of the network takes a minute on a shared CPU
def test_exported_onnx_sets_equal_predict_seg(tiny, tmp_path, capsys):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    run, images = tiny
    want = _predicted_sets(run, images, tmp_path / "pred", ["0.3"])
    onnx_file = tmp_path / "model.onnx"
    _export(run, onnx_file, "onnx", ["0.3"], capsys)
    session = ort.InferenceSession(str(onnx_file))
    assert [o.name for o in session.get_outputs()] == ["probs", "sets"]
    for stem, sets in want.items():
        _, got = session.run(None, {"image": _pixels(images, stem).numpy()})
        assert got.dtype == bool and np.array_equal(got[0], sets), stem


def test_band_mode_is_refused(tiny, tmp_path, capsys):
    run, _ = tiny
    capsys.readouterr()
    assert load_tool("export").main([str(run), "--format", "pt2", "--out",
                                     str(tmp_path / "m.pt2"), "--conformal", "alpha=0.1",
                                     "mode=band"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mode=band" in err and "\n" not in err
    assert not (tmp_path / "m.pt2").exists()
    assert load_tool("export").main([str(run), "--format", "onnx", "--out",
                                     str(tmp_path / "m.onnx"), "--conformal", "alpha=0.1",
                                     "score=aps"]) == 2
    err = capsys.readouterr().err.strip()
    assert "score=aps" in err and "pt2" in err and "\n" not in err
