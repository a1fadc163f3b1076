"""Export a trained segmentation run as ONNX or a torch.export program (.pt2).

    python tools/export.py runs/<name> --format onnx --out model.onnx
    python tools/export.py runs/<name> --format pt2 --out model.pt2 [--logits]
        [--conformal 0.1 [mode=risk|image:0.9|class] [score=lac|aps]]

The program maps a float32 RGB batch (N, 3, H, W) with values in [0, 255] to calibrated
probabilities (N, K, H, W) at the input's resolution: normalisation, padding to the network's
stride, the network, and softmax(logits / T) with the run's fitted temperature are inside it.
N, H and W are dynamic. With --conformal ALPHA [mode=risk|image:TAU|class] [score=lac|aps] (aps:
pt2 only), the program has a second output, sets: the prediction sets (N, K, H, W) bool of
predict_seg --conformal (docs/conformal.md), from the fit saved in <run>/calibrators/ (or fitted
now on the run's held-out validation images). Next to FILE, FILE.json says what it expects and
returns (class names, temperature, normalisation, the conformal threshold). The .onnx file holds its
weights (up to 2 GB; a larger model's go to FILE.data, named when written). Load a .pt2 with
torch.export.load(FILE).module(), an .onnx with onnxruntime.InferenceSession(FILE). ONNX needs
pip install "cals_seg[export]".
"""

from __future__ import annotations

import argparse
import sys

from cals_seg.commands._cli import add_trust_argument

# The library's names (cals_seg.runs.export imports torch; --help must not).
FORMATS = ("onnx", "pt2")
CALIBRATORS = ("ts", "none")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", metavar="RUN", help="run directory (or a checkpoint inside one)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, metavar="FILE")
    parser.add_argument("--calibrator", default="ts", choices=CALIBRATORS,
                        help="ts: the run's fitted temperature (default); none: T = 1")
    parser.add_argument("--logits", action="store_true", help="output raw logits")
    parser.add_argument("--checkpoint", default="best", choices=["best", "last"])
    parser.add_argument("--min-size", type=int, default=None, metavar="PIXELS",
                        help="smallest H / W the program accepts (default: 2 x output stride)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="ALPHA",
                        help="also output the prediction sets of predict_seg --conformal: ALPHA "
                        "[mode=risk|image:TAU|class] [score=lac|aps]")
    add_trust_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from cals_seg.commands._cli import consent_of

    with consent_of(args):  # --trust-code: the run folders' factories may be imported
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cals_seg.commands._cli import USER_ERRORS, report
    from cals_seg.errors import UserError
    from cals_seg.runs.export import export_run
    from cals_seg.utils.paths import OutputFolder

    try:  # FILE and FILE.json: never over a file that export did not write
        out = Path(args.out)
        outputs = OutputFolder(out.parent, "export", inputs=[])
        outputs.check_free([out.name, f"{out.name}.json"])
        conformal = None
        if args.conformal is not None:
            from cals_seg.commands._conformal import load_or_fit_conformal, parse_conformal
            from cals_seg.runs.run import load_run

            spec = parse_conformal(args.conformal)
            if any(m.startswith("band") for m in spec["mode"]):
                raise UserError("--conformal mode=band: the distance to the predicted boundaries "
                                "is not exported; use mode=risk, image:TAU or class.")
            if spec["score"] == "aps" and args.format == "onnx":
                raise UserError("--format onnx --conformal score=aps: the APS randomisation "
                                "reads the bits of the probabilities, which ONNX cannot; use "
                                "--format pt2, or score=lac.")
            conformal = load_or_fit_conformal(
                load_run(args.run, args.checkpoint, device="cpu", amp="none",
                         family="segmentation"), spec)
        info = export_run(args.run, args.out, args.format, args.calibrator, args.logits,
                          args.checkpoint, args.min_size, conformal)
        outputs.claim([out.name, f"{out.name}.json"])  # once written: a failed export claims none
    except (*USER_ERRORS, ImportError) as err:
        return report(err)
    from cals_seg.runs.export import written_files

    what = "logits" if args.logits else f"probabilities (T = {info['temperature']:.4g})"
    files = written_files(args.out)
    print(f"{args.out}: {args.format}, (N, 3, H, W) in [0, 255] -> (N, {info['num_classes']}, "
          f"H, W) {what}; H, W >= {info['input']['min_size']}; metadata in {args.out}.json")
    if info.get("conformal"):
        c = info["conformal"]
        print(f"second output: sets (N, {info['num_classes']}, H, W) bool, {c['mode']} "
              f"{c['score']} alpha {c['alpha']:g} (threshold {c['threshold']})")
    keep = " (keep them together)" if len(files) > 2 else ""
    print(f"wrote {len(files)} files{keep}: {', '.join(str(f) for f in files)}")
    return 0


def run() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
