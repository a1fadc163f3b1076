"""Evaluate a trained image or text classification run: metrics before/after calibration, the
post-hoc calibrators, prediction sets with a guarantee, reliability diagrams.

    python tools/eval_cls.py runs/<name> [--checkpoint best|last|FILE] [--split test]
        [--out DIR] [--calibrators ts vector dirichlet] [--refit-calibrators]
        [--calibrator-param dirichlet.lam=0.01 ...] [--save-calibrators-to-run]
        [--conformal alpha=0.1 [mode=risk|class] [score=lac|aps|raps] [calibrator=NAME]
                     [seed=S] [every=E]]
        [--device auto|cpu|cuda] [--amp auto|none|bf16|fp16] [--set key=value ...]

The classification counterpart of tools/eval_seg.py (docs/classification.md), on runs of
tools/train_cls.py; the same library does the work (an input is a 1 x 1 image to it). Writes
DIR/metrics.json (default DIR: <run>/eval_<split>): the test meters before ("pre_ts") and
after ("post_ts") temperature scaling, with T; DIR/reliability_{pre,post}_ts.png.

With --calibrators, each post-hoc calibrator named that applies to logits without space (ts,
vector, dirichlet, selective, cms_ap, cms_op: docs/calibrators.md; the spatial ones, e.g. lts,
boundary_ts, image_ts, are refused in one line) is loaded from <run>/calibrators/<name>.pt when
fitted for this use, or fitted on the validation split (--refit-calibrators refits); a new fit
is the run's own (which predict_cls and export use) under the rule of eval_seg: an evaluation
in place of the best checkpoint with the run's config and the default parameters, or
--save-calibrators-to-run; otherwise it lives in DIR/calibrators/. metrics.json["calibrators"]
[NAME] holds the same dictionary as "pre_ts", metrics.json["calibrator_fits"][NAME] the fit's
summary; DIR/calibrators.md is the table (ECE, AECE, classwise ECE, NLL, Brier, AURC,
accuracy), DIR/reliability_<name>.png each diagram. A calibrator that cannot be fitted is named
on stderr and in metrics.json["calibrator_errors"], and the exit status is 1.

With --conformal, prediction sets with a finite-sample guarantee (docs/conformal.md) are
fitted on the held-out validation inputs and measured on the split: mode risk (marginal
coverage >= 1 - alpha) or class (the same per class). metrics.json["conformal"][MODE] holds
alpha, threshold, calibration_images (and their ids), guarantee, needs_images and, on the
split, coverage, set_size, multi (more than one class), empty, and per class coverage_class,
set_size_class, count_class; the numbers of the first mode are also at metrics.json["conformal"]
itself. DIR/conformal.md is the table. A guarantee needs ceil(1 / alpha) - 1 calibration inputs
(9 at alpha = 0.1); below that every set holds every class, said on stderr. The fit on the
network's logits is saved where the calibrators' are: <run>/calibrators/ (which predict_cls
and export use) for an evaluation in place with the run's config, else DIR/calibrators/.

Writing into the run (the default DIR, or --calibrators) holds the run folder's lock; an
existing file of DIR is replaced only when eval_cls wrote it. A segmentation run is refused in
one line naming tools/eval_seg.py.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cals_seg.commands._cli import (
    USER_ERRORS,
    add_set_argument,
    add_trust_argument,
    launch,
    report,
    run_folder_command,
)
from cals_seg.commands.eval_seg import calibrator_name
from cals_seg.config.rules import check_folder
from cals_seg.errors import MissingPathError, UserError
from cals_seg.utils.lock import RunLock
from cals_seg.utils.paths import OutputFolder

# The conformal modes of classification: marginal coverage, and per class (Mondrian). The
# image:TAU mode is risk for one label per input; band needs space.
MODES = ("risk", "class")
# Keys of the set meter that describe space (boundary bands, object sizes, pixels): left out.
SPATIAL_KEYS = ("pixels", "band_edges", "size_edges", "coverage_image_below_tau", "tau",
                *[f"{stat}_{region}" for stat in ("count", "coverage", "set_size", "multi")
                  for region in ("band", "size")])
# The numbers of the first mode repeated at metrics.json["conformal"] itself.
SUMMARY_KEYS = ("mode", "alpha", "score", "threshold", "calibration_images", "guarantee",
                "needs_images", "coverage", "set_size", "coverage_class", "empty", "multi")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", metavar="RUN_DIR", help="a run folder of tools/train_cls.py (or "
                        "a checkpoint inside one)")
    parser.add_argument("--checkpoint", default="best",
                        help="best (default), last, or a checkpoint file")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--out", default=None, help="output folder (default: <run>/eval_<split>)")
    parser.add_argument("--calibrators", nargs="+", default=[], type=calibrator_name,
                        metavar="NAME", help="post-hoc calibrators to fit (on validation) and "
                        "evaluate, among those without space: e.g. ts vector dirichlet")
    parser.add_argument("--refit-calibrators", action="store_true",
                        help="refit the calibrators already saved in <run>/calibrators/")
    parser.add_argument("--save-calibrators-to-run", action="store_true",
                        help="save the fits into <run>/calibrators/ (which predict_cls and "
                        "export use) even when --out is elsewhere, the parameters are not the "
                        "defaults or the run's config is overridden")
    parser.add_argument("--calibrator-param", nargs="+", action="extend", default=[],
                        metavar="NAME.KEY=VALUE", help="a calibrator's parameter, e.g. "
                        "dirichlet.lam=0.01 (YAML values)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="KEY=VALUE",
                        help="prediction sets with a guarantee: alpha=0.1 [mode=risk|class] "
                        "[score=lac|aps|raps] [calibrator=NAME] [seed=S] [every=E]")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1 (default: the "
                        "run's train.device)")
    parser.add_argument("--amp", default=None, choices=["auto", "none", "bf16", "fp16"],
                        help="precision of the forward pass (default: the run's train.amp, "
                        "where auto is float32 on a CPU)")
    add_set_argument(parser)
    add_trust_argument(parser)
    parser.add_argument("--logit-cache-gb", type=float, default=2.0, metavar="GB",
                        help="logits kept in memory so that each input goes through the "
                        "network once (default 2; 0: run it for every consumer)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- checks
def flat_calibrators(num_classes: int = 3) -> list[str]:
    """The registered calibrators that apply to logits without space, ``(N, K)``, in registry
    order: those that need no image and whose new (identity) instance maps a ``(2, K)`` batch
    to a batch of its shape (the spatial ones, boundary bands or a temperature map, refuse it).
    A calibrator registered later is probed the same way."""
    import torch

    from cals_seg.calibrators import CALIBRATORS, build_calibrator

    logits = torch.randn(2, num_classes, generator=torch.Generator().manual_seed(0))
    names = []
    for name, cls in CALIBRATORS.items():
        if cls.needs_image:
            continue
        try:
            with torch.no_grad():
                out = build_calibrator(name, num_classes).eval()(logits, None)
        except (ValueError, RuntimeError, TypeError, IndexError, UserError):
            continue
        if tuple(out.shape) == tuple(logits.shape):
            names.append(name)
    return names


def check_flat(names: Sequence[str], flag: str) -> None:
    """Refuse, in one line listing the valid ones, a calibrator of ``names`` that needs space
    (a classification input has none).

    Raises:
        UserError: ``--calibrators lts: needs ...; for classification runs use one of [...]``.
    """
    valid = flat_calibrators()
    for name in names:
        if name is not None and name not in valid:
            raise UserError(f"{flag} {name}: a spatial calibrator (it needs an image's pixels); "
                            f"for classification and text runs use one of {valid}.")


def check_conformal(spec: dict[str, Any]) -> None:
    """Refuse the conformal modes that need space, and a spatial calibrator before the sets.

    Raises:
        UserError: one line naming the mode and the valid ones.
    """
    for mode in spec["mode"]:
        if mode not in MODES:
            raise UserError(f"--conformal mode={mode}: for classification and text runs the "
                            f"modes are {list(MODES)} (risk: marginal coverage, class: per "
                            "class; one label per input leaves nothing for image:TAU or band).")
    check_flat([spec.get("calibrator")], "--conformal calibrator=")


def checked_run_path(args: argparse.Namespace, tool: str = "eval_cls") -> tuple[str, str, Any]:
    """``(path, checkpoint, config)``: what :func:`~cals_seg.runs.run.load_run` is given for
    ``RUN_DIR [--checkpoint best|last|FILE]``, and the run's config (with ``--set``), after
    refusing a segmentation run in one line naming the segmentation counterpart of ``tool``
    (the config read, nothing else)."""
    from cals_seg.runs.run import Run, resolve_run
    from cals_seg.tasks import task_family

    given = Path(args.run)
    if given.is_file() and given.suffix in (".yaml", ".yml"):
        raise UserError(f"{given} is a config: give the run folder of tools/train_cls.py (or a "
                        "checkpoint inside one).")
    checkpoint = getattr(args, "checkpoint", "best")
    path, which = (args.run, checkpoint) if checkpoint in ("best", "last") else \
        (checkpoint, "best")
    folder, _ = resolve_run(path, which)
    cfg = Run(folder).read_config(getattr(args, "set", []) or [])
    family = task_family(cfg)
    if family != "classification":
        right = tool.replace("_cls", "_seg")
        raise UserError(f"{folder} is a {family} run ({cfg.data.name!r}): use "
                        f"tools/{right}.py {folder} (tools/{tool}.py takes classification and "
                        "text runs).")
    return path, which, cfg


def open_run(args: argparse.Namespace, with_data: bool = True) -> Any:
    """The classification run of ``args`` (its task built when ``with_data``)."""
    from cals_seg.runs.run import load_run

    path, which, _ = checked_run_path(args)
    return load_run(path, which, overrides=getattr(args, "set", []) or [],
                    family="classification", with_data=with_data,
                    device=getattr(args, "device", None), amp=getattr(args, "amp", None))


# ----------------------------------------------------------------------------- sample ids
def sample_ids(dataset: Any, root: str | Path | None = None) -> list[str]:
    """An id per sample, in order, that names what the sample is: an image's path (relative to
    ``root``, the data root, when inside it), a text's digest (of its token ids: the same text
    and vocabulary give the same id), else its position. A fit records the digest of the ids it
    saw (:mod:`cals_seg.utils.fits`)."""
    import torch

    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple | list):
        base = Path(root).resolve() if root is not None else None
        out = []
        for path, _ in samples:
            p = Path(path)
            try:
                out.append(p.resolve().relative_to(base).as_posix() if base else p.as_posix())
            except ValueError:
                out.append(p.as_posix())
        return out
    rows = getattr(dataset, "ids", None)
    if isinstance(rows, torch.Tensor) and rows.dim() == 2 and len(rows) == len(dataset):
        return [hashlib.blake2b(r.contiguous().numpy().tobytes(), digest_size=12).hexdigest()
                for r in rows.cpu()]
    if isinstance(rows, list | tuple) and len(rows) == len(dataset):
        return [str(i) for i in rows]
    return [str(i) for i in range(len(dataset))]


class SampleIds:
    """A dataset with :func:`sample_ids` as its ``ids`` (what the fits record of the samples
    they saw); items, length and every other attribute are the dataset's."""

    def __init__(self, dataset: Any, ids: Sequence[str]) -> None:
        self.dataset, self.ids = dataset, list(ids)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "ids") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_ids(dataset: Any, root: str | Path | None) -> SampleIds:
    """``dataset`` with its :func:`sample_ids`."""
    return SampleIds(dataset, sample_ids(dataset, root))


