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
validation, never on test), beside the 3-seed mean ± std of the same setup measured earlier. Those
reference numbers, with the machine, date and command that made them, are read from
``demo_reference.json`` beside this module (``--reference FILE`` for another), which
``tools/compare.py SETUP --methods ce cals_alm --seeds 0 1 2 --calibrators ts boundary_ts
--reference-out FILE`` writes; a missing or malformed file is refused in one line before any
training. A finished run found in the output folder is reused (delete the folder to retrain).

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
# The 3-seed test ECE of each row's setup, method and calibration, with its provenance: written by
# ``tools/compare.py ... --reference-out`` (cals_seg.training.study.write_reference).
REFERENCE_FILE = Path(__file__).with_name("demo_reference.json")


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


def reference_cell(entry: dict | None, method: str, calibration: str) -> str:
    """``mean ± std`` (or ``mean (mean of n)`` where only the mean was published) of the test ECE,
    in %, of ``method`` after ``calibration`` in a setup's reference ``entry``; ``-`` where the
    study did not measure it."""
    cell = ((entry or {}).get("ece", {}).get(method) or {}).get(calibration)
    if cell is None:
        return "-"
    if cell.get("std") is None:
        return f"{cell['mean']:.2f}" + (f" (mean of {cell['n']})" if cell["n"] > 1 else "")
    return f"{cell['mean']:.2f} ± {cell['std']:.2f}"


def provenance(entry: dict) -> str:
    """Where a reference entry comes from, in words: seeds, machine, precision, date, and the
    command that measured it (or the doc section it was taken from)."""
    seeds = ", ".join(map(str, entry["seeds"]))
    precision = f", {entry['precision']}" if entry.get("precision") else ""
    how = " ".join(x for x in (entry.get("command"), entry.get("source") and
                               f"(published in {entry['source']})") if x)
    return f"{len(entry['seeds'])} seeds ({seeds}), {entry['machine']}{precision}, " \
           f"{entry['date']}: {how}"


def table(rows: dict[str, tuple[dict, dict, dict]], reference: dict | None) -> list[str]:
    """The demo's table: per method ``(test metrics, validation metrics, test_metrics.json of the
    training)``, one raw row and one with the calibrator picked on validation, beside the same
    row of the setup's ``reference`` entry (:func:`reference_cell`)."""
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
            out.append(
                f"| {method} | {label} | {cell(v.get('ece'))} | {cell(m.get('ece'))} | "
                f"{cell(m.get('ece_band_weighted'))} | {cell(m.get('nll'), 1.0, 3)} | "
                f"{cell(m.get('miou'))} | {reference_cell(reference, method, label)} |")
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
    parser.add_argument("--reference", type=Path, default=REFERENCE_FILE, metavar="FILE",
                        help="the 3-seed reference numbers (JSON written by tools/compare.py "
                        "--reference-out; default: the one shipped beside this module)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="extra overrides for both runs (may be repeated)")
    args = parser.parse_args(argv)
    setup = SETUPS[args.long]
    out = Path(args.out or ("runs/demo_long" if args.long else "runs/demo"))
    py = sys.executable
    from cals_seg.commands._cli import USER_ERRORS, report
    from cals_seg.runs.run import Run
    from cals_seg.training.study import read_reference

    try:  # before any training: a broken reference file is refused in one line
        reference = read_reference(args.reference)["setups"].get(setup)
    except USER_ERRORS as err:
        return report(err)

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
    last = (f"the same row over {provenance(reference)}" if reference is not None else
            f"none ({args.reference} holds no study of {setup})")
    print(f"\n{setup}, seed 0, test split (pooled over pixels, %; NLL in nats), {seconds:.0f} s "
          "in all. Calibration: raw, and the post-hoc calibrator (of "
          f"{' and '.join(CALIBRATORS)}, fitted on validation) with the lower validation ECE. "
          f"Last column: {last}.\n")
    for line in table(rows, reference):
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


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
