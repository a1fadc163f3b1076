"""The tables of a study: one row per method (mean and standard deviation over seeds) for the
test metrics, the calibrators, the conformal sets, the shift benchmark and the ensembles, each
written as markdown and CSV into the study's output folder (``tools/compare.py``).
"""

from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path
from typing import Any

from cals_seg.evaluation.engine import TABLE_COLUMNS, table_values
from cals_seg.evaluation.shift import SHIFT_COLUMNS, metric, rows_of, severity_means
from cals_seg.utils.io import atomic_write

# (key in test_metrics, column title, lower is better, shown in percent)
COLUMNS = [
    ("score", None, False, True),
    ("ece", "ECE", True, True),
    ("ece_band_weighted", "band-weighted ECE", True, True),
    ("ba_ece", "BA-ECE", True, True),
    ("aece", "AECE", True, True),
    ("cwce", "CWCE", True, True),
    ("nll", "NLL", True, False),
    ("aurc", "AURC", True, True),
    ("ece_image_mean", "ECE (image mean)", True, True),
    ("ece_boundary", "boundary ECE", True, True),
    ("ece_interior", "interior ECE", True, True),
    ("post_ece", "post-TS ECE", True, True),
    ("post_ece_band_weighted", "post-TS band-weighted ECE", True, True),
    ("post_ba_ece", "post-TS BA-ECE", True, True),
    ("temperature", "T", None, False),
    ("epoch_time", "train s/epoch", None, False),
]




