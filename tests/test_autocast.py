"""Every loss, its gradient, ``observe`` and ``update_multipliers`` give the float32 results
whatever autocast context surrounds them (CPU and CUDA, bf16 and fp16, TF32 allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cals_seg.contrib.cals_bands  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.losses import LOSSES, build_loss

from .conftest import autocast_nesting

K = 21
IGN = 255
MARGIN = 3.0  # logit gaps of randn * 4 logits often exceed it: the penalties are active
# lambda = 8, rho = 2 where the loss has them (P' >= 8 - 2 > 0: every class is penalised).
PARAMS = {
    "cals_alm": {"margin": MARGIN, "lambda_init": 8.0, "rho_init": 2.0},
    "cals_hr": {"margin": MARGIN, "lambda_init": 8.0},
    "mbls": {"margin": MARGIN},
    "crac": {"lambda_init": 8.0, "rho_init": 2.0},
    "cals_alm_bands": {"margin": MARGIN, "lambda_init": 8.0, "rho_init": 2.0},
}
ADAPTIVE = ["cals_alm", "cals_hr", "crac", "cals_alm_bands"]
HALF = [torch.bfloat16, torch.float16]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture(autouse=True)
def _allow_tf32():
    """TF32 matmuls allowed, as many training scripts do; the criterion must not use them."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _data(device, n=2, s=(32, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, K, *s), generator=g) * 4.0
    y = torch.randint(0, K, (n, *s), generator=g)
    y[torch.rand((n, *s), generator=g) < 0.05] = IGN  # a few void pixels
    return x.to(device), y.to(device)


def _loss(name, device):
    return build_loss(name, K, ignore_index=IGN, **PARAMS.get(name, {})).to(device)


def _value_and_grad(loss, x, y, dtype=None):
    a = x.detach().clone().requires_grad_(True)
    if dtype is None:
        out = loss(a, y)
    else:
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            out = loss(a, y)
    out.backward()
    return out.detach(), a.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_gradient_under_autocast_equal_float32(name, dtype, device):
    x, y = _data(device)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, x, y)
    if name in PARAMS:
        assert loss.terms["penalty"] > 0.1  # the penalty is active
    out, grad = _value_and_grad(loss, x, y, dtype)
    assert out.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_backward_inside_autocast_equals_float32(name, dtype, device):
    x, y = _data(device)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, x, y)
    a = x.clone().requires_grad_(True)
    with torch.autocast(device_type=device, dtype=dtype):
        out = loss(a, y)
        out.backward()
    torch.testing.assert_close(out.detach(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.grad, ref_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_half_logits_are_computed_in_float32(name, dtype, device):
    x, y = _data(device)
    half = x.to(dtype)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, half.float(), y)
    for ctx in (None, dtype):
        out, grad = _value_and_grad(loss, half, y, ctx)
        assert out.dtype == torch.float32
        assert grad.dtype == dtype  # autograd requires the logits' dtype
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad.to(dtype))


def _epochs(device, cast=None):
    """Two epochs of two validation batches; the second epoch's logits are sharper, so that
    CALS-HR's lambdas move too."""
    out = []
    for epoch in range(2):
        batches = []
        for seed in range(2):
            x, y = _data(device, seed=seed)
            x = x * (1.0 + 0.5 * epoch)
            batches.append((x if cast is None else x.to(cast), y))
        out.append(batches)
    return out


