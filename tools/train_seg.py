"""Train a segmentation network with a calibration loss, then test its best checkpoint.

    python tools/train_seg.py configs/synthetic_deeplabv3_cals_alm.yaml [--set key=value ...]
    python tools/train_seg.py configs/synthetic_deeplabv3.yaml --method ce
    python tools/train_seg.py CONFIG --resume runs/<name>

Writes runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt, checkpoint_best.pt,
test_metrics.json, temperature.json, plots/*.png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cals_seg.cli import launch, train_command  # noqa: E402

main = train_command(__doc__, "segmentation")

if __name__ == "__main__":
    launch(main)
