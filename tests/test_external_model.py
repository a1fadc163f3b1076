"""Networks trained elsewhere (cals_seg.models.external, tools/import_model.py): a torchvision
DeepLabV3, an smp Unet, a factory of one's own and (when installed) a Transformers SegFormer,
with random weights saved and reloaded, go through import_model, eval_seg --calibrators,
predict_seg and export; the logits the toolkit computes equal the network's own forward
(upsampled bilinearly, align_corners=False, when smaller); wrong shapes, mismatching and unsafe
weights files are refused with one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from torch import nn

from cals_seg.commands import eval_seg, export, import_model, predict_seg
from cals_seg.config.checks import check_config
from cals_seg.config.schema import load_config
from cals_seg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from cals_seg.errors import CheckpointError, ConfigError, UntrustedCheckpointError
from cals_seg.evaluation.inference import input_multiple, segment_logits
from cals_seg.models.external import (
    ExternalSegmenter,
    OutputShapeError,
    logits_of,
    map_keys,
    suggest_key_map,
)
from cals_seg.runs.run import load_run

K = 11  # the embedded synthetic dataset's classes
# A random network's validation NLL may be lowest at the largest temperature searched. The
# library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file checks
# numbers, messages and which files are written, not how a figure looks.
pytestmark = [pytest.mark.filterwarnings("ignore:.*search boundary:UserWarning"),
              pytest.mark.usefixtures("undrawn_figures")]


# ----------------------------------------------------------------------------- a factory
class TinyNet(nn.Module):
    """Two convolutions, logits at 1/``stride`` of the input, returned as ``output`` says."""

    def __init__(self, num_classes: int = K, stride: int = 1, output: str = "tensor") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, num_classes, 1))
        self.stride, self.output = stride, output

    def forward(self, x):
        out = self.body(x)
        if self.stride > 1:
            out = F.avg_pool2d(out, self.stride)
        if self.output == "dict":
            return {"aux": out * 0, "seg": out}
        if self.output == "tuple":
            return out, out.mean()
        if self.output == "vector":
            return out.mean(dim=(2, 3))
        return out


def tiny_net(num_classes: int = K, stride: int = 1, output: str = "tensor") -> nn.Module:
    """The factory named ``tests.test_external_model:tiny_net`` in the configs below."""
    return TinyNet(num_classes, stride, output)


def not_a_module() -> int:
    return 3


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("external") / "synthetic"


def write_config(folder: Path, root: Path, model: dict, **eval_keys) -> Path:
    """A tiny config: the synthetic set at 32 x 32, 1 train, 1 val and 1 test image, on CPU."""
    cfg = {
        "data": {"name": "synthetic", "root": str(root), "num_classes": K, "crop_size": 32,
                 "val_fraction": 0.5,
                 "synthetic": {"num_train": 2, "num_test": 1, "image_size": 32}},
        "model": {"arch": "external", **model},
        "train": {"device": "cpu", "amp": "none", "progress": False},
        "eval": {"batch_size": 2, "num_maps": 0, **eval_keys},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def own_input(x: torch.Tensor, mean, std) -> torch.Tensor:
    """The dataset's ImageNet-normalised images, normalised instead with ``mean`` / ``std``
    (float64, then float32): what the network's own pipeline feeds it."""
    x = x.double()
    raw = x * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1).double() \
        + torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1).double()
    own = (raw - torch.tensor(mean).view(1, 3, 1, 1).double()) \
        / torch.tensor(std).view(1, 3, 1, 1).double()
    return own.float()


