"""Train a segmentation network with a calibration loss, then test its best checkpoint.

    python tools/train_seg.py configs/synthetic_deeplabv3_cals_alm.yaml [--set key=value ...]
    python tools/train_seg.py CONFIG --resume runs/<name>

Writes runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt, checkpoint_best.pt,
test_metrics.json, plots/*.png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cals_seg.cli import USER_ERRORS, launch, report, run_config, training_parser  # noqa: E402
from cals_seg.distributed import is_main_process  # noqa: E402
from cals_seg.engine import seed_everything  # noqa: E402
from cals_seg.tasks import build_segmentation_task  # noqa: E402
from cals_seg.trainer import fit  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = training_parser(__doc__).parse_args(argv)
    try:
        cfg = run_config(args)
        seed_everything(cfg.train.seed)
        task = build_segmentation_task(cfg)
        test = fit(cfg, task, resume=args.resume)
    except USER_ERRORS as err:
        return report(err)
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
    launch(main)
