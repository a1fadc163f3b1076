"""Compare calibration methods: train (or reuse) one run per config and seed, then tabulate.

    python tools/compare.py configs/synthetic_deeplabv3.yaml --methods ce cals_alm \
        --out runs/compare [--seeds 0 1 2] [--jobs 2 --set train.threads=1]
        [--set train.epochs=20 ...] [--checkpoints best|all|none]
        [--calibrators ts vector dirichlet lts selective boundary_ts]
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
                                      accuracy, ECE, band-weighted ECE, AECE, CWCE, NLL, per-image
                                      ECE, boundary and interior ECE, post-TS ECE and
                                      band-weighted ECE, T; the best value per column in
                                      bold; failed runs listed
    OUT/calibrators.md, .csv          with --calibrators NAME...: one row per method and
                                      calibration (uncalibrated, post-TS, each post-hoc
                                      calibrator fitted on the run's validation split): ECE,
                                      band-weighted, boundary and interior ECE, NLL, AURC, mIoU
    OUT/ece_vs_score.png              ECE against mIoU / accuracy (the paper's Figure 1)
    OUT/reliability_grid.png          one reliability diagram per method (first seed)
    OUT/lambda_curves_<method>.png    learned class-wise multipliers of the CALS runs (first seed)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from cals_seg.commands._cli import add_set_argument

SCORE_NAMES = {"miou": "mIoU", "acc": "Acc"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    parser.add_argument(
        "--calibrators", nargs="+", default=[], metavar="NAME",
        choices=["ts", "vector", "dirichlet", "lts", "selective", "boundary_ts",
                 "cms_ap", "cms_op", "boundary_ts_fine", "boundary_ts_conf"],
        help="post-hoc calibrators fitted on each segmentation run's validation split and "
        "evaluated on its test split: OUT/calibrators.md and .csv",
    )
    add_set_argument(parser)
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> list[tuple]:
    """The runs of the study, ``(row name, config, method, seed)`` in table order; each dataset
    is built once here (the embedded ones are generated on first use), so that parallel runs
    never race to write the same files.

    Raises:
        UserError: a config that does not load.
    """
    from cals_seg.config.checks import check_config
    from cals_seg.config.schema import load_config, resolve_config_path
    from cals_seg.tasks import build_task

    jobs, prepared = [], set()
    for config in args.configs:
        for method in args.methods or [None]:
            cfg = load_config(config, [*args.set, f"output_dir={args.out / 'runs'}"], method)
            check_config(cfg, reads_data=True, writes_run=True)  # as the runs will see it
            if (cfg.data.name, cfg.data.root) not in prepared:
                prepared.add((cfg.data.name, cfg.data.root))
                build_task(cfg)
            # The row is the method's name (cals_alm_auto, not the loss cals_alm it uses), or
            # the run's name when two configs give the same method.
            row = resolve_config_path(config, method)[1] or cfg.loss.name
            row = row if row not in rows else cfg.name
            rows.setdefault(row, {"summaries": [], "failed": []})
            jobs += [(row, config, method, seed) for seed in args.seeds]
    return jobs


def collect(jobs: list[tuple], results: list[tuple], rows: dict[str, dict[str, Any]],
            calibrators: list[str] = ()) -> tuple[dict[str, Path], str]:
    """Summaries of the finished runs into ``rows`` (failures listed; with ``calibrators``,
    each segmentation run's post-hoc calibrators too); returns the first run of each row and
    the headline metric's name, read from the runs' own files."""

    from cals_seg.errors import UntrustedCheckpointError, UserError
    from cals_seg.runs.run import Run
    from cals_seg.tasks import score_metric, task_family
    from cals_seg.training.study import (
        add_calibrators,
        backfill_test_metrics,
        calibrator_rows,
        summarise,
    )

    first_run: dict[str, Path] = {}
    metric = None
    for (method, _, _, seed), (run_dir, error) in zip(jobs, results, strict=True):
        row = rows[method]
        if error is not None:
            print(f"FAILED {method} seed {seed}: {error}", file=sys.stderr)
            row["failed"].append((seed, error))
            continue
        try:
            cfg = Run(run_dir).read_config()
            if task_family(cfg) == "segmentation":
                backfill_test_metrics(run_dir)
                if calibrators:
                    add_calibrators(run_dir, list(calibrators))
        except UntrustedCheckpointError:  # never go on past a file that could run code
            raise
        except UserError as err:
            print(f"FAILED {method} seed {seed}: {err}", file=sys.stderr)
            row["failed"].append((seed, f"adding the new test metrics: {err}"))
            continue
        metrics = Run(run_dir).read_test_metrics()
        metric = metrics.get("score_metric") or score_metric(cfg)  # older runs: from the config
        history = Run(run_dir).history()
        row["summaries"].append(summarise(metrics, metric, history))
        if calibrators and metrics.get("calibrators"):
            row.setdefault("calibrators", []).append(calibrator_rows(metrics, list(calibrators)))
        first_run.setdefault(method, run_dir)
    return first_run, SCORE_NAMES.get(metric, metric or "mIoU")


def plot_study(out: Path, rows: dict[str, dict[str, Any]], first_run: dict[str, Path],
               score_name: str) -> None:
    """ECE against the score, a reliability grid and the multiplier curves of each row."""

    from cals_seg.runs.run import Run
    from cals_seg.training.study import mean_std
    from cals_seg.visualization import plotting

    points = []
    for method, row in rows.items():
        if row["summaries"]:
            _, x, sx = mean_std([s["score"] for s in row["summaries"]], True)
            _, y, sy = mean_std([s["ece"] for s in row["summaries"]], True)
            points.append((method, x, y, sx, sy))
    if points:
        plotting.plot_method_scatter(
            points, out / "ece_vs_score.png", xlabel=f"{score_name} (%)", ylabel="ECE (%)"
        )
    grid = []
    for method, run_dir in first_run.items():
        metrics = Run(run_dir).read_test_metrics()
        grid.append((method, metrics["pre_ts"]["reliability"]))
        plotting.plot_multiplier_curves(
            Run(run_dir).history(), out / f"lambda_curves_{method}.png",
            metrics.get("class_names"),
        )
    if grid:
        plotting.plot_reliability_grid(grid, out / "reliability_grid.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from concurrent.futures import ThreadPoolExecutor

    from cals_seg.commands._cli import USER_ERRORS, report
    from cals_seg.config.rules import check_folder
    from cals_seg.errors import UntrustedCheckpointError
    from cals_seg.training.study import run_one, write_results

    start = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    try:
        check_folder("--out", str(args.out), must_exist=False, writable=True)
        jobs = plan(args, rows)
        from cals_seg.utils.paths import OutputFolder

        # the tables and figures: never over a file compare did not write (runs/ is resumed)
        outputs = OutputFolder(args.out, "compare", inputs=[])
        names = ["results.md", "results.csv", "calibrators.md", "calibrators.csv",
                 "ece_vs_score.png", "reliability_grid.png"]
        outputs.check_free(names)
        outputs.claim(names)
    except USER_ERRORS as err:
        return report(err)
    args.out.mkdir(parents=True, exist_ok=True)
    # Runs are independent processes: with --jobs N they share the CPU cores (give each run
    # fewer threads with --set train.threads=...).
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(
            pool.map(
                lambda j: run_one(j[1], j[2], j[3], args.out, args.set, args.checkpoints), jobs
            )
        )
    try:
        first_run, score_name = collect(jobs, results, rows, args.calibrators)
    except UntrustedCheckpointError as err:
        return report(err)
    write_results(args.out, rows, score_name)
    if args.calibrators:
        from cals_seg.training.study import write_calibrator_results

        write_calibrator_results(args.out, rows)
    plot_study(args.out, rows, first_run, score_name)
    print(
        f"wrote {args.out / 'results.md'}, results.csv and the figures in {args.out} "
        f"({len(jobs)} runs, {(time.perf_counter() - start) / 60:.1f} min)"
    )
    return 0 if all(row["summaries"] for row in rows.values()) else 1


def run() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