def run_pipeline(tmp_path: Path, config: Path, own_forward, capsys, pt2: bool = True) -> Path:
    """import_model, then the toolkit's logits against ``own_forward`` on every image of every
    split (within 1e-5), eval_seg with ts and boundary_ts, predict_seg and (``pt2``) a pt2
    export."""
    run = tmp_path / "run"
    assert import_model.main([str(config), "--out", str(run)]) == 0, capsys.readouterr().err
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "checkpoint_best.pt",
                                               "history.jsonl", "temperature.json"}
    assert (run / "history.jsonl").read_text() == ""

    loaded = load_run(run, with_data=True)
    task = loaded.task
    for split in (task.train_set, task.val_set, task.test_set):
        for i in range(len(split)):
            x = split[i]["image"][None]
            toolkit = segment_logits(loaded.model, x, loaded.protocol)
            with torch.no_grad():
                own = own_forward(x)
            assert toolkit.shape == (1, K, *x.shape[-2:])
            torch.testing.assert_close(toolkit, own, atol=1e-5, rtol=1e-5)

    out = tmp_path / "eval"
    assert eval_seg.main([str(run), "--calibrators", "ts", "boundary_ts", "--out", str(out),
                          "--num-maps", "0", "--save-calibrators-to-run"]) == 0, \
        capsys.readouterr().err
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["calibrators"]) == {"ts", "boundary_ts"}
    assert 0 <= metrics["pre_ts"]["ece"] <= 1
    assert (run / "calibrators" / "boundary_ts.pt").is_file()

    image_file = sorted(Path(task.test_set.image_path(task.test_set.ids[0])).parent.glob(
        f"{task.test_set.ids[0]}.*"))[0]
    preds = tmp_path / "pred"
    assert predict_seg.main([str(run), str(image_file), "--out", str(preds)]) == 0
    assert (preds / f"{image_file.stem}_label.png").is_file()
    if not pt2:
        return run

    program_file = tmp_path / "model.pt2"
    assert export.main([str(run), "--format", "pt2", "--out", str(program_file),
                        "--min-size", "64"]) == 0, \
        capsys.readouterr().err
    program = torch.export.load(program_file).module()
    pixels = np.asarray(Image.open(image_file).convert("RGB"), np.float32)
    pixels = torch.from_numpy(pixels.repeat(2, axis=0).repeat(2, axis=1))  # 64 x 64
    pixels = pixels.permute(2, 0, 1)[None]
    normalised = (pixels / 255 - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) \
        / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        want = torch.softmax(own_forward(normalised) / loaded.temperature, dim=1)
        got = program(pixels)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return run


def upsample(logits: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The documented upsampling: bilinear, align_corners=False, to the input's size."""
    if logits.shape[-2:] == like.shape[-2:]:
        return logits
    return F.interpolate(logits, size=like.shape[-2:], mode="bilinear", align_corners=False)


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("pt2", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["pipeline", "with-pt2-export"])
def test_torchvision_deeplabv3(tmp_path, data_root, capsys, pt2):
    """torchvision's dict output ({"out": ..., "aux": ...}) read without user code (its pt2
    export in the slow run; make test exports the own-factory network)."""
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    torch.manual_seed(0)
    net = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=K,
                                       aux_loss=True).eval()
    torch.save(net.state_dict(), tmp_path / "deeplab.pt")
    config = write_config(tmp_path, data_root, {
        "factory": "torchvision:deeplabv3_mobilenet_v3_large", "params": {"aux_loss": True},
        "weights": str(tmp_path / "deeplab.pt")})
    run_pipeline(tmp_path, config, lambda x: net(x)["out"], capsys, pt2)


@pytest.mark.parametrize("pt2", [
    False, pytest.param(True, marks=pytest.mark.slow)], ids=["pipeline", "with-pt2-export"])
def test_smp_unet_wrapped_weights_and_own_normalisation(tmp_path, data_root, capsys, pt2):
    """An smp Unet saved as {"state_dict": {"module.<key>": ...}} (DataParallel in a training
    checkpoint), read with model.key_map, and its own input statistics (its pt2 export in the
    slow run, 7 s of torch.export and torch.export.load; make test exports the own-factory
    network, with its own input statistics too)."""
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    net = smp.Unet("resnet18", encoder_weights=None, classes=K, encoder_depth=3,
                   decoder_channels=(32, 16, 8)).eval()
    wrapped = {"epoch": 7, "state_dict": {f"module.{k}": v for k, v in net.state_dict().items()}}
    torch.save(wrapped, tmp_path / "unet.pth")
    mean, std = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]
    config = write_config(tmp_path, data_root, {
        "factory": "smp:unet", "encoder_name": "resnet18",
        "params": {"encoder_depth": 3, "decoder_channels": [32, 16, 8]},
        "weights": str(tmp_path / "unet.pth"), "key_map": {"module.": ""},
        "mean": mean, "std": std})
    run = run_pipeline(tmp_path, config, lambda x: net(own_input(x, mean, std)), capsys, pt2)
    # Padded as the toolkit pads its own smp models (smp's Unet takes any size: no padding).
    assert load_run(run).model.input_multiple == input_multiple(net)


