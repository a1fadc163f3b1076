"""Segmentation logits at each image's own resolution: the one path of evaluation and prediction.

The network input may differ from the image: resized (longest side to ``resize``, aspect kept),
padded (bottom/right, to at least ``pad x pad`` and to sides divisible by the network's stride),
or cut into overlapping ``window x window`` tiles (``mode="slide"``, overlapping logits
averaged). The logits never differ: the padding is cropped off and the logits are bilinearly
upsampled to the image's ``(H, W)`` *before* any softmax. So every metric, the temperature fit and
the saved confidence maps are taken on the original pixels, against the unmodified mask::

    protocol = EvalProtocol(mode="slide", window=512, stride=341)
    logits = segment_logits(model, images, protocol)           # (N, K, H, W), float32
    out = predict_image(model, image, temperature=1.3, protocol=protocol)
    out.label, out.confidence, out.entropy                     # (N, H, W) each

Memory: ``whole`` runs the batch it is given; ``slide`` runs one image at a time, ``tile_batch``
tiles per forward pass, and keeps one ``(K, H, W)`` sum of logits per image.

Logits that are NaN or infinite (a diverged checkpoint, an imported network that overflows)
never reach a metric or a saved map: :func:`segment_logits` raises
:class:`NonFiniteLogitsError`, one line naming what to check. On the CPU each call checks its
logits at once; on an accelerator a pass hands it a :class:`FiniteLogits` that keeps a device
flag and is read once at the end of the pass (no synchronisation per batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cals_seg.errors import UserError
from cals_seg.evaluation.logit_cache import cached_logits
from cals_seg.utils.precision import autocast_context

MODES = ("whole", "slide")
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)
_ROWS_PER_CHUNK = 256  # rows of softmax statistics computed at once (bounds the temporaries)


@dataclass(frozen=True)
class EvalProtocol:
    """How the network input is made from an image; the logits are always at the image's size.

    Args:
        mode: ``whole`` (one forward pass per batch) or ``slide`` (tiles of ``window x window``
            every ``stride`` pixels, one image at a time, overlapping logits averaged).
        resize: longest side of the network input (aspect kept; smaller images are enlarged),
            or ``None`` for the image's own size.
        pad: pad the network input at the bottom/right to at least ``pad x pad`` (the paper's
            VOC protocol: 512), or ``None``.
        window: tile side in ``slide`` mode (an image side below it gives a shorter tile).
        stride: step between tiles, ``1 <= stride <= window``.
        multiple: the network needs sides divisible by it: inputs are padded to it and the
            logits cropped back; ``None``: ask the model (:func:`input_multiple`).
        tile_batch: tiles per forward pass in ``slide`` mode.
        mean, std: per-channel normalisation of ``[0, 1]`` RGB pixels (ImageNet). Padding is
            filled with the normalised value of a black pixel, ``-mean / std``.

    Raises:
        ValueError: an unknown mode or a size that is not a positive integer.
    """

    mode: str = "whole"
    resize: int | None = None
    pad: int | None = None
    window: int = 512
    stride: int = 341
    multiple: int | None = None
    tile_batch: int = 8
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`mode`: expected one of {list(MODES)}, got {self.mode!r}.")
        for name in ("window", "stride", "multiple", "tile_batch", "resize", "pad"):
            value = getattr(self, name)
            if value is None and name in ("resize", "pad", "multiple"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}`: expected an integer >= 1, got {value!r}.")
        if self.stride > self.window:
            raise ValueError(  # the one stride rule: config checks report it under eval.*
                f"`stride`: expected an integer in [1, `window`] = [1, {self.window}] (a larger "
                f"stride leaves pixels no tile covers), got {self.stride}."
            )


class NonFiniteLogitsError(UserError, RuntimeError):
    """The network returned NaN or infinite logits: no metric or map would mean anything."""


# What to check, in the one line of a NonFiniteLogitsError.
NON_FINITE_HINT = ("check the network's weights (a checkpoint saved after the training "
                   "diverged), the factory and weights of an imported network, and the "
                   "precision of the forward pass (fp16 overflows: --set train.amp=none, or "
                   "--amp none)")


def all_finite(x: Tensor) -> Tensor:
    """0-dim bool on ``x``'s device: every value of ``x`` is finite (True when ``x`` is empty).

    One ``aminmax`` pass: a NaN makes both the minimum and the maximum NaN, an infinity shows in
    one of them. Same answer as ``isfinite(x).all()`` without its bool tensor of ``x``'s size
    (about 10x faster on the CPU for the logits of a 4000 x 3000 photo).
    """
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)


class FiniteLogits:
    """Whether every logit of one pass is finite: :meth:`observe` each batch's logits,
    :meth:`check` once at the end of the pass.

    On the CPU :meth:`observe` raises at once (there is no device to wait for). On an
    accelerator it adds ``not all_finite(logits)`` to a 0-dim device count, with no
    synchronisation; :meth:`check` reads that count once (one synchronisation per pass).

    Args:
        defer: keep the count for :meth:`check` (True) or raise in :meth:`observe` (False);
            None: defer on an accelerator, not on the CPU.

    Raises:
        NonFiniteLogitsError: from :meth:`observe` (CPU) or :meth:`check` (accelerators).
    """

    def __init__(self, defer: bool | None = None) -> None:
        self.defer = defer
        self.bad: Tensor | None = None  # batches with a non-finite logit (device, 0-dim)
        self.batches = 0

    def observe(self, logits: Tensor) -> Tensor:
        """Note one batch's logits ``(N, K, *S)``; returns them."""
        self.batches += 1
        finite = all_finite(logits)
        defer = self.defer if self.defer is not None else logits.device.type != "cpu"
        if not defer:
            if not bool(finite):
                raise NonFiniteLogitsError(self.message(1))
            return logits
        count = (~finite).to(torch.int64)
        self.bad = count if self.bad is None else self.bad + count
        return logits

    def check(self) -> None:
        """Raise if a batch of the pass had a NaN or infinite logit (one host read)."""
        if self.bad is not None:
            count = int(self.bad)
            self.bad = None
            if count:
                raise NonFiniteLogitsError(self.message(count))

    def message(self, count: int) -> str:
        where = "" if self.batches <= 1 else f" in {count} of {self.batches} batches"
        return f"the network returned NaN or infinite logits{where}; {NON_FINITE_HINT}."


