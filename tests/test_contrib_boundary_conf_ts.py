"""``boundary_ts_conf``: the pieces against float64 loop references (log-odds, quantile edges,
bins, the per-cell grid NLL), the fitted temperatures are the per-cell TS optima of the cells
it defines (an independent ``fit_temperature`` per cell), streaming equals one batch, the
``Q = 1`` candidates score like ``boundary_ts``, and where the temperature follows the
confidence inside a band it is chosen and beats ``boundary_ts``; the argmax is kept. It lives in
``cals_seg/contrib/`` (opt-in): importing the module registers it."""

from __future__ import annotations

import math
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
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.contrib.boundary_conf_ts import (
    HIST_BINS,
    HIST_STEP,
    U_MIN,
    UNUSED,
    _quantile_edges,
    cell_grid_nll,
    conf_bins,
    confidence_logodds,
)

K = 3
VOID = 255


def test_logodds_of_the_confidence_against_float64():
    x = torch.tensor([[2.0, 0.5, -1.0], [0.0, 0.0, 0.0], [200.0, 0.0, 0.0], [1.0, 3.0, 3.0]])
    u = confidence_logodds(x[:, :, None, None])
    for i, row in enumerate(x.double()):
        if i == 2:
            continue  # saturated: 1 - s is 0 in float64 too (checked below)
        p = row.softmax(0)
        s = float(p.max())
        top = int(row.argmax())
        # log s - log(1 - s) with 1 - s summed from the other classes (exact near s = 1)
        ref = math.log(s) - math.log(float(p.sum() - p[top]))
        assert float(u[i, 0, 0]) == pytest.approx(ref, rel=1e-6, abs=1e-5)
    assert float(u[2, 0, 0]) == pytest.approx(200.0 - math.log(2.0), rel=1e-7)  # s == 1.0 in f32


def test_quantile_edges_and_bins_by_hand():
    hist = torch.zeros(2, HIST_BINS, dtype=torch.int64)
    hist[0, 1000] = 10  # band 0: 10 pixels at histogram bin 1000, 10 at 1500, 20 at 2000
    hist[0, 1500] = 10
    hist[0, 2000] = 20
    edges = _quantile_edges(hist, 4)
    # cumulative 10, 20, 40: the quarters 10, 20, 30 are first reached at bins 1000, 1500, 2000
    up = [U_MIN + HIST_STEP * (k + 1) for k in (1000, 1500, 2000)]
    torch.testing.assert_close(edges[0], torch.tensor(up, dtype=torch.float64))
    assert bool((edges[1] == UNUSED).all())  # an empty band: no edge reached
    u = torch.tensor([up[0] - 1e-3, up[0], up[1] + 1.0, up[2] + 1.0, 3.0])
    band = torch.tensor([0, 0, 0, 0, 1])
    assert conf_bins(u, band, edges).tolist() == [0, 1, 2, 3, 0]
    assert conf_bins(u, band, edges[:, :0]).tolist() == [0] * 5


def test_cell_grid_nll_against_a_loop():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, K, generator=g) * 4
    labels = torch.randint(0, K, (50,), generator=g)
    cell = torch.randint(0, 4, (50,), generator=g)
    log_t = torch.randn(4, 5, generator=g, dtype=torch.float64)
    out = cell_grid_nll(rows, labels, cell, log_t)
    ref = torch.zeros(4, 5, dtype=torch.float64)
    for i in range(50):
        for j in range(5):
            t = math.exp(float(log_t[cell[i], j]))
            z = [float(v) / t for v in rows[i]]
            m = max(z)
            ref[cell[i], j] += m + math.log(sum(math.exp(v - m) for v in z)) - z[labels[i]]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-12)


