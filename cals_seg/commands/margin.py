"""Choose the margin m of CALS-ALM (and MbLS, CALS-HR) on your own data, before a long run.

    python tools/margin.py gaps RUN_DIR_OR_CHECKPOINT [--split val] [--margins 3 4 6 8 10]
        [--out gaps.json] [--set key=value ...]
    python tools/margin.py sweep CONFIG [--margins 4 6 8 10] [--epochs 20] [--max-miou-drop 1.0]
        [--method cals_alm] [--seed 0] [--jobs 2] [--out runs/margin_sweep] [--set key=value ...]

``gaps`` streams a trained run (``config.yaml`` + ``checkpoint_best.pt``, typically a short CE
run) over the validation split and reports the logit gaps ``d_ik = max_j l_ij - l_ik`` on valid
pixels: percentiles of the largest gap per pixel (``max - min``) and of all N x K gaps (the top
class's own zero gap included, as in the penalty's mean over K), from a fixed histogram (bin
width ``--bin-width``; memory independent of the number of pixels; a percentile is within half a
bin of the exact one). For each candidate margin m it prints the top-label confidence cap
``1 / (1 + (K - 1) e^-m)`` that ``d <= m`` implies, and the fraction of valid pixels whose largest
gap exceeds m (where the constraint binds), of all gaps above m, and of pixels whose confidence is
above the cap. A margin that almost no pixel exceeds leaves the penalty inert.

``sweep`` trains one short run per margin (``--set loss.params.margin=m``, run
``<name>_m<m>_seed<s>``) and one cross-entropy run (method ``ce``) as the reference, with
``tools/compare.py``'s ``run_one`` (finished runs with the same config are reused), and
recommends the margin with the lowest VALIDATION ECE among those whose validation mIoU (accuracy
for classification) is at most ``--max-miou-drop`` points below CE's. The validation numbers are
those of each run's best epoch (the last line of ``history.jsonl`` marked ``"best": true``); the
test split is shown, never used for the choice. Writes OUT/results.md and OUT/results.json.

The defaults (4 margins + CE, 20 epochs, 2 runs at a time, ``train.threads=1``) size
``python tools/margin.py sweep configs/synthetic_deeplabv3.yaml`` for the embedded data on 2 CPU
cores: 5 runs x 20 epochs of about 5-7 s (DeepLabV3 at one thread), two at a time, well under
15 minutes (twice as long when the cores are shared with other work).
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
from cals_seg.config.checks import check_config
from cals_seg.config.schema import load_config
from cals_seg.errors import UserError

PERCENTILES = (1.0, 5.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0)  # as cals_seg.runs.margin_choice


def _fmt_gap_table(stats: dict[str, Any]) -> str:
    qs = list(stats["largest_gap"]["percentiles"])
    head = f"{'logit gap d = max - l':<26}" + "".join(f"{'p' + q:>8}" for q in qs)
    head += f"{'mean':>8}{'max':>8}"
    lines = [head]
    for key, title in (("largest_gap", "largest per pixel"), ("all_gaps", "all N x K gaps")):
        s = stats[key]
        row = f"{title:<26}" + "".join(f"{s['percentiles'][q]:>8.2f}" for q in qs)
        lines.append(row + f"{s['mean']:>8.2f}{s['max']:>8.2f}")
    lines += [
        "",
        f"{'margin':>7} {'conf. cap':>10} {'pixels largest gap > m':>23} {'gaps > m':>9} "
        f"{'pixels conf > cap':>18}",
    ]
    for m in stats["margins"]:
        lines.append(
            f"{m['margin']:>7g} {m['confidence_cap']:>10.4f} {100 * m['pixels_binding']:>22.2f}% "
            f"{100 * m['gaps_binding']:>8.2f}% {100 * m['pixels_above_cap']:>17.2f}%"
        )
    return "\n".join(lines)


def gaps_main(args: argparse.Namespace) -> int:
    from cals_seg.runs.margin_choice import gap_statistics
    from cals_seg.runs.run import load_run
    from cals_seg.training.engine import make_loader
    from cals_seg.utils.io import write_json

    try:
        if any(m <= 0 for m in args.margins):
            raise UserError(f"margins must be > 0, got {args.margins}")
        run = load_run(args.run, overrides=args.set, with_data=True)
        cfg, task = run.config, run.task
        split_set = {"val": task.val_set, "test": task.test_set}[args.split]
        loader = make_loader(split_set, cfg.eval.batch_size, False, cfg.data.num_workers)
        batches = run.inference.predict(loader, cfg.train.progress)
        stats = gap_statistics(
            batches, task.num_classes, task.ignore_index, list(args.margins),
            tuple(args.percentiles), args.bin_width, args.hist_max,
        )
    except USER_ERRORS as err:
        return report(err)
    stats = {
        "run": str(run.path), "checkpoint": str(run.checkpoint), "epoch": run.epoch,
        "split": args.split, "loss": cfg.loss.name, **stats,
    }
    out = Path(args.out) if args.out else run.path / f"margin_gaps_{args.split}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, stats)
    print(
        f"{args.split} split of {run.path} ({run.checkpoint.name}, epoch {stats['epoch']}, "
        f"loss {cfg.loss.name}): {stats['pixels']} valid pixels, K = {task.num_classes}"
    )
    print(_fmt_gap_table(stats))
    for key in ("largest_gap", "all_gaps"):
        if stats[key]["overflow"]:
            print(f"note: percentiles {stats[key]['overflow']} of {key} are above --hist-max "
                  f"{args.hist_max:g} (shown as that value)")
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------------------------- sweep
def _sweep_table(rows: list[dict[str, Any]], name: str, choice: float | None) -> list[str]:
    lines = [
        f"| margin | val ECE | val {name} | test ECE | test {name} | T | best epoch |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        label = "CE (no penalty)" if r["margin"] is None else f"{r['margin']:g}"
        if r["margin"] is not None and r["margin"] == choice:
            label += " (recommended)"
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | | | |")
            continue
        t = r["temperature"]
        lines.append(
            f"| {label} | {100 * r['val_ece']:.2f} | {100 * r['val_score']:.2f} | "
            f"{100 * r['test_ece']:.2f} | {100 * r['test_score']:.2f} | "
            f"{'' if t is None else f'{t:.3f}'} | {r['best_epoch']} |"
        )
    return lines


def write_sweep(out: Path, rows: list[dict[str, Any]], config: Path, args: argparse.Namespace,
                sets: list[str], minutes: float) -> None:
    """The recommendation from the sweep's rows (the CE reference first), written to
    ``OUT/results.json`` and ``OUT/results.md`` and printed."""
    from cals_seg.runs.margin_choice import recommend
    from cals_seg.utils.io import write_json

    reference, candidates = rows[0], [r for r in rows[1:] if "error" not in r]
    if "error" in reference:
        choice, reason = None, "the CE reference run failed"
    elif not candidates:
        choice, reason = None, "every margin run failed"
    else:
        choice, reason = recommend(reference, candidates, args.max_miou_drop)
    name = reference.get("score_name", "mIoU")
    result = {
        "config": str(config), "method": args.method, "seed": args.seed, "epochs": args.epochs,
        "sets": sets, "max_miou_drop": args.max_miou_drop, "score_name": name, "rows": rows,
        "recommended_margin": None if choice is None else choice["margin"], "reason": reason,
        "minutes": minutes,
    }
    write_json(out / "results.json", result)
    table = _sweep_table(rows, name, None if choice is None else choice["margin"])
    verdict = (
        f"recommended margin: {choice['margin']:g} ({reason})" if choice
        else f"no recommendation: {reason}"
    )
    text = [
        f"# Margin sweep: {config} ({args.method}, seed {args.seed}, {args.epochs} epochs)", "",
        "Validation numbers from each run's best epoch; the choice uses the validation split "
        "only.", "", *table, "", verdict, "",
    ]
    (out / "results.md").write_text("\n".join(text))
    print("\n".join(table))
    print(verdict)
    print(f"wrote {out / 'results.md'} and results.json ({len(rows)} runs, {minutes:.1f} min)")


def sweep_main(args: argparse.Namespace) -> int:
    import inspect
    from concurrent.futures import ThreadPoolExecutor

    from cals_seg.losses import LOSSES
    from cals_seg.runs.margin_choice import run_summary
    from cals_seg.tasks import build_task
    from cals_seg.training.study import run_one

    start = time.perf_counter()
    config = Path(args.config)
    sets = ["train.threads=1", f"train.epochs={args.epochs}", *args.set]
    margins = list(dict.fromkeys(args.margins))
    try:
        if any(m <= 0 for m in margins):
            raise UserError(f"margins must be > 0, got {margins}")
        if args.max_miou_drop < 0:
            raise UserError(f"--max-miou-drop must be >= 0, got {args.max_miou_drop}")
        cfg = load_config(config, sets, args.method)
        ce_cfg = load_config(config, sets, "ce")
        check_config(cfg, reads_data=True, writes_run=True)
        check_config(ce_cfg, reads_data=True, writes_run=True)
        if ce_cfg.loss.name != "ce":
            raise UserError(f"the method 'ce' of {config} is not cross-entropy")
        loss_cls = LOSSES.get(cfg.loss.name)
        if loss_cls is None or "margin" not in inspect.signature(loss_cls).parameters:
            raise UserError(f"--method {args.method}: loss {cfg.loss.name!r} has no margin")
        build_task(cfg)  # generate an embedded dataset once, before runs start in parallel
    except USER_ERRORS as err:
        return report(err)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[float | None, str, list[str]]] = [(None, "ce", sets)]
    for m in margins:
        jobs.append(
            (m, args.method, [*sets, f"loss.params.margin={m:g}", f"name={cfg.name}_m{m:g}"])
        )

    def run(job):
        _, method, job_sets = job
        return run_one(config, method, args.seed, out, job_sets, args.checkpoints)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(run, jobs))
    rows = []
    for (m, _, _), (run_dir, error) in zip(jobs, results, strict=True):
        row: dict[str, Any] = {"margin": m}
        if error is None:
            try:
                row.update(run_summary(run_dir))
            except (OSError, ValueError, KeyError) as err:
                error = f"{run_dir}: {err}"
        if error is not None:
            print(f"FAILED margin {m}: {error}", file=sys.stderr)
            row.update(run=str(run_dir), error=error)
        rows.append(row)
    write_sweep(out, rows, config, args, sets, (time.perf_counter() - start) / 60)
    return 1 if any("error" in r for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gaps", help="logit-gap statistics of a trained run")
    g.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT")
    g.add_argument("--split", default="val", choices=["val", "test"])
    g.add_argument("--margins", type=float, nargs="+", default=[3.0, 4.0, 6.0, 8.0, 10.0])
    g.add_argument("--percentiles", type=float, nargs="+", default=list(PERCENTILES))
    g.add_argument("--bin-width", type=float, default=0.01, help="histogram bin (default 0.01)")
    g.add_argument("--hist-max", type=float, default=200.0, help="histogram range [0, max)")
    g.add_argument("--out", default=None, help="JSON file (default: RUN/margin_gaps_<split>.json)")
    add_set_argument(g)
    add_trust_argument(g)
    s = sub.add_parser("sweep", help="train one short run per margin and recommend one")
    s.add_argument("config", help="setup file with the methods ce and --method")
    s.add_argument("--margins", type=float, nargs="+", default=[4.0, 6.0, 8.0, 10.0])
    s.add_argument("--epochs", type=int, default=20)
    s.add_argument(
        "--max-miou-drop", type=float, default=1.0,
        help="largest validation mIoU (accuracy) loss vs CE, in points (default 1.0)",
    )
    s.add_argument("--method", default="cals_alm", help="margin-based method (default cals_alm)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--jobs", type=int, default=2, help="runs trained at the same time")
    s.add_argument("--out", default="runs/margin_sweep")
    s.add_argument(
        "--checkpoints", choices=["all", "best", "none"], default="best",
        help="checkpoints kept per finished run (best: for `gaps` on the CE run)",
    )
    add_set_argument(s)
    args = parser.parse_args(argv)
    if args.command == "gaps":
        for q in args.percentiles:
            if not 0 <= q <= 100:
                parser.error(f"percentiles must lie in [0, 100], got {q}")

        with consent_of(args):  # --trust-code: the run folder's factory may be imported
            return gaps_main(args)
    return sweep_main(args)


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