def _checked(logits: Tensor, finite: FiniteLogits | None) -> Tensor:
    """``logits``, noted by the pass's ``finite`` or (None) checked now."""
    if finite is not None:
        return finite.observe(logits)
    once = FiniteLogits()
    once.observe(logits)
    once.check()
    return logits


def input_multiple(model: nn.Module) -> int:
    """The side multiple an smp network needs (its encoder's output stride), a network's own
    ``input_multiple`` (:class:`cals_seg.models.external.ExternalSegmenter`), else 1."""
    if isinstance(getattr(model, "input_multiple", None), int):
        return model.input_multiple
    if not getattr(model, "requires_divisible_input_shape", False):
        return 1
    return int(getattr(getattr(model, "encoder", None), "output_stride", 1))


def _fill(protocol: EvalProtocol, like: Tensor) -> Tensor:
    """``(1, 3, 1, 1)``: a black pixel after normalisation, the value padding is filled with."""
    mean = torch.tensor(protocol.mean, dtype=like.dtype, device=like.device)
    std = torch.tensor(protocol.std, dtype=like.dtype, device=like.device)
    return (-mean / std).view(1, -1, 1, 1)


def _pad(x: Tensor, height: int, width: int, fill: Tensor) -> Tensor:
    """``x (N, C, h, w)`` padded at the bottom/right to ``(height, width)`` with ``fill``."""
    h, w = x.shape[-2:]
    if (h, w) == (height, width):
        return x
    out = fill.expand(x.shape[0], x.shape[1], height, width).clone()
    out[..., :h, :w] = x
    return out


def _forward(model: nn.Module, x: Tensor, protocol: EvalProtocol, fill: Tensor, amp: str) -> Tensor:
    """Logits ``(N, K, h, w)`` float32 of ``x (N, 3, h, w)``, padded to the network's multiple
    for the forward pass and cropped back."""
    h, w = x.shape[-2:]
    m = protocol.multiple or input_multiple(model)
    padded = _pad(x, math.ceil(h / m) * m, math.ceil(w / m) * m, fill)
    with autocast_context(x.device, amp):
        logits = model(padded)
    return logits[..., :h, :w].float()


def _starts(size: int, tile: int, stride: int) -> list[int]:
    """Tile origins along one side: every ``stride``, the last one flush with the end."""
    count = max(size - tile + stride - 1, 0) // stride + 1
    return sorted({min(i * stride, size - tile) for i in range(count)})


