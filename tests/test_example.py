"""examples/train_smp_loop.py runs end to end and does what it says: one epoch in a few seconds."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_smp_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_smp_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_one_epoch_updates_multipliers_and_fits_temperature(capsys):
    pytest.importorskip("segmentation_models_pytorch")
    pytest.importorskip("albumentations")
    out = _load().main(["--epochs", "1", "--device", "cpu", "--margin", "0.5"])
    printed = capsys.readouterr().out
    assert "epoch 1:" in printed and "post-TS" in printed
    # the penalty prints as a clean number (never -5e-13), epochs count from 1
    assert re.search(r"\(penalty -?\d+\.\d{4}\)", printed), printed
    # the validation protocol moved the multipliers away from their initial value
    assert out["lambda"] != out["lambda_init"]
    assert all(math.isfinite(v) and v >= 1e-6 for v in out["lambda"])
    assert out["temperature"] > 0 and math.isfinite(out["temperature"])
    for key in ("test_pre_ts", "test_post_ts"):
        assert 0.0 <= out[key]["ece"] <= 1.0
    assert f"post-TS {100 * out['test_post_ts']['ece']:.2f}%" in printed
