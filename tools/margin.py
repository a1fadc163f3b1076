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
import importlib.util
import inspect
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cals_seg.checks import check_config  # noqa: E402
from cals_seg.cli import add_set_argument, report  # noqa: E402
from cals_seg.config import load_config  # noqa: E402
from cals_seg.engine import make_loader  # noqa: E402
from cals_seg.errors import MissingPathError, UserError  # noqa: E402
from cals_seg.evaluation import predict  # noqa: E402
from cals_seg.losses import LOSSES  # noqa: E402
from cals_seg.precision import resolve_amp  # noqa: E402
from cals_seg.rundir import load_checkpoint, read_jsonl, write_json  # noqa: E402
from cals_seg.tasks import build_task  # noqa: E402
from cals_seg.trainer import resolve_device  # noqa: E402

PERCENTILES = (1.0, 5.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0)


def confidence_cap(margin: float, num_classes: int) -> float:
    """The largest top-label confidence with every logit gap ``<= margin``: all K - 1 other
    logits exactly ``margin`` below the top one."""
    return 1.0 / (1.0 + (num_classes - 1) * math.exp(-margin))


def _key(q: float) -> str:
    return f"{q:g}"


class GapHistogram:
    """Streaming histogram of non-negative values: bins of ``width`` on ``[0, hi)`` plus one
    overflow bin, with each bin's count, smallest and largest value, and the exact count and
    sum. O(hi / width) memory, whatever the number of values."""

    def __init__(self, width: float = 0.01, hi: float = 200.0) -> None:
        if not (width > 0 and hi > width):
            raise UserError(f"Expected 0 < bin width < histogram max, got {width} and {hi}.")
        self.width = float(width)
        self.nbins = math.ceil(hi / width)
        self.hi = self.nbins * self.width
        self.counts = torch.zeros(self.nbins + 1, dtype=torch.int64)
        self.bin_min = torch.full((self.nbins + 1,), math.inf, dtype=torch.float64)
        self.bin_max = torch.full((self.nbins + 1,), -math.inf, dtype=torch.float64)
        self.n, self.total = 0, 0.0

    min = property(lambda self: float(self.bin_min.min()))
    max = property(lambda self: float(self.bin_max.max()))

    def update(self, values: torch.Tensor) -> None:
        values = values.reshape(-1).double().cpu()
        if values.numel() == 0:
            return
        idx = torch.div(values, self.width).floor_().clamp_(0, self.nbins).long()
        self.counts += torch.bincount(idx, minlength=self.nbins + 1)
        self.bin_min.scatter_reduce_(0, idx, values, "amin")
        self.bin_max.scatter_reduce_(0, idx, values, "amax")
        self.n += values.numel()
        self.total += float(values.sum())

    def _order_statistic(self, i: int) -> tuple[float, bool]:
        """Estimate of the i-th smallest value (0-based): its bin's centre clipped to the
        smallest and largest value seen in that bin (exact when they are equal); True when it
        lies in the overflow bin (then only the bin's range bounds it)."""
        cum = torch.cumsum(self.counts, 0)
        b = int(torch.searchsorted(cum, torch.tensor([i]), right=True))
        lo, hi = float(self.bin_min[b]), float(self.bin_max[b])
        if b >= self.nbins:
            return lo, True
        return min(max((b + 0.5) * self.width, lo), hi), False

    def percentile(self, q: float) -> tuple[float, bool]:
        """The q-th percentile with numpy's default (linear) interpolation between order
        statistics, each estimated to within half a bin; True if it reaches the overflow bin."""
        if self.n == 0:
            return math.nan, False
        r = q / 100.0 * (self.n - 1)
        lo, hi = math.floor(r), math.ceil(r)
        (a, over_a), (b, over_b) = self._order_statistic(lo), self._order_statistic(hi)
        return a + (r - lo) * (b - a), over_a or over_b

    def summary(self, percentiles: tuple[float, ...]) -> dict[str, Any]:
        values = {_key(q): self.percentile(q) for q in percentiles}
        return {
            "count": self.n,
            "mean": self.total / self.n if self.n else math.nan,
            "min": self.min if self.n else math.nan,
            "max": self.max if self.n else math.nan,
            "percentiles": {k: v for k, (v, _) in values.items()},
            "overflow": [k for k, (_, over) in values.items() if over],
        }