# ----------------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_folder_command(args, _main)


def _main(args: argparse.Namespace) -> int:
    from cals_seg.commands.eval_seg import calibrator_params

    try:
        if args.out:
            check_folder("--out", args.out, must_exist=False, writable=True)
        from cals_seg.calibrators import CALIBRATORS
        from cals_seg.commands._cli import enable_set_contrib, registered_or_refused

        enable_set_contrib(args.set)
        registered_or_refused(CALIBRATORS, args.calibrators, "--calibrators")
        check_flat(args.calibrators, "--calibrators")
        args.calibrator_params = calibrator_params(args.calibrator_param)  # before any pass
        check_flat(list(args.calibrator_params), "--calibrator-param")
        if args.conformal is not None:
            from cals_seg.commands._conformal import parse_conformal

            args.conformal = parse_conformal(args.conformal)
            check_conformal(args.conformal)
        run = open_run(args)
        claim_outputs(run, args)
    except USER_ERRORS as err:
        return report(err)
    from cals_seg.evaluation.logit_cache import logit_cache

    with logit_cache(int(max(args.logit_cache_gb, 0.0) * 2**30)):
        return evaluate_run(run, args)


def output_folder(run: Any, args: argparse.Namespace) -> Path:
    """``--out``, else ``<run>/eval_<split>``."""
    return Path(args.out) if args.out else run.eval_dir(args.split)


