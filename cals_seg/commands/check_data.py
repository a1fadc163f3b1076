"""Check a segmentation dataset before training: read every split once and report.

    python tools/check_data.py configs/cityscapes_deeplabv3.yaml [--set data.root=...]
    python tools/check_data.py CONFIG --json report.json --no-progress

Reports the image/mask pairs of each split, files without their partner, ids or images listed
twice, unreadable files, image and mask size mismatches, label values outside the classes, the
class histogram per split (share of the labelled pixels and number of images) and the range of
image sizes. Training runs the cheap part of these checks (the file listing) before its first
epoch; this tool also decodes every file.

Exit status: 0 when nothing would make training wrong (warnings are printed), 1 when something
would (each problem names its files), 2 on a bad config or command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cals_seg.config.rules import check_class_names
from cals_seg.config.schema import ConfigError, load_config
from cals_seg.data.crops import crop_warning


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="YAML config or setup file of a segmentation run")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config values, e.g. --set data.root=/data/cityscapes")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the report (statistics, problems, warnings) as JSON")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported after parsing, so that --help answers without loading torch.
    from cals_seg.data.checks import check_splits
    from cals_seg.tasks.segmentation import class_names, segmentation_splits

    try:
        cfg = load_config(args.config, args.set)
        check_class_names(cfg)
        datasets = segmentation_splits(cfg)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # the data at data.root cannot be read as this dataset
        print(f"problem: {err}", file=sys.stderr)
        return 1
    d = cfg.data
    report = check_splits(datasets, class_names(cfg), d.num_classes, d.ignore_index,
                          progress=args.progress)
    report.warnings += _setup_warnings(cfg, report)
    print(f"{d.name} at {d.root}: {d.num_classes} classes, void label {d.ignore_index}")
    print(report.format())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


def _setup_warnings(cfg, report) -> list[str]:
    """What would make training slow or stop although the data are right: crops much larger
    than the images, pretrained weights that cannot be downloaded here."""
    from cals_seg.models.hub import weights_problem

    found = []
    train = report.splits.get("train")
    sizes = [train.max_size] if train is not None and train.max_size else []
    crops = crop_warning(cfg.data.crop_size, sizes, cfg.data.scale_range)
    if crops:
        found.append(crops)
    weights = cfg.model.encoder_weights
    if weights == "imagenet":
        problem = weights_problem(cfg.model.encoder_name, weights)
        if problem:
            found.append(f"{problem} (training would stop at its start)")
    return found


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
