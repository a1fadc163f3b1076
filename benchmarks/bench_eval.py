"""Evaluation cost at the size of Cityscapes and ADE20K, as ratios to ``softmax``.

    python benchmarks/bench_eval.py [--threads 1] [--repeats 3] [--device cpu|cuda] [--quick]
        [--shapes cityscapes ade20k] [--no-loop] [--clock wall|cpu]

For a Cityscapes-shaped batch (one image, K = 19, 1024 x 2048) and an ADE20K-shaped one (one
image, K = 150, 512 x 683), in one run: each meter's ``update`` and each calibrator's ``apply``
(its forward), as the ratio of its median time to the median time of ``softmax`` of the same
logits (the one pass over the logits no evaluation avoids) and, steadier on a machine whose speed
drifts, "paired": the median over rounds of its time over the softmax's in the same round (the
two alternate; the ``TARGET`` lines use it), and its peak extra memory as a
multiple of the logits tensor's size; then, for the same rows, the cost in copies of the logits
(``logits.clone()``, timed in the same run: the least a pass over the logits costs), with the
CPU named by its model and the instruction set of torch's kernels; then the whole evaluation
loop (a DeepLabV3 ResNet-18 forward, the image padded to sides divisible by 8, + every meter's
update) in images per second.

Peak extra memory: on CUDA ``max_memory_allocated`` minus the allocation before the call; on
the CPU the largest resident set seen by a sampling thread (every 0.5 ms, from
``/proc/self/statm``) minus the resident set before the call, with the freed pages of the
previous call returned to the system first (``malloc_trim``). It is an estimate on the CPU: a
short-lived temporary can fall between two samples.

The region meters (``BoundaryCalibrationMeter``, ``ObjectSizeCalibrationMeter``) get three
rows: ``update`` computing the ground-truth analysis itself, ``update`` given it
(``groups=``, what the evaluation's main process does when the loader makes the maps), and the
analysis alone (``group_fn`` on each mask, on the CPU: the loader's share).

Calibrators are applied with their parameters as built (the apply cost does not depend on the
fitted values), but ``selective`` gets ``T_mis = 2`` (at 1 it returns the logits untouched).
Each item gets a warm-up call first. ``--logit-scale S`` multiplies the logits: at 1 (the
default) the confidence is about 0.4 almost everywhere; at 4, two thirds of the positions have
a confidence above 14 / 15, closer to a trained network's. ``--quick`` runs tiny shapes once
each (a smoke test: its numbers mean nothing). ``--clock cpu`` times with the process's CPU
time (one thread, CPU only), which other jobs on a shared machine disturb far less than the
wall clock.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable

SHAPES = {"cityscapes": (19, 1024, 2048), "ade20k": (150, 512, 683)}
QUICK_SHAPES = {"cityscapes": (5, 32, 48), "ade20k": (12, 24, 30)}
METERS = ["CalibrationMeter", "SegmentationMeter", "BoundaryCalibrationMeter",
          "ObjectSizeCalibrationMeter"]
CALIBRATORS = ["ts", "vector", "dirichlet", "selective", "boundary_ts", "lts"]
COPY = "copy (logits.clone())"  # the bound: one read and one write of the logits


def make_batch(k: int, h: int, w: int, device, seed: int = 0):
    """Blocky class map plus noise (so that there are boundaries, objects and errors)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    cell = max(min(h, w) // 16, 1)
    coarse = torch.randint(0, k, (1, 1, -(-h // cell), -(-w // cell)), generator=g).float()
    regions = F.interpolate(coarse, scale_factor=cell, mode="nearest")[:, 0, :h, :w].long()
    logits = torch.randn(1, k, h, w, generator=g)
    logits.scatter_add_(1, regions.unsqueeze(1), torch.full((1, 1, h, w), 3.0))
    target = torch.where(torch.rand(1, h, w, generator=g) < 0.9, regions,
                         torch.randint(0, k, (1, h, w), generator=g))
    target[:, :, : max(w // 64, 1)] = 255  # a void strip
    image = torch.randn(1, 3, h, w, generator=g)
    return logits.to(device), target.to(device), image.to(device)


class PeakMemory:
    """Peak extra memory of a call, in bytes (see the module docstring)."""

    def __init__(self, device) -> None:
        self.device = device
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def measure(self, fn: Callable[[], object]) -> float | None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - base)
        if not os.path.exists("/proc/self/statm"):
            return None
        if self.libc is not None:
            self.libc.malloc_trim(0)
        base = self._rss()
        peak = [base]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], self._rss())
                time.sleep(0.0005)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        fn()
        peak[0] = max(peak[0], self._rss())
        done.set()
        t.join()
        return float(peak[0] - base)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn: Callable[[], object], repeats: int, device, clock: str = "wall") -> float:
    """Median seconds of ``repeats`` calls after one warm-up call (``clock="cpu"``: the
    process's CPU time, which other jobs on a shared machine disturb far less; CPU only)."""
    import torch

    now = CLOCKS[clock]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        sync()
        times.append(now() - start)
    return statistics.median(times)


def timed_pair(fn: Callable[[], object], ref: Callable[[], object], repeats: int, device,
               clock: str = "wall") -> tuple[float, float]:
    """``(median seconds of fn, median over rounds of fn's time / ref's time in that round)``:
    ``fn`` and ``ref`` alternate (the order reversed every other round) after one warm-up call
    each, so a slow drift of the machine's speed affects both sides of each ratio alike."""
    import torch

    now = CLOCKS[clock]

    def once(f: Callable[[], object]) -> float:
        start = now()
        f()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return now() - start

    once(fn)
    once(ref)
    mine, ratios = [], []
    for i in range(repeats):
        if i % 2 == 0:
            t, r = once(fn), once(ref)
        else:
            r, t = once(ref), once(fn)
        mine.append(t)
        ratios.append(t / r if r > 0 else float("nan"))
    return statistics.median(mine), statistics.median(ratios)


def build_meters(k: int, meter_names: list[str]):
    from cals_seg import metrics

    return {name: getattr(metrics, name)(num_classes=k, ignore_index=255) for name in meter_names}


def build_calibrators(k: int, names: list[str], device):
    from cals_seg.calibrators import build_calibrator

    cals = {name: build_calibrator(name, k).to(device).eval() for name in names}
    if "selective" in cals:  # at T = 1 it returns the logits as they are: apply its classifier
        cals["selective"].temperature.fill_(2.0)
    return cals


def bench_shape(label: str, k: int, h: int, w: int, args, device, mem: PeakMemory) -> list[dict]:
    import torch

    logits, target, image = make_batch(k, h, w, device)
    logits.mul_(args.logit_scale)
    size = logits.numel() * logits.element_size()
    rows = []

    def softmax() -> object:
        return logits.softmax(dim=1)

    def row(name: str, fn: Callable[[], object]) -> dict:
        with torch.no_grad():
            seconds, paired = timed_pair(fn, softmax, args.repeats, device, args.clock)
            peak = mem.measure(fn)
        return {"shape": label, "name": name, "seconds": seconds, "paired": paired,
                "peak_logits": None if peak is None else peak / size}

    rows.append(row(COPY, logits.clone))
    base = row("softmax", softmax)
    rows.append(base)
    for name, meter in build_meters(k, args.meters).items():
        rows.append(row(name, lambda m=meter: m.update(logits, target)))
        if hasattr(meter, "group_fn"):  # a region meter: its analysis made by the loader
            fn, masks = meter.group_fn(), target.cpu().numpy()
            groups = meter.group_map(target).to(device)
            rows.append(row(f"{name} (groups given)",
                            lambda m=meter, g=groups: m.update(logits, target, groups=g)))
            rows.append(row(f"{name}: analysis in the loader",
                            lambda f=fn, ms=masks: [f(mask) for mask in ms]))
    for name, cal in build_calibrators(k, args.calibrators, device).items():
        rows.append(row(f"apply {name}", lambda c=cal: c(logits, image)))
    for r in rows:
        r["ratio"] = r["seconds"] / base["seconds"]
        r["copies"] = r["seconds"] / rows[0]["seconds"]
    return rows


def bench_loop(k: int, h: int, w: int, args, device) -> float:
    """Images per second of the evaluation loop: network forward + every meter's update."""
    import torch

    from cals_seg.models.segmentation import build_segmentation_model

    model = build_segmentation_model("deeplabv3", "resnet18", None, k).to(device).eval()
    _, target, image = make_batch(k, h, w, device)
    meters = build_meters(k, args.meters)

    pad_h, pad_w = -h % 8, -w % 8  # the network needs sides divisible by 8: pad, then crop
    image = torch.nn.functional.pad(image, (0, pad_w, 0, pad_h))

    def step() -> None:
        with torch.no_grad():
            out = model(image)[..., :h, :w]
            for meter in meters.values():
                meter.update(out, target)

    seconds = timed(step, args.loop_repeats, device, args.clock)
    return 1.0 / seconds


def describe(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and cores
    (``cals_seg.training.study.describe_machine``) with the instruction set of torch's kernels
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` run the AVX2 kind of the machine)."""
    import torch

    from cals_seg.training.study import describe_machine

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{describe_machine()}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", default="wall", choices=list(CLOCKS),
                        help="cpu: process CPU time (use with --threads 1 on a shared machine)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--meters", nargs="*", default=METERS, choices=METERS)
    parser.add_argument("--calibrators", nargs="*", default=CALIBRATORS, choices=CALIBRATORS)
    parser.add_argument("--logit-scale", type=float, default=1.0,
                        help="multiply the logits (4: two thirds of the positions with a "
                             "confidence above 14/15, as a trained network's; 1: about none)")
    parser.add_argument("--no-loop", action="store_true", help="skip the evaluation loop")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one repeat (smoke)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.quick:
        args.repeats = args.loop_repeats = 1
    where = describe(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu times the host only: use it with --device cpu")
    print(f"bench_eval: {where}, {args.threads} thread(s), {args.device}, {args.clock} clock, "
          f"median of {args.repeats}; torch {torch.__version__}; logits x {args.logit_scale:g}")
    mem = PeakMemory(device)
    results = {label: bench_shape(label, *shapes[label], args, device, mem)
               for label in args.shapes}
    names = [r["name"] for r in results[args.shapes[0]]]
    heads = [f"{label} (K {shapes[label][0]}, {shapes[label][1]} x {shapes[label][2]})"
             for label in args.shapes]
    print()
    print("| update / apply | " + " | ".join(f"{h} x softmax | paired | peak / logits"
                                             for h in heads) + " |")
    print("|---|" + "---:|---:|---:|" * len(heads))
    for i, name in enumerate(names):
        cells = []
        for label in args.shapes:
            r = results[label][i]
            ratio = f"{r['seconds'] * 1e3:.1f} ms" if name == "softmax" else f"{r['ratio']:.2f}"
            peak = "n/a" if r["peak_logits"] is None else f"{r['peak_logits']:.2f}"
            cells.append(f"{ratio} | {r['paired']:.2f} | {peak}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("| in copies of the logits (logits.clone()) | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for i, name in enumerate(names[1:], start=1):
        cells = [f"{results[label][i]['copies']:.2f}" for label in args.shapes]
        print(f"| {name}, copies | " + " | ".join(cells) + " |")
    limits = {"CalibrationMeter": 2.0, "apply boundary_ts": 1.5, "apply lts": 5.0,
              "BoundaryCalibrationMeter (groups given)": 1.0,
              "ObjectSizeCalibrationMeter (groups given)": 1.0}
    for label in args.shapes:
        for r in results[label]:
            if r["name"] in limits:
                limit = limits[r["name"]]
                print(f"TARGET | eval {label}: {r['name']} time / softmax | {r['paired']:.4g} | "
                      f"<= {limit:g} | {'MET' if r['paired'] <= limit else 'NOT MET'}")
            if r["name"] in args.meters and r["peak_logits"] is not None:
                met = r["peak_logits"] <= 2.0
                print(f"TARGET | eval {label}: {r['name']} peak extra memory / logits | "
                      f"{r['peak_logits']:.4g} | <= 2 | {'MET' if met else 'NOT MET'}")
    if not args.no_loop:
        print()
        print("| evaluation loop (DeepLabV3 ResNet-18 forward + every meter) | images / s |")
        print("|---|---:|")
        for label in args.shapes:
            ips = bench_loop(*shapes[label], args, device)
            print(f"| {label} | {ips:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
