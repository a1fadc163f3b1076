"""The machine a benchmark ran on, and the bound it measures against: one copy of the logits.

Every benchmark that times the loss, a meter or a calibrator also times ``logits.clone()`` (one
read and one write of the logits, the least any pass over them costs) in the same run, and
reports each cost in copies beside its ratio to the obvious alternative, so that a reader sees
how far each one is from the memory limit on any CPU or GPU. A CPU is named by its model and
the instruction set torch's kernels use (``torch.backends.cpu.get_cpu_capability()``, which
``ATEN_CPU_CAPABILITY=avx2`` lowers: the AVX2 kind of the same machine).

Imported by the scripts of this folder (``from _machine import ...``: a script's folder is on
``sys.path`` when it runs).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

COPY = "copy (logits.clone())"  # the row name of the bound in every table


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(device: str = "cpu") -> str:
    """``"<CPU model>, torch kernels <ISA>"`` (with the ``ATEN_CPU_CAPABILITY`` /
    ``ONEDNN_MAX_CPU_ISA`` overrides when set), or the GPU's name for a CUDA device."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    isa = torch.backends.cpu.get_cpu_capability()
    forced = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
              if os.environ.get(k)]
    return f"{cpu_model()}, torch kernels {isa}" + (f" ({', '.join(forced)})" if forced else "")


def copy_fn(logits) -> Callable[[], object]:
    """The bound as a timed call: one copy of ``logits``."""
    return logits.clone


def in_copies(seconds: float, copy_seconds: float) -> str:
    """``seconds`` in copies of the logits, formatted (``n/a`` without a copy time)."""
    return f"{seconds / copy_seconds:.2f}" if copy_seconds > 0 else "n/a"


def copy_seconds(logits, repeats: int = 5, clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] = lambda: None) -> float:
    """Fastest of ``repeats`` copies of ``logits`` after a warm-up one."""
    logits.clone()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        logits.clone()
        sync()
        best = min(best, clock() - start)
    return best
