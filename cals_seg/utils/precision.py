"""Mixed precision that is fast on the machine at hand: ``train.amp: auto`` and its probes.

``auto`` resolves, for training, to ``bf16`` where bfloat16 is native (a CUDA device that
supports it; a CPU whose oneDNN reports native bf16 and whose ATen kernels are AVX-512 or
better) and to ``none`` (float32) everywhere else. ``fp16`` is used only when asked for, and only
on CUDA. The criterion and the meters always compute in float32, whatever the model's forward
pass runs in.

For inference (evaluation, prediction, export: ``resolve_amp(..., inference=True)``), ``auto``
on a CPU is float32 on every kind of CPU: the confidences a command reports must not depend on
the CPU it ran on, and must equal those of the float32 exported program. A lower precision is
used there only when asked for (``--amp bf16``, ``train.amp: bf16``), with its measured
deviation (:data:`BF16_DEVIATION`) said once. Calibration quantities (softmax, temperatures,
thresholds, prediction sets) are float32 in every case: the logits are cast to float32 before
any of them.
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from cals_seg.errors import UserError

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
AMP_CHOICES = ("auto", "none", "bf16", "fp16")
# Measured on a 2-core AMD EPYC with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# (docs/benchmarks.md): a DeepLabV3-ResNet18 training step, 8x3x64x64, 2 threads, took 7.2 s in
# emulated bf16 against 0.35 s in float32.
EMULATED_BF16_SLOWDOWN = "about 20x"
# A bf16 forward pass against float32, same images (docs/performance.md, "Precision"): a
# DeepLabV3-ResNet18 trained 20 epochs on the embedded data, 24 test images of 59 x 51, on the
# 2-core AMD EPYC with native bf16 and capped to AVX2 (emulated bf16): largest change of a
# probability 0.013, labels changed 0.05%, test ECE 2.573% vs 2.569% (pooled, 200 images).
# Issue 51 measured up to 0.107 and 1.9% of labels on another run: it depends on the network.
BF16_DEVIATION = ("a bf16 forward pass moves confidences away from float32 (the exported "
                  "program's): up to 0.013 per probability and 0.05% of labels changed on the "
                  "embedded DeepLabV3-ResNet18, up to 0.107 and 1.9% on other networks "
                  "(docs/performance.md#precision)")


def cpu_has_native_bf16() -> bool:
    """True when a CPU bf16 autocast runs on native kernels: oneDNN reports bf16 support and,
    on x86, ATen's kernels are AVX-512 or better (``ATEN_CPU_CAPABILITY=avx2`` caps them)."""
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False
    if not onednn:
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")
    return True


def has_native_bf16(device: torch.device) -> bool:
    """Whether bfloat16 autocast is native (fast) on ``device``."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve_amp(amp: str, device: torch.device, warn: bool = True,
                inference: bool = False) -> str:
    """The precision a run uses on ``device``: ``none``, ``bf16`` or ``fp16``.

    Args:
        amp: ``auto`` (bf16 where native, else float32; for inference on a CPU, float32),
            ``none``, ``bf16`` or ``fp16``.
        device: where the model runs.
        warn: warn once when ``bf16`` is asked for explicitly on a CPU without native bf16.
        inference: the forward pass of an evaluation, a prediction or an export, not of
            training: ``auto`` is then float32 on every CPU (module docstring).

    Raises:
        ValueError: an unknown value, or ``fp16`` off CUDA (the message names the fix).
    """
    if amp not in AMP_CHOICES:
        raise UserError(f"train.amp: expected one of {list(AMP_CHOICES)}; got {amp!r}.")
    if amp == "auto":
        if inference and device.type == "cpu":
            return "none"
        return "bf16" if has_native_bf16(device) else "none"
    if amp == "fp16" and device.type != "cuda":
        raise UserError(
            f"train.amp=fp16 needs a CUDA device (this run is on {device.type}); use "
            "train.amp=auto (bf16 where the CPU has it natively), bf16 or none."
        )
    if amp == "bf16" and warn and device.type == "cpu" and not cpu_has_native_bf16():
        warnings.warn(
            f"train.amp=bf16: this CPU has no native bfloat16 "
            f"({torch.backends.cpu.get_cpu_capability()}), so bf16 autocast is emulated and "
            f"{EMULATED_BF16_SLOWDOWN} slower than float32; train.amp=auto picks float32 here.",
            stacklevel=2,
        )
    return amp


def autocast_context(device: torch.device, amp: str) -> AbstractContextManager:
    """Autocast for the forward pass in the resolved precision ``amp`` (``none``: no-op)."""
    if amp == "none":
        return nullcontext()
    if amp not in AMP_DTYPES:
        raise ValueError(f"autocast_context: expected a resolved precision none/bf16/fp16, got "
                         f"{amp!r} (call resolve_amp first).")
    return _autocast(device.type, AMP_DTYPES[amp])


@contextmanager
def _autocast(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast`` that empties autocast's cache of cast weights when it ends.

    Autocast keeps the low-precision copy of each weight it casts and drops these copies when
    its outermost context ends, found by a nesting count. That count is process state: an
    exception inside a ``torch._dynamo`` trace (e.g. ``torch._dynamo.explain`` of a function
    that raises) leaves it one too high, after which no context is outermost, the copies are
    never dropped, and every later forward pass uses the weights of the first one while the
    optimizer updates the float32 ones (silently: the loss still moves through the layers
    autocast leaves in float32). Emptying the cache here makes each forward pass cast the
    current weights whatever the count says; where the count is right it is what
    ``torch.autocast`` does anyway.
    """
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            yield
    finally:
        torch.clear_autocast_cache()


def precision_name(amp: str) -> str:
    """What a resolved ``amp`` means in words for logs: ``bfloat16``, ``float16``, ``float32``."""
    return {"bf16": "bfloat16", "fp16": "float16", "none": "float32"}[amp]


def resolve_device(name: str) -> torch.device:
    """``auto`` -> this process' GPU under torchrun, CUDA when available, else CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device(name)
