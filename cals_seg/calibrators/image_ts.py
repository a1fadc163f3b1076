"""``image_ts``: a temperature per pixel, a regularised function of what the image and the
logits show, fitted on clean and corrupted validation images with its clean behaviour protected.

A temperature fitted on clean validation images is one number for a clean image and a fogged
one; on a low-contrast image the network is confidently wrong and that temperature cannot
know it (docs/shift.md). Following parameterized / sample-dependent temperature scaling
(Tomani et al., WACV 2022; Joy et al., AAAI 2023) and perturbation-fitted scaling (Tomani et
al., CVPR 2021), the temperature here depends on the input::

    log T(i, p) = c[band(p)] + sum_f z_f(i, p) (w_f + g(i, p) u_f) + b
    forward(l)(p) = l(p) / T(i, p)

``c`` are the clean-fitted band temperatures (``boundary_ts`` on the clean validation images).
The offset is linear in the standardised statistics ``z`` of the image and of the pixel, and
the gate ``g`` (the pixel's standardised log margin) lets a shift change how confident pixels
are warmed or cooled relative to unsure ones: a veil that makes the network confidently wrong
needs its confident pixels warmed most. With corrupted copies in the fit, every statistic is
centred on the mean clean fit pixel and ``b = 0``: the mean clean pixel gets exactly the
clean-fitted temperature, and an image that looks shifted gets a warmer one *or a colder one*
(on the over-confident embedded runs the network is under-confident on noisy images;
docs/shift.md).

``band(p)`` is the pixel's distance band from the *predicted* boundaries (the bands of
``boundary_ts``: a pixel is a boundary pixel when one of its 8 neighbours inside the image has
another arg-max, ``D`` the exact squared Euclidean distance to the nearest one, band ``b`` where
``ceil(bands[b-1]^2) <= D < ceil(bands[b]^2)``). ``z`` holds, standardised and clipped to the
range seen in the fit (:data:`FEATURES` then :data:`PIXEL_FEATURES`):

- of the image, the same for all its pixels, de-normalised to ``[0, 1]`` RGB (``image_mean``,
  ``image_std``: the evaluation's normalisation), on its luma ``Y = .299 R + .587 G + .114 B``:
  mean brightness, log RMS contrast ``log(std Y + 1e-3)``, log sharpness ``log(var(lap Y) +
  1e-6)`` (the 4-neighbour Laplacian, replicate-padded), log noise ``log(sigma + 1e-4)`` with
  Immerkaer's estimator ``sigma = sqrt(pi / 2) / 6 mean |Y * M|``, ``M = [[1, -2, 1], [-2, 4,
  -2], [1, -2, 1]]`` (replicate-padded), and the mean HSV saturation ``(max - min) / (max +
  1e-3)``;
- of the image's logits: the mean and the spread (population standard deviation over the
  pixels) of the predictive entropy and of the top-1 minus top-2 logit margin;
- of the pixel: its entropy and margin, and their means over the ``9 x 9`` window around it
  (replicate-padded).

``g = (log(m(p) + 0.01) - mean) / scale``, clipped the same way. ``T > 0`` everywhere (``log T``
is clamped to ``[-log 100, log 100]``) and each pixel's logits are divided by one number, so
the arg-max is the network's. ``use_image=False`` drops the five image statistics. The forward
pass is tensor operations only (no numpy, no loop over a data-dependent size): it goes into
``torch.export``.

Fit (:meth:`ImageTemperatureScaling.fit`) on a stream that holds each validation image
followed by ``copies`` corrupted copies (:class:`cals_seg.data.drift_mixtures.CorruptedCopies`:
haze, low light, desaturation, speckle noise, Gaussian blur, spatter, severities 1-5, none of
them the benchmark's; ``eval_seg`` builds it through
:meth:`~ImageTemperatureScaling.fit_data`):

1. validation image ``v`` (with its copies) is held out when ``v % holdout_every ==
   holdout_every - 1``; the others fit;
2. ``c``: the clean-fitted band temperatures (``boundary_ts``'s fit on the clean fit images),
   kept; the standardisation: mean over the pixels of the clean fit images (of all fit images
   without copies), scale the standard deviation over the pixels of all fit images;
3. from ``w = u = 0`` (and ``b = 0``): the reference, ``c`` alone, scored first), full-batch
   L-BFGS (float64, streamed) of ``(w, u)`` (and ``b`` without copies) on ``0.5 mean NLL(clean
   fit pixels) + 0.5 mean NLL(corrupted fit pixels) + lam (|w|^2 + |u|^2)`` for each ``lam``
   of ``lams`` in turn, each stage started where the last ended; every objective pass also
   scores the held-out images;
4. the clean rule: an iterate is admissible when, on the held-out *clean* images, its mean
   per-image NLL exceeds the reference's by at most ``tolerance`` standard errors of the paired
   per-image differences (not worse beyond noise). Of the admissible iterates, the reference
   included, the one with the lowest held-out objective (step 3's two means, on the held-out
   images) is kept; when that is the reference, the calibrator *fell back* to the clean-fitted
   band temperatures, and ``fit_info["fell_back"]`` says so. The stages stop after one that
   did not improve it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from cals_seg.calibrators._base import (
    Batches,
    Calibrator,
    check_finite_nll,
    check_same_data,
    iterate,
    lbfgs_stages,
)
from cals_seg.calibrators._export import graph_bands
from cals_seg.calibrators._image_features import (
    FEATURES,
    GATE,
    IMAGE_FEATURES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LOG_T_MAX,
    PIXEL_FEATURES,
    entropy_margin,
    image_statistics,
    logit_statistics,
    pixel_statistics,
    work_dtype,
)
from cals_seg.calibrators.boundary_ts import BoundaryTemperatureScaling
from cals_seg.calibrators.registry import CALIBRATORS
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.data.drift_mixtures import (
    IMAGE_TS_CORRUPTIONS,
    CorruptedCopies,
    held_out_function,
)
from cals_seg.errors import UserError
from cals_seg.metrics.distance import int_thresholds
from cals_seg.utils.distributed import is_distributed
from cals_seg.utils.validation import check_int, check_positive_float

LAMS = (1.0, 0.1)
# Standard units by which a per-image statistic must leave the fit's range to be flagged
# (:meth:`ImageTemperatureScaling.outside_fit`): float32 evaluation of a fit image's statistics
# differs from the fit's float64 in the 7th digit.
OUTSIDE_TOLERANCE = 1e-4


@CALIBRATORS.register("image_ts")
class ImageTemperatureScaling(Calibrator):
    """A temperature per pixel from image, logit and pixel statistics (module docstring).

    Buffers: ``log_temperatures`` ``(B,)`` (``c``, B = ``len(bands) + 1``), ``weight`` and
    ``interaction`` ``(F,)`` (``w``, ``u``), ``bias`` ``()`` (``b``), ``feature_mean`` /
    ``feature_scale`` ``(F + 1,)`` (the standardisation of the F statistics, then of the gate),
    ``feature_low`` / ``feature_high`` ``(F + 1,)`` (the clip, in standard units); zeros (scale
    1) until fitted, the identity. F = 13, or 8 with ``use_image=False``.

    Args:
        num_classes: K >= 2.
        bands: the band distances in pixels (``boundary_ts``'s); ``[]``: no bands.
        use_image: use the image statistics (then ``forward`` needs the image).
        use_pixel: use the four pixel statistics (else ``z`` is the same for every pixel of an
            image and only the gate varies within it).
        copies: corrupted copies of each validation image that :meth:`fit_data` adds.
        corruptions, seed: the held-out mixture of those copies
            (:class:`cals_seg.data.drift_mixtures.HeldOutMixture`).
        lams: the L2 strengths on ``(w, u)``, tried in turn (each >= 0).
        max_iter: L-BFGS iterations per stage.
        holdout_every: one validation image (with its copies) in ``holdout_every`` is held out
            (>= 2; 0: none, no clean check, the last iterate kept).
        tolerance: the clean rule's allowance, in standard errors.
        image_mean, image_std: the normalisation of the images given (the evaluation's).

    Shape:
        - logits: ``(N, K, H, W)``; image: ``(N, 3, H, W)``; output like logits.
    """

    name = "image_ts"
    changes_argmax = False
    needs_image = True

    log_temperatures: Tensor
    weight: Tensor
    interaction: Tensor
    bias: Tensor
    feature_mean: Tensor
    feature_scale: Tensor
    feature_low: Tensor
    feature_high: Tensor

    def __init__(self, num_classes: int, bands: Sequence[float] = (3.0, 8.0),
                 use_image: bool = True, use_pixel: bool = True, copies: int = 3,
                 corruptions: Sequence[str] | None = None, seed: int = 0,
                 lams: Sequence[float] = LAMS, max_iter: int = 30, holdout_every: int = 5,
                 tolerance: float = 1.0, image_mean: Sequence[float] = IMAGENET_MEAN,
                 image_std: Sequence[float] = IMAGENET_STD) -> None:
        bands = [float(b) for b in bands] if isinstance(bands, list | tuple) else bands
        if not isinstance(bands, list) or not all(0 < b < math.inf for b in bands) or any(
                b >= c for b, c in zip(bands, bands[1:], strict=False)):
            raise UserError(f"Expected `bands` to be increasing positive finite distances, but "
                            f"got {bands!r}.")
        check_int("copies", copies, 0)
        check_int("seed", seed, 0)
        check_int("max_iter", max_iter)
        if holdout_every != 0:
            check_int("holdout_every", holdout_every, 2)
        if not (isinstance(tolerance, int | float) and tolerance >= 0
                and math.isfinite(tolerance)):
            raise UserError(f"Expected `tolerance` to be a finite number >= 0, but got "
                            f"{tolerance!r}.")
        lams = [float(v) for v in lams] if isinstance(lams, list | tuple) else lams
        if not isinstance(lams, list) or not lams or not all(
                math.isfinite(v) and v >= 0 for v in lams):
            raise UserError(f"Expected `lams` to be a non-empty list of numbers >= 0, but got "
                            f"{lams!r}.")
        corruptions = list(IMAGE_TS_CORRUPTIONS if corruptions is None else corruptions)
        for name in corruptions:
            held_out_function(name)
        stats = []
        for key, value in (("image_mean", image_mean), ("image_std", image_std)):
            value = list(value) if isinstance(value, list | tuple) else value
            if not isinstance(value, list) or len(value) != 3:
                raise UserError(f"Expected `{key}` to be 3 numbers, but got {value!r}.")
            for v in value:
                (check_positive_float if key == "image_std" else _check_float)(key, v)
            stats.append([float(v) for v in value])
        super().__init__(num_classes, bands=bands, use_image=bool(use_image),
                         use_pixel=bool(use_pixel), copies=copies,
                         corruptions=corruptions, seed=seed, lams=lams, max_iter=max_iter,
                         holdout_every=holdout_every, tolerance=float(tolerance),
                         image_mean=stats[0], image_std=stats[1])
        self.needs_image = bool(use_image)
        self.thresholds = int_thresholds(bands)
        nf = len(self.feature_names)
        self.register_buffer("log_temperatures", torch.zeros(len(bands) + 1))
        self.register_buffer("weight", torch.zeros(nf))
        self.register_buffer("interaction", torch.zeros(nf))
        self.register_buffer("bias", torch.zeros(()))
        self.register_buffer("feature_mean", torch.zeros(nf + 1))
        self.register_buffer("feature_scale", torch.ones(nf + 1))
        self.register_buffer("feature_low", torch.zeros(nf + 1))
        self.register_buffer("feature_high", torch.zeros(nf + 1))

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The F statistics of ``z``, in the order of ``weight`` (the gate is not among them)."""
        per_image = FEATURES if self.needs_image else FEATURES[IMAGE_FEATURES:]
        return per_image + (PIXEL_FEATURES if self.params["use_pixel"] else ())

    # ------------------------------------------------------------------------- the map
    def features(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """The raw statistics of every pixel (before standardisation): the F of
        :attr:`feature_names`, then the gate ``log(m + 0.01)``.

        Shape:
            - logits: ``(N, K, H, W)``; image: ``(N, 3, H, W)``; returns ``(N, F + 1, H, W)``.
        """
        maps = entropy_margin(logits)  # once for the per-image and the per-pixel statistics
        per_image = self._per_image(logits, image, maps)
        pixel, gate = pixel_statistics(logits, maps)
        n, _, h, w = pixel.shape
        wide = per_image[:, :, None, None].expand(n, per_image.shape[1], h, w)
        parts = [wide, pixel] if self.params["use_pixel"] else [wide]
        return torch.cat([*parts, gate.unsqueeze(1)], dim=1)

    def _per_image(self, logits: Tensor, image: Tensor | None, maps: Tensor) -> Tensor:
        """The per-image statistics ``(N, F_image)``: the image's (with ``use_image``), then
        its logits'."""
        per_image = logit_statistics(logits, maps)
        if self.needs_image:
            img = image_statistics(image, self.params["image_mean"], self.params["image_std"])
            per_image = torch.cat([img.to(per_image.dtype), per_image], dim=1)
        return per_image

    def outside_fit(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """Whether each image lies outside what the fit saw: one of its per-image statistics
        (of the image and of its logits, the first ``F_image`` of :attr:`feature_names`) is
        below the lowest or above the highest value among the fit's images (the clean ones and
        their corrupted copies, held-out ones excluded). There :meth:`forward` clips the
        statistic to that range, so the temperature is the edge's, not one the fit could check.
        All False before fitting.

        Shape:
            - logits: ``(N, K, H, W)``; image: ``(N, 3, H, W)``; returns ``(N,)`` bool.
        """
        self._check(logits, image)
        if not bool((self.feature_high > self.feature_low).any()):  # not fitted: the identity
            return torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        x = logits.to(work_dtype(logits))
        raw = self._per_image(x, None if image is None else image.to(x.dtype),
                              entropy_margin(x))
        f = raw.shape[1]
        dt, dev = raw.dtype, raw.device
        z = (raw - self.feature_mean[:f].to(dev, dt)) / self.feature_scale[:f].to(dev, dt)
        return ((z < self.feature_low[:f].to(dev, dt) - OUTSIDE_TOLERANCE)
                | (z > self.feature_high[:f].to(dev, dt) + OUTSIDE_TOLERANCE)).any(dim=1)

    def _standardised(self, raw: Tensor, mean: Tensor, scale: Tensor, low: Tensor,
                      high: Tensor) -> Tensor:
        dt, shape = raw.dtype, (1, -1, 1, 1)
        z = (raw - mean.to(raw.device, dt).view(shape)) / scale.to(raw.device, dt).view(shape)
        return torch.minimum(torch.maximum(z, low.to(raw.device, dt).view(shape)),
                             high.to(raw.device, dt).view(shape))

    def log_temperature(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """``log T`` of every pixel, ``(N, H, W)`` (float64 for float64 logits, else float32)."""
        z = self._standardised(self.features(logits, image), self.feature_mean,
                               self.feature_scale, self.feature_low, self.feature_high)
        dt = z.dtype
        offset = _offset(z, self.weight.to(z.device, dt), self.interaction.to(z.device, dt),
                         self.bias.to(z.device, dt))
        band = graph_bands(logits, self.thresholds)
        return (self.log_temperatures.to(z.device, dt)[band] + offset).clamp(-LOG_T_MAX,
                                                                           LOG_T_MAX)

    def _check(self, logits: Tensor, image: Tensor | None) -> None:
        self.check_input(logits, image)
        if logits.dim() != 4:
            raise ValueError(
                f"Expected `logits` of shape (N, K, H, W), but got {tuple(logits.shape)}.")
        if self.needs_image and image.shape[1] != 3:
            raise ValueError(f"Expected an RGB image (N, 3, H, W), but got "
                             f"{tuple(image.shape)}.")

    def forward(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        self._check(logits, image)
        dt = work_dtype(logits)
        t = self.log_temperature(logits, image).exp().unsqueeze(1)
        return (logits.to(dt) / t).to(logits.dtype)

    # ------------------------------------------------------------------------- the fit
    def fit_data(self, dataset: Any) -> tuple[Any, dict[str, Any]]:
        """The images the fit streams and the keyword arguments of :meth:`fit`: the validation
        ``dataset`` with ``copies`` corrupted copies of each image interleaved
        (:class:`cals_seg.data.drift_mixtures.CorruptedCopies`; what
        :func:`cals_seg.evaluation.engine.fit_calibrators` streams through the network). A
        split that cannot be corrupted (no image files) is fitted as it is, with a warning."""
        copies = self.params["copies"]
        if not copies:
            return dataset, {"copies": 0}
        try:
            data = CorruptedCopies(dataset, copies, self.params["corruptions"],
                                   seed=self.params["seed"])
        except UserError as err:
            warnings.warn(f"image_ts: fitted on the clean validation images only ({err})",
                          stacklevel=2)
            return dataset, {"copies": 0}
        return data, {"copies": copies}

    def _layout(self, j: Tensor, copies: int) -> tuple[Tensor, Tensor]:
        """``(clean, held)`` flags of stream images ``j``."""
        period, every = copies + 1, self.params["holdout_every"]
        clean = j % period == 0
        held = (j // period) % every == every - 1 if every else torch.zeros_like(clean)
        return clean, held

    def _reference(self, batches: Batches, ignore_index: int, copies: int) -> list[float]:
        """The clean-fitted band temperatures: ``boundary_ts``'s fit (one temperature for
        ``bands=[]``) on the clean images that fit."""

        def clean_fit():
            seen = 0
            for logits, target, _ in iterate(batches):
                j = torch.arange(seen, seen + logits.shape[0])
                seen += logits.shape[0]
                clean, held = self._layout(j, copies)
                keep = (clean & ~held).to(logits.device)
                if bool(keep.any()):
                    yield logits[keep].double(), target[keep.to(target.device)]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty band or a search-edge note
            if not self.params["bands"]:
                return [fit_temperature(clean_fit, ignore_index)]
            ref = BoundaryTemperatureScaling(self.num_classes, self.params["bands"])
            ref._fit_depth = 1  # no identity probe: a part of this fit
            ref.fit(clean_fit, ignore_index)
        return ref.temperatures.tolist()

    def _scan(self, batches: Batches, ignore_index: int, copies: int) -> dict[str, Tensor]:
        """One pass: the flags and valid pixels of every stream image, and the pixel sums,
        sums of squares and ranges of the raw statistics over the clean fit images and over
        all fit images (float64)."""
        counts, seen, sums = [], 0, {}
        for logits, target, image in iterate(batches):
            self._check(logits, image)
            n = logits.shape[0]
            j = torch.arange(seen, seen + n)
            seen += n
            counts.append((target != ignore_index).flatten(1).sum(dim=1).cpu())
            clean, held = self._layout(j, copies)
            if not bool((~held).any()):
                continue
            raw = self.features(logits.double(), None if image is None else image.double())
            raw = raw[(~held).to(raw.device)].transpose(0, 1).flatten(1).cpu()  # (F + 1, P)
            pixels = raw.shape[1] // int((~held).sum())
            clean_cols = clean[~held].repeat_interleave(pixels)
            for key, cols in (("all", raw), ("clean", raw[:, clean_cols])):
                if cols.shape[1]:
                    _accumulate(sums, key, cols)
        if not seen:
            raise ValueError("Expected validation batches, but got none.")
        clean, held = self._layout(torch.arange(seen), copies)
        return {"count": torch.cat(counts), "clean": clean, "held": held, "sums": sums}

    # Not split (over 80 lines): one algorithm, most of it the closure of the L-BFGS passes.
    def fit(self, batches: Batches, ignore_index: int = -100, copies: int = 0
            ) -> dict[str, Any]:
        """Fit ``c``, ``w`` and ``u`` on the stream of ``batches`` (module docstring).
        ``copies``: the stream holds each validation image followed by that many corrupted
        copies (0: a plain validation stream, every image clean)."""
        if is_distributed():
            raise UserError("image_ts: fit it in one process (its held-out images are counted "
                            "in loader order).")
        check_int("copies", copies, 0)
        p, k = self.params, self.num_classes
        scan = self._scan(batches, ignore_index, copies)
        clean, held, count = scan["clean"], scan["held"], scan["count"]
        fitting = ~held
        if not bool((fitting & clean & (count > 0)).any()):
            raise ValueError("Expected clean validation images with valid pixels to fit, but "
                             "got none (one in holdout_every is held out; lower it).")
        every = p["holdout_every"]
        if every and not bool((held & clean & (count > 0)).any()):
            raise ValueError(f"Expected at least {every} validation images (one in {every} is "
                             "held out for the clean check), but the held-out ones have no "
                             "valid pixel; lower `holdout_every`.")
        anchored = bool((fitting & ~clean).any())  # corrupted copies: no offset at clean
        every_pixel = scan["sums"]["all"]
        centre = scan["sums"]["clean"] if anchored else every_pixel
        mean = centre["sum"] / centre["n"]
        all_mean = every_pixel["sum"] / every_pixel["n"]
        scale = (every_pixel["sq"] / every_pixel["n"] - all_mean.pow(2)).clamp(min=0).sqrt()
        scale = torch.where(scale > 1e-6, scale, torch.ones_like(scale))
        low, high = (every_pixel["low"] - mean) / scale, (every_pixel["high"] - mean) / scale
        ref_t = self._reference(batches, ignore_index, copies)
        n_clean = float(count[fitting & clean].sum())
        n_corrupt = float(count[fitting & ~clean].sum())
        w_clean = 0.5 / n_clean if n_corrupt else 1.0 / n_clean
        w_corrupt = 0.5 / n_corrupt if n_corrupt else 0.0
        held_clean = held & clean & (count > 0)
        f64 = dict(dtype=torch.float64)
        c = torch.tensor([math.log(t) for t in ref_t], **f64)
        nf = len(self.feature_names)
        w = torch.zeros(nf, **f64).requires_grad_(True)
        u = torch.zeros(nf, **f64).requires_grad_(True)
        b = torch.zeros((), **f64).requires_grad_(not anchored)
        state: dict[str, Any] = {"passes": 0, "trace": [], "best": None, "ref": None}

        def image_nll(logits: Tensor, target: Tensor, image: Tensor | None
                      ) -> tuple[Tensor, Tensor]:
            """Summed NLL and mean offset of every image of the batch (float64, the NLL with
            the graph)."""
            x = logits.double()
            dev = x.device
            with torch.no_grad():  # recomputed each pass: kept, they would take (F + 1) x 8
                # bytes per pixel of every stream image
                z = self._standardised(self.features(x, None if image is None
                                                     else image.double()),
                                       mean, scale, low, high)
                band = graph_bands(x, self.thresholds)
            offset = _offset(z, w.to(dev), u.to(dev), b.to(dev))
            log_t = (c.to(dev)[band] + offset).clamp(-LOG_T_MAX, LOG_T_MAX)
            scaled = x / log_t.exp().unsqueeze(1)
            valid = target != ignore_index
            labels = torch.where(valid, target, torch.zeros_like(target)).long()
            if bool(valid.any()) and (int(labels.min()) < 0 or int(labels.max()) >= k):
                raise ValueError(f"Expected valid `target` values in [0, {k}), but got values "
                                 f"in [{int(labels.min())}, {int(labels.max())}] "
                                 f"(ignore_index={ignore_index}).")
            nll = torch.logsumexp(scaled, dim=1) - scaled.gather(1, labels[:, None])[:, 0]
            nll = torch.where(valid, nll, torch.zeros_like(nll)).flatten(1).sum(dim=1)
            return nll, offset.detach().flatten(1).mean(dim=1)

        def closure(lam: float) -> Tensor:
            w.grad = u.grad = b.grad = None
            total = torch.zeros((), **f64)
            held_sum = torch.zeros(len(count), **f64)
            offsets = torch.zeros(len(count), **f64)
            seen = 0
            for logits, target, image in iterate(batches):
                n = logits.shape[0]
                idx = torch.arange(seen, seen + n)
                seen += n
                live = count[idx] > 0
                if not bool(live.any()):
                    continue
                nll, offset = image_nll(logits, target.to(logits.device), image)
                nll = nll.cpu()
                offsets[idx] = offset.cpu()
                is_held = held[idx] & live
                held_sum[idx[is_held]] = nll[is_held].detach()
                weights = torch.where(clean[idx], torch.tensor(w_clean, **f64),
                                      torch.tensor(w_corrupt, **f64)) * (~held[idx] & live)
                if bool((weights > 0).any()):
                    loss = (nll * weights).sum()
                    loss.backward()
                    total += loss.detach()
            check_same_data(len(count), seen, "images")
            reg = lam * (w.pow(2).sum() + u.pow(2).sum())
            reg.backward()
            objective = total + reg.detach()
            check_finite_nll(float(objective))
            state["passes"] += 1
            if every:
                per_image = held_sum / count.clamp(min=1)
                score = _held_objective(held_sum, count, held, clean)
                if state["ref"] is None:  # the first pass is at the reference (no offset)
                    state["ref"] = per_image[held_clean].clone()
                diff = per_image[held_clean] - state["ref"]
                se = (diff.std(correction=1) / math.sqrt(diff.numel())
                      if diff.numel() > 1 else torch.zeros((), **f64))
                admissible = bool(diff.mean() <= p["tolerance"] * se + 1e-12)
                state["trace"].append({"score": score, "clean_diff": float(diff.mean()),
                                       "clean_se": float(se), "admissible": admissible})
            else:
                score, admissible = -state["passes"], True  # none held out: the last iterate
            if admissible and (state["best"] is None or score < state["best"]["score"]):
                state["best"] = {"score": score, "lam": lam, "evaluation": state["passes"],
                                 "w": w.detach().clone(), "u": u.detach().clone(),
                                 "b": b.detach().clone(), "offsets": offsets,
                                 "fit_objective": float(objective)}
            return objective

        with torch.enable_grad():  # the caller may be under no_grad (an evaluation)
            closure(0.0)  # evaluation 1: the reference, the clean-fitted band temperatures
            params = [w, u] if anchored else [w, u, b]
            stages = lbfgs_stages(params, closure, p["lams"], p["max_iter"],
                                  lambda: state["best"]["score"], early_stop=bool(every))
        best = state["best"]
        fell_back = bool(every) and best["evaluation"] == 1
        with torch.no_grad():
            self.log_temperatures.copy_(c)
            self.weight.copy_(best["w"])
            self.interaction.copy_(best["u"])
            self.bias.copy_(best["b"])
            self.feature_mean.copy_(mean)
            self.feature_scale.copy_(scale)
            self.feature_low.copy_(low)
            self.feature_high.copy_(high)
        period = copies + 1
        info = {
            "features": list(self.feature_names),
            "gate": GATE,
            "weight": best["w"].tolist(),
            "interaction": best["u"].tolist(),
            "bias": float(best["b"]),
            "band_temperatures": ref_t,
            "offset": _offset_summary(best["offsets"], fitting, clean),
            "fell_back": fell_back,
            "lam": None if fell_back else best["lam"],
            "evaluation": best["evaluation"],
            "stages": stages,
            "passes": state["passes"] + 4,
            "copies": copies,
            "fit_data": (f"each validation image and {copies} corrupted copies "
                         f"({', '.join(p['corruptions'])}; severities 1-5; seed {p['seed']})"
                         if copies else "the validation images as given (all clean)"),
            "images": {"fit_clean": int((fitting & clean).sum()),
                       "fit_corrupted": int((fitting & ~clean).sum()),
                       "heldout_clean": int((held & clean).sum()),
                       "heldout_corrupted": int((held & ~clean).sum()),
                       "validation": len(count) // period},
        }
        if every:
            first, chosen = state["trace"][0], state["trace"][best["evaluation"] - 1]
            info.update(heldout=f"every {every}th validation image in loader order, with its "
                                "copies",
                        heldout_objective=best["score"], reference_heldout_objective=first["score"],
                        heldout_clean_diff=chosen["clean_diff"],
                        heldout_clean_se=chosen["clean_se"],
                        heldout_trace=[t["score"] for t in state["trace"]])
        self.fit_info = info
        return info


def _accumulate(sums: dict[str, dict[str, Any]], key: str, cols: Tensor) -> None:
    """Add the pixel count, sums, sums of squares and range of ``cols (F + 1, P)`` to
    ``sums[key]``."""
    low, high = cols.amin(dim=1), cols.amax(dim=1)
    part = sums.get(key)
    if part is None:
        sums[key] = {"n": cols.shape[1], "sum": cols.sum(dim=1), "sq": cols.pow(2).sum(dim=1),
                     "low": low, "high": high}
        return
    part["n"] += cols.shape[1]
    part["sum"] += cols.sum(dim=1)
    part["sq"] += cols.pow(2).sum(dim=1)
    part["low"] = torch.minimum(part["low"], low)
    part["high"] = torch.maximum(part["high"], high)


def _offset(z: Tensor, w: Tensor, u: Tensor, b: Tensor) -> Tensor:
    """``sum_f z_f (w_f + g u_f) + b`` per pixel, ``z (N, F + 1, H, W)`` standardised (the gate
    last); returns ``(N, H, W)``."""
    stats, gate = z[:, :-1], z[:, -1]
    return ((stats * w.view(1, -1, 1, 1)).sum(dim=1)
            + gate * (stats * u.view(1, -1, 1, 1)).sum(dim=1) + b)


def _offset_summary(offsets: Tensor, fitting: Tensor, clean: Tensor) -> dict[str, float]:
    """How the fitted offset treats the fit images: the mean over their pixels of the offset in
    ``log T``, averaged over the clean ones and over the corrupted ones, and the mean absolute
    one of the clean ones."""
    out = {}
    for key, group in (("clean", fitting & clean), ("corrupted", fitting & ~clean)):
        if bool(group.any()):
            out[f"mean_{key}"] = float(offsets[group].mean())
    if bool((fitting & clean).any()):
        out["mean_abs_clean"] = float(offsets[fitting & clean].abs().mean())
    return out


def _held_objective(held_sum: Tensor, count: Tensor, held: Tensor, clean: Tensor) -> float:
    """``0.5 mean NLL(held-out clean pixels) + 0.5 mean NLL(held-out corrupted pixels)`` (the
    clean mean alone without corrupted images)."""
    parts = []
    for group in (held & clean, held & ~clean):
        n = float(count[group].sum())
        if n:
            parts.append(float(held_sum[group].sum()) / n)
    return sum(parts) / len(parts)


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UserError(f"Expected `{name}` to hold finite numbers, but got {value!r}.")


__all__ = ["FEATURES", "PIXEL_FEATURES", "ImageTemperatureScaling",
           "image_statistics", "logit_statistics", "pixel_statistics"]