def test_own_factory_smaller_output_is_upsampled(tmp_path, data_root, capsys):
    """A factory of one's own whose logits are 1/4 of the input, in a dict read by
    model.output_key: upsampled bilinearly to the input's size; with its own input statistics
    (as the smp Unet above), which its pt2 export applies too."""
    torch.manual_seed(0)
    net = TinyNet(stride=4, output="dict").eval()
    torch.save(net.state_dict(), tmp_path / "tiny.pt")
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    config = write_config(tmp_path, data_root, {
        "factory": "tests.test_external_model:tiny_net",
        "params": {"stride": 4, "output": "dict"}, "output_key": "seg", "output_stride": 4,
        "weights": str(tmp_path / "tiny.pt"), "mean": mean, "std": std})
    run_pipeline(tmp_path, config, lambda x: upsample(net(own_input(x, mean, std))["seg"], x),
                 capsys)


def test_transformers_segformer(tmp_path, data_root, capsys):
    """SegFormer's .logits at 1/4 of the input, upsampled as Transformers' post-processing
    does (bilinear, align_corners=False)."""
    transformers = pytest.importorskip("transformers")
    params = {"num_encoder_blocks": 4, "depths": [1, 1, 1, 1], "hidden_sizes": [8, 16, 24, 32],
              "num_attention_heads": [1, 1, 1, 1], "decoder_hidden_size": 16}
    torch.manual_seed(0)
    net = transformers.SegformerForSemanticSegmentation(
        transformers.SegformerConfig(num_labels=K, **params)).eval()
    torch.save(net.state_dict(), tmp_path / "segformer.pt")
    config = write_config(tmp_path, data_root, {
        "factory": "transformers:segformer", "params": params,
        "weights": str(tmp_path / "segformer.pt")})
    run_pipeline(tmp_path, config, lambda x: upsample(net(pixel_values=x).logits, x), capsys)


