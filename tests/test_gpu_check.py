"""benchmarks/gpu_check.sh --dry end to end (about a minute on 2 CPU cores), so that the script
the GPU machine runs once does not rot: every section is written, both runs finish their epoch,
and the benchmark targets parse as finite numbers."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The suite's longest test (minutes on 2 cores): `pytest -m slow tests/test_gpu_check.py`
# before using the GPU machine.
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_gpu_check_dry_writes_every_section(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert (tmp_path / "out" / "gpu_check.log").is_file()
    for section in ("# GPU check", "## 0. Environment", "## 1. CUDA tests", "## 2. Training runs",
                    "## 3. Benchmarks", "## 4. Targets", "## 5. Stages"):
        assert section in md, section
    assert "- mode: dry" in md
    stages = md.split("## 5. Stages")[1]
    for name in ("environment", "cuda_tests", "synthetic_data", "run_amp_auto",
                 "run_channels_last", "bench_loss", "bench_metrics", "bench_eval",
                 "bench_train_step_auto",
                 "cuda_compile_tests", "bench_loss_compiled", "bench_train_step_compiled"):
        assert re.search(rf"^\| {name} \| ok \| \d+ \| \d+ \|$", stages, re.M), (name, stages)
    # the CUDA tests ran and skipped (no GPU here)
    assert re.search(r"\d+ skipped", md.split("## 1. CUDA tests")[1].split("## 2.")[0])
    runs = [line for line in md.split("## 2. Training runs")[1].split("## 3.")[0].splitlines()
            if line.startswith(("| amp_auto", "| channels_last"))]
    assert len(runs) == 2, runs
    for row in runs:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "ok" and cells[2] == "1 of 1" and cells[3] == "yes", row
        assert math.isfinite(float(cells[4])) and cells[-1] == "PASS", row
    targets = {}
    for line in md.split("## 4. Targets")[1].split("## 5.")[0].splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("bench_"):
            targets[(cells[0], cells[1])] = cells[2:]
    for stage, what in [
        ("bench_loss", "loss: cals_alm fwd+bwd time / F.cross_entropy (eager)"),
        ("bench_loss", "loss: (cals_alm peak - F.cross_entropy peak) / logits size"),
        ("bench_loss_compiled", "loss: cals_alm fwd+bwd time / F.cross_entropy (both "
         "torch.compile)"),
        ("bench_train_step_auto", None),
        ("bench_train_step_compiled", None),
    ]:
        found = [v for (s, w), v in targets.items() if s == stage and (what is None or w == what)]
        assert found, (stage, what, targets)
        measured, limit, verdict = found[0]
        assert math.isfinite(float(measured)), (stage, what, measured)
        assert verdict in ("MET", "NOT MET") and limit.split()[0] in ("<=", ">="), found
    compiled_step = [w for s, w in targets if s == "bench_train_step_compiled"]
    assert any("torch.compile" in w for w in compiled_step), targets
    assert any(s == "bench_eval" and "CalibrationMeter time / softmax" in w
               for s, w in targets), targets
    metrics = [k for k in targets if k[0] == "bench_metrics"]
    assert len(metrics) == 3, targets  # torchmetrics may be missing here: n/a is allowed
