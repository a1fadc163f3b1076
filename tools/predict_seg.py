"""Calibrated segmentation of new, unlabelled images with a trained run.

    python tools/predict_seg.py runs/<name> photos/ extra.jpg --out predictions/ \\
        [--threshold 0.5] [--temperature T] [--mode slide --window 512 --stride 341] \\
        [--resize S] [--pad P] [--device auto|cpu|cuda] [--strict] [--set key=value ...]

RUN_DIR_OR_CHECKPOINT is a run directory (its checkpoint_best.pt, else checkpoint_last.pt) or a
checkpoint inside one; the run's resolved config.yaml rebuilds the model and the normalisation,
and its temperature.json (fitted on the validation split) calibrates the confidences
(--temperature 1 switches that off). INPUTS are image files or folders (searched recursively).

Per image, named after the input file, in DIR:

    <name>_label.png        the predicted class per pixel, a palette PNG (VOC colours)
    <name>_confidence.png   top-label probability of softmax(logits / T), 16-bit PNG: value / 65535
    <name>_entropy.png      predictive entropy / ln K (0: certain, 1: uniform), 16-bit PNG
    <name>_overlay.png      image, prediction colours, pixels under --threshold in magenta

and one JSON line per input in DIR/predictions.jsonl: size, temperature, mean confidence, the
fraction of pixels under the threshold, mean entropy (nats), predicted class areas, seconds, and
the output files (or the error of an unreadable input). Outputs are at the image's own
resolution whatever the network input (see cals_seg.inference).

Exit status: 0, or 1 when some inputs could not be read (each is named, the rest are written),
or 2 on a usage error or, with --strict, at the first unreadable input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageOps  # noqa: E402
from tqdm import tqdm  # noqa: E402

from cals_seg.checks import check_config  # noqa: E402
from cals_seg.cli import (  # noqa: E402
    add_protocol_arguments,
    add_set_argument,
    protocol_overrides,
    report,
)
from cals_seg.config import Config, load_config  # noqa: E402
from cals_seg.data.voc import voc_palette  # noqa: E402
from cals_seg.errors import MissingPathError, UserError  # noqa: E402
from cals_seg.inference import EvalProtocol, Prediction, predict_image  # noqa: E402
from cals_seg.precision import resolve_amp  # noqa: E402
from cals_seg.rules import check_folder  # noqa: E402
from cals_seg.rundir import CHECKPOINT_FILES, RunDir, load_checkpoint  # noqa: E402
from cals_seg.tasks import DATASETS  # noqa: E402
from cals_seg.tasks.segmentation import build_model, class_names, eval_protocol  # noqa: E402
from cals_seg.trainer import resolve_device  # noqa: E402

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
SCALE_16 = 65535  # 16-bit PNG value of probability 1 (and of entropy ln K)
HIGHLIGHT = (255, 0, 255)  # low-confidence pixels in the overlay


class UnreadableImageError(UserError):
    """An input that is not a decodable image."""


def resolve_run(path: str | Path) -> tuple[Path, Path]:
    """``(run directory, checkpoint)`` of a run directory or of a checkpoint inside one.

    Raises:
        FileNotFoundError: no such path, no checkpoint, or no config.yaml next to it.
    """
    path = Path(path)
    if path.is_dir():
        found = [path / name for name in reversed(CHECKPOINT_FILES) if (path / name).is_file()]
        if not found:
            raise MissingPathError(
                f"{path} holds no checkpoint ({' or '.join(reversed(CHECKPOINT_FILES))}); give a "
                "run directory of tools/train_seg.py or a checkpoint file."
            )
        run, checkpoint = path, found[0]
    elif path.is_file():
        run, checkpoint = path.parent, path
    else:
        raise MissingPathError(f"{path} does not exist; give a run directory or a checkpoint.")
    if not (run / "config.yaml").is_file():
        raise MissingPathError(
            f"{run} has no config.yaml: the run's resolved config is needed to rebuild the model "
            "and its normalisation (tools/train_seg.py writes it next to the checkpoints)."
        )
    return run, checkpoint


def collect_inputs(inputs: list[str]) -> list[Path]:
    """Files named, and the images (by suffix) under folders named, in order, without repeats."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*")
                            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        else:
            files.append(path)  # a missing file is reported when it is read
    return list(dict.fromkeys(files))


