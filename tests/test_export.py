"""Export: the .pt2 program and the ONNX model give the toolkit's calibrated probabilities (and
logits) within 1e-4, for several batch sizes and image sizes from one file."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cals_seg.config.schema import load_config
from cals_seg.evaluation.inference import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EvalProtocol,
    input_multiple,
    segment_logits,
)
from cals_seg.runs.export import export_run, written_files
from cals_seg.tasks.segmentation import build_model
from cals_seg.utils.io import load_checkpoint

from .conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]
# Sides that are and are not multiples of the output stride (16), batch sizes 1 to 3.
SHAPES = [(1, 3, 37, 45), (3, 3, 64, 64), (2, 3, 50, 33)]


def small_lraspp(num_classes: int = 11):
    """The factory ``tests.test_export:small_lraspp``: torchvision's LRASPP head (its pooled
    branch, its ``{"out": ...}`` dict) on four stride-2 convolutions instead of MobileNetV3
    (low features at stride 8, high at 16, as there): what torch.export traces is a few
    operations, the pooled branch's 1 x 1 case the same."""
    from torch import nn
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.lraspp import LRASPP

    def block(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, 2, 1), nn.BatchNorm2d(c_out),
                             nn.Hardswish())

    torch.manual_seed(0)
    body = nn.Sequential(block(3, 8), block(8, 8), block(8, 16), block(16, 32))
    return LRASPP(IntermediateLayerGetter(body, {"2": "low", "3": "high"}), 16, 32, num_classes,
                  inter_channels=16)


def _import_config(folder: Path, model: dict) -> Path:
    """``folder/config.yaml`` for tools/import_model.py: the synthetic set at 32 x 32 (2
    training images, half of them validation, and 1 test image) and ``model``."""
    import yaml

    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"name": "synthetic", "root": str(folder / "data"), "num_classes": 11,
                 "crop_size": 32, "val_fraction": 0.5,
                 "synthetic": {"num_train": 2, "num_test": 1, "image_size": 32}},
        "model": {"arch": "external", **model},
        "train": {"device": "cpu", "amp": "none", "progress": False},
        "eval": {"batch_size": 2, "num_maps": 0}}))
    return config


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A run imported by tools/import_model.py from :func:`small_lraspp` (random weights),
    padded to an output stride of 16 as the setup's DeepLabV3 (read only), and its network."""
    import warnings

    from cals_seg.runs.run import load_run

    folder = tmp_path_factory.mktemp("small")
    config = _import_config(folder, {"factory": "tests.test_export:small_lraspp",
                                     "output_stride": 16})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a random network's temperature at the boundary
        assert load_tool("import_model").main([str(config), "--out", str(folder / "run")]) == 0
    model = load_run(folder / "run", device="cpu", amp="none").model
    return folder / "run", model


@pytest.fixture(scope="module")
def run(trained_run):
    """The session's one-epoch run (the setup's ResNet-18 DeepLabV3, its fitted temperature;
    read only), its network and its temperature."""
    run_dir = trained_run.folder
    model = build_model(load_config(run_dir / "config.yaml"))
    model.load_state_dict(load_checkpoint(run_dir / "checkpoint_best.pt")["model"])
    temperature = json.loads((run_dir / "temperature.json").read_text())["temperature"]
    return run_dir, model.eval(), temperature


