"""Neighbourhood machinery of the spatial losses (SVLS, NACL, CRaC): label proportions in a
``k x k`` window and the boundary / interior split of the windows.

A reader who wants a loss formula can skip this file. Notation: target ``y (N, H, W)``, the
window ``W(i)`` of pixel ``i`` (``k x k``, centred), kernel weights ``w_j`` over the window's
offsets. The *neighbourhood distribution* of a valid pixel ``i`` is::

    q_ik = ( sum_{j in W(i), j valid} w_j [y_j = k]  +  (1 / K) sum_{j in W(i), j void} w_j )
           / sum_{j in W(i)} w_j

A void neighbour's label is unknown: its weight is spread evenly over the K classes, so ``q``
sums to 1. (Leaving void neighbours out would make SVLS exactly CE on masks that outline every
object with void, as VOC and the synthetic data do; docs/spatial_losses.md compares the
choices.) Outside the image the label map is padded as the authors pad it: with class 0
(``padding="zeros"``, NACL and CRaC, whose ``nn.Unfold`` pads with zeros) or with the nearest
border label (``padding="replicate"``, SVLS). Without void pixels ``q`` is exactly the authors'
target; docs/spatial_losses.md compares the two where there is void.

The sums are ``k^2`` scatter-adds of one weight per pixel into a ``(N, K + 1, H, W)`` buffer in
the logits' dtype (the extra channel collects void neighbours): no convolution, so no TF32 on a
GPU, and each position receives one addition per offset (deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cals_seg.losses._base import SegLoss

PADDINGS = ("zeros", "replicate")
_TINY = 1e-30  # a kernel whose weights are all 0 (refused earlier; kept safe)


def check_spatial(logits: Tensor, name: str) -> None:
    """Refuse logits that are not ``(N, K, H, W)``: the spatial losses need a 2-D
    neighbourhood."""
    if not torch.is_tensor(logits) or logits.dim() != 4:
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(
            f"Expected `logits` of shape (N, K, H, W) for the spatial loss {name!r} (it needs "
            f"each pixel's 2-D neighbourhood), but got {shape}; use a non-spatial loss for "
            "classification or 1-D/3-D outputs."
        )


def check_kernel_size(kernel_size: int) -> int:
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 3 or (
        kernel_size % 2 == 0
    ):
        raise ValueError(
            f"Expected `kernel_size` to be an odd integer >= 3, but got {kernel_size!r}."
        )
    return kernel_size


class SpatialLoss(SegLoss):
    """A :class:`SegLoss` whose :meth:`_forward` (and ``_observe``) get the spatial layout:
    ``logits (N, K, H, W)``, ``target (N, H, W)`` int64, ``valid (N, H, W)`` bool. Other
    shapes are refused with a message; checks, float32 and autocast-off are the base's."""

    loss_name = "spatial"

    def _prepare(self, logits: Tensor, target: Tensor,
                 deferred: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        check_spatial(logits, self.loss_name)
        logits3, target2, valid = self._check_flatten(logits, target, deferred)
        n, k, h, w = logits.shape
        return logits, target2.view(n, h, w), valid.view(n, h, w)


def gaussian_svls_kernel(kernel_size: int = 3, sigma: float = 1.0) -> Tensor:
    """The SVLS kernel (Islam and Glocker, 2021): a normalised Gaussian ``g`` whose centre
    weight is replaced by the sum of the others, ``w_c = sum_{j != c} g_j``; returned divided by
    that sum, so ``w_c = 1`` and ``w_j = g_j / (1 - g_c)`` (the weights add up to 2: half of the
    soft label is the pixel's own label).

    Returns:
        ``(kernel_size, kernel_size)`` float64.
    """
    if not (isinstance(sigma, int | float) and not isinstance(sigma, bool) and sigma > 0):
        raise ValueError(f"Expected `sigma` > 0, but got {sigma!r}.")
    r = torch.arange(kernel_size, dtype=torch.float64) - (kernel_size - 1) / 2
    g = torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / (2 * float(sigma) ** 2))
    g = g / g.sum()
    c = kernel_size // 2
    rest = 1.0 - g[c, c]
    g[c, c] = rest
    return g / rest


