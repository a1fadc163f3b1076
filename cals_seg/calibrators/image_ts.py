"""``image_ts``: a temperature per image and predicted-boundary band, a regularised linear
function of what the image and the logits show, fitted on clean and corrupted validation images
with its clean behaviour protected.

A temperature fitted on clean validation images is one number for a clean image and a fogged
one; on a low-contrast image the network is confidently wrong and that temperature cannot
know it (docs/shift.md). Following parameterized / sample-dependent temperature scaling
(Tomani et al., WACV 2022; Joy et al., AAAI 2023) and perturbation-fitted scaling (Tomani et
al., CVPR 2021), the temperature here depends on the input::

    log T(i, p) = c[band(p)] + max(0, w . z_i + b),       forward(l)(p) = l(p) / T(i, p)

``c`` are the clean-fitted band temperatures (``boundary_ts`` on the clean validation images),
and the image's offset is never negative: an image that does not look shifted (``w . z + b <=
0``) gets exactly the clean-fitted temperatures, one that does gets warmer ones. With corrupted
copies in the fit, ``z`` is centred on the mean clean fit image and ``b <= 0``, so the mean
clean image gets no offset by construction. (Why only warmer: on the embedded runs the best
temperature of an image, per image, is far above the clean images' under fog and contrast and
within about 0.1 of it in log T under the other corruptions; docs/shift.md.)

with ``band(p)`` the pixel's distance band from the *predicted* boundaries (the bands of
``boundary_ts``: a pixel is a boundary pixel when one of its 8 neighbours inside the image has
another arg-max, ``D`` the exact squared Euclidean distance to the nearest one, band ``b`` where
``ceil(bands[b-1]^2) <= D < ceil(bands[b]^2)``), and ``z_i`` the standardised statistics of
image ``i`` (:data:`FEATURES`), clipped to the range seen in the fit:

- of the image, de-normalised to ``[0, 1]`` RGB (``image_mean``, ``image_std``: the
  evaluation's normalisation), on its luma ``Y = .299 R + .587 G + .114 B``: mean brightness,
  log RMS contrast ``log(std Y + 1e-3)``, log sharpness ``log(var(lap Y) + 1e-6)`` (the 4-
  neighbour Laplacian, replicate-padded), log noise ``log(sigma + 1e-4)`` with Immerkaer's
  estimator ``sigma = sqrt(pi / 2) / 6 mean |Y * M|``, ``M = [[1, -2, 1], [-2, 4, -2], [1, -2,
  1]]`` (replicate-padded), and the mean HSV saturation ``(max - min) / (max + 1e-3)``;
- of the logits: the mean and the spread (population standard deviation over the pixels) of the
  predictive entropy and of the top-1 minus top-2 logit margin.

``T > 0`` everywhere (``log T`` is clamped to ``[-log 100, log 100]``), so the arg-max is the
network's. ``use_image=False`` keeps the logit statistics only. The forward pass is tensor
operations only (no numpy, no loop over a data-dependent size): it goes into ``torch.export``.

Fit (:meth:`ImageTemperatureScaling.fit`) on a stream that holds each validation image
followed by ``copies`` corrupted copies (:class:`cals_seg.data.drift_mixtures.CorruptedCopies`:
haze, low light, desaturation, speckle noise, Gaussian blur, spatter, severities 1-5, none of
them the benchmark's; ``eval_seg`` builds it through
:meth:`~ImageTemperatureScaling.fit_data`):

1. validation image ``v`` (with its copies) is held out when ``v % holdout_every ==
   holdout_every - 1``; the others fit;
2. ``c``: the clean-fitted band temperatures (``boundary_ts``'s fit on the clean fit images),
   kept; the reference is ``c`` with no offset (``w = 0``), scored first;
3. then, from ``w`` of length 0.05 towards the copies' mean statistics and ``b = -0.049``
   (``b = -softplus(beta)``; without copies: ``w = 0``, ``b = 0.05``, unconstrained; the hinge
   needs a start where some images have a gradient), full-batch L-BFGS (float64, streamed) of
   ``(w, b)`` on ``0.5 mean NLL(clean fit pixels) + 0.5 mean NLL(corrupted fit pixels) + lam
   |w|^2`` for each ``lam`` of ``lams`` in turn, each stage started where the last ended; every
   objective pass also scores the held-out images;
4. the clean rule: an iterate is admissible when, on the held-out *clean* images, its mean
   per-image NLL exceeds the reference's by at most ``tolerance`` standard errors of the paired
   per-image differences (not worse beyond noise). Of the admissible iterates, the reference
   included (the first pass scores it), the one with the lowest held-out objective is kept; when
   that is the reference, the calibrator *fell back* to the clean-fitted band temperatures, and
   ``fit_info["fell_back"]`` says so. The stages stop after one that did not improve it.
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
from cals_seg.calibrators._image_features import (
    FEATURES,
    IMAGE_FEATURES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LOG_T_MAX,
    band_map,
    image_statistics,
    logit_statistics,
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

LAMS = (0.1, 0.01, 0.001)
B_START = 0.05  # the offset's bias at the start of a fit without copies (at 0: no gradient)
B_ANCHOR = 3.0  # with copies, b = -softplus(beta) starts at -softplus(-3) = -0.049
W_START = 0.05  # and w at this length towards the copies' mean features


@CALIBRATORS.register("image_ts")
class ImageTemperatureScaling(Calibrator):
    """A temperature per image and predicted band from image and logit statistics (module
    docstring).

    Buffers: ``log_temperatures`` ``(B,)`` (``c``, B = ``len(bands) + 1``), ``weight`` ``(F,)``
    (``w``), ``bias`` ``()`` (``b``), ``feature_mean`` / ``feature_scale`` ``(F,)`` (the
    standardisation), ``feature_low`` / ``feature_high`` ``(F,)`` (the clip, in standard
    units); zeros (scale 1) until fitted, the identity. With ``use_image=False`` only the four
    logit statistics enter (F = 4).

    Args:
        num_classes: K >= 2.
        bands: the band distances in pixels (``boundary_ts``'s); ``[]``: one temperature per
            image.
        use_image: use the image statistics (then ``forward`` needs the image).
        copies: corrupted copies of each validation image that :meth:`fit_data` adds.
        corruptions, seed: the held-out mixture of those copies
            (:class:`cals_seg.data.drift_mixtures.HeldOutMixture`).
        lams: the L2 strengths on ``w``, tried in turn (each >= 0).
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
    bias: Tensor
    feature_mean: Tensor
    feature_scale: Tensor
    feature_low: Tensor
    feature_high: Tensor

    def __init__(self, num_classes: int, bands: Sequence[float] = (3.0, 8.0),
                 use_image: bool = True, copies: int = 3,
                 corruptions: Sequence[str] | None = None, seed: int = 0,
                 lams: Sequence[float] = LAMS, max_iter: int = 20, holdout_every: int = 5,
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
        super().__init__(num_classes, bands=bands, use_image=bool(use_image), copies=copies,
                         corruptions=corruptions, seed=seed, lams=lams, max_iter=max_iter,
                         holdout_every=holdout_every, tolerance=float(tolerance),
                         image_mean=stats[0], image_std=stats[1])
        self.needs_image = bool(use_image)
        self.thresholds = int_thresholds(bands)
        nf = len(FEATURES) - (0 if use_image else IMAGE_FEATURES)
        self.register_buffer("log_temperatures", torch.zeros(len(bands) + 1))
        self.register_buffer("weight", torch.zeros(nf))
        self.register_buffer("bias", torch.zeros(()))
        self.register_buffer("feature_mean", torch.zeros(nf))
        self.register_buffer("feature_scale", torch.ones(nf))
        self.register_buffer("feature_low", torch.zeros(nf))
        self.register_buffer("feature_high", torch.zeros(nf))

    @property
    def feature_names(self) -> tuple[str, ...]:
        return FEATURES if self.needs_image else FEATURES[IMAGE_FEATURES:]

    # ------------------------------------------------------------------------- the map
    def features(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """The raw statistics of every image (before standardisation).

        Shape:
            - logits: ``(N, K, H, W)``; image: ``(N, 3, H, W)``; returns ``(N, F)``.
        """
        stats = logit_statistics(logits)
        if not self.needs_image:
            return stats
        img = image_statistics(image, self.params["image_mean"], self.params["image_std"])
        return torch.cat([img.to(stats.dtype), stats], dim=1)

    def log_temperature(self, logits: Tensor, image: Tensor | None = None) -> Tensor:
        """``log T`` of every pixel, ``(N, H, W)`` (float64 for float64 logits, else float32)."""
        raw = self.features(logits, image)
        dt = raw.dtype
        z = (raw - self.feature_mean.to(dt)) / self.feature_scale.to(dt)
        z = torch.minimum(torch.maximum(z, self.feature_low.to(dt)), self.feature_high.to(dt))
        per_image = ((z * self.weight.to(dt)).sum(dim=1) + self.bias.to(dt)).clamp(min=0.0)
        band = band_map(logits, self.thresholds)
        log_t = self.log_temperatures.to(dt)[band] + per_image[:, None, None]
        return log_t.clamp(-LOG_T_MAX, LOG_T_MAX)

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
        """One pass: the raw features, the flags and the valid pixels of every stream image."""
        feats, counts, seen = [], [], 0
        for logits, target, image in iterate(batches):
            self._check(logits, image)
            n = logits.shape[0]
            seen += n
            feats.append(self.features(logits.double(), None if image is None
                                       else image.double()).cpu())
            counts.append((target != ignore_index).flatten(1).sum(dim=1).cpu())
        if not seen:
            raise ValueError("Expected validation batches, but got none.")
        j = torch.arange(seen)
        clean, held = self._layout(j, copies)
        return {"features": torch.cat(feats), "count": torch.cat(counts), "clean": clean,
                "held": held}

    # Not split (over 80 lines): one algorithm, most of it the closure of the L-BFGS passes.
    def fit(self, batches: Batches, ignore_index: int = -100, copies: int = 0
            ) -> dict[str, Any]:
        """Fit ``c`` and ``w`` on the stream of ``batches`` (module docstring). ``copies``: the
        stream holds each validation image followed by that many corrupted copies (0: a plain
        validation stream, every image clean)."""
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
        raw = scan["features"]
        anchored = bool((fitting & ~clean).any())  # corrupted copies: offset 0 at clean
        mean = raw[fitting & clean].mean(dim=0) if anchored else raw[fitting].mean(dim=0)
        scale = raw[fitting].std(dim=0, correction=0)
        scale = torch.where(scale > 1e-6, scale, torch.ones_like(scale))
        z_all = (raw - mean) / scale
        low, high = z_all[fitting].amin(dim=0), z_all[fitting].amax(dim=0)
        z_all = torch.minimum(torch.maximum(z_all, low), high)
        ref_t = self._reference(batches, ignore_index, copies)
        n_clean = float(count[fitting & clean].sum())
        n_corrupt = float(count[fitting & ~clean].sum())
        w_clean = 0.5 / n_clean if n_corrupt else 1.0 / n_clean
        w_corrupt = 0.5 / n_corrupt if n_corrupt else 0.0
        held_clean = held & clean & (count > 0)
        f64 = dict(dtype=torch.float64)
        c = torch.tensor([math.log(t) for t in ref_t], **f64)
        w = torch.zeros(z_all.shape[1], **f64).requires_grad_(True)
        beta = torch.zeros((), **f64).requires_grad_(True)

        def bias() -> Tensor:
            """``b``: ``-softplus(beta) <= 0`` when anchored (the mean clean image, at ``z =
            0``, gets no offset), else ``beta`` itself."""
            return -torch.nn.functional.softplus(beta) if anchored else beta
        state: dict[str, Any] = {"passes": 0, "trace": [], "best": None, "ref": None}

        def image_nll(logits: Tensor, target: Tensor, z: Tensor) -> Tensor:
            """Summed NLL of every image of the batch (float64, with the graph)."""
            x = logits.double()
            band = band_map(x, self.thresholds)
            offset = (z.to(x.device) @ w.to(x.device) + bias().to(x.device)).clamp(min=0.0)
            log_t = (c.to(x.device)[band] + offset[:, None, None]).clamp(-LOG_T_MAX, LOG_T_MAX)
            scaled = x / log_t.exp().unsqueeze(1)
            valid = target != ignore_index
            labels = torch.where(valid, target, torch.zeros_like(target)).long()
            if bool(valid.any()) and (int(labels.min()) < 0 or int(labels.max()) >= k):
                raise ValueError(f"Expected valid `target` values in [0, {k}), but got values "
                                 f"in [{int(labels.min())}, {int(labels.max())}] "
                                 f"(ignore_index={ignore_index}).")
            nll = torch.logsumexp(scaled, dim=1) - scaled.gather(1, labels[:, None])[:, 0]
            return torch.where(valid, nll, torch.zeros_like(nll)).flatten(1).sum(dim=1)

        def closure(lam: float) -> Tensor:
            w.grad = beta.grad = None
            total = torch.zeros((), **f64)
            held_sum = torch.zeros(len(count), **f64)
            seen = 0
            for logits, target, _ in iterate(batches):
                n = logits.shape[0]
                idx = torch.arange(seen, seen + n)
                seen += n
                live = count[idx] > 0
                if not bool(live.any()):
                    continue
                nll = image_nll(logits, target.to(logits.device), z_all[idx])
                nll = nll.cpu()
                is_held = held[idx] & live
                held_sum[idx[is_held]] = nll[is_held].detach()
                weights = torch.where(clean[idx], torch.tensor(w_clean, **f64),
                                      torch.tensor(w_corrupt, **f64)) * (~held[idx] & live)
                if bool((weights > 0).any()):
                    loss = (nll * weights).sum()
                    loss.backward()
                    total += loss.detach()
            check_same_data(len(count), seen, "images")
            reg = lam * w.pow(2).sum()
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
                                 "w": w.detach().clone(), "b": bias().detach().clone(),
                                 "fit_objective": float(objective)}
            return objective

        with torch.enable_grad():  # the caller may be under no_grad (an evaluation)
            with torch.no_grad():
                beta.fill_(-B_ANCHOR if anchored else 0.0)
            closure(0.0)  # evaluation 1: the reference, the clean-fitted band temperatures
            with torch.no_grad():  # a start where the hinge has a gradient
                if anchored:  # towards what tells the copies from the clean images
                    d = z_all[fitting & ~clean].mean(dim=0) - z_all[fitting & clean].mean(dim=0)
                    w.copy_(W_START * d / d.norm().clamp(min=1e-12))
                else:
                    beta.fill_(B_START)
            stages = lbfgs_stages([w, beta], closure, p["lams"], p["max_iter"],
                                  lambda: state["best"]["score"], early_stop=bool(every))
        best = state["best"]
        fell_back = bool(every) and best["evaluation"] == 1
        with torch.no_grad():
            self.log_temperatures.copy_(c)
            self.weight.copy_(best["w"])
            self.bias.copy_(best["b"])
            self.feature_mean.copy_(mean)
            self.feature_scale.copy_(scale)
            self.feature_low.copy_(low)
            self.feature_high.copy_(high)
        period = copies + 1
        info = {
            "features": list(self.feature_names),
            "weight": best["w"].tolist(),
            "bias": float(best["b"]),
            "band_temperatures": ref_t,
            "offset": _offset_summary(z_all, best["w"], best["b"], fitting, clean),
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


def _offset_summary(z: Tensor, w: Tensor, b: Tensor, fitting: Tensor, clean: Tensor
                    ) -> dict[str, float]:
    """How the fitted offset ``max(0, w . z + b)`` treats the fit images: its mean on the clean
    ones and on the corrupted ones, and the fraction of clean ones it moves at all."""
    offset = (z @ w + b).clamp(min=0.0)
    out = {}
    for key, group in (("clean", fitting & clean), ("corrupted", fitting & ~clean)):
        if bool(group.any()):
            out[f"mean_{key}"] = float(offset[group].mean())
    if bool((fitting & clean).any()):
        out["moved_clean_fraction"] = float((offset[fitting & clean] > 0).double().mean())
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


__all__ = ["FEATURES", "ImageTemperatureScaling", "band_map", "image_statistics",
           "logit_statistics"]
