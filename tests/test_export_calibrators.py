"""Every registered calibrator inside the exported program (tools/export.py --calibrator NAME):
the program's probabilities equal those of predict_seg --calibrator NAME within 1e-5 and its
labels exactly, on images whose sides are no multiple of the network's stride, for each name of
the registry (a calibrator registered later is tested without an edit here); the .pt2 for
every calibrator, ONNX for every calibrator's own program and, through the whole network, in
the slow run (one in make test). The predicted boundary bands inside the program are those of
the fitted calibrator (generated label maps); conformal sets after a calibrator are predict_seg's.
"""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import cals_seg.contrib.boundary_conf_ts  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.calibrators import CALIBRATORS, build_calibrator
from cals_seg.calibrators._export import graph_bands
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.metrics.distance import int_thresholds

from .conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
K = 11
NAMES = list(CALIBRATORS)
# Sides that are no multiple of the network's output stride (16), as predict_seg gets them.
SIZES = [(37, 45), (40, 33)]
# Constructor arguments that bound a fit's work, given to every calibrator that takes them (a
# few L-BFGS iterations, epochs, passes): the fitted state is what is compared, not its quality.
# `temperature` and `threshold` fix selective's T_mis and flag level, so that it flags pixels
# and they do change.
BUDGET = {"max_iter": 4, "epochs": 2, "passes": 2, "lams": [0.1], "temperature": 3.0,
          "threshold": 0.05}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _structured(shape: tuple[int, ...], seed: int, scale: int = 6) -> torch.Tensor:
    """Smooth random values (bilinearly upsampled noise): images and logits with regions."""
    g = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    low = torch.randn(n, c, h // scale + 2, w // scale + 2, generator=g)
    return F.interpolate(low, size=(h, w), mode="bilinear", align_corners=False)


def _image(height: int, width: int, seed: int) -> np.ndarray:
    x = _structured((1, 3, height, width), seed)[0] * 70 + 128
    return x.clamp(0, 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def _network(cfg):
    """A random DeepLabV3 whose batch-norm statistics are those of structured images and whose
    head is 8 times its initial scale: its predictions have regions, boundaries and
    confidences from 0.2 to 1 (a fresh one predicts one class everywhere, near 1 / K)."""
    from cals_seg.tasks.segmentation import build_model

    torch.manual_seed(0)
    model = build_model(cfg)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
            module.reset_running_stats()
    model.train()
    with torch.no_grad():
        for seed in range(4):
            model(_structured((4, 3, 48, 48), 100 + seed) * 2)
        model.segmentation_head[0].weight.mul_(8.0)
    return model.eval()


def _budget(name: str) -> dict:
    accepted = inspect.signature(CALIBRATORS.lookup(name).__init__).parameters
    return {k: v for k, v in BUDGET.items() if k in accepted}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder (train.amp: auto, as the setup files) with every registered calibrator
    fitted on ten structured validation-like images (targets: the network's labels with noise)
    and saved as eval_seg saves it, for this network."""
    from cals_seg.calibrators import calibrator_record, save_calibrator
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.evaluation.inference import normalise, segment_logits
    from cals_seg.runs.run import load_run

    tmp = tmp_path_factory.mktemp("export_calibrators")
    sets = [f"data.root={tmp / 'data'}", "train.amp=auto", "train.threads=1",
            "data.synthetic={num_train: 30, num_test: 2, image_size: 32}",
            "train.progress=false", "eval.num_maps=0", "train.device=cpu",
            "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", sets, "ce")
    folder = tmp / "run"
    folder.mkdir()
    save_config(cfg, folder / "config.yaml")
    model = _network(cfg)
    torch.save({"model": model.state_dict(), "num_classes": K, "epoch": 0},
               folder / "checkpoint_best.pt")
    (folder / "temperature.json").write_text(json.dumps({"temperature": 1.3}))
    loaded = load_run(folder, device="cpu", amp="none", family="segmentation")
    batches = []
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x = torch.cat([normalise(_image(37, 45, 10 * i + j)) for j in range(2)])
        logits = segment_logits(loaded.model, x, loaded.protocol)
        target = (logits + 1.5 * torch.randn(logits.shape, generator=g)).argmax(dim=1)
        batches.append((logits, target, x))
    for name in NAMES:
        calibrator = build_calibrator(name, K, **_budget(name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibrator.fit(lambda: iter(batches), ignore_index=255)
        save_calibrator(calibrator.eval(), loaded.run.calibrator_file(name),
                        fitted_for=calibrator_record(loaded, name))
    images = tmp / "images"
    images.mkdir()
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(_image(h, w, 1000 + i)).save(images / f"im{i}.png")
    return folder


def _predicted(run: Path, name: str | None, image: np.ndarray, tmp_path: Path):
    """predict_seg's probabilities and labels for ``image``: its own loading of the run and the
    calibrator (open_run, the default precision) and its own path (predict_image)."""
    from cals_seg.evaluation.inference import predict_image

    predict_seg = load_tool("predict_seg")
    argv = [str(run), "x.png", "--out", str(tmp_path / "unused")]
    args = predict_seg.parse_args([*argv, *(["--calibrator", name] if name else [])])
    loaded, temperature = predict_seg.open_run(args)
    assert loaded.precision == "none"  # float32 by default on every CPU
    out = predict_image(loaded.model, image, temperature, loaded.protocol, loaded.precision,
                        return_probs=True, calibrator=args.calibrator_module)
    return out.probs, out.label


def _pixels(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None].contiguous()


def _images(run: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p).convert("RGB"))
            for p in sorted((run.parent / "images").glob("*.png"))]


def _check(run: Path, name: str, call, tmp_path: Path) -> None:
    for image in _images(run):
        want, label = _predicted(run, name, image, tmp_path)
        got = call(_pixels(image))
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5, (name, float((got - want).abs().max()))
        assert torch.equal(got.argmax(dim=1), label), name
    # two images of one size in one batch: each gets its own bands, as alone
    image = _images(run)[0]
    pair = torch.cat([_pixels(image), _pixels(image[::-1].copy())])
    got = call(pair)
    assert (got[1] - call(pair[1:])[0]).abs().max() <= 1e-5


def test_the_registry_is_the_export_list():
    """--calibrator takes every registered name, and none."""
    from cals_seg.runs.export import calibrator_choices

    assert set(calibrator_choices()) == {"none", *NAMES}


def test_fitted_calibrators_are_not_the_identity(run, tmp_path):
    """The comparisons below compare something: every fitted calibrator moves the probabilities
    of the test images away from the uncalibrated softmax."""
    image = _images(run)[0]
    plain, _ = _predicted(run, None, image, tmp_path)  # T = 1.3: compare with T = 1
    raw = plain.log().mul(1.3).softmax(dim=1)
    for name in NAMES:
        calibrated, _ = _predicted(run, name, image, tmp_path)
        assert (calibrated - raw).abs().max() > 1e-3, name


@pytest.mark.parametrize("name", NAMES)
def test_pt2_program_equals_predict_seg(run, tmp_path, name):
    from cals_seg.runs.export import export_run

    out = tmp_path / f"{name}.pt2"
    info = export_run(run, out, "pt2", name)
    assert info["calibrator"] == name and info["precision"] == "none"
    assert info["calibrator_file"].endswith(f"calibrators/{name}.pt")
    assert info["input"]["min_size"] <= min(min(s) for s in SIZES)
    program = torch.export.load(out).module()
    with torch.no_grad():
        _check(run, name, program, tmp_path)


def _onnx_call(path: Path):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()})[0])


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[] if n == "boundary_ts_conf" else pytest.mark.slow) for n in NAMES])
def test_onnx_model_equals_predict_seg(run, tmp_path, name):
    """The whole network in ONNX (make test: boundary_ts_conf, whose program holds the bands,
    the confidence bins and a gather; the slow run: every calibrator)."""
    pytest.importorskip("onnxscript")
    from cals_seg.runs.export import export_run

    out = tmp_path / f"{name}.onnx"
    info = export_run(run, out, "onnx", name)
    assert info["onnx_check"]["max_difference_to_pt2"] <= 1e-4
    _check(run, name, _onnx_call(out), tmp_path)


@pytest.mark.parametrize("name", NAMES)
def test_calibrator_program_in_both_formats_equals_forward(run, name):
    """Each fitted calibrator's own program (export_module), traced with dynamic N, H, W and
    run by torch.export and by onnxruntime, equals its forward on logits with regions of every
    class: within 1e-5, labels exactly."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from cals_seg.calibrators import load_calibrator

    calibrator = load_calibrator(run / "calibrators" / f"{name}.pt")
    batches = [(_structured((2, K, 37, 45), 0) * 4, torch.randn(2, 3, 37, 45))]
    dim = torch.export.Dim
    sizes = {0: dim("n", min=1, max=64), 2: dim("h", min=9), 3: dim("w", min=9)}
    tests = [(_structured((1, K, 40, 33), 7) * 4, torch.randn(1, 3, 40, 33)),
             (_structured((2, K, 17, 70), 8) * 4, torch.randn(2, 3, 17, 70))]
    for fmt in ("pt2", "onnx"):
        program = _Both(calibrator.export_module(fmt), calibrator.needs_image)
        example = batches[0]
        exported = torch.export.export(program, example,
                                       dynamic_shapes={"logits": sizes, "image": sizes})
        if fmt == "pt2":
            call = exported.module()
        else:
            import tempfile

            with tempfile.TemporaryDirectory() as folder:
                file = Path(folder) / "calibrator.onnx"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.onnx.export(exported, example, str(file), dynamo=True, verbose=False,
                                      input_names=["logits", "image"])
                session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
                inputs = [i.name for i in session.get_inputs()]

                def call(logits, image, session=session, inputs=inputs):
                    feed = {"logits": logits.numpy(), "image": image.numpy()}
                    return torch.from_numpy(session.run(None, {k: feed[k] for k in inputs})[0])
        for logits, image in tests:
            with torch.no_grad():
                want = calibrator(logits, image if calibrator.needs_image else None)
                got = call(logits, image)
            assert (got.softmax(1) - want.softmax(1)).abs().max() <= 1e-5, (name, fmt)
            assert torch.equal(got.argmax(dim=1), want.argmax(dim=1)), (name, fmt)


class _Both(torch.nn.Module):
    """A calibrator's program with the image as a second input (passed on when it needs it)."""

    def __init__(self, program: torch.nn.Module, needs_image: bool) -> None:
        super().__init__()
        self.program, self.needs_image = program, needs_image

    def forward(self, logits: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.program(logits, image if self.needs_image else None)


def _label_maps():
    """Generated label maps: regions of every scale, thin lines, single pixels, one class,
    images smaller than the largest distance, every aspect."""
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 1, 1), (1, 1, 9), (3, 5, 2), (2, 40, 33), (1, 70, 90), (1, 100, 3),
                  (1, 31, 31)]:
        for scale in (1, 3, 7, 40):
            low = torch.randint(0, 4, (shape[0], shape[1] // scale + 1, shape[2] // scale + 1),
                                generator=g)
            yield F.interpolate(low[:, None].float(), size=shape[1:], mode="nearest")[:, 0].long()
    yield torch.zeros(1, 20, 30, dtype=torch.long)


@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0),
                                   (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0),
                                   (0.5,), (2.5, 30.0)])