def planned_outputs(args: argparse.Namespace) -> list[str]:
    """Every file eval_cls may write into its output folder, relative to it."""
    from cals_seg.runs.run import EVAL_METRICS_FILE

    keys = ["pre_ts", "post_ts", *args.calibrators]
    return [EVAL_METRICS_FILE, "calibrators.md", "conformal.md",
            *[f"reliability_{k}.png" for k in keys]]


def claim_outputs(run: Any, args: argparse.Namespace) -> None:
    """Before any work: the run folder's lock when the evaluation writes into the run, and an
    output folder that neither overlaps the data nor holds a file eval_cls did not write."""
    from cals_seg.commands.eval_seg import planned_fits

    if not args.out or args.calibrators:
        args.run_lock = RunLock(run.folder, "eval").acquire()  # held until the process ends
    out = output_folder(run, args)
    outputs = OutputFolder(out, "eval_cls", inputs=[run.config.data.root])
    names = planned_outputs(args) + planned_fits(run, args, out)
    outputs.check_free(names, replace_unlisted=not args.out)
    outputs.claim(names)


def split_of(task: Any, split: str) -> Any:
    """The samples of ``split`` as evaluated (the training split without augmentation)."""
    dataset = {"train": task.train_set, "val": task.val_set, "test": task.test_set}[split]
    if split == "train" and hasattr(dataset, "transform"):
        dataset = copy.copy(dataset)
        dataset.transform = task.val_set.transform
    return dataset


