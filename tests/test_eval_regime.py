"""eval_seg says when a network is under-confident (its validation temperature interval below
1: a margin penalty cannot help) in one line and in metrics.json, and says nothing otherwise;
planted networks that predict the background everywhere (right on about three quarters of the
valid pixels of the embedded set) with a planted confidence: low (under-confident) or near 1
(over-confident)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from cals_seg.commands import eval_seg, import_model

from ._figures_skipped import figures_skipped

K = 11
# The cases check eval_seg's line and metrics.json, never its figures: those are not even built
# here (tests/_figures_skipped.py: figures_skipped; building them undrawn was most of an
# evaluation's time); anything else is saved undrawn.
pytestmark = pytest.mark.usefixtures("undrawn_figures", "no_figures")


@pytest.fixture(scope="module")
def no_figures() -> Iterator[None]:
    with figures_skipped():
        yield


class Background(nn.Module):
    """Logits ``(bias, 0, ..., 0)`` at every pixel: the background class, with confidence
    ``e^bias / (e^bias + K - 1)``."""

    def __init__(self, bias: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, K, 1)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.bias.zero_()
            self.conv.bias[0] = bias

    def forward(self, x):
        return self.conv(x)


def background(bias: float = 0.0) -> nn.Module:
    return Background(bias)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("regime")


@pytest.mark.parametrize("bias,under", [(0.5, True), (2.0, True), (9.0, False), (14.0, False)])
def test_under_confidence_line(root, tmp_path, capsys, bias, under):
    cfg = {
        "data": {"name": "synthetic", "root": str(root / "synthetic"), "num_classes": K,
                 "crop_size": 32, "val_fraction": 0.5,
                 "synthetic": {"num_train": 12, "num_test": 2, "image_size": 32}},
        "model": {"arch": "external", "factory": "tests.test_eval_regime:background",
                  "params": {"bias": bias}},
        "train": {"device": "cpu", "amp": "none", "progress": False},
        "eval": {"batch_size": 4, "num_maps": 0},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    assert import_model.main([str(config), "--out", str(run)]) == 0
    capsys.readouterr()
    assert eval_seg.main([str(run), "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    lines = [line for line in out.splitlines() if line.startswith("under-confident")]
    if under:
        assert len(lines) == 1 and "--calibrators" in lines[0] and str(run) in lines[0]
        record = metrics["under_confident"]
        assert record["T_interval"][1] < 1 and record["advice"] == lines[0]
    else:
        assert not lines and "under_confident" not in metrics
    # an evaluation that fits a post-hoc calibrator: the record, but not the hint to fit one
    assert eval_seg.main([str(run), "--out", str(tmp_path / "ts"), "--calibrators", "ts"]) == 0
    out = capsys.readouterr().out
    fitted = json.loads((tmp_path / "ts" / "metrics.json").read_text())
    assert not [line for line in out.splitlines() if line.startswith("under-confident")]
    assert ("under_confident" in fitted) == under
