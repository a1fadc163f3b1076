"""Throughput and peak memory of the streaming meters against torchmetrics, on CPU or CUDA.

    python benchmarks/bench_metrics.py [--pixels 1e7 1e8] [--batch 8 21 512 512] [--threads 1]
        [--device cpu|cuda]
    python benchmarks/bench_metrics.py --quick

``--device cuda``: the two batches live on the GPU, both sides run there, each timed region is
closed by ``torch.cuda.synchronize()``, and peak memory is ``torch.cuda.max_memory_allocated``
(reset after the batches exist, so "above setup" is what the metrics add); the pinned-malloc runs
are skipped (they concern the CPU heap). A ``TARGET`` line per configuration states the target:
our two meters together at least 5x torchmetrics' throughput at the same pixel count, and one
more per pixel count at least 2x with the class-wise ECE on (``ours cw=True``).

Each configuration streams VOC-sized batches of 21-class logits (8 x 21 x 512 x 512 = 2.1e6
pixels, 5% void) through update() until the pixel budget is reached, then calls compute():

- ``ours cw=False``: ``CalibrationMeter(classwise=False)`` + ``SegmentationMeter``
- ``ours cw=True``:  ``CalibrationMeter(classwise=True)`` + ``SegmentationMeter``
- ``torchmetrics``:  ``MulticlassCalibrationError(num_classes=21, n_bins=15, norm="l1")`` +
  ``MulticlassJaccardIndex(num_classes=21)`` (both with ``ignore_index=255``), fed
  ``softmax(logits)`` of the same batches (the softmax is timed on both sides; our meters take
  logits and apply it themselves).

Three more configurations time the region meter against the calibration meter on label maps
with spatial structure (square objects of 16 x 16 pixels with random classes, 5% of them void,
so that boundaries, bands and components look like a segmentation mask's; the logits are the
same as above):

- ``calibration``: ``CalibrationMeter(classwise=False)`` alone
- ``boundary``:    ``BoundaryCalibrationMeter`` (bands 3 and 8 pixels) alone
- ``size``:        ``ObjectSizeCalibrationMeter`` (COCO areas, background class 0) alone

and a ``RATIO`` line per pixel count gives the boundary (and size) meter's throughput as a
fraction of ``calibration``'s in the same run.

The bound: a ``copy`` configuration streams the same batches through ``logits.clone()`` (one
read and one write of the logits, the least a pass over them costs); "copies" is each
configuration's time in copies. The header names the CPU and the instruction set of torch's
kernels (or the GPU).

torchmetrics is NOT a dependency of cals_seg; when it is not installed its column is skipped
(``pip install torchmetrics==1.9.0`` to add it).

Every configuration runs in a fresh subprocess (``--repeats`` times, interleaved, since other
work on the machine shifts timings). Two batches are generated up front and reused
in turn, so generation is excluded from the time and costs the same memory everywhere. Time
covers one warm-up update on a batch plus a reset excluded, then all updates and the final
compute(). Peak memory is the child's ``ru_maxrss`` (the whole process: Python, torch, the two
pre-generated batches, the meter states and temporaries); "above setup" is its growth after the
batches exist (warm-up included), i.e. what the metrics themselves add at their high-water mark:
update temporaries and states for ours, plus the stored per-pixel values for torchmetrics.

With glibc's default malloc the peak RSS of identical runs differs by up to ~10%: blocks of
128 KiB..32 MiB (our per-position temporaries are 2-16 MiB) are served from a heap whose freed
holes stay resident, and how much it retains depends on placement. Each configuration is
therefore also run once with ``MALLOC_MMAP_THRESHOLD_=131072`` (every such block mmap-ed and
returned when freed): that peak follows live memory and is the one to compare across pixel
counts (``--no-pinned`` skips these runs). Times come from the default-malloc runs only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time

import torch

CONFIGS = ["ours cw=False", "ours cw=True", "torchmetrics", "calibration", "boundary", "size",
           "copy"]
REGION_CONFIGS = ("calibration", "boundary", "size")  # timed on label maps with objects
VOID = 255
TM_LIMIT_GB = 12.0  # skip torchmetrics where its estimated memory is above this


def describe(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and cores
    (``cals_seg.training.study.describe_machine``) with the instruction set of torch's kernels
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` run the AVX2 kind of the machine)."""
    from cals_seg.training.study import describe_machine

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{describe_machine()}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def make_batches(shape: list[int], count: int = 2, device: str = "cpu",
                 objects: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Logits informative on ~70% of the positions (so confidences spread over the bins).

    ``objects``: the target is made of 16 x 16 squares of one class (5% of them void) instead
    of independent pixels (5% void)."""
    g = torch.Generator().manual_seed(0)
    n, k, h, w = shape
    out = []
    for _ in range(count):
        target = torch.randint(0, k, (n, h, w), generator=g)
        logits = torch.empty(shape).normal_(0.0, 2.0, generator=g)
        boost = (torch.rand(n, h, w, generator=g) < 0.7).float() * 4.0
        logits.scatter_add_(1, target.unsqueeze(1), boost.unsqueeze(1))
        if objects:
            coarse = torch.randint(0, k, (n, -(-h // 16), -(-w // 16)), generator=g)
            coarse.masked_fill_(torch.rand(coarse.shape, generator=g) < 0.05, VOID)
            target = coarse.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :h, :w]
            target = target.contiguous()
        else:
            target.masked_fill_(torch.rand(n, h, w, generator=g) < 0.05, VOID)
        out.append((logits.to(device), target.to(device)))
    return out


def make_pair(config: str, k: int, device: str = "cpu"):
    """(update(logits, target), compute(), meters) of one configuration."""
    if config == "copy":  # the bound: one copy of the logits per batch
        return lambda x, y: x.clone(), lambda: None, ()
    if config in REGION_CONFIGS:
        from cals_seg.metrics import (
            BoundaryCalibrationMeter,
            CalibrationMeter,
            ObjectSizeCalibrationMeter,
        )

        meter = {
            "calibration": lambda: CalibrationMeter(k, ignore_index=VOID, classwise=False),
            "boundary": lambda: BoundaryCalibrationMeter(k, ignore_index=VOID),
            "size": lambda: ObjectSizeCalibrationMeter(k, ignore_index=VOID, background_index=0),
        }[config]().to(device)
        key = {"calibration": "ece", "boundary": "ece_band", "size": "ece_size"}[config]
        return meter.update, lambda: meter.compute()[key], (meter,)
    if config.startswith("ours"):
        from cals_seg.metrics import CalibrationMeter, SegmentationMeter

        cal = CalibrationMeter(k, n_bins=15, ignore_index=VOID, classwise=config.endswith("True"))
        seg = SegmentationMeter(k, ignore_index=VOID)
        cal, seg = cal.to(device), seg.to(device)

        def update(x: torch.Tensor, y: torch.Tensor) -> None:
            cal.update(x, y)
            seg.update(x, y)

        return update, lambda: (cal.compute()["ece"], seg.compute()["miou"]), (cal, seg)
    from torchmetrics.classification import MulticlassCalibrationError, MulticlassJaccardIndex

    ce = MulticlassCalibrationError(num_classes=k, n_bins=15, norm="l1", ignore_index=VOID)
    ji = MulticlassJaccardIndex(num_classes=k, ignore_index=VOID)
    ce, ji = ce.to(device), ji.to(device)

    def update_tm(x: torch.Tensor, y: torch.Tensor) -> None:
        p = torch.softmax(x, dim=1)
        ce.update(p, y)
        ji.update(p, y)

    return update_tm, lambda: (float(ce.compute()), float(ji.compute())), (ce, ji)


def child(config: str, pixels: float, shape: list[int], device: str = "cpu") -> dict:
    """One configuration in this (fresh) process; returns timings and memory as a dict."""
    cuda = device.startswith("cuda")
    batches = make_batches(shape, device=device, objects=config in REGION_CONFIGS)
    per_batch = shape[0] * shape[2] * shape[3]
    steps = max(1, math.ceil(pixels / per_batch))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        setup = torch.cuda.memory_allocated() / 2**20  # the two batches
    else:
        setup = _maxrss_mb()  # Python + torch + the two batches
    update, compute, meters = make_pair(config, shape[1], device)
    update(*batches[0])  # warm-up (lazy initialisation, not timed), then start from empty states
    for m in meters:
        m.reset()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        update(*batches[i % len(batches)])
    values = compute()  # returns Python floats: a device synchronisation
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _maxrss_mb()
    return {"config": config, "pixels": steps * per_batch, "seconds": seconds,
            "setup_mb": setup, "peak_mb": peak, "values": values}


def tm_estimate_gb(pixels: float, shape: list[int]) -> float:
    """torchmetrics keeps a float32 confidence and a float32 accuracy per valid pixel and
    concatenates them at compute() (x2), plus the batches and per-batch temporaries."""
    batch = shape[0] * shape[1] * shape[2] * shape[3] * 4
    return (pixels * 8 * 2 + 6 * batch) / 1e9


def run_child(config: str, pixels: float, shape: list[int], threads: int | None,
              pinned: bool = False, device: str = "cpu") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--pixels", str(pixels),
           "--batch", *map(str, shape), "--device", device]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ)
    if pinned:
        # A fixed threshold turns off glibc's dynamic one: every block >= 128 KiB is mmap-ed and
        # unmapped when freed, so RSS follows live memory instead of what the heap retains.
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _merge(best: dict | None, r: dict) -> dict:
    """Fastest time and largest peak over repeats."""
    if best is None:
        return r
    out = dict(r, seconds=min(r["seconds"], best["seconds"]))
    if best["peak_mb"] > r["peak_mb"]:
        out["peak_mb"], out["setup_mb"] = best["peak_mb"], best["setup_mb"]
    return out


# Not split (over 80 lines): a benchmark script that reads top to bottom, as nanoGPT's.
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pixels", type=float, nargs="+", default=[1e7, 1e8])
    ap.add_argument("--batch", type=int, nargs=4, default=[8, 21, 512, 512],
                    metavar=("N", "K", "H", "W"))
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per configuration, interleaved; the table shows the fastest time "
                    "and the largest peak")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads in every child (default: torch's default)")
    ap.add_argument("--no-pinned", action="store_true",
                    help="skip the memory runs with glibc's mmap threshold pinned")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2e6 and 8e6 pixels in batches of 4x21x256x256")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.pixels[0], args.batch, args.device)))
        return
    if args.quick:
        args.pixels, args.batch = [2e6, 8e6], [4, 21, 256, 256]
    cuda = args.device.startswith("cuda")
    if cuda:
        args.no_pinned = True  # the pinned-malloc runs concern the CPU heap

    have_tm = importlib.util.find_spec("torchmetrics") is not None
    print(f"torch {torch.__version__}, threads per child: {args.threads or torch.get_num_threads()}"
          f", batch {'x'.join(map(str, args.batch))}, {describe(args.device)}")
    if not have_tm:
        print("torchmetrics is not installed (it is not a dependency of cals_seg): its column is "
              "skipped. `pip install torchmetrics==1.9.0` to compare.")
    rows: dict[tuple[float, str], dict | str] = {}
    pinned: dict[tuple[float, str], dict] = {}
    for pixels in args.pixels:
        for repeat in range(args.repeats):
            for config in CONFIGS:
                if config == "torchmetrics":
                    if not have_tm:
                        rows[pixels, config] = "skipped: torchmetrics not installed"
                        continue
                    gb = tm_estimate_gb(pixels, args.batch)
                    if gb > TM_LIMIT_GB * (4 if cuda else 1):
                        rows[pixels, config] = f"skipped: would need ~{gb:.0f} GB (> {TM_LIMIT_GB})"
                        continue
                r = run_child(config, pixels, args.batch, args.threads, device=args.device)
                print(f"  run {repeat + 1}: {config:14s} {r['pixels']:.3g} px: "
                      f"{r['seconds']:.2f} s, peak {r['peak_mb']:.0f} MB", flush=True)
                best = rows.get((pixels, config))
                rows[pixels, config] = _merge(best if isinstance(best, dict) else None, r)
        for config in [] if args.no_pinned else CONFIGS:
            if isinstance(rows.get((pixels, config)), dict):
                r = pinned[pixels, config] = run_child(config, pixels, args.batch, args.threads,
                                                       pinned=True)
                print(f"  pinned malloc: {config:14s} {r['pixels']:.3g} px: "
                      f"peak {r['peak_mb']:.0f} MB", flush=True)

    peak_name = "peak CUDA memory (MiB)" if cuda else "peak RSS (MB)"
    print(f"\n| pixels | configuration | time (s) | Mpx/s | time / torchmetrics | copies "
          f"| {peak_name} | above setup | peak RSS, pinned malloc (MB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (pixels, config), r in rows.items():
        if isinstance(r, str):
            print(f"| {pixels:.0e} | {config} | {r} | | | | | | |")
            continue
        tm = rows.get((pixels, "torchmetrics"))
        ratio = f"{r['seconds'] / tm['seconds']:.2f}" if isinstance(tm, dict) else "n/a"
        cp = rows.get((pixels, "copy"))
        copies = f"{r['seconds'] / cp['seconds']:.2f}" if isinstance(cp, dict) else "n/a"
        pin = pinned.get((pixels, config))
        pin_mb = f"{pin['peak_mb']:.0f}" if pin else "n/a"
        print(f"| {r['pixels']:.3g} | {config} | {r['seconds']:.2f} | "
              f"{r['pixels'] / r['seconds'] / 1e6:.2f} | {ratio} | {copies} | {r['peak_mb']:.0f} | "
              f"{r['peak_mb'] - r['setup_mb']:.0f} | {pin_mb} |")

    if len(args.pixels) >= 2:
        lo, hi = min(args.pixels), max(args.pixels)
        print(f"\nPeak RSS at {hi:.0e} / at {lo:.0e} pixels (default malloc; pinned malloc):")
        for config in CONFIGS:
            a, b = rows.get((lo, config)), rows.get((hi, config))
            if isinstance(a, dict) and isinstance(b, dict):
                line = f"- {config}: {b['peak_mb'] / a['peak_mb']:.3f}"
                pa, pb = pinned.get((lo, config)), pinned.get((hi, config))
                if pa and pb:
                    line += (f"; {pb['peak_mb'] / pa['peak_mb']:.3f} "
                             f"({pa['peak_mb']:.0f} -> {pb['peak_mb']:.0f} MB)")
                print(line)
    for pixels in args.pixels:
        base = rows.get((pixels, "calibration"))
        for config in ("boundary", "size"):
            r = rows.get((pixels, config))
            if isinstance(r, dict) and isinstance(base, dict):
                print(f"RATIO | metrics {pixels:.0e} px: {config} meter throughput / "
                      f"CalibrationMeter(classwise=False) | {base['seconds'] / r['seconds']:.3f}")
    for pixels in args.pixels:
        tm = rows.get((pixels, "torchmetrics"))
        for config in CONFIGS[:2]:
            r = rows.get((pixels, config))
            what = f"metrics {pixels:.0e} px: {config} throughput / torchmetrics"
            if isinstance(r, dict) and isinstance(tm, dict):
                speedup = tm["seconds"] / r["seconds"]
                print(f"TARGET | {what} | {speedup:.4g} | >= 5 | "
                      f"{'MET' if speedup >= 5 else 'NOT MET'}")
            else:
                why = tm if isinstance(tm, str) else "not measured"
                print(f"TARGET | {what} | n/a | >= 5 | NOT MEASURED ({why})")
        r = rows.get((pixels, "ours cw=True"))  # issue 38: with the class-wise ECE on, >= 2x
        if isinstance(r, dict) and isinstance(tm, dict):
            speedup = tm["seconds"] / r["seconds"]
            print(f"TARGET | metrics {pixels:.0e} px: ours cw=True throughput / torchmetrics "
                  f"(class-wise on) | {speedup:.4g} | >= 2 | "
                  f"{'MET' if speedup >= 2 else 'NOT MET'}")
    lo = min(args.pixels)
    tm = rows.get((lo, "torchmetrics"))
    if isinstance(tm, dict):
        off, on = rows[lo, "ours cw=False"], rows[lo, "ours cw=True"]
        print(f"\nAt {lo:.0e} pixels: cw=False / torchmetrics = "
              f"{off['seconds'] / tm['seconds']:.2f} (requirement <= 1), cw=True / torchmetrics "
              f"= {on['seconds'] / tm['seconds']:.2f} (requirement <= 2).")


if __name__ == "__main__":
    main()
