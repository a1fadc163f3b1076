"""The public API: ``import cals_seg`` is light and every name in ``__all__`` resolves."""

from __future__ import annotations

import subprocess
import sys

import cals_seg


def test_imports_pull_heavy_dependencies_only_when_used():
    """``import cals_seg`` and its top names load no plotting, augmentation or network library;
    the modules every command imports load no network library (smp, timm) and no augmentation
    library (albumentations: about a second of imports); building a pipeline loads
    albumentations, and the pipelines still work. One interpreter for all of it."""
    code = (
        "import sys\n"
        "import cals_seg\n"
        "heavy = ('matplotlib', 'albumentations', 'segmentation_models_pytorch')\n"
        "early = [m for m in heavy if m in sys.modules]\n"
        "assert not early, early\n"
        "cals_seg.build_loss, cals_seg.CalibrationMeter, cals_seg.fit_temperature\n"
        "early = [m for m in heavy if m in sys.modules]\n"
        "assert not early, early\n"
        "import cals_seg.commands.eval_seg, cals_seg.commands.predict_seg, cals_seg.runs.run\n"
        "import cals_seg.tasks, cals_seg.data.transforms, cals_seg.data.classification\n"
        "lazy = ('albumentations', 'segmentation_models_pytorch', 'timm')\n"
        "early = [m for m in lazy if m in sys.modules]\n"
        "assert not early, early\n"
        "import numpy as np\n"
        "from cals_seg.data.transforms import train_transform, eval_transform\n"
        "from cals_seg.data.classification import classification_eval_transform\n"
        "image, mask = np.zeros((5, 9, 3), np.uint8), np.zeros((5, 9), np.uint8)\n"
        "out = train_transform(8)(image=image, mask=mask)\n"
        "assert tuple(out['image'].shape) == (3, 8, 8), out['image'].shape\n"
        "assert str(out['mask'].dtype) == 'torch.int64', out['mask'].dtype\n"
        "out = eval_transform(None)(image=image, mask=mask)\n"
        "assert tuple(out['image'].shape) == (3, 5, 9), out['image'].shape\n"
        "assert tuple(classification_eval_transform(8)(image).shape) == (3, 8, 8)\n"
        "assert 'albumentations' in sys.modules\n"
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
    from cals_seg.calibrators import build_calibrator, load_calibrator, save_calibrator
    from cals_seg.calibrators.ts import TemperatureScaling
    from cals_seg.evaluation.conformal import ConformalSets
    from cals_seg.runs.run import load_run

    assert cals_seg.build_calibrator is build_calibrator
    assert cals_seg.save_calibrator is save_calibrator
    assert cals_seg.load_calibrator is load_calibrator
    assert cals_seg.TemperatureScaling is TemperatureScaling
    assert cals_seg.ConformalSets is ConformalSets
    assert cals_seg.load_run is load_run
    assert {cls.__name__ for cls in LOSSES.values()  # the core's (contrib: opt-in, apart)
            if not cls.__module__.startswith("cals_seg.contrib.")} <= set(cals_seg.__all__)


def test_calibrator_api_round_trip(tmp_path):
    """Build, fit, save and load through the top-level names; the loaded calibrator gives the
    same output."""
    import torch

    torch.manual_seed(0)
    logits = torch.randn(4, 3, 5, 5) * 3
    target = logits.argmax(1)
    target[0, 0, 0] = (target[0, 0, 0] + 1) % 3
    cal = cals_seg.build_calibrator("ts", 3)
    cal.fit(lambda: iter([(logits, target)]))
    path = tmp_path / "ts.pt"
    cals_seg.save_calibrator(cal, path)
    loaded = cals_seg.load_calibrator(path)
    torch.testing.assert_close(loaded(logits), cal(logits), rtol=0, atol=0)
    assert float(cal.temperature) != 1.0


def test_deprecated_names_warn_and_keep_working():
    import warnings

    import pytest
    import torch

    from cals_seg.calibrators.ts import TemperatureScaling
    from cals_seg.evaluation import conformal_eval

    with pytest.warns(DeprecationWarning, match="TemperatureScaling.fixed"):
        old = cals_seg.TemperatureScaler(2.0)
    new = TemperatureScaling.fixed(2.0)
    x = torch.randn(2, 4, 3)
    torch.testing.assert_close(old(x), new(x), rtol=0, atol=0)
    assert old.state_dict().keys() == new.state_dict().keys()
    with pytest.warns(DeprecationWarning, match="ConformalTestView"):
        assert conformal_eval.ConformalSets is conformal_eval.ConformalTestView
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TemperatureScaling.fixed(1.5)
