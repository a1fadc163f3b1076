"""Region-adaptive CALS-ALM (``cals_alm_bands``): multipliers and margins per class and per
distance band.

One margin and one multiplier per class cannot treat a boundary pixel and an interior pixel of
the same class differently; here every band of the ground truth's distance to the nearest class
boundary (the bands of ``BoundaryCalibrationMeter``, default ``d < 3``, ``3 <= d < 8``,
``d >= 8`` pixels) has its own CALS-ALM multipliers and, with ``margin: auto``, its own margin,
steered by that band's validation calibration.

Kept beside the core (``cals_seg.contrib``): its goal, a band-weighted ECE at most 0.7x CE's at
CE's mIoU, was missed by a wide margin on both embedded regimes (0.94x over three seeds,
docs/studies/spatial_losses.md). Importing this module registers ``cals_alm_bands`` in
``LOSSES``; opt in with ``import cals_seg.contrib.cals_bands`` or ``contrib: [cals_bands]`` in a
config (a setup file's method entry may carry it).

The module holds, in order: the distance bands of a mask (:func:`distance_bands`,
:class:`BandMap`, computed by the training data), the penalty with per-band parameters and its
analytic backward (:func:`band_penalty`), and the loss (:class:`BandCALSALMLoss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from cals_seg.contrib.auto_margin import beyond_chance, next_margin
from cals_seg.losses._adaptive import AdaptiveLoss
from cals_seg.losses._alm import ALMRules, ALMSettings
from cals_seg.losses._base import as_float32, autocast_off
from cals_seg.losses._functional import blocks, ce_sum, class_sums
from cals_seg.losses._spatial import SpatialLoss
from cals_seg.losses.margin_rules import MarginSettings
from cals_seg.losses.penalties import Penalty
from cals_seg.losses.registry import LOSSES
from cals_seg.losses.temperature_stats import (
    NUM_BINS,
    class_counts,
    effective_margin_sums,
    largest_gap_bound,
    solve_temperature,
)
from cals_seg.metrics.distance import int_thresholds, label_map_bands
from cals_seg.utils.validation import check_finite

# --------------------------------------------------------------------------------------------
# The bands of a mask (the training data's extra input), NumPy on the CPU: OpenCV's exact
# Euclidean distance transform, imported when first used, so that the training bands are
# computed where the data is loaded, not on the accelerator.
# --------------------------------------------------------------------------------------------

ExtraInputFn = Callable[[np.ndarray, np.ndarray | None], np.ndarray]


def distance_bands(target: np.ndarray, bands: Sequence[float], ignore_index: int,
                   inside: np.ndarray | None = None) -> np.ndarray:
    """The band of every pixel: ``b`` with ``edges[b] <= d < edges[b + 1]``, ``edges = [0,
    *bands, inf]`` and ``d`` the exact Euclidean distance to the nearest boundary pixel of the
    same image (:func:`cals_seg.metrics.regions.boundary_bands`, with ``inside`` marking the
    image proper); -1 at void pixels and outside the image. With ``inside=None`` these are
    exactly the bands of ``BoundaryCalibrationMeter(bands=bands)``.

    Shape:
        target: ``(N, H, W)`` integer; inside: ``(N, H, W)`` or None; returns ``(N, H, W)``
        int64.
    """
    from cals_seg.metrics.regions import boundary_bands  # OpenCV

    out = boundary_bands(target, bands, ignore_index, inside)
    out[target == ignore_index] = -1
    if inside is not None:
        out[~inside.astype(bool)] = -1
    return out


class BandMap:
    """The ``band`` map of one augmented mask (a picklable :data:`ExtraInputFn`).

    Args:
        bands: increasing positive distances in pixels (e.g. ``(3, 8)``).
        ignore_index: void label.
    """

    def __init__(self, bands: Sequence[float], ignore_index: int) -> None:
        self.bands, self.ignore_index = tuple(float(b) for b in bands), ignore_index

    def __call__(self, mask: np.ndarray, inside: np.ndarray | None = None) -> np.ndarray:
        """``mask (H, W)`` -> ``(H, W)`` int64 band indices (-1: void or padding)."""
        ins = None if inside is None else inside[None]
        return distance_bands(np.asarray(mask)[None], self.bands, self.ignore_index, ins)[0]

    def __repr__(self) -> str:
        return f"BandMap(bands={self.bands}, ignore_index={self.ignore_index})"


# --------------------------------------------------------------------------------------------
# The CALS-ALM penalty with per-band parameters, and its analytic backward. As
# :func:`cals_seg.losses._functional.class_penalty`, with the margin, the multiplier and the
# penalty parameter of each position taken from its band ``b(i)``::
#
#     z_ik     = d_ik / m_b(i) - 1,        d_ik = max_j l_ij - l_ik
#     penalty  = (1 / (|V| K)) sum_{i in V} sum_k P(z_ik; rho_b(i)k, lambda_b(i)k)
#     g_ik     = P'(z_ik) / (|V| K m_b(i))  on valid positions, 0 elsewhere
#     d penalty / d l_ik = -g_ik + [k == argmax_j l_ij] sum_c g_ic
#
# Backward keeps the logits (alive for the cross-entropy), the ``(N, 1, S)`` maxima and the
# ``(N, S)`` int8 band map; both passes walk the logits in blocks, so every other temporary is
# block-sized and the only logits-sized allocation is the gradient returned.
# --------------------------------------------------------------------------------------------


def _block_params(band: Tensor, margins: Tensor, lambdas: Tensor, rhos: Tensor
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``m (n, 1, s)``, ``lambda (n, K, s)``, ``rho (n, K, s)`` of a block's band map
    ``(n, s)`` (void positions, band -1, take band 0's values; they are masked out)."""
    b = band.long().clamp_(min=0)
    return (margins[b].unsqueeze(1), lambdas[b].permute(0, 2, 1), rhos[b].permute(0, 2, 1))


