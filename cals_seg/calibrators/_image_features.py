"""The statistics ``image_ts`` reads from an image and its logits, in tensor operations only (no
numpy, no loop over a data-dependent size), so that the calibrator's forward pass goes into
``torch.export`` (:mod:`cals_seg.calibrators.image_ts`; its predicted-boundary bands are
:func:`cals_seg.calibrators._export.graph_bands`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

FEATURES = ("brightness", "log_contrast", "log_sharpness", "log_noise", "saturation",
            "entropy_mean", "entropy_std", "margin_mean", "margin_std")
IMAGE_FEATURES = 5  # the first five come from the image
PIXEL_FEATURES = ("pixel_entropy", "local_entropy", "pixel_margin", "local_margin")
GATE = "log_margin"  # the pixel statistic the interaction weights multiply
LOCAL = 9  # the side of the window of the local means (pixels)
GATE_EPS = 1e-2
LOG_T_MAX = math.log(100.0)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
LUMA = (0.299, 0.587, 0.114)
_LAPLACIAN = ((0.0, 1.0, 0.0), (1.0, -4.0, 1.0), (0.0, 1.0, 0.0))
_NOISE = ((1.0, -2.0, 1.0), (-2.0, 4.0, -2.0), (1.0, -2.0, 1.0))


def work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _filter(y: Tensor, kernel: Sequence[Sequence[float]]) -> Tensor:
    """``y (N, 1, H, W)`` convolved with a 3 x 3 kernel, replicate-padded (same size)."""
    k = torch.tensor(kernel, dtype=y.dtype, device=y.device).view(1, 1, 3, 3)
    return F.conv2d(F.pad(y, (1, 1, 1, 1), mode="replicate"), k)


def image_statistics(image: Tensor, mean: Sequence[float] = IMAGENET_MEAN,
                     std: Sequence[float] = IMAGENET_STD) -> Tensor:
    """The five image statistics of :data:`FEATURES`, per image (formulas in the docstring of
    :mod:`cals_seg.calibrators.image_ts`).

    Shape:
        - image: ``(N, 3, H, W)`` normalised ``(x - mean) / std``; returns ``(N, 5)`` in float64
          for a float64 image, else float32.
    """
    x = image.to(work_dtype(image))
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    rgb = (x * s + m).clamp(0.0, 1.0)
    luma = (rgb * torch.tensor(LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)).sum(
        dim=1, keepdim=True)
    flat = luma.flatten(1)
    brightness = flat.mean(dim=1)
    contrast = torch.log(flat.std(dim=1, correction=0) + 1e-3)
    sharpness = torch.log(_filter(luma, _LAPLACIAN).flatten(1).var(dim=1, correction=0) + 1e-6)
    sigma = math.sqrt(math.pi / 2.0) / 6.0 * _filter(luma, _NOISE).abs().flatten(1).mean(dim=1)
    noise = torch.log(sigma + 1e-4)
    high, low = rgb.amax(dim=1), rgb.amin(dim=1)
    saturation = ((high - low) / (high + 1e-3)).flatten(1).mean(dim=1)
    return torch.stack([brightness, contrast, sharpness, noise, saturation], dim=1)


def entropy_margin(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The predictive entropy (nats) and the top-1 minus top-2 logit margin of every pixel.

    Shape:
        - logits: ``(N, K, H, W)``, K >= 2; returns two ``(N, H, W)`` (float64 for float64
          logits, else float32).
    """
    x = logits.to(work_dtype(logits))
    logp = torch.log_softmax(x, dim=1)
    top = x.topk(2, dim=1).values
    return -(logp.exp() * logp).sum(dim=1), top[:, 0] - top[:, 1]


def logit_statistics(logits: Tensor, maps: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The four logit statistics of :data:`FEATURES`: mean and spread of the predictive entropy
    (nats) and of the top-1 minus top-2 logit margin, per image. ``maps``: the
    :func:`entropy_margin` of ``logits`` when already computed.

    Shape:
        - logits: ``(N, K, H, W)``, K >= 2; returns ``(N, 4)`` (float64 for float64 logits,
          else float32).
    """
    entropy, margin = entropy_margin(logits) if maps is None else maps
    entropy, margin = entropy.flatten(1), margin.flatten(1)
    return torch.stack([entropy.mean(dim=1), entropy.std(dim=1, correction=0),
                        margin.mean(dim=1), margin.std(dim=1, correction=0)], dim=1)


def local_mean(x: Tensor, side: int = LOCAL) -> Tensor:
    """The mean of ``x (N, C, H, W)`` over the ``side x side`` window around each pixel,
    replicate-padded (same size; ``side`` odd)."""
    r = side // 2
    return F.avg_pool2d(F.pad(x, (r, r, r, r), mode="replicate"), side, stride=1)


def pixel_statistics(logits: Tensor, maps: tuple[Tensor, Tensor] | None = None
                     ) -> tuple[Tensor, Tensor]:
    """The four pixel statistics of :data:`PIXEL_FEATURES` and the gate of every pixel:
    the predictive entropy ``H(p)`` (nats) and the top-1 minus top-2 logit margin ``m(p)``, each
    also as its mean over the ``9 x 9`` window around the pixel (replicate-padded), and the gate
    ``log(m(p) + 0.01)``. ``maps``: the :func:`entropy_margin` of ``logits`` when already
    computed.

    Shape:
        - logits: ``(N, K, H, W)``, K >= 2; returns ``(N, 4, H, W)`` and ``(N, H, W)``
          (float64 for float64 logits, else float32).
    """
    entropy, margin = entropy_margin(logits) if maps is None else maps
    entropy, margin = entropy.unsqueeze(1), margin.unsqueeze(1)
    near = local_mean(torch.cat([entropy, margin], dim=1))
    stats = torch.cat([entropy, near[:, :1], margin, near[:, 1:]], dim=1)
    return stats, torch.log(margin[:, 0] + GATE_EPS)


__all__ = ["FEATURES", "GATE", "PIXEL_FEATURES", "entropy_margin",
           "image_statistics", "local_mean", "logit_statistics", "pixel_statistics",
           "work_dtype"]
