"""The main job on the embedded dataset: CE and CALS-ALM at the paper's setting, each raw and
after the post-hoc calibrator that fits it best, in one table.

    python tools/demo.py [--long] [--out DIR] [--epochs N] [--threads 1] [--set KEY=VALUE ...]

Generates the embedded synthetic dataset (VOC layout) if missing, then, for CE and CALS-ALM
(``cals_alm``: the paper's margin m = 10 and its other hyper-parameters), side by side:

1. ``tools/train_seg.py SETUP --method {ce,cals_alm}`` (seed 0 of the setup's 3-seed study);
2. ``tools/eval_seg.py RUN --split val --calibrators ts boundary_ts``: both calibrators fitted on
   the validation split (saved in RUN/calibrators/) and their validation ECE;
3. ``tools/eval_seg.py RUN --calibrators ts boundary_ts``: the test split, raw and calibrated;

and prints one table: each method raw and with the calibrator of lower validation ECE (chosen on
validation, never on test), beside the 3-seed mean ± std of the same setup measured earlier
(2-core AMD EPYC, AVX2 only, float32, 2026-11-27; docs/margin.md and docs/calibrators.md). A
finished run found in the output folder is reused (delete the folder to retrain).

The setup is ``configs/synthetic_deeplabv3_short.yaml`` (20 epochs, the regime where CE ends
under-confident on the test split), chosen so that the demo fits in 10 minutes on 2 AVX2-only
cores; ``--long`` runs the 56-epoch ``configs/synthetic_deeplabv3.yaml`` (CE over-confident), about
twice as long. With ``train.amp: auto`` the runs train in bfloat16 where the CPU has it natively and
in float32 elsewhere. Run it from the repository's root (it reads ``configs/`` and writes ``data/``
and ``runs/`` there).
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
CALIBRATORS = ("ts", "boundary_ts")
SETUPS = {  # --long: False / True
    False: "configs/synthetic_deeplabv3_short.yaml",
    True: "configs/synthetic_deeplabv3.yaml",
}
SETUP = SETUPS[False]
STUDY = ("3 seeds, 2-core AMD EPYC (AVX2 only, float32), 2026-11-27: docs/margin.md, "
         "\"Segmentation, both regimes\"; boundary_ts: docs/calibrators.md")
# The test ECE (%) of the 3-seed study each demo row belongs to: mean ± std over seeds 0, 1, 2
# (the demo's runs are seed 0), or the mean where only the per-seed values were published.
REFERENCE: dict[str, dict[tuple[str, str], str]] = {
    "configs/synthetic_deeplabv3_short.yaml": {
        ("ce", "raw"): "2.97 ± 0.31", ("ce", "ts"): "1.29 ± 0.47",
        ("ce", "boundary_ts"): "1.06 (mean)",
        ("cals_alm", "raw"): "3.02 ± 0.37", ("cals_alm", "ts"): "1.21 ± 0.36",
        ("cals_alm", "boundary_ts"): "not measured",
    },
    "configs/synthetic_deeplabv3.yaml": {
        ("ce", "raw"): "1.85 ± 0.25", ("ce", "ts"): "1.15 ± 0.20",
        ("ce", "boundary_ts"): "0.89 (mean)",
        ("cals_alm", "raw"): "1.63 ± 0.37", ("cals_alm", "ts"): "0.93 ± 0.33",
        ("cals_alm", "boundary_ts"): "not measured",
    },
}


def run_command(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_parallel(jobs: dict[str, list[list[str]]]) -> None:
    """Run each job's commands in order, the jobs side by side (one thread each: on a small CPU
    two single-threaded runs finish sooner than two two-threaded runs in a row), prefixing their
    output lines with the job's name."""
    failed: list[str] = []

    def work(name: str, cmds: list[list[str]]) -> None:
        for cmd in cmds:
            print(f"[{name}] $ {' '.join(cmd)}", flush=True)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
            for line in proc.stdout:
                print(f"[{name}] {line}", end="", flush=True)
            if proc.wait() != 0:
                failed.append(name)
                return

    threads = [threading.Thread(target=work, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        raise SystemExit(f"{sorted(failed)} failed; see the output above")


def pick_calibrator(val_metrics: dict) -> tuple[str, float]:
    """The calibrator of lowest validation ECE among those evaluated (ties: the simpler, first
    of :data:`CALIBRATORS`), with that ECE."""
    found = val_metrics.get("calibrators") or {}
    scored = [(found[name]["ece"], i, name) for i, name in enumerate(CALIBRATORS) if name in found]
    if not scored:
        raise SystemExit("no calibrator was evaluated on the validation split; see the output "
                         "above")
    ece, _, name = min(scored)
    return name, ece


def table(rows: dict[str, tuple[dict, dict, dict]], setup: str) -> list[str]:
    """The demo's table: per method ``(test metrics, validation metrics, test_metrics.json of the
    training)``, one raw row and one with the calibrator picked on validation."""
    ref = REFERENCE.get(setup, {})
    out = [
        "| method | calibration (picked on validation) | val ECE | ECE | band-weighted ECE | NLL | "
        "mIoU | 3-seed ECE, same setup |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(value: float | None, scale: float = 100.0, digits: int = 2) -> str:
        return "-" if value is None else f"{scale * value:.{digits}f}"

    for method, (test, val, _) in rows.items():
        best, val_ece = pick_calibrator(val)
        for label, m, v in (("raw", test["pre_ts"], val["pre_ts"]),
                            (best, test["calibrators"][best], val["calibrators"][best])):
            key = "raw" if label == "raw" else best
            out.append(
                f"| {method} | {label} | {cell(v.get('ece'))} | {cell(m.get('ece'))} | "
                f"{cell(m.get('ece_band_weighted'))} | {cell(m.get('nll'), 1.0, 3)} | "
                f"{cell(m.get('miou'))} | {ref.get((method, key), '-')} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true",
                        help=f"the 56-epoch setup {SETUPS[True]} (CE over-confident; about "
                        "twice as long) instead of the 20-epoch " + SETUPS[False])
    parser.add_argument("--out", default=None,
                        help="output folder of the two runs (default: runs/demo, --long: "
                        "runs/demo_long)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="override train.epochs (the table's 3-seed column is then not the "
                        "same setup)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="extra overrides for both runs (may be repeated)")
    args = parser.parse_args(argv)
    setup = SETUPS[args.long]
    out = Path(args.out or ("runs/demo_long" if args.long else "runs/demo"))
    py = sys.executable
    from cals_seg.runs.run import Run

    start = time.perf_counter()
    trainings, run_dirs = {}, {}
    for method in METHODS:
        run_dir = run_dirs[method] = out / method
        sets = [f"output_dir={out}", f"name={method}", "train.progress=false",
                f"train.threads={args.threads}", *args.set]
        if args.epochs is not None:
            sets.append(f"train.epochs={args.epochs}")
        if Run(run_dir).finished():
            print(f"reusing the finished run {run_dir} (delete it to retrain)")
            continue
        if run_dir.exists():  # an unfinished demo run: start it again
            shutil.rmtree(run_dir)
        trainings[method] = [[py, "-m", "cals_seg.commands.train_seg", setup, "--method", method,
                              "--set", *sets]]
    if trainings:
        # generate the dataset once, before two processes could race to write it
        run_command([py, "-m", "cals_seg.commands.make_synthetic", "--root", "data/synthetic"])
        run_parallel(trainings)
    evals = {}
    for method, run_dir in run_dirs.items():
        common = ["--calibrators", *CALIBRATORS, "--set", "train.progress=false",
                  f"train.threads={args.threads}"]
        evals[method] = [
            [py, "-m", "cals_seg.commands.eval_seg", str(run_dir), "--split", "val", "--num-maps",
             "0", "--out", str(Run(run_dir).eval_dir("val")), *common],
            [py, "-m", "cals_seg.commands.eval_seg", str(run_dir), "--out",
             str(Run(run_dir).eval_dir("test")), *common],
        ]
    run_parallel(evals)  # fit both calibrators on validation, then the test split

    def read(path: Path) -> dict:
        return json.loads(path.read_text())

    rows = {method: (read(Run.eval_metrics(Run(d).eval_dir("test"))),
                     read(Run.eval_metrics(Run(d).eval_dir("val"))),
                     read(Run(d).test_metrics))
            for method, d in run_dirs.items()}
    seconds = time.perf_counter() - start
    print(f"\n{setup}, seed 0, test split (pooled over pixels, %; NLL in nats), {seconds:.0f} s "
          "in all. Calibration: raw, and the post-hoc calibrator (of "
          f"{' and '.join(CALIBRATORS)}, fitted on validation) with the lower validation ECE. "
          f"Last column: the same row over {STUDY}.\n")
    for line in table(rows, setup):
        print(line)
    if args.epochs is not None or args.set:
        print("\n(--epochs / --set given: the 3-seed column is of the setup as shipped, not of "
              "these runs.)")
    for method, (_, _, trained) in rows.items():
        advice = (trained.get("under_confident") or {}).get("advice")
        if advice:
            print(f"\n{method}: {advice}")
    print("\nOne seed: its digits differ from the 3-seed means by up to about their std; read "
          "the difference between CE and CALS-ALM against it.")
    print("\nPlots:")
    for run_dir in run_dirs.values():
        print(f"  {run_dir}/plots/  (reliability diagrams, lambda curves, training curves)")
        print(f"  {run_dir}/eval_test/  (calibrators.md, per-band plots; maps/: per-image "
              "calibration maps)")
    return 0


def run() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
