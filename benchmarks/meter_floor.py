"""What the class-wise statistics of ``CalibrationMeter`` cost at least, in softmaxes.

    python benchmarks/meter_floor.py [--threads 1] [--repeats 15] [--compile] [--logit-scale 1]

``CalibrationMeter`` walks the logits in blocks of positions (``position_block``: about 4 MiB of
logits on the CPU). For the Cityscapes shape (one image, K = 19, 1024 x 2048, the logits of
``bench_eval.py``), this prints the per-block cost of the steps that no eager implementation of
its statistics can skip, as fractions of the target's unit: the time of ``softmax`` of the whole
logits (``bench_eval.py``'s denominator) divided by the number of blocks.

- ``read``: the block's first read from memory (``contiguous()`` of the strided block, a
  different block each time, so it comes from DRAM as in the meter);
- ``softmax``: ``torch.softmax`` of the block, from the cache (its bits are the meter's
  definition of ``p``: the bins of the tests depend on them);
- ``class-wise compare``, ``class-wise compaction``: finding the values above the first bin
  edge among the ``K`` probabilities of every position (the integer comparison and the
  ``nonzero`` of ``_classwise_rest_sums``);
- ``class totals``: the float64 per-class sums of the probabilities (bin 0's sum is their total
  minus the other bins);
- with ``--compile``: the class-wise bin sums as one inductor kernel instead (14 cumulative
  float64 sums in one read of the block, no compaction), what a compiled meter would pay.

The sum of the first rows is a lower bound on the meter's cost before any top-label statistic
(confidence, arg-max, NLL, Brier, the histograms); the target is 2. Times are the fastest of
``--repeats`` (process CPU time with one thread, wall clock otherwise), the header names the CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path


def _bench_eval():
    """benchmarks/bench_eval.py (its logits and its device description), loaded by path."""
    path = Path(__file__).resolve().with_name("bench_eval.py")
    spec = importlib.util.spec_from_file_location("bench_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="also time the inductor kernel")
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="a small shape (smoke test)")
    args = parser.parse_args(argv)
    import torch

    from cals_seg.metrics.calibration import _above
    from cals_seg.metrics.functional import BLOCK_ELEMENTS, _edge_thresholds, position_block

    bench_eval = _bench_eval()
    describe, make_batch = bench_eval.describe, bench_eval.make_batch
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    k, h, w = (5, 64, 96) if args.quick else (19, 1024, 2048)
    logits, _, _ = make_batch(k, h, w, torch.device("cpu"))
    logits = logits.mul_(args.logit_scale).reshape(1, k, h * w)
    block = min(position_block(logits, BLOCK_ELEMENTS), h * w)
    starts = list(range(0, h * w - block + 1, block))
    t1 = _edge_thresholds(15, torch.float32)[0]
    thresholds = _edge_thresholds(15, torch.float32)

    def best(fn, cold: bool = False) -> float:
        fn(0)
        times = []
        for i in range(args.repeats):
            j = (i + 1) % len(starts) if cold else 0
            start = clock()
            fn(j)
            times.append(clock() - start)
        return min(times)

    with torch.no_grad():
        whole = best(lambda _: logits.softmax(dim=1))
        x = logits[:, :, :block].contiguous()
        p = x.softmax(dim=1)
        q = p.scatter(1, p.argmax(dim=1, keepdim=True), 0.0)  # the arg-max taken out
        mask = _above(q, t1)
        rows = {
            "read": best(lambda j: logits[:, :, starts[j]:starts[j] + block].contiguous(),
                         cold=True),
            "softmax": best(lambda _: x.softmax(dim=1)),
            "class-wise compare": best(lambda _: _above(q, t1)),
            "class-wise compaction": best(lambda _: mask.nonzero(as_tuple=True)),
            "class totals": best(lambda _: q.sum(dim=2, dtype=torch.float64)),
        }
        if args.compile:
            def cumulative(v):
                v64 = v.to(torch.float64)
                return torch.stack([torch.where(v > t, v64, 0.0).sum(dim=2) for t in thresholds])

            kernel = torch.compile(cumulative, dynamic=False)
            rows["(compiled: the class-wise sums in one kernel)"] = best(lambda _: kernel(q))
    unit = whole * block / (h * w)
    print(f"meter_floor: {describe('cpu')}, {args.threads} thread(s), logits x "
          f"{args.logit_scale:g}; torch {torch.__version__}")
    print(f"softmax of the whole logits: {whole * 1e3:.1f} ms; {len(starts)} blocks of {block} "
          f"positions; unit = {unit * 1e3:.3f} ms per block")
    print("| step (per block) | ms | in softmaxes |")
    print("|---|---:|---:|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1e3:.3f} | {seconds / unit:.2f} |")
    eager = [rows[n] for n in ("read", "softmax", "class-wise compare",
                               "class-wise compaction", "class totals")]
    print(f"| lower bound, eager (the five rows) | {sum(eager) * 1e3:.3f} | "
          f"{sum(eager) / unit:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
