"""Images/s of a DeepLabV3 training step with CE and with CALS-ALM, measured in the same run.

    python benchmarks/bench_train_step.py [--size 128] [--batch 8] [--classes 21] [--steps 6]
        [--encoder resnet18] [--device cpu|cuda] [--amp auto|none|bf16|fp16] [--channels-last]

One step = forward, loss, backward, AdamW step, on random images and labels with 10% void. The
two criteria alternate step by step (after warm-up) so that drift of the machine (other load,
clocks) affects both alike; the median step time of each is reported with the ratio. ``--amp
auto`` is resolved with ``cals_seg.precision.resolve_amp`` (bf16 where native, else float32)
and the resolved precision is printed. Peak memory (CUDA: ``torch.cuda.max_memory_allocated``,
reset before one extra step per criterion) is reported per criterion. The ``TARGET`` line states
the target: a CALS-ALM step at most 1.02x a CE step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cals_seg.losses import _functional as penalty_blocks
from cals_seg.losses import build_loss
from cals_seg.models import build_segmentation_model
from cals_seg.precision import AMP_CHOICES, precision_name, resolve_amp

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--classes", type=int, default=21)
    p.add_argument("--steps", type=int, default=6, help="timed steps per criterion")
    p.add_argument("--encoder", default="resnet18")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", default="none", choices=list(AMP_CHOICES),
                   help="auto: bf16 where native on the device, else float32 (resolve_amp)")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="blocks per penalty pass on an accelerator (default: the library's)")
    args = p.parse_args()
    if args.gpu_blocks is not None:
        penalty_blocks.GPU_BLOCKS = args.gpu_blocks
    print(f"# penalty blocks on an accelerator: {penalty_blocks.GPU_BLOCKS}")
    device = torch.device(args.device)
    asked = args.amp
    args.amp = resolve_amp(args.amp, device)
    print(f"# amp: {asked} -> {args.amp} ({precision_name(args.amp)} forward pass)")
    torch.manual_seed(0)
    model = build_segmentation_model("deeplabv3", args.encoder, None, args.classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda") if args.amp == "fp16" else None
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, args.classes, (args.batch, args.size, args.size), device=device)
    y[torch.rand(y.shape, device=device) < 0.1] = 255
    criteria = {"ce": build_loss("ce", args.classes, ignore_index=255).to(device),
                "cals_alm": build_loss("cals_alm", args.classes, ignore_index=255).to(device)}
    criteria["cals_alm"].lambdas.fill_(0.5)  # an active penalty, as after some epochs

    def step(criterion) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dtype = AMP.get(args.amp, torch.bfloat16)
        with torch.autocast(device.type, dtype=dtype, enabled=args.amp != "none"):
            logits = model(x)
        loss = criterion(logits, y)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for c in criteria.values():  # warm-up
        step(c)
        step(c)
    times: dict[str, list[float]] = {name: [] for name in criteria}
    for _ in range(args.steps):
        for name, c in criteria.items():
            times[name].append(step(c))
    peak: dict[str, float] = {}
    for name, c in criteria.items():
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            step(c)
            peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            peak[name] = float("nan")  # not measured on CPU
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# DeepLabV3-{args.encoder}, batch {args.batch} x 3 x {args.size} x {args.size}, "
          f"{args.classes} classes, {dev}, {torch.get_num_threads()} threads, amp={args.amp}, "
          f"channels_last={args.channels_last}, torch {torch.__version__}")
    print("| criterion | step (ms, median) | images/s | time / CE | peak memory (MiB) |")
    print("|---|---:|---:|---:|---:|")
    ce = statistics.median(times["ce"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {args.batch / med:.1f} | {med / ce:.3f}x | "
              f"{peak[name]:.0f} |")
    ratio = statistics.median(times["cals_alm"]) / ce
    print(f"TARGET | train step ({args.amp}): cals_alm step time / ce | {ratio:.4g} | <= 1.02 | "
          f"{'MET' if ratio <= 1.02 else 'NOT MET'}")


if __name__ == "__main__":
    main()
