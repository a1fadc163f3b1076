"""``lts``: Local Temperature Scaling (Ding, Liu, Xiong and Shi, ICCV 2021, "Local Temperature
Scaling for Probability Calibration").

A small convolutional network predicts a temperature per pixel from the logits and the image;
``forward(l, x)(p) = l(p) / T(p)``. As in the authors' model, every branch is a 5 x 5 convolution
with dilation 2 and reflection padding: two temperature branches on the logits mixed by a gate
on the logits, and a temperature branch on the image mixed with them by a second gate on the
logits::

    t_l = g1 * conv_a(l) + (1 - g1) * conv_b(l),      g1 = sigmoid(conv_g1(l))
    log T = g2 * t_l + (1 - g2) * conv_img(x),         g2 = sigmoid(conv_g2(l))

With ``downsample = s > 1`` the network runs on the logits and image average-pooled by ``s``
(windows of ``s x s`` pixels) and ``log T`` is upsampled bilinearly to the full size, so the
convolutions cost ``1 / s^2`` of the full-resolution ones (the authors also predict a
lower-resolution temperature map); a map too small for the reflection padding at that size is
computed at full resolution. The default ``downsample = 1`` is the full-resolution model. The
factor is part of the fitted model: fit and apply with the same one.

The authors' model writes ``T = relu(1 + ...) + 1e-8``; here the branches give ``log T``
(``T = exp(log T)``, clamped to ``[1e-2, 1e2]``), which is positive everywhere and, with every
convolution zero-initialised, exactly 1 at initialisation: the untrained calibrator is the
identity. A positive temperature per pixel never changes the argmax.

Fit: Adam on the mean NLL of the fit images, one step per validation batch, early-stopped on
the held-out images (one in ``holdout_every``, see :func:`._base.fit_with_holdout`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cals_seg.calibrators._base import Batches, Calibrator, fit_with_holdout
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.errors import UserError
from cals_seg.utils.validation import check_int

LOG_T_MAX = math.log(100.0)


def _conv(in_channels: int, kernel_size: int, dilation: int) -> nn.Conv2d:
    conv = nn.Conv2d(in_channels, 1, kernel_size, padding=dilation * (kernel_size - 1) // 2,
                     dilation=dilation, padding_mode="reflect")
    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    return conv


def _reflect_conv(x: Tensor, weight: Tensor, bias: Tensor, pad: int, dilation: int) -> Tensor:
    """``conv2d(reflect_pad(x, pad), weight, bias, dilation)`` without the padded copy of ``x``.

    The convolution runs with zero padding, on the CPU in the channels-last layout (oneDNN's
    kernels for a few output channels are several times faster there than on NCHW, which pays
    for the layout change), and the output within ``pad`` of each side, where zeros and
    reflection differ, is recomputed from reflection-padded strips ``3 pad`` wide (the kernel
    of an output row ``< pad`` reaches input rows ``< 3 pad``). Images with a side under
    ``3 pad``, and any trace (``torch.export``, ``torch.compile``: the size test would become
    a guard on the traced sides), take the padded copy; both are the same convolution, equal
    to float rounding.

    Shape:
        - x: ``(N, C, H, W)``; weight: ``(O, C, k, k)`` with ``dilation (k - 1) = 2 pad``;
          returns ``(N, O, H, W)``.
    """
    h, w = x.shape[-2:]
    tracing = torch.compiler.is_compiling() or torch.compiler.is_exporting()
    if tracing or pad == 0 or min(h, w) < 3 * pad:
        return F.conv2d(F.pad(x, (pad, pad, pad, pad), mode="reflect"), weight, bias,
                        dilation=dilation)
    if x.device.type == "cpu":
        x = x.contiguous(memory_format=torch.channels_last)
    out = F.conv2d(x, weight, bias, padding=pad, dilation=dilation)
    edge = 3 * pad

    def strip(part: Tensor) -> Tensor:
        return F.conv2d(F.pad(part, (pad, pad, pad, pad), mode="reflect"), weight, bias,
                        dilation=dilation)

    out[..., :pad, :] = strip(x[..., :edge, :])[..., :pad, :]
    out[..., h - pad:, :] = strip(x[..., h - edge:, :])[..., edge - pad:, :]
    out[..., :, :pad] = strip(x[..., :, :edge])[..., :, :pad]
    out[..., :, w - pad:] = strip(x[..., :, w - edge:])[..., :, edge - pad:]
    return out


def _nll_sum(logits: Tensor, target: Tensor, ignore_index: int) -> tuple[Tensor, int] | None:
    n = int((target != ignore_index).sum())
    if n == 0:
        return None
    loss = F.cross_entropy(logits.float(), target.long(), ignore_index=ignore_index,
                           reduction="sum")
    return loss, n


@CALIBRATORS.register("lts")
class LocalTemperatureScaling(Calibrator):
    """A temperature per pixel from the logits (and the image).

    Args:
        num_classes: K >= 2.
        use_image: feed the image branch (then ``forward`` needs the image).
        image_channels: channels of the image.
        kernel_size, dilation: of every convolution.
        epochs, patience, lr, holdout_every: of the fit (:func:`._base.fit_with_holdout`).
        downsample: the temperature map's resolution divisor ``s`` (>= 1; see above).

    Shape:
        - logits: ``(N, K, H, W)``; image: ``(N, C, H, W)`` (H, W > 4); output like logits.
    """

    name = "lts"
    changes_argmax = False
    needs_image = True

    def __init__(self, num_classes: int, use_image: bool = True, image_channels: int = 3,
                 kernel_size: int = 5, dilation: int = 2, epochs: int = 10, patience: int = 3,
                 lr: float = 1e-3, holdout_every: int = 5, downsample: int = 1) -> None:
        check_int("image_channels", image_channels)
        check_int("downsample", downsample)
        check_int("kernel_size", kernel_size)
        check_int("dilation", dilation)
        if kernel_size % 2 == 0:
            raise UserError(f"Expected an odd `kernel_size`, but got {kernel_size}.")
        super().__init__(num_classes, use_image=bool(use_image), image_channels=image_channels,
                         kernel_size=kernel_size, dilation=dilation, epochs=epochs,
                         patience=patience, lr=lr, holdout_every=holdout_every,
                         **({"downsample": downsample} if downsample != 1 else {}))
        self.needs_image = bool(use_image)
        k, args = num_classes, (kernel_size, dilation)
        self.t_a, self.t_b, self.gate_ab = _conv(k, *args), _conv(k, *args), _conv(k, *args)
        self.gate_image = _conv(k, *args)
        self.t_image = _conv(image_channels, *args) if use_image else None

    def log_temperature(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """``log T`` per pixel, ``(N, 1, H, W)`` (computed at ``1 / downsample`` of the size and
        upsampled bilinearly when ``downsample > 1``)."""
        x = logits.float()
        img = image.float() if image is not None and self.t_image is not None else None
        s = self.params.get("downsample", 1)
        size = x.shape[-2:]
        pad = self.params["dilation"] * (self.params["kernel_size"] - 1) // 2
        low = s > 1 and min(-(-size[0] // s), -(-size[1] // s)) > pad
        if low:
            x = F.avg_pool2d(x, s, ceil_mode=True)
            img = None if img is None else F.avg_pool2d(img, s, ceil_mode=True)
        # The four branches on the logits as one convolution with four output channels (one
        # pass over the logits instead of four).
        branches = (self.t_a, self.t_b, self.gate_ab, self.gate_image)
        weight = torch.cat([c.weight for c in branches])
        bias = torch.cat([c.bias for c in branches])
        dilation = self.params["dilation"]
        # (contiguous: the channels-last output's channels are strided views)
        t_a, t_b, gate_ab, gate_image = _reflect_conv(
            x, weight, bias, pad, dilation).contiguous().split(1, dim=1)
        t = torch.lerp(t_b, t_a, torch.sigmoid(gate_ab))  # g1 t_a + (1 - g1) t_b
        if self.t_image is not None:
            t_image = _reflect_conv(img, self.t_image.weight, self.t_image.bias, pad, dilation)
            t = torch.lerp(t_image, t, torch.sigmoid(gate_image))  # g2 t + (1 - g2) t_image
        if low:
            t = F.interpolate(t, size=size, mode="bilinear", align_corners=False)
        return t.clamp(-LOG_T_MAX, LOG_T_MAX)

    def _check(self, logits: Tensor, image: Tensor | None) -> None:
        self.check_input(logits, image)
        if logits.dim() != 4:
            raise ValueError(
                f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}."
            )
        if image is not None and self.needs_image and image.shape[1] != self.params[
                "image_channels"]:
            raise ValueError(f"Expected an image with {self.params['image_channels']} channels, "
                             f"but got {image.shape[1]}.")

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self._check(logits, image)
        return logits / self.log_temperature(logits, image).exp().to(logits.dtype)

    def fit(self, batches: Batches, ignore_index: int = -100) -> dict[str, Any]:
        """Train on the validation NLL, early-stopped on the held-out images."""
        p = self.params

        def loss(net: nn.Module, logits: Tensor, target: Tensor, image: Tensor | None,
                 void: int) -> tuple[Tensor, int] | None:
            self._check(logits, image)
            if logits.dtype in (torch.float16, torch.bfloat16):  # fit in float32: a bf16 fit
                logits = logits.float()  # equals the fit on the exact upcast (tested)
            return _nll_sum(net(logits, image), target, void)

        self.fit_info = fit_with_holdout(self, loss, batches, ignore_index, p["epochs"],
                                         p["patience"], p["lr"], p["holdout_every"])
        return self.fit_info
