"""Evaluate a segmentation checkpoint: metrics before/after temperature scaling, plots, and
per-image calibration maps.

    python tools/eval_seg.py runs/<name>/config.yaml --checkpoint runs/<name>/checkpoint_best.pt \
        [--split test] [--out DIR] [--num-maps 4] [--mode slide --window 512 --stride 341]
        [--resize S] [--pad P] [--set key=value ...]

Every metric is taken at each image's own resolution against its unmodified mask; the network
input follows the run's ``eval`` section (resize, pad, whole or slide), overridden by the options.

Writes DIR/metrics.json (every metric of the test meters, pooled and per-image, per boundary
band and object size, pre- and post-TS with T), DIR/reliability_{pre,post}_ts.png,
DIR/ece_bands.png and DIR/ece_sizes.png (ECE per distance band / object-size bucket, pre- and
post-TS), DIR/risk_coverage.png, DIR/reliability_bands_{pre,post}_ts.png (one diagram per band),
DIR/lambda_curves.png when the run has multipliers, and DIR/maps/<id>.png (image, ground truth,
prediction, confidence, errors, confidence on errors).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cals_seg import plotting  # noqa: E402
from cals_seg.checks import bounded_input, check_config, warn_large_images  # noqa: E402
from cals_seg.cli import (  # noqa: E402
    add_method_argument,
    add_protocol_arguments,
    add_set_argument,
    launch,
    protocol_overrides,
    report,
)
from cals_seg.config import load_config  # noqa: E402
from cals_seg.data.transforms import eval_transform  # noqa: E402
from cals_seg.data.voc import voc_palette  # noqa: E402
from cals_seg.distributed import is_main_process  # noqa: E402
from cals_seg.engine import make_loader  # noqa: E402
from cals_seg.errors import UserError  # noqa: E402
from cals_seg.inference import EvalProtocol, segment_logits  # noqa: E402
from cals_seg.precision import resolve_amp  # noqa: E402
from cals_seg.rules import check_folder, check_model_input  # noqa: E402
from cals_seg.rundir import RunDir, load_checkpoint, write_json  # noqa: E402
from cals_seg.tasks import build_task  # noqa: E402
from cals_seg.trainer import calibrated_test, resolve_device  # noqa: E402
from cals_seg.voc_checks import check_voc_data  # noqa: E402


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return n


@torch.no_grad()
def calibration_maps(
    model: torch.nn.Module,
    dataset,
    ids: list[str],
    out_dir: Path,
    device: torch.device,
    class_names: list[str],
    ignore_index: int,
    temperature: float = 1.0,
    protocol: EvalProtocol | None = None,
    amp: str = "none",
) -> list[Path]:
    """One six-panel PNG per image id, at the image's own resolution: the logits of the
    evaluation's ``protocol`` (:func:`cals_seg.inference.segment_logits`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    to_tensor = eval_transform(None, ignore_index=ignore_index)
    written = []
    for sample_id in ids:
        image, mask = dataset.load_image(sample_id), dataset.load_mask(sample_id)
        x = to_tensor(image=image, mask=mask)["image"].unsqueeze(0).to(device)
        logits = segment_logits(model, x, protocol, amp) / temperature
        conf, pred = logits.softmax(dim=1).max(dim=1)
        path = out_dir / f"{sample_id}.png"
        plotting.plot_calibration_map(
            image,
            mask,
            pred[0].cpu().numpy(),
            conf[0].cpu().numpy(),
            path,
            class_names=class_names,
            ignore_index=ignore_index,
            palette=voc_palette(),
            title=sample_id,
        )
        written.append(path)
    return written


