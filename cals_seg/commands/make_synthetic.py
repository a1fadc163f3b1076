"""Generate the embedded default dataset (synthetic scenes in the VOC layout).

Usage::

    python tools/make_synthetic.py --root data/synthetic [--seed 0] [--num-train 120]
        [--num-test 200] [--image-size 64] [--overwrite]

The result is read with ``VOCSegmentation(root, ids, num_classes=11)``; ``paper_split(root)`` gives
the train / val / test ids.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=120, help="ids in train.txt")
    parser.add_argument("--num-test", type=int, default=200, help="ids in val.txt (the test set)")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a synthetic dataset generated with other parameters")
    args = parser.parse_args(argv)
    from cals_seg.data.synthetic import SYNTHETIC_CLASSES, generate_synthetic_voc
    from cals_seg.data.voc import paper_split


    start = time.perf_counter()
    root = generate_synthetic_voc(args.root, num_train=args.num_train, num_test=args.num_test,
                                  image_size=args.image_size, seed=args.seed,
                                  overwrite=args.overwrite)
    split = paper_split(root)
    print(f"synthetic dataset at {root} ({time.perf_counter() - start:.1f}s): "
          f"{len(split['train'])} train / {len(split['val'])} val / {len(split['test'])} test "
          f"images, {len(SYNTHETIC_CLASSES)} classes: {', '.join(SYNTHETIC_CLASSES)}")
    return root


def cli() -> None:
    """Console entry point."""
    main()


if __name__ == "__main__":
    cli()
