"""The main job on the embedded dataset: train CE and CALS-ALM, evaluate both, compare.

    python tools/demo.py [--epochs N] [--out runs/demo]

Generates the embedded synthetic dataset (VOC layout) if missing, runs
``tools/train_seg.py configs/synthetic_deeplabv3.yaml --method {ce,cals_alm}`` side by side,
then ``tools/eval_seg.py`` on each best checkpoint, and prints a side-by-side table. A finished
run found in the output folder is reused (delete the folder to retrain).

The two runs are seed 0 of the study's CE and CALS-ALM rows (``make compare``). With
``train.amp: auto`` they train in bfloat16 where the CPU has it natively and in float32
elsewhere (emulated bf16 would be about 20x slower): on 2 cores about 5 minutes with native bf16
and 11 on an AVX2-only CPU (docs/benchmarks.md, "The two commands"). Run it from the
repository's root (it reads ``configs/`` and writes ``data/`` and ``runs/`` there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

METHODS = ("ce", "cals_alm")
SETUP = "configs/synthetic_deeplabv3.yaml"


def run_command(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_parallel(cmds: dict[str, list[str]]) -> None:
    """Run the trainings side by side (one thread each: on a small CPU two single-threaded
    runs finish sooner than two two-threaded runs in a row), prefixing their output lines."""
    procs = {}
    for name, cmd in cmds.items():
        print(f"$ {' '.join(cmd)}", flush=True)
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, bufsize=1)

    def pump(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            print(f"[{name}] {line}", end="", flush=True)

    threads = [threading.Thread(target=pump, args=item) for item in procs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [name for name, proc in procs.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"{failed} failed; see the output above")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="output folder of the two runs")
    parser.add_argument("--epochs", type=int, default=None, help="override train.epochs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per training")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="extra overrides for both runs (may be repeated)")
    args = parser.parse_args(argv)
    py = sys.executable
    from cals_seg.runs.run import Run

    start = time.perf_counter()
    trainings, run_dirs = {}, {}
    for method in METHODS:
        run_dir = run_dirs[method] = Path(args.out) / method
        sets = [f"output_dir={args.out}", f"name={method}", "train.progress=false",
                f"train.threads={args.threads}", *args.set]
        if args.epochs is not None:
            sets.append(f"train.epochs={args.epochs}")
        if Run(run_dir).finished():
            print(f"reusing the finished run {run_dir} (delete it to retrain)")
            continue
        if run_dir.exists():  # an unfinished demo run: start it again
            shutil.rmtree(run_dir)
        trainings[method] = [py, "-m", "cals_seg.commands.train_seg", SETUP, "--method", method,
                             "--set", *sets]
    if trainings:
        # generate the dataset once, before two processes could race to write it
        run_command([py, "-m", "cals_seg.commands.make_synthetic", "--root", "data/synthetic"])
        run_parallel(trainings)
    run_parallel({  # the maps and plots of both runs, side by side
        method: [py, "-m", "cals_seg.commands.eval_seg", str(run_dir), "--out",
                 str(Run(run_dir).eval_dir("test")),
                 "--set", "train.progress=false", f"train.threads={args.threads}"]
        for method, run_dir in run_dirs.items()
    })
    rows = {method: json.loads(Run.eval_metrics(Run(run_dir).eval_dir("test")).read_text())
            for method, run_dir in run_dirs.items()}

    print(f"\nTest split of the embedded dataset (pooled over pixels; % except T), "
          f"{time.perf_counter() - start:.0f}s in all:\n")
    header = ("| method | ECE | band-weighted ECE | AECE | CWCE | ECE (image mean) | NLL | mIoU | "
              "post-TS ECE | T |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for method, m in rows.items():
        pre, post = m["pre_ts"], m["post_ts"]
        post_ece = f"{100 * post['ece']:.2f}" if post else "-"
        banded = pre.get("ece_band_weighted")
        banded = "-" if banded is None else f"{100 * banded:.2f}"
        print(f"| {method} | {100 * pre['ece']:.2f} | {banded} | {100 * pre['aece']:.2f} | "
              f"{100 * pre['cwce']:.2f} | {100 * pre['ece_image_mean']:.2f} | {pre['nll']:.3f} | "
              f"{100 * pre['miou']:.2f} | {post_ece} | {m['temperature']:.2f} |")
    print("\nPlots:")
    for method in METHODS:
        run_dir = Path(args.out) / method
        print(f"  {run_dir}/plots/  (reliability diagrams, lambda curves, training curves)")
        print(f"  {run_dir}/eval_test/maps/  (per-image calibration maps)")
    return 0


def run() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
