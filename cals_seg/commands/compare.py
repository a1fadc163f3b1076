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
    FILE (--reference-out FILE)       the test ECE per method and calibration (mean, std over
                                      seeds) with the machine, date and command, as the setup's
                                      entry of the JSON reference file tools/demo.py reads

Runs made elsewhere: a folder given instead of a config (a run of tools/import_model.py, or a
trained run of another study) is one row of its own, named after the folder; it is not trained
but evaluated once by tools/eval_seg.py into OUT/eval/<row>/<run>/ (with --calibrators, --shift
and --conformal as for the trained runs), and the tables read that evaluation (--seeds does not
apply to it):

    python tools/compare.py configs/synthetic_deeplabv3_ce.yaml runs/my_imported_net \
        --out runs/compare --calibrators ts boundary_ts

Prediction sets, shift and ensembles (docs/conformal.md, docs/shift.md), for segmentation runs:

    --conformal alpha=0.1 [mode=risk,image:0.9,class,band] [score=NAME] [calibrator=NAME]
        the conformal evaluation of tools/eval_seg.py --conformal on each run (fitted on its
        held-out validation images, measured on its test split), and again after each
        calibrator of --calibrators: OUT/conformal.md and .csv, one row per method,
        calibration and mode: alpha, test risk, coverage, set size, fraction of pixels with more
        than one class, coverage in the boundary band (mean ± std over seeds)
    --shift NAME:SEVERITY ... | all:3 | all  [--shift-seed 0] [--calibrator-fit-shift]
        each run evaluated by tools/eval_seg.py --shift into OUT/eval/<row>/<run>/:
        OUT/shift.md and .csv (ECE, band-weighted, boundary and interior ECE, NLL, mIoU per
        corruption and severity and the mean over corruptions per severity, for every method
        and calibration, clean-fitted NAME next to drift-fitted NAME+drift) and
        OUT/shift_ece_severity.png (band-weighted ECE against severity)
    --ensemble [ROW ...]
        the deep ensemble of each method's seeds (tools/eval_seg.py RUN... --ensemble; two
        seeds or more), clean and under --shift, with its inference cost measured here:
        OUT/ensemble.md and .csv, and an "<method> ensemble" row in the shift tables; with
        row names, only those rows' ensembles (--ensemble ce: one ensemble, not one per method)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from cals_seg.commands._cli import (
    USER_ERRORS,
    add_set_argument,
    add_trust_argument,
    consent_of,
    report,
)
from cals_seg.commands.eval_seg import calibrator_name
from cals_seg.config.checks import check_config
from cals_seg.config.rules import check_folder
from cals_seg.config.schema import load_config, resolve_config_path
from cals_seg.errors import MissingPathError, UntrustedCheckpointError, UserError
from cals_seg.utils.fits import file_digest
from cals_seg.utils.paths import OutputFolder

