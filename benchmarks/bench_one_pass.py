"""One pass over the data: ``eval_seg RUN --calibrators ts boundary_ts --conformal alpha=0.2
mode=risk,band every=2 --shift fog:1`` as it runs now (each split streamed once, each distinct
image through the network once) against the same command with ``--logit-cache-gb 0`` (every
consumer runs the network again) and, with ``--baseline-src DIR``, against the same command of
an earlier checkout of cals_seg (e.g. ``git worktree add /tmp/base afcd01c``: the code before
the evaluation engine), in one run, alternating, with the ratios. The precision is pinned to
float32 (``--set train.amp=none``) so that every variant computes the same numbers; the
metrics of the variants are compared (to 1e-9, timings and bookkeeping keys aside).

    python benchmarks/bench_one_pass.py RUN [--repeats 3] [--threads 1] [--baseline-src DIR]

RUN: a trained segmentation run (e.g. ``tools/train_seg.py
configs/synthetic_deeplabv3_short.yaml --method ce --set train.epochs=2``). Prints the wall
time of each command (min / median over the repeats), the median ratios, and the network's
images forwarded and served from memory (``metrics.json["network_passes"]``). Name the CPU when
quoting it (printed on the first line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--calibrators", "ts", "boundary_ts", "--conformal", "alpha=0.2", "mode=risk,band",
           "every=2", "--shift", "fog:1", "--num-maps", "0", "--refit-calibrators"]
# Keys that differ between the variants by design: timings, what a fit was for, bookkeeping,
# and keys an earlier checkout did not write yet (the regime line, the guarantee's record).
VOLATILE = {"fit_seconds", "fitted_for", "network_passes", "checkpoint", "guarantee", "file",
            "plan", "needs_images", "every", "groups_without_guarantee", "under_confident"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def once(run: str, out: Path, extra: list[str], threads: int,
         src: str | None = None) -> tuple[float, dict]:
    """Wall seconds of one ``eval_seg`` process and its metrics.json (``src``: the checkout
    whose ``tools/eval_seg.py`` and package run, else this one)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    root = Path(src).resolve() if src else ROOT
    if src:
        env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, str(root / "tools" / "eval_seg.py"), str(Path(run).resolve()),
           "--out", str(out), *OPTIONS, *extra, "--set", f"train.threads={threads}",
           "train.progress=false", "train.amp=none"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=root if src else None)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"eval_seg failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return seconds, metrics


def differences(a: object, b: object, path: str = "") -> list[str]:
    """Where two metrics dicts differ beyond 1e-9 (relative above 1), the keys of
    :data:`VOLATILE` aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b) - VOLATILE) if k not in VOLATILE
                for d in (differences(a[k], b[k], f"{path}.{k}") if k in a and k in b
                          else [f"{path}.{k}: in one only"])]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} and {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        same = a == b or (math.isnan(a) and math.isnan(b)) or \
            abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
        return [] if same else [f"{path}: {a} vs {b}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline-src", default=None,
                        help="a checkout of an earlier cals_seg whose eval_seg is timed too")
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; torch threads {args.threads}; {args.repeats} repeats, alternating")
    variants: dict[str, tuple[list[str], str | None]] = {
        "one pass": ([], None), "cache off": (["--logit-cache-gb", "0"], None)}
    if args.baseline_src:
        variants["baseline"] = ([], args.baseline_src)
    times: dict[str, list[float]] = {name: [] for name in variants}
    metrics: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, (extra, src) in variants.items():
                seconds, metrics[name] = once(args.run, Path(tmp) / f"{name}{r}".replace(" ", "_"),
                                              extra, args.threads, src)
                times[name].append(seconds)
    for name, values in times.items():
        print(f"{name:>10}: wall min {min(values):.1f} s, median {statistics.median(values):.1f}"
              f" s; network images {metrics[name].get('network_passes', 'not counted')}")
    for other in list(variants)[1:]:
        ratio = statistics.median(a / b for a, b in zip(times["one pass"], times[other],
                                                         strict=True))
        diff = differences(metrics["one pass"], metrics[other])
        print(f"ratio one pass / {other} (median of pairs): {ratio:.2f}; metrics "
              + ("equal to 1e-9" if not diff else f"differ: {diff[:5]}"))


if __name__ == "__main__":
    main()
