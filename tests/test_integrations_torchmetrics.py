"""The torchmetrics wrappers give the meters' numbers, streamed, in a MetricCollection and on two
gloo processes (states summed by torchmetrics)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys

import pytest
import torch

from cals_seg.metrics import CalibrationMeter, SegmentationMeter

from ._dist import run_distributed

if importlib.util.find_spec("torchmetrics") is None:
    pytest.skip("torchmetrics is not installed", allow_module_level=True)


class _Imported:
    """A module imported at its first attribute: torchmetrics takes seconds to import, which
    every xdist worker paid while collecting this file, whether or not it runs it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


tm = _Imported("torchmetrics")
ctm = _Imported("cals_seg.integrations.torchmetrics")

VOID = 255
K = 6


def _data(seed: int = 0, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K, 20, 18, generator=g) * 3
    logits[:, 2] += 30.0 * (torch.rand(n, 20, 18, generator=g) < 0.2)  # saturated positions
    target = torch.randint(0, K, (n, 20, 18), generator=g)
    target[torch.rand(n, 20, 18, generator=g) < 0.15] = VOID
    return logits, target


def _reference(logits, target, n_bins=15):
    cal = CalibrationMeter(K, n_bins=n_bins, ignore_index=VOID)
    seg = SegmentationMeter(K, ignore_index=VOID)
    cal.update(logits, target)
    seg.update(logits, target)
    c, s = cal.compute(), seg.compute()
    return {"ece": c["ece"], "aece": c["aece"], "cwce": c["cwce"], "miou": s["miou"],
            "nll": c["nll"]}


def _metrics(n_bins=15):
    return {
        "ece": ctm.ECE(K, n_bins=n_bins, ignore_index=VOID),
        "aece": ctm.AdaptiveECE(K, n_bins=n_bins, ignore_index=VOID),
        "cwce": ctm.ClasswiseECE(K, n_bins=n_bins, ignore_index=VOID),
        "miou": ctm.MeanIoU(K, ignore_index=VOID),
        "all": ctm.CalibrationMetrics(K, n_bins=n_bins, ignore_index=VOID),
    }


def _check(got: dict, want: dict) -> None:
    for key in ("ece", "aece", "cwce", "miou"):
        value = float(got[key])
        assert math.isclose(value, want[key], rel_tol=1e-12, abs_tol=1e-15), (key, value, want)
    assert math.isclose(got["all"]["nll"], want["nll"], rel_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wrappers_equal_the_meters_streamed(seed):
    logits, target = _data(seed)
    want = _reference(logits, target, n_bins=10)
    metrics = _metrics(n_bins=10)
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        for m in metrics.values():
            m.update(logits[sl], target[sl])
    _check({k: m.compute() for k, m in metrics.items()}, want)
    assert metrics["ece"].compute().dtype == torch.float64


def test_metric_collection_and_reset():
    logits, target = _data(3)
    want = _reference(logits, target)
    collection = tm.MetricCollection({k: v for k, v in _metrics().items() if k != "all"})
    collection.update(logits, target)
    got = collection.compute()
    for key in ("ece", "aece", "cwce", "miou"):
        assert math.isclose(float(got[key]), want[key], rel_tol=1e-12), key
    collection.reset()
    collection.update(logits[:2], target[:2])
    again = _reference(logits[:2], target[:2])
    assert math.isclose(float(collection.compute()["ece"]), again["ece"], rel_tol=1e-12)
    # nothing valid seen: NaN, not an error
    empty = ctm.ECE(K, ignore_index=VOID)
    empty.update(logits[:1], torch.full_like(target[:1], VOID))
    assert math.isnan(float(empty.compute()))


def test_probabilities_are_refused_as_logits():
    logits, target = _data(4, n=2)
    with pytest.raises(ValueError, match="inputs='probs'"):
        ctm.ECE(K, ignore_index=VOID).update(logits.softmax(dim=1), target)
    m = ctm.ECE(K, ignore_index=VOID, inputs="probs")
    m.update(logits.softmax(dim=1), target)
    assert math.isclose(float(m.compute()), _reference(logits, target)["ece"], abs_tol=1e-5)


# Rank 0 sees images 0-2 in two updates, rank 1 images 3-5 in one.
_SHARDS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 6)]}


def _rank_fn(rank: int, world: int, want: dict) -> None:
    logits, target = _data(5)
    metrics = _metrics()
    for sl in _SHARDS[rank]:
        for m in metrics.values():
            m.update(logits[sl], target[sl])
    _check({k: m.compute() for k, m in metrics.items()}, want)
    # the local states are the rank's own (compute synced copies)
    local = CalibrationMeter(K, ignore_index=VOID)
    for sl in _SHARDS[rank]:
        local.update(logits[sl], target[sl])
    assert torch.equal(metrics["ece"].bin_count, local.bin_count)


def test_wrappers_under_two_processes():
    logits, target = _data(5)
    run_distributed(_rank_fn, 2, _reference(logits, target), start_method="fork")


def test_missing_torchmetrics_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchmetrics", None)
    monkeypatch.delitem(sys.modules, "cals_seg.integrations.torchmetrics", raising=False)
    with pytest.raises(ImportError, match=r'pip install "cals_seg\[lightning\]"'):
        importlib.import_module("cals_seg.integrations.torchmetrics")
