"""Every registered calibrator inside the exported program (tools/export.py --calibrator NAME):
the program's probabilities equal those of predict_seg --calibrator NAME within 1e-5 and its
labels exactly, on images whose sides are no multiple of the network's stride, for each name of
the registry (a calibrator registered later is tested without an edit here): the .pt2 for
every calibrator here; ONNX for every calibrator's own program and, through the whole network,
in the slow run (one in make test), the boundary bands inside the program and the conformal
sets after a calibrator in tests/test_export_calibrator_programs.py (the second half, for the
test workers' balance), on the run built here (:func:`fitted_run`, once for both files).
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


# The network of fitted_run (model.arch: external): torch.export's trace, its saving and its
# loading cost go with the number of operations and of symbolic sizes, not with their size;
# these tests check the calibrators inside the program (tests/test_export.py exports the
# setup's own DeepLabV3), on a network of output stride 16 padded to it.
FACTORY = "tests.test_export_calibrators:strided_segmenter"


class _Strided(torch.nn.Module):
    """Two convolutions of stride 4 with a batch norm between: normalised images
    ``(N, 3, H, W)``, sides multiples of 16, to logits ``(N, K, H / 16, W / 16)`` (upsampled
    to the input's size by :class:`~cals_seg.models.external.ExternalSegmenter`)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 4, stride=4), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, classes, 4, stride=4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def strided_segmenter(classes: int = K) -> torch.nn.Module:
    """The factory :data:`FACTORY`: :class:`_Strided` of ``classes`` classes."""
    return _Strided(classes)


def _network(cfg, head=None, gain: float = 8.0):
    """A random DeepLabV3 (or the config's network, ``head(model)`` its last layer) whose
    batch-norm statistics are those of structured images and whose head is ``gain`` times its
    initial scale: its predictions have regions, boundaries and confidences from 0.2 to 1 (a
    fresh one predicts one class everywhere, near 1 / K)."""
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
        (head(model) if head else model.segmentation_head[0]).weight.mul_(gain)
    return model.eval()


def _budget(name: str) -> dict:
    accepted = inspect.signature(CALIBRATORS.lookup(name).__init__).parameters
    return {k: v for k, v in BUDGET.items() if k in accepted}


def fitted_run(tmp: Path) -> Path:
    """``tmp/run``: a run folder (train.amp: auto, as the setup files) with every registered
    calibrator fitted on ten structured validation-like images (targets: the network's labels
    with noise) and saved as eval_seg saves it, for this network; ``tmp/images``: one image of
    each of :data:`SIZES`."""
    from cals_seg.calibrators import calibrator_key, save_calibrator
    from cals_seg.config.schema import load_config, save_config
    from cals_seg.evaluation.inference import input_multiple, normalise, segment_logits
    from cals_seg.models.consent import remember
    from cals_seg.runs.run import load_run

    # the synthetic setup with the network of FACTORY (random weights, output stride 16)
    sets = [f"data.root={tmp / 'data'}", "train.amp=auto", "train.threads=1",
            "data.synthetic={num_train: 30, num_test: 2, image_size: 32}",
            "train.progress=false", "eval.num_maps=0", "train.device=cpu",
            "model.arch=external", f"model.factory={FACTORY}", "model.output_stride=16",
            "model.params={}"]
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", sets, "ce")
    folder = tmp / "run"
    folder.mkdir()
    save_config(cfg, folder / "config.yaml")
    remember(folder, FACTORY)  # as a command that makes a run from a config allows its factory
    # gain 16: confidences from 0.3 to 1, which every calibrator's fit moves (lts: its held-out
    # loss improves on the untrained one's)
    model = _network(cfg, head=lambda m: m.net.body[-1], gain=16.0)
    assert input_multiple(model) == 16  # SIZES are no multiple of it
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
        save_calibrator(calibrator.eval(), loaded.calibrator_file(name),
                        fitted_for=calibrator_key(loaded, name).record())
    images = tmp / "images"
    images.mkdir()
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(_image(h, w, 1000 + i)).save(images / f"im{i}.png")
    return folder


@pytest.fixture(scope="module")
def run(fitted_calibrators) -> Path:
    """:func:`fitted_run`, built once for this file and
    tests/test_export_calibrator_programs.py (tests/conftest.py: ``fitted_calibrators``; read
    only)."""
    return fitted_calibrators


def _predictor(run: Path, name: str | None, tmp_path: Path):
    """predict_seg's probabilities and labels of an image, as a function of the image: its own
    loading of the run and the calibrator (open_run, the default precision, once) and its own
    path (predict_image)."""
    from cals_seg.evaluation.inference import predict_image

    predict_seg = load_tool("predict_seg")
    argv = [str(run), "x.png", "--out", str(tmp_path / "unused")]
    args = predict_seg.parse_args([*argv, *(["--calibrator", name] if name else [])])
    loaded, temperature = predict_seg.open_run(args)
    assert loaded.precision == "none"  # float32 by default on every CPU

    def predicted(image: np.ndarray):
        out = predict_image(loaded.model, image, temperature, loaded.protocol, loaded.precision,
                            return_probs=True, calibrator=args.calibrator_module)
        return out.probs, out.label

    return predicted


def _predicted(run: Path, name: str | None, image: np.ndarray, tmp_path: Path):
    """predict_seg's probabilities and labels for ``image`` (:func:`_predictor`)."""
    return _predictor(run, name, tmp_path)(image)


def _pixels(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None].contiguous()


def _images(run: Path) -> list[np.ndarray]:
    return [np.asarray(Image.open(p).convert("RGB"))
            for p in sorted((run.parent / "images").glob("*.png"))]


def _check(run: Path, name: str, call, tmp_path: Path) -> None:
    predicted = _predictor(run, name, tmp_path)
    for image in _images(run):
        want, label = predicted(image)
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
