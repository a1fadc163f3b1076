"""Train a segmentation network with a calibration loss, then test its best checkpoint.

    python tools/train_seg.py configs/synthetic_deeplabv3_cals_alm.yaml [--set key=value ...]
    python tools/train_seg.py CONFIG --resume runs/<name>

Writes runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt, checkpoint_best.pt,
test_metrics.json, plots/*.png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cals_seg.config import ConfigError, load_config  # noqa: E402
from cals_seg.distributed import cleanup, init_from_env, is_main_process  # noqa: E402
from cals_seg.engine import NonFiniteLossError, seed_everything  # noqa: E402
from cals_seg.models.segmentation import WeightsUnavailableError  # noqa: E402
from cals_seg.tasks import build_segmentation_task  # noqa: E402
from cals_seg.trainer import fit  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="YAML config file")
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override config values, e.g. --set train.epochs=5 loss.name=ce",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its checkpoint_last.pt",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        if args.resume:  # the run's own resolved config, with any explicit overrides on top
            cfg = load_config(Path(args.resume) / "config.yaml", args.set)
        seed_everything(cfg.train.seed)
        task = build_segmentation_task(cfg)
        test = fit(cfg, task, resume=args.resume)
    except (
        ConfigError,
        ValueError,
        FileNotFoundError,
        FileExistsError,
        NonFiniteLossError,
        WeightsUnavailableError,
    ) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not is_main_process():
        return 0
    pre, post = test["pre_ts"], test["post_ts"]
    line = f"test (best epoch {test['epoch'] + 1}): ECE {pre['ece']:.4f}  mIoU {pre['miou']:.4f}"
    if post is not None:
        line += f"  | post-TS ECE {post['ece']:.4f} (T = {test['temperature']:.3f})"
    print(line)
    run_dir = Path(args.resume) if args.resume else cfg.run_dir
    print(f"run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    init_from_env()  # joins the process group under torchrun; nothing otherwise
    try:
        code = main()
    finally:
        cleanup()
    sys.exit(code)
