"""Allocations a setting makes huge, estimated and refused before anything is allocated.

A ``data.crop_size`` or ``eval.pad`` of 16384 is a valid size, but one training batch of it
needs more memory than most machines have: the process would be killed by the kernel (or CUDA
would fail mid-epoch) after minutes of data loading. :func:`check_batch_memory` computes a
lower bound of the memory of one batch and refuses, on one line naming the key, when it exceeds
the memory of the device. The bound counts only the tensors every segmentation step holds::

    bytes >= 4 * B * H * W * (3 + 3 * K)

(float32 input ``(B, 3, H, W)``; logits, probabilities and their gradient ``(B, K, H, W)``); the
network's own activations come on top, so a refused setting can never have fitted.
"""

from __future__ import annotations

import os

import torch

from cals_seg.errors import UserError


class MemoryEstimateError(UserError, MemoryError):
    """A setting whose batches cannot fit in the device's memory."""


def batch_bytes(batch: int, height: int, width: int, num_classes: int) -> int:
    """Lower bound of the bytes of one segmentation batch: ``4 * B * H * W * (3 + 3 K)``."""
    return 4 * batch * height * width * (3 + 3 * num_classes)


def device_memory(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes (physical RAM for the CPU), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        return None


def check_batch_memory(batch: int, side: int, num_classes: int, device: torch.device,
                       key: str, fix: str) -> None:
    """Refuse a ``batch x side x side`` input whose lower bound (:func:`batch_bytes`) exceeds the
    memory of ``device``.

    Args:
        batch: images per batch.
        side: the network input's side in pixels (the crop, pad, resize or window).
        num_classes: ``K``.
        device: where the batch goes.
        key: the setting that makes it large (named in the message), e.g. ``data.crop_size``.
        fix: what to change, e.g. ``--set data.crop_size=512``.

    Raises:
        MemoryEstimateError: one line with the estimate, the memory and the fix.
    """
    need = batch_bytes(batch, side, side, num_classes)
    have = device_memory(device)
    if have is not None and need > have:
        raise MemoryEstimateError(
            f"{key}: {side} x {side} pixels x {batch} image(s) x {num_classes} classes needs at "
            f"least {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of "
            f"{device.type}; {fix}."
        )


__all__ = ["MemoryEstimateError", "batch_bytes", "check_batch_memory", "device_memory"]
