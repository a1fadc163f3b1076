"""A run folder is data: the ``model.factory`` its config names is imported only for a known
model builder, with ``--trust-code`` / ``trust_code=True``, or with consent the user gave on this
machine (``import_model`` of their own config); every other callable is refused before anything
is imported, by every command that reads a run folder (cals_seg.models.consent)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from torch import nn

from cals_seg.commands import compare, eval_seg, export, import_model, margin, predict_seg
from cals_seg.commands._cli import run_config, training_parser
from cals_seg.models.consent import (
    UntrustedCodeError,
    check_consent,
    code_consent,
    is_known_builder,
    remember,
    remembered,
)
from cals_seg.runs.run import load_run

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

K = 11
PAYLOAD = "cals_seg_test_payload"  # a module that, if imported, leaves a marker file


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, K, 1)

    def forward(self, x):
        return self.conv(x)


def tiny() -> nn.Module:
    """The factory ``tests.test_consent:tiny`` of the imported run."""
    return Tiny()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """A run imported from the user's own config naming ``tests.test_consent:tiny``."""
    root = tmp_path_factory.mktemp("consent")
    cfg = {
        "data": {"name": "synthetic", "root": str(root / "synthetic"), "num_classes": K,
                 "crop_size": 32, "val_fraction": 0.5,
                 "synthetic": {"num_train": 2, "num_test": 1, "image_size": 32}},
        "model": {"arch": "external", "factory": "tests.test_consent:tiny"},
        "train": {"device": "cpu", "amp": "none", "progress": False},
        "eval": {"batch_size": 2, "num_maps": 0, "temperature_scaling": False},
    }
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run = root / "run"
    assert import_model.main([str(config), "--out", str(run)]) == 0
    return run


@pytest.fixture()
def payload(tmp_path, monkeypatch) -> Path:
    """A module importable by name that would write ``marker`` when imported."""
    marker = tmp_path / "marker"
    (tmp_path / f"{PAYLOAD}.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "import torch\n"
        "def build(**kw):\n    return torch.nn.Conv2d(3, 11, 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(PAYLOAD, None)
    return marker


def received(imported: Path, tmp_path: Path, factory: str, params: dict | None = None) -> Path:
    """A copy of ``imported`` whose config names ``factory`` (as a run folder someone sent)."""
    run = tmp_path / "received"
    shutil.copytree(imported, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["factory"] = factory
    cfg["model"]["params"] = params or {}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def an_image(tmp_path: Path) -> Path:
    path = tmp_path / "img.png"
    Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(path)
    return path


COMMANDS = {
    "eval_seg": lambda run, tmp: eval_seg.main([str(run), "--out", str(tmp / "ev")]),
    "predict_seg": lambda run, tmp: predict_seg.main([str(run), str(an_image(tmp)), "--out",
                                                      str(tmp / "pred")]),
    "export": lambda run, tmp: export.main([str(run), "--format", "pt2", "--out",
                                            str(tmp / "m.pt2")]),
    "compare": lambda run, tmp: compare.main([str(run), "--out", str(tmp / "cmp")]),
    "margin_gaps": lambda run, tmp: margin.main(["gaps", str(run), "--out",
                                                 str(tmp / "gaps.json")]),
}
# Callables outside the known builders, as an attacker or a typo would name them.
FOREIGN = [
    ("os:system", {"command": "touch {marker}"}),
    ("shutil:rmtree", {"path": "{victim}"}),
    ("runpy:run_path", {"path_name": "{victim}/payload.py"}),
    ("subprocess:call", {"args": ["touch", "{marker}"]}),
    ("builtins:exec", {}),
    (f"{PAYLOAD}:build", {}),
    ("torchvision.io:write_file", {"filename": "{marker}", "data": [1]}),
    ("timm:create_model", {"model_name": "resnet18"}),
    ("segmentation_models_pytorch.encoders:get_encoder", {}),
]


def _fill(params: dict, marker: Path, victim: Path) -> dict:
    fill = lambda v: v.format(marker=marker, victim=victim) if isinstance(v, str) else v  # noqa: E731
    return {k: [fill(x) for x in v] if isinstance(v, list) else fill(v) for k, v in params.items()}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("factory,params", FOREIGN, ids=[f for f, _ in FOREIGN])
def test_foreign_factory_is_refused_before_import(imported, tmp_path, payload, capsys, command,
                                                  factory, params):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "payload.py").write_text(f"open({str(payload)!r}, 'w').write('ran')\n")
    run = received(imported, tmp_path, factory, _fill(params, payload, victim))
    before = set(sys.modules)
    code = COMMANDS[command](run, tmp_path)
    err = capsys.readouterr().err
    assert code != 0
    assert not payload.exists() and victim.is_dir() and (victim / "payload.py").is_file()
    assert PAYLOAD not in sys.modules
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in
                {"runpy", "subprocess", PAYLOAD}}
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert any(factory in line for line in lines), err
    if factory.split(":")[0].split(".")[0] not in {"torchvision", "timm",
                                                   "segmentation_models_pytorch"}:
        assert any("--trust-code" in line for line in lines), err
    assert "Traceback" not in err


