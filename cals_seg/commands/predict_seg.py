"""Calibrated segmentation of new, unlabelled images with a trained run.

    python tools/predict_seg.py runs/<name> photos/ extra.jpg --out predictions/ \\
        [--threshold 0.5] [--temperature T] [--mode slide --window 512 --stride 341] \\
        [--resize S] [--pad P] [--device auto|cpu|cuda] [--strict] [--set key=value ...]
        [--calibrator NAME] [--conformal ALPHA [mode=risk|image:0.9|class|band] [score=NAME]]

RUN_DIR_OR_CHECKPOINT is a run directory (its checkpoint_best.pt, else checkpoint_last.pt) or a
checkpoint inside one; the run's resolved config.yaml rebuilds the model and the normalisation,
and its temperature.json (fitted on the validation split) calibrates the confidences
(--temperature 1 switches that off). With --calibrator NAME the confidences come instead from
the post-hoc calibrator saved in <run>/calibrators/NAME.pt (fitted on the validation split by
``tools/eval_seg.py RUN --calibrators NAME``; docs/calibrators.md). INPUTS are image files or
folders (searched recursively).

Per image, named after the input file, in DIR:

    <name>_label.png        the predicted class per pixel, a palette PNG (VOC colours)
    <name>_confidence.png   top-label probability of softmax(logits / T), 16-bit PNG: value / 65535
    <name>_entropy.png      predictive entropy / ln K (0: certain, 1: uniform), 16-bit PNG
    <name>_overlay.png      image, prediction colours, pixels under --threshold in magenta

and one JSON line per input in DIR/predictions.jsonl: size, temperature (or calibrator), the
forward pass's precision (none: float32, the default on a CPU), mean confidence, the
fraction of pixels under the threshold, mean entropy (nats), predicted class areas, seconds, and
the output files (or the error of an unreadable input).

With --conformal ALPHA, per image also (docs/conformal.md): <name>_set_size.png (classes in each
pixel's prediction set), <name>_sets.npz (bool array ``sets`` (K, H, W)) and
<name>_ambiguous.png (pixels whose set is not one class, in magenta). The threshold is read from
<run>/calibrators/conformal_<mode>_<score>_a<ALPHA>.json (written by tools/eval_seg.py
--conformal), or fitted on the run's held-out validation images when missing; the sets come
from the network's logits. Outputs are at the image's own
resolution whatever the network input (see cals_seg.evaluation.inference).

DIR may not be, lie inside or hold an input folder, and an existing file there is replaced only
when predict_seg wrote it (listed in DIR/.cals_seg_outputs.json); both are refused before any
prediction.
Far from the validation data: an image whose mean predictive entropy is above the 99th
percentile of the validation images' (computed once with the same calibration and kept in
<run>/calibrators/entropy_p99_<T or calibrator>.json) gets a warning and
``"far_from_validation": true`` in its JSON line (docs/shift.md); --no-ood-check skips it.
With ``--calibrator image_ts``, every line also says ``"outside_calibrator_fit"``: true (and a
warning) when one of the image's statistics lies outside the range of the images the calibrator
was fitted on, where its temperature is the edge of the fit's (docs/shift.md).

Exit status: 0, or 1 when some inputs could not be read (each is named, the rest are written),
or 2 on a usage error or, with --strict, at the first unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from cals_seg.commands._cli import (
    USER_ERRORS,
    add_protocol_arguments,
    add_set_argument,
    add_trust_argument,
    check_inputs_exist,
    protocol_overrides,
    report,
    run_folder_command,
)
from cals_seg.commands._shift import entropy_reference
from cals_seg.commands.eval_seg import calibrator_name
from cals_seg.config.rules import check_folder
from cals_seg.errors import UserError
from cals_seg.utils.paths import OutputFolder, os_error


def open_run(args: argparse.Namespace):
    """The run to predict with (eval mode, on its device) and the temperature to use; with
    ``--calibrator NAME``, ``args.calibrator_module`` is the run's saved calibrator."""
    from cals_seg.runs.run import load_run
    from cals_seg.utils.precision import BF16_DEVIATION, resolve_amp

    run = load_run(args.run, overrides=[*args.set, *protocol_overrides(args)],
                   device=args.device, amp=args.amp, family="segmentation")
    # The forward pass of a prediction: `auto` is float32 on every CPU (the confidences of the
    # float32 export, whatever the CPU); bf16 / fp16 only when asked, said once.
    run.precision = resolve_amp(run.config.train.amp, run.device, warn=args.amp is not None,
                                inference=True)
    if run.precision != "none":
        warnings.warn(f"precision {run.precision}: {BF16_DEVIATION}; --amp none for float32.",
                      stacklevel=1)
    args.calibrator_module = None
    if args.calibrator is not None:  # validated, and refused unless fitted for this use
        from cals_seg.calibrators import load_run_calibrator

        args.calibrator_module = load_run_calibrator(run, args.calibrator)
        return run, 1.0
    return run, run.temperature_for(args.temperature)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT")
    parser.add_argument("inputs", nargs="+", metavar="INPUTS", help="image files or folders")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="confidence under which a pixel is highlighted (default 0.5)")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="instead of the run's fitted temperature (1: no calibration)")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1 (default: the "
                        "run's train.device)")
    parser.add_argument("--amp", default=None, choices=["auto", "none", "bf16", "fp16"],
                        help="precision of the forward pass (default: the run's train.amp, "
                        "where auto is float32 on a CPU; bf16 / fp16 change confidences, "
                        "docs/performance.md#precision)")
    parser.add_argument("--calibrator", default=None, metavar="NAME", type=calibrator_name,
                        help="a post-hoc calibrator saved in <run>/calibrators/ (instead of T)")
    parser.add_argument("--conformal", nargs="+", default=None, metavar="ALPHA",
                        help="prediction sets with miscoverage ALPHA (then optional mode=..., "
                        "score=NAME: lac, aps or any registered score; docs/conformal.md)")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first unreadable input (default: name it, go on)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--no-ood-check", dest="ood_check", action="store_false",
                        help="no warning for images far from the validation data")
    add_protocol_arguments(parser)
    add_set_argument(parser)
    add_trust_argument(parser)
    args = parser.parse_args(argv)
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold: expected a number in (0, 1], got {args.threshold}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    return run_folder_command(args, _main)


