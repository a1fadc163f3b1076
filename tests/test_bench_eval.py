"""benchmarks/bench_eval.py --quick end to end (a smoke test: every row and target is printed
with a finite number; the timings themselves are not asserted). The script runs in this
process as ``python benchmarks/bench_eval.py --quick`` runs it (its ``__main__``, its exit
status): a process of its own only added the imports of torch and the toolkit."""

from __future__ import annotations

import contextlib
import io
import math
import re
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_bench_eval_quick_prints_every_row():
    script = ROOT / "benchmarks" / "bench_eval.py"
    threads = torch.get_num_threads()  # the script sets its own (--threads 1)
    buffer = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", [str(script), "--quick"]), \
                contextlib.redirect_stdout(buffer):
            try:
                runpy.run_path(str(script), run_name="__main__")
                code = 0
            except SystemExit as done:
                code = done.code
    finally:
        torch.set_num_threads(threads)
    out = buffer.getvalue()
    assert code == 0, out
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