def _slide(model: nn.Module, x: Tensor, protocol: EvalProtocol, fill: Tensor, amp: str) -> Tensor:
    """Logits ``(1, K, h, w)`` of one image ``x (1, 3, h, w)``: the mean over the tiles that
    cover each pixel."""
    h, w = x.shape[-2:]
    th, tw = min(protocol.window, h), min(protocol.window, w)
    boxes = [(y, x0) for y in _starts(h, th, protocol.stride)
             for x0 in _starts(w, tw, protocol.stride)]
    total: Tensor | None = None
    count = torch.zeros((1, 1, h, w), device=x.device)
    for i in range(0, len(boxes), protocol.tile_batch):
        chunk = boxes[i:i + protocol.tile_batch]
        tiles = torch.cat([x[..., y:y + th, x0:x0 + tw] for y, x0 in chunk])
        logits = _forward(model, tiles, protocol, fill, amp)
        if total is None:
            total = torch.zeros((1, logits.shape[1], h, w), device=x.device)
        for (y, x0), tile in zip(chunk, logits, strict=True):
            total[0, :, y:y + th, x0:x0 + tw] += tile
            count[0, :, y:y + th, x0:x0 + tw] += 1
    return total.div_(count) if len(boxes) > 1 else total


def resized_shape(height: int, width: int, longest: int | None) -> tuple[int, int]:
    """``(h, w)`` with the longest side ``longest`` and the aspect kept (``None``: unchanged)."""
    if longest is None:
        return height, width
    scale = longest / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


@torch.no_grad()
def segment_logits(
    model: nn.Module, images: Tensor, protocol: EvalProtocol | None = None, amp: str = "none",
    finite: FiniteLogits | None = None,
) -> Tensor:
    """Logits of normalised images at their own resolution, whatever the network input was.

    Steps: resize the input (``protocol.resize``, bilinear, antialiased when shrinking), pad it
    (``protocol.pad``), run it whole or tile by tile (``protocol.mode``), crop the padding off
    the logits, and upsample them bilinearly (``align_corners=False``) to ``(H, W)``. With the
    default protocol and sides divisible by ``multiple`` this is ``model(images).float()``.

    Args:
        model: maps ``(n, 3, h, w)`` to ``(n, K, h, w)`` logits; put in eval mode by the caller.
        images: normalised images (what the dataset returns).
        protocol: see :class:`EvalProtocol` (default: whole images, no resize, no padding).
        amp: resolved precision of the forward pass (``none``, ``bf16``, ``fp16``).
        finite: the pass's :class:`FiniteLogits` (read once at its end on an accelerator);
            None: these logits are checked now (on an accelerator: one synchronisation).

    Shape:
        ``images (N, 3, H, W)`` -> logits ``(N, K, H, W)`` float32.

    Raises:
        NonFiniteLogitsError: a NaN or infinite logit (with ``finite`` on an accelerator: at
            ``finite.check()``).

    Inside a :func:`cals_seg.evaluation.logit_cache.logit_cache` block, images already run with
    this model, protocol and precision are served from memory (one network call per distinct
    input within an evaluation).
    """
    protocol = protocol or EvalProtocol()
    return _checked(cached_logits(model, images, (repr(protocol), amp),
                                  lambda: _segment_logits(model, images, protocol, amp)), finite)


def _segment_logits(model: nn.Module, images: Tensor, protocol: EvalProtocol, amp: str
                    ) -> Tensor:
    """:func:`segment_logits` without the cache."""
    height, width = images.shape[-2:]
    fill = _fill(protocol, images)
    x = images
    h, w = resized_shape(height, width, protocol.resize)
    if (h, w) != (height, width):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False,
                          antialias=h < height)
    if protocol.pad is not None:
        x = _pad(x, max(h, protocol.pad), max(w, protocol.pad), fill)
    if protocol.mode == "slide":
        logits = torch.cat([_slide(model, x[i:i + 1], protocol, fill, amp)
                            for i in range(x.shape[0])])
    else:
        logits = _forward(model, x, protocol, fill, amp)
    logits = logits[..., :h, :w]
    if (h, w) != (height, width):
        logits = F.interpolate(logits, size=(height, width), mode="bilinear",
                               align_corners=False)
    return logits


@dataclass
class Prediction:
    """Per-pixel outputs of :func:`predict_image`, at the images' resolution.

    Shape:
        ``label (N, H, W)`` int64, the arg-max class; ``confidence (N, H, W)`` float32, the top
        softmax probability of ``logits / T``; ``entropy (N, H, W)`` float32, in nats,
        ``-sum_k p_k log p_k``; ``probs (N, K, H, W)`` float32 when asked for, else None;
        ``outside_fit (N,)`` bool when the calibrator can tell whether an image lies outside
        what it was fitted on (``image_ts``: :meth:`~cals_seg.calibrators.image_ts.
        ImageTemperatureScaling.outside_fit`), else None.
    """

    label: Tensor
    confidence: Tensor
    entropy: Tensor
    probs: Tensor | None = None
    outside_fit: Tensor | None = None


