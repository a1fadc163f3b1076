"""The device-side boundary distances (cals_seg.metrics.distance) against scipy's exact
Euclidean distance transform and the numpy bands of the region meters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.metrics.distance import boundary_mask, capped_squared_distance, label_map_bands
from cals_seg.metrics.regions import boundary_bands, boundary_pixels

ndimage = pytest.importorskip("scipy.ndimage")


def _maps(seed: int, n: int, h: int, w: int, k: int, cell: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, k, (n, 1, -(-h // cell), -(-w // cell)), generator=g).float()
    out = F.interpolate(coarse, scale_factor=cell, mode="nearest")[:, 0, :h, :w].long()
    noise = torch.rand(n, h, w, generator=g) < 0.01
    return torch.where(noise, torch.randint(0, k, (n, h, w), generator=g), out)


def _ref_squared(boundary: np.ndarray) -> np.ndarray:
    out = np.full(boundary.shape, np.inf)
    for i, b in enumerate(boundary):
        if b.any():
            out[i] = np.rint(ndimage.distance_transform_edt(~b) ** 2)
    return out


@pytest.mark.parametrize(("seed", "shape", "k", "cell"), [
    (0, (2, 37, 53), 3, 9), (1, (1, 64, 40), 2, 20), (2, (3, 1, 30), 4, 5),
    (3, (2, 30, 1), 3, 4), (4, (1, 50, 50), 1, 50), (5, (2, 45, 70), 5, 30),
])
def test_squared_distance_matches_scipy(seed, shape, k, cell):
    labels = _maps(seed, *shape, k, cell)
    if k == 1:
        labels[:] = 0  # no boundary at all
    b = boundary_mask(labels)
    assert torch.equal(b, torch.from_numpy(boundary_pixels(labels.numpy(), -1)))
    ref = _ref_squared(b.numpy())
    h, w = shape[1:]
    for limit in (1, 9, 64, 65, 200, h * h + w * w + 1):
        got = capped_squared_distance(b, limit).numpy()
        assert np.array_equal(got, np.minimum(ref, limit)), limit


@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.0,), (2.5, 5.0, 7.5), (0.5, 1.5)])
def test_bands_equal_the_numpy_bands(bands):
    labels = _maps(7, 2, 60, 75, 4, 12)
    expected = boundary_bands(labels.numpy(), bands)
    assert torch.equal(label_map_bands(labels, bands), torch.from_numpy(expected))


def test_predicted_bands_of_boundary_ts():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 40, 33, generator=g)
    logits[:, 2, :20] += 4.0
    pred = logits.argmax(dim=1).numpy()
    assert torch.equal(predicted_bands(logits, (3.0, 8.0)),
                       torch.from_numpy(boundary_bands(pred, (3.0, 8.0))))


def test_ground_truth_bands_with_void_equal_the_loss_bands():
    """cals_alm_bands' device map equals the numpy distance_bands (void: -1, a void neighbour
    counts as different, a void pixel is no boundary pixel)."""
    from cals_seg.contrib.cals_bands import distance_bands  # registers cals_alm_bands
    from cals_seg.losses import build_loss

    labels = _maps(11, 2, 41, 57, 3, 10)
    g = torch.Generator().manual_seed(11)
    labels[torch.rand(labels.shape, generator=g) < 0.05] = 255
    labels[:, 10:14, 20:30] = 255
    loss = build_loss("cals_alm_bands", 3, ignore_index=255, bands=[2.0, 5.5])
    expected = distance_bands(labels.numpy(), (2.0, 5.5), 255)
    assert torch.equal(loss.band_map(labels), torch.from_numpy(expected))
