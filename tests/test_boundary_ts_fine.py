"""``boundary_ts_fine``: the band set is the one a held-out reference picks (fitted on the other
validation images, scored by float64 NLL), its temperatures are ``boundary_ts``'s on all of
validation, it beats ``boundary_ts`` where the true temperature follows the distance finely, and
it keeps the argmax."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cals_seg.calibrators import (
    BoundaryTemperatureScaling,
    build_calibrator,
    load_calibrator,
    save_calibrator,
)
from cals_seg.metrics.regions import boundary_pixels, squared_boundary_distance

K = 3


def _scene(seed: int, n: int = 15, size: int = 48):
    """Logits with a fixed gap 4 on a blocky predicted map; labels drawn from
    ``softmax(l / T(d))`` with ``T`` falling smoothly from 3 on the predicted boundary to 0.5 at
    6 pixels (blocks of 16 pixels), so a profile finer than (3, 8) fits it better."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, K, (n, 1, 3, 3), generator=g).float()
    pred = F.interpolate(blocks, size=(size, size), mode="nearest")[:, 0].long()
    d = torch.from_numpy(np.sqrt(squared_boundary_distance(boundary_pixels(pred.numpy(), -1))))
    d = torch.nan_to_num(d, posinf=20.0)
    temp = 3.0 - 2.5 * (d.clamp(max=6.0) / 6.0)
    logits = 4.0 * F.one_hot(pred, K).permute(0, 3, 1, 2).float()
    probs = (logits / temp.unsqueeze(1)).softmax(1)
    target = torch.multinomial(probs.permute(0, 2, 3, 1).reshape(-1, K), 1, generator=g)
    return logits, target.view(n, size, size)


def _batches(x, y):
    return lambda: [(x[i:i + 3], y[i:i + 3]) for i in range(0, x.shape[0], 3)]


def _nll(z, y):
    return float(F.cross_entropy(z.double(), y))


def test_choice_is_the_held_out_reference_and_refit_on_all_validation(tmp_path):
    x, y = _scene(0)
    cal = build_calibrator("boundary_ts_fine", K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = cal.fit(_batches(x, y))
        # reference: each candidate fitted on the images not held out (j % 5 != 4), scored on
        # images 4, 9 and 14 in float64
        held = [j for j in range(x.shape[0]) if j % 5 == 4]
        fit = [j for j in range(x.shape[0]) if j % 5 != 4]
        scores = []
        for bands in cal.params["candidates"]:
            single = BoundaryTemperatureScaling(K, bands)
            single.fit(_batches(x[fit], y[fit]))
            scores.append(_nll(single(x[held]), y[held]))
        best = int(np.argmin(scores))
        assert info["heldout_nll"] == pytest.approx(scores, abs=1e-9)
        assert int(cal.choice) == best and best > 0  # a finer set than boundary_ts's wins
        full = BoundaryTemperatureScaling(K, cal.params["candidates"][best])
        full.fit(_batches(x, y))
    n = full.temperatures.numel()
    assert torch.equal(cal.temperatures[:n], full.temperatures)
    assert torch.equal(cal.temperatures[n:], torch.ones(cal.temperatures.numel() - n))
    # on fresh data from the same law it beats boundary_ts, and keeps the argmax
    xt, yt = _scene(1)
    coarse = BoundaryTemperatureScaling(K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coarse.fit(_batches(x, y))
    assert _nll(cal(xt), yt) < _nll(coarse(xt), yt) < _nll(xt, yt)
    assert torch.equal(cal(xt).argmax(1), xt.argmax(1))
    path = save_calibrator(cal, tmp_path / "boundary_ts_fine.pt")
    torch.testing.assert_close(load_calibrator(path)(xt), cal(xt))