SCORE_NAMES = {"miou": "mIoU", "acc": "Acc"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "configs", nargs="+", type=Path,
        help="configs, one per method (configs/<setup>_<method>.yaml), setup files with "
        "--methods, or run folders (tools/import_model.py or another study; evaluated, not "
        "trained)",
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
        "--calibrators", nargs="+", default=[], metavar="NAME", type=calibrator_name,
        help="post-hoc calibrators fitted on each segmentation run's validation split and "
        "evaluated on its test split: OUT/calibrators.md and .csv",
    )
    parser.add_argument("--conformal", nargs="+", default=None, metavar="KEY=VALUE",
                        help="prediction sets with a guarantee, as tools/eval_seg.py's: alpha=0.1 "
                        "[mode=risk|image:0.9|class|band (comma-separated)] [score=NAME] "
                        "[calibrator=NAME]: OUT/conformal.md and .csv")
    parser.add_argument("--shift", nargs="+", default=None, metavar="NAME:SEVERITY",
                        help="evaluate each run with each image corruption (severity 1-5; all:3, "
                        "all): OUT/shift.md, .csv and shift_ece_severity.png")
    parser.add_argument("--shift-seed", type=int, default=0, help="seed of the corruptions")
    parser.add_argument("--calibrator-fit-shift", action="store_true",
                        help="with --shift: also fit each --calibrators one on corrupted "
                        "validation images (held-out corruptions), shown as NAME+drift")
    parser.add_argument("--ensemble", nargs="*", default=None, metavar="ROW",
                        help="the ensemble of each method's seeds, clean and under --shift, with "
                        "its cost: OUT/ensemble.md and .csv; with row names (--ensemble ce), "
                        "of those rows only")
    parser.add_argument("--reference-out", type=Path, default=None, metavar="FILE",
                        help="also write the test ECE per method and calibration (mean, std over "
                        "seeds), with this machine, the date and this command, as the entry of "
                        "the setup file given in the JSON reference FILE that tools/demo.py "
                        "reads (other setups in FILE are kept); one setup file only")
    add_set_argument(parser)
    add_trust_argument(parser)
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> list[tuple]:
    """The runs of the study, ``(row name, config, method, seed)`` in table order; each dataset
    is built once here (the embedded ones are generated on first use), so that parallel runs
    never race to write the same files.

    Raises:
        UserError: a config that does not load.
    """
    from cals_seg.tasks import build_task

    jobs, prepared, given = [], set(), {}
    for config in args.configs:
        if config.is_dir():  # a run folder: evaluated, not trained
            row = given_run_row(config, rows)
            same = given_run_identity(config)  # one row per run, however spelt or copied
            if same in given:
                print(f"compare: {config} is the same run as {given[same]} (the same checkpoint "
                      "and config by content): one row for both.", flush=True)
                continue
            given[same] = config
            rows[row] = {"summaries": [], "failed": [], "given": True}
            jobs.append((row, config, GIVEN, None))
            continue
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


GIVEN = "<run folder>"  # the method of a job whose run folder was given (not trained)


def given_run_identity(folder: Path) -> tuple[str, str]:
    """A given run folder by content: the digests of its best checkpoint and its config, so
    that a folder spelt two ways (relative / absolute, through a link) or copied byte for byte
    is one run."""
    from cals_seg.runs.run import Run

    run = Run(folder)
    return file_digest(run.best), file_digest(run.config_file)


def given_run_row(folder: Path, rows: dict[str, dict[str, Any]]) -> str:
    """The row of a run folder given on the command line: its name (``parent/name`` when
    taken), after checking that it is a segmentation run with a config and a checkpoint.

    Raises:
        UserError: not a run folder, or not a segmentation run (one line, naming the fix).
    """
    from cals_seg.runs.run import Run
    from cals_seg.tasks import task_family

    run = Run(folder)
    if not run.has_config() or not run.best.is_file():
        raise MissingPathError(
            f"{folder} is a folder but not a run (it needs {run.config_file.name} and "
            f"{run.best.name}); give a config, or make the run with tools/import_model.py.")
    if task_family(run.read_config()) != "segmentation":
        raise UserError(f"{folder}: only segmentation runs can be given as folders; give the "
                        "config of a classification run instead.")
    row = folder.resolve().name
    return row if row not in rows else f"{folder.resolve().parent.name}/{row}"