# ----------------------------------------------------------------------------- refusals
def _refused(capsys, config: Path, out: Path) -> str:
    """import_model's exit status 2 and its one-line message."""
    assert import_model.main([str(config), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not (out / "checkpoint_best.pt").exists()
    return err


def test_wrong_output_shape_is_refused(tmp_path, data_root, capsys):
    for params, words in (({"num_classes": 5}, "(1, 5, 32, 32)"),  # another class count
                          ({"output": "vector"}, "(1, 11)")):  # no spatial logits
        config = write_config(tmp_path, data_root, {
            "factory": "tests.test_external_model:tiny_net", "params": params})
        err = _refused(capsys, config, tmp_path / "run")
        assert words in err and "data.num_classes=11" in err


def test_mismatching_weights_are_refused(tmp_path, data_root, capsys):
    factory = "tests.test_external_model:tiny_net"
    torch.save(TinyNet(num_classes=5).state_dict(), tmp_path / "five.pt")
    config = write_config(tmp_path, data_root, {"factory": factory,
                                                "weights": str(tmp_path / "five.pt")})
    err = _refused(capsys, config, tmp_path / "run")
    assert "model.weights" in err and "shapes differ" in err and "(5, 8, 1, 1)" in err

    prefixed = {f"model.{k}": v for k, v in TinyNet().state_dict().items()}
    torch.save(prefixed, tmp_path / "prefixed.pt")
    config = write_config(tmp_path, data_root, {"factory": factory,
                                                "weights": str(tmp_path / "prefixed.pt")})
    err = _refused(capsys, config, tmp_path / "run")
    assert "model.key_map: {'model.': ''}" in err  # the fix, named


def test_unsafe_weights_file_is_refused(tmp_path, data_root, capsys):
    """A whole module pickled (torch.save(model)) would run code when loaded: refused."""
    torch.save(TinyNet(), tmp_path / "whole.pt")
    config = write_config(tmp_path, data_root, {
        "factory": "tests.test_external_model:tiny_net", "weights": str(tmp_path / "whole.pt")})
    err = _refused(capsys, config, tmp_path / "run")
    assert "could run code" in err and "state_dict()" in err
    assert "(tests.test_external_model.TinyNet" in err  # what it would build, named
    with pytest.raises(UntrustedCheckpointError):
        from cals_seg.models.external import read_state_dict

        read_state_dict(tmp_path / "whole.pt")


@pytest.mark.parametrize("model, words", [
    ({"factory": "tests.test_external_model:no_such_function"}, "has no function"),
    ({"factory": "no_such_package.module:net"}, "cannot import"),
    ({"factory": "not a factory"}, "package.module:function"),
    ({"factory": "tests.test_external_model:not_a_module"}, "not a torch.nn.Module"),
    ({"factory": "torchvision:resnet50"}, "not a torchvision segmentation model"),
    ({}, "model.factory"),
    ({"factory": "smp:unet", "mean": [123.7, 116.3, 103.5]}, "model.mean"),
    ({"factory": "smp:unet", "weights": "missing.pt"}, "does not exist"),
])
def test_bad_model_sections_are_refused(tmp_path, data_root, capsys, model, words):
    err = _refused(capsys, write_config(tmp_path, data_root, model), tmp_path / "run")
    assert words in err


def test_other_refusals(tmp_path, data_root, capsys):
    config = write_config(tmp_path, data_root, {"factory": "tests.test_external_model:tiny_net"})
    text = yaml.safe_load(config.read_text())
    text["model"]["arch"] = "deeplabv3"
    other = tmp_path / "smp.yaml"
    other.write_text(yaml.safe_dump(text))
    assert "model.arch: expected 'external'" in _refused(capsys, other, tmp_path / "run")
    with pytest.raises(ConfigError, match="model.factory: expected null unless model.arch is "
                       "'external'"):  # every tool: the factory of an smp model is a mistake
        check_config(load_config(other))

    assert import_model.main([str(config), "--out", str(tmp_path / "run")]) == 0
    assert import_model.main([str(config), "--out", str(tmp_path / "run")]) == 2
    assert "already holds a run" in capsys.readouterr().err


# ----------------------------------------------------------------------------- pieces
def test_logits_of_reads_each_library_output():
    t = torch.zeros(1, K, 2, 2)

    class Output:  # a Transformers ModelOutput has the logits as an attribute
        logits = t

    assert logits_of(t) is t
    assert logits_of({"out": t, "aux": t + 1}) is t  # torchvision
    assert logits_of(Output()) is t
    assert logits_of((t, t + 1)) is t
    assert logits_of({"only": t}) is t
    assert logits_of({"seg": t, "aux": t + 1}, key="seg") is t
    with pytest.raises(OutputShapeError, match="model.output_key"):
        logits_of({"seg": t, "aux": t + 1})


def test_key_map_and_its_suggestion():
    state = {"module.a.weight": 1, "module.b.bias": 2, "head.c": 3}
    assert map_keys(state, {"module.": ""}) == {"a.weight": 1, "b.bias": 2, "head.c": 3}
    assert map_keys(state, {"": "net."}) == {f"net.{k}": v for k, v in state.items()}
    # The first matching prefix wins, in the order given.
    assert map_keys({"ab.x": 0}, {"a": "1", "ab": "2"}) == {"1b.x": 0}
    assert suggest_key_map(["a.weight", "b.bias"], ["module.a.weight", "module.b.bias"]) \
        == {"module.": ""}
    assert suggest_key_map(["net.a", "net.b"], ["a", "b"]) == {"": "net."}
    assert suggest_key_map(["a", "b"], ["x", "y"]) is None


def test_renormalisation_is_exact_affine_map():
    """The wrapper maps ImageNet-normalised input to the network's own normalisation."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(x)
            return torch.zeros(x.shape[0], K, *x.shape[-2:])

    mean, std = [0.1, 0.2, 0.3], [0.5, 0.4, 0.3]
    wrapper = ExternalSegmenter(Probe(), K, mean, std)
    x = torch.randn(2, 3, 4, 5)
    wrapper(x)
    torch.testing.assert_close(seen[-1], own_input(x, mean, std), atol=1e-6, rtol=1e-6)
    ExternalSegmenter(Probe(), K)(x)  # ImageNet statistics: the input as it is
    assert seen[-1] is x


def test_checkpoint_errors_name_the_key(tmp_path):
    from cals_seg.models.external import read_state_dict

    torch.save({"epoch": 3, "weights": {"a": torch.zeros(1)}}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="model.weights_key"):
        read_state_dict(tmp_path / "ckpt.pt")
    assert set(read_state_dict(tmp_path / "ckpt.pt", weights_key="weights")) == {"a"}
    with pytest.raises(CheckpointError, match="model.weights_key: .* no entry 'net'"):
        read_state_dict(tmp_path / "ckpt.pt", weights_key="net")
    (tmp_path / "junk.pt").write_bytes(b"not a weights file")
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_state_dict(tmp_path / "junk.pt")
    with pytest.raises(ConfigError, match="model.factory"):
        from cals_seg.models.external import split_factory

        split_factory("torchvision")
