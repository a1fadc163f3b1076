"""A calibrator fit's passes over validation served from memory after the first complete one
(``LogitCache.replay``, the default) against the same evaluation with every pass streamed again
(the validation loader read, decoded and hashed once per pass, as cals_seg did before), in one
process, alternating, with the ratio; the two variants' metrics are compared (to 1e-9,
timings and bookkeeping aside).

    python benchmarks/bench_fit_passes.py RUN [--tool eval_cls|eval_seg]
        [--calibrators vector dirichlet] [--repeats 3] [--threads 1]

RUN: a trained run (e.g. ``python tools/train_cls.py configs/synthetic_cls.yaml --method ce
--set train.epochs=1``). Prints the CPU, the wall time of ``TOOL RUN --calibrators ...
--refit-calibrators`` per variant (min / median), the median ratio, and the network's
images forwarded and served from memory.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = {"fit_seconds", "fitted_for", "network_passes", "file", "plan"}


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def numbers(tree, path=""):
    """``{path: float}`` of every number in ``tree`` outside :data:`VOLATILE`."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k not in VOLATILE:
                out.update(numbers(v, f"{path}/{k}"))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.update(numbers(v, f"{path}/{i}"))
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        out[path] = float(tree)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--tool", choices=["eval_cls", "eval_seg"], default="eval_cls")
    parser.add_argument("--calibrators", nargs="+", default=["vector", "dirichlet"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from cals_seg.evaluation.logit_cache import LogitCache

    torch.set_num_threads(args.threads)
    tool = importlib.import_module(f"cals_seg.commands.{args.tool}")
    replay = LogitCache.replay

    def streamed(self, loader, context, source):  # every pass read again (the old behaviour)
        return source()

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {args.threads} thread(s); "
          f"{args.tool} {args.run} --calibrators {' '.join(args.calibrators)}")
    times: dict[str, list[float]] = {"replayed": [], "streamed": []}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for variant in (("replayed", "streamed") if r % 2 == 0 else ("streamed", "replayed")):
                LogitCache.replay = replay if variant == "replayed" else streamed
                out = Path(tmp) / f"{variant}{r}"
                cmd = [args.run, "--out", str(out), "--calibrators", *args.calibrators,
                       "--refit-calibrators", "--set", "train.amp=none"]
                start = time.perf_counter()
                code = tool.main(cmd)
                times[variant].append(time.perf_counter() - start)
                if code not in (0, 1):
                    print(f"{variant}: exit code {code}", file=sys.stderr)
                    return 1
                results[variant] = json.loads((out / "metrics.json").read_text())
    LogitCache.replay = replay
    a, b = numbers(results["replayed"]), numbers(results["streamed"])
    differ = [k for k in a.keys() | b.keys() if k not in a or k not in b
              or not math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12)]
    for variant, ts in times.items():
        passes = results[variant].get("network_passes", {})
        print(f"{variant:>9}: min {min(ts):6.2f} s  median {statistics.median(ts):6.2f} s   "
              f"network passes {passes}")
    ratio = statistics.median(times["streamed"]) / statistics.median(times["replayed"])
    print(f"streamed / replayed (median): {ratio:.2f}x; metrics "
          + ("equal" if not differ else f"DIFFER at {sorted(differ)[:5]}"))
    return 0 if not differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