def plot_regions(result: dict, out: Path, name: str) -> list[Path]:
    """ECE per boundary band and per object size, risk-coverage, reliability per band."""
    views = [(key, key.replace("_", "-").replace("ts", "TS")) for key in ("pre_ts", "post_ts")
             if result.get(key)]  # fmt: skip
    pre = result["pre_ts"]
    written = []
    for group, what, xlabel in (
        ("band", "boundary band", "distance to the nearest class boundary (pixels)"),
        ("size", "object size", "area of the ground-truth object (pixels)"),
    ):
        if pre.get(f"ece_{group}") is None:
            continue
        path = out / f"ece_{group}s.png"
        plotting.plot_band_ece(
            pre[f"{group}_edges"], {label: result[k][f"ece_{group}"] for k, label in views},
            path, title=f"{name}: ECE per {what}", xlabel=xlabel, counts=pre[f"count_{group}"],
        )
        written.append(path)
    if pre.get("risk_coverage"):
        path = out / "risk_coverage.png"
        curves = [(label, result[k]["risk_coverage"], result[k]["aurc"]) for k, label in views]
        plotting.plot_risk_coverage(curves, path, title=f"{name}: risk-coverage")
        written.append(path)
    for key, label in views if pre.get("reliability_band") else []:
        bands = zip(plotting.band_labels(pre["band_edges"]), result[key]["reliability_band"],
                    strict=True)  # fmt: skip
        items = [(f"{label}, d in {b}", rel) for b, rel in bands]
        path = out / f"reliability_bands_{key}.png"
        plotting.plot_reliability_grid(items, path, ncols=len(items))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="YAML config (e.g. the run's config.yaml)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint_best.pt or _last.pt")
    parser.add_argument("--split", default="test", choices=["train", "val", "test"])
    parser.add_argument("--out", default=None, help="output folder (default: <run>/eval_<split>)")
    parser.add_argument(
        "--num-maps",
        type=_count,
        default=None,
        help="calibration maps for the first N images (default: eval.num_maps)",
    )
    add_protocol_arguments(parser)
    add_method_argument(parser)
    add_set_argument(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.set, *protocol_overrides(args)], args.method)
        check_config(cfg, reads_data=True, writes_run=False)
        if args.out:
            check_folder("--out", args.out, must_exist=False, writable=True)
        task = build_task(cfg, "segmentation")
        check_model_input(cfg, task)
        check_voc_data(task, tuple(dict.fromkeys(("val", args.split))))
        ckpt = load_checkpoint(args.checkpoint)
        if ckpt.get("num_classes") != task.num_classes:
            raise UserError(
                f"{args.checkpoint} was trained with {ckpt.get('num_classes')} "
                f"classes, but {args.config} has data.num_classes="
                f"{task.num_classes}; use the config the run was trained with."
            )
        try:
            task.model.load_state_dict(ckpt["model"])
        except RuntimeError as err:  # another architecture than the config's
            raise UserError(
                f"{args.checkpoint} does not fit the model of {args.config} "
                f"({str(err).splitlines()[0]}); use the config the run was trained with."
            ) from None
        device = resolve_device(cfg.train.device)
        amp = resolve_amp(cfg.train.amp, device)
    except UserError as err:
        return report(err)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    model = task.model.to(device)
    split_set = {"train": task.train_set, "val": task.val_set, "test": task.test_set}[args.split]
    warn_large_images(split_set, args.split, bounded_input(cfg))
    if args.split == "train":  # the training images without augmentation (a copy, not the task's)
        split_set = copy.copy(split_set)
        split_set.transform = task.val_set.transform
    e, workers = cfg.eval, cfg.data.num_workers
    result = calibrated_test(
        model, task, make_loader(task.val_set, e.batch_size, False, workers),
        make_loader(split_set, e.batch_size, False, workers), device, amp, e.n_bins,
        e.temperature_scaling, cfg.train.progress,
    )
    result.update(checkpoint=str(args.checkpoint), epoch=ckpt.get("epoch"), split=args.split,
                  precision=amp)
    if not is_main_process():  # every rank computed the same numbers; rank 0 writes them
        return 0

    run = RunDir(Path(args.checkpoint).resolve().parent)
    out = Path(args.out) if args.out else run.path / f"eval_{args.split}"
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "metrics.json", result)
    for key in ("pre_ts", "post_ts"):
        if result.get(key):
            title = f"{cfg.name} {args.split}, {key.replace('_', '-')}"
            if key == "post_ts":
                title += f" (T = {result['temperature']:.2f})"
            plotting.plot_reliability_diagram(
                result[key]["reliability"],
                out / f"reliability_{key}.png",
                title=title,
                ece=result[key]["ece"],
            )
    plot_regions(result, out, f"{cfg.name} {args.split}")
    plotting.plot_multiplier_curves(run.history(), out / "lambda_curves.png", task.class_names)
    num_maps = cfg.eval.num_maps if args.num_maps is None else args.num_maps
    maps = calibration_maps(
        model,
        split_set,
        split_set.ids[:num_maps],
        out / "maps",
        device,
        task.class_names,
        task.ignore_index,
        protocol=task.protocol,
        amp=amp,
    )
    pre, post = result["pre_ts"], result["post_ts"]
    line = f"{args.split}: ECE {pre['ece']:.4f}  AECE {pre['aece']:.4f}  mIoU {pre['miou']:.4f}"
    if post is not None:
        line += f"  | post-TS ECE {post['ece']:.4f} (T = {result['temperature']:.3f})"
    print(line)
    print(f"wrote {out / 'metrics.json'} and {len(maps)} calibration maps in {out / 'maps'}")
    return 0


if __name__ == "__main__":
    launch(main)
