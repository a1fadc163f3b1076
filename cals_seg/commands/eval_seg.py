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
import sys
from pathlib import Path
from typing import Any

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
    drift_calibrators,
    open_ensemble,
    shift_results,
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


def calibrator_keys(name: str) -> list[str]:
    """The parameters of registered calibrator ``name`` (its constructor's, as
    :func:`cals_seg.calibrators.build_calibrator` accepts them)."""
    import inspect

    from cals_seg.calibrators import CALIBRATORS

    cls = CALIBRATORS.lookup(name)
    return [p for p in inspect.signature(cls.__init__).parameters
            if p not in ("self", "num_classes")]


def open_run(args: argparse.Namespace):
    """The run of ``RUN_DIR [--checkpoint best|last|FILE]``, or of the older form
    ``CONFIG --checkpoint FILE`` (the config given instead of the run's own)."""
    from cals_seg.runs.run import load_run

    sets = [*args.set, *protocol_overrides(args)]
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


def _main(args: argparse.Namespace) -> int:
    from cals_seg.data.checks import check_voc_data

    try:
        if args.out:
            check_folder("--out", args.out, must_exist=False, writable=True)
        from cals_seg.calibrators import CALIBRATORS
        from cals_seg.commands._cli import enable_set_contrib, registered_or_refused

        enable_set_contrib(args.set)
        registered_or_refused(CALIBRATORS, args.calibrators, "--calibrators")
        args.calibrator_params = calibrator_params(args.calibrator_param)
        if args.conformal is not None:
            from cals_seg.commands._conformal import parse_conformal

            args.conformal = parse_conformal(args.conformal)

        check_shift_arguments(args)
        run = open_ensemble(args, open_run) if args.ensemble else open_run(args)
        check_voc_data(run.task, tuple(dict.fromkeys(("val", args.split))))  # files named
        claim_outputs(run, args)
    except USER_ERRORS as err:
        return report(err)
    from cals_seg.evaluation.logit_cache import logit_cache

    # One network call per distinct input image: every consumer (temperature and calibrator
    # fits, conformal fits, meters, shift statistics, maps) reads the logits from one cache.
    with logit_cache(int(max(args.logit_cache_gb, 0.0) * 2**30)):
        return evaluate_run(run, args)


def claim_outputs(run, args: argparse.Namespace) -> None:
    """Before any work: the run folder's lock when the evaluation writes into the run (its
    calibrators, the default output folder), and an output folder that neither overlaps the
    data nor holds a file of the same name that eval_seg did not write (``cals_seg.utils.paths``).
    """
    from cals_seg.utils.distributed import is_main_process

    if not is_main_process():
        return
    folder = run
    if not args.out or args.calibrators:
        args.run_lock = RunLock(folder.path, "eval").acquire()  # held until the process ends
    out = Path(args.out) if args.out else folder.eval_dir(args.split)
    outputs = OutputFolder(out, "eval_seg", inputs=[run.config.data.root])
    split_set = getattr(run.task, f"{args.split}_set")
    num_maps = run.config.eval.num_maps if args.num_maps is None else args.num_maps
    names = planned_outputs(args, split_set.ids[:num_maps]) + planned_fits(run, args, out)
    # The default folder is inside the run, which the toolkit wrote: its files of these names
    # are eval_seg's; a link is never written through either way.
    outputs.check_free(names, replace_unlisted=not args.out)
    outputs.claim(names)


def planned_outputs(args: argparse.Namespace, map_ids: list) -> list[str]:
    """Every file eval_seg may write into its output folder for ``args``, relative to it:
    checked against the folder's manifest before any work and claimed (a test runs every option
    and checks that nothing else is written)."""
    from cals_seg.runs.run import EVAL_METRICS_FILE

    keys = ["pre_ts", "post_ts", *args.calibrators]
    if getattr(args, "calibrator_fit_shift", False):
        keys += [f"{name}+drift" for name in args.calibrators]
    names = [EVAL_METRICS_FILE, "calibrators.md", "lambda_curves.png", "ece_bands.png",
             "ece_sizes.png", "risk_coverage.png", "conformal.md", "shift.md",
             *[f"reliability_{k}.png" for k in keys],
             *[f"reliability_bands_{k}.png" for k in keys],
             *[f"maps/{i}.png" for i in map_ids]]
    conformal = getattr(args, "conformal", None)
    if isinstance(conformal, dict):
        names += [f"maps/{i}_set_size_{m.replace(':', '-')}.png" for m in conformal["mode"]
                  for i in map_ids]
    return names


