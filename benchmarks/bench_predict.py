"""Peak memory and time per megapixel of ``tools/predict_seg.py`` on a folder of JPEGs.

    python benchmarks/bench_predict.py                       # whole, slide, resize 1024
    python benchmarks/bench_predict.py --modes slide --run runs/<name> --threads 2

Generates, in a temporary folder, JPEGs of 4000 x 3000 (a phone photo) and three of 500 x 375
(VOC-sized), and, unless ``--run`` names a trained run, a run directory with the study's model
(``configs/synthetic_deeplabv3.yaml``: DeepLabV3-ResNet18, random weights: the time does not
depend on them). For each protocol it runs ``predict_seg`` in a fresh process, checks that every
output was written, and prints per image the seconds (reading, network, writing the four files)
and seconds per megapixel, and the peak resident memory of the process (``getrusage``: the
largest RSS, model and imports included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SIZES = [(4000, 3000), (500, 375), (500, 375), (375, 500)]  # (width, height)
PROTOCOLS = {
    "whole": [],  # the run's eval section: the synthetic study's is whole images, no resize
    "slide": ["--mode", "slide", "--window", "512", "--stride", "341"],
    "resize": ["--resize", "1024"],
}


def make_images(folder: Path, seed: int = 0) -> list[Path]:
    """Smooth random colour fields with edges (JPEG-compressible like photos)."""
    rng = np.random.default_rng(seed)
    paths = []
    for i, (w, h) in enumerate(SIZES):
        coarse = rng.integers(0, 256, (max(2, h // 100), max(2, w // 100), 3), dtype=np.uint8)
        image = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_CUBIC)
        image = cv2.add(image, rng.integers(0, 24, (h, w, 3), dtype=np.uint8))
        path = folder / f"img{i}_{w}x{h}.jpg"
        cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        paths.append(path)
    return paths


def make_run(folder: Path) -> Path:
    """A run directory with the study's config and a random-weight checkpoint."""
    import torch

    from cals_seg.config.schema import load_config, save_config
    from cals_seg.runs.run import Run
    from cals_seg.tasks.segmentation import build_model

    cfg = load_config(ROOT / "configs" / "synthetic_deeplabv3.yaml", [], "ce")
    run = folder / "run"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    torch.manual_seed(0)
    torch.save({"model": build_model(cfg).state_dict(), "num_classes": cfg.data.num_classes,
                "epoch": 0}, run / "checkpoint_best.pt")
    Run(run).write_temperature(1.0)
    return run


def run_predict(run: Path, images: Path, out: Path, extra: list[str]) -> tuple[float, int, int]:
    """``(wall seconds, peak RSS in bytes, exit status)`` of one predict_seg process."""
    cmd = [sys.executable, str(ROOT / "tools" / "predict_seg.py"), str(run), str(images),
           "--out", str(out), "--no-progress", *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - start, usage.ru_maxrss * 1024, proc.returncode  # KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--run", default=None, help="a trained run (default: random weights)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (--set)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    extra = ["--device", args.device]
    if args.threads:
        extra += ["--set", f"train.threads={args.threads}"]
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
          f"device {args.device}, threads {args.threads or 'torch default'}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "images").mkdir()
        images = make_images(tmp / "images")
        run = Path(args.run) if args.run else make_run(tmp)
        for mode in args.modes:
            out = tmp / f"out_{mode}"
            wall, rss, rc = run_predict(run, tmp / "images", out, [*extra, *PROTOCOLS[mode]])
            if rc != 0:
                print(f"{mode}: predict_seg failed with exit status {rc}")
                return 1
            lines = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
            missing = [p for x in lines for p in x["outputs"].values() if not Path(p).is_file()]
            assert len(lines) == len(images) and not missing, missing
            print(f"\n{mode} ({' '.join(PROTOCOLS[mode]) or 'the run eval section'}): "
                  f"peak RSS {rss / 2**20:.0f} MiB, process wall time {wall:.1f} s")
            print("| image | megapixels | seconds | s / megapixel |\n|---|---:|---:|---:|")
            for x in lines:
                mp = x["width"] * x["height"] / 1e6
                print(f"| {Path(x['input']).name} | {mp:.2f} | {x['seconds']:.2f} | "
                      f"{x['seconds'] / mp:.2f} |")
            mp = sum(x["width"] * x["height"] for x in lines) / 1e6
            seconds = sum(x["seconds"] for x in lines)
            print(f"| all {len(lines)} | {mp:.2f} | {seconds:.2f} | {seconds / mp:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