def _reference(model, images: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """The toolkit's own path: normalise, segment_logits (pad to the stride, crop), softmax."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    protocol = EvalProtocol(multiple=input_multiple(model))
    logits = segment_logits(model, (images / 255 - mean) / std, protocol)
    return logits if temperature is None else torch.softmax(logits / temperature, dim=1)


def _images(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g).float()


@pytest.fixture(scope="module")
def pt2_export(run, tmp_path_factory) -> tuple[Path, dict, str]:
    """The run's .pt2 export by tools/export.py with ``--calibrator ts`` where eval_seg has not
    fitted ``calibrators/ts.pt``: the run's own temperature, the program of the default export
    (``export_run(RUN, OUT, "pt2")``; one export for the tests of both); what it wrote to
    ``OUT.json`` and what it printed."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("pt2") / "model.pt2"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert load_tool("export").main([str(run[0]), "--format", "pt2", "--out", str(out),
                                         "--calibrator", "ts"]) == 0
    return out, json.loads(Path(f"{out}.json").read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def onnx_export(run, tmp_path_factory) -> Path:
    """The run's default ONNX export, written into a folder that held a stale
    ``model.onnx.data`` sidecar of an older export."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path_factory.mktemp("onnx") / "model.onnx"
    Path(f"{out}.data").write_bytes(b"stale sidecar of an older export")
    export_run(run[0], out, "onnx")
    return out


def test_pt2_program_equals_pytorch(run, pt2_export):
    _, model, temperature = run
    out, info, _ = pt2_export
    assert info["temperature"] == temperature and info["num_classes"] == 11
    assert info["class_names"][0] == "background"
    program = torch.export.load(out).module()
    assert temperature != 1.0
    for i, shape in enumerate(SHAPES):
        x = _images(shape, i)
        with torch.no_grad():
            got = program(x)
        want = _reference(model, x, temperature)
        assert got.shape == (shape[0], 11, *shape[2:])
        assert (got - want).abs().max() <= 1e-4, (shape, float((got - want).abs().max()))
        assert torch.allclose(got.sum(dim=1), torch.ones(()), atol=1e-5)


def test_onnx_model_equals_pytorch(run, onnx_export, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    _, model, temperature = run
    out = onnx_export
    # one self-contained file: no sidecar, and the .onnx copied alone elsewhere loads
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.json"]
    assert written_files(out) == [out, Path(f"{out}.json")]
    alone = tmp_path / "copy"
    alone.mkdir()
    (alone / "model.onnx").write_bytes(out.read_bytes())
    session = ort.InferenceSession(str(alone / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["image"]
    assert [o.name for o in session.get_outputs()] == ["probs"]
    for i, shape in enumerate(SHAPES):
        x = _images(shape, 10 + i)
        got = torch.from_numpy(session.run(None, {"image": x.numpy()})[0])
        want = _reference(model, x, temperature)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-4, (shape, float((got - want).abs().max()))


def test_tool_exports_logits(small_run, tmp_path, capsys):
    """--logits: the network's logits, padded to its stride and cropped (the setup's network's
    program: test_pt2_program_equals_pytorch; here a small one of the same stride)."""
    run_dir, model = small_run
    assert input_multiple(model) == 16
    out = tmp_path / "logits.pt2"
    tool = load_tool("export")
    assert tool.main([str(run_dir), "--format", "pt2", "--out", str(out), "--logits"]) == 0
    printed = capsys.readouterr().out
    assert "logits" in printed and f"wrote 2 files: {out}, {out}.json" in printed
    program = torch.export.load(out).module()
    x = _images((2, 3, 40, 48), 20)
    with torch.no_grad():
        got = program(x)
    assert (got - _reference(model, x, None)).abs().max() <= 1e-4


def test_calibrator_ts_without_a_fit_is_the_run_s_temperature(run, pt2_export):
    """--calibrator ts where eval_seg has not fitted calibrators/ts.pt: the run's own fitted
    temperature (what the flag meant before every calibrator was exportable), said (the
    program: test_pt2_program_equals_pytorch)."""
    run_dir, _, temperature = run
    out, info, printed = pt2_export
    assert not (run_dir / "calibrators" / "ts.pt").exists()
    assert "temperature.json, is used" in printed
    assert f"wrote 2 files: {out}, {out}.json" in printed
    assert info["calibrator"] == "ts" and info["temperature"] == temperature
    assert info["calibrator_file"].endswith("temperature.json")


def _link_big(src: str, dst: str) -> str:
    """Hard-link a file of 1 MiB or more (the checkpoints), copy the rest."""
    if os.path.getsize(src) >= 2**20:
        os.link(src, dst)
        return dst
    return shutil.copy2(src, dst)


def test_bad_requests_give_one_line_errors(run, tmp_path, capsys, monkeypatch):
    # a copy whose temperature.json is moved away for a while (its 137 MB checkpoints, only
    # read here, hard links)
    run_dir = tmp_path / run[0].name
    shutil.copytree(run[0], run_dir, copy_function=_link_big)
    tool = load_tool("export")
    assert tool.main([str(tmp_path / "nowhere"), "--format", "pt2", "--out", "m.pt2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # a run without temperature.json: ts is refused with the fix, none works
    (run_dir / "temperature.json").rename(tmp_path / "t.json")
    try:
        with pytest.raises(ValueError, match="--calibrator none"):
            export_run(run_dir, tmp_path / "x.pt2", "pt2")
    finally:
        (tmp_path / "t.json").rename(run_dir / "temperature.json")
    with pytest.raises(ValueError, match=r"--calibrator: expected one of \['none', 'ts', "):
        export_run(run_dir, tmp_path / "x.pt2", "pt2", calibrator="nosuch")
    # a registered calibrator that eval_seg has not fitted: the command that fits it
    with pytest.raises(FileNotFoundError, match="--calibrators dirichlet"):
        export_run(run_dir, tmp_path / "x.pt2", "pt2", calibrator="dirichlet")
    with pytest.raises(ValueError, match="--logits outputs the network's raw logits"):
        export_run(run_dir, tmp_path / "x.pt2", "pt2", calibrator="boundary_ts", logits=True)
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(ImportError, match=r'pip install "cals_seg\[export\]"'):
        export_run(run_dir, tmp_path / "x.onnx", "onnx")


# ----------------------------------------------------------------------------- outside cals_seg
def _doc_block(contains: str) -> str:
    """The python block of docs/integrations.md that holds ``contains``."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    blocks = [b.split("\n", 1)[1] for b in text.split("```python")[1:]]
    found = [b.split("```")[0] for b in blocks if contains in b.split("```")[0]]
    assert len(found) == 1, f"docs/integrations.md: {len(found)} python blocks hold {contains!r}"
    return found[0]


def test_documented_loading_runs_without_cals_seg(pt2_export, onnx_export, tmp_path):
    """docs/integrations.md's loading block, run as written in a folder holding the default
    .pt2 and .onnx exports (with their .json) and an image, in a process where cals_seg cannot
    be imported."""
    import subprocess

    import numpy as np
    from PIL import Image

    for program in (pt2_export[0], onnx_export):
        for path in (program, Path(f"{program}.json")):
            shutil.copyfile(path, tmp_path / path.name)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (37, 45, 3), dtype=np.uint8)).save(tmp_path / "photo.png")
    code = "import sys\nsys.modules['cals_seg'] = None  # torch and onnxruntime alone\n" + \
        _doc_block("torch.export.load(")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = done.stdout.splitlines()[-2:]
    assert first.startswith("ts none ")  # calibrator, precision (float32), a class name
    assert float(second) <= 1e-4  # ONNX and .pt2 agree


def test_docs_table_lists_every_calibrator_in_both_formats():
    """The calibrator x format table of docs/integrations.md has a row per registered
    calibrator, each exported in both formats (none is refused at present); the contrib one
    too (imported here, as tests/test_export_calibrators.py does, whatever else ran before)."""
    import cals_seg.contrib.boundary_conf_ts  # noqa: F401  (registers boundary_ts_conf)
    from cals_seg.calibrators import CALIBRATORS
    from cals_seg.runs.export import REFUSED

    rows = {}
    for line in (ROOT / "docs" / "integrations.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:3]
    assert set(rows) == {"none", *CALIBRATORS}
    for name, (pt2, onnx) in rows.items():
        for fmt, cell in (("pt2", pt2), ("onnx", onnx)):
            want = f"refused: {REFUSED[name, fmt]}" if (name, fmt) in REFUSED else "exported"
            assert cell == want, (name, fmt, cell)


# ------------------------------------------------------------------ one line, not a traceback
def test_unwritable_output_is_one_line(run, tmp_path, capsys, monkeypatch):
    """An output folder that cannot be written (read-only, a path under a file, a full disk)
    ends in one line naming the path, exit status 2, no traceback."""
    run_dir, _, _ = run
    tool = load_tool("export")
    (tmp_path / "file").write_text("x")
    assert tool.main([str(run_dir), "--format", "pt2", "--out",
                      str(tmp_path / "file" / "m.pt2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a file" in err, err
    if os.geteuid() != 0:  # root writes into a read-only folder: the case below stands for it
        readonly = tmp_path / "readonly"
        readonly.mkdir()
        readonly.chmod(0o555)
        assert tool.main([str(run_dir), "--format", "pt2", "--out",
                          str(readonly / "m.pt2")]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro" / "m.pt2"))

    monkeypatch.setattr(torch.export, "save", refuse)
    # refused before the program is used: no trace needed to reach the write
    monkeypatch.setattr("cals_seg.runs.export.trace_program", lambda *args, **kwargs: (None, 17))
    assert tool.main([str(run_dir), "--format", "pt2", "--out", str(tmp_path / "ro" / "m.pt2"),
                      "--calibrator", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Permission denied" in err, err
    assert not (tmp_path / "ro" / "m.pt2.json").exists()


def test_torchvision_lraspp_exports_at_the_defaults(small_run, tmp_path, capsys):
    """torchvision's LRASPP imported with import_model exports at the default smallest side
    (found: 17, where its pooled branch's 1 x 1 case would tie the program; the fixed default of
    16 ended in 77 lines of torch.export), and --min-size 16 is refused naming 17 (on
    :func:`small_lraspp`, the same head on a small body: the refusal traces twice)."""
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large

    torch.manual_seed(0)
    net = lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=11).eval()
    torch.save(net.state_dict(), tmp_path / "lraspp.pt")
    config = _import_config(tmp_path, {"factory": "torchvision:lraspp_mobilenet_v3_large",
                                       "weights": str(tmp_path / "lraspp.pt")})
    run_dir = tmp_path / "run"
    import_model = load_tool("import_model")  # before pytest.warns: the tools' warning printer
    with pytest.warns(UserWarning):  # a random network's temperature at the search boundary
        assert import_model.main([str(config), "--out", str(run_dir)]) == 0
    out = tmp_path / "lraspp.pt2"
    assert load_tool("export").main([str(run_dir), "--format", "pt2", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    info = json.loads(Path(f"{out}.json").read_text())
    assert info["input"]["min_size"] == 17
    program = torch.export.load(out).module()
    for h, w in ((17, 17), (17, 40), (33, 18)):
        x = torch.rand(1, 3, h, w) * 255
        with torch.no_grad():
            assert program(x).shape == (1, 11, h, w)
    capsys.readouterr()
    assert load_tool("export").main([str(small_run[0]), "--format", "pt2", "--out",
                                     str(tmp_path / "small.pt2"), "--min-size", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "use --min-size 17" in err, err