def planned_fits(run, args: argparse.Namespace, out: Path) -> list[str]:
    """The calibrator fits this evaluation saves inside its output folder (:func:`fits_home`:
    not the run's own), relative to it: ``calibrators/NAME.pt``."""
    names = []
    for name in dict.fromkeys(getattr(args, "calibrators", [])):
        folder = fits_home(run, args, name)[0]
        try:
            names.append(f"{folder.resolve().relative_to(out.resolve()).as_posix()}/{name}.pt")
        except ValueError:  # the run's own folder, or an ensemble's
            continue
    return names


def evaluate_run(run, args: argparse.Namespace) -> int:
    """Test metrics before/after temperature scaling, plots and calibration maps of ``run``."""
    import copy

    from cals_seg.data.checks import warn_large_images
    from cals_seg.evaluation.engine import calibrated_test, fit_post_temperature
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.distributed import is_main_process

    cfg, task, infer = run.config, run.task, run.inference
    split_set = {"train": task.train_set, "val": task.val_set, "test": task.test_set}[args.split]
    warn_large_images(split_set, args.split, bounded_input(cfg))
    if args.split == "train":  # the training images without augmentation (a copy, not the task's)
        split_set = copy.copy(split_set)
        split_set.transform = task.val_set.transform
    e, workers = cfg.eval, cfg.data.num_workers
    val_loader = make_loader(task.val_set, e.batch_size, False, workers)
    calibrators, fits, skipped = {}, {}, {}
    names = getattr(args, "calibrators", [])
    if names:
        from cals_seg.calibrators import calibrator_key
        from cals_seg.evaluation.engine import load_or_fit_calibrators
        from cals_seg.evaluation.inference import NonFiniteLogitsError
        from cals_seg.utils.distributed import is_distributed

        # the drift fits (named by their seed, reused by their key): where fits_home says
        cal_folder = fits_home(run, args)[0]
        if is_distributed() and {"lts", "selective"} & set(names):
            return report(ValueError("--calibrators lts / selective: fit them in one process "
                                     "(without torchrun); the others fit under torchrun too."))
        params = getattr(args, "calibrator_params", None) or {}
        for name in dict.fromkeys(names):  # one that cannot be fitted is reported, not fatal
            folder, why = fits_home(run, args, name)
            try:  # reused only when fitted for this network, classes, images, params, precision
                key = calibrator_key(run, name, params.get(name, {}), task.val_set.ids,
                                     precision=infer.amp, protocol=infer.protocol)
                found = None if args.refit_calibrators or folder == run.calibrators else \
                    run_fit(run, name, key)  # the run's own fit, read only, when it is this
                one, fit = found or load_or_fit_calibrators(
                    [name], folder, task.num_classes, infer, val_loader, task.ignore_index,
                    args.refit_calibrators, params, keys={name: key})
            except NonFiniteLogitsError as err:  # the network's fault, not the calibrator's
                return report(UserError(f"{run.path}: {err}"))
            except (*USER_ERRORS, ValueError) as err:
                skipped[name] = calibrator_skip(name, err)
                report(UserError(f"calibrator {name} skipped: {skipped[name]}"))
                continue
            if is_main_process() and not fit[name].get("loaded"):
                print(fit_notice(run, name, fit[name]["file"], why), flush=True)
            calibrators.update(one)
            fits.update(fit)
        if getattr(args, "calibrator_fit_shift", False) and calibrators:

            try:
                drifted = drift_calibrators(run, args, list(calibrators), cal_folder,
                                            e.batch_size, workers)
            except USER_ERRORS as err:
                return report(err)
            calibrators, fits = calibrators | drifted[0], fits | drifted[1]
    # Everything fitted on validation comes first (each pass after the first served from the
    # logit cache); then ONE pass over the split feeds the meters of every view, the conformal
    # sets and the entropy statistics of the shift flag.
    temperature = None
    if e.temperature_scaling:  # the ts calibrator fitted above is the same fit, to the bit
        ts_fit = fits.get("ts", {}).get("temperature")
        temperature = float(ts_fit) if ts_fit is not None and "ts" in calibrators else \
            fit_post_temperature(infer, val_loader, task.ignore_index)
    extra: list[Any] = []
    sets = clean_entropy = None
    if getattr(args, "conformal", None):
        from cals_seg.commands._conformal import conformal_sets

        try:
            out = Path(args.out) if args.out else run.eval_dir(args.split)
            num_maps = cfg.eval.num_maps if args.num_maps is None else args.num_maps
            # where fits_home says: the run's own (which predict_seg and export use) only for
            # an evaluation in place with its config; an ensemble's in its --out
            sets = conformal_sets(run, args.conformal, task.val_set, split_set, out / "maps",
                                  num_maps, fits_home(run, args)[0])
        except USER_ERRORS as err:
            return report(err)
        extra.append(sets)
    if getattr(args, "shift", None):
        from cals_seg.evaluation.ood import MeanEntropy

        clean_entropy = MeanEntropy(temperature or 1.0)  # the flag's clean rate, same pass
        extra.append(clean_entropy)
    result = calibrated_test(
        infer, task, val_loader, make_loader(split_set, e.batch_size, False, workers), e.n_bins,
        e.temperature_scaling, cfg.train.progress, calibrators=calibrators,
        temperature=temperature, extra=extra,
    )
    result.update(checkpoint=str(run.checkpoint), epoch=run.epoch, split=args.split,
                  precision=infer.amp, family=run.family, score_metric=run.score_metric)
    figures = Background()
    if is_main_process():  # the clean figures are drawn while the corrupted splits stream
        out = Path(args.out) if args.out else run.eval_dir(args.split)
        out.mkdir(parents=True, exist_ok=True)
        figures.start(draw_clean_figures, result, out, cfg.name, args.split)
    from cals_seg.evaluation.confidence_regime import KEY as REGIME_KEY

    regime = under_confidence(run, infer, val_loader)
    if regime is not None:  # a margin penalty cannot help this network: said in one line
        result[REGIME_KEY] = regime
    if fits:
        result["calibrator_fits"] = fits
    if run.extra.get("ensemble"):
        result["ensemble"] = run.extra["ensemble"]
    if getattr(args, "shift", None):

        try:
            result["shift"], result["entropy_flag"] = shift_results(
                run, args, split_set, result, calibrators, clean_entropy.all_values())
        except USER_ERRORS as err:
            return report(err)
    if sets is not None:
        result["conformal"] = sets.results()
    if names and skipped:
        result["calibrator_errors"] = skipped
    from cals_seg.evaluation.logit_cache import active_cache

    cache = active_cache()
    if cache is not None:  # images the network ran on, and those served from memory
        result["network_passes"] = dict(cache.stats)
    if not is_main_process():  # every rank computed the same numbers; rank 0 writes them
        return 0

    code = write_evaluation(run, args, result, split_set, figures)
    return code or (1 if skipped else 0)  # 1: some calibrators could not be fitted (named)