def read_image(path: Path) -> np.ndarray:
    """RGB pixels ``(H, W, 3)`` uint8, EXIF orientation applied.

    Raises:
        UnreadableImageError: missing, unreadable, truncated or not an image, naming the file.
    """
    try:
        with Image.open(path) as image:
            image.load()
            return np.asarray(ImageOps.exif_transpose(image).convert("RGB"), dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImageError(
            f"cannot read {path} ({type(err).__name__}: {err})"
        ) from None


def output_names(files: list[Path]) -> list[str]:
    """One output name per input: its stem, made unique with its suffix and a counter."""
    used: set[str] = set()
    names = []
    for path in files:
        name = path.stem
        if name in used:
            name = f"{path.stem}_{path.suffix.lstrip('.')}"
        base, i = name, 1
        while name in used:
            i += 1
            name = f"{base}_{i}"
        used.add(name)
        names.append(name)
    return names


def to_16bit(values: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``values / scale`` in ``[0, 1]`` as uint16 (``round(x * 65535)``; half a step of error)."""
    return np.rint(np.clip(values / scale, 0.0, 1.0) * SCALE_16).astype(np.uint16)


def write_outputs(out: Path, name: str, image: np.ndarray, pred: Prediction, num_classes: int,
                  threshold: float) -> dict[str, str]:
    """The four files of one image; returns their paths by kind."""
    label = pred.label[0].cpu().numpy().astype(np.uint8)
    confidence = pred.confidence[0].cpu().numpy()
    entropy = pred.entropy[0].cpu().numpy()
    paths = {kind: out / f"{name}_{kind}.png"
             for kind in ("label", "confidence", "entropy", "overlay")}
    palette = voc_palette()
    label_png = Image.fromarray(label).convert("P")  # L -> P keeps the values
    label_png.putpalette(palette.tobytes())
    label_png.save(paths["label"], optimize=False)
    fast = [cv2.IMWRITE_PNG_COMPRESSION, 1]
    cv2.imwrite(str(paths["confidence"]), to_16bit(confidence), fast)
    cv2.imwrite(str(paths["entropy"]), to_16bit(entropy, math.log(num_classes)), fast)
    base = Image.fromarray(image)
    blended = Image.blend(base, Image.fromarray(palette[label]), 0.45)
    low = Image.fromarray(np.where(confidence < threshold, 255, 0).astype(np.uint8))
    highlighted = Image.blend(blended, Image.new("RGB", base.size, HIGHLIGHT), 0.6)
    overlay = np.asarray(Image.composite(highlighted, blended, low))
    cv2.imwrite(str(paths["overlay"]), cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR), fast)
    return {kind: str(p) for kind, p in paths.items()}


def summary(pred: Prediction, threshold: float, names: list[str]) -> dict[str, Any]:
    """Per-image numbers of the JSON line (exact means over all pixels, in float64)."""
    confidence, entropy = pred.confidence[0].double(), pred.entropy[0].double()
    areas = torch.bincount(pred.label[0].reshape(-1), minlength=len(names)).double()
    areas = (areas / areas.sum()).tolist()
    return {
        "mean_confidence": float(confidence.mean()),
        "low_confidence_fraction": float((confidence < threshold).double().mean()),
        "mean_entropy": float(entropy.mean()),
        "class_areas": {n: a for n, a in zip(names, areas, strict=True) if a > 0},
    }


def load_run(args: argparse.Namespace) -> tuple[Config, torch.nn.Module, EvalProtocol, float,
                                                 torch.device, str]:
    """Config, model (on its device, eval mode), protocol, temperature, device and precision."""
    run, checkpoint = resolve_run(args.run)
    given = [f"train.{key}={getattr(args, key)}" for key in ("device", "amp")
             if getattr(args, key) is not None]  # checked as the config keys they replace
    cfg = load_config(run / "config.yaml", [*args.set, *protocol_overrides(args), *given])
    check_config(cfg, reads_data=False, writes_run=False)
    if DATASETS.get(cfg.data.name, ("unknown",))[0] != "segmentation":
        raise UserError(f"{run} is a {cfg.data.name!r} run; predict_seg predicts segmentation.")
    state = load_checkpoint(checkpoint)
    if state.get("num_classes") not in (None, cfg.data.num_classes):
        raise UserError(f"{checkpoint} has {state['num_classes']} classes, but {run}/config.yaml "
                         f"has data.num_classes={cfg.data.num_classes}.")
    model = build_model(cfg, encoder_weights=None)  # every weight comes from the checkpoint
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as err:
        raise UserError(f"{checkpoint} does not fit the model of {run}/config.yaml "
                         f"({str(err).splitlines()[0]}).") from None
    protocol = eval_protocol(cfg, model)
    temperature = args.temperature
    if temperature is None:
        temperature = RunDir(run).read_temperature()
        if temperature is None:
            warnings.warn(f"{run} has no temperature.json (the run did not finish, or "
                          "eval.temperature_scaling is false): confidences are not calibrated "
                          "(T = 1).", stacklevel=1)
            temperature = 1.0
    if not temperature > 0:
        raise UserError(f"--temperature: expected a number > 0, got {temperature}.")
    device = resolve_device(cfg.train.device)
    amp = resolve_amp(cfg.train.amp, device, warn=False)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    return cfg, model.to(device).eval(), protocol, float(temperature), device, amp


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
                        help="precision of the forward pass (default: the run's train.amp)")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first unreadable input (default: name it, go on)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    add_protocol_arguments(parser)
    add_set_argument(parser)
    args = parser.parse_args(argv)
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold: expected a number in (0, 1], got {args.threshold}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_folder("--out", args.out, must_exist=False, writable=True)
        cfg, model, protocol, temperature, device, amp = load_run(args)
    except UserError as err:
        return report(err)
    files = collect_inputs(args.inputs)
    if not files:
        return report(UserError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {args.inputs}"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names, k = class_names(cfg), cfg.data.num_classes
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
            pred = predict_image(model, image, temperature, protocol, amp)
            record = {
                "input": str(path), "height": image.shape[0], "width": image.shape[1],
                "temperature": temperature, "threshold": args.threshold,
                **summary(pred, args.threshold, names),
                "outputs": write_outputs(out, name, image, pred, k, args.threshold),
            }
            record["seconds"] = time.perf_counter() - start
            log.write(json.dumps(record) + "\n")
            log.flush()
    done = len(files) - len(failed)
    print(f"wrote {done} prediction(s) to {out} (T = {temperature:.3f}, {device.type}, "
          f"precision {amp}, {protocol.mode}); summary lines in {out / 'predictions.jsonl'}")
    if failed:
        print(f"error: {len(failed)} input(s) could not be read: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