def calibrated_outputs(logits: Tensor, temperature: float = 1.0,
                       return_probs: bool = False) -> Prediction:
    """Label, confidence and entropy of ``softmax(logits / T)``, computed in bands of rows so
    that the temporaries stay small next to the logits.

    Shape:
        ``logits (N, K, H, W)``.
    """
    if not temperature > 0:
        raise ValueError(f"Expected a positive temperature, but got {temperature}.")
    n, k, height, width = logits.shape
    label = torch.empty((n, height, width), dtype=torch.long, device=logits.device)
    confidence = torch.empty((n, height, width), device=logits.device)
    entropy = torch.empty((n, height, width), device=logits.device)
    probs = torch.empty((n, k, height, width), device=logits.device) if return_probs else None
    for top in range(0, height, _ROWS_PER_CHUNK):
        rows = slice(top, top + _ROWS_PER_CHUNK)
        log_p = torch.log_softmax(logits[:, :, rows].float() / temperature, dim=1)
        p = log_p.exp()
        confidence[:, rows], label[:, rows] = p.max(dim=1)
        entropy[:, rows] = -(p * log_p).sum(dim=1)
        if probs is not None:
            probs[:, :, rows] = p
    return Prediction(label, confidence, entropy, probs)


def normalise(images: np.ndarray, protocol: EvalProtocol | None = None) -> Tensor:
    """``uint8`` RGB images to the network's input: ``(x / 255 - mean) / std`` with
    albumentations' ``Normalize``, the transform the evaluation datasets apply.

    Shape:
        ``images (H, W, 3)`` or ``(N, H, W, 3)`` uint8 -> ``(N, 3, H, W)`` float32.
    """
    import albumentations as A  # the library itself stays importable without it

    protocol = protocol or EvalProtocol()
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"Expected uint8 RGB images of shape (H, W, 3) or (N, H, W, 3), but got "
            f"{images.dtype} {images.shape}."
        )
    norm = A.Normalize(mean=protocol.mean, std=protocol.std)
    return torch.stack([torch.from_numpy(norm(image=im)["image"]).permute(2, 0, 1)
                        for im in images])


@torch.no_grad()
def predict_image(
    model: nn.Module,
    images: np.ndarray | Tensor,
    temperature: float = 1.0,
    protocol: EvalProtocol | None = None,
    amp: str = "none",
    return_probs: bool = False,
    calibrator: nn.Module | None = None,
) -> Prediction:
    """Calibrated per-pixel predictions of a model at the images' own resolution.

    The logits come from :func:`segment_logits` (the evaluation's path), are divided by the
    temperature fitted on validation, and turned into label, confidence and entropy.

    Args:
        model: segmentation network returning logits; it is put in eval mode, and the images go
            to the device of its parameters.
        images: ``uint8`` RGB ``(H, W, 3)`` or ``(N, H, W, 3)`` (normalised here), or already
            normalised ``(N, 3, H, W)`` float tensors.
        temperature: ``T`` of temperature scaling (1: the raw softmax).
        protocol: resize / pad / slide settings (see :class:`EvalProtocol`).
        amp: resolved precision of the forward pass.
        return_probs: also return the ``(N, K, H, W)`` probabilities (memory: K floats a pixel).
        calibrator: a fitted :class:`cals_seg.calibrators.Calibrator` applied to the logits
            (with the normalised image when it needs one) instead of the temperature; the
            label is then the argmax of its output.

    Returns:
        A :class:`Prediction` on the model's device.
    """
    model.eval()
    device = next(model.parameters()).device
    x = images if isinstance(images, Tensor) else normalise(images, protocol)
    x = x.to(device)
    logits = segment_logits(model, x, protocol, amp)
    outside = None
    if calibrator is not None:
        image = x if calibrator.needs_image else None
        with torch.no_grad():
            if hasattr(calibrator, "outside_fit"):
                outside = calibrator.outside_fit(logits, image)
            logits = calibrator(logits, image)
        temperature = 1.0
    out = calibrated_outputs(logits, temperature, return_probs)
    out.outside_fit = outside
    return out


__all__ = [
    "MODES",
    "NON_FINITE_HINT",
    "FiniteLogits",
    "NonFiniteLogitsError",
    "Prediction",
    "EvalProtocol",
    "calibrated_outputs",
    "input_multiple",
    "normalise",
    "predict_image",
    "resized_shape",
    "segment_logits",
]
