"""Markdown pieces for benchmarks/gpu_check.sh (standard library only).

    python benchmarks/gpu_check_report.py run RUN_DIR LABEL EPOCHS STATUS WALL_S
        one row of the training-run table: epochs finished, every lambda finite, pre_ts.ece
        finite, seconds per epoch, verdict
    python benchmarks/gpu_check_report.py targets LOG [LOG ...]
        the table of the ``TARGET | what | measured | limit | verdict`` lines in the logs
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RUN_HEADER = (
    "| run | stage status | epochs finished | every lambda finite | pre_ts.ece | "
    "s / epoch (each) | wall (s) | verdict |\n|---|---|---:|---|---:|---|---:|---|"
)
TARGET_HEADER = "| stage | target | measured | limit | verdict |\n|---|---|---:|---|---|"


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def run_row(run_dir: str, label: str, epochs: int, status: str, wall: str) -> str:
    run = Path(run_dir)
    history: list[dict] = []
    problems = []
    try:
        lines = (run / "history.jsonl").read_text().splitlines()
        history = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as err:
        problems.append(f"history.jsonl: {type(err).__name__}")
    lambdas = [v for h in history for v in (h.get("lambda") or [])]
    lam_ok = bool(history) and all("lambda" in h for h in history) and all(
        _finite(v) for v in lambdas)
    try:
        ece = json.loads((run / "test_metrics.json").read_text())["pre_ts"]["ece"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        ece = None
        problems.append(f"test_metrics.json: {type(err).__name__}")
    times = [h.get("time", h.get("train_time")) for h in history]
    per_epoch = ", ".join(f"{t:.1f}" if _finite(t) else "?" for t in times) or "-"
    ok = status == "ok" and len(history) == epochs and lam_ok and _finite(ece)
    verdict = "PASS" if ok else "FAIL" + (f" ({'; '.join(problems)})" if problems else "")
    ece_s = f"{ece:.4f}" if _finite(ece) else str(ece)
    return (f"| {label} | {status} | {len(history)} of {epochs} | {'yes' if lam_ok else 'NO'} | "
            f"{ece_s} | {per_epoch} | {wall} | {verdict} |")


def targets(logs: list[str]) -> str:
    rows = []
    for log in logs:
        try:
            text = Path(log).read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("TARGET |"):
                parts = [p.strip() for p in line.split("|")[1:]]
                if len(parts) >= 4:
                    rows.append(f"| {Path(log).stem} | {parts[0]} | {parts[1]} | {parts[2]} | "
                                f"{parts[3]} |")
    if not rows:
        return TARGET_HEADER + "\n| (none) | no target reported: see the stage table | | | |"
    return TARGET_HEADER + "\n" + "\n".join(rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"] and len(argv) == 6:
        print(run_row(argv[1], argv[2], int(argv[3]), argv[4], argv[5]))
    elif argv[:1] == ["run-header"]:
        print(RUN_HEADER)
    elif argv[:1] == ["targets"]:
        print(targets(argv[1:]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