def collect(jobs: list[tuple], results: list[tuple], rows: dict[str, dict[str, Any]],
            calibrators: list[str] = (), args: argparse.Namespace | None = None
            ) -> tuple[dict[str, Path], str]:
    """Summaries of the finished runs into ``rows`` (failures listed; with ``calibrators``,
    each segmentation run's post-hoc calibrators too; with ``args.shift`` / ``args.conformal``
    each segmentation run's shift and conformal evaluations under ``row["shift"]`` /
    ``row["conformal"]``); returns the first run of each row and the headline metric's name,
    read from the runs' own files (a given run folder: from its evaluation by eval_seg)."""

    from cals_seg.runs.run import Run
    from cals_seg.tasks import score_metric, task_family
    from cals_seg.training.study import add_calibrators, backfill_test_metrics
    from cals_seg.training.tables import calibrator_rows, summarise

    first_run: dict[str, Path] = {}
    metric = None
    for (method, _, _, seed), (run_dir, error) in zip(jobs, results, strict=True):
        row = rows[method]
        if error is not None:
            print(f"FAILED {method}{'' if seed is None else f' seed {seed}'}: {error}",
                  file=sys.stderr)
            row["failed"].append((seed, error))
            continue
        given = row.get("given", False)
        evaluation = None
        try:
            cfg = Run(run_dir).read_config()
            segmentation = task_family(cfg) == "segmentation"
            if segmentation and not given:
                backfill_test_metrics(run_dir)
                if calibrators:
                    add_calibrators(run_dir, list(calibrators))
            if segmentation and args is not None and (given or args.shift):
                evaluation = eval_seg_metrics([run_dir], eval_folder(args.out, method, run_dir),
                                              args)
            if segmentation and args is not None and args.conformal:
                row.setdefault("conformal", []).append(conformal_metrics(
                    run_dir, eval_folder(args.out, method, run_dir), args))
        except UntrustedCheckpointError:  # never go on past a file that could run code
            raise
        except UserError as err:
            print(f"FAILED {method}{'' if seed is None else f' seed {seed}'}: {err}",
                  file=sys.stderr)
            what = "evaluating it" if given else "adding the new test metrics"
            row["failed"].append((seed, f"{what}: {err}"))
            continue
        try:  # the run's own files, read (validated) here: a damaged one fails this run only
            metrics = evaluation if given else Run(run_dir).read_test_metrics()
            history = Run(run_dir).history()
        except UserError as err:
            print(f"FAILED {method}{'' if seed is None else f' seed {seed}'}: {err}",
                  file=sys.stderr)
            row["failed"].append((seed, f"reading the run: {err}"))
            continue
        if evaluation is not None and args.shift:
            row.setdefault("shift", []).append(evaluation)
        row.setdefault("metrics", []).append((run_dir, metrics))
        metric = metrics.get("score_metric") or score_metric(cfg)  # older runs: from the config
        row["summaries"].append(summarise(metrics, metric, history))
        if calibrators and metrics.get("calibrators"):
            row.setdefault("calibrators", []).append(calibrator_rows(metrics, list(calibrators)))
        first_run.setdefault(method, run_dir)
    return first_run, SCORE_NAMES.get(metric, metric or "mIoU")


def run_or_fail(config: Path, method: str | None, seed: int, out: Path, sets: list[str],
                checkpoints: str) -> tuple[Path, str | None]:
    """:func:`cals_seg.training.study.run_one`, a user error (a damaged file of a run left by
    an earlier call) reported as that run's failure, in one line, not as a traceback."""
    from cals_seg.commands._cli import one_line
    from cals_seg.training.study import run_one

    try:
        return run_one(config, method, seed, out, sets, checkpoints)
    except UntrustedCheckpointError:
        raise
    except UserError as err:
        return out / "runs", one_line(err)


def eval_folder(out: Path, row: str, run_dir: Path) -> Path:
    """Where compare has tools/eval_seg.py evaluate ``run_dir`` of ``row``:
    ``OUT/eval/<row>/<run folder name>``."""
    return out / "eval" / row.replace("/", "_") / run_dir.name


def _stamp(runs: list[Path]) -> list[str]:
    """What an evaluation of ``runs`` depends on besides the options: each checkpoint file and
    its modification time (a retrained run is evaluated again)."""
    from cals_seg.runs.run import Run

    out = []
    for run in runs:
        best = Run(run).best
        out.append(f"{best.resolve()}@{best.stat().st_mtime_ns if best.is_file() else 0}")
    return out


def eval_seg_argv(args: argparse.Namespace) -> list[str]:
    """The options compare passes to tools/eval_seg.py: no calibration maps, its
    ``--calibrators`` and ``--shift`` ones."""
    argv = ["--num-maps", "0"]
    if args.calibrators:
        argv += ["--calibrators", *args.calibrators]
    if args.shift:
        argv += ["--shift", *args.shift, "--shift-seed", str(args.shift_seed)]
        if args.calibrator_fit_shift:
            argv.append("--calibrator-fit-shift")
    return argv


