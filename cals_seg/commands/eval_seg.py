"""Evaluate a trained segmentation run: metrics before/after calibration, plots, maps.

Metrics before and after temperature scaling (fitted on the validation split), plots, and
per-image calibration maps.

    python tools/eval_seg.py runs/<name> [--checkpoint best|last|FILE] [--split test]
        [--out DIR] [--num-maps 4] [--mode slide --window 512 --stride 341]
        [--resize S] [--pad P] [--set key=value ...]
        [--calibrators ts vector dirichlet lts selective boundary_ts] [--refit-calibrators]
        [--calibrator-param lts.epochs=20 ...] [--save-calibrators-to-run]
        [--conformal alpha=0.1 [mode=risk|image:0.9|class|band] [score=NAME]
                     [calibrator=NAME]]
        [--shift NAME:SEVERITY ... | all:3 | all] [--shift-seed 0] [--calibrator-fit-shift]
    python tools/eval_seg.py RUN1 RUN2 ... --ensemble --out DIR [options above]
    python tools/eval_seg.py CONFIG --checkpoint FILE ...     (older form: another config)

Every metric is taken at each image's own resolution against its unmodified mask; the network
input follows the run's ``eval`` section (resize, pad, whole or slide), overridden by the options.

Writes DIR/metrics.json (every metric of the test meters, pooled and per-image, per boundary
band and object size, pre- and post-TS with T), DIR/reliability_{pre,post}_ts.png,
DIR/ece_bands.png and DIR/ece_sizes.png (ECE per distance band / object-size bucket, pre- and
post-TS), DIR/risk_coverage.png, DIR/reliability_bands_{pre,post}_ts.png (one diagram per band),
DIR/lambda_curves.png when the run has multipliers, and DIR/maps/<id>.png (image, ground truth,
prediction, confidence, errors, confidence on errors).

With --calibrators, each post-hoc calibrator named (docs/calibrators.md) is loaded from
<run>/calibrators/<name>.pt when fitted for this use, or fitted on the validation split
(--refit-calibrators refits); all are evaluated on the split in the same single pass as the
pre/post-TS metrics. A new fit is saved as the run's own, <run>/calibrators/<name>.pt (which
predict_seg and export use), only by an evaluation in place of the best checkpoint with the
run's config and the calibrator's default parameters (or with --save-calibrators-to-run);
otherwise (--out elsewhere, --calibrator-param, --set, a protocol option, another checkpoint)
it lives with the evaluation, in DIR/calibrators/NAME.pt, and a line says which (the run's own
fit is still reused, never written, when it was made for this use).
metrics.json["calibrators"][NAME] holds the same dictionary as "pre_ts",
metrics.json["calibrator_fits"][NAME] the fit's summary (held-out images, passes, seconds);
DIR/calibrators.md is the table (ECE, band-weighted ECE, boundary and interior ECE, NLL, AURC,
mIoU), DIR/reliability_<name>.png each calibrator's diagram, and the band / size plots and
per-band diagrams include every calibrator. A calibrator that cannot be fitted (e.g. lts and
selective on fewer than 5 validation images) is named with its reason on stderr and in
metrics.json["calibrator_errors"]; the others are evaluated, and the exit status is 1.

With --conformal, per-pixel prediction sets with a guarantee (docs/conformal.md) are fitted on
the held-out validation images and measured on the split: metrics.json["conformal"][MODE]
(alpha, threshold, calibration_images and their ids, risk, coverage, set_size, coverage_band,
...), the table DIR/conformal.md and DIR/maps/<id>_set_size_<mode>.png (classes per pixel).

--out DIR may not lie inside (or hold) data.root, and a file there is replaced only when
eval_seg wrote it (DIR/.cals_seg_outputs.json lists them). Writing into the run (the default DIR,
or --calibrators) holds the run folder's lock: refused while another process trains the run.
With --shift, the split is evaluated again with each image corruption (docs/shift.md; masks
untouched, seeded by --shift-seed): metrics.json["shift"]["NAME:SEVERITY"] holds the same
dictionary as the clean evaluation and DIR/shift.md the table (with the mean over corruptions per
severity). --calibrator-fit-shift also fits each calibrator on corrupted validation images
(corruptions the benchmark does not use), reported as NAME+drift. --ensemble evaluates the mean
probability of the runs given (their data and protocol must match).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cals_seg.commands._cli import (
    USER_ERRORS,
    add_method_argument,
    add_protocol_arguments,
    add_set_argument,
    add_trust_argument,
    launch,
    protocol_overrides,
    report,
    run_folder_command,
)
from cals_seg.commands._shift import (
    add_shift_arguments,
    check_shift_arguments,
    open_ensemble,
    parse_seed,
    write_shift,
)
from cals_seg.config.checks import bounded_input
from cals_seg.config.rules import check_folder
from cals_seg.errors import MissingPathError, UserError
from cals_seg.utils.background import Background
from cals_seg.utils.lock import RunLock
from cals_seg.utils.paths import OutputFolder


def calibrator_name(value: str) -> str:
    """``value`` when it names a calibrator of cals_seg.calibrators.CALIBRATORS, read at the
    call (a calibrator registered later counts; --help never calls it, so imports no torch)."""
    from cals_seg.calibrators import CALIBRATORS

    if value not in CALIBRATORS and value not in CALIBRATORS.beside:  # contrib: after --set
        raise argparse.ArgumentTypeError(f"unknown calibrator {value!r}; valid names are "
                                         f"{list(CALIBRATORS)}")
    return value


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", metavar="RUN_DIR", nargs="+",
                        help="a run folder (or, older form, a YAML config with --checkpoint); "
                        "several with --ensemble")
    parser.add_argument("--checkpoint", default="best",
                        help="best (default), last, or a checkpoint file")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--out", default=None, help="output folder (default: <run>/eval_<split>)")
    parser.add_argument(
        "--num-maps",
        type=_count,
        default=None,
        help="calibration maps for the first N images (default: eval.num_maps)",
    )
    parser.add_argument("--calibrators", nargs="+", default=[], type=calibrator_name,
                        metavar="NAME", help="post-hoc calibrators to fit (on validation) and "
                        "evaluate: any registered name (docs/calibrators.md), e.g. ts vector "
                        "boundary_ts")
    parser.add_argument("--refit-calibrators", action="store_true",
                        help="refit the calibrators already saved in <run>/calibrators/")
    parser.add_argument("--save-calibrators-to-run", action="store_true",
                        help="save the fits into <run>/calibrators/ (which predict_seg and "
                        "export use) even when --out is elsewhere, the parameters are not the "
                        "defaults or the run's config is overridden (default: such fits live "
                        "in the evaluation's folder, OUT/calibrators/)")
    parser.add_argument("--calibrator-param", nargs="+", action="extend", default=[],
                        metavar="NAME.KEY=VALUE", help="a calibrator's parameter, e.g. "
                        "lts.epochs=20 or boundary_ts.bands=[2,5,10] (YAML values)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="KEY=VALUE",
                        help="prediction sets with a guarantee: alpha=0.1 [mode=risk|image:0.9|"
                        "class|band (comma-separated)] [score=NAME] [calibrator=NAME]")
    add_protocol_arguments(parser)
    add_shift_arguments(parser)
    add_method_argument(parser)
    add_set_argument(parser)
    add_trust_argument(parser)
    parser.add_argument("--logit-cache-gb", type=float, default=2.0, metavar="GB",
                        help="logits kept in memory so that each distinct image goes through the "
                        "network once (default 2; 0: run it for every consumer)")
    args = parser.parse_args(argv)
    if len(args.run) == 1 and not args.ensemble:
        args.run = args.run[0]
    return args


def calibrator_params(items: list[str]) -> dict[str, dict]:
    """``{name: {key: value}}`` from ``NAME.KEY=VALUE`` items (values read as YAML), checked
    against the registry before any work: the calibrator, its parameter (the valid keys
    listed) and the value (the calibrator built with it).

    Raises:
        UserError: a malformed item, an unknown calibrator or parameter, or a bad value, in
            one line naming the item.
    """
    import yaml

    from cals_seg.calibrators import CALIBRATORS, build_calibrator
    from cals_seg.evaluation.evaluator import calibrator_keys

    out: dict[str, dict] = {}
    given: dict[str, str] = {}
    for item in items:
        head, sep, value = item.partition("=")
        name, dot, key = head.partition(".")
        if not (sep and dot and name and key):
            raise UserError(f"--calibrator-param {item!r}: expected NAME.KEY=VALUE, e.g. "
                             "lts.epochs=20.")
        if name not in CALIBRATORS:
            raise UserError(f"--calibrator-param {item!r}: unknown calibrator {name!r}; valid "
                             f"names are {sorted(CALIBRATORS)}.")
        valid = calibrator_keys(name)
        if key not in valid:
            raise UserError(f"--calibrator-param {item!r}: unknown parameter {key!r} of "
                            f"calibrator {name}; valid keys are {valid}.")
        try:
            out.setdefault(name, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise UserError(f"--calibrator-param {item!r}: expected a YAML value ({problem}), "
                            f"e.g. {name}.{key}=[2, 5] (quote the item for the shell).") from None
        given[name] = item
    for name, params in out.items():  # the values, before any network pass (K: a stand-in)
        try:
            build_calibrator(name, 2, **params)
        except (TypeError, ValueError) as err:
            raise UserError(f"--calibrator-param {given[name]!r}: "
                            f"{' '.join(str(err).split())}") from None
    return out


def open_run(args: argparse.Namespace):
    """The run of ``RUN_DIR [--checkpoint best|last|FILE]``, or of the older form
    ``CONFIG --checkpoint FILE`` (the config given instead of the run's own)."""
    from cals_seg.runs.run import load_run

    sets = [*args.set, *protocol_overrides(args), *plan_overrides(args)]
    given = Path(args.run)
    if given.is_file() and given.suffix in (".yaml", ".yml"):  # CONFIG --checkpoint FILE
        if args.checkpoint in ("best", "last"):
            raise MissingPathError(f"{given} is a config: name the checkpoint with --checkpoint "
                                    "FILE, or give the run folder instead.")
        return load_run(args.checkpoint, overrides=sets, family="segmentation", with_data=True,
                        config=given, method=args.method)
    if args.checkpoint in ("best", "last"):
        return load_run(given, args.checkpoint, overrides=sets, family="segmentation",
                        with_data=True)
    return load_run(args.checkpoint, overrides=sets, family="segmentation", with_data=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    return run_folder_command(args, _main)


def plan_overrides(args: argparse.Namespace) -> list[str]:
    """The flags of the plan written as the config keys they stand for (``--calibrators ts``
    is ``eval.calibrators=[ts]``), after the ``--set`` items: the plan of this evaluation is
    the run's config (with both) read by :meth:`~cals_seg.evaluation.evaluator.EvalPlan.
    from_config`. Flags not given leave the keys as the run's config has them."""
    import json

    out = []
    shift, seed = getattr(args, "shift", None), getattr(args, "shift_seed", None)
    if args.calibrators:
        out.append(f"eval.calibrators={json.dumps(list(dict.fromkeys(args.calibrators)))}")
    if args.calibrator_param:
        out.append(f"eval.calibrator_params={json.dumps(calibrator_params(args.calibrator_param))}")
    if args.conformal is not None:
        out.append(f"eval.conformal={json.dumps(' '.join(args.conformal))}")
    if shift:
        out.append(f"eval.shift={json.dumps(list(shift))}")
    if seed is not None:
        out.append(f"eval.shift_seed={parse_seed(seed)}")
    if getattr(args, "calibrator_fit_shift", False):
        out.append("eval.calibrator_fit_shift=true")
    return out


def _main(args: argparse.Namespace) -> int:
    from cals_seg.data.checks import check_voc_data

    try:
        if args.out:
            check_folder("--out", args.out, must_exist=False, writable=True)
        from cals_seg.calibrators import CALIBRATORS
        from cals_seg.commands._cli import enable_set_contrib, registered_or_refused

        enable_set_contrib(args.set)  # every option checked before any work, in its own words
        registered_or_refused(CALIBRATORS, args.calibrators, "--calibrators")
        calibrator_params(args.calibrator_param)
        if args.conformal is not None:
            from cals_seg.evaluation.conformal_fit import parse_conformal

            parse_conformal(args.conformal)
        check_shift_arguments(args)
        ensemble = None
        if args.ensemble:
            run, ensemble = open_ensemble(args, open_run)
        else:
            run = open_run(args)
        plan = plan_of(run, args, ensemble)
        check_voc_data(run.task, tuple(dict.fromkeys(("val", plan.split))))  # files named
        lock = claim_outputs(run, plan, out_of(run, args), bool(args.out))
    except USER_ERRORS as err:
        return report(err)
    try:
        return evaluate_run(run, plan, out_of(run, args))
    finally:  # main called in a process that goes on (a test, a notebook): not held after
        if lock is not None:
            lock.release()


def out_of(run, args: argparse.Namespace) -> Path:
    """The output folder: ``--out``, else ``<run>/eval_<split>``."""
    return Path(args.out) if args.out else run.eval_dir(args.split)


def plan_of(run, args: argparse.Namespace, ensemble: Path | None = None):
    """The :class:`~cals_seg.evaluation.evaluator.EvalPlan` of this evaluation: the run's
    config (flags written into it) and the options that are not config keys: the split, where
    the fits go (:func:`fits_home`), the maps, the logit cache."""
    from cals_seg.evaluation.evaluator import EvalPlan

    out = out_of(run, args)
    folder, why = (ensemble, "an ensemble's fit") if ensemble is not None else \
        fits_home(run, args)
    num_maps = run.config.eval.num_maps if args.num_maps is None else args.num_maps
    return EvalPlan.from_config(
        run.config, split=args.split, refit=args.refit_calibrators,
        fits=None if why is None else folder, fits_why=why, num_maps=num_maps,
        maps_dir=out / "maps", cache_bytes=int(max(args.logit_cache_gb, 0.0) * 2**30))


def claim_outputs(run, plan, out: Path, given: bool) -> RunLock | None:
    """Before any work: the run folder's lock when the evaluation writes into the run (its
    calibrators, the default output folder), and an output folder that neither overlaps the
    data nor holds a file of the same name that eval_seg did not write (``cals_seg.utils.paths``);
    files an earlier evaluation wrote there and this one does not are removed (one evaluation
    per folder). Returns the lock (held until released or the process ends)."""
    from cals_seg.utils.distributed import is_main_process

    if not is_main_process():
        return None
    lock = None
    if not given or plan.calibrators:
        lock = RunLock(run.folder, "eval").acquire()
    outputs = OutputFolder(out, "eval_seg", inputs=[run.config.data.root])
    split_set = getattr(run.task, f"{plan.split}_set")
    names = planned_outputs(plan, split_set.ids[:plan.num_maps]) + planned_fits(run, plan, out)
    # The default folder is inside the run, which the toolkit wrote: its files of these names
    # are eval_seg's; a link is never written through either way.
    outputs.check_free(names, replace_unlisted=not given)
    outputs.claim(names, only=True)
    return lock


def planned_outputs(plan, map_ids: list) -> list[str]:
    """Every file eval_seg may write into its output folder for ``plan``, relative to it:
    checked against the folder's manifest before any work and claimed (a test runs every option
    and checks that nothing else is written)."""
    from cals_seg.runs.run import EVAL_METRICS_FILE

    keys = ["pre_ts", "post_ts", *plan.calibrators]
    if plan.fit_shift:
        keys += [f"{name}+drift" for name in plan.calibrators]
    names = [EVAL_METRICS_FILE, "calibrators.md", "lambda_curves.png", "ece_bands.png",
             "ece_sizes.png", "risk_coverage.png", "conformal.md", "shift.md",
             *[f"reliability_{k}.png" for k in keys],
             *[f"reliability_bands_{k}.png" for k in keys],
             *[f"maps/{i}.png" for i in map_ids]]
    if plan.conformal:
        names += [f"maps/{i}_set_size_{m.replace(':', '-')}.png" for m in plan.conformal["mode"]
                  for i in map_ids]
    return names


def planned_fits(run, plan, out: Path) -> list[str]:
    """The fits this evaluation saves inside its output folder (the plan's store when it is
    not the run's own), relative to it: ``calibrators/NAME.pt``, the drift fits and the
    conformal thresholds."""
    from cals_seg.utils.fits import FitStore

    if plan.fits is None:
        return []
    store = FitStore(plan.fits)
    files = [store.calibrator(n) for n in plan.calibrators]
    if plan.fit_shift:
        files += [store.drift(plan.shift_seed).calibrator(n) for n in plan.calibrators]
    if plan.conformal and not plan.conformal.get("calibrator"):
        c = plan.conformal
        files += [store.conformal(m, c["score"], c["alpha"], c["seed"]) for m in c["mode"]]
    names = []
    for file in files:
        try:
            names.append(file.resolve().relative_to(out.resolve()).as_posix())
        except ValueError:  # an ensemble's folder elsewhere
            continue
    return names


def evaluate_run(run, plan, out: Path) -> int:
    """The evaluation of ``plan`` (:class:`~cals_seg.evaluation.evaluator.Evaluator`), then its
    report in ``out`` (rank 0); exit status 1 when a calibrator could not be fitted."""
    from cals_seg.data.checks import warn_large_images
    from cals_seg.evaluation.evaluator import Evaluator
    from cals_seg.evaluation.logit_cache import logit_cache
    from cals_seg.utils.distributed import is_main_process

    cfg = run.config
    split_set = getattr(run.task, f"{plan.split}_set")
    warn_large_images(split_set, plan.split, bounded_input(cfg))
    figures = Background()

    def clean(result: dict) -> None:  # its figures drawn while the corrupted splits stream
        if is_main_process():
            out.mkdir(parents=True, exist_ok=True)
            figures.start(draw_clean_figures, dict(result), out, cfg.name, plan.split)

    # one logit cache for the evaluation and the calibration maps of its report
    with logit_cache(plan.cache_bytes):
        try:
            result = Evaluator(run, plan, on_clean=clean).run()
        except USER_ERRORS as err:
            return report(err)
        if not is_main_process():  # every rank computed the same numbers; rank 0 writes them
            return 0
        write_evaluation(run, plan, result.metrics, out, split_set, figures)
    if result.advice:  # under-confident, and no post-hoc calibrator fitted: the one line
        print(result.advice, flush=True)
    return 1 if result.skipped else 0  # 1: some calibrators could not be fitted (named)


def fits_home(run, args: argparse.Namespace, name: str | None = None
              ) -> tuple[Path, str | None]:
    """Where this evaluation saves its fits (of calibrator ``name``, or of every kind):
    ``(folder, None)`` for the run's own, ``<run>/calibrators/`` (which predict_seg and export
    use), when the evaluation is the run's own: in place (no --out, or the default folder), of
    its best checkpoint, with its config (no --set, no protocol option, not the older CONFIG
    form) and the calibrator's default parameters, or with --save-calibrators-to-run;
    otherwise ``(OUT/calibrators, why)``: the fit lives with the evaluation (an ensemble's:
    its own folder), and the run's own fit is left as it is."""
    if args.save_calibrators_to_run:
        return run.calibrators, None
    reasons = []
    if args.out and Path(args.out).resolve() != run.eval_dir(args.split).resolve():
        reasons.append("--out elsewhere")
    if Path(run.checkpoint).resolve() != run.best.resolve():
        reasons.append(f"checkpoint {Path(run.checkpoint).name}")
    if [i for i in args.set if not plan_key(i)] or protocol_overrides(args) or \
            Path(str(args.run)).is_file():
        reasons.append("the run's config overridden")
    params = run.config.eval.calibrator_params or {}
    given = {n: params[n] for n in ([name] if name else params) if params.get(n)}
    if any(not default_params(n, p) for n, p in given.items()):
        reasons.append("parameters other than the defaults")
    if not reasons:
        return run.calibrators, None
    return evaluation_fits(run, args), ", ".join(reasons)


def evaluation_fits(run, args: argparse.Namespace) -> Path:
    """The folder of the fits that live with this evaluation: ``OUT/calibrators``."""
    return out_of(run, args) / "calibrators"


def plan_key(item: str) -> bool:
    """A ``--set`` item of the evaluation's plan (``eval.calibrators=...``): it changes what
    is evaluated, not the run's network or its inputs."""
    from cals_seg.evaluation.evaluator import PLAN_KEYS

    key = item.partition("=")[0].strip()
    return key in {f"eval.{k}" for k in (*PLAN_KEYS, "shift_seed", "calibrator_fit_shift")}


def default_params(name: str, params: dict) -> bool:
    """``params`` of calibrator ``name`` are its defaults (every value as the constructor's)."""
    from cals_seg.calibrators import resolved_params

    return resolved_params(name, 2, params) == resolved_params(name, 2, {})


def draw_clean_figures(result: dict, out: Path, setup: str, split: str) -> None:
    """The figures of the clean evaluation ``result`` of ``split`` in ``out``: the reliability
    diagrams (pre-TS, post-TS, each calibrator) and the region plots (ECE per band and size,
    risk-coverage, reliability per band), titled with the ``setup``'s name and the split."""
    from cals_seg.evaluation.reports import plot_regions
    from cals_seg.visualization import plotting

    for key in ("pre_ts", "post_ts"):
        if result.get(key):
            title = f"{setup} {split}, {key.replace('_', '-')}"
            if key == "post_ts":
                title += f" (T = {result['temperature']:.2f})"
            plotting.plot_reliability_diagram(
                result[key]["reliability"],
                out / f"reliability_{key}.png",
                title=title,
                ece=result[key]["ece"],
            )
    for cal, metrics in (result.get("calibrators") or {}).items():
        plotting.plot_reliability_diagram(metrics["reliability"], out / f"reliability_{cal}.png",
                                          title=f"{setup}, {split} split, {cal}",
                                          ece=metrics["ece"])
    plot_regions(result, out, f"{setup} {split}")


def write_evaluation(run, plan, result: dict, out: Path, split_set,
                     figures: Background | None = None) -> int:
    """What rank 0 writes into ``out``: metrics.json, the calibrator table, the multiplier
    curves and the calibration maps, and the clean figures (:func:`draw_clean_figures`: here,
    or joined from ``figures`` where they were started while the corrupted splits streamed);
    prints the summary line."""
    from cals_seg.evaluation.reports import calibration_maps
    from cals_seg.runs.run import Run
    from cals_seg.utils.io import write_json
    from cals_seg.visualization import plotting

    cfg, task = run.config, run.task
    out.mkdir(parents=True, exist_ok=True)
    write_json(Run.eval_metrics(out), result)
    if figures is None or not figures.started:
        draw_clean_figures(result, out, cfg.name, plan.split)
    write_calibrator_outputs(result, out, f"{cfg.name}, {plan.split} split")
    if result.get("shift"):
        write_shift(result, out, f"{cfg.name}, {plan.split} split")
    if result.get("conformal"):
        from cals_seg.evaluation.conformal_eval import conformal_table

        table = conformal_table(result["conformal"])
        (out / "conformal.md").write_text(f"{cfg.name}, {plan.split} split: conformal sets "
                                          "(docs/conformal.md).\n\n" + table)
        print(table)
    plotting.plot_multiplier_curves(run.history(), out / "lambda_curves.png", task.class_names)
    maps = calibration_maps(
        run.model,
        split_set,
        split_set.ids[:plan.num_maps],
        out / "maps",
        run.device,
        task.class_names,
        task.ignore_index,
        protocol=task.protocol,
        amp=run.precision,
    )
    pre, post = result["pre_ts"], result["post_ts"]
    line = (f"{plan.split}: ECE {100 * pre['ece']:.2f}%  AECE {100 * pre['aece']:.2f}%  "
            f"mIoU {pre['miou']:.4f}")
    if post is not None:
        line += f"  | post-TS ECE {100 * post['ece']:.2f}% (T = {result['temperature']:.3f})"
    if figures is not None:
        figures.wait()
    print(line)
    print(f"wrote {Run.eval_metrics(out)} and {len(maps)} calibration maps in {out / 'maps'}")
    return 0


def write_calibrator_outputs(result: dict, out: Path, title: str) -> None:
    """The table of the post-hoc calibrators, ``out/calibrators.md`` (their reliability
    diagrams are among :func:`draw_clean_figures`)."""
    from cals_seg.evaluation.engine import calibration_table

    if not result.get("calibrators"):
        return
    rows = {"uncalibrated": result["pre_ts"]}
    if result.get("post_ts"):
        rows["ts (the run's T)"] = result["post_ts"]
    rows.update(result["calibrators"])
    table = calibration_table(rows)
    (out / "calibrators.md").write_text(
        f"{title}; calibrators fitted on the validation split. Values in % except NLL.\n\n"
        + table)
    print(table)


def cli() -> None:
    """Console entry point (joins the process group under torchrun)."""

    launch(main)


if __name__ == "__main__":
    cli()
