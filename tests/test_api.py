"""The public API: ``import cals_seg`` is light and every name in ``__all__`` resolves."""

from __future__ import annotations

import subprocess
import sys

import cals_seg


def test_import_does_not_pull_heavy_dependencies():
    code = (
        "import cals_seg, sys; "
        "heavy = [m for m in ('matplotlib', 'albumentations', 'segmentation_models_pytorch') "
        "if m in sys.modules]; "
        "assert not heavy, heavy; "
        "cals_seg.build_loss, cals_seg.CalibrationMeter, cals_seg.fit_temperature; "
        "heavy = [m for m in ('matplotlib', 'albumentations', 'segmentation_models_pytorch') "
        "if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names():
    from cals_seg.calibrators.ts import TemperatureScaler, fit_temperature
    from cals_seg.losses import LOSSES, build_loss
    from cals_seg.metrics import CalibrationMeter, SegmentationMeter

    assert isinstance(cals_seg.__version__, str) and cals_seg.__version__.count(".") >= 2
    for name in cals_seg.__all__:
        assert getattr(cals_seg, name) is not None
    assert cals_seg.build_loss is build_loss and cals_seg.LOSSES is LOSSES
    assert cals_seg.CalibrationMeter is CalibrationMeter
    assert cals_seg.SegmentationMeter is SegmentationMeter
    assert cals_seg.fit_temperature is fit_temperature
    assert cals_seg.TemperatureScaler is TemperatureScaler
    assert {cls.__name__ for cls in LOSSES.values()} <= set(cals_seg.__all__)
