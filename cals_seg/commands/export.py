"""Export a trained segmentation or image classification run as ONNX or a torch.export program.

    python tools/export.py runs/<name> --format onnx --out model.onnx
    python tools/export.py runs/<name> --format pt2 --out model.pt2 [--logits]
        [--calibrator NAME] [--conformal 0.1 [mode=risk|image:0.9|class] [score=NAME]]

The program maps a float32 RGB batch (N, 3, H, W) with values in [0, 255] to calibrated
probabilities (N, K, H, W) at the input's resolution: normalisation, padding to the network's
stride, the network, and the calibration are inside it, in float32, and give what predict_seg
gives by default: softmax(logits / T) with the run's fitted temperature, or with --calibrator
NAME the post-hoc calibrator saved in <run>/calibrators/NAME.pt (fitted by tools/eval_seg.py RUN
--calibrators NAME), as predict_seg --calibrator NAME applies it (every registered calibrator;
its boundary bands come from the program's own predicted map). --calibrator none: T = 1. N, H
and W are dynamic; the smallest side is the smallest the network holds (found by the export;
--min-size to ask for another). With --conformal ALPHA [mode=risk|image:TAU|class]
[score=NAME] (aps: pt2 only), the program has a second output, sets: the prediction sets
(N, K, H, W) bool of predict_seg --conformal (docs/conformal.md), from the fit saved in
<run>/calibrators/ (or fitted now on the run's held-out validation images). Next to FILE,
FILE.json says what it expects and returns (class names, smallest side, calibration,
normalisation, the forward precision, the conformal threshold). The .onnx file holds its
weights (up to 2 GB; a larger model's go to FILE.data, named when written) and is checked
against the PyTorch program with onnxruntime when installed. Load a .pt2 with
torch.export.load(FILE).module(), an .onnx with onnxruntime.InferenceSession(FILE)
(docs/integrations.md). ONNX needs pip install "cals_seg[export]".

An image classification run (tools/train_cls.py) maps (N, 3, S, S), S = data.image_size (images
resized and cropped as predict_cls makes them), to (N, K) probabilities, with its calibrator
fitted by tools/eval_cls.py and its sets (N, K) (mode risk or class); a text run is refused
(docs/classification.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cals_seg.commands._cli import USER_ERRORS, add_trust_argument, report, run_folder_command
from cals_seg.config.rules import check_folder
from cals_seg.errors import UserError
from cals_seg.utils.paths import OutputFolder, os_error

# The library's names (cals_seg.runs.export imports torch; --help must not). --calibrator is
# checked against the registry there (cals_seg.runs.export.calibrator_choices()), so that a
# calibrator registered later is exported without an edit here.
FORMATS = ("onnx", "pt2")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", metavar="RUN", help="run directory (or a checkpoint inside one)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, metavar="FILE")
    parser.add_argument("--calibrator", default=None, metavar="NAME",
                        help="a registered post-hoc calibrator saved in <run>/calibrators/ by "
                        "tools/eval_seg.py --calibrators NAME (as predict_seg --calibrator NAME "
                        "applies it), or none: T = 1 (default: the run's fitted temperature)")
    parser.add_argument("--logits", action="store_true", help="output raw logits")
    parser.add_argument("--checkpoint", default="best", choices=["best", "last"])
    parser.add_argument("--min-size", type=int, default=None, metavar="PIXELS",
                        help="smallest H / W the program accepts (default: the smallest the "
                        "network holds, found by the export)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="ALPHA",
                        help="also output the prediction sets of predict_seg --conformal: ALPHA "
                        "[mode=risk|image:TAU|class] [score=NAME]")
    add_trust_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # --trust-code: the run folders' factories may be imported; a user error raised anywhere
    # (a DataLoader worker included) ends in one line
    return run_folder_command(args, _main)


def _main(args: argparse.Namespace) -> int:
    from cals_seg.runs.export import export_run
    from cals_seg.runs.run import TEMPERATURE_FILE

    try:  # FILE and FILE.json: never over a file that export did not write
        out = Path(args.out)
        if args.min_size is not None and args.min_size < 1:
            raise UserError(f"--min-size: expected a number of pixels >= 1, got {args.min_size}.")
        check_folder("--out", str(out.parent), must_exist=False, writable=True)
        outputs = OutputFolder(out.parent, "export", inputs=[])
        outputs.check_free([out.name, f"{out.name}.json"])
        conformal = loaded = None
        if args.conformal is not None:
            from cals_seg.commands._conformal import load_or_fit_conformal, parse_conformal
            from cals_seg.evaluation.conformal_score import refuse_onnx
            from cals_seg.runs.export import export_family
            from cals_seg.runs.run import load_run

            spec = parse_conformal(args.conformal)
            family = export_family(args.run, args.checkpoint)  # a text run: refused
            if family == "classification":  # the sets of predict_cls, fitted by eval_cls
                from cals_seg.evaluation.evaluator import check_conformal

                check_conformal(spec)
            elif any(m.startswith("band") for m in spec["mode"]):
                raise UserError("--conformal mode=band: the distance to the predicted boundaries "
                                "is not exported; use mode=risk, image:TAU or class.")
            if args.format == "onnx":
                refuse_onnx(spec["score"])
            loaded = load_run(args.run, args.checkpoint, device="cpu", amp="none",
                              family=family)  # read once: the export uses it too
            conformal = load_or_fit_conformal(loaded, spec, family)
        info = export_run(args.run, args.out, args.format, args.calibrator, args.logits,
                          args.checkpoint, args.min_size, conformal, loaded)
        outputs.claim([out.name, f"{out.name}.json"])  # once written: a failed export claims none
    except (*USER_ERRORS, ImportError) as err:  # before OSError: a missing run is both
        return report(err)
    except OSError as err:  # a read-only folder, a full disk: one line naming what failed
        return report(os_error_of(err, Path(args.out), Path(args.run)))
    from cals_seg.runs.export import written_files

    if args.logits:
        what = "logits"
    elif info["temperature"] is not None:
        what = f"probabilities (T = {info['temperature']:.4g})"
    else:
        what = f"probabilities (calibrator {info['calibrator']})"
    files = written_files(args.out)
    if info.get("family") == "classification":
        side = info["input"]["size"]
        print(f"{args.out}: {args.format}, (N, 3, {side}, {side}) in [0, 255] -> "
              f"(N, {info['num_classes']}) {what}, float32 (images made as predict_cls makes "
              f"them: {info['input']['resize'].split(' (')[0]}); metadata in {args.out}.json")
    else:
        print(f"{args.out}: {args.format}, (N, 3, H, W) in [0, 255] -> (N, "
              f"{info['num_classes']}, H, W) {what}, float32; H, W >= "
              f"{info['input']['min_size']}; metadata in {args.out}.json")
    if args.calibrator == "ts" and str(info["calibrator_file"]).endswith(TEMPERATURE_FILE):
        print("--calibrator ts: the run has no fitted ts calibrator (tools/eval_seg.py RUN "
              f"--calibrators ts fits it): its fitted temperature, {info['calibrator_file']}, "
              "is used")
    if info.get("conformal"):
        c = info["conformal"]
        shape = ", ".join(str(d) for d in c["output"]["shape"]).replace("K", str(
            info["num_classes"]))
        print(f"second output: sets ({shape}) bool, {c['mode']} "
              f"{c['score']} alpha {c['alpha']:g} (threshold {c['threshold']})")
    keep = " (keep them together)" if len(files) > 2 else ""
    print(f"wrote {len(files)} files{keep}: {', '.join(str(f) for f in files)}")
    return 0


def os_error_of(err: OSError, out: Path, run: Path) -> UserError:
    """An OS error of the export as what it is: reading the run (a file of ``run``), else
    writing the program (``out``, its ``.json``, the ONNX weights file)."""
    name = Path(str(err.filename)) if err.filename else None
    if name is not None and run.exists() and (name == run or run.resolve() in
                                              name.resolve().parents):
        return os_error(err, name, "read the run file")
    return os_error(err, name if name is not None else out, "write the export")


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
