"""Coverage of the conformal sets of classification and text runs, per score, over seeds.

    python benchmarks/cls_coverage.py --out DIR [--setups synthetic_cls synthetic_text]
        [--seeds 0 1 2] [--epochs 10] [--alpha 0.1] [--scores lac aps raps]

For each setup and seed, one run of ``ce`` (tools/train_cls.py with ``train.seed=SEED`` and
``train.epochs=EPOCHS``, in DIR/runs; reused when it is there), then, for each score,
``tools/eval_cls.py RUN --conformal alpha=A score=S --out DIR/eval/...``: the toolkit's own
procedure (the threshold fitted on the held-out validation inputs, the coverage measured on the
test split). Prints one row per setup and score: the test coverage of each seed, their mean,
the standard error of that mean, whether the mean lies within 3 standard errors of ``1 -
alpha``, the mean set size, and the calibration and test inputs. Writes the table to
DIR/cls_coverage.md.

The standard error is that of the theory, per seed
``sqrt(l (n + 1 - l) / ((n + 1)^2 (n + 2)) + c (1 - c) / n_test)`` divided by ``sqrt(seeds)``:
the spread of the coverage of split conformal over the draw of ``n`` calibration inputs (a
Beta law, ``l = n + 1 - ceil((n + 1)(1 - alpha))``) plus the test sampling of ``n_test``
inputs at coverage ``c``; the spread of the seeds themselves (``sd``) is printed beside it.
Single-threaded, CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, metavar="DIR", help="runs, evaluations, table")
    parser.add_argument("--setups", nargs="+", default=["synthetic_cls", "synthetic_text"],
                        help="configs/<setup>.yaml (embedded data; default both)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10,
                        help="training epochs of each run (default 10)")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--scores", nargs="+", default=["lac", "aps", "raps"])
    return parser.parse_args(argv)


def coverage_se(n_cal: int, n_test: int, alpha: float, coverage: float) -> float:
    """The standard deviation of one run's test coverage (module docstring)."""
    m = n_cal + 1
    miss = m - math.ceil(m * (1 - alpha) - 1e-9)
    return math.sqrt(miss * (m - miss) / (m * m * (n_cal + 2))
                     + coverage * (1 - coverage) / n_test)


def train(setup: str, seed: int, epochs: int, out: Path) -> Path:
    """The run of ``setup``'s ``ce`` at ``seed`` (trained unless already finished)."""
    from cals_seg.commands import train_cls

    name = f"{setup}_ce_seed{seed}"
    run = out / "runs" / name
    if not (run / "test_metrics.json").is_file():
        code = train_cls.main([str(ROOT / "configs" / f"{setup}.yaml"), "--method", "ce",
                               "--set", f"name={name}", f"output_dir={out / 'runs'}",
                               f"data.root={out / 'data' / setup}", f"train.seed={seed}",
                               f"train.epochs={epochs}", "train.progress=false",
                               "train.threads=1", "train.amp=none", "train.device=cpu"])
        if code != 0:
            raise SystemExit(f"training {name} failed (exit {code})")
    return run


def evaluate(run: Path, score: str, alpha: float, out: Path) -> dict[str, Any]:
    """``metrics.json["conformal"]["risk"]`` of eval_cls with ``score`` (and the test count)."""
    from cals_seg.commands import eval_cls

    folder = out / "eval" / f"{run.name}_{score}"
    code = eval_cls.main([str(run), "--conformal", f"alpha={alpha:g}", f"score={score}",
                          "--out", str(folder)])
    if code != 0:
        raise SystemExit(f"eval_cls {run} score={score} failed (exit {code})")
    metrics = json.loads((folder / "metrics.json").read_text())
    return {**metrics["conformal"]["risk"], "n_test": metrics["pre_ts"]["count"]}


def cpu_model() -> str:
    """The CPU's name from ``lscpu`` (else the platform's)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def table(rows: list[dict[str, Any]], alpha: float) -> str:
    head = (f"| setup | score | coverage per seed | mean | SE | within 3 SE of {1 - alpha:g} | "
            "sd of seeds | set size | calibration inputs | test inputs |\n"
            "|---|---|---|---:|---:|---|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(f"| {r['setup']} | {r['score']} | "
                     f"{', '.join(f'{c:.3f}' for c in r['coverages'])} | {r['mean']:.3f} | "
                     f"{r['se']:.3f} | {'yes' if r['ok'] else 'NO'} | {r['sd']:.3f} | "
                     f"{r['size']:.2f} | {r['n_cal']} | {r['n_test']} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    start = time.perf_counter()
    rows = []
    for setup in args.setups:
        runs = [train(setup, seed, args.epochs, out) for seed in args.seeds]
        for score in args.scores:
            found = [evaluate(run, score, args.alpha, out) for run in runs]
            coverages = [f["coverage"] for f in found]
            mean = sum(coverages) / len(coverages)
            n_cal, n_test = found[0]["calibration_images"], found[0]["n_test"]
            se = coverage_se(n_cal, n_test, args.alpha, mean) / math.sqrt(len(found))
            sd = (math.sqrt(sum((c - mean) ** 2 for c in coverages) / (len(coverages) - 1))
                  if len(coverages) > 1 else 0.0)
            rows.append({"setup": setup, "score": score, "coverages": coverages, "mean": mean,
                         "se": se, "ok": abs(mean - (1 - args.alpha)) <= 3 * se, "sd": sd,
                         "size": sum(f["set_size"] for f in found) / len(found),
                         "n_cal": n_cal, "n_test": n_test})
    text = table(rows, args.alpha)
    minutes = (time.perf_counter() - start) / 60
    note = (f"alpha = {args.alpha:g}, seeds {args.seeds}, {args.epochs} epochs of ce per run; "
            f"{cpu_model()}, {time.strftime('%Y-%m-%d')}, {minutes:.1f} min\n")
    (out / "cls_coverage.md").write_text(note + "\n" + text)
    print(note)
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