def calibrator_rows(metrics: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """``{calibration: table values}`` of one run: uncalibrated, post-TS (the run's T), then
    each of ``names`` (:func:`cals_seg.evaluation.engine.table_values`)."""
    rows = {"uncalibrated": table_values(metrics["pre_ts"])}
    if metrics.get("post_ts"):
        rows["post-TS"] = table_values(metrics["post_ts"])
    for name in names:  # a calibrator eval_seg could not fit is missing (named on stderr)
        if name in (metrics.get("calibrators") or {}):
            rows[name] = table_values(metrics["calibrators"][name])
    return rows


def write_calibrator_results(out: Path, rows: dict[str, dict[str, Any]]) -> None:
    """OUT/calibrators.md and .csv: one row per (method, calibration), mean ± std over seeds of
    the columns of :data:`cals_seg.evaluation.engine.TABLE_COLUMNS`; ``rows[method]["calibrators"]``
    holds one :func:`calibrator_rows` per seed."""
    lines = ["| method | calibration | seeds | " + " | ".join(t for _, t, _ in TABLE_COLUMNS)
             + " |", "|---|---|---:|" + "---:|" * len(TABLE_COLUMNS)]
    records = []
    for method, row in rows.items():
        per_seed = row.get("calibrators") or []
        for calibration in dict.fromkeys(c for s in per_seed for c in s):
            seeds = [s[calibration] for s in per_seed if calibration in s]
            cells, record = [], {"method": method, "calibration": calibration,
                                 "seeds": len(seeds)}
            for key, _, pct in TABLE_COLUMNS:
                text, mean, std = mean_std([s[key] for s in seeds], pct)
                cells.append(text)
                record.update({f"{key}_mean": mean, f"{key}_std": std})
            records.append(record)
            lines.append(f"| {method} | {calibration} | {len(seeds)} | " + " | ".join(cells)
                         + " |")
    text = ("\n".join(lines) + "\n\nValues in % except NLL; mean ± std over seeds. Calibrators "
            "fitted on each run's validation split, evaluated on its test split.\n")
    (out / "calibrators.md").write_text(text)
    with (out / "calibrators.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["method"])
        writer.writeheader()
        writer.writerows(records)
    print(text)


def epoch_time(history: list[dict[str, Any]]) -> float | None:
    """The median seconds of one training pass (``train_time`` of each epoch after the first,
    which carries the warm-up; the only epoch of a one-epoch run), or None without timings."""
    times = [h["train_time"] for h in history if isinstance(h.get("train_time"), int | float)]
    if not times:
        return None
    return statistics.median(times[1:] or times)


def summarise(metrics: dict[str, Any], score_metric: str,
              history: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """One run's row entries: ``score_metric`` (the task's headline metric, e.g. ``miou``) as
    ``score``, the calibration columns of :data:`COLUMNS`, and the median training seconds per
    epoch from the run's ``history`` (:func:`epoch_time`)."""
    pre, post = metrics["pre_ts"], metrics.get("post_ts")
    score = pre[score_metric]
    bands = pre.get("ece_band") or [None]
    return {
        "score": score,
        "ece": pre["ece"],
        "ece_band_weighted": pre.get("ece_band_weighted"),
        "ba_ece": pre.get("ba_ece"),
        "aece": pre["aece"],
        "cwce": pre.get("cwce"),
        "nll": pre["nll"],
        "aurc": pre.get("aurc"),
        "ece_image_mean": pre.get("ece_image_mean"),
        "ece_boundary": bands[0],
        "ece_interior": bands[-1],
        "post_ece": post["ece"] if post else None,
        "post_ece_band_weighted": post.get("ece_band_weighted") if post else None,
        "post_ba_ece": post.get("ba_ece") if post else None,
        "temperature": metrics["temperature"],
        "epoch_time": epoch_time(history) if history else None,
    }


def mean_std(values: list[float], percent: bool) -> tuple[str, float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return "-", None, None
    scale = 100.0 if percent else 1.0
    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    text = f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ± {std:.2f}"
    return text, mean, std


def write_results(out: Path, rows: dict[str, dict[str, Any]], score_name: str) -> None:
    """results.md (best per column in bold) and results.csv."""
    table = {}
    for method, row in rows.items():
        table[method] = {
            key: mean_std([s[key] for s in row["summaries"]], pct) for key, _, _, pct in COLUMNS
        }
    best = {}
    for key, _, lower, _ in COLUMNS:
        means = [(cells[key][1], m) for m, cells in table.items() if cells[key][1] is not None]
        if lower is None or not means:
            continue
        best[key] = (min(means) if lower else max(means))[1]
    # the time of each row as a ratio to CE's (the first row named "ce"), when both were timed
    ref = table.get("ce", {}).get("epoch_time", (None, None))[1]
    for cells in table.values():
        mean = cells["epoch_time"][1]
        ratio = mean / ref if ref and mean is not None else None
        cells["time_ratio"] = (f"{ratio:.2f}x" if ratio is not None else "-", ratio, None)
    columns = [*COLUMNS, ("time_ratio", "time / CE", None, False)]
    titles = [score_name if title is None else title for _, title, _, _ in columns]
    lines = [
        "| method | seeds | " + " | ".join(titles) + " |",
        "|---|---:|" + "---:|" * len(columns),
    ]
    for method, cells in table.items():
        shown = [
            f"**{cells[key][0]}**" if best.get(key) == method else cells[key][0]
            for key, *_ in columns
        ]
        lines.append(f"| {method} | {len(rows[method]['summaries'])} | " + " | ".join(shown) + " |")
    failures = [(m, seed, err) for m, row in rows.items() for seed, err in row["failed"]]
    text = "\n".join(lines) + "\n"
    text += (
        "\nValues in % except NLL, T and times; mean ± std over seeds; best per column in bold "
        "(lower is better for calibration, higher for " + score_name + "); train s/epoch is "
        "the median training pass after the first epoch, time / CE its ratio to the ce row.\n"
    )
    if failures:
        text += "\nFailed runs (not in the means):\n\n"
        text += "".join(f"- {m}{'' if seed is None else f', seed {seed}'}: {err}\n"
                        for m, seed, err in failures)
    atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text(text))
    table_csv = io.StringIO(newline="")
    writer = csv.writer(table_csv)
    writer.writerow(
        ["method", "seeds", "failed"]
        + [f"{k}_mean" for k, *_ in columns]
        + [f"{k}_std" for k, *_ in columns]
    )
    for method, cells in table.items():
        writer.writerow(
            [method, len(rows[method]["summaries"]), len(rows[method]["failed"])]
            + [cells[k][1] for k, *_ in columns]
            + [cells[k][2] for k, *_ in columns]
        )
    atomic_write(out / "results.csv",
                 lambda tmp: Path(tmp).write_text(table_csv.getvalue(), newline=""))
    print(text)




# (key of eval_seg's conformal result, column title, shown in percent)
CONFORMAL_COLUMNS = [
    ("risk", "test risk", True),
    ("coverage", "coverage", True),
    ("set_size", "set size", False),
    ("multi", "more than one class", True),
    ("coverage_boundary", "coverage, boundary band", True),
    ("calibration_images", "calibration images", False),
]


def _conformal_value(result: dict[str, Any], key: str) -> float | None:
    if key == "coverage_boundary":  # the band nearest to the boundaries (band 0)
        bands = result.get("coverage_band") or [None]
        return bands[0]
    return result.get(key)


def write_conformal_results(out: Path, per_method: dict[str, list[dict[str, Any]]]) -> None:
    """OUT/conformal.md and .csv: one row per (method, calibration, mode), mean ± std over
    seeds of :data:`CONFORMAL_COLUMNS`; ``per_method[method]`` holds one
    ``{calibration: {MODE: eval_seg's conformal result}}`` per seed."""
    titles = [t for _, t, _ in CONFORMAL_COLUMNS]
    lines = ["| method | calibration | mode | score | alpha | seeds | " + " | ".join(titles)
             + " |", "|---|---|---|---|---:|---:|" + "---:|" * len(titles)]
    records = []
    for method, seeds in per_method.items():
        for calibration in dict.fromkeys(c for s in seeds for c in s):
            per_cal = [s[calibration] for s in seeds if calibration in s]
            for mode in dict.fromkeys(m for s in per_cal for m in s):
                results = [s[mode] for s in per_cal if mode in s]
                first = results[0]
                record = {"method": method, "calibration": calibration, "mode": mode,
                          "score": first.get("score"), "alpha": first.get("alpha"),
                          "seeds": len(results)}
                cells = []
                for key, _, pct in CONFORMAL_COLUMNS:
                    text, mean, std = mean_std([_conformal_value(r, key) for r in results], pct)
                    cells.append(text)
                    record.update({f"{key}_mean": mean, f"{key}_std": std})
                records.append(record)
                lines.append(f"| {method} | {calibration} | {mode} | {record['score']} | "
                             f"{record['alpha']:g} | {len(results)} | " + " | ".join(cells)
                             + " |")
    text = ("\n".join(lines) + "\n\nPrediction sets fitted on each run's held-out validation "
            "images (after the calibration named, fitted on the other validation images), "
            "measured on its test split (docs/conformal.md). Risk, coverage and fractions in %; "
            "set size in classes per pixel; mean ± std over seeds.\n")
    atomic_write(out / "conformal.md", lambda tmp: Path(tmp).write_text(text))
    _write_csv(out / "conformal.csv", records)
    print(text)


def _write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=list(records[0]) if records else ["method"])
    writer.writeheader()
    writer.writerows(records)
    atomic_write(path, lambda tmp: Path(tmp).write_text(buffer.getvalue(), newline=""))


def _drift_order(names: list[str]) -> list[str]:
    """Calibrations with each drift-fitted ``NAME+drift`` right after its clean-fitted
    ``NAME``."""
    drift = [n for n in names if n.endswith("+drift")]
    order = []
    for name in names:
        if name in drift:
            continue
        order.append(name)
        if f"{name}+drift" in drift:
            order.append(f"{name}+drift")
    return order + [n for n in drift if n not in order]


def shift_blocks(metrics: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """One evaluation's ``(corruption, severity, {calibration: metric values})`` blocks:
    ``clean`` (severity 0), each ``NAME:SEVERITY``, then ``mean at severity S`` (the mean over
    the corruptions evaluated at S, :func:`cals_seg.evaluation.shift.severity_means`)."""
    shift = metrics.get("shift") or {}
    blocks = [("clean", 0, dict(rows_of(metrics)))]
    blocks += [(key, int(key.rpartition(":")[2]), dict(rows_of(r))) for key, r in shift.items()]
    blocks += [(f"mean at severity {s}", s, rows) for s, rows in severity_means(shift).items()]
    return blocks


def shift_records(evaluations: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per (method, calibration, corruption block): mean and std over the seeds'
    evaluations of each :data:`cals_seg.evaluation.shift.SHIFT_COLUMNS` key (fractions, NLL
    in nats)."""
    records = []
    for method, seeds in evaluations.items():
        if not seeds:
            continue
        per_seed = [{name: (sev, rows) for name, sev, rows in shift_blocks(m)} for m in seeds]
        for block, (severity, rows) in per_seed[0].items():
            for calibration in _drift_order(list(rows)):
                values = [s[block][1][calibration] for s in per_seed
                          if block in s and calibration in s[block][1]]
                record = {"method": method, "calibration": calibration,
                          "fit": "drift" if calibration.endswith("+drift") else "clean",
                          "corruption": block, "severity": severity, "seeds": len(values)}
                for key, _, _ in SHIFT_COLUMNS:
                    _, mean, std = mean_std([metric(v, key) for v in values], False)
                    record.update({f"{key}_mean": mean, f"{key}_std": std})
                records.append(record)
    return records


def write_shift_results(out: Path, evaluations: dict[str, list[dict[str, Any]]]) -> None:
    """OUT/shift.md and .csv (every method, calibration and corruption block of
    :func:`shift_records`; the summary first: band-weighted ECE and ECE, clean and the mean over
    corruptions per severity) and OUT/shift_ece_severity.png (band-weighted ECE against
    severity, one line per method and calibration)."""
    from cals_seg.visualization.shift import plot_severity_curves  # matplotlib: when drawn

    records = shift_records(evaluations)

    def cell(record: dict[str, Any], key: str, percent: bool) -> str:
        mean, std = record[f"{key}_mean"], record[f"{key}_std"]
        if mean is None:
            return "-"
        scale, digits = (100.0, 2) if percent else (1.0, 4)
        text = f"{scale * mean:.{digits}f}"
        return text if record["seeds"] < 2 else f"{text} ± {scale * std:.{digits}f}"

    summary = [r for r in records if r["corruption"] == "clean"
               or r["corruption"].startswith("mean at severity")]
    severities = sorted({r["severity"] for r in summary})
    head = ["method", "calibration", "fit"] + [
        f"{title} {'clean' if s == 0 else f'sev. {s}'}"
        for key, title in (("ece_band_weighted", "bw-ECE"), ("ece", "ECE")) for s in severities]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    curves: dict[str, list[tuple[int, float]]] = {}
    for method in dict.fromkeys(r["method"] for r in summary):
        mine = [r for r in summary if r["method"] == method]
        for calibration in dict.fromkeys(r["calibration"] for r in mine):
            by_sev = {r["severity"]: r for r in mine if r["calibration"] == calibration}
            cells = [cell(by_sev[s], k, True) if s in by_sev else "-"
                     for k in ("ece_band_weighted", "ece") for s in severities]
            fit = "drift" if calibration.endswith("+drift") else "clean"
            lines.append(f"| {method} | {calibration} | {fit} | " + " | ".join(cells) + " |")
            points = [(s, 100 * r["ece_band_weighted_mean"]) for s, r in sorted(by_sev.items())
                      if r["ece_band_weighted_mean"] is not None]
            if points:
                curves[f"{method}, {calibration}"] = points
    full = ["| method | calibration | corruption | seeds | "
            + " | ".join(t for _, t, _ in SHIFT_COLUMNS) + " |",
            "|---|---|---|---:|" + "---:|" * len(SHIFT_COLUMNS)]
    for r in records:
        full.append(f"| {r['method']} | {r['calibration']} | {r['corruption']} | {r['seeds']} | "
                    + " | ".join(cell(r, k, p) for k, _, p in SHIFT_COLUMNS) + " |")
    text = ("Calibration under image corruptions (docs/shift.md): band-weighted ECE (bw-ECE) "
            "and ECE in %, clean and the mean over the corruptions at each severity; NAME+drift "
            "is NAME fitted on corrupted validation images. Mean ± std over seeds.\n\n"
            + "\n".join(lines) + "\n\nEvery corruption (values in % except NLL):\n\n"
            + "\n".join(full) + "\n")
    atomic_write(out / "shift.md", lambda tmp: Path(tmp).write_text(text))
    _write_csv(out / "shift.csv", records)
    if curves:
        plot_severity_curves(curves, out / "shift_ece_severity.png",
                             title="band-weighted ECE against corruption severity")
    print(text)


def write_ensemble_results(out: Path, ensembles: dict[str, dict[str, Any]],
                           rows: dict[str, dict[str, Any]]) -> None:
    """OUT/ensemble.md and .csv: each ensemble's clean test metrics (before and after its
    temperature) next to its method's single runs (mean over seeds), and its cost: forward
    passes per image, seconds per image of the ensemble and of one member, their ratio."""
    keys = [("ece", "ECE", True), ("ece_band_weighted", "band-weighted ECE", True),
            ("nll", "NLL", False), ("miou", "mIoU", True)]
    head = ["ensemble", "members", *[t for _, t, _ in keys],
            *[f"post-TS {t}" for _, t, _ in keys[:2]], "forward passes / image",
            "s / image", "s / image (one member)", "cost ratio"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    records = []

    def fmt(value: float | None, percent: bool) -> str:
        return "-" if value is None else f"{100 * value:.2f}" if percent else f"{value:.4f}"

    for name, e in ensembles.items():
        pre, post, cost = e["metrics"]["pre_ts"], e["metrics"].get("post_ts") or {}, e["cost"]
        record = {"ensemble": name, "members": e["members"]}
        record.update({k: pre.get(k) for k, _, _ in keys})
        record.update({f"post_ts_{k}": post.get(k) for k, _, _ in keys[:2]})
        record.update({k: cost.get(k) for k in ("forward_passes_per_image", "seconds_per_image",
                                                "seconds_per_image_single", "cost_ratio")})
        records.append(record)
        ratio = cost.get("cost_ratio")
        lines.append("| " + " | ".join([
            name, str(e["members"]), *[fmt(pre.get(k), p) for k, _, p in keys],
            *[fmt(post.get(k), p) for k, _, p in keys[:2]],
            str(cost.get("forward_passes_per_image")), f"{cost.get('seconds_per_image', 0):.4f}",
            f"{cost.get('seconds_per_image_single', 0):.4f}",
            "-" if ratio is None else f"{ratio:.2f}x"]) + " |")
        singles = rows.get(e["row"], {}).get("summaries") or []
        if singles:
            cells = [mean_std([s[k if k != "miou" else "score"] for s in singles], p)[0]
                     for k, _, p in keys]
            cells += [mean_std([s[f"post_{k}"] for s in singles], True)[0]
                      for k, _, _ in keys[:2]]
            lines.append(f"| {e['row']} (one run, {len(singles)} seeds) | 1 | "
                         + " | ".join(cells) + " | 1 | - | - | 1.00x |")
    text = ("Deep ensembles of each method's seeds (mean of the members' probabilities), on the "
            "test split; values in % except NLL. Cost measured in this comparison, one pass "
            "over the test split each (data loading included), on "
            f"{next(iter(ensembles.values()))['cost'].get('device', '?') if ensembles else '-'}"
            ".\n\n" + "\n".join(lines) + "\n")
    atomic_write(out / "ensemble.md", lambda tmp: Path(tmp).write_text(text))
    _write_csv(out / "ensemble.csv", records)
    print(text)