def fit_calibrators(run: Any, args: argparse.Namespace, val_set: SampleIds,
                    val_loader: Any) -> tuple[dict, dict, dict]:
    """The calibrators of ``--calibrators``, each the run's own saved fit when it is for this
    use, else fitted on validation and saved where :func:`~cals_seg.commands.eval_seg.
    fits_home` says (the rule of eval_seg). Returns ``(calibrators, fit summaries, {name: why
    it could not be fitted})``."""
    from cals_seg.calibrators import calibrator_key
    from cals_seg.commands.eval_seg import calibrator_skip, fit_notice, fits_home, run_fit
    from cals_seg.evaluation.engine import load_or_fit_calibrators
    from cals_seg.evaluation.inference import NonFiniteLogitsError
    from cals_seg.utils.distributed import is_main_process

    task, infer = run.task, run.inference
    params = getattr(args, "calibrator_params", None) or {}
    calibrators, fits, skipped = {}, {}, {}
    for name in dict.fromkeys(args.calibrators):
        folder, why = fits_home(run, args, name)
        try:  # reused only when fitted for this network, classes, inputs, params, precision
            key = calibrator_key(run, name, params.get(name, {}), val_set.ids,
                                 precision=infer.amp, protocol=infer.protocol)
            found = None if args.refit_calibrators or folder == run.calibrators else \
                run_fit(run, name, key)  # the run's own fit, read only, when it is this use's
            one, fit = found or load_or_fit_calibrators(
                [name], folder, task.num_classes, infer, val_loader, task.ignore_index,
                args.refit_calibrators, params, keys={name: key})
        except NonFiniteLogitsError:
            raise  # the network's fault: one line naming the run (run_folder_command)
        except (*USER_ERRORS, ValueError) as err:
            skipped[name] = calibrator_skip(name, err)
            report(UserError(f"calibrator {name} skipped: {skipped[name]}"))
            continue
        if is_main_process() and not fit[name].get("loaded"):
            print(fit_notice(run, name, fit[name]["file"], why).replace("predict_seg",
                                                                         "predict_cls"),
                  flush=True)
        calibrators.update(one)
        fits.update(fit)
    return calibrators, fits, skipped


