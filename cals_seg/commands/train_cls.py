"""Train an image or text classifier with a calibration loss, then test its best checkpoint.

    python tools/train_cls.py configs/synthetic_cls.yaml --method cals_alm [--set key=value ...]
    python tools/train_cls.py configs/synthetic_text.yaml --method ce --set train.epochs=5
    python tools/train_cls.py --resume runs/<name>

The same trainer as tools/train_seg.py (classification is the case without spatial dimensions),
so the run directory is the same: runs/<name>/{config.yaml, history.jsonl, checkpoint_last.pt,
checkpoint_best.pt, test_metrics.json, temperature.json, plots/*.png}. The test pass also
gives the long-tail view: under ``pre_ts`` and ``post_ts``, ``class_counts`` (training samples
per class), ``per_class_acc`` and ``groups`` = {many (> 100 training samples), medium (20-100),
few (< 20)}, each with accuracy, ECE, AECE, NLL ... over the test samples of its classes.
"""

from __future__ import annotations

from typing import Any

from cals_seg.commands._cli import launch, train_command


def group_report(test: dict[str, Any]) -> str:
    """One line per group and temperature: ``many  pre_ts  acc 0.812  ece 5.10% (n=...)``."""
    lines = []
    for key in ("pre_ts", "post_ts"):
        block = test.get(key) or {}
        for name, g in (block.get("groups") or {}).items():
            if not g["count"]:
                continue
            lines.append(
                f"  {name:6s} {key:7s} classes {g['num_classes']:3d}  n {g['count']:6d}  "
                f"acc {g['acc']:.4f}  ece {100 * g['ece']:.2f}%  aece {100 * g['aece']:.2f}%"
            )
    return "\n".join(lines)


main = train_command(__doc__, "classification", summary=group_report)


def cli() -> None:
    """Console entry point (joins the process group under torchrun)."""
    launch(main)


if __name__ == "__main__":
    cli()
