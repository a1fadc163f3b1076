"""Train a segmentation network with a calibration loss, then test its best checkpoint.

    python tools/train_seg.py configs/synthetic_deeplabv3.yaml --method cals_alm [--set k=v ...]
    python tools/train_seg.py configs/synthetic_deeplabv3.yaml --method ce
    python tools/train_seg.py --resume runs/<name>

Writes runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt, checkpoint_best.pt,
test_metrics.json, temperature.json, plots/*.png}.
"""

from __future__ import annotations

from cals_seg.commands._cli import launch, train_command

main = train_command(__doc__, "segmentation")


def cli() -> None:
    """Console entry point (joins the process group under torchrun)."""
    launch(main)


if __name__ == "__main__":
    cli()