def fits_home(run, args: argparse.Namespace, name: str | None = None
              ) -> tuple[Path, str | None]:
    """Where this evaluation saves its fits (of calibrator ``name``, or of every kind):
    ``(folder, None)`` for the run's own, ``<run>/calibrators/`` (which predict_seg and export
    use), when the evaluation is the run's own: in place (no --out, or the default folder), of
    its best checkpoint, with its config (no --set, no protocol option, not the older CONFIG
    form) and the calibrator's default parameters, or with --save-calibrators-to-run;
    otherwise ``(OUT/calibrators, why)``: the fit lives with the evaluation (an ensemble's:
    its own folder), and the run's own fit is left as it is."""
    if getattr(args, "calibrator_folder", None):  # an ensemble: never a member's folder
        return Path(args.calibrator_folder), "an ensemble's fit"
    if getattr(args, "save_calibrators_to_run", False):
        return run.calibrators, None
    reasons = []
    if args.out and Path(args.out).resolve() != run.eval_dir(args.split).resolve():
        reasons.append("--out elsewhere")
    if Path(run.checkpoint).resolve() != run.best.resolve():
        reasons.append(f"checkpoint {Path(run.checkpoint).name}")
    if args.set or protocol_overrides(args) or Path(str(args.run)).is_file():
        reasons.append("the run's config overridden")
    given = (getattr(args, "calibrator_params", None) or {}).get(name) if name else None
    if given and not default_params(name, given):
        reasons.append("parameters other than the defaults")
    if not reasons:
        return run.calibrators, None
    return evaluation_fits(run, args), ", ".join(reasons)


def evaluation_fits(run, args: argparse.Namespace) -> Path:
    """The folder of the fits that live with this evaluation: ``OUT/calibrators`` (an
    ensemble's: its own folder there)."""
    if getattr(args, "calibrator_folder", None):
        return Path(args.calibrator_folder)
    return (Path(args.out) if args.out else run.eval_dir(args.split)) / "calibrators"


def default_params(name: str, params: dict) -> bool:
    """``params`` of calibrator ``name`` are its defaults (every value as the constructor's)."""
    from cals_seg.calibrators import resolved_params

    return resolved_params(name, 2, params) == resolved_params(name, 2, {})


