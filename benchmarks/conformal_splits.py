"""What the conformal guarantees give on a calibrated toy network, over random splits.

    python benchmarks/conformal_splits.py [--images 600] [--calibration 200] [--splits 200]

A pool of ``--images`` 12 x 12 images, 4 classes: blocky class regions, a per-image sharpness
and pixel noise in the logits, labels drawn from their softmax (so the probabilities are
exactly calibrated). For each of ``--splits`` random calibration / test splits of the pool, each
mode's threshold is fitted on ``--calibration`` images (the library's own rules) and measured on
the rest. Prints, per score, mode and alpha, the mean over splits of the guaranteed quantity
(the test risk; for ``image:0.9`` the fraction of test images under 0.9 coverage; for
``class`` / ``band`` the worst class / band) with its standard error, and the mean set size.
Single-threaded; the numbers of docs/conformal.md come from it.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from cals_seg.evaluation.conformal import (
    ConformalSets,
    crc_threshold,
    image_risk_curves,
    image_scores,
    quantile_threshold,
)
from cals_seg.metrics.regions import boundary_bands

K, H, W, GRID, BANDS = 4, 12, 12, 2**10, (1.0, 2.0)


def pool(n: int, seed: int = 0, boundary_t: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels; ``boundary_t`` > 1 draws the labels of the pixels on the predicted
    boundaries (band ``[0, 1)``) from ``softmax(logits / boundary_t)``: an over-confident
    network there."""
    g = torch.Generator().manual_seed(seed)
    base = torch.zeros(n, K, H, W)
    cls = torch.randint(0, K, (n, 2, 2), generator=g)
    for a in range(2):
        for b in range(2):
            rows, cols = slice(a * H // 2, (a + 1) * H // 2), slice(b * W // 2, (b + 1) * W // 2)
            base[torch.arange(n), cls[:, a, b], rows, cols] += 1.5
    sharp = 0.5 + 3.0 * torch.rand(n, 1, 1, 1, generator=g)
    logits = sharp * (base + 0.5 * torch.randn(n, K, H, W, generator=g))
    edge = torch.from_numpy(boundary_bands(logits.argmax(dim=1).numpy(), BANDS) == 0)
    t = torch.where(edge, boundary_t, 1.0).unsqueeze(1)
    probs = (logits / t).softmax(dim=1).permute(0, 2, 3, 1).reshape(-1, K)
    return logits, torch.multinomial(probs, 1, generator=g).view(n, H, W)


def losses(true_cell: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per image and grid index: the fraction of masked pixels left out (NaN: none)."""
    t = np.arange(GRID + 1)
    out = np.full((len(true_cell), GRID + 1), np.nan)
    for i, (c, m) in enumerate(zip(true_cell, mask, strict=True)):
        if m.any():
            out[i] = (c[m][:, None] > t[None, :]).mean(axis=0)
    return out


def set_sizes(cells: torch.Tensor) -> np.ndarray:
    """Per image and grid index: the mean set size at a single threshold."""
    n = cells.shape[0]
    hist = torch.stack([torch.bincount(c.reshape(-1), minlength=GRID + 1) for c in cells])
    return (hist.cumsum(dim=1).double() / (cells.shape[2])).numpy().reshape(n, GRID + 1)


def study(score: str, mode: str, logits, y, splits, n_cal: int, alphas) -> list[str]:
    cs = ConformalSets(K, 0.1, mode, score, bands=BANDS, grid=GRID)
    cells, yy, valid = cs.cells(logits, y)
    true_cell = cells.gather(1, yy.unsqueeze(1)).squeeze(1)
    group = cs.pixel_groups(logits, cells, yy)
    lines = []
    if cs.kind == "image":
        s = image_scores(true_cell, valid, cs.tau, GRID).numpy()
        loss = losses(true_cell.numpy(), valid.numpy())
        sizes = set_sizes(cells)
        for alpha in alphas:
            bad, size = [], []
            for perm in splits:
                g = quantile_threshold(np.bincount(s[perm[:n_cal]], minlength=GRID + 1)
                                       .tolist(), alpha)
                bad.append((1 - loss[perm[n_cal:], g] < cs.tau - 1e-12).mean())
                size.append(sizes[perm[n_cal:], g].mean())
            lines.append(row(score, mode, alpha, np.array(bad), np.mean(size)))
        return lines
    curves, totals = image_risk_curves(true_cell, valid, group, cs.num_groups, GRID)
    curves, present = curves.numpy(), (totals > 0).numpy()
    loss = [losses(true_cell.numpy(), (valid & (group == g)).numpy())
            for g in range(cs.num_groups)]
    sums = [[(curves[p[:n_cal], g].sum(axis=0).tolist(), int(present[p[:n_cal], g].sum()))
             for g in range(cs.num_groups)] for p in splits]
    for alpha in alphas:
        per_group = np.zeros((len(splits), cs.num_groups))
        size = []
        for i, (perm, split_sums) in enumerate(zip(splits, sums, strict=True)):
            idx = torch.tensor([crc_threshold(r, n, alpha) for r, n in split_sums])
            for g in range(cs.num_groups):
                per_group[i, g] = np.nanmean(loss[g][perm[n_cal:], int(idx[g])])
            if cs.kind == "class":
                member = cells <= idx.view(1, -1, 1)
            else:
                member = cells <= idx[group].unsqueeze(1)
            size.append(member[perm[n_cal:]].sum(dim=1).double().mean().item())
        worst = per_group[:, np.argmax(per_group.mean(axis=0))]
        lines.append(row(score, mode, alpha, worst, np.mean(size)))
    return lines


def band_comparison(score: str, logits, y, splits, n_cal: int, alpha: float) -> list[str]:
    """Risk per predicted-boundary band under the marginal (``risk``) threshold and under the
    band-conditional thresholds, at ``alpha``."""
    cs = ConformalSets(K, alpha, "band", score, bands=BANDS, grid=GRID)
    cells, yy, valid = cs.cells(logits, y)
    true_cell = cells.gather(1, yy.unsqueeze(1)).squeeze(1)
    group = cs.pixel_groups(logits, cells, yy)
    one, _ = image_risk_curves(true_cell, valid, torch.zeros_like(yy), 1, GRID)
    per, totals = image_risk_curves(true_cell, valid, group, cs.num_groups, GRID)
    one, per, present = one[:, 0].numpy(), per.numpy(), (totals > 0).numpy()
    loss = [losses(true_cell.numpy(), (valid & (group == g)).numpy())
            for g in range(cs.num_groups)]
    marginal = np.zeros((len(splits), cs.num_groups))
    conditional = np.zeros((len(splits), cs.num_groups))
    for i, perm in enumerate(splits):
        cal, test = perm[:n_cal], perm[n_cal:]
        t = crc_threshold(one[cal].sum(axis=0).tolist(), n_cal, alpha)
        for g in range(cs.num_groups):
            tg = crc_threshold(per[cal, g].sum(axis=0).tolist(), int(present[cal, g].sum()),
                               alpha)
            marginal[i, g] = np.nanmean(loss[g][test, t])
            conditional[i, g] = np.nanmean(loss[g][test, tg])
    edges = [0.0, *BANDS, math.inf]
    return [f"| {score} | [{edges[g]:g}, {edges[g + 1]:g}) | {marginal[:, g].mean():.4f} | "
            f"{conditional[:, g].mean():.4f} |" for g in range(cs.num_groups)]


def row(score: str, mode: str, alpha: float, values: np.ndarray, size: float) -> str:
    se = values.std(ddof=1) / math.sqrt(len(values))
    return (f"| {score} | {mode} | {alpha:g} | {values.mean():.4f} ± {se:.4f} | "
            f"{size:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--calibration", type=int, default=200)
    parser.add_argument("--splits", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logits, y = pool(args.images)
    rng = np.random.default_rng(1)
    splits = [rng.permutation(args.images) for _ in range(args.splits)]
    print("| score | mode | alpha | guaranteed quantity (mean ± s.e.) | mean set size |")
    print("|---|---|---|---|---|")
    for score in ("lac", "aps"):
        for mode in ("risk", "image:0.9", "class", "band"):
            for line in study(score, mode, logits, y, splits, args.calibration,
                              (0.01, 0.05, 0.1)):
                print(line, flush=True)
    for boundary_t in (1.0, 2.0):
        logits, y = pool(args.images, boundary_t=boundary_t)
        print(f"\nRisk per predicted-boundary band (pixels), alpha = 0.1, mean over splits; "
              f"labels on the predicted boundaries drawn at temperature {boundary_t:g}:\n")
        print("| score | band | marginal threshold (risk) | one threshold per band (band) |")
        print("|---|---|---|---|")
        for score in ("lac", "aps"):
            for line in band_comparison(score, logits, y, splits, args.calibration, 0.1):
                print(line, flush=True)


if __name__ == "__main__":
    main()
