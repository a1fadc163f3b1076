"""torchrun on CPU (gloo, 2 processes): eval_seg equals one process; train_seg writes once and
keeps identical multipliers on both ranks (the trainer checks it every epoch).

The three commands run in one torchrun launch (tests/_torchrun_tools.py: each through the
tools' own ``launch``, the process group joined and left per command): train_seg trains the
run, then eval_seg evaluates its checkpoint twice (plain, and with fits and a corruption); the
one-process evaluations of the same checkpoint run here, in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cals_seg.config.schema import load_config
from cals_seg.tasks import build_task

from ._undrawn import children_undrawn
from .conftest import figures_undrawn, load_tool
from .test_pipeline import CONFIG, ROOT, _overrides

# the options of the second evaluation (fits on the shards, a corruption, no maps)
OPTS = ["--calibrators", "ts", "boundary_ts", "--shift", "fog:1", "--num-maps", "0",
        "--refit-calibrators"]


def _torchrun(commands: list[tuple[str, list[str]]], nproc: int = 2
              ) -> subprocess.CompletedProcess:
    """``commands`` ((tool, argv) pairs) in order, in one launch of ``nproc`` processes."""
    with children_undrawn():  # the workers' figures are not what this file checks
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ROOT / "tests" / "_torchrun_tools.py"),
           json.dumps([[tool, list(map(str, argv))] for tool, argv in commands])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The launch: train_seg of ``ddp`` (2 epochs), then eval_seg of its best checkpoint into
    ``two`` (plain) and ``two_all`` (:data:`OPTS`). Returns (folder, run, launch output)."""
    tmp = tmp_path_factory.mktemp("ddp")
    # odd-sized val/test splits, so the shards are unequal and a padding duplicate would show
    sets = _overrides(tmp, "ddp", epochs=2) + [
        "data.synthetic={num_train: 23, num_test: 7, image_size: 32}", "eval.batch_size=2"]
    cfg = load_config(CONFIG, sets)
    build_task(cfg)  # the embedded data generated once, before the ranks start
    ckpt, conf = cfg.run_dir / "checkpoint_best.pt", cfg.run_dir / "config.yaml"
    out = _torchrun([
        ("train_seg", [CONFIG, "--set", *sets]),
        ("eval_seg", [conf, "--checkpoint", ckpt, "--out", tmp / "two"]),
        ("eval_seg", [conf, "--checkpoint", ckpt, "--out", tmp / "two_all", *OPTS]),
    ])
    return tmp, cfg.run_dir, out


def _one_process(*argv: str) -> None:
    """tools/eval_seg.py in this process (one torch thread, tests/conftest.py: one_thread, as
    the torchrun workers have: the convolutions sum in the same order), figures undrawn."""
    with figures_undrawn():
        assert load_tool("eval_seg").main(list(argv)) == 0


def test_eval_seg_under_torchrun_equals_one_process(launched):
    tmp, run, _ = launched
    ckpt = str(run / "checkpoint_best.pt")
    conf = str(run / "config.yaml")
    _one_process(conf, "--checkpoint", ckpt, "--out", str(tmp / "one"))
    one = json.loads((tmp / "one" / "metrics.json").read_text())
    two = json.loads((tmp / "two" / "metrics.json").read_text())
    assert two["pre_ts"]["count"] == one["pre_ts"]["count"]
    assert two["pre_ts"]["num_images"] == one["pre_ts"]["num_images"] == 7
    assert two["temperature"] == pytest.approx(one["temperature"], rel=1e-9)
    for key in ("pre_ts", "post_ts"):
        for metric, value in one[key].items():
            if isinstance(value, float):
                assert two[key][metric] == pytest.approx(value, rel=1e-9, abs=1e-12), metric
            elif isinstance(value, int):
                assert two[key][metric] == value, metric


def test_train_seg_under_torchrun(launched):
    _, run, out = launched
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [0, 1]  # written once, by rank 0
    assert all(len(h["lambda"]) == 11 for h in history)
    # the sharded evaluation saw every valid pixel exactly once (no padding duplicates)
    task = build_task(load_config(run / "config.yaml"))

    def valid_pixels(dataset) -> int:
        return sum(int((dataset[i]["mask"] != 255).sum()) for i in range(len(dataset)))

    assert {h["val_count"] for h in history} == {valid_pixels(task.val_set)}
    test = json.loads((run / "test_metrics.json").read_text())
    assert test["pre_ts"]["count"] == valid_pixels(task.test_set)
    assert (run / "test_metrics.json").is_file() and (run / "checkpoint_best.pt").is_file()
    assert out.stdout.count("run directory:") == 1  # only rank 0 reports


def test_eval_seg_with_fits_and_a_corruption_under_torchrun_equals_one_process(launched):
    """The engine under torchrun: calibrators fitted on the shards (their temperatures), the
    test pass with their meters and the entropy statistics, and a corruption's pass equal one
    process (the conformal sets are refused under torchrun, in one line)."""
    tmp, run, _ = launched
    ckpt = str(run / "checkpoint_best.pt")
    conf = str(run / "config.yaml")
    _one_process(conf, "--checkpoint", ckpt, "--out", str(tmp / "one_all"), *OPTS)
    one = json.loads((tmp / "one_all" / "metrics.json").read_text())
    two = json.loads((tmp / "two_all" / "metrics.json").read_text())

    def close(a, b, where):
        if isinstance(a, dict):
            for k in a:
                if k not in ("fit_seconds", "fitted_for", "file", "network_passes"):
                    close(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                close(x, y, f"{where}[{i}]")
        elif isinstance(a, float):
            assert b == pytest.approx(a, rel=1e-7, abs=1e-10), where
        else:
            assert a == b, where

    for key in ("temperature", "pre_ts", "post_ts", "calibrators", "shift", "entropy_flag"):
        close(one[key], two[key], key)
    for name in ("ts", "boundary_ts"):
        close(one["calibrator_fits"][name].get("temperature"),
              two["calibrator_fits"][name].get("temperature"), name)