def _observe_and_update(name, device, epochs, dtype=None):
    loss = _loss(name, device)
    history = []
    for epoch, batches in enumerate(epochs):
        for x, y in batches:
            if dtype is None:
                loss.observe(x, y)
            else:
                with torch.autocast(device_type=device, dtype=dtype):
                    loss.observe(x, y)
        history.append(loss.update_multipliers(epoch))
    return loss, history


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ADAPTIVE)
def test_observe_and_update_under_autocast_equal_float32(name, dtype, device):
    epochs = _epochs(device)
    ref, ref_history = _observe_and_update(name, device, epochs)
    got, history = _observe_and_update(name, device, epochs, dtype)
    assert not torch.equal(ref.lambdas, torch.full_like(ref.lambdas, 8.0))  # lambdas moved
    torch.testing.assert_close(got.lambdas, ref.lambdas, rtol=1e-6, atol=0)
    for a, b in zip(history, ref_history, strict=True):
        for key in b:
            if b[key] is None:  # e.g. a distance band without validation pixels
                assert a[key] is None, key
                continue
            torch.testing.assert_close(
                torch.tensor(a[key]), torch.tensor(b[key]), rtol=1e-6, atol=0
            )
    # half logits: the float32 statistics of the same (upcast) values
    half = _epochs(device, cast=dtype)
    upcast = [[(x.float(), y) for x, y in batches] for batches in half]
    ref_half, _ = _observe_and_update(name, device, upcast)
    got_half, _ = _observe_and_update(name, device, half, dtype)
    torch.testing.assert_close(got_half.lambdas, ref_half.lambdas, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_issue_example_fp16_lambdas_are_finite(device):
    # K = 21, logits 2x21x128x128, lambda = 8, rho = 2: under fp16 autocast the per-image sums of
    # P' (~1e5) used to overflow float16, giving lambda = 1e6 for every class.
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, K, 128, 128), generator=g).to(device)
    y = torch.randint(0, K, (2, 128, 128), generator=g).to(device)
    lambdas = []
    for dtype in (None, torch.float16):
        crit = build_loss("cals_alm", K, ignore_index=IGN, lambda_init=8.0, rho_init=2.0)
        crit = crit.to(device)
        if dtype is None:
            crit.observe(x, y)
        else:
            with torch.autocast(device_type=device, dtype=dtype):
                crit.observe(x, y)
        crit.update_multipliers(0)
        lambdas.append(crit.lambdas)
    ref, got = lambdas
    assert torch.isfinite(got).all() and float(got.max()) < 100.0
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ADAPTIVE)
def test_observe_rejects_non_finite_logits(name, bad):
    x, y = _data("cpu")
    x[1, 3, 5, 7] = bad
    loss = _loss(name, "cpu")
    with pytest.raises(ValueError, match=r"Expected `logits` to be finite, but got 1 non-finite"):
        loss.observe(x, y)
    with pytest.raises(RuntimeError, match="no observed validation positions"):
        loss.update_multipliers(0)  # nothing of the rejected batch was accumulated


# ----------------------------------------------------------------------------- inference
# One precision rule for the commands' forward pass (cals_seg.utils.precision): `auto` is float32
# on every CPU for evaluation, prediction and export; bf16 only when asked, said once; the
# calibration (softmax, temperatures, calibrators, sets) in float32 whatever the forward pass.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}  # the AVX2 kind of CPU


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16-cpu", "avx2-cpu"])
def test_auto_is_float32_for_inference_on_every_cpu(native, monkeypatch):
    from cals_seg.utils import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    assert precision.resolve_amp("auto", cpu, inference=True) == "none"
    assert precision.resolve_amp("auto", cpu) == ("bf16" if native else "none")  # training
    assert precision.resolve_amp("bf16", cpu, warn=False, inference=True) == "bf16"  # asked


# The program the export below saved (export_run -> torch.export.save), as it was saved: this
# process's CPU kind runs it without reading the file back (torch.export.load parses every
# symbolic size of the 500 nodes with sympy: seconds); the AVX2 kind's process loads the file.
SAVED: dict = {}


@pytest.fixture(scope="module")
def precision_run(tmp_path_factory):
    """A run whose config says train.amp: auto (as the setup files), its exported .pt2 (the
    default export; the program saved kept in :data:`SAVED`) and an image whose sides are no
    multiple of the stride (16)."""
    from PIL import Image

    from cals_seg.config.schema import load_config, save_config
    from cals_seg.runs.export import export_run

    from .test_export_calibrators import ROOT, _image, _network

    tmp = tmp_path_factory.mktemp("precision")
    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", [
        f"data.root={tmp / 'data'}", "train.amp=auto", "train.device=cpu", "train.threads=1",
        "model.encoder_name=tu-mobilenetv3_small_050",
        "model.params={encoder_output_stride: 16, decoder_channels: 16}"], "ce")
    run = tmp / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    torch.save({"model": _network(cfg).state_dict(), "num_classes": 11, "epoch": 0},
               run / "checkpoint_best.pt")
    (run / "temperature.json").write_text('{"temperature": 1.3}')
    (tmp / "images").mkdir()
    Image.fromarray(_image(37, 45, 7)).save(tmp / "images" / "a.png")
    save = torch.export.save

    def keeping(program, path, *args, **kwargs):
        SAVED[str(path)] = program
        return save(program, path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "save", keeping)
        export_run(run, tmp / "model.pt2", "pt2")
    assert list(SAVED) == [str(tmp / "model.pt2")]
    return run, tmp / "images" / "a.png", tmp / "model.pt2"


