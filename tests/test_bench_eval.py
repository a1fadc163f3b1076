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

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> str:
    """The output of ``python benchmarks/<name> ARGS``, run in this process (its
    ``__main__``), after checking that it exits with status 0."""
    script = ROOT / "benchmarks" / name
    threads = torch.get_num_threads()  # the scripts set their own (--threads 1)
    buffer = io.StringIO()
    try:
        with mock.patch.object(sys, "argv", [str(script), *args]), \
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
    return out


def test_bench_eval_quick_prints_every_row():
    out = run_script("bench_eval.py", "--quick")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| update")}
    for name in ("softmax", "CalibrationMeter", "SegmentationMeter", "BoundaryCalibrationMeter",
                 "ObjectSizeCalibrationMeter", "apply ts", "apply vector", "apply dirichlet",
                 "apply selective", "apply boundary_ts", "apply lts", "cityscapes", "ade20k",
                 "BoundaryCalibrationMeter (groups given)",
                 "ObjectSizeCalibrationMeter: analysis in the loader"):
        assert name in rows, (name, out)
    cells = [c.strip() for c in rows["CalibrationMeter"].strip("|").split("|")]
    assert len(cells) == 7 and all(math.isfinite(float(c)) for c in cells[1:] if c != "n/a")
    targets = re.findall(r"^TARGET \| (.+?) \| (\S+) \| (<= \S+) \| (MET|NOT MET)$", out, re.M)
    # per shape: 5 time ratios (calibration meter, the two region meters given their groups,
    # boundary_ts, lts) and 4 meters' memory
    assert len(targets) == 2 * (5 + 4), out
    assert all(math.isfinite(float(t[1])) for t in targets)


def test_meter_floor_quick_prints_every_step():
    """benchmarks/meter_floor.py --quick: every step's row, in softmaxes, and the bound."""
    out = run_script("meter_floor.py", "--quick", "--repeats", "2")
    rows = {line.split("|")[1].strip(): line.strip("|").split("|") for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| step")}
    steps = ["read", "softmax", "class-wise compare", "class-wise compaction", "class totals"]
    for name in [*steps, "lower bound, eager (the five rows)"]:
        assert name in rows and math.isfinite(float(rows[name][2])), (name, out)
    total = sum(float(rows[name][1]) for name in steps)
    assert float(rows["lower bound, eager (the five rows)"][1]) == pytest.approx(total, abs=0.01)
