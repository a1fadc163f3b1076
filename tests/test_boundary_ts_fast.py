"""boundary_ts's apply path: the blocked arg-max and the one-byte distance map give exactly
``temperatures[band]`` of the int64 bands, and ``argmax_map`` equals ``argmax(dim=1)``."""

from __future__ import annotations

import pytest
import torch

from cals_seg.calibrators import build_calibrator
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.metrics import functional
from cals_seg.metrics.distance import boundary_mask, capped_squared_distance
from cals_seg.metrics.functional import argmax_map


def _logits(n: int, k: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, k, (n, 1, h // 4 + 1, w // 4 + 1), generator=g).float()
    regions = torch.nn.functional.interpolate(coarse, scale_factor=4)[:, 0, :h, :w].long()
    x = torch.randn(n, k, h, w, generator=g)
    x.scatter_add_(1, regions.unsqueeze(1), torch.full((n, 1, h, w), 2.0))
    x[:, :, :3, :3] = 0.5  # ties: the first class wins
    return x


@pytest.mark.parametrize("seed", range(3))
def test_argmax_map_equals_argmax(seed, monkeypatch):
    x = _logits(2, [3, 19, 40][seed], 23, 37, seed).round(decimals=1)  # many ties
    assert torch.equal(argmax_map(x), x.argmax(dim=1))
    monkeypatch.setattr(functional, "BLOCK_ELEMENTS", 1)  # blocks of 64 positions
    assert torch.equal(argmax_map(x), x.argmax(dim=1))
    assert torch.equal(argmax_map(x.double()), x.argmax(dim=1))


@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.5, 2.0, 5.0), (12.0,)])
def test_temperature_map_is_the_gather_of_the_bands(bands):
    k = 5
    x = _logits(2, k, 40, 52, seed=len(bands))
    cal = build_calibrator("boundary_ts", k, bands=bands)
    cal.temperatures.copy_(torch.linspace(0.5, 3.0, len(bands) + 1))
    band = predicted_bands(x, bands)
    assert torch.equal(band, predicted_bands(x.double(), bands))
    want = cal.temperatures[band]
    assert torch.equal(cal.temperature_map(x), want)
    with torch.no_grad():
        assert torch.equal(cal(x), x / want.unsqueeze(1))


def test_capped_distance_dtype_and_limit():
    b = boundary_mask(_logits(1, 4, 30, 41, seed=9).argmax(dim=1))
    assert capped_squared_distance(b, 64).dtype == torch.uint8
    assert capped_squared_distance(b, 200).dtype == torch.int16
    full = capped_squared_distance(b, 30**2 + 41**2).long()
    for limit in (1, 9, 64, 121, 122, 200):
        got = capped_squared_distance(b, limit)
        assert torch.equal(got.long(), full.clamp(max=limit)), limit