# Run in a fresh process (so that a CPU kind can be set before torch loads; this process's own
# kind: run here, with the program as saved, PROGRAM): predict_seg's default probabilities of
# the image (its own loading and path) and the default .pt2's.
_BOTH = r"""
import sys, numpy as np, torch
from PIL import Image
from cals_seg.commands import predict_seg
from cals_seg.evaluation.inference import predict_image
run, image_file, program_file, out = sys.argv[1:]
args = predict_seg.parse_args([run, image_file, "--out", out])
loaded, temperature = predict_seg.open_run(args)
image = np.asarray(Image.open(image_file).convert("RGB"))
pred = predict_image(loaded.model, image, temperature, loaded.protocol, loaded.precision,
                     return_probs=True)
pixels = torch.from_numpy(image.astype(np.float32)).permute(2, 0, 1)[None].contiguous()
program = globals().get("PROGRAM")
if program is None:
    program = torch.export.load(program_file)
with torch.no_grad():
    exported = program.module()(pixels)
np.savez(out + ".npz", predict=pred.probs.numpy(), export=exported.numpy(),
         precision=loaded.precision, kind=torch.backends.cpu.get_cpu_capability())
"""


def _both(precision_run, tmp_path, env):
    import os
    import subprocess
    import sys

    import numpy as np

    run, image, program = precision_run
    out = str(tmp_path / f"both_{len(env)}")
    argv = [str(run), str(image), str(program), out]
    if not env:  # this process's own CPU kind: the same script, run here (one process less),
        from unittest import mock  # on the program export_run saved (not read back)

        with mock.patch.object(sys, "argv", ["-c", *argv]):
            exec(compile(_BOTH, "<both>", "exec"),
                 {"__name__": "__main__", "PROGRAM": SAVED[str(program)]})
        return np.load(out + ".npz")
    done = subprocess.run([sys.executable, "-c", _BOTH, *argv], env={**os.environ, **env},
                          capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(out + ".npz")


def test_predict_seg_default_equals_the_default_export_on_every_cpu_kind(precision_run,
                                                                            tmp_path):
    """predict_seg RUN img and the default export of RUN: every probability within 1e-4, on
    this CPU (the program as saved) and on the AVX2 kind (ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2: the .pt2 file loaded); and the two kinds give predict_seg the same
    probabilities."""
    import numpy as np

    here, avx2 = _both(precision_run, tmp_path, {}), _both(precision_run, tmp_path, AVX2)
    assert str(avx2["kind"]) == "AVX2"
    for result in (here, avx2):
        assert str(result["precision"]) == "none"
        assert np.abs(result["predict"] - result["export"]).max() <= 1e-4
    assert np.abs(here["predict"] - avx2["predict"]).max() <= 1e-4


def test_predict_seg_is_float32_by_default_and_bf16_only_when_asked(precision_run, tmp_path,
                                                                    monkeypatch):
    """On a CPU with native bf16 (as this machine may or may not be: patched), predict_seg's
    default forward pass is float32, recorded in predictions.jsonl; --amp bf16 runs bf16,
    records it and prints its measured deviation once."""
    import json
    import warnings

    from cals_seg.commands import predict_seg
    from cals_seg.utils import precision

    run, image, _ = precision_run
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    for amp, want in ((None, "none"), ("bf16", "bf16")):
        out = tmp_path / f"pred_{amp}"
        argv = [str(run), str(image), "--out", str(out), "--no-progress", "--no-ood-check"]
        with warnings.catch_warnings(record=True) as caught:  # the tools show each in one line
            warnings.simplefilter("always")
            assert predict_seg.main([*argv, *(["--amp", amp] if amp else [])]) == 0
        record = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
        assert record["precision"] == want
        said = [w for w in caught if "docs/performance.md#precision" in str(w.message)]
        assert len(said) == (want != "none"), [str(w.message) for w in caught]


def test_calibration_is_float32_after_a_bf16_forward_pass(precision_run):
    """A bf16 forward pass gives float32 logits to the calibration: probabilities, confidence
    and a calibrator's output are float32."""
    from cals_seg.calibrators import build_calibrator
    from cals_seg.evaluation.inference import predict_image
    from cals_seg.runs.run import load_run

    from .test_export_calibrators import _image

    loaded = load_run(precision_run[0], device="cpu", amp="bf16", family="segmentation")
    seen = []

    class Spy(torch.nn.Module):
        needs_image = False

        def forward(self, logits, image=None):
            seen.append(logits.dtype)
            return build_calibrator("ts", 11)(logits)

    out = predict_image(loaded.model, _image(37, 45, 3), 1.3, loaded.protocol, "bf16",
                        return_probs=True, calibrator=Spy())
    assert seen == [torch.float32]
    assert out.probs.dtype == out.confidence.dtype == torch.float32


# ------------------------------------------------ autocast's nesting count left off by a trace
def _leak_by_a_failed_trace() -> int:
    """What left the count one too high in the suite (torch 2.14): ``torch._dynamo.explain`` of
    a criterion whose label assertion fails inside the graph. Returns how much it moved."""
    before = autocast_nesting()
    logits = torch.randn(2, 5, 6, 7)
    target = torch.randint(0, 5, (2, 6, 7))
    target[1, 2, 3] = 9  # outside [0, 5): the assertion inside the traced graph raises
    with pytest.raises(RuntimeError):
        torch._dynamo.explain(build_loss("ce", 5, ignore_index=IGN))(logits, target)
    torch._dynamo.reset()
    return autocast_nesting() - before


@pytest.fixture(params=["trace", "one", "two"])
def leaked_nesting(request):
    """Autocast's nesting count left too high, by a failed trace or by hand; restored after."""
    before = autocast_nesting()
    if request.param == "trace":
        _leak_by_a_failed_trace()
    else:
        for _ in range({"one": 1, "two": 2}[request.param]):
            torch.autocast_increment_nesting()
    yield autocast_nesting() - before
    while autocast_nesting() > before:
        torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()


def _train_bf16(steps: int = 4) -> torch.Tensor:
    """``steps`` SGD steps of a small conv net under bf16 autocast (``train_one_epoch``);
    its weights after them, flattened."""
    from cals_seg.training.engine import train_one_epoch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Dropout2d(0.3), torch.nn.Conv2d(8, 4, 1))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 4, (2, 8, 8), generator=g))
               for _ in range(steps)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    train_one_epoch(model, build_loss("ce", 4, ignore_index=IGN), batches, optimizer,
                    torch.device("cpu"), "bf16", progress=False)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_training_casts_the_current_weights_whatever_the_nesting_count(leaked_nesting):
    """With autocast's count left too high, ``torch.autocast`` never empties its cache of cast
    weights, and every forward pass after the first would use the first step's weights. Each
    training step here casts the weights the optimizer just wrote: the same weights, to the
    bit, as with a correct count."""
    leaked = _train_bf16()
    while autocast_nesting() > 0:
        torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()
    clean = _train_bf16()
    assert torch.equal(leaked, clean)


def test_inference_casts_the_current_weights_whatever_the_nesting_count(leaked_nesting):
    """The evaluation's forward pass (``autocast_context``) after the weights changed in place
    (a checkpoint loaded into the same module, a training step) uses the new weights."""
    from cals_seg.utils.precision import autocast_context

    layer = torch.nn.Linear(6, 3)
    x = torch.randn(4, 6)
    with torch.no_grad():
        with autocast_context(torch.device("cpu"), "bf16"):
            first = layer(x)
        layer.weight.mul_(-2.0)
        with autocast_context(torch.device("cpu"), "bf16"):
            second = layer(x)
        want = torch.nn.functional.linear(x.bfloat16(), layer.weight.bfloat16(),
                                          layer.bias.bfloat16())
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, want, rtol=0, atol=0)