def eval_seg_metrics(runs: list[Path], folder: Path, args: argparse.Namespace,
                     ensemble: bool = False) -> dict[str, Any]:
    """``folder/metrics.json`` of ``tools/eval_seg.py RUN... --out folder`` with
    :func:`eval_seg_argv` (``--ensemble`` of the runs with ``ensemble``), run in this process
    unless the same request (options and checkpoints) was evaluated there before.

    Raises:
        UserError: eval_seg refused or failed (its one-line message is on stderr).
    """
    from cals_seg.commands import eval_seg
    from cals_seg.errors import RunFileError
    from cals_seg.runs.run import Run
    from cals_seg.utils.io import write_json

    argv = [*map(str, runs), "--out", str(folder), *eval_seg_argv(args)]
    argv += ["--ensemble"] if ensemble else []
    request = {"argv": argv, "checkpoints": _stamp(runs)}
    done, metrics = folder / "compare_request.json", Run.eval_metrics(folder)
    if saved_json(done) == request and metrics.is_file():
        try:
            found = Run.read_eval_metrics(folder)
        except RunFileError as err:  # damaged: evaluated again
            print(f"notice: {err.path} {err.problem}; evaluating again.", file=sys.stderr,
                  flush=True)
        else:
            print(f"reusing {metrics}", flush=True)
            return found
    done.unlink(missing_ok=True)
    print("$ tools/eval_seg.py " + " ".join(argv), flush=True)
    code = eval_seg.main(argv)
    if code not in (0, 1) or not metrics.is_file():  # 1: a calibrator skipped, named
        raise UserError(f"tools/eval_seg.py {' '.join(argv)} exited with status {code} (its "
                        "message is above)")
    found = Run.read_eval_metrics(folder)
    write_json(done, request)
    return found


def saved_json(path: Path) -> dict[str, Any] | None:
    """What compare saved at ``path`` (a record of what it computed), None when there is none;
    a damaged one (empty, truncated, not an object) is None too, with a notice: it is computed
    again."""
    from cals_seg.errors import RunFileError
    from cals_seg.utils.io import read_json_file

    if not path.is_file():
        return None
    try:
        return read_json_file(path, "computed again")
    except RunFileError as err:
        print(f"notice: {path} {err.problem}; computing it again.", file=sys.stderr, flush=True)
        return None