class _BandPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, band, margins, lambdas, rhos, penalty):  # type: ignore[override]
        with autocast_off(logits.device):
            n, k, s = logits.shape
            maxima = torch.empty((n, 1, s), dtype=logits.dtype, device=logits.device)
            total = torch.zeros((), dtype=torch.float64, device=logits.device)
            for im, pos in blocks(logits):
                x, bb = logits[im, :, pos], band[im, pos]
                mx = x.amax(dim=1, keepdim=True)
                maxima[im, :, pos] = mx
                m, lam, rho = _block_params(bb, margins, lambdas, rhos)
                z = (mx - x).div_(m).sub_(1.0)
                values = penalty.value(z, rho, lam)
                values.masked_fill_((bb < 0).unsqueeze(1), 0.0)
                total += values.sum(dim=2).sum(dim=0, dtype=torch.float64).sum()
            denom = (band >= 0).sum().clamp(min=1) * k
            ctx.save_for_backward(logits, maxima, band, margins, lambdas, rhos)
            ctx.penalty, ctx.denom = penalty, denom
            return (total / denom).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, maxima, band, margins, lambdas, rhos = ctx.saved_tensors
        with autocast_off(logits.device):
            grad = torch.empty_like(logits)
            scale = grad_out / ctx.denom
            for im, pos in blocks(logits):
                x, mx, bb = logits[im, :, pos], maxima[im, :, pos], band[im, pos]
                m, lam, rho = _block_params(bb, margins, lambdas, rhos)
                z = (mx - x).div_(m).sub_(1.0)
                g = ctx.penalty.derivative(z, rho, lam)
                # g_ik = P'(z_ik) valid_i grad_out / (|V| K m_b(i)); -g_ik, and the arg-max
                # class gets sum_c g_ic (shared between tied maxima, as amax's autograd).
                g = g.mul_(((bb >= 0).to(g.dtype) * -scale).unsqueeze(1) / m)
                is_max = (x == mx).to(g.dtype)
                share = g.sum(dim=1, keepdim=True).div_(is_max.sum(dim=1, keepdim=True)).neg_()
                grad[im, :, pos] = g.addcmul_(is_max, share)
        return grad, None, None, None, None, None