@torch.no_grad()
def gap_statistics(
    batches, num_classes: int, ignore_index: int, margins: list[float],
    percentiles: tuple[float, ...] = PERCENTILES, bin_width: float = 0.01, hist_max: float = 200.0,
) -> dict[str, Any]:
    """Logit-gap statistics over the valid positions of ``(logits (N, K, *S), target (N, *S))``
    batches, streamed (the memory does not grow with the number of positions)."""
    largest_hist, all_hist = GapHistogram(bin_width, hist_max), GapHistogram(bin_width, hist_max)
    caps = [confidence_cap(m, num_classes) for m in margins]
    binding_pixels = [0] * len(margins)
    binding_gaps = [0] * len(margins)
    above_cap = [0] * len(margins)
    for logits, target in batches:
        n, k = logits.shape[:2]
        flat = logits.float().reshape(n, k, -1).transpose(1, 2).reshape(-1, k)
        flat = flat[target.reshape(-1) != ignore_index]
        gaps = flat.max(dim=1, keepdim=True).values - flat  # (P, K), >= 0
        largest = gaps.max(dim=1).values
        confidence = 1.0 / torch.exp(-gaps).sum(dim=1)
        largest_hist.update(largest)
        all_hist.update(gaps)
        for j, (m, cap) in enumerate(zip(margins, caps, strict=True)):
            binding_pixels[j] += int((largest > m).sum())
            binding_gaps[j] += int((gaps > m).sum())
            above_cap[j] += int((confidence > cap).sum())
    pixels = largest_hist.n
    if pixels == 0:
        raise UserError("the split has no valid pixel (every label is ignore_index)")
    return {
        "num_classes": num_classes,
        "pixels": pixels,
        "bin_width": bin_width,
        "largest_gap": largest_hist.summary(percentiles),
        "all_gaps": all_hist.summary(percentiles),
        "margins": [
            {
                "margin": m,
                "confidence_cap": cap,
                "pixels_binding": bp / pixels,
                "gaps_binding": bg / all_hist.n,
                "pixels_above_cap": ac / pixels,
            }
            for m, cap, bp, bg, ac in zip(
                margins, caps, binding_pixels, binding_gaps, above_cap, strict=True
            )
        ],
    }