def test_trust_code_flag_allows_the_factory(imported, tmp_path, payload, capsys):
    run = received(imported, tmp_path, "tests.test_consent:tiny")
    assert not remembered(run, "tests.test_consent:tiny")
    assert eval_seg.main([str(run), "--out", str(tmp_path / "a")]) != 0
    assert eval_seg.main([str(run), "--out", str(tmp_path / "b"), "--trust-code"]) == 0, \
        capsys.readouterr().err
    with pytest.raises(UntrustedCodeError, match="--trust-code"):
        load_run(run)
    assert load_run(run, trust_code=True).model is not None


def test_remembered_consent_is_per_folder_and_factory(imported, tmp_path, payload):
    # import_model of the user's own config remembered its factory for that folder only
    assert remembered(imported, "tests.test_consent:tiny")
    assert load_run(imported).model is not None
    run = received(imported, tmp_path, f"{PAYLOAD}:build")  # same content, another folder
    with pytest.raises(UntrustedCodeError):
        load_run(run)
    remember(run, "tests.test_consent:tiny")
    with pytest.raises(UntrustedCodeError):  # consent for another factory does not carry
        load_run(run)
    assert not payload.exists()
    # consent is never read from the folder itself
    assert not any("consent" in p.name for p in imported.rglob("*"))


def test_resume_of_a_received_folder_needs_consent(imported, tmp_path, payload):
    run = received(imported, tmp_path, f"{PAYLOAD}:build")
    shutil.copy(run / "checkpoint_best.pt", run / "checkpoint_last.pt")
    args = training_parser(None).parse_args(["--resume", str(run)])
    with pytest.raises(Exception, match="--trust-code") as err:
        run_config(args)
    assert isinstance(err.value, UntrustedCodeError) or "checkpoint" not in str(err.value)
    assert not payload.exists() and PAYLOAD not in sys.modules


def test_known_builders_are_decided_from_the_string():
    from torchvision.models import list_models

    for name in list_models():
        assert is_known_builder(f"torchvision:{name}") or True  # the short form: built below
        assert is_known_builder(f"torchvision.models:{name}")
    import timm

    for name in timm.list_models()[::97]:
        assert is_known_builder(f"timm:{name}")
    for name in ("unet", "deeplabv3plus", "Unet"):
        assert is_known_builder(f"segmentation_models_pytorch:{name}")
    rng = np.random.default_rng(0)
    words = ["os", "sys", "shutil", "runpy", "pickle", "my_pkg.models", "torchvisionx",
             "timm_extra", "subprocess", "importlib", "builtins"]
    for _ in range(40):
        module = str(rng.choice(words))
        name = "".join(rng.choice(list("abcdefghij_"), size=6))
        factory = f"{module}:{name}"
        assert not is_known_builder(factory)
        with code_consent(False), pytest.raises(UntrustedCodeError, match=factory):
            check_consent(factory, "RUN/config.yaml")
        with code_consent(True):
            check_consent(factory)  # allowed: no error
    for factory in ("torchvision.io:write_file", "timm:create_model", "torchvision:not_a_net"):
        assert not is_known_builder(factory) or factory.startswith("torchvision:")


def test_known_builder_without_flag(tmp_path, capsys):
    """A torchvision builder named by its module path is built without --trust-code (no
    download: its weights are None)."""
    from cals_seg.models.external import build_network

    with code_consent(False):
        net = build_network("torchvision.models.segmentation:lraspp_mobilenet_v3_large", K)
    assert isinstance(net, nn.Module)
    with code_consent(False), pytest.raises(Exception, match="not imported"):
        build_network("torchvision.io:write_file", K, {"filename": str(tmp_path / "x")})
    assert not (tmp_path / "x").exists()