def conformal_metrics(run_dir: Path, folder: Path, args: argparse.Namespace
                      ) -> dict[str, dict[str, Any]]:
    """``{calibration: {MODE: result}}`` of one run: eval_seg's conformal evaluation
    (:func:`cals_seg.commands._conformal.conformal_evaluation`) of ``args.conformal`` on the
    run's test split, on the logits (or after its ``calibrator=``) and after each calibrator of
    ``args.calibrators``; kept in ``folder/conformal.json`` and reused for the same checkpoint.
    A calibration that cannot be fitted is named on stderr and left out."""
    import json

    from cals_seg.commands._conformal import conformal_evaluation
    from cals_seg.runs.run import load_run
    from cals_seg.utils.io import write_json

    spec = args.conformal
    calibrations = list(dict.fromkeys([spec["calibrator"], *args.calibrators]))
    key = {c: json.dumps({**spec, "calibrator": c}, sort_keys=True) for c in calibrations}
    path = folder / "conformal.json"
    saved = saved_json(path) or {}
    if saved.get("checkpoints") != _stamp([run_dir]) or not isinstance(saved.get("results"),
                                                                        dict):
        saved = {"checkpoints": _stamp([run_dir]), "results": {}}
    missing = [c for c in calibrations if key[c] not in saved["results"]]
    if missing:
        run = load_run(run_dir, with_data=True, family="segmentation")
        for c in missing:
            print(f"{run_dir.name}: conformal {spec['alpha']:g} {','.join(spec['mode'])} after "
                  f"{c or 'no calibrator'}", flush=True)
            try:
                saved["results"][key[c]] = conformal_evaluation(
                    run, {**spec, "calibrator": c}, run.task.val_set, run.task.test_set)
            except (*USER_ERRORS, ValueError) as err:
                print(f"FAILED conformal after {c} on {run_dir}: {err}", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        write_json(path, saved)
    return {c or "uncalibrated": saved["results"][key[c]] for c in calibrations
            if key[c] in saved["results"]}


def ensemble_cost(runs: list[Path]) -> dict[str, Any]:
    """Inference seconds per test image of the first run and of the ensemble of ``runs``,
    measured here one after the other on the same loader (after a warm-up pass of the first
    run; data loading included in both), and their ratio."""
    import time

    import torch

    from cals_seg.evaluation.ensemble import Ensemble
    from cals_seg.evaluation.stream import predict
    from cals_seg.runs.run import load_run
    from cals_seg.training.engine import make_loader

    first = load_run(runs[0], with_data=True, family="segmentation")
    members = [first.model] + [load_run(r, family="segmentation", device=str(first.device)).model
                               for r in runs[1:]]
    e = first.config.eval
    loader = make_loader(first.task.test_set, e.batch_size, False, first.config.data.num_workers)

    def seconds(model: Any) -> float:
        start, images = time.perf_counter(), 0
        with torch.no_grad():
            for logits, _ in predict(model, loader, first.device, first.precision,
                                     protocol=first.task.protocol):
                images += len(logits)
        return (time.perf_counter() - start) / max(images, 1)

    seconds(first.model)  # warm-up: one-time costs out of the timing
    single = seconds(first.model)
    together = seconds(Ensemble(members).eval())
    return {"members": len(runs), "forward_passes_per_image": len(runs),
            "seconds_per_image_single": single, "seconds_per_image": together,
            "cost_ratio": together / single if single > 0 else None,
            "device": str(first.device)}


def evaluate_ensembles(args: argparse.Namespace, rows: dict[str, dict[str, Any]]
                       ) -> dict[str, dict[str, Any]]:
    """``{"<row> ensemble": {"metrics", "cost", "members"}}``: for each trained segmentation
    row with two seeds or more, tools/eval_seg.py RUN... --ensemble (clean, --calibrators and
    --shift as for its runs) into ``OUT/eval/<row>/ensemble`` and :func:`ensemble_cost`."""
    from cals_seg.runs.run import Run
    from cals_seg.tasks import task_family
    from cals_seg.utils.io import write_json

    out = {}
    for name, row in rows.items():
        if args.ensemble and name not in args.ensemble:
            continue
        members = [d for d, _ in row.get("metrics", [])
                   if task_family(Run(d).read_config()) == "segmentation"]
        if row.get("given") or len(members) < 2:
            if not row.get("given") and row.get("metrics"):
                print(f"--ensemble: {name} has {len(members)} segmentation run(s); an ensemble "
                      "needs two seeds or more (--seeds 0 1 2)", file=sys.stderr)
            continue
        folder = args.out / "eval" / name.replace("/", "_") / "ensemble"
        try:
            metrics = eval_seg_metrics(members, folder, args, ensemble=True)
        except USER_ERRORS as err:
            print(f"FAILED {name} ensemble: {err}", file=sys.stderr)
            continue
        path, stamp = folder / "cost.json", _stamp(members)
        cost = saved_json(path) or {}
        if cost.get("checkpoints") != stamp:
            cost = {**ensemble_cost(members), "checkpoints": stamp}
            write_json(path, cost)
        out[f"{name} ensemble"] = {"metrics": metrics, "cost": cost, "members": len(members),
                                   "row": name}
    return out


def plot_study(out: Path, rows: dict[str, dict[str, Any]], first_run: dict[str, Path],
               score_name: str) -> None:
    """ECE against the score, a reliability grid and the multiplier curves of each row."""

    from cals_seg.runs.run import Run
    from cals_seg.training.tables import mean_std
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
        metrics = rows[method]["metrics"][0][1]  # the test metrics (or eval_seg's) read before
        grid.append((method, metrics["pre_ts"]["reliability"]))
        plotting.plot_multiplier_curves(
            Run(run_dir).history(), out / f"lambda_curves_{method}.png",
            metrics.get("class_names"),
        )
    if grid:
        plotting.plot_reliability_grid(grid, out / "reliability_grid.png")


EXTRA_OUTPUTS = ["conformal.md", "conformal.csv", "shift.md", "shift.csv",
                 "shift_ece_severity.png", "ensemble.md", "ensemble.csv"]


def check_extras(args: argparse.Namespace) -> None:
    """``--conformal`` parsed into its spec, ``--shift`` checked, and the options that need
    another refused, before any run starts.

    Raises:
        UserError: one line naming the option and the fix.
    """
    from cals_seg.data.corruptions import parse_shifts

    if args.conformal is not None:
        from cals_seg.commands._conformal import parse_conformal

        args.conformal = parse_conformal(args.conformal)
    if args.shift:
        parse_shifts(args.shift, args.shift_seed)  # refused here, passed on as given
    if args.calibrator_fit_shift and not (args.shift and args.calibrators):
        raise UserError("--calibrator-fit-shift: give --shift NAME:SEVERITY ... and the "
                        "calibrators to fit with --calibrators, e.g. --calibrators ts.")
    if args.reference_out is not None and (len(args.configs) != 1 or args.configs[0].is_dir()):
        raise UserError("--reference-out: give one setup file (the reference numbers are per "
                        "setup), e.g. configs/synthetic_deeplabv3_short.yaml --methods ce "
                        "cals_alm.")


def write_extras(args: argparse.Namespace, rows: dict[str, dict[str, Any]],
                 ensembles: dict[str, dict[str, Any]]) -> None:
    """OUT/conformal.*, OUT/shift.* and shift_ece_severity.png, OUT/ensemble.* (each when its
    option was given)."""
    from cals_seg.training import tables

    if args.conformal:
        tables.write_conformal_results(args.out, {m: r.get("conformal", []) for m, r in
                                                 rows.items()})
    if args.shift:
        evaluations = {m: r.get("shift", []) for m, r in rows.items()}
        evaluations.update({name: [e["metrics"]] for name, e in ensembles.items()})
        tables.write_shift_results(args.out, evaluations)
    if args.ensemble is not None:
        tables.write_ensemble_results(args.out, ensembles, rows)


def write_reference_out(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    """``--reference-out FILE``: this study's entry of the demo's reference file
    (:func:`cals_seg.training.study.reference_entry`), under the setup file's path as given
    (relative to the working folder when inside it), naming this command."""
    import shlex

    from cals_seg.runs.run import Run
    from cals_seg.training.study import precision_words, reference_entry, write_reference

    config = args.configs[0]
    try:
        setup = config.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        setup = config.as_posix()
    first = next(((Path(d), m) for row in rows.values() for d, m in row.get("metrics", [])[:1]),
                 None)
    precision = precision_words(Run(first[0]).trained_precision(), first[1].get("precision")) \
        if first else None
    command = "python tools/compare.py " + shlex.join(args.argv)
    write_reference(args.reference_out, setup, reference_entry(
        rows, list(args.calibrators), command=command, seeds=args.seeds, precision=precision))
    print(f"wrote the reference numbers of {setup} into {args.reference_out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)

    with consent_of(args):  # --trust-code: the run folders' factories may be imported
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from cals_seg.training.tables import write_results

    start = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    try:
        check_folder("--out", str(args.out), must_exist=False, writable=True)
        check_extras(args)
        jobs = plan(args, rows)
        unknown = [r for r in args.ensemble or [] if r not in rows]
        if unknown:

            raise UserError(f"--ensemble {' '.join(unknown)}: no such row in this comparison "
                            f"(its rows: {', '.join(rows)}); name rows of --methods, or give "
                            "--ensemble alone for every row")

        # the tables and figures: never over a file compare did not write (runs/ is resumed)
        outputs = OutputFolder(args.out, "compare", inputs=[])
        names = ["results.md", "results.csv", "calibrators.md", "calibrators.csv",
                 "ece_vs_score.png", "reliability_grid.png", *EXTRA_OUTPUTS]
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
                lambda j: (j[1], None) if j[2] == GIVEN else
                run_or_fail(j[1], j[2], j[3], args.out, args.set, args.checkpoints), jobs
            )
        )
    try:
        first_run, score_name = collect(jobs, results, rows, args.calibrators, args)
        ensembles = evaluate_ensembles(args, rows) if args.ensemble is not None else {}
    except UntrustedCheckpointError as err:
        return report(err)
    write_results(args.out, rows, score_name)
    if args.calibrators:
        from cals_seg.training.tables import write_calibrator_results

        write_calibrator_results(args.out, rows)
    write_extras(args, rows, ensembles)
    if args.reference_out is not None:
        try:
            write_reference_out(args, rows)
        except USER_ERRORS as err:
            return report(err)
    plot_study(args.out, rows, first_run, score_name)
    print(
        f"wrote {args.out / 'results.md'}, results.csv and the figures in {args.out} "
        f"({len(jobs)} runs, {(time.perf_counter() - start) / 60:.1f} min)"
    )
    return 0 if all(row["summaries"] for row in rows.values()) else 1


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
