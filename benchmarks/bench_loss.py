"""Forward+backward time and memory of every loss, as ratios to F.cross_entropy.

    python benchmarks/bench_loss.py [--shape 8 21 256 256] [--void 0.1] [--repeats 7]
        [--threads 2] [--device cpu|cuda] [--losses F.cross_entropy ce cals_alm] [--compile]

Each loss runs on the same ``(N, K, H, W)`` logits with a fraction of void (255) pixels. Time is
the fastest of ``--repeats`` forward+backward passes after one warm-up, the losses taking turns
in every round (the order reversed every other round); ``F.cross_entropy`` is measured in the
same run, and "paired" is the median over the rounds of each loss's time over
``F.cross_entropy``'s in the same round (steadier than the ratio of the fastest times on a
machine whose speed drifts; use ``--repeats 15`` or more), and so is one copy of the
logits (``logits.clone()``, the least a pass over them costs): "copies" is each time in copies,
with the CPU (its model and the instruction set of torch's kernels) or the GPU named. "saved"
is what the autograd graph keeps for backward besides the logits (measured with saved-tensor
hooks). Peak memory is measured per loss: on CUDA in this process with
``torch.cuda.max_memory_allocated`` (reset before each pass; the caching allocator does not
affect it); on CPU (Linux) in a fresh subprocess as the growth of the peak RSS (VmHWM, reset
just before the pass) over the state with logits and target allocated.

``--compile`` also times ``torch.compile`` of every measured loss (rows marked "compiled", the
criteria with ``deferred_checks`` so that their graph has no host read; a failed compilation is
reported, not raised): "time / F.cross_entropy" of a compiled row is its ratio to the compiled
``F.cross_entropy`` of the same run, and "compile (s)" the time of its first call less one
steady call (dynamo, inductor and the C++/Triton compiler). "saved" of a compiled row is what
the compiled graph keeps; its peak is measured on CUDA only (a fresh process would compile
again). The lines starting with ``TARGET`` state the performance targets (CALS-ALM
forward+backward at most 1.5x ``F.cross_entropy``; compiled, at most 1.2x on the CPU and 1.5x
on CUDA; peak memory at most CE's plus one logits-sized tensor, for CALS-ALM and for the
region-adaptive ``cals_alm_bands``, whose band map is made once from the target outside the
measured passes, as the data loader makes it in training) with the measured value.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import cals_seg.contrib.cals_bands  # noqa: F401  (the opt-in cals_alm_bands is measured too)
from cals_seg.losses import LOSSES, build_loss
from cals_seg.losses import _functional as penalty_blocks
from cals_seg.training.study import describe_machine

NAMES = ["F.cross_entropy", *LOSSES]
COMPILED = " (compiled)"
COPY = "copy (logits.clone())"  # the bound, timed with the losses


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


def in_copies(seconds: float, copy_seconds: float) -> str:
    return f"{seconds / copy_seconds:.2f}" if copy_seconds > 0 else "n/a"


def make_inputs(shape: list[int], void: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n, k, *s = shape
    # Logits with a realistic scale: some positions far beyond the margin of 10.
    # Filled in place, so creating the inputs leaves no large freed temporaries behind.
    logits = torch.empty(shape).normal_(0.0, 6.0, generator=g).to(device)
    target = torch.randint(0, k, (n, *s), generator=g)
    target.masked_fill_(torch.rand((n, *s), generator=g) < void, 255)
    return logits, target.to(device)


COMPILE_BACKEND = "inductor"
CLOCK = time.perf_counter


def make_fn(name: str, k: int, device: torch.device | str = "cpu",
            target: torch.Tensor | None = None):
    """The loss ``name`` for K classes, its buffers (multipliers) on ``device``. A loss with
    ``extra_inputs`` (the band map of ``cals_alm_bands``) gets them made from ``target`` here,
    outside the measured passes, as the data loader makes them in training."""
    if name == COPY:
        return None  # step() copies the logits
    if name.endswith(COMPILED):
        fn = make_fn(name[: -len(COMPILED)], k, device, target)
        if hasattr(fn, "deferred_checks"):
            fn.deferred_checks = True  # the label check stays on the device: one graph
        return torch.compile(fn, backend=COMPILE_BACKEND)
    if name == "F.cross_entropy":
        return lambda x, y: F.cross_entropy(x, y, ignore_index=255)
    loss = build_loss(name, k, ignore_index=255).to(device)
    if hasattr(loss, "rhos"):  # multipliers as after some training, so the penalty is active
        loss.lambdas.fill_(0.5)
        loss.rhos.fill_(2.0)
    if "band" in loss.extra_inputs:
        if target is None:
            raise ValueError(f"{name} needs the target to make its band map")
        band = loss.band_map(target)
        return lambda x, y: loss(x, y, band=band)
    return loss


def step(fn, logits: torch.Tensor, target: torch.Tensor) -> None:
    if fn is None:  # the bound: one copy of the logits
        logits.clone()
        return
    x = logits.detach().requires_grad_(True)
    fn(x, target).backward()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_all(names: list[str], logits, target, repeats: int, device: str,
             fns: dict | None = None, first: dict | None = None,
             rounds: list | None = None) -> dict[str, float]:
    """Fastest of ``repeats`` forward+backward passes per loss, the losses taking turns in each
    round so that a change of machine load affects every loss alike. The functions are left in
    ``fns`` when given (a compiled one is reused, not compiled again), the time of the first
    call (a compiled function compiles there) in ``first``, each round's times in
    ``rounds``."""
    fns = {} if fns is None else fns
    first = {} if first is None else first
    for name in names:
        fns[name] = make_fn(name, logits.shape[1], logits.device, target)
    for name in names:  # warm-up (a compiled function compiles here)
        sync(device)
        t0 = time.perf_counter()  # wall: the C++ compiler runs in other processes
        step(fns[name], logits, target)
        sync(device)
        first[name] = time.perf_counter() - t0
    return _time_in_turns(names, fns, logits, target, repeats, device, rounds)


def _time_in_turns(names: list[str], fns: dict, logits, target, repeats: int,
                   device: str, rounds: list | None = None) -> dict[str, float]:
    """Fastest of ``repeats`` passes of the already warmed-up ``fns[name]``, in turns (the
    order reversed every other round); each round's ``{name: seconds}`` appended to
    ``rounds``."""
    best = dict.fromkeys(names, float("inf"))
    for i in range(repeats):
        times = {}
        for name in names if i % 2 == 0 else names[::-1]:
            sync(device)
            t0 = CLOCK()
            step(fns[name], logits, target)
            sync(device)
            times[name] = CLOCK() - t0
            best[name] = min(best[name], times[name])
        if rounds is not None:
            rounds.append(times)
    return best


def paired_ratio(rounds: list[dict[str, float]], name: str, ref: str) -> float:
    """Median over the rounds of ``time[name] / time[ref]`` measured in the same round: a slow
    drift of the machine's speed affects both, unlike the ratio of two fastest times."""
    ratios = [r[name] / r[ref] for r in rounds if name in r and ref in r and r[ref] > 0]
    return statistics.median(ratios) if ratios else float("nan")


