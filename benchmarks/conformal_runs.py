"""Conformal prediction sets on trained runs, over random calibration / test splits.

    python benchmarks/conformal_runs.py RUN [RUN ...] --out DIR [--splits 100] [--alpha 0.1]
        [--calibrators ts boundary_ts] [--score lac]

For each run: the logits of its test split are computed once; each calibrator is fitted on the
run's validation split (never on a test image) and applied to them. Then, for each of
``--splits`` random halvings of the test images into calibration and test halves, every mode's
threshold (``risk``, ``image:0.9``, ``class``, ``band``) is fitted on the calibration half with
the library's own rules (:class:`cals_seg.evaluation.conformal.ConformalSets`: the same grid,
the same fixed-point risk curves and thresholds) and measured on the other half: the test risk,
the coverage of the pixels in each ground-truth boundary band (``d < 3``, ``3 <= d < 8``,
``d >= 8``, the boundary meter's bands), the fraction of images under 0.9 coverage and the mean
set size. The per-image statistics are computed once per run and input; each split only sums
them, so 100 splits cost about as much as one pass.

Writes ``DIR/conformal_runs.md`` (tables) and ``DIR/conformal_coverage.png`` (one box per mode
and band: the test coverage over the splits, all runs pooled per regime). Single-threaded.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODES = ("risk", "image:0.9", "class", "band")
GT_BANDS = (3.0, 8.0)
BAND_NAMES = ("d < 3", "3 <= d < 8", "d >= 8")


def run_logits(path: str, calibrators: list[str]) -> tuple[dict[str, torch.Tensor],
                                                          torch.Tensor, torch.Tensor, Any]:
    """``({input: logits (N, K, H, W)}, target (N, H, W), gt band per pixel (N, H, W), run)``
    on the test split; ``input`` is ``raw`` and each calibrator (fitted on validation)."""
    from cals_seg.calibrators import build_calibrator
    from cals_seg.evaluation.stream import predict
    from cals_seg.metrics.regions import boundary_bands
    from cals_seg.runs.run import load_run
    from cals_seg.training.engine import make_loader

    run = load_run(path, device="cpu", with_data=True, overrides=["train.threads=1"])
    task, cfg = run.task, run.config

    def stream(dataset):
        loader = make_loader(dataset, cfg.eval.batch_size, False, 0)
        return predict(run.model, loader, run.device, run.precision, protocol=task.protocol,
                       with_inputs=True)

    logits, targets, images = [], [], []
    for lg, tg, im in stream(task.test_set):
        logits.append(lg.float())
        targets.append(tg)
        images.append(im)
    raw, target, image = torch.cat(logits), torch.cat(targets), torch.cat(images)
    out = {"raw": raw}
    for name in calibrators:
        cal = build_calibrator(name, task.num_classes)
        cal.fit(lambda: ((lg.float(), tg, im) for lg, tg, im in stream(task.val_set)),
                ignore_index=task.ignore_index)
        cal.eval()
        with torch.no_grad():
            out[name] = torch.cat([cal(raw[i:i + 8], image[i:i + 8] if cal.needs_image
                                       else None) for i in range(0, len(raw), 8)])
    bands = torch.from_numpy(boundary_bands(target.numpy().astype(np.int64), GT_BANDS,
                                            ignore_index=task.ignore_index))
    return out, target, bands, run


def per_image(logits: torch.Tensor, target: torch.Tensor, gt_band: torch.Tensor,
              mode: str, score: str, ignore_index: int) -> dict[str, Any]:
    """Per-image statistics of one input for one mode, at every grid index."""
    from cals_seg.evaluation.conformal import ConformalSets, image_risk_curves, image_scores

    k = logits.shape[1]
    cs = ConformalSets(k, 0.1, mode, score, bands=GT_BANDS, ignore_index=ignore_index)
    cells, y, valid = cs.cells(logits, target)
    true_cell = cells.gather(1, y.unsqueeze(1)).squeeze(1)
    group = cs.pixel_groups(logits, cells, y)
    grid = cs.grid
    stats: dict[str, Any] = {"cs": cs, "kind": cs.kind, "valid": valid, "cells": cells,
                             "group": group}
    if cs.kind == "image":
        stats["scores"] = image_scores(true_cell, valid, cs.tau, grid)
    else:
        curves, totals = image_risk_curves(true_cell, valid, group, cs.num_groups, grid)
        stats["curves"], stats["present"] = curves, totals > 0
    return stats


def split_result(st: dict[str, Any], cal: np.ndarray, test: np.ndarray,
                 alpha: float) -> dict[str, Any]:
    """Fit the threshold(s) on ``cal`` images and measure on ``test`` images."""
    from cals_seg.evaluation.conformal import crc_threshold, quantile_threshold

    cs, grid = st["cs"], st["cs"].grid
    cal_t, test_t = torch.from_numpy(cal), torch.from_numpy(test)
    if st["kind"] == "image":
        s = st["scores"][cal_t]
        idx = torch.tensor([quantile_threshold(
            torch.bincount(s[s >= 0], minlength=grid + 1).tolist(), alpha)])
    else:
        curves, present = st["curves"][cal_t], st["present"][cal_t]
        idx = torch.tensor([crc_threshold(curves[:, g].sum(dim=0).tolist(),
                                          int(present[:, g].sum()), alpha)
                            for g in range(cs.num_groups)])
    cells, group, valid = st["cells"][test_t], st["group"][test_t], st["valid"][test_t]
    if st["kind"] == "class":
        member = cells <= idx.view(1, -1, 1)
    elif st["kind"] == "band":
        member = cells <= idx[group].unsqueeze(1)
    else:
        member = cells <= idx[0]
    size = member.sum(dim=1).double()[valid].mean().item()
    multi = (member.sum(dim=1) > 1)[valid].double().mean().item()
    return {"idx": idx, "size": size, "multi": multi}


def evaluate(st: dict[str, Any], target: torch.Tensor, gt_band: torch.Tensor, splits,
             alpha: float, ignore_index: int) -> dict[str, np.ndarray]:
    """Per split: test risk (mean over images of the miss fraction), coverage per gt band,
    fraction of images under 0.9 coverage, mean set size, fraction of multi-class pixels."""
    k = st["cells"].shape[1]
    y = target.flatten(1).clamp(0, k - 1)
    true_cell = st["cells"].gather(1, y.unsqueeze(1)).squeeze(1)
    gb = gt_band.flatten(1)
    out: dict[str, list] = {"risk": [], "under_0.9": [], "size": [], "multi": [],
                            "coverage": [], **{b: [] for b in BAND_NAMES}}
    for cal, test in splits:
        r = split_result(st, cal, test, alpha)
        idx, test_t = r["idx"], torch.from_numpy(test)
        grp = st["group"][test_t]
        if st["kind"] in ("class", "band"):
            thr = idx[grp]
        else:
            thr = idx[0].expand_as(grp)
        tc, valid, band = true_cell[test_t], st["valid"][test_t], gb[test_t]
        hit = (tc <= thr) & valid
        nvalid = valid.sum(dim=1).clamp(min=1).double()
        cov_img = hit.sum(dim=1).double() / nvalid
        has = valid.any(dim=1)
        out["risk"].append(float((1 - cov_img[has]).mean()))
        out["under_0.9"].append(float((cov_img[has] < 0.9 - 1e-12).double().mean()))
        out["coverage"].append(float(hit.sum() / valid.sum()))
        for b, name in enumerate(BAND_NAMES):
            m = valid & (band == b)
            out[name].append(float(hit[m].double().mean()) if bool(m.any()) else math.nan)
        out["size"].append(r["size"])
        out["multi"].append(r["multi"])
    return {key: np.array(v) for key, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--splits", type=int, default=100)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--score", default="lac", choices=["lac", "aps"])
    parser.add_argument("--calibrators", nargs="*", default=["ts", "boundary_ts"])
    parser.add_argument("--label", action="append", default=[],
                        help="REGIME=SUBSTRING: runs whose path holds SUBSTRING are pooled "
                        "under REGIME in the figure (default: one group)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [item.split("=", 1) for item in args.label]
    rows: list[dict[str, Any]] = []
    for path in args.runs:
        regime = next((name for name, sub in labels if sub in path), "runs")
        inputs, target, gt_band, run = run_logits(path, args.calibrators)
        ignore = run.task.ignore_index
        n = len(target)
        rng = np.random.default_rng(0)
        splits = []
        for _ in range(args.splits):
            perm = rng.permutation(n)
            splits.append((np.sort(perm[: n // 2]), np.sort(perm[n // 2:])))
        for name, logits in inputs.items():
            for mode in MODES:
                st = per_image(logits, target, gt_band, mode, args.score, ignore)
                res = evaluate(st, target, gt_band, splits, args.alpha, ignore)
                rows.append({"run": Path(path).name, "regime": regime, "input": name,
                             "mode": mode, **{k: v.tolist() for k, v in res.items()}})
                print(f"{Path(path).name} {name} {mode}: risk {res['risk'].mean():.4f} "
                      f"under-0.9 {res['under_0.9'].mean():.3f} size {res['size'].mean():.3f} "
                      + " ".join(f"{b}: {res[b].mean():.4f}" for b in BAND_NAMES), flush=True)
    (out_dir / "conformal_runs.json").write_text(json.dumps(rows))
    write_tables(rows, out_dir / "conformal_runs.md", args.alpha)
    figure(rows, out_dir / "conformal_coverage.png", args.alpha)


def write_tables(rows: list[dict[str, Any]], path: Path, alpha: float) -> None:
    """Mean over splits, then mean ± std over the runs of a regime."""
    lines = [f"alpha = {alpha:g}; per run the mean over splits, then mean ± std over runs.", "",
             "| regime | input | mode | test risk | images under 0.9 | coverage d < 3 | "
             "3 <= d < 8 | d >= 8 | set size | pixels with > 1 class |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["regime"], r["input"], r["mode"]) for r in rows},
                  key=lambda t: (t[0], ["raw", "ts", "boundary_ts"].index(t[1])
                                 if t[1] in ("raw", "ts", "boundary_ts") else 9,
                                 MODES.index(t[2])))
    for regime, inp, mode in keys:
        sel = [r for r in rows if (r["regime"], r["input"], r["mode"]) == (regime, inp, mode)]

        def cell(key: str, digits: int = 4, sel: list = sel) -> str:
            per_run = np.array([np.nanmean(r[key]) for r in sel])
            spread = per_run.std(ddof=1) if len(per_run) > 1 else 0.0
            return f"{per_run.mean():.{digits}f} ± {spread:.{digits}f}"

        lines.append(f"| {regime} | {inp} | {mode} | {cell('risk')} | {cell('under_0.9', 3)} | "
                     + " | ".join(cell(b) for b in BAND_NAMES)
                     + f" | {cell('size', 3)} | {cell('multi', 3)} |")
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def figure(rows: list[dict[str, Any]], path: Path, alpha: float) -> None:
    """One panel per regime: a box per mode and gt band of the test coverage over all splits
    and runs (raw logits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = sorted({r["regime"] for r in rows})
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4), squeeze=False)
    colors = ("#d62728", "#ff7f0e", "#2ca02c")
    for ax, regime in zip(axes[0], regimes, strict=True):
        data, pos, col = [], [], []
        for m, mode in enumerate(MODES):
            sel = [r for r in rows if r["regime"] == regime and r["input"] == "raw"
                   and r["mode"] == mode]
            for b, name in enumerate(BAND_NAMES):
                values = np.concatenate([np.array(r[name]) for r in sel])
                data.append(values[~np.isnan(values)])
                pos.append(m * 4 + b)
                col.append(colors[b])
        box = ax.boxplot(data, positions=pos, widths=0.8, patch_artist=True, showfliers=False,
                         medianprops={"color": "black"})
        for patch, c in zip(box["boxes"], col, strict=True):
            patch.set_facecolor(c)
            patch.set_alpha(0.6)
        ax.axhline(1 - alpha, color="k", lw=0.8, ls="--")
        ax.set_xticks([m * 4 + 1 for m in range(len(MODES))], MODES)
        ax.set_ylabel("test coverage (pixels of the band)")
        ax.set_title(f"{regime}: {len(data[0]) if data else 0} splits x runs, alpha {alpha:g}")
        for b, name in enumerate(BAND_NAMES):
            ax.plot([], [], color=colors[b], lw=6, alpha=0.6, label=f"GT band {name}")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