def evaluate_run(run: Any, args: argparse.Namespace) -> int:
    """Test metrics before/after temperature scaling, the calibrators, the conformal sets and
    the reliability diagrams of ``run`` on ``args.split``."""
    from cals_seg.commands.eval_seg import under_confidence
    from cals_seg.evaluation.engine import calibrated_test, fit_post_temperature
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.distributed import is_main_process

    cfg, task, infer = run.config, run.task, run.inference
    root = cfg.data.root
    val_set = with_ids(task.val_set, root)
    split_set = val_set if args.split == "val" else with_ids(split_of(task, args.split), root)
    e, workers = cfg.eval, cfg.data.num_workers
    val_loader = make_loader(val_set, e.batch_size, False, workers)
    calibrators, fits, skipped = fit_calibrators(run, args, val_set, val_loader)
    temperature = None
    if e.temperature_scaling:  # the ts calibrator fitted above is the same fit, to the bit
        ts_fit = fits.get("ts", {}).get("temperature")
        temperature = float(ts_fit) if ts_fit is not None and "ts" in calibrators else \
            fit_post_temperature(infer, val_loader, task.ignore_index)
    extra: list[Any] = []
    sets = None
    if args.conformal:
        from cals_seg.commands._conformal import conformal_sets
        from cals_seg.commands.eval_seg import fits_home

        try:  # saved where fits_home says: the run's own only for an evaluation in place
            sets = conformal_sets(run, args.conformal, val_set, split_set, None, 0,
                                  fits_home(run, args)[0])
        except USER_ERRORS as err:
            return report(err)
        extra.append(sets)
    result = calibrated_test(
        infer, task, val_loader, make_loader(split_set, e.batch_size, False, workers), e.n_bins,
        e.temperature_scaling, cfg.train.progress, calibrators=calibrators,
        temperature=temperature, extra=extra)
    result.update(checkpoint=str(run.checkpoint), epoch=run.epoch, split=args.split,
                  precision=infer.amp, family=run.family, score_metric=run.score_metric,
                  class_names=list(run.class_names))
    from cals_seg.evaluation.confidence_regime import KEY as REGIME_KEY

    regime = under_confidence(run, infer, val_loader)
    if regime is not None:
        result[REGIME_KEY] = regime
    if fits:
        result["calibrator_fits"] = fits
    if sets is not None:
        result["conformal"] = conformal_results(sets.results())
    if skipped:
        result["calibrator_errors"] = skipped
    from cals_seg.evaluation.logit_cache import active_cache

    cache = active_cache()
    if cache is not None:
        result["network_passes"] = dict(cache.stats)
    if not is_main_process():
        return 0
    write_evaluation(run, args, result)
    return 1 if skipped else 0


