"""Plots of a run: reliability diagrams, multiplier curves, training curves, calibration maps.

Every function renders one PNG to ``path`` (parent folders are created) and keeps no figure
alive. Figures are built with matplotlib's object-oriented API on an explicit Agg canvas
(``Figure`` + ``FigureCanvasAgg``) instead of ``pyplot``: nothing opens a window, nothing needs a
display, no figure is registered in pyplot's global list (so none is left open), and importing
this module does not switch the backend of a user's interactive session or notebook.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FormatStrFormatter, MaxNLocator

from cals_seg.data.voc import voc_palette

PathLike = str | os.PathLike

_RELIABILITY_KEYS = ("bin_edges", "count", "confidence", "accuracy")
_DPI = 130
_INFERNO_GREY = colormaps["inferno"].with_extremes(bad="#d0d0d0")  # masked pixels grey
_LOWER_IS_BETTER = ("ece", "mce", "cwce", "nll", "brier", "loss")  # metric names: lower is better


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: PathLike) -> None:
    """Write the figure as PNG atomically (a reader never sees half a file)."""
    from cals_seg.utils.io import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=_DPI, format="png"))
    fig.clear()


# ----------------------------------------------------------------------------- reliability


def _check_reliability(reliability: Mapping) -> dict[str, np.ndarray]:
    missing = [k for k in _RELIABILITY_KEYS if k not in reliability]
    if missing:
        raise ValueError(
            f"Expected `reliability` to have the keys {list(_RELIABILITY_KEYS)}, but it lacks "
            f"{missing}."
        )
    arr = {k: np.asarray(reliability[k], dtype=np.float64) for k in _RELIABILITY_KEYS}
    n = arr["count"].shape
    if arr["bin_edges"].ndim != 1 or len(n) != 1 or arr["bin_edges"].shape[0] != n[0] + 1:
        raise ValueError(
            f"Expected `bin_edges` of length n_bins + 1 and `count` of length n_bins, but got "
            f"{arr['bin_edges'].shape} and {n}."
        )
    for k in ("confidence", "accuracy"):
        if arr[k].shape != n:
            raise ValueError(f"Expected `{k}` of shape {n} like `count`, but got {arr[k].shape}.")
    if (arr["count"] < 0).any():
        raise ValueError("Expected non-negative `count` values.")
    return arr


def _ece(rel: dict[str, np.ndarray]) -> float:
    """ECE = sum_b (n_b / n) |acc_b - conf_b|, from the per-bin statistics (0 when empty)."""
    total = rel["count"].sum()
    if total == 0:
        return 0.0
    return float((rel["count"] * np.abs(rel["accuracy"] - rel["confidence"])).sum() / total)


def _draw_reliability(ax, rel: dict[str, np.ndarray], fontsize: float) -> list:
    """Guo et al. style: accuracy bars ("Outputs"), the gap to mean confidence, the diagonal.

    Returns legend handles (explicit, so they look right even when every bin is empty).
    """
    edges, count = rel["bin_edges"], rel["count"]
    left, width = edges[:-1], np.diff(edges)
    full = count > 0
    acc, conf = rel["accuracy"][full], rel["confidence"][full]
    outputs = {"facecolor": "tab:blue", "edgecolor": "black", "linewidth": 0.5}
    gap = {"facecolor": (0.84, 0.15, 0.16, 0.3), "edgecolor": "tab:red", "hatch": "//", "lw": 0.5}
    ax.bar(left[full], acc, width[full], align="edge", **outputs)
    gap_bottom, gap_height = np.minimum(acc, conf), np.abs(conf - acc)
    ax.bar(left[full], gap_height, width[full], bottom=gap_bottom, align="edge", **gap)
    lo, hi = edges[0], edges[-1]
    (diag,) = ax.plot(
        [lo, hi], [lo, hi], "--", color="0.3", linewidth=1, label="Perfect calibration"
    )
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1)
    ax.set_ylabel("Accuracy", fontsize=fontsize)
    ax.tick_params(labelsize=fontsize - 1)
    if not full.any():
        ax.text(0.5, 0.5, "no samples", ha="center", transform=ax.transAxes, color="0.4")
    return [diag, Patch(label="Outputs", **outputs), Patch(label="Gap", **gap)]


def plot_reliability_diagram(
    reliability: Mapping, path: PathLike, title: str = "", ece: float | None = None
) -> dict[str, float | None]:
    """Reliability diagram with the pixel-count histogram below it.

    Top: per-bin accuracy bars, the gap to the bin's mean confidence, and the diagonal.
    Bottom: number of pixels per bin on a log axis, with the overall accuracy and mean
    confidence (count-weighted) as vertical lines. Empty bins draw nothing.

    Args:
        reliability: ``{"bin_edges": [n_bins + 1], "count": [n_bins], "confidence": [n_bins],
            "accuracy": [n_bins]}`` from the metrics module (empty bins hold 0.0).
        path: output PNG.
        title: figure title.
        ece: value shown in the legend; by default computed from the bins as
            ``sum_b (n_b / n) |acc_b - conf_b|`` (the binned ECE, identical to the metric's).

    Raises:
        ValueError: if a key is missing or the lengths disagree.
    """
    rel = _check_reliability(reliability)
    fig = _figure(4.8, 5.8)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.2]})
    handles = _draw_reliability(top, rel, fontsize=10)
    value = _ece(rel) if ece is None else float(ece)
    top.legend(handles=handles, title=f"ECE = {100 * value:.2f}%", loc="upper left", fontsize=9)
    top.set_title(title or "Reliability diagram", fontsize=11)

    edges, count = rel["bin_edges"], rel["count"]
    full = count > 0
    bar_style = {"align": "edge", "color": "0.6", "edgecolor": "black", "linewidth": 0.5}
    bottom.bar(edges[:-1][full], count[full], np.diff(edges)[full], **bar_style)
    if full.any():
        bottom.set_yscale("log")
        bottom.set_ylim(0.5, count.max() * 3)
        n = count.sum()
        acc = (count * rel["accuracy"]).sum() / n
        conf = (count * rel["confidence"]).sum() / n
        bottom.axvline(acc, color="tab:blue", label=f"accuracy {100 * acc:.1f}%")
        bottom.axvline(conf, color="tab:red", ls="--", label=f"avg. confidence {100 * conf:.1f}%")
        bottom.legend(loc="upper left", fontsize=8)
    else:
        bottom.set_yticks([])
    bottom.set_xlabel("Confidence", fontsize=10)
    bottom.set_ylabel("Pixels", fontsize=10)
    bottom.tick_params(labelsize=9)
    _save(fig, path)
    return {
        "ece": value,
        "accuracy": float(acc) if full.any() else None,
        "confidence": float(conf) if full.any() else None,
    }


def plot_reliability_grid(
    items: Sequence[tuple[str, Mapping]], path: PathLike, ncols: int = 4
) -> list[float]:
    """One small reliability diagram per method (or per band), ``ncols`` per row, ECE in each
    title.

    Args:
        items: ``(name, reliability dict)`` pairs (see :func:`plot_reliability_diagram`).
        path: output PNG.
        ncols: diagrams per row (fewer if there are fewer items).

    Returns:
        The ECE shown in each title, ``sum_b (n_b / n) |acc_b - conf_b|`` of the item's bins
        (0 for an empty item), in the order of ``items``.

    Raises:
        ValueError: if ``items`` is empty, ``ncols < 1`` or a dict is malformed.
    """
    if not items:
        raise ValueError("Expected at least one `(name, reliability)` item, but got none.")
    if ncols < 1:
        raise ValueError(f"Expected `ncols` to be a positive integer, but got {ncols}.")
    rels = [(name, _check_reliability(rel)) for name, rel in items]
    ncols = min(ncols, len(rels))
    nrows = math.ceil(len(rels) / ncols)
    fig = _figure(2.9 * ncols, 3.0 * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for i, (ax, (name, rel)) in enumerate(zip(axes, rels, strict=False)):
        handles = _draw_reliability(ax, rel, fontsize=8)
        ax.set_title(f"{name}\nECE = {100 * _ece(rel):.2f}%", fontsize=9)
        if i % ncols:
            ax.set_ylabel("")
        if i >= len(rels) - ncols:
            ax.set_xlabel("Confidence", fontsize=8)
    for ax in axes[len(rels) :]:
        ax.set_visible(False)
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    _save(fig, path)
    return [_ece(rel) for _, rel in rels]


def band_labels(edges: Sequence[float | None]) -> list[str]:
    """``"[a, b)"`` for consecutive edges; a last edge of None is infinity (``"[a, inf)"``)."""
    def fmt(v: float | None) -> str:
        return "inf" if v is None or v == math.inf else f"{v:g}"

    return [f"[{fmt(a)}, {fmt(b)})" for a, b in zip(edges[:-1], edges[1:], strict=True)]


def plot_band_ece(
    edges: Sequence[float | None],
    ece: Mapping[str, Sequence[float | None]],
    path: PathLike,
    title: str = "",
    xlabel: str = "distance to the nearest class boundary (pixels)",
    counts: Sequence[int] | None = None,
) -> dict[str, list[float | None]]:
    """Grouped bars of the ECE per band (or per object-size bucket), one colour per series.

    Args:
        edges: ``B + 2`` band edges as the meters return them (last None: infinity).
        ece: series name (e.g. ``"pre-TS"``) -> ``B + 1`` ECE values (fractions; None for an
            empty band draws no bar).
        path: output PNG.
        title, xlabel: figure title and x label.
        counts: pixels per band, written under the band labels.

    Returns:
        The bar heights drawn, in percent, per series (None where no bar).

    Raises:
        ValueError: if ``ece`` is empty or a series does not have one value per band.
    """
    labels = band_labels(edges)
    if not ece:
        raise ValueError("Expected at least one ECE series, but got none.")
    for name, values in ece.items():
        if len(values) != len(labels):
            raise ValueError(
                f"Expected {len(labels)} values in series {name!r} (one per band), but got "
                f"{len(values)}."
            )
    if counts is not None:
        labels = [f"{lab}\n{c:,} px" for lab, c in zip(labels, counts, strict=True)]
    fig = _figure(1.4 + 1.3 * len(labels) * max(1, len(ece)) ** 0.5, 3.6)
    ax = fig.subplots()
    width = 0.8 / len(ece)
    x = np.arange(len(labels))
    drawn: dict[str, list[float | None]] = {}
    for i, (name, values) in enumerate(ece.items()):
        heights = [None if v is None else 100.0 * float(v) for v in values]
        have = [j for j, h in enumerate(heights) if h is not None]
        bars = ax.bar(x[have] + (i - (len(ece) - 1) / 2) * width, [heights[j] for j in have],
                      width, label=name, color=colormaps["tab10"](i % 10), edgecolor="black",
                      linewidth=0.5)  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        drawn[name] = heights
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel("ECE (%)")
    ax.margins(y=0.15)
    ax.grid(True, axis="y", ls=":", alpha=0.6)
    ax.legend(fontsize=8)
    ax.set_title(title or "ECE per band", fontsize=10)
    _save(fig, path)
    return drawn


def _trapezoid(x: np.ndarray, y: np.ndarray) -> float:
    return float(((y[1:] + y[:-1]) / 2 * np.diff(x)).sum())


def plot_risk_coverage(
    curves: Sequence[tuple[str, Mapping, float | None]], path: PathLike, title: str = ""
) -> dict[str, float]:
    """Risk-coverage curves of selective prediction: the error rate of the most confident
    fraction ``c`` of the pixels, against ``c``; AURC in the legend.

    Args:
        curves: ``(name, {"coverage": [...], "risk": [...]}, aurc)`` per curve, e.g. pre- and
            post-TS. ``aurc`` None: the trapezoid area under the drawn points (from the first
            coverage to 1) is shown instead.
        path: output PNG.
        title: figure title.

    Returns:
        The AURC shown for each curve, by name.

    Raises:
        ValueError: if ``curves`` is empty or a curve's lists differ in length.
    """
    if not curves:
        raise ValueError("Expected at least one risk-coverage curve, but got none.")
    fig = _figure(5.0, 3.8)
    ax = fig.subplots()
    shown: dict[str, float] = {}
    for i, (name, rc, aurc) in enumerate(curves):
        c = np.asarray(rc["coverage"], dtype=np.float64)
        r = np.asarray(rc["risk"], dtype=np.float64)
        if c.shape != r.shape or c.ndim != 1 or not len(c):
            raise ValueError(
                f"Expected `coverage` and `risk` of one equal length in curve {name!r}, but got "
                f"{c.shape} and {r.shape}."
            )
        value = _trapezoid(c, r) if aurc is None else float(aurc)
        shown[name] = value
        ax.plot(100 * c, 100 * r, color=colormaps["tab10"](i % 10), lw=1.6,
                label=f"{name} (AURC {100 * value:.2f}%)")  # fmt: skip
    ax.set_xlim(0, 100)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("coverage: most confident pixels kept (%)")
    ax.set_ylabel("risk: error rate among them (%)")
    ax.grid(True, ls=":", alpha=0.6)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title or "Risk-coverage", fontsize=10)
    _save(fig, path)
    return shown


# ----------------------------------------------------------------------------- histories


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _epochs(history: Sequence[Mapping]) -> list[float]:
    return [e.get("epoch", i) for i, e in enumerate(history)]


# Not split (over 80 lines): one figure laid out panel by panel, read in one place.
def plot_multiplier_curves(
    history: Sequence[Mapping],
    path: PathLike,
    class_names: Sequence[str] | None = None,
    top: int = 5,
) -> bool:
    """Class-wise multipliers ``lambda_k`` over epochs (log axis) and, if logged, ``rho_k``.

    The ``top`` classes with the highest and the ``top`` with the lowest mean ``lambda`` over
    epochs are drawn in colour (solid: highest, dashed: lowest) and named in the legend; the
    other classes are thin grey lines.

    Args:
        history: per-epoch dicts as in ``history.jsonl``: ``"epoch"`` and, for CALS runs,
            ``"lambda"`` (K floats), ``"rho"`` (K floats) and, with ``margin: auto``,
            ``"margin"`` (drawn in a panel of its own). Entries without ``"lambda"`` are
            skipped.
        path: output PNG.
        class_names: K names (default ``"class k"``).
        top: number of highest and of lowest classes to highlight.

    Returns:
        False (and nothing written) if no entry has ``"lambda"``, True otherwise.

    Raises:
        ValueError: if the entries disagree on K or ``class_names`` has the wrong length.
    """
    rows = [e for e in history if e.get("lambda") is not None]
    if not rows:
        return False
    lam = [np.asarray(e["lambda"], dtype=np.float64) for e in rows]
    k = lam[0].shape[0]
    if any(x.shape != (k,) for x in lam):
        raise ValueError("Expected every `lambda` entry to hold the same number K of classes.")
    lam = np.stack(lam)  # (E, K)
    names = list(class_names) if class_names is not None else [f"class {c}" for c in range(k)]
    if len(names) != k:
        raise ValueError(f"Expected {k} `class_names`, but got {len(names)}.")
    epochs = _epochs(rows)
    rho_rows = [e for e in rows if e.get("rho") is not None]
    rho = np.stack([np.asarray(e["rho"], dtype=np.float64) for e in rho_rows]) if rho_rows else None
    if rho is not None and rho.shape[1] != k:
        raise ValueError(f"Expected `rho` to hold K={k} values like `lambda`.")

    order = np.argsort(lam.mean(axis=0), kind="stable")
    top = max(0, int(top))
    high = list(order[::-1][: min(top, k)])
    low = [c for c in order[: min(top, k)] if c not in high]
    cmap = colormaps["tab10" if len(high) + len(low) <= 10 else "tab20"]
    colours = [cmap(i % cmap.N) for i in range(len(high) + len(low))]
    style = {c: (colours[i], "-") for i, c in enumerate(high)}
    style.update({c: (colours[len(high) + i], "--") for i, c in enumerate(low)})
    marker = "o" if len(epochs) <= 30 else None

    margin_rows = [e for e in rows if e.get("margin") is not None]
    npanels = 1 + (rho is not None) + bool(margin_rows)
    fig = _figure(7.5 + 1.6, 3.3 * npanels + 0.4)
    axes = np.atleast_1d(fig.subplots(npanels, 1, sharex=True, squeeze=False).ravel())
    panels = [(axes[0], epochs, lam, r"$\lambda_k$ (class-wise multiplier)")]
    if rho is not None:
        panels.append((axes[1], _epochs(rho_rows), rho, r"$\rho_k$ (penalty parameter)"))
    if margin_rows:  # margin: auto, the margin in force after each epoch
        ax = axes[-1]
        ax.plot(_epochs(margin_rows), [float(e["margin"]) for e in margin_rows], color="k",
                lw=1.8, marker=marker, ms=3, label="margin m (auto)")
        ax.set_ylabel("margin m (auto)")
        ax.grid(True, which="major", alpha=0.3)
    for ax, x, values, label in panels:
        for c in range(k):
            if c not in style:
                ax.plot(x, values[:, c], color="0.75", linewidth=0.7, zorder=1)
        for c, (colour, ls) in style.items():
            line = {"color": colour, "ls": ls, "lw": 1.8, "marker": marker, "ms": 3, "zorder": 2}
            ax.plot(x, values[:, c], label=names[c], **line)
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    if (lam > 0).all():
        axes[0].set_yscale("log")
    else:
        axes[0].set_yscale("symlog", linthresh=1e-6)
    if len(style) < k:
        axes[0].set_title(f"Class-wise multipliers (coloured: top/bottom {top} by mean λ)")
    else:
        axes[0].set_title("Class-wise multipliers")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("epoch")
    if style:
        handles, _ = axes[0].get_legend_handles_labels()
        if len(style) < k:
            handles.append(Line2D([], [], color="0.75", linewidth=0.7, label="other classes"))
        legend_title = "mean λ: high (—) / low (--)" if low else "by mean λ"
        axes[0].legend(handles=handles, title=legend_title, title_fontsize=8, fontsize=8,
                       loc="upper left", bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    _save(fig, path)
    return True


# The reasons a `margin: auto` history row gives for its margin (margin_reason), by colour.
_REASON_COLOURS = {"over-confident": "tab:red", "under-confident": "tab:blue",
                   "still learning": "tab:orange", "calibrated within noise": "tab:green",
                   "at chance": "0.5", "warmup": "0.7"}


def plot_margin_evidence(history: Sequence[Mapping], path: PathLike) -> bool:
    """The ``margin: auto`` rule epoch by epoch: the margin in force after each validation
    pass, a marker coloured by the reason of the move or no move, and the temperature
    estimate ``T_hat`` with its interval ``[T_lo, T_hi]`` (log axis; the margin moves only
    when the interval excludes 1).

    Args:
        history: per-epoch dicts as in ``history.jsonl``; entries with ``"margin_reason"``
            are drawn (``"margin"``, ``"margin_temperature"``, ``"margin_t_low"``,
            ``"margin_t_high"``).
        path: output PNG.

    Returns:
        False (and nothing written) if no entry has ``"margin_reason"``, True otherwise.
    """
    rows = [e for e in history if e.get("margin_reason") is not None]
    if not rows:
        return False
    epochs = _epochs(rows)
    fig = _figure(7.5 + 1.6, 6.6 + 0.4)
    ax_m, ax_t = fig.subplots(2, 1, sharex=True)
    ax_m.plot(epochs, [float(e["margin"]) for e in rows], color="k", lw=1.5, zorder=1)
    seen = {}
    for x, e in zip(epochs, rows, strict=True):
        base = str(e["margin_reason"]).split(",")[0]
        colour = _REASON_COLOURS.get(base, "k")
        seen[base] = colour
        ax_m.scatter([x], [float(e["margin"])], color=colour, s=22, zorder=2)
    ax_m.set_ylabel("margin m (auto)")
    ax_m.set_title("margin: auto, the margin after each validation pass and why")
    ax_m.grid(True, alpha=0.3)
    ax_m.legend(handles=[Line2D([], [], color=c, marker="o", ls="", label=r)
                         for r, c in seen.items()], fontsize=8, loc="upper left",
                bbox_to_anchor=(1.01, 1.0))
    t_hat = [float(e["margin_temperature"]) for e in rows]
    low = [float(e.get("margin_t_low", t)) for e, t in zip(rows, t_hat, strict=True)]
    high = [float(e.get("margin_t_high", t)) for e, t in zip(rows, t_hat, strict=True)]
    ax_t.fill_between(epochs, low, high, color="tab:purple", alpha=0.25, lw=0,
                      label="interval [T_lo, T_hi]")
    ax_t.plot(epochs, t_hat, color="tab:purple", lw=1.5, label="T_hat (validation)")
    ax_t.axhline(1.0, color="k", lw=0.8, ls="--", label="T = 1 (calibrated)")
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_t.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax_t.set_ylabel("temperature")
    ax_t.grid(True, alpha=0.3)
    ax_t.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax_t.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_t.set_xlabel("epoch")
    _save(fig, path)
    return True


def _train_terms(entry: Mapping, prefix: str) -> dict[str, float]:
    """Numeric ``<prefix>*`` loss keys of one history entry (throughput, time and lr dropped)."""
    return {
        k: v
        for k, v in entry.items()
        if k.startswith(prefix)
        and _is_number(v)
        and k[len(prefix) :] not in ("lr", "time")
        and not k.endswith(("_per_s", "_time"))
    }


def plot_training_curves(
    history: Sequence[Mapping],
    path: PathLike,
    keys: Sequence[str] = ("val_ece", "val_miou"),
    train_prefix: str = "train_",
) -> bool:
    """Training loss terms and validation metrics over epochs, one panel each.

    The first panel holds every numeric ``train_prefix*`` key (e.g. ``train_loss``,
    ``train_ce``, ``train_penalty``; not ``*_lr``, ``*_time``, ``*_per_s``), on a log axis when
    all values are positive. Then one panel per key of ``keys`` that appears in
    the history; absent keys are skipped.

    Args:
        history: per-epoch dicts as in ``history.jsonl`` (``"epoch"`` optional: the entry index).
        path: output PNG.
        keys: validation metrics to plot, each in its own panel.
        train_prefix: prefix of the training-loss keys.

    Returns:
        False (and nothing written) if there is nothing to plot, True otherwise.
    """
    epochs = _epochs(history)
    terms: dict[str, tuple[list, list]] = {}
    for x, entry in zip(epochs, history, strict=True):
        for name, v in _train_terms(entry, train_prefix).items():
            terms.setdefault(name, ([], []))
            terms[name][0].append(x)
            terms[name][1].append(v)
    metrics = {}
    for key in keys:
        pts = [(x, e[key]) for x, e in zip(epochs, history, strict=True) if _is_number(e.get(key))]
        if pts:
            metrics[key] = pts
    npanels = (1 if terms else 0) + len(metrics)
    if npanels == 0:
        return False
    fig = _figure(3.8 * npanels, 3.3)
    axes = np.atleast_1d(fig.subplots(1, npanels, squeeze=False).ravel())
    marker = "o" if len(history) <= 30 else None
    i = 0
    if terms:
        ax = axes[0]
        for name, (x, v) in sorted(terms.items()):
            ax.plot(x, v, marker=marker, markersize=3, label=name)
        if all(val > 0 for _, v in terms.values() for val in v):
            ax.set_yscale("log")
        ax.set_title("training loss")
        ax.legend(fontsize=8)
        i = 1
    for ax, (key, pts) in zip(axes[i:], metrics.items(), strict=True):
        x, v = zip(*pts, strict=True)
        ax.plot(x, v, marker=marker, markersize=3, color="tab:green")
        lower = any(word in key for word in _LOWER_IS_BETTER)
        best = int(np.argmin(v) if lower else np.argmax(v))
        ax.scatter(
            x[best], v[best], color="tab:red", zorder=3, label=f"best {v[best]:.4g} @ {x[best]}"
        )
        ax.set_title(key)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    _save(fig, path)
    return True


# ----------------------------------------------------------------------------- calibration map


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x)


# Not split (over 80 lines): one figure laid out panel by panel, read in one place.
def plot_calibration_map(
    image,
    target,
    pred,
    confidence,
    path: PathLike,
    class_names: Sequence[str] | None = None,
    ignore_index: int = 255,
    palette: np.ndarray | None = None,
    title: str = "",
) -> dict[str, float | None]:
    """Six panels for one image: where the model is wrong and how confident it is there.

    Panels: image; ground truth (palette colours, void white); prediction; confidence heat map
    (0..1, colour bar); error map (correct dark, wrong red, void white); confidence on the
    errors only (other pixels grey). A legend below names the classes present.

    Args:
        image: ``(H, W, 3)`` uint8 RGB.
        target: ``(H, W)`` integer labels, ``ignore_index`` for void.
        pred: ``(H, W)`` integer predicted labels (argmax of the logits).
        confidence: ``(H, W)`` top-label confidence in [0, 1].
        path: output PNG.
        class_names: names indexed by class (default ``"class k"``).
        ignore_index: void label in ``target``.
        palette: ``(256, 3)`` uint8 colours (default :func:`voc_palette`).
        title: figure title.

    Raises:
        ValueError: on mismatched shapes, a non-uint8 image, labels outside [0, 256), a bad
            palette, or confidences outside [0, 1].

    Accepts numpy arrays or tensors (moved to the CPU).
    """
    image, target, pred, conf = map(_to_numpy, (image, target, pred, confidence))
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(
            f"Expected `image` of shape (H, W, 3) and dtype uint8, but got {image.shape} "
            f"{image.dtype}."
        )
    hw = image.shape[:2]
    for name, arr in (("target", target), ("pred", pred), ("confidence", conf)):
        if arr.shape != hw:
            raise ValueError(f"Expected `{name}` of shape {hw} like `image`, but got {arr.shape}.")
    if palette is None:
        palette = voc_palette()
    palette = np.asarray(palette)
    if palette.shape != (256, 3):
        raise ValueError(f"Expected `palette` of shape (256, 3), but got {palette.shape}.")
    palette = palette.astype(np.uint8)
    void = target == ignore_index
    target = target.astype(np.int64)
    pred = pred.astype(np.int64)
    for name, labels in (("target", target[~void]), ("pred", pred)):
        if labels.size and (labels.min() < 0 or labels.max() > 255):
            raise ValueError(f"Expected `{name}` labels in [0, 256) (void excluded).")
    conf = conf.astype(np.float64)
    if conf.size and not (np.nanmin(conf) >= 0 and np.nanmax(conf) <= 1 + 1e-6):
        raise ValueError("Expected `confidence` values in [0, 1].")

    gt_rgb = palette[np.where(void, 0, target)]
    gt_rgb[void] = 255
    wrong = (pred != target) & ~void
    error = np.where(void, 2, wrong.astype(np.int64))  # 0 correct, 1 wrong, 2 void
    conf_wrong = np.ma.masked_where(~wrong, conf)

    # Panels are ~2.6 in wide; size the figure to the image aspect so no band is left empty.
    height = 2.6 * hw[0] / max(hw[1], 1) + 1.1 + (0.3 if title else 0.0)
    fig = _figure(17.0, min(max(height, 2.4), 8.0))
    axes = fig.subplots(1, 6)
    n_valid = int((~void).sum())
    rate = f"{100 * wrong.sum() / n_valid:.1f}%" if n_valid else "n/a"
    errors = ListedColormap(["#303030", "#e41a1c", "#ffffff"])
    panels = [
        ("image", image, {}),
        ("ground truth", gt_rgb, {}),
        ("prediction", palette[pred], {}),
        ("confidence", conf, {"cmap": "viridis", "vmin": 0, "vmax": 1}),
        (f"errors ({rate} of valid)", error, {"cmap": errors, "vmin": -0.5, "vmax": 2.5}),
        ("confidence on errors", conf_wrong, {"cmap": _INFERNO_GREY, "vmin": 0, "vmax": 1}),
    ]
    for ax, (name, data, kwargs) in zip(axes, panels, strict=True):
        im = ax.imshow(data, interpolation="nearest", **kwargs)
        ax.set_title(name)
        ax.set_xticks([])
        ax.set_yticks([])
        if name.startswith("confidence"):
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)

    present = np.union1d(np.unique(target[~void]), np.unique(pred))
    names = list(class_names) if class_names is not None else []
    edge = {"edgecolor": "0.3", "linewidth": 0.5}
    handles = [
        Patch(
            facecolor=palette[c] / 255, label=names[c] if c < len(names) else f"class {c}", **edge
        )
        for c in present[:40]
    ]
    handles += [
        Patch(facecolor="white", label="void", **edge),
        Patch(facecolor="#303030", label="correct", **edge),
        Patch(facecolor="#e41a1c", label="wrong", **edge),
    ]
    ncols = min(len(handles), 10)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    _save(fig, path)
    return {
        "valid": n_valid,
        "error_rate": float(wrong.sum() / n_valid) if n_valid else None,
        "mean_confidence_on_errors": float(conf[wrong].mean()) if wrong.any() else None,
    }


# ----------------------------------------------------------------------------- comparisons


def plot_method_scatter(
    points: Sequence[tuple[str, float, float, float, float]],
    path: PathLike,
    xlabel: str = "mIoU (%)",
    ylabel: str = "ECE (%)",
    title: str = "",
) -> None:
    """Calibration against discriminative performance, one marker per method (paper Fig. 1).

    Args:
        points: ``(name, x, y, x_std, y_std)`` per method (std 0 for a single seed); values
            are drawn as given (pass percentages for percent axes).
        path: output PNG.
        xlabel, ylabel, title: axis labels and title.
    """
    if not points:
        raise ValueError("Expected at least one method to plot, but got none.")
    fig = _figure(5.2, 4.0)
    ax = fig.subplots()
    cmap = colormaps["tab10"]
    for i, (name, x, y, sx, sy) in enumerate(points):
        ax.errorbar(x, y, xerr=sx or None, yerr=sy or None, fmt="o", ms=7, capsize=3,
                    color=cmap(i % 10), label=name)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, ls=":", alpha=0.6)
    ax.set_title(title or f"{ylabel} vs {xlabel} (lower right is better)", fontsize=10)
    _save(fig, path)
