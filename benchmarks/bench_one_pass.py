"""One pass over the data: ``eval_seg RUN --calibrators ts boundary_ts --conformal alpha=0.2
mode=risk,band every=2 --shift fog:1`` with the logit cache (each distinct image through the
network once) against the same command with ``--logit-cache-gb 0`` (every consumer runs the
network, as before the cache), in one run, alternating, with the ratio.

    python benchmarks/bench_one_pass.py RUN [--repeats 3] [--threads 1]

RUN: a trained segmentation run of the embedded setup (e.g. ``tools/train_seg.py
configs/synthetic_deeplabv3_short.yaml --method ce --set train.epochs=2``). Prints the wall
time of each command (min / median over the repeats), the median ratio, and the network's
images forwarded and served from memory (``metrics.json["network_passes"]``). Name the CPU when
quoting it (printed on the first line).
"""

from __future__ import annotations

import argparse
import json
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


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def once(run: str, out: Path, cache_gb: float, threads: int) -> tuple[float, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(ROOT / "tools" / "eval_seg.py"), run, "--out", str(out),
           *OPTIONS, "--logit-cache-gb", str(cache_gb), "--set", f"train.threads={threads}",
           "train.progress=false"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"eval_seg failed:\n{done.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    return seconds, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(f"CPU: {cpu_name()}; torch threads {args.threads}; {args.repeats} repeats, alternating")
    times: dict[str, list[float]] = {"one pass": [], "cache off": []}
    passes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for name, gb in (("one pass", 2.0), ("cache off", 0.0)):
                seconds, metrics = once(args.run, Path(tmp) / f"{name}{r}".replace(" ", "_"),
                                        gb, args.threads)
                times[name].append(seconds)
                passes[name] = metrics.get("network_passes")
    for name, values in times.items():
        print(f"{name:>10}: wall min {min(values):.1f} s, median {statistics.median(values):.1f}"
              f" s; network images {passes[name]}")
    ratio = statistics.median(a / b for a, b in zip(times["one pass"], times["cache off"],
                                                     strict=True))
    print(f"ratio one pass / cache off (median of pairs): {ratio:.2f}")


if __name__ == "__main__":
    main()