def mean_weights(kernel_size: int = 3) -> list[list[float]]:
    """The mean kernel as nested lists of 1.0 (exact in every dtype)."""
    return [[1.0] * kernel_size for _ in range(kernel_size)]


def padded_labels(target: Tensor, valid: Tensor, num_classes: int, pad: int,
                  padding: str) -> Tensor:
    """``(N, H + 2 pad, W + 2 pad)`` int64 labels with void set to ``num_classes`` and the
    border padded with class 0 (``"zeros"``) or the nearest label (``"replicate"``)."""
    if padding not in PADDINGS:
        raise ValueError(f"Expected `padding` to be one of {list(PADDINGS)}, but got {padding!r}.")
    labels = target.masked_fill(~valid, num_classes)
    if padding == "zeros":
        return F.pad(labels, (pad, pad, pad, pad), value=0)
    # Replicate: indices of the nearest row / column inside the image.
    n, h, w = labels.shape
    rows = torch.arange(-pad, h + pad, device=labels.device).clamp_(0, h - 1)
    cols = torch.arange(-pad, w + pad, device=labels.device).clamp_(0, w - 1)
    return labels[:, rows][:, :, cols]


def neighbourhood_distribution(
    target: Tensor, valid: Tensor, num_classes: int, kernel: Tensor | list[list[float]],
    padding: str = "zeros",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The weighted label distribution ``q`` of every pixel's window (module docstring).

    Args:
        target: ``(N, H, W)`` int64 (void positions may hold any value).
        valid: ``(N, H, W)`` bool.
        num_classes: K.
        kernel: ``(k, k)`` non-negative weights with a positive centre, k odd: a tensor (its
            values rounded to ``dtype``), or nested lists of floats already exact in ``dtype``
            (what the losses pass: no tensor is read on the host inside a call).
        padding: ``"zeros"`` or ``"replicate"``.
        dtype: of the result (the logits' float32, or float64 in the tests' references).

    Returns:
        ``(N, K, H, W)`` in ``dtype``; every row sums to 1.
    """
    weights = kernel.to(dtype).tolist() if isinstance(kernel, Tensor) else kernel
    k = len(weights)
    pad = k // 2
    n, h, w = target.shape
    labels = padded_labels(target, valid, num_classes, pad, padding)
    acc = torch.zeros((n, num_classes + 1, h, w), dtype=dtype, device=target.device)
    for dy in range(k):
        for dx in range(k):
            if weights[dy][dx] == 0.0:
                continue
            lab = labels[:, dy:dy + h, dx:dx + w].unsqueeze(1)
            acc.scatter_add_(1, lab, torch.full_like(lab, weights[dy][dx], dtype=dtype))
    total = acc.sum(dim=1, keepdim=True)
    q = acc[:, :num_classes].add_(acc[:, num_classes:], alpha=1.0 / num_classes)
    return q.div_(total.clamp_(min=_TINY))


def mixed_windows(target: Tensor, valid: Tensor, num_classes: int, kernel_size: int = 3) -> Tensor:
    """``(N, H, W)`` bool: True where the ``k x k`` window (zero padded, as the CRaC authors'
    ``nn.Unfold``) holds a label other than the centre's; a void neighbour counts as other.

    Shape:
        target, valid: ``(N, H, W)``.
    """
    pad = kernel_size // 2
    n, h, w = target.shape
    labels = padded_labels(target, valid, num_classes, pad, "zeros")
    centre = labels[:, pad:pad + h, pad:pad + w]
    out = torch.zeros((n, h, w), dtype=torch.bool, device=target.device)
    for dy in range(kernel_size):
        for dx in range(kernel_size):
            out |= labels[:, dy:dy + h, dx:dx + w] != centre
    return out
