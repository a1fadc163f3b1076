"""The evaluation with the region meters' ground-truth analysis made where the data is loaded
(the ``val``/``test`` items carry ``group_fn`` maps) gives exactly the metrics of the meters
analysing the masks themselves: the one test pass (``run_test_pass``, what ``eval_seg`` and the
trainer's final test run) with and without the maps, in worker processes, on mixed-size
splits and in slide mode."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from cals_seg.config.schema import load_config
from cals_seg.data.transforms import eval_transform
from cals_seg.evaluation.engine import run_test_pass
from cals_seg.evaluation.inference import EvalProtocol
from cals_seg.evaluation.stream import GROUPS_PREFIX, Inference, group_fns, group_key
from cals_seg.metrics import (
    BoundaryAwareECEMeter,
    BoundaryCalibrationMeter,
    ObjectSizeCalibrationMeter,
    SegmentationMeter,
)
from cals_seg.tasks import build_task
from cals_seg.training.engine import make_loader

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "synthetic_deeplabv3_cals_alm.yaml"
VOID = 255


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Exactly equal trees (floats bit for bit, NaN equal to NaN)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), (path, got)
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


class Stripped(Dataset):
    """The items of ``dataset`` without their group maps: the meters analyse the masks."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {k: v for k, v in self.dataset[i].items() if not k.startswith(GROUPS_PREFIX)}


@pytest.fixture()
def analysed(monkeypatch) -> list[str]:
    """The names of the region meters that analysed a mask themselves (BoundaryAwareECEMeter,
    which always does, not counted)."""
    calls: list[str] = []
    for cls in (BoundaryCalibrationMeter, ObjectSizeCalibrationMeter):
        original = cls.group_map

        def spy(self, target, _original=original):
            calls.append(type(self).__name__)
            return _original(self, target)

        monkeypatch.setattr(cls, "group_map", spy)
    return calls


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    cfg = load_config(CONFIG, [
        f"output_dir={tmp / 'runs'}", f"data.root={tmp / 'data'}",
        "data.synthetic={num_train: 8, num_test: 5, image_size: 32}", "data.crop_size=32",
        "train.threads=1", "model.params={encoder_output_stride: 16, decoder_channels: 16}",
    ])
    torch.manual_seed(0)
    return build_task(cfg)


def test_val_and_test_items_carry_their_meters_maps(task):
    """``val``: the validation meters' band maps; ``test``: bands and object sizes; each map
    the meter's own analysis of the item's mask; train items carry none."""
    val_meters, test_meters = task.meters(), task.meters(test=True)
    val_keys = set(group_fns(val_meters.values()))
    test_keys = set(group_fns(test_meters.values()))
    assert val_keys == {group_key(val_meters["boundary"].group_fn())}
    assert test_keys == val_keys | {group_key(test_meters["size"].group_fn())}
    for split, meters in (("val", val_meters), ("test", test_meters)):
        item = getattr(task, f"{split}_set")[0]
        assert {k for k in item if k.startswith(GROUPS_PREFIX)} == set(group_fns(meters.values()))
        for meter in meters.values():
            key = group_key(meter.group_fn()) if hasattr(meter, "group_fn") else None
            if key in item:
                assert item[key].dtype == torch.uint8
                assert torch.equal(item[key].long(), meter.group_map(item["mask"][None])[0])
    assert not any(k.startswith(GROUPS_PREFIX) for k in task.train_set[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_test_pass_equals_the_meters_own_analysis(task, analysed, num_workers):
    """The one test pass (raw and temperature-scaled views, batches of 2 over 5 images) with
    the loader's maps equals it without them, every metric exactly; with the maps no band or
    size meter analyses a mask in the main process."""
    infer = Inference(task.model, torch.device("cpu"), "none", task.protocol)

    def meters():
        return task.meters(15, test=True)

    def run(dataset):
        from cals_seg.calibrators.ts import TemperatureScaler

        loader = make_loader(dataset, 2, train=False, num_workers=num_workers)
        return run_test_pass(infer, loader, meters, temperature=1.7,
                             calibrators={"ts": TemperatureScaler(1.3)})

    given = run(task.test_set)
    assert analysed == []
    own = run(Stripped(task.test_set))
    assert sorted(set(analysed)) == ["BoundaryCalibrationMeter", "ObjectSizeCalibrationMeter"]
    assert given["post_ts"] is not None and given["calibrators"]["ts"]
    assert_same(given, own)


# ------------------------------------------------------------- mixed sizes and slide mode
class Shapes(Dataset):
    """Images of several sizes (two of the same size, so that a batch may stack) with random
    blob masks and some void; items from ``eval_transform(None)`` with ``fns`` as extras."""

    SIZES = ((21, 30), (21, 30), (17, 25), (26, 19), (12, 12))

    def __init__(self, fns: dict) -> None:
        self.transform = eval_transform(None, ignore_index=VOID)
        self.transform.add_extra_inputs(fns)

    def __len__(self) -> int:
        return len(self.SIZES)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(100 + i)
        h, w = self.SIZES[i]
        coarse = rng.integers(0, 4, (h // 4 + 1, w // 4 + 1))
        mask = np.kron(coarse, np.ones((4, 4), np.int64))[:h, :w].astype(np.uint8)
        mask[rng.random((h, w)) < 0.03] = VOID
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        return self.transform(image=image, mask=mask)


class Blobs(nn.Module):
    """A tiny convolutional net whose logits depend on the neighbourhood (so tiles differ)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, k, 3,
                                                                                     padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * 3


DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["whole", "slide"])
def test_mixed_sizes_and_slide_mode(analysed, mode, device):
    """Ragged batches (images at their own size, one at a time) and slide mode (a stacked
    batch split image by image): the maps are split with their targets, and the metrics equal
    those of the meters' own analysis (on CUDA: the maps moved to the device against the
    meters' device transform)."""
    k = 4

    def meters():
        return {"boundary": BoundaryCalibrationMeter(k, bands=(2.0, 5.0), ignore_index=VOID),
                "rings": BoundaryAwareECEMeter(k, ignore_index=VOID),
                "size": ObjectSizeCalibrationMeter(k, areas=(20, 60), ignore_index=VOID,
                                                   background_index=0),
                "segmentation": SegmentationMeter(k, VOID)}

    fns = group_fns(meters().values())
    assert len(fns) == 2
    protocol = EvalProtocol(mode=mode, window=16, stride=11, multiple=1, tile_batch=3)
    infer = Inference(Blobs(k).to(device), torch.device(device), "none", protocol)
    dataset = Shapes(fns)
    given = run_test_pass(infer, make_loader(dataset, 2, train=False), meters, temperature=0.8)
    assert analysed == []
    own = run_test_pass(infer, make_loader(Stripped(dataset), 2, train=False), meters,
                        temperature=0.8)
    assert analysed
    assert_same(given, own)
    assert given["pre_ts"]["ece_band"] != given["post_ts"]["ece_band"]
