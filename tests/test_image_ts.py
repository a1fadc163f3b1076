"""image_ts: a temperature per pixel from image, logit and pixel statistics.

Checked against independent float64 references written here (loops and numpy), on planted
data (a temperature that depends on the image's contrast, a fit that would hurt the held-out
clean images), through save / load, torch.export, and eval_seg against predict_seg."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from cals_seg.calibrators import build_calibrator, load_calibrator, save_calibrator
from cals_seg.calibrators._export import graph_bands
from cals_seg.calibrators.boundary_ts import predicted_bands
from cals_seg.calibrators.image_ts import (
    FEATURES,
    PIXEL_FEATURES,
    ImageTemperatureScaling,
    image_statistics,
    logit_statistics,
    pixel_statistics,
)
from cals_seg.metrics.distance import int_thresholds

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

VOID = 255
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


# ----------------------------------------------------------------------------- references
def _ref_image_stats(image: np.ndarray) -> list[float]:
    """The five image statistics of one normalised (3, H, W) image, by loops in float64."""
    _, h, w = image.shape
    rgb = np.empty((h, w, 3))
    for c in range(3):
        for i in range(h):
            for j in range(w):
                rgb[i, j, c] = min(max(image[c, i, j] * STD[c] + MEAN[c], 0.0), 1.0)
    y = np.empty((h, w))
    for i in range(h):
        for j in range(w):
            y[i, j] = 0.299 * rgb[i, j, 0] + 0.587 * rgb[i, j, 1] + 0.114 * rgb[i, j, 2]

    def at(i: int, j: int) -> float:  # replicate padding
        return y[min(max(i, 0), h - 1), min(max(j, 0), w - 1)]

    lap, noise = [], []
    for i in range(h):
        for j in range(w):
            lap.append(at(i - 1, j) + at(i + 1, j) + at(i, j - 1) + at(i, j + 1) - 4 * at(i, j))
            m = (at(i - 1, j - 1) + at(i - 1, j + 1) + at(i + 1, j - 1) + at(i + 1, j + 1)
                 - 2 * (at(i - 1, j) + at(i + 1, j) + at(i, j - 1) + at(i, j + 1))
                 + 4 * at(i, j))
            noise.append(abs(m))
    values = y.ravel()
    mean = sum(values) / values.size
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / values.size)
    lap_mean = sum(lap) / len(lap)
    lap_var = sum((v - lap_mean) ** 2 for v in lap) / len(lap)
    sigma = math.sqrt(math.pi / 2) / 6 * sum(noise) / len(noise)
    sat = [(max(rgb[i, j]) - min(rgb[i, j])) / (max(rgb[i, j]) + 1e-3)
           for i in range(h) for j in range(w)]
    return [mean, math.log(std + 1e-3), math.log(lap_var + 1e-6), math.log(sigma + 1e-4),
            sum(sat) / len(sat)]


def _array_stats(logits: np.ndarray, image: np.ndarray) -> list[float]:
    """:func:`_ref_image_stats` + :func:`_ref_logit_stats` of one (K, H, W) and its (3, H, W),
    the same formulas on whole float64 NumPy arrays (checked against the loops where used): for
    the tests that need them on many images."""
    rgb = np.clip(image * STD[:, None, None] + MEAN[:, None, None], 0.0, 1.0)  # (3, H, W)
    y = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    p = np.pad(y, 1, mode="edge")  # replicate padding
    up, down, left, right = p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]
    lap = up + down + left + right - 4 * y
    noise = np.abs(p[:-2, :-2] + p[:-2, 2:] + p[2:, :-2] + p[2:, 2:]
                   - 2 * (up + down + left + right) + 4 * y)
    sigma = math.sqrt(math.pi / 2) / 6 * noise.mean()
    sat = (rgb.max(axis=0) - rgb.min(axis=0)) / (rgb.max(axis=0) + 1e-3)
    top = logits.max(axis=0)
    e = np.exp(logits - top)
    prob = e / e.sum(axis=0)
    ent = -np.where(prob > 0, prob * np.log(np.where(prob > 0, prob, 1.0)), 0.0).sum(axis=0)
    ranked = np.sort(logits, axis=0)
    margin = ranked[-1] - ranked[-2]
    return [y.mean(), math.log(y.std() + 1e-3), math.log(lap.var() + 1e-6),
            math.log(sigma + 1e-4), sat.mean(), ent.mean(), ent.std(), margin.mean(),
            margin.std()]


def _ref_pixel_maps(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entropy and top-2 margin of every pixel of one (K, H, W), by loops."""
    k, h, w = logits.shape
    ent, margin = np.empty((h, w)), np.empty((h, w))
    for i in range(h):
        for j in range(w):
            col = [logits[c, i, j] for c in range(k)]
            top = max(col)
            z = sum(math.exp(v - top) for v in col)
            p = [math.exp(v - top) / z for v in col]
            ent[i, j] = -sum(q * math.log(q) for q in p if q > 0)
            ranked = sorted(col, reverse=True)
            margin[i, j] = ranked[0] - ranked[1]
    return ent, margin


