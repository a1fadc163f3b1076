"""How far a temperature can go on one corruption: the ceilings behind docs/shift.md's analysis.

    python benchmarks/shift_ceiling.py RUN [--shift fog:3 contrast:3] [--shift-seed 0]

For each corruption of ``--shift``, the run's test split is corrupted (as ``eval_seg --shift``
does) and split in two halves by image index (even: fit, odd: measure). On the odd half it
prints the band-weighted ECE (%) of:

- ``boundary_ts``: fitted on the clean validation images (what ``eval_seg`` fits);
- ``+ best global T``: ``boundary_ts`` times one extra temperature for all images of the
  corruption, the one (of a grid of 41 in ``log T`` from -0.5 to 1.5) with the lowest
  band-weighted ECE on the even half: the best that one number per corruption can do;
- ``image_ts on the corruption``: ``image_ts`` fitted (NLL, no held-out images, all images
  counted as clean) on the even half of the *corrupted test images themselves*: an oracle that
  no calibrator can be, the ceiling of a per-pixel temperature fitted by NLL;
- ``image_ts``: fitted as ``eval_seg --calibrators image_ts`` fits it (validation images and
  held-out corrupted copies of them), for reference.

One torch thread. The numbers are those of docs/shift.md's "Why it falls short".
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Callable

import torch


def _grab(infer, dataset, batch_size: int = 16):
    from cals_seg.training.engine import make_loader

    out = [[], [], []]
    for logits, target, image in infer.predict(make_loader(dataset, batch_size, False, 0),
                                               with_inputs=True):
        for part, value in zip(out, (logits, target, image), strict=True):
            part.append(value.cpu())
    return [torch.cat(part) for part in out]


def _batches(logits, target, image, index):
    def gen():
        for s in range(0, len(index), 16):
            j = index[s:s + 16]
            yield logits[j], target[j], image[j]
    return gen


def _bw_ece(task, logits, target, image, index, calibrate: Callable) -> float:
    meters = task.meters(15, test=True)
    with torch.no_grad():
        for s in range(0, len(index), 16):
            j = index[s:s + 16]
            out = calibrate(logits[j], image[j])
            for meter in meters.values():
                meter.update(out, target[j])
    values: dict = {}
    for meter in meters.values():
        values.update(meter.compute())
    return 100 * float(values["ece_band_weighted"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--shift", nargs="+", default=["fog:3", "contrast:3"])
    parser.add_argument("--shift-seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    from cals_seg.calibrators import build_calibrator
    from cals_seg.data.corruptions import corrupted_dataset, parse_shifts
    from cals_seg.runs.run import load_run

    loaded = load_run(args.run, with_data=True)
    task, infer, ignore = loaded.task, loaded.inference, loaded.task.ignore_index
    k = task.num_classes
    val = _grab(infer, task.val_set)
    everything = torch.arange(len(val[0]))
    boundary = build_calibrator("boundary_ts", k)
    boundary.fit(_batches(*val, everything), ignore)
    image_ts = build_calibrator("image_ts", k)
    data, kwargs = image_ts.fit_data(task.val_set)
    stream = _grab(infer, data)
    image_ts.fit(_batches(*stream, torch.arange(len(stream[0]))), ignore, **kwargs)
    grid = [-0.5 + 0.05 * i for i in range(41)]
    print("| corruption | boundary_ts | + best global T | image_ts on the corruption | image_ts |")
    print("|---|---:|---:|---:|---:|")
    for corruption in parse_shifts(args.shift, seed=args.shift_seed):
        test = _grab(infer, corrupted_dataset(task.test_set, corruption))
        n = len(test[0])
        even, odd = torch.arange(0, n, 2), torch.arange(1, n, 2)
        base = _bw_ece(task, *test, odd, lambda x, _: boundary(x))
        scores = [_bw_ece(task, *test, even, lambda x, _, o=o: boundary(x) / math.exp(o))
                  for o in grid]
        best = grid[min(range(len(grid)), key=scores.__getitem__)]
        best_t = _bw_ece(task, *test, odd, lambda x, _, o=best: boundary(x) / math.exp(o))
        oracle = build_calibrator("image_ts", k, holdout_every=0)
        oracle.fit(_batches(*test, even), ignore)
        ceiling = _bw_ece(task, *test, odd, oracle)
        fitted = _bw_ece(task, *test, odd, image_ts)
        print(f"| {corruption.key} | {base:.2f} | {best_t:.2f} (log T + {best:.2f}) | "
              f"{ceiling:.2f} | {fitted:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