def run_fit(run, name: str, key) -> tuple[dict, dict] | None:
    """The run's own saved fit of calibrator ``name``, read (never written), when it was made
    for this use (its record is ``key``'s); None otherwise."""
    from cals_seg.calibrators import load_calibrator

    path = run.fits.calibrator(name)
    cal, problem = run.fits.reuse(path, key, lambda p: load_calibrator(
        p, run.device, num_classes=run.task.num_classes))
    if problem is not None:
        if problem[0] == "file" and path.is_file():  # damaged: said; this evaluation fits its own
            print(f"notice: {path} {problem[1]}; not used (this evaluation fits its own)",
                  file=sys.stderr, flush=True)
        return None
    return {name: cal}, {name: {**cal.fit_info, "loaded": True, "file": str(path),
                                "fitted_for": key.record()}}


def fit_notice(run, name: str, file: str, why: str | None) -> str:
    """The line that says where a new fit of calibrator ``name`` went: the run's own fit (used
    by predict_seg and export), or this evaluation's (``why``), the run's own left as is."""
    if why is None:
        return (f"calibrator {name}: fitted on the validation split and saved as the run's own "
                f"fit, {file} (predict_seg --calibrator {name} and export use it)")
    return (f"calibrator {name}: fitted on the validation split for this evaluation ({why}), "
            f"saved to {file}; the run's own fit, {run.calibrator_file(name)}, which "
            "predict_seg and export use, is left as it is (--save-calibrators-to-run replaces "
            "it)")


def under_confidence(run, infer, val_loader) -> dict | None:
    """The network's validation temperature interval (one more pass over validation, served
    by the logit cache); the record of
    :func:`cals_seg.evaluation.confidence_regime.under_confidence` when it lies below 1 (the
    network is under-confident), printed as one line; else None."""
    from cals_seg.evaluation import confidence_regime
    from cals_seg.utils.distributed import is_main_process

    record = confidence_regime.measured_under_confidence(
        infer, val_loader, run.task.num_classes, run.task.ignore_index, str(run.path),
        run.family)
    if record is not None and is_main_process():
        print(record["advice"], flush=True)
    return record


def calibrator_skip(name: str, err: Exception) -> str:
    """Why calibrator ``name`` could not be fitted, on one line, with the option to change."""
    reason = " ".join(str(err).split())
    if "holdout_every" in reason:
        reason += f" (--calibrator-param {name}.holdout_every=N, or more validation images)"
    return reason


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


def write_evaluation(run, args: argparse.Namespace, result: dict, split_set,
                     figures: Background | None = None) -> int:
    """What rank 0 writes: metrics.json, the calibrator table, the multiplier curves and the
    calibration maps, and the clean figures (:func:`draw_clean_figures`: here, or joined from
    ``figures`` where they were started while the corrupted splits streamed); prints the
    summary line."""
    from cals_seg.evaluation.reports import calibration_maps
    from cals_seg.runs.run import Run
    from cals_seg.utils.io import write_json
    from cals_seg.visualization import plotting

    cfg, task = run.config, run.task
    folder = run
    out = Path(args.out) if args.out else folder.eval_dir(args.split)
    out.mkdir(parents=True, exist_ok=True)
    write_json(Run.eval_metrics(out), result)
    if figures is None:
        draw_clean_figures(result, out, cfg.name, args.split)
    write_calibrator_outputs(result, out, f"{cfg.name}, {args.split} split")
    if result.get("shift"):

        write_shift(result, out, f"{cfg.name}, {args.split} split")
    if result.get("conformal"):
        from cals_seg.commands._conformal import conformal_table

        table = conformal_table(result["conformal"])
        (out / "conformal.md").write_text(f"{cfg.name}, {args.split} split: conformal sets "
                                          "(docs/conformal.md).\n\n" + table)
        print(table)
    history = folder.history()
    plotting.plot_multiplier_curves(history, out / "lambda_curves.png", task.class_names)
    num_maps = cfg.eval.num_maps if args.num_maps is None else args.num_maps
    maps = calibration_maps(
        run.model,
        split_set,
        split_set.ids[:num_maps],
        out / "maps",
        run.device,
        task.class_names,
        task.ignore_index,
        protocol=task.protocol,
        amp=run.precision,
    )
    pre, post = result["pre_ts"], result["post_ts"]
    line = (f"{args.split}: ECE {100 * pre['ece']:.2f}%  AECE {100 * pre['aece']:.2f}%  "
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
