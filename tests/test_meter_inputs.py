"""Meters refuse probabilities passed as logits, and take them when built with inputs='probs'.

Generated cases: softmax outputs (several shapes, dtypes and class counts) must raise; logits
that are non-negative but do not sum to 1 must pass; a meter built with ``inputs="probs"``
gives the numbers of the logits meter on ``softmax(logits)``.
"""

from __future__ import annotations

import pytest
import torch

from cals_seg.metrics import (
    BoundaryCalibrationMeter,
    CalibrationMeter,
    ObjectSizeCalibrationMeter,
    SegmentationMeter,
    ShotGroupMeter,
)
from cals_seg.metrics.functional import PROBE_POSITIONS, looks_like_probabilities

from .conftest import assert_tree_close

VOID = 255


def _meters(k: int, inputs: str = "logits", spatial: bool = True) -> dict[str, torch.nn.Module]:
    out = {
        "calibration": CalibrationMeter(k, ignore_index=VOID, inputs=inputs),
        "segmentation": SegmentationMeter(k, ignore_index=VOID, inputs=inputs),
        "groups": ShotGroupMeter([100 * (i + 1) for i in range(k)], ignore_index=VOID,
                                 inputs=inputs),
    }
    if spatial:
        out["boundary"] = BoundaryCalibrationMeter(k, ignore_index=VOID, inputs=inputs)
        out["size"] = ObjectSizeCalibrationMeter(k, areas=(4, 16), ignore_index=VOID,
                                                 inputs=inputs)
    return out


def _case(seed: int, shape: tuple[int, ...], k: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    n, *s = shape
    logits = torch.randn(n, k, *s, generator=g) * scale
    target = torch.randint(0, k, (n, *s), generator=g)
    target[torch.rand(target.shape, generator=g) < 0.1] = VOID
    return logits, target


CASES = [  # (seed, (N, *S), K)
    (0, (2, 9, 11), 3),
    (1, (1, 64, 80), 21),  # 5120 positions: more than PROBE_POSITIONS, so a strided probe
    (2, (3, 5, 4), 2),
    (3, (4,), 5),  # classification-shaped (N, K)
]


@pytest.mark.parametrize("seed,shape,k", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_softmax_outputs_are_refused_with_the_fix(seed, shape, k, dtype):
    logits, target = _case(seed, shape, k)
    probs = logits.softmax(dim=1).to(dtype)  # rounding to dtype: sums within its tolerance
    for name, meter in _meters(k, spatial=len(shape) == 3).items():
        with pytest.raises(ValueError, match="inputs='probs'") as err:
            meter.update(probs, target)
        assert "\n" not in str(err.value), name
        assert "before the softmax" in str(err.value), name
    # The same logits pass.
    for meter in _meters(k, spatial=len(shape) == 3).values():
        meter.update(logits.to(dtype), target)


@pytest.mark.parametrize("seed", range(6))
def test_non_negative_logits_that_do_not_sum_to_one_pass(seed):
    g = torch.Generator().manual_seed(100 + seed)
    k = int(torch.randint(2, 12, (1,), generator=g))
    n, h, w = 2, 7, 6
    target = torch.randint(0, k, (n, h, w), generator=g)
    cases = {
        "uniform [0, 5)": torch.rand(n, k, h, w, generator=g) * 5,
        # Rows summing to 1 + 0.01 (beyond float32's 1e-3 tolerance).
        "sums 1.01": torch.rand(n, k, h, w, generator=g).softmax(dim=1) * 1.01,
        # Probabilities everywhere but one position with a negative value.
        "one negative": torch.rand(n, k, h, w, generator=g).softmax(dim=1),
        # Probabilities everywhere but one position whose row sums to 2.
        "one row off": torch.rand(n, k, h, w, generator=g).softmax(dim=1),
        "zeros": torch.zeros(n, k, h, w),
    }
    cases["one negative"][1, 0, 3, 2] = -1e-3
    cases["one row off"][0, :, 6, 5] *= 2
    for label, scores in cases.items():
        assert not looks_like_probabilities(scores.reshape(n, k, -1), 1e-3), label
        for meter in _meters(k).values():
            meter.update(scores, target)


def test_probe_is_strided_and_bounded():
    """Beyond PROBE_POSITIONS positions only an evenly spaced sample is examined."""
    k, h, w = 3, 100, 100  # 2 x 10_000 positions > PROBE_POSITIONS
    probs = torch.rand(2, k, h, w).softmax(dim=1)
    assert looks_like_probabilities(probs.reshape(2, k, -1), 1e-3)
    total = 2 * h * w
    m = PROBE_POSITIONS
    probed = torch.arange(m) * total // m
    off = torch.ones(total, dtype=torch.bool)
    off[probed] = False
    first_unprobed = int(off.nonzero()[0])
    moved = probs.clone().reshape(2, k, -1)
    moved[first_unprobed // (h * w), :, first_unprobed % (h * w)] += 1.0
    assert looks_like_probabilities(moved, 1e-3)  # an unprobed position: not seen (documented)
    moved[0, :, int(probed[1])] += 1.0
    assert not looks_like_probabilities(moved, 1e-3)


@pytest.mark.parametrize("seed,shape,k", CASES)
def test_probs_meters_give_the_logits_numbers(seed, shape, k):
    logits, target = _case(seed, shape, k, scale=2.0)
    spatial = len(shape) == 3
    by_logits, by_probs = _meters(k, spatial=spatial), _meters(k, "probs", spatial=spatial)
    for half in (slice(0, 1), slice(1, None)):  # streamed over two batches
        for name in by_logits:
            by_logits[name].update(logits[half], target[half])
            by_probs[name].update(logits[half].softmax(dim=1), target[half])
    for name in by_logits:
        a, b = by_logits[name].compute(), by_probs[name].compute()
        # log(p) round trip: confidences move by float32 rounding; a position may change fine
        # cell (adaptive ECE / AURC), which moves those by far less than 1e-4.
        assert_tree_close(a, b, rel=1e-4, abs_=1e-4, path=name)


def test_probs_meter_refuses_logits_and_bad_inputs_names_the_choices():
    logits, target = _case(7, (2, 6, 6), 4)
    with pytest.raises(ValueError, match="inputs='logits'"):
        CalibrationMeter(4, ignore_index=VOID, inputs="probs").update(logits, target)
    with pytest.raises(ValueError, match=r"Expected `inputs` to be one of \['logits', 'probs'\]"):
        CalibrationMeter(4, inputs="probabilities")
    with pytest.raises(ValueError, match="inputs"):
        SegmentationMeter(4, inputs="softmax")


def test_nan_logits_are_reported_as_nan_not_as_probabilities():
    logits, target = _case(8, (1, 5, 5), 3)
    logits[0, :, 2, 2] = float("nan")
    with pytest.raises(ValueError) as err:
        CalibrationMeter(3, ignore_index=VOID).update(logits, target)
    assert "probabilities" not in str(err.value)