def saved_for_backward(name: str, logits: torch.Tensor, target: torch.Tensor,
                       fn=None) -> float:
    """MiB of distinct tensor storages the autograd graph keeps for backward, the input logits
    excluded (every loss needs them or something of their size)."""
    fn = fn if fn is not None else make_fn(name, logits.shape[1], logits.device, target)
    x = logits.detach().requires_grad_(True)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr != x.untyped_storage().data_ptr():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x, target)
    loss.backward()
    return sum(seen.values()) / 2**20


def peak_memory(name: str, args: argparse.Namespace, inputs=None, fn=None) -> float:
    """Peak extra memory (MiB) of one forward+backward: on CUDA in this process (the peak
    counter is reset first), on CPU in a fresh process (the peak RSS cannot be reset)."""
    logits, target = inputs or make_inputs(args.shape, args.void, args.device)
    fn = fn if fn is not None else make_fn(name, logits.shape[1], logits.device, target)
    x = logits.detach().requires_grad_(True)
    if args.device.startswith("cuda"):
        fn(x, target).backward()  # warm-up (a compiled fn compiles here), then measure
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(x, target).backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _vm_kib("VmHWM")
    fn(x, target).backward()
    return (_vm_kib("VmHWM") - base) / 1024


def _vm_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not found in /proc/self/status (Linux only)")


