"""Binning edge cases other libraries got wrong, for every meter and every calibrator fit:

- a confidence of exactly 1.0 (float32 / bf16 softmax of a saturated pixel) lands in the last
  of the ``n_bins`` bins, never in an extra one (torchmetrics issue 3510);
- a probability of exactly 0 lands in the first bin (class-wise ECE);
- bf16 logits give the numbers of their exact float32 upcast;
- every pixel in one bin: ECE = MCE = |accuracy - confidence|;
- a fit that leaves a calibrator at the identity says so (netcal issues 48 and 61).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import cals_seg.contrib.boundary_conf_ts  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.calibrators import CALIBRATORS, Calibrator, build_calibrator
from cals_seg.metrics import (
    BoundaryAwareECEMeter,
    BoundaryCalibrationMeter,
    CalibrationMeter,
    ObjectSizeCalibrationMeter,
    SegmentationMeter,
    ShotGroupMeter,
)

VOID = 255
K = 3
BINS = 15


def _target(n: int = 2, h: int = 10, w: int = 10) -> torch.Tensor:
    y = torch.zeros(n, h, w, dtype=torch.long)
    y[:, 3:8, 2:6] = 1  # an object: boundaries, rings and an object size
    y[:, 0, :] = VOID
    y[1, 6:, 6:] = 2
    return y


def _saturated(target: torch.Tensor, gap: float = 200.0) -> torch.Tensor:
    """Class 0 predicted with a logit gap of ``gap``: float32 softmax gives exactly 1.0 / 0."""
    x = torch.zeros(target.shape[0], K, *target.shape[1:])
    x[:, 0] = gap
    return x


def _meters() -> dict[str, torch.nn.Module]:
    return {
        "calibration": CalibrationMeter(K, BINS, VOID),
        "boundary": BoundaryCalibrationMeter(K, n_bins=BINS, ignore_index=VOID),
        "rings": BoundaryAwareECEMeter(K, n_bins=BINS, ignore_index=VOID),
        "size": ObjectSizeCalibrationMeter(K, areas=(10,), n_bins=BINS, ignore_index=VOID),
        "shots": ShotGroupMeter([500, 50, 5], BINS, VOID),
        "segmentation": SegmentationMeter(K, VOID),
    }


def test_confidence_exactly_one_is_in_the_last_bin_of_every_meter():
    y = _target()
    x = _saturated(y)
    assert bool((x.softmax(1).amax(1) == 1.0).all())  # the case under test
    valid = y != VOID
    n, acc = int(valid.sum()), float((y[valid] == 0).double().mean())
    out = {name: m for name, m in _meters().items()}
    for m in out.values():
        m.update(x, y)
    cal = out["calibration"].compute()
    rel = cal["reliability"]
    assert len(rel["count"]) == BINS and len(rel["bin_edges"]) == BINS + 1
    assert rel["count"][-1] == n and sum(rel["count"]) == n
    assert cal["ece"] == pytest.approx(1 - acc, abs=1e-12)
    assert cal["mce"] == pytest.approx(1 - acc, abs=1e-12)
    assert cal["ece_over"] == pytest.approx(cal["ece"], abs=1e-15)
    for name, suffix in (("boundary", "band"), ("rings", "ring"), ("size", "size")):
        res = out[name].compute()
        for g, count in enumerate(res[f"count_{suffix}"]):
            if count:
                assert res[f"ece_{suffix}"][g] == pytest.approx(1 - res[f"acc_{suffix}"][g],
                                                                abs=1e-12)
            if f"reliability_{suffix}" in res:
                bins = res[f"reliability_{suffix}"][g]["count"]
                assert len(bins) == BINS and bins[-1] == count == sum(bins)
    assert sum(out["rings"].compute()["count_ring"]) == n
    shots = out["shots"].compute()["groups"]
    assert sum(g["count"] or 0 for g in shots.values()) == n
    for g in shots.values():
        if g["count"]:
            assert g["ece"] == pytest.approx(1 - g["acc"], abs=1e-12)


@pytest.mark.parametrize("inputs", ["logits", "probs"])
def test_probability_exactly_zero_is_in_the_first_bin(inputs):
    """K = 2, class 0 predicted with p = 1 and class 1 with p = 0 exactly; a fraction ``a`` of
    the pixels is class 0. Class-wise ECE: class 0 ``|a - 1|``, class 1 ``|(1 - a) - 0|``."""
    y = torch.zeros(1, 4, 5, dtype=torch.long)
    y[0, :1] = 1  # a = 15 / 20
    x = torch.zeros(1, 2, 4, 5)
    x[:, 0] = 200.0
    if inputs == "probs":
        x = x.softmax(1)
    assert bool((x.softmax(1)[:, 1] == 0).all()) if inputs == "logits" else bool(
        (x[:, 1] == 0).all())
    meter = CalibrationMeter(2, BINS, classwise=True, inputs=inputs)
    meter.update(x, y)
    out = meter.compute()
    a = 0.75
    assert out["classwise_ece"] == pytest.approx([1 - a, 1 - a], abs=1e-12)
    assert out["cwce"] == pytest.approx(1 - a, abs=1e-12)
    assert meter.cw_hits.shape == (2, BINS)
    assert int(meter.cw_hits[1, 0]) == 5 and int(meter.cw_hits[1].sum()) == 5  # p = 0: bin 0


def test_bf16_logits_give_the_numbers_of_their_float32_upcast():
    g = torch.Generator().manual_seed(0)
    y = _target(3, 12, 12)
    x = (torch.randn(3, K, 12, 12, generator=g) * 4).to(torch.bfloat16)
    x[0, 1, :4] = 120.0  # bf16 softmax of a saturated pixel
    results = []
    for logits in (x, x.float()):
        meters = _meters()
        for m in meters.values():
            m.update(logits, y)
        results.append({k: m.compute() for k, m in meters.items()})
    assert results[0] == results[1]


def test_every_pixel_in_one_bin():
    y = _target()
    valid = y != VOID
    c = 0.7
    x = torch.zeros(y.shape[0], 2, *y.shape[1:])
    x[:, 0] = math.log(c / (1 - c))
    conf = float(x.softmax(1)[:, 0].flatten()[0])
    y2 = torch.where(valid, (y > 0).long(), y)  # two classes; class 0 predicted everywhere
    acc = float((y2[valid] == 0).double().mean())
    meter = CalibrationMeter(2, BINS, VOID)
    meter.update(x, y2)
    out = meter.compute()
    assert sum(1 for k in out["reliability"]["count"] if k) == 1
    assert out["ece"] == pytest.approx(abs(acc - conf), abs=1e-7)
    assert out["mce"] == pytest.approx(abs(acc - conf), abs=1e-7)
    # all correct: the adaptive bins agree too
    right = torch.where(valid, torch.zeros_like(y), y)
    meter = CalibrationMeter(2, BINS, VOID)
    meter.update(x, right)
    out = meter.compute()
    assert out["ece"] == pytest.approx(1 - conf, abs=1e-7)
    assert out["aece"] == pytest.approx(1 - conf, abs=1e-6)


# ------------------------------------------------------------------------ calibrator fits
FAST = {"boundary_ts_fine": {"holdout_every": 2},
        "boundary_ts_conf": {"holdout_every": 2, "min_count": 5},
        "dirichlet": {"max_iter": 15}, "vector": {"max_iter": 15},
        "cms_ap": {"max_iter": 15, "holdout_every": 2},
        "cms_op": {"max_iter": 15, "holdout_every": 2},
        "lts": {"epochs": 1, "holdout_every": 2, "use_image": False},
        "image_ts": {"max_iter": 5, "holdout_every": 2, "use_image": False},
        "selective": {"epochs": 1, "holdout_every": 2, "steps_per_batch": 2,
                      "pixels_per_step": 64}}


def _fit_data(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    y = _target(4, 10, 10)
    x = torch.randn(4, K, 10, 10, generator=g) * 3
    x[:, 0, 5:, :] += 200.0  # confidence exactly 1.0
    x = x.to(dtype)
    return lambda: [(x[:2], y[:2]), (x[2:], y[2:])], x


def _fitted(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    cal = build_calibrator(name, K, **FAST.get(name, {}))
    batches, x = _fit_data(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search-boundary notes on this tiny set
        info = cal.fit(batches, ignore_index=VOID)
    return cal, info, x


@pytest.mark.parametrize("name", sorted(CALIBRATORS))
def test_every_calibrator_fits_saturated_and_bf16_logits(name):
    low, _, x16 = _fitted(name, torch.bfloat16)
    cal, info, x = _fitted_upcast(name, x16)  # bf16 fit == fit on the exact float32 upcast
    for (k, a), b in zip(low.state_dict().items(), cal.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name}.{k}")
    assert isinstance(info["identity"], bool)
    for value in cal.state_dict().values():
        if value.is_floating_point():
            assert bool(torch.isfinite(value).all()), name
    out = cal(x.float())
    assert bool(torch.isfinite(out).all())
    if not cal.changes_argmax:
        assert torch.equal(out.argmax(1), x.argmax(1))


def _fitted_upcast(name: str, x16: torch.Tensor):
    torch.manual_seed(0)
    cal = build_calibrator(name, K, **FAST.get(name, {}))
    y = _target(4, 10, 10)
    x = x16.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = cal.fit(lambda: [(x[:2], y[:2]), (x[2:], y[2:])], ignore_index=VOID)
    return cal, info, x


class _DoesNothing(Calibrator):
    name = "noop"

    def fit(self, batches, ignore_index=-100):
        self.fit_info = {}
        return self.fit_info

    def forward(self, logits, image=None):
        return logits


def test_a_fit_that_leaves_the_identity_says_so():
    y = _target()
    x = torch.randn(y.shape[0], K, *y.shape[1:])
    with pytest.warns(UserWarning, match="identity"):
        info = _DoesNothing(K).fit(lambda: [(x, y)], VOID)
    assert info["identity"] is True
    # a real one: every temperature gives the same probabilities on uniform logits
    ts = build_calibrator("ts", K)
    with pytest.warns(UserWarning, match="identity"):
        ts.fit(lambda: [(torch.zeros_like(x), y)], VOID)
    assert ts.fit_info["identity"] is True
    # and a fit that moves says it did not
    ts = build_calibrator("ts", K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ts.fit(lambda: [(x * 5, y)], VOID)
    assert ts.fit_info["identity"] is False