def _scene(seed: int, n: int = 15, size: int = 32):
    """A blocky predicted map with random logit gaps; labels drawn from ``softmax(l / T)`` with
    ``T = 2`` on confident pixels (confidence > 0.9) and ``0.6`` on the others, in every
    band: the temperature follows the confidence, not the distance."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, K, (n, 1, 4, 4), generator=g).float()
    pred = F.interpolate(blocks, size=(size, size), mode="nearest")[:, 0].long()
    gap = 0.5 + 6.0 * torch.rand(n, 1, size, size, generator=g)
    logits = gap * F.one_hot(pred, K).permute(0, 3, 1, 2).float()
    temp = torch.where(logits.softmax(1).amax(1) > 0.9, 2.0, 0.6)
    probs = (logits / temp.unsqueeze(1)).softmax(1)
    target = torch.multinomial(probs.permute(0, 2, 3, 1).reshape(-1, K), 1, generator=g)
    target = target.view(n, size, size)
    target[:, 0, :3] = VOID
    return logits, target


def _batches(x, y, step=4):
    return lambda: [(x[i:i + step], y[i:i + step]) for i in range(0, x.shape[0], step)]


def _nll(z, y):
    return float(F.cross_entropy(z.double(), y, ignore_index=VOID))


def test_fit_is_the_per_cell_ts_optimum_and_wins_where_confidence_matters(tmp_path):
    x, y = _scene(0)
    cands = [[[3.0, 8.0], 1], [[3.0, 8.0], 3]]
    cal = build_calibrator("boundary_ts_conf", K, candidates=cands, min_count=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = cal.fit(_batches(x, y), ignore_index=VOID)
        # the Q = 1 candidate is boundary_ts on the fit images, scored on the held-out ones
        held = [j for j in range(x.shape[0]) if j % 5 == 4]
        fit = [j for j in range(x.shape[0]) if j % 5 != 4]
        single = BoundaryTemperatureScaling(K, [3.0, 8.0])
        single.fit(_batches(x[fit], y[fit]), ignore_index=VOID)
    assert info["heldout_nll"][0] == pytest.approx(_nll(single(x[held]), y[held]), abs=1e-7)
    assert info["conf_bins"] == 3 and int(cal.choice) == 1
    assert info["heldout_nll"][1] < info["heldout_nll"][0]
    # every cell's temperature is an independent TS fit on that cell's pixels (all images)
    band = predicted_bands(x, [3.0, 8.0])
    u = confidence_logodds(x)
    edges = cal.edges[:3, :2]
    q = conf_bins(u, band, edges)
    temps = cal.temperatures[:3, :3]
    for b in range(3):
        for k in range(3):
            sel = (band == b) & (q == k) & (y != VOID)
            if int(sel.sum()) < 20:
                continue
            rows = x.permute(0, 2, 3, 1)[sel]
            ref = fit_temperature(lambda rows=rows, sel=sel: [(rows, y[sel])])
            assert float(temps[b, k]) == pytest.approx(ref, rel=1e-5), (b, k)
    # streaming equals one batch
    one = build_calibrator("boundary_ts_conf", K, candidates=cands, min_count=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one.fit(lambda: [(x, y)], ignore_index=VOID)
    torch.testing.assert_close(one.temperatures, cal.temperatures, rtol=1e-6, atol=0)
    torch.testing.assert_close(one.edges, cal.edges)
    # fresh data from the same law: better than boundary_ts, argmax kept, save / load
    xt, yt = _scene(1)
    coarse = BoundaryTemperatureScaling(K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coarse.fit(_batches(x, y), ignore_index=VOID)
    assert _nll(cal(xt), yt) < _nll(coarse(xt), yt) - 0.01
    assert torch.equal(cal(xt).argmax(1), xt.argmax(1))
    path = save_calibrator(cal, tmp_path / "boundary_ts_conf.pt")
    torch.testing.assert_close(load_calibrator(path)(xt), cal(xt))


def test_small_cells_take_their_bands_temperature_and_bad_input_is_named():
    x, y = _scene(2, n=5)
    cal = build_calibrator("boundary_ts_conf", K, candidates=[[[3.0], 4]], min_count=10**9,
                           holdout_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal.fit(_batches(x, y), ignore_index=VOID)
        ref = BoundaryTemperatureScaling(K, [3.0])
        ref.fit(_batches(x, y), ignore_index=VOID)
    t = cal.temperatures[:2, :4]
    torch.testing.assert_close(t, ref.temperatures[:, None].expand(2, 4), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="bands"):
        build_calibrator("boundary_ts_conf", K, candidates=[[[8.0, 3.0], 2]])
    with pytest.raises(ValueError, match="candidates"):
        build_calibrator("boundary_ts_conf", K, candidates=[[3.0, 8.0]])
    with pytest.raises(ValueError, match="candidates Q"):
        build_calibrator("boundary_ts_conf", K, candidates=[[[3.0], 0]])
    assert np.isfinite(float(cal(x).sum()))


def test_a_cell_with_every_pixel_right_takes_its_bands_temperature():
    """Pixels with a large gap are all right (their NLL falls all the way to ``t_min``): the
    cell does not keep ``T = t_min`` (one test error there would cost ``gap / t_min`` nats)."""
    g = torch.Generator().manual_seed(4)
    n, size = 6, 16
    gap = torch.where(torch.rand(n, 1, size, size, generator=g) < 0.5, 1.0, 8.0)
    x = gap * F.one_hot(torch.zeros(n, size, size, dtype=torch.long), K).permute(0, 3, 1, 2)
    y = torch.where(gap[:, 0] > 4, 0, torch.randint(0, K, (n, size, size), generator=g))
    cal = build_calibrator("boundary_ts_conf", K, candidates=[[[3.0], 2]], min_count=1,
                           holdout_every=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        info = cal.fit(_batches(x, y))
    t = torch.tensor(info["temperatures"])  # one band (no boundary): the interior row
    assert info["count_cell"][1][1] == 0  # the all-right cell counts as empty ...
    pooled = fit_temperature(lambda: [(x, y)])
    assert float(t[1, 1]) == pytest.approx(pooled, rel=1e-6)  # ... and takes its band's T


def test_registered_only_when_opted_in():
    """The core's registry holds ``boundary_ts_conf`` only after the contrib module is
    imported (``import cals_seg.contrib.boundary_conf_ts`` or ``contrib: [boundary_conf_ts]``)."""
    import subprocess
    import sys

    from cals_seg.calibrators import CALIBRATORS
    from cals_seg.utils.registry import enable_contrib

    assert enable_contrib(["boundary_conf_ts"]) == ["boundary_conf_ts"]
    assert CALIBRATORS["boundary_ts_conf"].__module__ == "cals_seg.contrib.boundary_conf_ts"
    fresh = ("from cals_seg.calibrators import CALIBRATORS; "
             "print('boundary_ts_conf' in CALIBRATORS, len(CALIBRATORS) > 0)")
    out = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_core_names_the_module_of_a_calibrator_kept_beside_it():
    import subprocess
    import sys

    code = ("from cals_seg.calibrators import build_calibrator\n"
            "try:\n"
            "    build_calibrator('boundary_ts_conf', 3)\n"
            "except Exception as err:\n"
            "    print(type(err).__name__, err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("UserError Calibrator 'boundary_ts_conf' is kept beside the core")
    assert "contrib: [boundary_conf_ts]" in out
    assert "import cals_seg.contrib.boundary_conf_ts" in out