def _ref_logit_stats(logits: np.ndarray) -> list[float]:
    """Mean and spread of the entropy and of the top-2 margin of one (K, H, W), by loops."""
    ent, margin = _ref_pixel_maps(logits)

    def mean_std(v: list[float]) -> tuple[float, float]:
        m = sum(v) / len(v)
        return m, math.sqrt(sum((x - m) ** 2 for x in v) / len(v))

    return [*mean_std(ent.ravel().tolist()), *mean_std(margin.ravel().tolist())]


def _ref_local(x: np.ndarray, side: int = 9) -> np.ndarray:
    """The mean over the side x side window of every pixel, replicate padding, by loops."""
    h, w = x.shape
    r = side // 2
    out = np.empty((h, w))
    for i in range(h):
        for j in range(w):
            out[i, j] = sum(x[min(max(a, 0), h - 1), min(max(b, 0), w - 1)]
                            for a in range(i - r, i + r + 1)
                            for b in range(j - r, j + r + 1)) / side ** 2
    return out


def _ref_pixel_stats(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The four pixel statistics (4, H, W) and the gate (H, W) of one (K, H, W)."""
    ent, margin = _ref_pixel_maps(logits)
    return (np.stack([ent, _ref_local(ent), margin, _ref_local(margin)]),
            np.log(margin + 1e-2))


def _ref_bands(logits: np.ndarray, bands: list[float]) -> np.ndarray:
    """Predicted bands of one (K, H, W) by brute force: 8-neighbour boundary inside the image,
    squared distances to every boundary pixel, ``d < b``."""
    pred = logits.argmax(axis=0)
    h, w = pred.shape
    boundary = np.zeros((h, w), dtype=bool)
    for i in range(h):
        for j in range(w):
            boundary[i, j] = bool((pred[max(i - 1, 0):i + 2, max(j - 1, 0):j + 2]
                                   != pred[i, j]).any())
    out = np.zeros((h, w), dtype=np.int64)
    bi, bj = np.nonzero(boundary)
    for i in range(h):
        for j in range(w):
            d = math.sqrt(min(((bi - i) ** 2 + (bj - j) ** 2).tolist())) if bi.size else math.inf
            out[i, j] = sum(d >= b for b in bands)
    return out


def _blobs(n: int, k: int, h: int, w: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Smooth logits with regions of several classes (so there are boundaries)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, h, w, generator=g, dtype=torch.float64)
    return torch.nn.functional.avg_pool2d(z, 5, 1, 2) * scale * 3


# ----------------------------------------------------------------------------- the map
def test_statistics_equal_a_float64_loop_reference():
    g = torch.Generator().manual_seed(0)
    image = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64)
    image[1] *= 0.2  # a low-contrast one
    logits = torch.randn(2, 4, 5, 7, generator=g, dtype=torch.float64) * 3
    got = image_statistics(image)
    got_l = logit_statistics(logits)
    assert got.dtype == torch.float64 and got.shape == (2, 5) and got_l.shape == (2, 4)
    for n in range(2):
        np.testing.assert_allclose(got[n].numpy(), _ref_image_stats(image[n].numpy()),
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_l[n].numpy(), _ref_logit_stats(logits[n].numpy()),
                                   rtol=1e-12, atol=1e-12)
    pixel, gate = pixel_statistics(logits)
    assert pixel.shape == (2, 4, 5, 7) and gate.shape == (2, 5, 7)
    for n in range(2):
        want, want_gate = _ref_pixel_stats(logits[n].numpy())
        np.testing.assert_allclose(pixel[n].numpy(), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gate[n].numpy(), want_gate, rtol=1e-12, atol=1e-12)
    assert got[1, 1] < got[0, 1]  # the RMS contrast feature sees the low contrast
    # float32 inputs: the same numbers to float32 rounding
    np.testing.assert_allclose(image_statistics(image.float()).double().numpy(), got.numpy(),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bands", [[3.0, 8.0], [1.0], [2.0, 5.0], [1, 2, 3, 4, 6, 8, 12], []])
def test_bands_are_boundary_ts_bands(bands):
    logits = _blobs(3, 4, 23, 31, seed=len(bands))
    got = graph_bands(logits, int_thresholds(bands))  # image_ts' bands
    if bands:
        assert torch.equal(got, predicted_bands(logits, bands))
    assert torch.equal(got[0], torch.from_numpy(_ref_bands(logits[0].numpy(), bands)))


def _planted_state(cal: ImageTemperatureScaling, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    nf = len(cal.feature_names)
    with torch.no_grad():
        cal.log_temperatures.copy_(torch.tensor([0.4, -0.3, 0.1]))
        cal.weight.copy_(torch.randn(nf, generator=g) * 0.4)
        cal.interaction.copy_(torch.randn(nf, generator=g) * 0.2)
        cal.bias.fill_(0.2)
        cal.feature_mean.copy_(torch.randn(nf + 1, generator=g))
        cal.feature_scale.copy_(torch.rand(nf + 1, generator=g) + 0.5)
        cal.feature_low.fill_(-1.5)
        cal.feature_high.fill_(1.5)


@pytest.mark.parametrize("use_image, use_pixel", [(True, True), (False, True), (True, False)])
def test_forward_equals_the_formula(use_image, use_pixel):
    """softmax(l / T) with log T(p) = c[band(p)] + sum_f z_f(p) (w_f + g(p) u_f) + b, z and g
    clip((f - mean) / scale), computed with the loop references above, in float64."""
    cal = ImageTemperatureScaling(4, use_image=use_image, use_pixel=use_pixel).eval()
    _planted_state(cal)
    logits = _blobs(2, 4, 12, 15, seed=3)
    image = torch.randn(2, 3, 12, 15, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(4))
    out = cal(logits, image)
    assert out.dtype == torch.float64
    c = cal.log_temperatures.double().numpy()
    w, u = cal.weight.double().numpy(), cal.interaction.double().numpy()
    mean, scale = cal.feature_mean.double().numpy(), cal.feature_scale.double().numpy()
    for n in range(2):
        per_image = ((_ref_image_stats(image[n].numpy()) if use_image else [])
                     + _ref_logit_stats(logits[n].numpy()))
        pixel, gate = _ref_pixel_stats(logits[n].numpy())
        band = _ref_bands(logits[n].numpy(), [3.0, 8.0])
        t = np.empty(band.shape)
        for i in range(band.shape[0]):
            for j in range(band.shape[1]):
                f = np.array(per_image + (pixel[:, i, j].tolist() if use_pixel else [])
                             + [gate[i, j]])
                z = np.clip((f - mean) / scale, -1.5, 1.5)
                offset = sum(z[q] * (w[q] + z[-1] * u[q]) for q in range(len(w)))
                t[i, j] = math.exp(min(max(c[band[i, j]] + offset + float(cal.bias),
                                           -math.log(100)), math.log(100)))
        x = logits[n].numpy() / t[None]
        p = np.exp(x - x.max(axis=0))
        p /= p.sum(axis=0)
        np.testing.assert_allclose(out[n].softmax(dim=0).numpy(), p, rtol=0, atol=1e-12)
    # float32: the same to float32 rounding, the arg-max exactly the network's
    out32 = cal(logits.float(), image.float())
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.softmax(1).double(), out.softmax(1), atol=2e-5, rtol=0)


def test_never_changes_the_argmax_and_starts_at_the_identity():
    cal = ImageTemperatureScaling(5)
    logits = torch.randn(3, 5, 16, 16) * 4
    image = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(cal(logits, image), logits, atol=0, rtol=0)
    _planted_state(cal, seed=7)
    with torch.no_grad():
        cal.weight.mul_(10)  # temperatures far from 1 either way
    out = cal(logits, image)
    assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))
    t = logits / out
    assert bool((t > 0).all())
    with pytest.raises(ValueError, match="needs the image"):
        cal(logits)
    no_image = ImageTemperatureScaling(5, use_image=False)
    assert no_image.needs_image is False
    assert no_image.weight.numel() == len(FEATURES) - 5 + len(PIXEL_FEATURES)
    assert no_image.feature_mean.numel() == no_image.weight.numel() + 1  # and the gate
    no_image(logits)


# ----------------------------------------------------------------------------- the fit
def _image(contrast: float, size: int, g: torch.Generator) -> torch.Tensor:
    """A normalised RGB image of the given RMS-like contrast around a random colour."""
    mean = torch.tensor(MEAN, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)
    base = torch.rand(3, 1, 1, generator=g) * 0.4 + 0.3
    img = (base + contrast * (torch.rand(3, size, size, generator=g) - 0.5)).clamp(0, 1)
    return (img - mean) / std


def _labels(z: torch.Tensor, t: float, g: torch.Generator) -> torch.Tensor:
    k, h, w = z.shape
    p = torch.softmax(z / t, dim=0).permute(1, 2, 0).reshape(-1, k)
    return torch.multinomial(p, 1, generator=g).view(h, w)


def _logits(k: int, size: int, g: torch.Generator) -> torch.Tensor:
    return torch.nn.functional.avg_pool2d(torch.randn(1, k, size, size, generator=g), 5, 1,
                                          2)[0] * 9


def _contrast_set(n: int, seed: int, copies: int = 0, k: int = 4, size: int = 24,
                  power: float = -0.8):
    """The planted shift: a clean image has contrast 0.9 and its right temperature is 0.6; a
    shifted one keeps a fraction ``f`` of the contrast and its right temperature is ``0.6
    f^power``: with the default -0.8 it grows as the contrast falls (a positive ``power``: it
    falls with the contrast, a shift that makes the network under-confident). The logits do
    not see the contrast.

    ``copies = 0``: ``n`` images with ``f`` drawn in [0.05, 0.8]; else ``n`` clean images each
    followed by ``copies`` shifted ones with ``f`` drawn in [0.05, 1] (the fit's stream)."""
    g = torch.Generator().manual_seed(seed)
    xs, ys, ims, contrast = [], [], [], []
    for _ in range(n):
        z = _logits(k, size, g)
        fractions = ([0.05 + 0.75 * float(torch.rand(1, generator=g))] if not copies else
                     [1.0] + [0.05 + 0.95 * float(torch.rand(1, generator=g))
                              for _ in range(copies)])
        for f in fractions:
            xs.append(z)
            ys.append(_labels(z, 0.6 * f ** power, g))
            ims.append(_image(0.9 * f, size, g))
            contrast.append(0.9 * f)
    return torch.stack(xs), torch.stack(ys), torch.stack(ims), torch.tensor(contrast)


def _batches(*tensors, size: int = 8):
    n = tensors[0].shape[0]
    return lambda: [tuple(t[s:s + size] for t in tensors) for s in range(0, n, size)]


def _nll(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.double(), y))


@pytest.fixture(scope="module")
def contrast_fit():
    torch.set_num_threads(1)
    x, y, im, _ = _contrast_set(20, seed=1, copies=3)
    # Weaker pulls than the default's: here the pixel statistics are the same on a clean image
    # and its copies, so the pulled fits of the default (1.0, 0.1) make the held-out clean images
    # worse by 0.001 nats, beyond their noise, and the clean rule falls back.
    cal = ImageTemperatureScaling(4, lams=[0.1, 0.01])
    info = cal.fit(_batches(x, y, im), ignore_index=VOID, copies=3)
    ts = build_calibrator("ts", 4)
    ts.fit(_batches(x, y), ignore_index=VOID)
    return cal.eval(), ts.eval(), info


def test_recovers_a_temperature_that_grows_as_contrast_falls(contrast_fit):
    """On new shifted images: image_ts's temperature falls with the contrast as the planted
    one does, and it beats one temperature (fitted on the same images), which is too cold on low
    contrast and too warm on high."""
    cal, ts, info = contrast_fit
    assert info["fell_back"] is False and info["copies"] == 3
    x, y, im, contrast = _contrast_set(60, seed=2)
    with torch.no_grad():
        log_t = cal.log_temperature(x, im).mean(dim=(1, 2))
        out = cal(x, im)
    rho = np.corrcoef(np.argsort(np.argsort(log_t.numpy())),
                      np.argsort(np.argsort(contrast.numpy())))[0, 1]
    assert rho < -0.8  # Spearman: the lower the contrast, the higher T
    assert _nll(out, y) < _nll(ts(x), y) - 0.02
    low, high = contrast < 0.35, contrast > 0.65

    def gap(logits: torch.Tensor, sel: torch.Tensor) -> float:
        """Mean confidence minus accuracy over the images of ``sel``."""
        p = logits[sel].softmax(dim=1)
        conf, pred = p.max(dim=1)
        return float(conf.mean() - (pred == y[sel]).double().mean())

    one_t = ts(x)
    assert gap(one_t, low) > 0.05 and gap(one_t, high) < -0.05  # one T cannot serve both
    assert abs(gap(out, low)) < 0.5 * gap(one_t, low)
    assert abs(gap(out, high)) < 0.5 * abs(gap(one_t, high))


def test_cools_as_well_as_warms():
    """A shift that needs a *colder* temperature (the network under-confident on it, as on the
    noisy images of the over-confident embedded runs): the fitted temperature falls with the
    contrast, and on new shifted images the fit beats one temperature fitted on the same
    images. (An offset that only warms cannot do this: it would stay at the clean
    temperatures.)"""
    torch.set_num_threads(1)
    x, y, im, _ = _contrast_set(20, seed=11, copies=3, power=0.8)
    # The planted clean images are so alike that the fit's cost on the held-out ones, 0.0014
    # nats, is 2.5 standard errors of their paired differences: allowed here (tolerance 3),
    # refused at the default (the fall-back test below checks the rule itself).
    cal = ImageTemperatureScaling(4, lams=[0.1, 0.01], tolerance=3.0)
    info = cal.fit(_batches(x, y, im), ignore_index=VOID, copies=3)
    assert info["fell_back"] is False and info["offset"]["mean_corrupted"] < -0.1
    ts = build_calibrator("ts", 4)
    ts.fit(_batches(x, y), ignore_index=VOID)
    x, y, im, contrast = _contrast_set(60, seed=12, power=0.8)
    with torch.no_grad():
        log_t = cal.log_temperature(x, im).mean(dim=(1, 2))
        out = cal(x, im)
    rho = np.corrcoef(np.argsort(np.argsort(log_t.numpy())),
                      np.argsort(np.argsort(contrast.numpy())))[0, 1]
    assert rho > 0.8  # the lower the contrast, the lower T
    assert float(log_t.max()) < float(cal.log_temperatures.max())  # colder than clean
    assert _nll(out, y) < _nll(ts(x), y) - 0.02


def _fallback_stream(n: int = 30, seed: int = 5):
    """Each validation image followed by one copy with the same logits. Fit images: clean ones
    of contrast 0.9 with labels at T = 1, copies of contrast 0.15 at T = 4: the fit learns "low
    contrast, warmer". The held-out clean images have the low contrast too but their labels
    are at T = 0.7: that rule makes them worse, to first order."""
    g = torch.Generator().manual_seed(seed)
    k, size = 4, 16
    xs, ys, ims = [], [], []
    for v in range(n):
        z = _logits(k, size, g)
        held = v % 5 == 4
        for contrast, t in (((0.15, 0.7) if held else (0.9, 1.0)), (0.15, 4.0)):
            xs.append(z)
            ys.append(_labels(z, t, g))
            ims.append(_image(contrast, size, g))
    return torch.stack(xs), torch.stack(ys), torch.stack(ims)


def test_falls_back_when_the_fit_would_hurt_held_out_clean_images():
    torch.set_num_threads(1)
    x, y, im = _fallback_stream()
    cal = ImageTemperatureScaling(4, lams=[0.01], max_iter=10)
    info = cal.fit(_batches(x, y, im), ignore_index=VOID, copies=1)
    assert info["fell_back"] is True and info["lam"] is None
    assert info["images"] == {"fit_clean": 24, "fit_corrupted": 24, "heldout_clean": 6,
                              "heldout_corrupted": 6, "validation": 30}
    assert bool((cal.weight == 0).all())
    ref = torch.tensor(info["band_temperatures"])
    torch.testing.assert_close(cal.log_temperatures.exp(), ref.float(), rtol=1e-6, atol=0)
    bts = build_calibrator("boundary_ts", 4)
    bts.temperatures.copy_(cal.log_temperatures.exp())
    torch.testing.assert_close(cal(x, im), bts(x), rtol=1e-6, atol=1e-6)
    # Without the rule (any clean loss allowed) the same fit moves, and the held-out clean
    # images pay for it: the rule is what kept them.
    free = ImageTemperatureScaling(4, lams=[0.01], max_iter=10, tolerance=1e6)
    loose = free.fit(_batches(x, y, im), ignore_index=VOID, copies=1)
    assert loose["fell_back"] is False and loose["heldout_clean_diff"] > 0.01
    assert loose["heldout_objective"] < info["heldout_objective"]


def test_outside_fit_flags_exactly_the_images_beyond_the_fit_range(contrast_fit):
    """An image is flagged when one of its per-image statistics (image and logits) lies outside
    the range over the fit's images (each clean image and its copies, the held-out ones left
    out), checked against that range computed here by the loop references, on generated images
    inside, at and beyond the edges; the fit images themselves are never flagged, and an
    unfitted calibrator flags nothing."""
    cal, _, _ = contrast_fit
    x, _, im, _ = _contrast_set(20, seed=1, copies=3)  # the fixture's fit stream
    fitting = [j for j in range(len(x)) if (j // 4) % 5 != 4]

    def ref_stats(logits: torch.Tensor, image: torch.Tensor) -> list[float]:
        return _array_stats(logits.double().numpy(), image.double().numpy())

    for j in (0, 1, len(x) - 1):  # the array formulas are the loop references
        np.testing.assert_allclose(
            ref_stats(x[j], im[j]), _ref_image_stats(im[j].double().numpy())
            + _ref_logit_stats(x[j].double().numpy()), rtol=1e-12, atol=1e-12)
    seen = np.array([ref_stats(x[j], im[j]) for j in fitting])
    low, high = seen.min(axis=0), seen.max(axis=0)
    with torch.no_grad():
        assert not bool(cal.outside_fit(x[fitting], im[fitting]).any())
    g = torch.Generator().manual_seed(21)
    logits, images = [], []
    for i in range(40):  # contrast from far below to above the fit's; logits sharper or flatter
        z = _logits(4, 24, g) * (0.3 + 1.7 * float(torch.rand(1, generator=g)))
        logits.append(z)
        images.append(_image(0.02 + 1.4 * i / 39, 24, g))
    logits, images = torch.stack(logits), torch.stack(images)
    with torch.no_grad():
        flags = cal.outside_fit(logits, images)
    scale = cal.feature_scale[:len(low)].double().numpy()
    checked = 0
    np.testing.assert_allclose(  # and on the generated images (the first and the last)
        [ref_stats(logits[j], images[j]) for j in (0, len(logits) - 1)],
        [_ref_image_stats(images[j].double().numpy()) + _ref_logit_stats(logits[j].double()
                                                                         .numpy())
         for j in (0, len(logits) - 1)], rtol=1e-12, atol=1e-12)
    for j in range(len(logits)):
        v = np.array(ref_stats(logits[j], images[j]))
        margin = np.minimum(np.abs(v - low), np.abs(v - high)) / scale
        if margin.min() < 1e-3:  # too close to an edge for float32 to decide
            continue
        assert bool(flags[j]) == bool(((v < low) | (v > high)).any()), j
        checked += 1
    assert checked >= 30 and 0 < int(flags.sum()) < len(flags)  # both kinds were generated
    fresh = ImageTemperatureScaling(4)
    assert not bool(fresh.outside_fit(logits, images).any())
    assert cal.outside_fit(logits, images).shape == (40,)


def test_save_load_round_trip(contrast_fit, tmp_path):
    cal, _, _ = contrast_fit
    path = save_calibrator(cal, tmp_path / "calibrators" / "image_ts.pt")
    back = load_calibrator(path)
    assert type(back) is ImageTemperatureScaling and back.params == cal.params
    assert back.fit_info["weight"] == cal.fit_info["weight"]
    x, _, im, _ = _contrast_set(4, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(back(x, im), cal(x, im), atol=0, rtol=0)


def test_goes_into_torch_export_for_every_size(contrast_fit):
    from torch.export import Dim, export

    cal, _, _ = contrast_fit
    x, _, im, _ = _contrast_set(2, seed=3)
    n, h, w = Dim("n", min=1), Dim("h", min=8, max=4096), Dim("w", min=8, max=4096)
    program = export(cal, (x, im), dynamic_shapes=({0: n, 2: h, 3: w}, {0: n, 2: h, 3: w}))
    module = program.module()  # one module for both sizes (each .module() rebuilds it)
    for shape in ((1, 4, 19, 33), (3, 4, 40, 24)):
        g = torch.Generator().manual_seed(shape[2])
        a = torch.randn(*shape, generator=g) * 5
        b = torch.randn(shape[0], 3, *shape[2:], generator=g)
        torch.testing.assert_close(module(a, b), cal(a, b), atol=0, rtol=0)


# ----------------------------------------------------------------------------- commands
def test_eval_seg_and_predict_seg_give_the_same_calibrated_confidence(tmp_path):
    """eval_seg --calibrators image_ts fits it (with corrupted copies of the validation images)
    and saves it; predict_seg --calibrator image_ts on a test image file writes the confidence
    that the evaluation pass computes for that image."""
    import json

    import cv2

    from cals_seg.config.schema import load_config
    from cals_seg.evaluation.engine import run_test_pass
    from cals_seg.runs.run import load_run
    from cals_seg.training.engine import make_loader

    from .conftest import fake_run, load_tool

    setup = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3.yaml"
    sets = [f"data.root={tmp_path / 'data'}",
            "data.synthetic={num_train: 30, num_test: 3, image_size: 32}",
            "train.amp=none", "train.threads=1", "train.progress=false", "eval.num_maps=0",
            "model.encoder_name=tu-mobilenetv3_small_050",
            "model.params={encoder_output_stride: 16, decoder_channels: 16}"]
    cfg = load_config(setup, sets, "ce")
    from cals_seg.tasks.segmentation import build_model

    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # a head that predicts several classes, so that there are boundaries
        model.segmentation_head[0].weight.normal_(0, 3)
    run = fake_run(tmp_path / "run", cfg, model=model, config=True)
    params = ["--calibrator-param", "image_ts.holdout_every=2", "image_ts.max_iter=3",
              "image_ts.lams=[0.1]"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_tool("eval_seg").main([str(run), "--out", str(tmp_path / "eval"),
                                           "--calibrators", "image_ts", *params,
                                           "--set", *sets, "--save-calibrators-to-run"]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    fit = metrics["calibrator_fits"]["image_ts"]
    assert fit["copies"] == 3 and fit["images"]["fit_corrupted"] == 3 * fit["images"]["fit_clean"]
    assert metrics["calibrators"]["image_ts"]["miou"] == metrics["pre_ts"]["miou"]

    loaded = load_run(run, overrides=sets, family="segmentation", with_data=True)
    path = run / "calibrators" / "image_ts.pt"
    cal = load_calibrator(path)
    test = loaded.task.test_set
    flags = []
    for logits, _, image in loaded.inference.predict(make_loader(test, 2, False, 0),
                                                     with_inputs=True):
        flags.append(cal.outside_fit(logits, image))
    flags = torch.cat(flags)
    assert metrics["calibrators"]["image_ts"]["outside_fit"] == pytest.approx(
        float(flags.double().mean()), abs=1e-12)
    _planted_state(cal)  # image statistics that matter, kept with the fit's record
    save_calibrator(cal, path, fitted_for=cal.fitted_for)
    sets_made: list[list[torch.Tensor]] = []

    class Capture:
        def __init__(self):
            self.seen: list[torch.Tensor] = []
            sets_made.append(self.seen)

        def to(self, device):
            return self

        def update(self, logits, target):
            self.seen.append(logits.softmax(dim=1).amax(dim=1))

        def compute(self):
            return {}

    run_test_pass(loaded.inference, make_loader(test, 1, False, 0),
                  lambda: {"capture": Capture()}, calibrators={"image_ts": cal})
    captured = sets_made[-1]  # the calibrator's set (made after the uncalibrated one)
    image_id = test.ids[0]
    out = tmp_path / "pred"
    assert load_tool("predict_seg").main([str(run), str(test.image_path(image_id)), "--out",
                                          str(out), "--calibrator", "image_ts",
                                          "--no-progress", "--no-ood-check"]) == 0
    saved = cv2.imread(str(out / f"{Path(test.image_path(image_id)).stem}_confidence.png"),
                       cv2.IMREAD_UNCHANGED) / 65535
    want = captured[0][0].numpy()
    assert saved.shape == want.shape
    assert np.abs(saved - want).max() <= 1 / 65535
    raw = sets_made[0][0][0].numpy()
    assert np.abs(raw - want).max() > 10 / 65535  # the check can tell them apart
    line = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
    assert line["calibrator"] == "image_ts"
    assert line["mean_confidence"] == pytest.approx(float(want.mean()), abs=1e-6)
    with torch.no_grad():  # the planted range (+-1.5 standard units) flags this image
        logits, _, image = next(iter(loaded.inference.predict(make_loader(test, 1, False, 0),
                                                               with_inputs=True)))
        assert bool(cal.outside_fit(logits, image)[0])
    assert line["outside_calibrator_fit"] is True
    with torch.no_grad():  # a range that holds every image: not flagged
        cal.feature_low.fill_(-1e9)
        cal.feature_high.fill_(1e9)
    save_calibrator(cal, path, fitted_for=cal.fitted_for)
    assert load_tool("predict_seg").main([str(run), str(test.image_path(image_id)), "--out",
                                          str(tmp_path / "pred2"), "--calibrator", "image_ts",
                                          "--no-progress", "--no-ood-check"]) == 0
    line = json.loads((tmp_path / "pred2" / "predictions.jsonl").read_text().splitlines()[0])
    assert line["outside_calibrator_fit"] is False
