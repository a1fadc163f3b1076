"""A metric against the corruption severity, one line per method and calibrator
(docs/shift.md); severity 0 is the clean split."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cals_seg.visualization.plotting import _figure, _save


def plot_severity_curves(curves: Mapping[str, Sequence[tuple[int, float]]], path: str | Path,
                         ylabel: str = "band-weighted ECE (%)", title: str = "") -> None:
    """``curves``: ``{label: [(severity, value), ...]}`` (severity 0: clean), drawn as given.

    Raises:
        ValueError: no curve.
    """
    if not curves:
        raise ValueError("Expected at least one curve to plot, but got none.")
    fig = _figure(5.6, 4.0)
    ax = fig.subplots()
    for i, (label, points) in enumerate(curves.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", ms=4, label=label, linestyle="-" if i < 10 else "--")
    ax.set_xlabel("corruption severity (0: clean; mean over the corruptions)")
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(0, 6))
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    _save(fig, path)


__all__ = ["plot_severity_curves"]