def conformal_results(results: dict[str, Any]) -> dict[str, Any]:
    """``{MODE: numbers}`` of the set meter without its spatial keys (bands, sizes, pixels),
    and the first mode's :data:`SUMMARY_KEYS` at the top level."""
    out: dict[str, Any] = {}
    for mode, r in results.items():
        out[mode] = {k: v for k, v in r.items() if k not in SPATIAL_KEYS}
    first = next(iter(out.values()), {})
    for key in SUMMARY_KEYS:
        if key in first:
            out.setdefault(key, first[key])
    return out


# ----------------------------------------------------------------------------- outputs
# (metric key, column title, shown in percent) of the calibrator table.
TABLE_COLUMNS = (("ece", "ECE", True), ("aece", "AECE", True), ("cwce", "classwise ECE", True),
                 ("nll", "NLL", False), ("brier", "Brier", False), ("aurc", "AURC", True),
                 ("acc", "accuracy", True))


def calibration_table(rows: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per ``{name: metrics}`` (values in % except NLL, Brier)."""
    lines = ["| calibration | " + " | ".join(t for _, t, _ in TABLE_COLUMNS) + " |",
             "|---|" + "---:|" * len(TABLE_COLUMNS)]
    for name, metrics in rows.items():
        cells = ["-" if metrics.get(k) is None else f"{metrics[k] * (100 if pct else 1):.2f}"
                 for k, _, pct in TABLE_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def conformal_table(results: dict[str, Any]) -> str:
    """A markdown table of the sets: per mode, score, alpha, threshold, calibration inputs,
    guarantee, coverage, set size, more than one class, empty, the lowest class coverage; the
    warning of each mode without a guarantee under it."""
    head = ("| mode | score | alpha | threshold | calibration inputs | guarantee | coverage | "
            "set size | more than one class | empty | lowest class coverage |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows, notes = [], []
    for mode in MODES:
        r = results.get(mode)
        if not isinstance(r, dict):
            continue
        thr = r["threshold"]
        thr = f"{thr:.4f}" if isinstance(thr, float) else ", ".join(f"{t:.3f}" for t in thr)
        classes = [c for c in r.get("coverage_class") or [] if c is not None]
        ok = r.get("guarantee", True)
        cell = "yes" if ok else f"NO: needs {r.get('needs_images')}"
        rows.append(f"| {mode} | {r['score']} | {r['alpha']:g} | {thr} | "
                    f"{r['calibration_images']} | {cell} | {_fmt(r['coverage'])} | "
                    f"{_fmt(r['set_size'])} | {_fmt(r['multi'])} | {_fmt(r['empty'])} | "
                    f"{_fmt(min(classes) if classes else None)} |")
        if not ok and r.get("warning"):
            notes.append(f"- {mode}: {r['warning']}.")
    text = head + "\n".join(rows) + "\n"
    if notes:
        text += "\nWarning, empty guarantees:\n" + "\n".join(notes) + "\n"
    return text


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def draw_figures(result: dict[str, Any], out: Path, title: str) -> None:
    """The reliability diagrams: pre-TS, post-TS and each calibrator's."""
    from cals_seg.visualization import plotting

    for key in ("pre_ts", "post_ts"):
        if result.get(key):
            name = f"{title}, {key.replace('_', '-')}"
            if key == "post_ts":
                name += f" (T = {result['temperature']:.2f})"
            plotting.plot_reliability_diagram(result[key]["reliability"],
                                              out / f"reliability_{key}.png", title=name,
                                              ece=result[key]["ece"])
    for cal, metrics in (result.get("calibrators") or {}).items():
        plotting.plot_reliability_diagram(metrics["reliability"], out / f"reliability_{cal}.png",
                                          title=f"{title}, {cal}", ece=metrics["ece"])


def write_evaluation(run: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """metrics.json, the figures, the tables; prints the summary."""
    from cals_seg.runs.run import Run
    from cals_seg.utils.io import write_json

    out = output_folder(run, args)
    out.mkdir(parents=True, exist_ok=True)
    write_json(Run.eval_metrics(out), result)
    title = f"{run.config.name}, {args.split} split"
    draw_figures(result, out, title)
    if result.get("calibrators"):
        rows = {"uncalibrated": result["pre_ts"]}
        if result.get("post_ts"):
            rows["ts (the run's T)"] = result["post_ts"]
        rows.update(result["calibrators"])
        table = calibration_table(rows)
        (out / "calibrators.md").write_text(f"{title}; calibrators fitted on the validation "
                                            "split. Values in % except NLL and Brier.\n\n"
                                            + table)
        print(table)
    if result.get("conformal"):
        table = conformal_table(result["conformal"])
        (out / "conformal.md").write_text(f"{title}: conformal sets (docs/conformal.md).\n\n"
                                          + table)
        print(table)
    pre, post = result["pre_ts"], result["post_ts"]
    line = (f"{args.split}: acc {pre['acc']:.4f}  ECE {100 * pre['ece']:.2f}%  "
            f"AECE {100 * pre['aece']:.2f}%  NLL {pre['nll']:.4f}")
    if post is not None:
        line += f"  | post-TS ECE {100 * post['ece']:.2f}% (T = {result['temperature']:.3f})"
    print(line)
    print(f"wrote {Run.eval_metrics(out)}")


# ----------------------------------------------------------------------------- saved sets
def load_or_fit_conformal(run: Any, spec: dict[str, Any]) -> Any:
    """For predict_cls / export: the saved conformal fit of ``spec`` (one mode, on the
    network's logits) when its key is this use's, else fitted now on the run's held-out
    validation inputs (the run's data read) and saved; an empty guarantee is said on stderr.

    Raises:
        UserError / MissingPathError: one line naming the file and the fix.
    """
    from cals_seg.commands._conformal import fit_conformal, spec_text
    from cals_seg.evaluation.conformal_fit import (
        conformal_file,
        fits_folder,
        load_conformal,
        saved_fit_mismatch,
    )

    if spec["calibrator"] or len(spec["mode"]) != 1:
        raise UserError("--conformal: one mode, on the network's logits (no calibrator=); e.g. "
                        "--conformal 0.1 or --conformal alpha=0.1 mode=class.")
    check_conformal(spec)
    mode, k = spec["mode"][0], len(run.class_names)
    path = conformal_file(fits_folder(run), mode, spec["score"], spec["alpha"], spec["seed"])
    refit = f"tools/eval_cls.py {run.path} --conformal {spec_text(spec)}"
    val = with_ids(run.task.val_set, run.config.data.root) if run.task is not None else None
    cs, reason = None, None
    if path.is_file():
        try:
            cs = load_conformal(path, k, f"refit it with {refit}")
        except UserError as err:  # damaged: fitted again from the validation inputs
            reason = str(err).removeprefix(f"{path}: ").split("; ")[0]
        else:
            reason = saved_fit_mismatch(run, spec, mode, cs, val)
        if reason is not None:
            cs = None
    if cs is None:
        data_run = run
        if run.task is None:
            from cals_seg.runs.run import load_run

            try:  # the run's data (an embedded synthetic set is generated on first use)
                data_run = load_run(run.checkpoint, with_data=True, device=str(run.device),
                                    amp=run.precision, family="classification")
            except (UserError, FileNotFoundError) as err:
                why = str(err).splitlines()[0]
                raise MissingPathError(f"{path}: {reason or 'does not exist'}, and the "
                                       f"validation data cannot be read to fit it ({why}); fit "
                                       f"it with {refit}.") from None
            val = with_ids(data_run.task.val_set, data_run.config.data.root)
        if reason is not None:
            print(f"conformal: {path.name}: {reason}; refitting it on the validation inputs.",
                  flush=True)
        fit_conformal(data_run, spec, val)
        cs = load_conformal(path, k, f"refit it with {refit}")
    status = cs.guarantee()
    if not status["guarantee"]:
        print(f"warning: {path}: {status['warning']}", file=sys.stderr, flush=True)
    return cs


def cli() -> None:
    """Console entry point (joins the process group under torchrun)."""
    launch(main)


if __name__ == "__main__":
    cli()
