"""The figure of docs/shift.md and README from two ``compare --shift`` studies (one per regime).

    python benchmarks/shift_figure.py UNDER_OUT OVER_OUT --out docs/shift_ece_severity.png

Reads ``OUT/shift.csv`` of each comparison (the under-confident and the over-confident regime of
the embedded setups) and draws the band-weighted ECE against the corruption severity (0: clean;
1-5: the mean over the corruptions, each seed's mean first, then the mean over seeds) for CE
uncalibrated, CE + `boundary_ts` fitted on clean validation images, CE + `boundary_ts` fitted on
drifted ones, CE + `image_ts`, and the CE ensemble: one line each (a curve a study does not
hold is left out), solid for the under-confident regime and dashed
for the over-confident one. Commands that make the two studies: docs/shift.md.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

CURVES = (  # (method, calibration, label)
    ("ce", "uncalibrated", "CE"),
    ("ce", "boundary_ts", "CE + boundary_ts (clean fit)"),
    ("ce", "boundary_ts+drift", "CE + boundary_ts (drift fit)"),
    ("ce", "image_ts", "CE + image_ts"),
    ("ce ensemble", "uncalibrated", "3 x CE ensemble"),
    ("cals_alm_bands", "uncalibrated", "CALS-ALM bands"),
)


def severity_points(path: Path, method: str, calibration: str) -> list[tuple[int, float]]:
    """``[(severity, band-weighted ECE in %)]`` of one method and calibration of a shift.csv:
    the clean row and the ``mean at severity S`` rows."""
    points = []
    with path.open() as f:
        for row in csv.DictReader(f):
            block = row["corruption"]
            if row["method"] != method or row["calibration"] != calibration:
                continue
            if block != "clean" and not block.startswith("mean at severity"):
                continue
            points.append((int(row["severity"]), 100 * float(row["ece_band_weighted_mean"])))
    return sorted(points)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("under", type=Path, help="compare --out of the under-confident regime")
    parser.add_argument("over", type=Path, help="compare --out of the over-confident regime")
    parser.add_argument("--out", type=Path, default=Path("docs/shift_ece_severity.png"))
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    regimes = ((args.under, "-", "under-conf."), (args.over, "--", "over-conf."))
    for folder, style, regime in regimes:
        for i, (method, calibration, label) in enumerate(CURVES):
            points = severity_points(folder / "shift.csv", method, calibration)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", ms=3.5, color=colours[i],
                    label=f"{label}, {regime}")
    ax.set_xlabel("corruption severity (0: clean; mean over 12 corruptions)")
    ax.set_ylabel("band-weighted ECE (%)")
    ax.set_xticks(range(0, 6))
    ax.set_title("Calibration under image corruptions, 3 seeds (solid: 20 epochs, dashed: 56)",
                 fontsize=9)
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
