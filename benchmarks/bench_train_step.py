"""Images/s of a DeepLabV3 training step with CE and with CALS-ALM, measured in the same run.

    python benchmarks/bench_train_step.py [--size 128] [--batch 8] [--classes 21] [--steps 6]
        [--encoder resnet18] [--device cpu|cuda] [--amp auto|none|bf16|fp16] [--channels-last]
        [--compile [BACKEND]]

One step = forward, loss, backward, AdamW step, on random images and labels with 10% void. The
two criteria alternate step by step (after warm-up) so that drift of the machine (other load,
clocks) affects both alike; the median step time of each is reported with the ratio. ``--amp
auto`` is resolved with ``cals_seg.utils.precision.resolve_amp`` (bf16 where native, else float32)
and the resolved precision is printed. Peak memory (CUDA: ``torch.cuda.max_memory_allocated``,
reset before one extra step per criterion) is reported per criterion. A copy of a logits-sized
float32 tensor (``clone``) is timed in the same turns: "over CE (copies)" is what a criterion's
step adds to CE's, in copies of the logits (the loss's own cost against the memory limit); the
CPU is named with the instruction set of torch's kernels. The ``TARGET`` line states the target:
a CALS-ALM step at most 1.02x a CE step.

The criteria run with ``deferred_checks`` as in the trainer (the label check stays on the
device). ``--compile`` adds the step of ``train.compile``: the model and each criterion
``torch.compile``-d separately (one compiled model shared by both criteria), timed in the same
turns as the eager steps; "time / CE" of a compiled row is its ratio to the compiled CE step,
"compile (s)" the first compiled step less the median one (the model's compilation counts in
the first criterion's row), and a second ``TARGET`` line states the compiled ratio.
"""

from __future__ import annotations

import argparse
import getpass
import os
import statistics
import tempfile
import time

import torch

from cals_seg.losses import _functional as penalty_blocks
from cals_seg.losses import build_loss
from cals_seg.models import build_segmentation_model
from cals_seg.training.study import describe_machine
from cals_seg.utils.precision import AMP_CHOICES, precision_name, resolve_amp

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
COMPILED = " (compiled)"


def separate_inductor_cache() -> None:
    """Under a forced CPU kind (``ATEN_CPU_CAPABILITY``) and without ``TORCHINDUCTOR_CACHE_DIR``,
    compile into an inductor cache of that kind: torch 2.14's graph cache does not key on it,
    and a graph cached under one kind and loaded under the other gave wrong values or
    corrupted memory (measured: compiled ``F.cross_entropy`` at 8 x 21 x 256 x 256)."""
    kind = os.environ.get("ATEN_CPU_CAPABILITY")
    default = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    if kind and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{kind}"


def describe(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and cores
    (``cals_seg.training.study.describe_machine``) with the instruction set of torch's kernels
    (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` run the AVX2 kind of the machine)."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{describe_machine()}; torch kernels {torch.backends.cpu.get_cpu_capability()}"


# Not split (over 80 lines): a benchmark script that reads top to bottom, as nanoGPT's.
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
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: the process's CPU time (time.process_time), steadier than the "
                   "wall clock on a shared machine with --threads 1; CPU device only")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time the model and criterion under torch.compile(backend=BACKEND)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="blocks per penalty pass on an accelerator (default: the library's)")
    args = p.parse_args()
    if args.compile:
        separate_inductor_cache()
    if args.gpu_blocks is not None:
        penalty_blocks.GPU_BLOCKS = args.gpu_blocks
    print(f"# penalty blocks on an accelerator: {penalty_blocks.GPU_BLOCKS}")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
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
    models = dict.fromkeys(criteria, model)
    for c in list(criteria.values()):
        c.deferred_checks = True  # as in the trainer: no host read of the label check
    if args.compile:
        compiled_model = torch.compile(model, backend=args.compile)
        for name in list(criteria):
            criteria[name + COMPILED] = torch.compile(criteria[name], backend=args.compile)
            models[name + COMPILED] = compiled_model

    def step(name: str) -> float:
        criterion = criteria[name]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        dtype = AMP.get(args.amp, torch.bfloat16)
        with torch.autocast(device.type, dtype=dtype, enabled=args.amp != "none"):
            logits = models[name](x)
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
        return clock() - t0

    first: dict[str, float] = {}
    for name in criteria:  # warm-up (a compiled step compiles in the first)
        t0 = time.perf_counter()  # wall: the C++ compiler runs in other processes
        step(name)
        first[name] = time.perf_counter() - t0
        step(name)
    like = torch.randn(args.batch, args.classes, args.size, args.size, device=device)

    def copy() -> float:  # the bound: one copy of a logits-sized tensor
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        like.clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    copy()
    times: dict[str, list[float]] = {name: [] for name in criteria}
    copies: list[float] = []
    for _ in range(args.steps):
        for name in criteria:
            times[name].append(step(name))
        copies.append(copy())
    peak: dict[str, float] = {}
    for name in criteria:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            step(name)
            peak[name] = torch.cuda.max_memory_allocated(device) / 2**20
        else:
            peak[name] = float("nan")  # not measured on CPU
    dev = describe(args.device)
    print(f"# DeepLabV3-{args.encoder}, batch {args.batch} x 3 x {args.size} x {args.size}, "
          f"{args.classes} classes, {dev}, {torch.get_num_threads()} threads, amp={args.amp}, "
          f"channels_last={args.channels_last}, {args.clock} clock, torch {torch.__version__}")
    if args.compile:
        print(f"# compiled rows: torch.compile(backend={args.compile!r}) of the model and of "
              "the criterion; time / CE is to the compiled CE step")
    copy_t = statistics.median(copies)
    print(f"# copy of the logits ({args.batch} x {args.classes} x {args.size} x {args.size} "
          f"float32): {copy_t * 1e3:.2f} ms (median)")
    print("| criterion | step (ms, median) | images/s | time / CE | over CE (copies) "
          "| peak memory (MiB) | compile (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name in times:
        ref = med["ce" + COMPILED] if name.endswith(COMPILED) else med["ce"]
        comp = f"{first[name] - med[name]:.1f}" if name.endswith(COMPILED) else ""
        print(f"| {name} | {med[name] * 1e3:.1f} | {args.batch / med[name]:.1f} | "
              f"{med[name] / ref:.3f}x | {(med[name] - ref) / copy_t:.2f} | {peak[name]:.0f} | "
              f"{comp} |")
    ratio = med["cals_alm"] / med["ce"]
    print(f"TARGET | train step ({args.amp}): cals_alm step time / ce | {ratio:.4g} | <= 1.02 | "
          f"{'MET' if ratio <= 1.02 else 'NOT MET'}")
    if args.compile:
        ratio = med["cals_alm" + COMPILED] / med["ce" + COMPILED]
        print(f"TARGET | train step ({args.amp}, torch.compile): cals_alm step time / ce | "
              f"{ratio:.4g} | <= 1.02 | {'MET' if ratio <= 1.02 else 'NOT MET'}")


if __name__ == "__main__":
    main()