def _run_files(path: Path) -> tuple[Path, Path]:
    """(config.yaml, checkpoint) of a run directory or of a checkpoint inside one."""
    if path.is_dir():
        checkpoint = path / "checkpoint_best.pt"
        if not checkpoint.is_file() and (path / "checkpoint_last.pt").is_file():
            checkpoint = path / "checkpoint_last.pt"
        config = path / "config.yaml"
    else:
        checkpoint, config = path, path.parent / "config.yaml"
    if not config.is_file():
        raise MissingPathError(f"{config} not found: give a run directory or a checkpoint in one")
    if not checkpoint.is_file():
        raise MissingPathError(f"{checkpoint} not found (was the run kept with checkpoints?)")
    return config, checkpoint


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
    try:
        config, checkpoint = _run_files(Path(args.run))
        cfg = load_config(config, args.set)
        check_config(cfg, reads_data=True, writes_run=False)
        task = build_task(cfg)
        ckpt = load_checkpoint(checkpoint)
        if ckpt.get("num_classes") != task.num_classes:
            raise UserError(
                f"{checkpoint} was trained with {ckpt.get('num_classes')} classes, but {config} "
                f"has {task.num_classes}"
            )
        task.model.load_state_dict(ckpt["model"])
        device = resolve_device(cfg.train.device)
        amp = resolve_amp(cfg.train.amp, device)
        if any(m <= 0 for m in args.margins):
            raise UserError(f"margins must be > 0, got {args.margins}")
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        split_set = {"val": task.val_set, "test": task.test_set}[args.split]
        loader = make_loader(split_set, cfg.eval.batch_size, False, cfg.data.num_workers)
        batches = predict(task.model.to(device), loader, device, amp, cfg.train.progress,
                          protocol=getattr(task, "protocol", None))
        stats = gap_statistics(
            batches, task.num_classes, task.ignore_index, list(args.margins),
            tuple(args.percentiles), args.bin_width, args.hist_max,
        )
    except UserError as err:
        return report(err)
    stats = {
        "run": str(config.parent), "checkpoint": str(checkpoint), "epoch": ckpt.get("epoch"),
        "split": args.split, "loss": cfg.loss.name, **stats,
    }
    out = Path(args.out) if args.out else config.parent / f"margin_gaps_{args.split}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, stats)
    print(
        f"{args.split} split of {config.parent} ({checkpoint.name}, epoch {stats['epoch']}, "
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
def _compare_module():
    spec = importlib.util.spec_from_file_location("_cals_compare", ROOT / "tools" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_epoch_line(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The line of the best epoch: the last one marked ``"best": true``."""
    best = [h for h in history if h.get("best")]
    if not best:
        raise UserError("the run's history.jsonl has no line marked best")
    return best[-1]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """Validation numbers of the best epoch and the test numbers of a finished run."""
    line = best_epoch_line(read_jsonl(run_dir / "history.jsonl"))
    test = json.loads((run_dir / "test_metrics.json").read_text())
    pre = test["pre_ts"]
    score_key = "miou" if "val_miou" in line else "acc"
    return {
        "run": str(run_dir),
        "best_epoch": line["epoch"],
        "score_name": "mIoU" if score_key == "miou" else "acc",
        "val_ece": line["val_ece"],
        "val_score": line[f"val_{score_key}"],
        "test_ece": pre["ece"],
        "test_score": pre[score_key],
        "temperature": test.get("temperature"),
    }


def recommend(
    reference: dict[str, Any], candidates: list[dict[str, Any]], max_drop: float
) -> tuple[dict[str, Any] | None, str]:
    """The candidate with the lowest validation ECE among those whose validation score is at
    most ``max_drop`` points (percent) below the reference's; ties go to the higher score, then
    the order given. Returns (choice or None, reason)."""
    name = reference["score_name"]
    floor = 100 * reference["val_score"] - max_drop
    eligible = [c for c in candidates if 100 * c["val_score"] >= floor - 1e-9]
    if not eligible:
        return None, (
            f"no margin keeps the validation {name} within {max_drop:g} points of CE's "
            f"({100 * reference['val_score']:.2f}); try larger margins or a larger --max-miou-drop"
        )
    best = min(eligible, key=lambda c: (c["val_ece"], -c["val_score"]))
    reason = (
        f"lowest validation ECE ({100 * best['val_ece']:.2f}%) among the margins whose validation "
        f"{name} is within {max_drop:g} points of CE's {100 * reference['val_score']:.2f} "
        f"(eligible: {', '.join(format(c['margin'], 'g') for c in eligible)}; "
        f"m = {best['margin']:g}: {100 * best['val_score']:.2f})"
    )
    if best["val_ece"] >= reference["val_ece"]:
        reason += f"; it does not beat CE's validation ECE ({100 * reference['val_ece']:.2f}%)"
    return best, reason


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


def sweep_main(args: argparse.Namespace) -> int:
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
        check_config(cfg)
        check_config(ce_cfg)
        if ce_cfg.loss.name != "ce":
            raise UserError(f"the method 'ce' of {config} is not cross-entropy")
        loss_cls = LOSSES.get(cfg.loss.name)
        if loss_cls is None or "margin" not in inspect.signature(loss_cls).parameters:
            raise UserError(f"--method {args.method}: loss {cfg.loss.name!r} has no margin")
        build_task(cfg)  # generate an embedded dataset once, before runs start in parallel
    except UserError as err:
        return report(err)
    compare = _compare_module()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[float | None, str, list[str]]] = [(None, "ce", sets)]
    for m in margins:
        jobs.append(
            (m, args.method, [*sets, f"loss.params.margin={m:g}", f"name={cfg.name}_m{m:g}"])
        )

    def run(job):
        _, method, job_sets = job
        return compare.run_one(config, method, args.seed, out, job_sets, args.checkpoints)

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
    reference, candidates = rows[0], [r for r in rows[1:] if "error" not in r]
    if "error" in reference:
        choice, reason = None, "the CE reference run failed"
    elif not candidates:
        choice, reason = None, "every margin run failed"
    else:
        choice, reason = recommend(reference, candidates, args.max_miou_drop)
    name = reference.get("score_name", "mIoU")
    minutes = (time.perf_counter() - start) / 60
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
    print(f"wrote {out / 'results.md'} and results.json ({len(jobs)} runs, {minutes:.1f} min)")
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
        return gaps_main(args)
    return sweep_main(args)


if __name__ == "__main__":
    sys.exit(main())