def test_bands_inside_the_program_are_the_fitted_calibrators(bands):
    """graph_bands (what the exported program computes) equals predicted_bands (what the
    boundary calibrators are fitted and applied with) on every generated map."""
    for label in _label_maps():
        logits = F.one_hot(label, 5).permute(0, 3, 1, 2).float()
        assert torch.equal(graph_bands(logits, int_thresholds(bands)),
                           predicted_bands(logits, bands)), (bands, tuple(label.shape))


def test_conformal_sets_after_a_calibrator_are_predict_seg_s(run, tmp_path, capsys):
    """--calibrator NAME --conformal ALPHA: the probabilities are the calibrator's, the sets
    those predict_seg --calibrator NAME --conformal ALPHA writes (on the network's logits)."""
    images = run.parent / "images"
    spec = ["alpha=0.2", "mode=class"]  # predict_seg fits it on held-out validation images
    pred = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(images), "--out", str(pred),
                                          "--calibrator", "boundary_ts", "--conformal", *spec,
                                          "--no-progress", "--no-ood-check"]) == 0, \
        capsys.readouterr().err
    out = tmp_path / "m.pt2"
    assert load_tool("export").main([str(run), "--format", "pt2", "--out", str(out),
                                     "--calibrator", "boundary_ts", "--conformal", *spec]) == 0, \
        capsys.readouterr().err
    info = json.loads(Path(f"{out}.json").read_text())
    assert info["calibrator"] == "boundary_ts" and info["outputs"] == ["probs", "sets"]
    program = torch.export.load(out).module()
    for path in sorted(images.glob("*.png")):
        image = np.asarray(Image.open(path).convert("RGB"))
        with torch.no_grad():
            probs, sets = program(_pixels(image))
        want_probs, _ = _predicted(run, "boundary_ts", image, tmp_path)
        assert (probs - want_probs).abs().max() <= 1e-5
        want_sets = np.load(pred / f"{path.stem}_sets.npz")["sets"]
        assert np.array_equal(sets[0].numpy(), want_sets)