def _main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cals_seg.evaluation.inference import predict_image
    from cals_seg.evaluation.predict import (
        IMAGE_SUFFIXES,
        UnreadableImageError,
        collect_inputs,
        label_palette,
        output_names,
        read_image,
        summary,
        write_outputs,
    )

    try:
        check_inputs_exist(args.inputs)  # a mistyped path: said before anything is created
        check_folder("--out", args.out, must_exist=False, writable=True)
        # never into (or around) the inputs; never over a file predict_seg did not write
        out_folder = OutputFolder(args.out, "predict_seg", inputs=args.inputs)
        spec = None
        if args.conformal is not None:  # the option checked before the run is loaded
            from cals_seg.commands._conformal import load_or_fit_conformal, parse_conformal

            spec = parse_conformal(args.conformal)
        run, temperature = open_run(args)
        conformal = None
        if spec is not None:
            conformal = load_or_fit_conformal(run, spec)
        try:
            files = collect_inputs(args.inputs)
        except OSError as err:  # a symbolic-link loop, a folder without permission
            raise os_error(err, None, "list the inputs") from None
        if not files:
            raise UserError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {args.inputs}")
        kinds = ["label.png", "confidence.png", "entropy.png", "overlay.png"]
        if conformal is not None:
            kinds += ["set_size.png", "sets.npz", "ambiguous.png"]
        planned = [f"{name}_{kind}" for name in output_names(files) for kind in kinds]
        out_folder.check_free([*planned, "predictions.jsonl"])
        reference = None
        if args.ood_check:

            reference = entropy_reference(run, temperature, args.calibrator,
                                          args.calibrator_module)
        # the output folder is made only now, once every check has passed: a refused
        # prediction leaves nothing behind
        out_folder.claim([*planned, "predictions.jsonl"])
    except USER_ERRORS as err:
        return report(err)
    cfg, model, protocol, device, amp = run.config, run.model, run.protocol, run.device, \
        run.precision
    out = Path(args.out)
    names, k = run.class_names, cfg.data.num_classes
    palette = label_palette(cfg.data.palette)
    failed: list[str] = []
    bar = tqdm(files, desc="predict", unit="img", disable=not args.progress, dynamic_ncols=True)
    with (out / "predictions.jsonl").open("w") as log:
        for path, name in zip(bar, output_names(files), strict=True):
            start = time.perf_counter()
            try:
                image = read_image(path)
            except UnreadableImageError as err:
                tqdm.write(f"error: {err}; " + ("stopping (--strict)." if args.strict
                                                else "skipped, going on."), file=sys.stderr)
                log.write(json.dumps({"input": str(path), "error": str(err)}) + "\n")
                if args.strict:
                    return 2
                failed.append(str(path))
                continue
            pred = predict_image(model, image, temperature, protocol, amp,
                                 calibrator=args.calibrator_module)
            record = {
                "input": str(path), "height": image.shape[0], "width": image.shape[1],
                "temperature": temperature, "calibrator": args.calibrator, "precision": amp,
                "threshold": args.threshold,
                **summary(pred, args.threshold, names),
                "outputs": write_outputs(out, name, image, pred, k, args.threshold, palette),
            }
            if reference is not None:
                far = record["mean_entropy"] > reference["limit_nats"]
                record["far_from_validation"] = bool(far)
                if far:
                    tqdm.write(f"warning: {path}: mean predictive entropy "
                               f"{record['mean_entropy']:.4f} nats is above the validation "
                               f"images' 99th percentile ({reference['limit_nats']:.4f}); the "
                               "image may be far from the training data and its confidences "
                               "less reliable.", file=sys.stderr)
            if pred.outside_fit is not None:
                outside = bool(pred.outside_fit.any())
                record["outside_calibrator_fit"] = outside
                if outside:
                    tqdm.write(f"warning: {path}: the image's statistics lie outside the range "
                               f"of the images calibrator {args.calibrator} was fitted on; its "
                               "temperature there is the edge of the fit's, not one the fit "
                               "could check.", file=sys.stderr)
            if conformal is not None:
                from cals_seg.commands._conformal import image_sets, set_summary, write_set_outputs

                sets = image_sets(run, conformal, image)
                record["conformal"] = set_summary(conformal, sets)
                record["outputs"].update(write_set_outputs(out, name, image, sets))
            record["seconds"] = time.perf_counter() - start
            log.write(json.dumps(record) + "\n")
            log.flush()
    done = len(files) - len(failed)
    how = f"calibrator {args.calibrator}" if args.calibrator else f"T = {temperature:.3f}"
    print(f"wrote {done} prediction(s) to {out} ({how}, {device.type}, "
          f"precision {amp}, {protocol.mode}); summary lines in {out / 'predictions.jsonl'}")
    if failed:
        print(f"error: {len(failed)} input(s) could not be read: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
