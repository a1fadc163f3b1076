"""benchmarks/bench_eval.py --quick end to end (a smoke test: every row and target is printed
with a finite number; the timings themselves are not asserted)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_eval_quick_prints_every_row():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_eval.py"), "--quick"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| update")}
    for name in ("softmax", "CalibrationMeter", "SegmentationMeter", "BoundaryCalibrationMeter",
                 "ObjectSizeCalibrationMeter", "apply ts", "apply vector", "apply dirichlet",
                 "apply selective", "apply boundary_ts", "apply lts", "cityscapes", "ade20k",
                 "BoundaryCalibrationMeter (groups given)",
                 "ObjectSizeCalibrationMeter: analysis in the loader"):
        assert name in rows, (name, out)
    cells = [c.strip() for c in rows["CalibrationMeter"].strip("|").split("|")]
    assert len(cells) == 5 and all(math.isfinite(float(c)) for c in cells[1:] if c != "n/a")
    targets = re.findall(r"^TARGET \| (.+?) \| (\S+) \| (<= \S+) \| (MET|NOT MET)$", out, re.M)
    # per shape: 5 time ratios (calibration meter, the two region meters given their groups,
    # boundary_ts, lts) and 4 meters' memory
    assert len(targets) == 2 * (5 + 4), out
    assert all(math.isfinite(float(t[1])) for t in targets)
