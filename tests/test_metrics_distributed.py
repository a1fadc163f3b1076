"""The meters on two gloo CPU processes give the numbers of one process over the union."""

from __future__ import annotations

import torch

from cals_seg.metrics import CalibrationMeter, SegmentationMeter

from ._dist import run_distributed
from .conftest import assert_tree_close

VOID = 255
K = 5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Six images; image 4 is entirely void (skipped by the per-image means)."""
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, K, (6, 24, 20), generator=g)
    logits = torch.randn(6, K, 24, 20, generator=g) * 3
    logits[:, 0] += 40.0 * (torch.rand(6, 24, 20, generator=g) < 0.3)  # saturated positions
    target[torch.rand(6, 24, 20, generator=g) < 0.2] = VOID
    target[4] = VOID
    return logits, target


# Rank 0 sees images 0-2 in two updates, rank 1 images 3-5 in one.
_SHARDS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 6)]}


def _rank_fn(rank: int, world: int, expected: dict, expected_more: dict) -> None:
    logits, target = _data()
    cal = CalibrationMeter(K, n_bins=10, ignore_index=VOID)
    seg = SegmentationMeter(K, ignore_index=VOID)
    for sl in _SHARDS[rank]:
        cal.update(logits[sl], target[sl])
        seg.update(logits[sl], target[sl])
    local = {name: t.clone() for name, t in cal.state_dict().items()}
    first = {"cal": cal.compute(), "seg": seg.compute()}
    assert_tree_close(first, expected)
    # compute() reduced copies: the local states are untouched, a second call is identical.
    for name, t in cal.state_dict().items():
        assert torch.equal(t, local[name]), name
    assert {"cal": cal.compute(), "seg": seg.compute()} == first
    # update continues after compute: both ranks add image 0 once more.
    cal.update(logits[:1], target[:1])
    seg.update(logits[:1], target[:1])
    assert_tree_close({"cal": cal.compute(), "seg": seg.compute()}, expected_more)


def _one_process(extra: int) -> dict:
    logits, target = _data()
    cal = CalibrationMeter(K, n_bins=10, ignore_index=VOID)
    seg = SegmentationMeter(K, ignore_index=VOID)
    for sl in [*_SHARDS[0], *_SHARDS[1]] + [slice(0, 1)] * extra:
        cal.update(logits[sl], target[sl])
        seg.update(logits[sl], target[sl])
    return {"cal": cal.compute(), "seg": seg.compute()}


def test_two_gloo_ranks_equal_one_process():
    expected, expected_more = _one_process(0), _one_process(2)
    assert expected["cal"]["num_images"] == 5  # the void image is skipped
    run_distributed(_rank_fn, 2, expected, expected_more, start_method="fork")
