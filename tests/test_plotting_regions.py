"""Plots of the region metrics: each returns what it draws, checked against loop references."""

from __future__ import annotations

import numpy as np
import pytest

from cals_seg.visualization.plotting import (
    band_labels,
    plot_band_ece,
    plot_reliability_grid,
    plot_risk_coverage,
)

from .test_plotting import _check_png, _reliability


def test_band_labels():
    assert band_labels([0.0, 3.0, 8.0, None]) == ["[0, 3)", "[3, 8)", "[8, inf)"]
    assert band_labels([0, 1024, 9216, None]) == ["[0, 1024)", "[1024, 9216)", "[9216, inf)"]


def test_band_ece_bars(tmp_path):
    series = {"pre-TS": [0.015, None, 0.0249], "post-TS": [0.0185, 0.0312, 0.019]}
    drawn = plot_band_ece([0.0, 3.0, 8.0, None], series, tmp_path / "bands.png",
                          counts=[10, 0, 30])
    _check_png(tmp_path / "bands.png")
    for name, values in series.items():
        want = [None if v is None else 100 * v for v in values]
        for got, w in zip(drawn[name], want, strict=True):
            assert (got is None and w is None) or got == pytest.approx(w, rel=1e-12)
    with pytest.raises(ValueError, match="one per band"):
        plot_band_ece([0.0, 3.0, None], {"x": [0.1]}, tmp_path / "bad.png")
    with pytest.raises(ValueError, match="none"):
        plot_band_ece([0.0, 3.0, None], {}, tmp_path / "bad.png")


def test_risk_coverage_aurc_shown(tmp_path):
    c = np.arange(1, 101) / 100
    r = 0.3 * c**2 + 0.01
    rc = {"coverage": c.tolist(), "risk": r.tolist()}
    shown = plot_risk_coverage([("given", rc, 0.123), ("computed", rc, None)],
                               tmp_path / "rc.png")
    _check_png(tmp_path / "rc.png")
    assert shown["given"] == 0.123
    area = 0.0  # trapezoids, one loop step per segment
    for i in range(1, len(c)):
        area += (r[i] + r[i - 1]) / 2 * (c[i] - c[i - 1])
    assert shown["computed"] == pytest.approx(area, rel=1e-12)
    with pytest.raises(ValueError, match="equal length"):
        plot_risk_coverage([("bad", {"coverage": [1.0], "risk": [0.1, 0.2]}, None)],
                           tmp_path / "bad.png")


def test_reliability_grid_returns_the_ece_of_each_band(tmp_path):
    items = [(f"band {i}", _reliability(empty=(i,))) for i in range(3)]
    shown = plot_reliability_grid(items, tmp_path / "bands.png", ncols=3)
    _check_png(tmp_path / "bands.png")
    for (_, rel), got in zip(items, shown, strict=True):
        n = sum(rel["count"])
        ece = sum(k * abs(a - f) for k, a, f in zip(rel["count"], rel["accuracy"],
                                                    rel["confidence"], strict=True)) / n
        assert got == pytest.approx(ece, rel=1e-12)