def band_penalty(logits: Tensor, band: Tensor, margins: Tensor, lambdas: Tensor, rhos: Tensor,
                 penalty: Penalty) -> Tensor:
    """Mean over valid positions and classes of ``P(z; rho, lambda)`` with per-band parameters
    (the formulas above), with the analytic backward.

    Args:
        logits: ``(N, K, S)`` floating point.
        band: ``(N, S)`` integer band index, -1 on void positions.
        margins: ``(B,)``; lambdas, rhos: ``(B, K)``; all in the logits' dtype and device.
        penalty: its ``value`` and ``derivative`` (elementwise, broadcasting).

    Returns:
        0-dim tensor; 0 with a zero gradient when no position is valid.
    """
    return _BandPenalty.apply(logits, band.to(torch.int8), margins, lambdas, rhos, penalty)


# --------------------------------------------------------------------------------------------
# The loss.
# --------------------------------------------------------------------------------------------

MARGIN_STEERS = ("band", "adjacent", "pooled_gate")


@LOSSES.register("cals_alm_bands")
class BandCALSALMLoss(ALMRules, AdaptiveLoss, SpatialLoss):
    """CALS-ALM with multipliers, penalty parameters and margins per class and distance band.

    Pixel ``i`` of a training mask is in band ``b(i)`` when ``edges[b] <= d(i) < edges[b + 1]``,
    ``edges = [0, *bands, inf]`` and ``d(i)`` the exact Euclidean distance to the nearest
    boundary pixel of its mask (a valid pixel with one of its 8 neighbours of another value,
    void included; the edges of the image, and of a crop, are not boundaries). Training loss::

        z_ik = (max_j l_ij - l_ik) / m_b(i) - 1
        loss = CE(l, y) + (1 / (|V| K)) sum_{i in V} sum_k P(z_ik; rho_b(i)k, lambda_b(i)k)

    After epoch ``j``, per band ``b`` from its ``n_b`` valid validation pixels (bands of the
    validation target, computed by :meth:`observe`), exactly the CALS-ALM rules::

        lambda_bk <- clip(mean_{i in b} P'(z_ik; rho_bk, lambda_bk), lambda_min, lambda_max)
        zbar_bk   =  mean_{i in b} z_ik
        rho_bk    <- gamma rho_bk  every rho_period epochs if zbar_bk > tau max(0, zbar_prev_bk)
        m_b       <- clip(m_b / T_b, margin_min, min(margin_max, G_b))      (margin "auto")

    with ``G_b`` band ``b``'s largest logit gap and ``T_b`` the temperature that matches the
    validation confidence of the pixels that steer band ``b`` to their accuracy
    (:mod:`cals_seg.losses.temperature_stats`), chosen by ``margin_steer``:

    - ``"band"``: band ``b``'s own pixels;
    - ``"adjacent"``: the pixels of bands ``b - 1``, ``b`` and ``b + 1`` together. A network
      cannot confine a band's penalty to that band's pixels (neighbouring pixels share
      features), so the margin answers to the pixels its penalty reaches;
    - ``"pooled_gate"``: band ``b``'s own pixels while all the valid validation pixels together
      are over-confident (``T_all >= 1``); otherwise every band takes ``T_all`` (the margins
      grow), so no band's penalty can make the whole set under-confident.

    A band without validation pixels keeps its values. With one band (``bands=()``) this is
    CALS-ALM, for every ``margin_steer``.

    The band map of a training batch comes with the data: the training transform computes it
    on the CPU from the augmented mask (``extra_inputs = ("band",)``, see
    :mod:`cals_seg.data.extra_inputs`) and the training step passes ``band=``. Called without
    it, the loss computes it from ``target`` (a copy to the CPU).

    Args:
        num_classes: K.
        bands: increasing positive distances in pixels (default ``(3, 8)``: three bands).
        margin: the initial margin of every band, a number (fixed) or ``"auto"``.
        penalty, lambda_init, rho_init, gamma, tau, rho_period, lambda_min, lambda_max,
            rho_min, rho_max, margin_init, margin_min, margin_max, margin_warmup, margin_rate,
            margin_skill: as :class:`CALSALMLoss`, per band.
        margin_steer: which validation pixels steer each band's margin (above), with
            ``margin: auto``.
        ignore_index: void label.

    Shape:
        logits: ``(N, K, H, W)``; target: ``(N, H, W)``; band: ``(N, H, W)`` integer in
        ``[0, B)`` at valid pixels (any value at void ones). Other shapes are refused.

    Buffers (in ``state_dict``): ``lambdas``, ``rhos``, ``zbar_prev`` ``(B, K)`` float64,
    ``has_prev (B,)`` bool and ``margins (B,)`` float64: ``O(K B)``. Validation sums:
    ``(B, K)``, and ``(B, bins)`` with ``"auto"``.
    """

    loss_name = "cals_alm_bands"
    extra_inputs = ("band",)
    check_attributes = (*AdaptiveLoss.check_attributes, "_unchecked_bad_bands")
    settings_types = (ALMSettings, MarginSettings)

    def __init__(
        self,
        num_classes: int,
        bands: Sequence[float] = (3.0, 8.0),
        margin: float | Literal["auto"] = "auto",
        ignore_index: int = -100,
        margin_steer: Literal["band", "adjacent", "pooled_gate"] = "pooled_gate",
        **settings: Any,
    ) -> None:
        super().__init__(num_classes, ignore_index)
        # pixels of deferred calls' band maps outside [0, B) (read by check())
        self._unchecked_bad_bands = torch.zeros((), dtype=torch.int64)
        alm, auto = self.settings(settings)
        bands = tuple(bands) if isinstance(bands, list | tuple) else bands
        if not isinstance(bands, tuple) or not all(
            isinstance(b, int | float) and not isinstance(b, bool) and 0 < b < math.inf
            for b in bands
        ) or any(b >= c for b, c in zip(bands, bands[1:], strict=False)):
            raise ValueError(
                f"Expected `bands` to be increasing positive finite distances, but got {bands!r}."
            )
        self.bands = tuple(float(b) for b in bands)
        self._thresholds = int_thresholds(self.bands)  # made here: no numpy inside a call
        self.auto_margin, margin = auto.start(margin)
        self._set_alm_rules(alm)
        auto.keep(self)
        if margin_steer not in MARGIN_STEERS:
            raise ValueError(f"Expected `margin_steer` to be one of {MARGIN_STEERS}, but got "
                             f"{margin_steer!r}.")
        self.margin_steer = margin_steer
        nb, k = len(self.bands) + 1, num_classes
        self.num_bands = nb
        self.add_state("lambdas", torch.full((nb, k), float(alm.lambda_init), dtype=torch.float64))
        self.add_state("rhos", torch.full((nb, k), float(alm.rho_init), dtype=torch.float64))
        self.add_state("zbar_prev", torch.zeros((nb, k), dtype=torch.float64))
        self.add_state("has_prev", torch.zeros(nb, dtype=torch.bool))
        self.add_state("margins", torch.full((nb,), float(margin), dtype=torch.float64))
        self.add_statistic("_sum_grad", (nb, k))
        self.add_statistic("_sum_z", (nb, k))
        self.add_statistic("_band_count", nb)
        keys = ["lambda", "rho", "constraint"]
        if self.auto_margin:
            self.add_statistic("_meff_hist", (nb, NUM_BINS))
            self.add_statistic("_gap_hist", (nb, NUM_BINS))
            self.add_statistic("_correct", nb)
            self.add_statistic("_class_count", (nb, k))  # the chance gate of each band
            keys += ["margin", "margin_temperature", "margin_ceiling", "margin_skill"]
        self.log_keys = (*(f"{key}_band{b}" for key in keys for b in range(nb)), "band_pixels")

    def extra_input_fns(self) -> dict[str, BandMap]:
        """``{"band": BandMap}``: the training transform's per-pixel band map."""
        return {"band": BandMap(self.bands, self.ignore_index)}

    def band_map(self, target: Tensor) -> Tensor:
        """The bands of ``target (N, H, W)`` (the meter's rule, :func:`distance_bands`),
        computed on its device (exact distances in torch); -1 at void pixels."""
        band = label_map_bands(target, self.bands, self.ignore_index, self._thresholds)
        return band.masked_fill_(target == self.ignore_index, -1)

    def check(self) -> None:
        """:meth:`SegLoss.check`, and the band maps: raise if a deferred call got a ``band``
        map with values outside ``[0, B)`` at valid pixels (those pixels were left out of the
        penalty)."""
        pending = self._unchecked_bad_bands
        self._unchecked_bad_bands = torch.zeros_like(pending)
        super().check()
        count = int(pending)
        if count:
            raise ValueError(f"{self._bad_band_message()} ({count} pixel(s), found by the "
                             "criterion's deferred check)")

    def _bad_band_message(self) -> str:
        return (f"`band` holds values outside [0, {self.num_bands}) at valid pixels; it must "
                f"come from BandMap(bands={self.bands}) of the same (augmented) mask.")

    # ------------------------------------------------------------------ training loss
    def forward(self, logits: Tensor, target: Tensor, band: Tensor | None = None) -> Tensor:
        """Scalar loss (class docstring); ``band`` from the training data, or computed from
        ``target`` when None.

        Raises:
            ValueError: bad shapes or labels, or a band map of another shape or with values
                outside ``[0, B)`` at valid pixels.
        """
        with autocast_off(logits.device):
            logits, target, valid = self._prepare(as_float32(logits), target,
                                                  deferred=self.deferred_checks)
            if band is None:
                band = self.band_map(target)
            elif band.shape != target.shape or band.is_floating_point():
                raise ValueError(
                    f"Expected `band` to be an integer map of shape {tuple(target.shape)} (the "
                    f"target's), but got {band.dtype} {tuple(band.shape)}."
                )
            band = band.to(target.device)
            bad = ((band < 0) | (band >= self.num_bands)) & valid
            if not self.deferred_checks:
                if bool(bad.any()):
                    raise ValueError(self._bad_band_message())
            else:  # counted on the device, reported by check(); those pixels get no penalty
                self._unchecked_bad_bands = bad.sum() + self._unchecked_bad_bands
                band = band.masked_fill(bad, -1)
            band = band.to(torch.int8).masked_fill_(~valid, -1)  # 1 byte per pixel
            n, k = logits.shape[:2]
            flat = logits.reshape(n, k, -1)
            ce = ce_sum(flat, target.reshape(n, -1), self.ignore_index) / valid.sum().clamp(min=1)
            like = dict(dtype=flat.dtype, device=flat.device)
            pen = band_penalty(flat, band.reshape(n, -1), self.margins.to(**like),
                               self.lambdas.to(**like), self.rhos.to(**like), self.penalty)
            self.terms = {"ce": ce.detach(), "penalty": pen.detach()}
            return ce + pen

    # ------------------------------------------------------------------ validation
    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        n, k = logits.shape[:2]
        flat, target2 = logits.reshape(n, k, -1), target.reshape(n, -1)
        check_finite(flat)
        band = self.band_map(target).reshape(n, -1)
        like = dict(dtype=flat.dtype, device=flat.device)
        margins = self.margins.tolist()  # the margins in force
        out: dict[str, list[Tensor]] = {}
        for b in range(self.num_bands):
            in_band = valid.reshape(n, -1) & (band == b)
            lam = self.lambdas[b].to(**like).view(1, -1, 1)
            rho = self.rhos[b].to(**like).view(1, -1, 1)
            fns = [lambda z, rho=rho, lam=lam: self.penalty.derivative(z, rho, lam),
                   lambda z: z]
            grad, z = class_sums(flat, in_band, margins[b], fns)
            out.setdefault("_sum_grad", []).append(grad)
            out.setdefault("_sum_z", []).append(z)
            out.setdefault("_band_count", []).append(in_band.sum().to(torch.float64))
            if self.auto_margin:
                hist, gaps, correct = effective_margin_sums(flat, target2, in_band)
                out.setdefault("_meff_hist", []).append(hist)
                out.setdefault("_gap_hist", []).append(gaps)
                out.setdefault("_correct", []).append(correct)
                out.setdefault("_class_count", []).append(class_counts(target2, in_band, k))
        return {key: torch.stack(values) for key, values in out.items()}

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict[str, Any]:
        """The CALS-ALM rules band by band (class docstring).

        Returns:
            per band ``b``: ``lambda_band{b}``, ``rho_band{b}`` (K floats, after the update),
            ``constraint_band{b}`` (this epoch's zbar, K floats; None for an empty band) and with
            ``"auto"`` ``margin_band{b}`` (the margin now in force), ``margin_temperature_band{b}``
            and ``margin_ceiling_band{b}``; ``band_pixels`` (validation pixels per band).
        """
        counts = stats["_band_count"]
        logs: dict[str, Any] = {"band_pixels": counts.tolist()}
        for b in range(self.num_bands):
            nb = float(counts[b])
            zbar = stats["_sum_z"][b] / max(nb, 1.0)
            if nb > 0:
                lam = (stats["_sum_grad"][b] / nb).clamp_(self.lambda_min, self.lambda_max)
                self.lambdas[b].copy_(lam)
                self._step_rhos(epoch, self.rhos[b], zbar, self.zbar_prev[b],
                                bool(self.has_prev[b]))
                self.zbar_prev[b].copy_(zbar)
                self.has_prev[b] = True
            if self.auto_margin:  # the multipliers follow a margin that moves
                logs.update(self._update_margin(b, epoch, stats, nb))
            logs[f"lambda_band{b}"] = self.lambdas[b].tolist()
            logs[f"rho_band{b}"] = self.rhos[b].tolist()
            logs[f"constraint_band{b}"] = zbar.tolist() if nb > 0 else None
        return logs

    def _steering(self, b: int, stats: dict[str, Tensor]) -> tuple[Tensor, float, Tensor]:
        """The statistics that steer band ``b``'s margin under ``margin_steer``: the ``m_eff``
        histogram, the number of correct pixels and the pixels per class, summed over the band
        (``"band"``, ``"pooled_gate"``) or over it and its adjacent bands (``"adjacent"``)."""
        lo, hi = (max(b - 1, 0), min(b + 2, self.num_bands)) if (
            self.margin_steer == "adjacent") else (b, b + 1)
        return (stats["_meff_hist"][lo:hi].sum(0), float(stats["_correct"][lo:hi].sum()),
                stats["_class_count"][lo:hi].sum(0))

    def _pooled_temperature(self, stats: dict[str, Tensor]) -> float | None:
        """``T_all``: the temperature of all valid validation pixels together (None if none)."""
        hist = stats["_meff_hist"].sum(0)
        if float(hist.sum()) <= 0:
            return None
        return solve_temperature(hist, float(stats["_correct"].sum()), self.num_classes)

    def _update_margin(self, b: int, epoch: int, stats: dict[str, Tensor],
                       nb: float) -> dict[str, float]:
        """Band ``b``'s margin: the rule of CALS-ALM's ``margin: auto``
        (:func:`~cals_seg.contrib.auto_margin.next_margin`, at most a factor
        ``margin_rate`` per epoch, held while the steering
        pixels are at chance) on the statistics ``margin_steer`` chooses; the band's multipliers
        follow the margin as CALS-ALM's do: ``lambda <- lambda m' / m``,
        ``zbar_prev <- (m / m')(zbar_prev + 1) - 1``.
        """
        t_hat: float | None = None
        ceiling: float | None = None
        skill: float | None = None
        if nb > 0:
            hist, correct, counts = self._steering(b, stats)
            learned, skill = beyond_chance(correct, counts, self.margin_skill)
            t_hat = solve_temperature(hist, correct, self.num_classes)
            if self.margin_steer == "pooled_gate":
                t_all = self._pooled_temperature(stats)
                if t_all is not None and t_all < 1.0:
                    t_hat = t_all
            ceiling = largest_gap_bound(stats["_gap_hist"][b])
            if epoch + 1 > self.margin_warmup and learned:
                old = float(self.margins[b])
                new = next_margin(old, t_hat, ceiling, self.margin_min, self.margin_max,
                                  self.margin_rate)
                if new != old:
                    self.margins[b] = new
                    new = float(self.margins[b])
                    self.lambdas[b].mul_(new / old).clamp_(self.lambda_min, self.lambda_max)
                    self.zbar_prev[b].add_(1.0).mul_(old / new).sub_(1.0)
        return {f"margin_band{b}": float(self.margins[b]),
                f"margin_temperature_band{b}": t_hat, f"margin_ceiling_band{b}": ceiling,
                f"margin_skill_band{b}": skill}

    def extra_repr(self) -> str:
        auto = " (auto)" if self.auto_margin else ""
        margins = ", ".join(f"{m:g}" for m in self.margins.tolist())
        steer = f", margin_steer={self.margin_steer}" if self.auto_margin else ""
        return (f"{super().extra_repr()}, bands={self.bands}, margins=[{margins}]{auto}"
                f"{steer}, penalty={self.penalty.name}")
