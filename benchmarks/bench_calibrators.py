"""Fit and apply time per megapixel, and peak memory, of each post-hoc calibrator.

    python benchmarks/bench_calibrators.py [--names ts boundary_ts] [--images 5]
        [--fit-size 512 512] [--height 1024 --width 2048] [--classes 19] [--threads 1]
        [--device cpu|cuda]

Validation: ``--images`` random logits maps of ``--fit-size H W`` (blocky class maps plus
noise, labels drawn from a softened softmax, so that there are boundaries and errors), held in
memory and streamed in batches of one image (the network's forward pass is NOT included: this is
the calibrator's own cost, per megapixel of validation). Apply: one ``height x width`` image
(default 2048 x 1024). Each calibrator runs in a fresh
process; the peak memory is the process' largest resident set (``getrusage``) minus the RSS after
the data was made (on CUDA, ``max_memory_allocated`` minus the data). ``lts`` and ``selective``
run their default epochs (early stopping may end them sooner); ``vector`` / ``dirichlet`` their
L-BFGS to convergence (at most ``max_iter`` passes). One copy of the apply image's logits
(``logits.clone()``, the least a pass over them costs) is timed in the same process: "apply
(copies)" is the apply time in copies; the header names the CPU and the instruction set of
torch's kernels (or the GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["ts", "vector", "dirichlet", "lts", "selective", "boundary_ts"]


def make_data(n: int, k: int, h: int, w: int, device, seed: int = 0):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    coarse = torch.randint(0, k, (n, 1, h // 64, w // 64), generator=g).float()
    regions = F.interpolate(coarse, size=(h, w), mode="nearest")[:, 0].long()
    logits = 3.0 * F.one_hot(regions, k).permute(0, 3, 1, 2).float()
    logits += torch.randn(n, k, h, w, generator=g)
    target = torch.empty(n, h, w, dtype=torch.long)
    for i in range(n):  # labels from softmax(logits / 1.5): the raw logits are over-confident
        p = (logits[i] / 1.5).softmax(dim=0).movedim(0, -1).reshape(-1, k)
        target[i] = torch.multinomial(p, 1, generator=g).view(h, w)
    image = torch.randn(n, 3, h, w, generator=g)
    return logits.to(device), target.to(device), image.to(device)


def describe(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and cores
    (``cals_seg.training.study.describe_machine``) with the instruction set of torch's kernels
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` run the AVX2 kind of the machine)."""
    import torch

    from cals_seg.training.study import describe_machine

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{describe_machine()}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


def copy_seconds(logits, sync) -> float:
    """Fastest of three copies of ``logits`` after a warm-up one (the bound of the apply)."""
    best = float("inf")
    for _ in range(4):
        sync()
        start = time.perf_counter()
        logits.clone()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(name: str, args: argparse.Namespace) -> dict:
    import torch

    from cals_seg.calibrators import build_calibrator

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    fh, fw = args.fit_size
    logits, target, image = make_data(args.images, args.classes, fh, fw, device)
    test, _, test_image = make_data(1, args.classes, args.height, args.width, device, seed=1)
    base = rss_mib()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    cal = build_calibrator(name, args.classes).to(device)

    def batches():
        return ((logits[i:i + 1], target[i:i + 1], image[i:i + 1]) for i in range(args.images))

    start = time.perf_counter()
    info = cal.fit(batches, ignore_index=255)
    if device.type == "cuda":
        torch.cuda.synchronize()
    fit_s = time.perf_counter() - start
    fit_peak = rss_mib() - base
    with torch.no_grad():
        cal(test[..., :64, :64], test_image[..., :64, :64])  # warm-up
        start = time.perf_counter()
        cal(test, test_image)
        if device.type == "cuda":
            torch.cuda.synchronize()
        apply_s = time.perf_counter() - start

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    copy_s = copy_seconds(test, sync)
    mp = args.height * args.width / 1e6
    out = {
        "name": name, "fit_s": fit_s, "fit_s_per_mp": fit_s / (fh * fw / 1e6 * args.images),
        "apply_s": apply_s, "apply_s_per_mp": apply_s / mp, "apply_copies": apply_s / copy_s,
        "peak_extra_rss_mib": rss_mib() - base, "fit_peak_extra_rss_mib": fit_peak,
        "passes": info.get("passes") or (info.get("epochs_run", 0) + 1),
    }
    if device.type == "cuda":
        out["peak_gpu_extra_mib"] = (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", nargs="+", default=NAMES, choices=NAMES)
    parser.add_argument("--images", type=int, default=5)
    parser.add_argument("--fit-size", type=int, nargs=2, default=[512, 512], metavar=("H", "W"))
    parser.add_argument("--height", type=int, default=1024)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=19)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child, args)))
        return 0
    print(f"{describe(args.device)}, {args.threads} thread(s), "
          f"{args.device}; fit on {args.images} images of {args.fit_size[1]} x "
          f"{args.fit_size[0]}, apply on one of {args.width} x {args.height}; K = {args.classes}")
    print("| calibrator | fit s | fit s / MP | passes | apply s / MP | apply (copies) "
          "| peak extra memory MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    for name in args.names:
        res = subprocess.run([sys.executable, __file__, *base, "--child", name],
                             capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            print(f"| {name} | failed: {res.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        mem = r.get("peak_gpu_extra_mib", r["peak_extra_rss_mib"])
        print(f"| {name} | {r['fit_s']:.1f} | {r['fit_s_per_mp']:.3f} | {r['passes']} | "
              f"{r['apply_s_per_mp']:.3f} | {r['apply_copies']:.2f} | {mem:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