# Not split (over 80 lines): a benchmark script that reads top to bottom, as nanoGPT's.
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", type=int, nargs="+", default=[8, 21, 256, 256])
    p.add_argument("--void", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--losses", nargs="+", default=None, choices=NAMES, metavar="NAME",
                   help=f"losses to measure (default: all of {NAMES})")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also time torch.compile(backend=BACKEND, default inductor) of "
                   "every measured loss ('eager': dynamo only, a cheap check)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="cpu: the process's CPU time (time.process_time), steadier than the "
                   "wall clock on a shared machine with --threads 1; CPU device only")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="blocks per penalty pass on an accelerator (default: the library's)")
    args = p.parse_args()
    if args.gpu_blocks is not None:
        penalty_blocks.GPU_BLOCKS = args.gpu_blocks
    print(f"# penalty blocks on an accelerator: {penalty_blocks.GPU_BLOCKS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        separate_inductor_cache()
        global COMPILE_BACKEND
        COMPILE_BACKEND = args.compile
    if args.clock == "cpu":
        global CLOCK
        CLOCK = time.process_time

    if args.memory_of:  # child process: one memory measurement
        print(json.dumps({"mib": peak_memory(args.memory_of, args)}))
        return

    names = list(args.losses or NAMES)
    for must in ("F.cross_entropy", "cals_alm"):  # the targets compare these two
        if must not in names:
            names.append(must)
    names.sort(key=NAMES.index)
    cuda = args.device.startswith("cuda")
    logits, target = make_inputs(args.shape, args.void, args.device)
    logits_mib = logits.numel() * logits.element_size() / 2**20
    fns: dict = {}
    first: dict = {}
    rounds: list[dict[str, float]] = []
    times = time_all([COPY, *names], logits, target, args.repeats, args.device, fns, first,
                     rounds)
    saved = {name: saved_for_backward(name, logits, target) for name in names}
    mems = {}
    for name in names:
        if cuda:
            mems[name] = peak_memory(name, args, (logits, target), fns[name])
            continue
        cmd = [
            sys.executable,
            __file__,
            "--memory-of",
            name,
            "--device",
            args.device,
            "--void",
            str(args.void),
            "--shape",
            *map(str, args.shape),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        mems[name] = json.loads(out.strip().splitlines()[-1])["mib"]
    compiled_errors: dict[str, str] = {}
    compiled: list[str] = []
    if args.compile:
        for base in list(names):
            name = base + COMPILED
            try:  # each compiled alone (a failure leaves the others), then timed in turns
                time_all([name], logits, target, 0, args.device, fns, first)
                compiled.append(name)
            except Exception as err:  # noqa: BLE001 - reported, the eager rows stand
                compiled_errors[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        best = _time_in_turns(compiled, fns, logits, target, args.repeats, args.device, rounds)
        for name in compiled:
            times[name] = best[name]
            saved[name] = saved_for_backward(name, logits, target, fns[name])
            mems[name] = (peak_memory(name, args, (logits, target), fns[name]) if cuda
                          else float("nan"))
            names.append(name)

    dev = describe(args.device)
    if args.compile:
        print(f"# compiled rows: torch.compile(backend={args.compile!r})")
    print(
        f"# forward+backward on logits {tuple(args.shape)} float32, {args.void:.0%} void, "
        f"{dev}, {torch.get_num_threads()} threads, {args.clock} clock, torch {torch.__version__}"
    )
    print(
        f"# logits tensor: {logits_mib:.0f} MiB; saved = kept for backward besides the logits; "
        "peak = peak extra memory of one pass "
        f"({'max_memory_allocated' if cuda else 'fresh process, VmHWM'})"
    )
    print("| loss | time (ms) | time / F.cross_entropy | paired | copies | saved (MiB) "
          "| peak (MiB) | peak / CE | compile (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ce_t, ce_m = times["F.cross_entropy"], mems["F.cross_entropy"]
    ce_ct = times.get("F.cross_entropy" + COMPILED, float("nan"))
    copy_t = times[COPY]
    print(f"| {COPY} | {copy_t * 1e3:.2f} | {copy_t / ce_t:.2f}x | "
          f"{paired_ratio(rounds, COPY, 'F.cross_entropy'):.2f}x | 1.00 | | | | |")
    for name in names:
        is_compiled = name.endswith(COMPILED)
        ref = ce_ct if is_compiled else ce_t
        paired = paired_ratio(rounds, name, "F.cross_entropy" + (COMPILED if is_compiled else ""))
        comp = f"{first[name] - times[name]:.1f}" if is_compiled else ""  # wall - clock
        print(
            f"| {name} | {times[name] * 1e3:.2f} | {times[name] / ref:.2f}x | {paired:.2f}x | "
            f"{in_copies(times[name], copy_t)} | {saved[name]:.0f} | {mems[name]:.0f} | "
            f"{mems[name] / max(ce_m, 1e-9):.2f}x | {comp} |"
        )
    if compiled:
        print("# compiled rows: time / F.cross_entropy is to the compiled F.cross_entropy "
              f"({ce_ct * 1e3:.2f} ms; eager {ce_t * 1e3:.2f} ms, compiled/eager "
              f"{ce_ct / ce_t:.2f}x)")
    for name, err in compiled_errors.items():
        print(f"# {name}: compilation failed: {err}")

    def target_line(what: str, value: float, op: str, limit: float) -> None:
        # 1e-3 of slack: the allocator rounds blocks (a few KiB on a 168 MiB tensor)
        met = value <= limit * (1 + 1e-3) if op == "<=" else value >= limit
        print(f"TARGET | {what} | {value:.4g} | {op} {limit:g} | {'MET' if met else 'NOT MET'}")

    target_line("loss: cals_alm fwd+bwd time / F.cross_entropy (eager)",
                times["cals_alm"] / ce_t, "<=", 1.5)
    if "cals_alm" + COMPILED in times and "F.cross_entropy" + COMPILED in times:
        target_line("loss: cals_alm fwd+bwd time / F.cross_entropy (both torch.compile)",
                    times["cals_alm" + COMPILED] / times["F.cross_entropy" + COMPILED], "<=",
                    1.5 if cuda else 1.2)
    elif args.compile:
        print("TARGET | loss: cals_alm fwd+bwd time / F.cross_entropy (both torch.compile) | "
              f"n/a | <= {1.5 if cuda else 1.2} | NOT MEASURED (compilation failed)")
    # peak(cals_alm) <= peak(CE) + one logits tensor, i.e. (peak - peak_CE) / logits <= 1
    target_line("loss: (cals_alm peak - F.cross_entropy peak) / logits size",
                (mems["cals_alm"] - ce_m) / logits_mib, "<=", 1.0)
    if "cals_alm_bands" in mems:  # the same memory target for the region-adaptive penalty
        target_line("loss: (cals_alm_bands peak - F.cross_entropy peak) / logits size",
                    (mems["cals_alm_bands"] - ce_m) / logits_mib, "<=", 1.0)
    print(f"# peak memory: F.cross_entropy {ce_m:.1f} MiB, cals_alm {mems['cals_alm']:.1f} MiB, "
          f"logits {logits_mib:.1f} MiB")


if __name__ == "__main__":
    main()
