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
from cals_seg.errors import UserError
from cals_seg.evaluation.evaluator import (  # noqa: F401 (the commands' names)
    MODES,
    check_conformal,
    check_flat,
    flat_calibrators,
)
from cals_seg.utils.lock import RunLock
from cals_seg.utils.paths import OutputFolder


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
    from cals_seg.commands.eval_seg import plan_overrides
    from cals_seg.runs.run import load_run

    path, which, _ = checked_run_path(args)
    sets = [*(getattr(args, "set", []) or []),
            *(plan_overrides(args) if hasattr(args, "calibrators") else [])]
    return load_run(path, which, overrides=sets, family="classification", with_data=with_data,
                    device=getattr(args, "device", None), amp=getattr(args, "amp", None))


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
        check_flat(list(calibrator_params(args.calibrator_param)), "--calibrator-param")
        if args.conformal is not None:
            from cals_seg.evaluation.conformal_fit import parse_conformal

            check_conformal(parse_conformal(args.conformal))
        run = open_run(args)
        plan = plan_of(run, args)
        check_flat(plan.calibrators, "eval.calibrators")  # a plan the run's config holds
        if plan.conformal:
            check_conformal(plan.conformal)
        out = output_folder(run, args)
        lock = claim_outputs(run, plan, out, bool(args.out))
    except USER_ERRORS as err:
        return report(err)
    from cals_seg.evaluation.evaluator import Evaluator
    from cals_seg.utils.distributed import is_main_process

    try:
        result = Evaluator(run, plan).run()
        if not is_main_process():
            return 0
        write_evaluation(run, plan, result.metrics, out)
        if result.advice:  # under-confident, and no post-hoc calibrator fitted: the one line
            print(result.advice, flush=True)
        return 1 if result.skipped else 0
    finally:  # main called in a process that goes on (a test, a notebook): not held after
        if lock is not None:
            lock.release()


def output_folder(run: Any, args: argparse.Namespace) -> Path:
    """``--out``, else ``<run>/eval_<split>``."""
    return Path(args.out) if args.out else run.eval_dir(args.split)


def plan_of(run: Any, args: argparse.Namespace) -> Any:
    """The :class:`~cals_seg.evaluation.evaluator.EvalPlan`: the run's config (the flags
    written into it), the split, where the fits go (the rule of eval_seg), the logit cache."""
    from cals_seg.commands.eval_seg import fits_home
    from cals_seg.evaluation.evaluator import EvalPlan

    folder, why = fits_home(run, args)
    return EvalPlan.from_config(
        run.config, split=args.split, refit=args.refit_calibrators,
        fits=None if why is None else folder, fits_why=why, num_maps=0, maps_dir=None,
        cache_bytes=int(max(args.logit_cache_gb, 0.0) * 2**30), tool="predict_cls")


def planned_outputs(plan: Any) -> list[str]:
    """Every file eval_cls may write into its output folder, relative to it."""
    from cals_seg.runs.run import EVAL_METRICS_FILE

    keys = ["pre_ts", "post_ts", *plan.calibrators]
    return [EVAL_METRICS_FILE, "calibrators.md", "conformal.md",
            *[f"reliability_{k}.png" for k in keys]]


def claim_outputs(run: Any, plan: Any, out: Path, given: bool) -> RunLock | None:
    """Before any work: the run folder's lock when the evaluation writes into the run, and an
    output folder that neither overlaps the data nor holds a file eval_cls did not write;
    files an earlier evaluation wrote there and this one does not are removed."""
    from cals_seg.commands.eval_seg import planned_fits
    from cals_seg.utils.distributed import is_main_process

    if not is_main_process():
        return None
    lock = RunLock(run.folder, "eval").acquire() if not given or plan.calibrators else None
    outputs = OutputFolder(out, "eval_cls", inputs=[run.config.data.root])
    names = planned_outputs(plan) + planned_fits(run, plan, out)
    outputs.check_free(names, replace_unlisted=not given)
    outputs.claim(names, only=True)
    return lock


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


def write_evaluation(run: Any, plan: Any, result: dict[str, Any], out: Path) -> None:
    """metrics.json, the figures, the tables in ``out``; prints the summary."""
    from cals_seg.runs.run import Run
    from cals_seg.utils.io import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(Run.eval_metrics(out), result)
    title = f"{run.config.name}, {plan.split} split"
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
        from cals_seg.evaluation.conformal_eval import CLASSIFICATION_COLUMNS, conformal_table

        table = conformal_table(result["conformal"], CLASSIFICATION_COLUMNS)
        (out / "conformal.md").write_text(f"{title}: conformal sets (docs/conformal.md).\n\n"
                                          + table)
        print(table)
    pre, post = result["pre_ts"], result["post_ts"]
    line = (f"{plan.split}: acc {pre['acc']:.4f}  ECE {100 * pre['ece']:.2f}%  "
            f"AECE {100 * pre['aece']:.2f}%  NLL {pre['nll']:.4f}")
    if post is not None:
        line += f"  | post-TS ECE {100 * post['ece']:.2f}% (T = {result['temperature']:.3f})"
    print(line)
    print(f"wrote {Run.eval_metrics(out)}")


def cli() -> None:
    """Console entry point (joins the process group under torchrun)."""
    launch(main)


if __name__ == "__main__":
    cli()
