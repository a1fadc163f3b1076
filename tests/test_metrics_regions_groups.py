"""The region meters given their ground-truth analysis (``update(..., groups=...)``, the maps
of ``group_fn`` made where the data is loaded) equal the meters computing it themselves;
their blocked binning equals a one-block run; bad ``groups`` are refused by name."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from cals_seg.metrics import BoundaryAwareECEMeter, BoundaryCalibrationMeter, regions
from cals_seg.metrics import ObjectSizeCalibrationMeter as SizeMeter

from .test_metrics_regions import VOID, make_logits, make_maps

BUILDERS = {
    "bands": lambda k: BoundaryCalibrationMeter(k, ignore_index=VOID),
    "bands_fine": lambda k: BoundaryCalibrationMeter(k, bands=(1.5, 2.0, 5.0),
                                                     ignore_index=VOID),
    "sizes": lambda k: SizeMeter(k, areas=(10, 60), ignore_index=VOID),
    "sizes_bg": lambda k: SizeMeter(k, areas=(5, 30, 200), ignore_index=VOID,
                                    background_index=0),
}


def _states(meter) -> dict[str, torch.Tensor]:
    return {s.name: getattr(meter, s.name).clone() for s in meter.states}


def _loader_maps(meter, target: torch.Tensor) -> torch.Tensor:
    """What a data loader would give: group_fn per mask (after a pickle round trip, as a
    worker process gets it), collated."""
    fn = pickle.loads(pickle.dumps(meter.group_fn()))
    return torch.stack([torch.as_tensor(fn(t.numpy())) for t in target])


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("seed", range(3))
def test_given_groups_equal_the_meter_computing_them(name, seed):
    k = [3, 4, 6][seed]
    target = make_maps(n=3, k=k, h=29 + seed, w=41, seed=10 + seed, void=0.05 * seed)
    logits = make_logits(target, k, seed=20 + seed)
    if seed == 2:
        target[1] = VOID  # an all-void image
    own, given = BUILDERS[name](k), BUILDERS[name](k)
    for sl in (slice(0, 2), slice(2, 3)):  # streamed, two batches
        own.update(logits[sl], target[sl])
        maps = _loader_maps(given, target[sl])
        assert maps.dtype == torch.uint8
        given.update(logits[sl], target[sl], groups=maps)
    a, b = _states(own), _states(given)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert own.compute() == given.compute()
    # the maps are the meter's own analysis
    assert torch.equal(_loader_maps(given, target).long(), own.group_map(target))


@pytest.mark.parametrize("name", ["bands", "sizes_bg"])
def test_blocked_binning_equals_one_block(name, monkeypatch):
    k = 5
    target = make_maps(n=2, k=k, h=33, w=40, seed=3)
    logits = make_logits(target, k, seed=4)
    one = BUILDERS[name](k)
    one.update(logits, target)
    monkeypatch.setattr(regions, "_BLOCK_ELEMENTS", 2 * k * 7)  # blocks of 7 positions
    many = BUILDERS[name](k)
    many.update(logits, target)
    for key, value in _states(one).items():
        assert torch.equal(value, getattr(many, key)), key


def test_bad_groups_are_refused():
    k = 4
    target = make_maps(n=2, k=k, seed=5)
    logits = make_logits(target, k, seed=6)
    meter = BoundaryCalibrationMeter(k, ignore_index=VOID)
    good = _loader_maps(meter, target)
    with pytest.raises(ValueError, match="Expected `groups` of the target's shape"):
        meter.update(logits, target, groups=good[:1])
    with pytest.raises(ValueError, match="Expected `groups` to be an integer tensor"):
        meter.update(logits, target, groups=good.float())
    with pytest.raises(ValueError, match=r"Expected `groups` values in \[0, 3\]"):
        meter.update(logits, target, groups=good.long() + 4)
    assert int(meter.bin_count.sum()) == 0  # nothing added
    ba = BoundaryAwareECEMeter(k, ignore_index=VOID)
    with pytest.raises(ValueError, match="computes its rings itself"):
        ba.update(logits, target, groups=good)
    ba.update(logits, target)  # and standalone it still works
    assert int(ba.bin_count.sum()) == int((target != VOID).sum())


def test_group_fn_through_the_loader_seam():
    """SegmentationTransform.add_extra_inputs runs group_fn on the transformed mask."""
    from cals_seg.data.transforms import eval_transform

    k = 4
    meter = SizeMeter(k, areas=(10, 60), ignore_index=VOID, background_index=0)
    transform = eval_transform(None)
    transform.add_extra_inputs({"groups": meter.group_fn()})
    mask = make_maps(n=1, k=k, h=24, w=32, seed=8)[0].numpy().astype(np.uint8)
    image = np.random.default_rng(0).integers(0, 255, (24, 32, 3), dtype=np.uint8)
    item = transform(image=image, mask=mask)
    assert torch.equal(item["groups"].long(), meter.group_map(item["mask"][None])[0])


# ------------------------------------------------------------------ CalibrationMeter blocks
@pytest.mark.parametrize("classwise", [True, False])
def test_calibration_blocks_equal_one_block(classwise, monkeypatch):
    """Blocks of 64 positions give the one-block states: counts exactly, float64 sums up to
    their summation order."""
    from cals_seg.metrics import CalibrationMeter, calibration

    k = 6
    target = make_maps(n=2, k=k, h=31, w=37, seed=11)
    logits = make_logits(target, k, seed=12) * 3
    one = CalibrationMeter(k, ignore_index=VOID, classwise=classwise)
    one.update(logits, target)
    monkeypatch.setattr(calibration, "_BLOCK_ELEMENTS", 1)  # 64 positions per block
    many = CalibrationMeter(k, ignore_index=VOID, classwise=classwise)
    many.update(logits, target)
    for key, value in _states(one).items():
        if value.dtype == torch.int64:
            assert torch.equal(value, getattr(many, key)), key
        else:
            torch.testing.assert_close(getattr(many, key), value, rtol=1e-12, atol=1e-12)


def test_max_argmax_equals_torch_max():
    from cals_seg.metrics.functional import max_argmax

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for k in (2, 5, 19, 150, 300):
            x = torch.randint(-3, 3, (3, k, 257), generator=g).to(dtype)  # many ties
            x[0, :, 0] = -3e38
            x[0, k - 1, 0] = 3e38
            x[1, :, 1] = 1e-45  # subnormal, all tied
            x[2, :, 2] = torch.arange(k, dtype=dtype) * 1e-30
            maxima, index = max_argmax(x)
            want_max, want_index = x.max(dim=1)
            assert torch.equal(maxima, want_max) and torch.equal(index, want_index), (dtype, k)


def test_given_groups_are_not_modified():
    k = 4
    target = make_maps(n=2, k=k, seed=13)
    logits = make_logits(target, k, seed=14)
    for dtype in (torch.int32, torch.int64, torch.uint8):
        meter = BoundaryCalibrationMeter(k, ignore_index=VOID)
        maps = _loader_maps(meter, target).to(dtype)
        kept = maps.clone()
        meter.update(logits, target, groups=maps)
        assert torch.equal(maps, kept), dtype
