"""Compare calibration methods: train (or reuse) one run per config and seed, then tabulate.

    python tools/compare.py configs/synthetic_deeplabv3.yaml --methods ce cals_alm \
        --out runs/compare [--seeds 0 1 2] [--jobs 2 --set train.threads=1]
        [--set train.epochs=20 ...] [--checkpoints best|all|none]
    python tools/compare.py configs/synthetic_deeplabv3_ce.yaml configs/my_setup_ce.yaml ...

Each (config, method) is one row of the table. Runs go to ``OUT/runs/<config name>_seed<s>`` and are
reused when their ``test_metrics.json`` exists, so an interrupted comparison continues where it
stopped (only if the saved config matches). A reused segmentation run whose
``test_metrics.json`` lacks keys that the test meters now write (runs finished before the
boundary-band and object-size meters existed) is evaluated once more on its test split with its
``checkpoint_best.pt`` and saved temperature, and only the missing keys are added to that file
(listed under ``added_keys``). A finished run keeps ``checkpoint_best.pt`` only
(``--checkpoints all`` keeps ``checkpoint_last.pt`` too, ``none`` neither). Segmentation
configs are trained with ``tools/train_seg.py``, others with ``tools/train_cls.py``. Writes:

    OUT/results.md, OUT/results.csv   one row per method: mean (and std over seeds) of mIoU or
                                      accuracy, ECE, AECE, CWCE, NLL, per-image ECE, boundary and
                                      interior ECE, post-TS ECE, T; the best value per column in
                                      bold; failed runs listed
    OUT/ece_vs_score.png              ECE against mIoU / accuracy (the paper's Figure 1)
    OUT/reliability_grid.png          one reliability diagram per method (first seed)
    OUT/lambda_curves_<method>.png    learned class-wise multipliers of the CALS runs (first seed)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cals_seg import plotting  # noqa: E402
from cals_seg.checks import check_config  # noqa: E402
from cals_seg.cli import add_set_argument, report  # noqa: E402
from cals_seg.config import (  # noqa: E402
    Config,
    config_to_dict,
    load_config,
    resolve_config_path,
)
from cals_seg.errors import MissingPathError, UserError  # noqa: E402
from cals_seg.precision import resolve_amp  # noqa: E402
from cals_seg.rules import check_folder  # noqa: E402
from cals_seg.rundir import RunDir, UntrustedCheckpointError, atomic_write  # noqa: E402
from cals_seg.tasks import build_task, task_family  # noqa: E402
from cals_seg.trainer import resolve_device  # noqa: E402

# (key in test_metrics, column title, lower is better, shown in percent)
COLUMNS = [
    ("score", None, False, True),
    ("ece", "ECE", True, True),
    ("aece", "AECE", True, True),
    ("cwce", "CWCE", True, True),
    ("nll", "NLL", True, False),
    ("ece_image_mean", "ECE (image mean)", True, True),
    ("ece_boundary", "boundary ECE", True, True),
    ("ece_interior", "interior ECE", True, True),
    ("post_ece", "post-TS ECE", True, True),
    ("temperature", "T", None, False),
]


# keys that may differ between a saved run and the requested one without changing its results
_IGNORED_KEYS = {"output_dir", "train.progress", "train.threads"}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "params":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _resolved_precision(run: RunDir) -> str | None:
    """The precision a run used (``none``/``bf16``/``fp16``), from its files; None if unknown."""
    if run.test_metrics.is_file():
        return json.loads(run.test_metrics.read_text()).get("precision")
    history = run.history()
    return history[-1].get("precision") if history else None


def config_differences(run_dir: Path, expected: Config) -> list[str]:
    """Dotted keys whose value in ``run_dir/config.yaml`` differs from ``expected``, and
    ``train.amp (resolved)`` when ``amp: auto`` resolved to another precision there (another
    CPU or GPU) than it does here."""
    saved = _flatten(config_to_dict(load_config(run_dir / "config.yaml")))
    wanted = _flatten(config_to_dict(expected))
    keys = (saved.keys() | wanted.keys()) - _IGNORED_KEYS
    differ = sorted(k for k in keys if saved.get(k) != wanted.get(k))
    there = _resolved_precision(RunDir(run_dir))
    here = resolve_amp(expected.train.amp, resolve_device(expected.train.device), warn=False)
    if there is not None and there != here:
        differ.append(f"train.amp (resolved: {there} there, {here} here)")
    return differ


def run_one(
    config: Path, method: str | None, seed: int, out: Path, sets: list[str],
    checkpoints: str = "best",
) -> tuple[Path, str | None]:
    """Train one (config, method, seed) run unless it has finished already; return
    (run dir, error).

    A run directory left by an earlier call is reused (finished) or resumed (interrupted) only
    if it was trained with the same config, in the same resolved precision; otherwise the run is
    reported as failed with the keys that differ, and nothing is overwritten."""
    cfg = load_config(config, sets, method)
    name = f"{cfg.name}_seed{seed}"
    run_dir = out / "runs" / name
    if (run_dir / "config.yaml").is_file():
        expected = load_config(
            config, [*sets, f"name={name}", f"output_dir={out / 'runs'}", f"train.seed={seed}"],
            method,
        )
        differ = config_differences(run_dir, expected)
        if differ:
            return run_dir, (
                f"{run_dir} was trained with another config (differs in {', '.join(differ)}); "
                "delete it to retrain, or pass another --out"
            )
    if (run_dir / "test_metrics.json").is_file():
        print(f"reusing {run_dir}", flush=True)
        return run_dir, None
    tool = "train_seg.py" if task_family(cfg) == "segmentation" else "train_cls.py"
    cmd = [
        sys.executable,
        str(ROOT / "tools" / tool),
        str(config),
        *(["--method", method] if method else []),
        "--set",
        *sets,
        f"name={name}",
        f"output_dir={out / 'runs'}",
        f"train.seed={seed}",
        "train.progress=false",
    ]
    if (run_dir / "checkpoint_last.pt").is_file():  # interrupted: continue it
        cmd += ["--resume", str(run_dir)]
    elif run_dir.exists():  # stopped (with a matching config) before its first checkpoint
        shutil.rmtree(run_dir)
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return run_dir, lines[-1] if lines else f"exit code {proc.returncode}"
    # a finished run is reused from test_metrics.json: its resume point is no longer needed
    drop = {"all": [], "best": ["checkpoint_last.pt"]}.get(
        checkpoints, ["checkpoint_last.pt", "checkpoint_best.pt"]
    )
    for name in drop:
        (run_dir / name).unlink(missing_ok=True)
    return run_dir, None


def backfill_test_metrics(run_dir: Path) -> list[str]:
    """Add to ``run_dir/test_metrics.json`` the keys the task's test meters write now and the
    file lacks (a run finished before those meters existed); return them (``[]``: none missing).

    The run's ``checkpoint_best.pt`` is evaluated once on its test split, in the precision it
    was tested in, with the saved temperature for the post-TS view (no refit); keys already in
    the file are kept as they are. Raises ``FileNotFoundError`` when keys are missing and the
    checkpoint is not there.
    """
    import torch

    from cals_seg.engine import make_loader
    from cals_seg.evaluation import Scaled, compute, evaluate
    from cals_seg.rundir import load_checkpoint, write_json

    path = run_dir / "test_metrics.json"
    metrics = json.loads(path.read_text())
    cfg = load_config(run_dir / "config.yaml")
    task = build_task(cfg)
    n_bins = cfg.eval.n_bins
    views = [v for v in ("pre_ts", "post_ts") if metrics.get(v)]
    missing = sorted(set(compute(task.meters(n_bins, test=True))) - set(metrics["pre_ts"]))
    if not missing:
        return []
    ckpt = run_dir / "checkpoint_best.pt"
    if not ckpt.is_file():
        raise MissingPathError(f"{run_dir} lacks the test metrics {missing} and {ckpt.name}")
    print(f"adding {', '.join(missing)} to {path} (one test pass of {ckpt.name})", flush=True)
    task.model.load_state_dict(load_checkpoint(ckpt)["model"])
    device = resolve_device(cfg.train.device)
    amp = metrics.get("precision") or resolve_amp(cfg.train.amp, device, warn=False)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    meters = {v: {k: m.to(device) for k, m in task.meters(n_bins, test=True).items()}
              for v in views}  # fmt: skip
    consumers: list[Any] = list(meters["pre_ts"].values())
    if "post_ts" in meters:
        consumers.append(Scaled(metrics["temperature"], meters["post_ts"].values()))
    loader = make_loader(task.test_set, cfg.eval.batch_size, False, cfg.data.num_workers)
    evaluate(task.model.to(device), loader, device, consumers, amp, protocol=task.protocol)
    for view in views:
        new = compute(meters[view])
        metrics[view].update({k: new[k] for k in missing})
    metrics["added_keys"] = sorted(set(metrics.get("added_keys", [])) | set(missing))
    write_json(path, metrics)
    return missing


def summarise(metrics: dict[str, Any]) -> dict[str, float]:
    pre, post = metrics["pre_ts"], metrics.get("post_ts")
    score = pre["miou"] if "miou" in pre else pre["acc"]
    bands = pre.get("ece_band") or [None]
    return {
        "score": score,
        "ece": pre["ece"],
        "aece": pre["aece"],
        "cwce": pre.get("cwce"),
        "nll": pre["nll"],
        "ece_image_mean": pre.get("ece_image_mean"),
        "ece_boundary": bands[0],
        "ece_interior": bands[-1],
        "post_ece": post["ece"] if post else None,
        "temperature": metrics["temperature"],
    }


def _fmt(values: list[float], percent: bool) -> tuple[str, float | None, float | None]:
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
            key: _fmt([s[key] for s in row["summaries"]], pct) for key, _, _, pct in COLUMNS
        }
    best = {}
    for key, _, lower, _ in COLUMNS:
        means = [(cells[key][1], m) for m, cells in table.items() if cells[key][1] is not None]
        if lower is None or not means:
            continue
        best[key] = (min(means) if lower else max(means))[1]
    titles = [score_name if title is None else title for _, title, _, _ in COLUMNS]
    lines = [
        "| method | seeds | " + " | ".join(titles) + " |",
        "|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for method, cells in table.items():
        shown = [
            f"**{cells[key][0]}**" if best.get(key) == method else cells[key][0]
            for key, *_ in COLUMNS
        ]
        lines.append(f"| {method} | {len(rows[method]['summaries'])} | " + " | ".join(shown) + " |")
    failures = [(m, seed, err) for m, row in rows.items() for seed, err in row["failed"]]
    text = "\n".join(lines) + "\n"
    text += (
        "\nValues in % except NLL and T; mean ± std over seeds; best per column in bold "
        "(lower is better for calibration, higher for " + score_name + ").\n"
    )
    if failures:
        text += "\nFailed runs (not in the means):\n\n"
        text += "".join(f"- {m}, seed {seed}: {err}\n" for m, seed, err in failures)
    atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text(text))
    rows_csv = io.StringIO(newline="")
    writer = csv.writer(rows_csv)
    writer.writerow(
        ["method", "seeds", "failed"]
        + [f"{k}_mean" for k, *_ in COLUMNS]
        + [f"{k}_std" for k, *_ in COLUMNS]
    )
    for method, cells in table.items():
        writer.writerow(
            [method, len(rows[method]["summaries"]), len(rows[method]["failed"])]
            + [cells[k][1] for k, *_ in COLUMNS]
            + [cells[k][2] for k, *_ in COLUMNS]
        )
    atomic_write(out / "results.csv",
                 lambda tmp: Path(tmp).write_text(rows_csv.getvalue(), newline=""))
    print(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "configs", nargs="+", type=Path,
        help="configs, one per method (configs/<setup>_<method>.yaml), or setup files with "
        "--methods",
    )
    parser.add_argument(
        "--methods", nargs="+", default=None,
        help="methods of each setup file given (default: the methods the config names)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at the same time")
    parser.add_argument(
        "--checkpoints",
        choices=["all", "best", "none"],
        default="best",
        help="checkpoints kept once a run has finished (default: best, for tools/eval_seg.py; "
        "DeepLabV3-ResNet18 with its optimizer state is about 160 MB per file)",
    )
    add_set_argument(parser)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        check_folder("--out", str(args.out), must_exist=False, writable=True)
    except UserError as err:
        return report(err)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    first_run: dict[str, Path] = {}
    score_name = "mIoU"
    jobs = []  # (row name, config, method, seed) in table order
    prepared = set()
    for config in args.configs:
        for method in args.methods or [None]:
            try:
                cfg = load_config(config, [*args.set, f"output_dir={args.out / 'runs'}"], method)
                check_config(cfg)
                # Build each dataset once here (the embedded ones are generated on first
                # use), so that parallel runs never race to write the same files.
                if (cfg.data.name, cfg.data.root) not in prepared:
                    prepared.add((cfg.data.name, cfg.data.root))
                    build_task(cfg)
            except UserError as err:
                print(f"error: {err}", file=sys.stderr)
                return 2
            # The row is the method's name (cals_alm_auto, not the loss cals_alm it uses), or
            # the run's name when two configs give the same method.
            row = resolve_config_path(config, method)[1] or cfg.loss.name
            row = row if row not in rows else cfg.name
            rows.setdefault(row, {"summaries": [], "failed": []})
            jobs += [(row, config, method, seed) for seed in args.seeds]
    # Runs are independent processes: with --jobs N they share the CPU cores (give each run
    # fewer threads with --set train.threads=...).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(
            pool.map(
                lambda j: run_one(j[1], j[2], j[3], args.out, args.set, args.checkpoints), jobs
            )
        )
    for (method, _, _, seed), (run_dir, error) in zip(jobs, results, strict=True):
        row = rows[method]
        if error is not None:
            print(f"FAILED {method} seed {seed}: {error}", file=sys.stderr)
            row["failed"].append((seed, error))
            continue
        try:
            if task_family(load_config(run_dir / "config.yaml")) == "segmentation":
                backfill_test_metrics(run_dir)
        except UntrustedCheckpointError as err:  # never go on past a file that could run code
            print(f"error: {err}", file=sys.stderr)
            return 2
        except UserError as err:
            print(f"FAILED {method} seed {seed}: {err}", file=sys.stderr)
            row["failed"].append((seed, f"adding the new test metrics: {err}"))
            continue
        metrics = json.loads((run_dir / "test_metrics.json").read_text())
        if "miou" not in metrics["pre_ts"]:
            score_name = "Acc"
        row["summaries"].append(summarise(metrics))
        first_run.setdefault(method, run_dir)

    write_results(args.out, rows, score_name)
    points = []
    for method, row in rows.items():
        if row["summaries"]:
            _, x, sx = _fmt([s["score"] for s in row["summaries"]], True)
            _, y, sy = _fmt([s["ece"] for s in row["summaries"]], True)
            points.append((method, x, y, sx, sy))
    if points:
        plotting.plot_method_scatter(
            points, args.out / "ece_vs_score.png", xlabel=f"{score_name} (%)", ylabel="ECE (%)"
        )
    grid = []
    for method, run_dir in first_run.items():
        metrics = json.loads((run_dir / "test_metrics.json").read_text())
        grid.append((method, metrics["pre_ts"]["reliability"]))
        plotting.plot_multiplier_curves(
            RunDir(run_dir).history(), args.out / f"lambda_curves_{method}.png",
            metrics.get("class_names"),
        )
    if grid:
        plotting.plot_reliability_grid(grid, args.out / "reliability_grid.png")
    print(
        f"wrote {args.out / 'results.md'}, results.csv and the figures in {args.out} "
        f"({len(jobs)} runs, {(time.perf_counter() - start) / 60:.1f} min)"
    )
    return 0 if all(row["summaries"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
