"""LTS with a lower-resolution temperature map (``downsample``): the map equals the
full-resolution network on pooled inputs, upsampled bilinearly (numpy references), and the
fitted calibrator still beats one temperature on a planted case."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cals_seg.calibrators import build_calibrator


def _pool(x: np.ndarray, s: int) -> np.ndarray:
    n, c, h, w = x.shape
    return x.reshape(n, c, h // s, s, w // s, s).mean(axis=(3, 5))


def _bilinear(x: np.ndarray, h: int, w: int) -> np.ndarray:
    """align_corners=False bilinear upsampling, written out."""
    n, c, hi, wi = x.shape
    out = np.zeros((n, c, h, w))
    for y in range(h):
        sy = max((y + 0.5) * hi / h - 0.5, 0.0)
        y0 = min(int(sy), hi - 1)
        y1, fy = min(y0 + 1, hi - 1), sy - y0
        for xx in range(w):
            sx = max((xx + 0.5) * wi / w - 0.5, 0.0)
            x0 = min(int(sx), wi - 1)
            x1, fx = min(x0 + 1, wi - 1), sx - x0
            out[:, :, y, xx] = ((1 - fy) * ((1 - fx) * x[:, :, y0, x0] + fx * x[:, :, y0, x1])
                                + fy * ((1 - fx) * x[:, :, y1, x0] + fx * x[:, :, y1, x1]))
    return out


def test_low_resolution_map_is_pooled_network_upsampled():
    torch.manual_seed(0)
    k, s = 4, 3
    low = build_calibrator("lts", k, downsample=s)
    full = build_calibrator("lts", k)
    for conv in (low.t_a, low.t_b, low.gate_ab, low.gate_image, low.t_image):
        torch.nn.init.normal_(conv.weight, std=0.05)
        torch.nn.init.normal_(conv.bias, std=0.1)
    full.load_state_dict(low.state_dict())
    logits, image = torch.randn(2, k, 27, 33) * 3, torch.randn(2, 3, 27, 33)
    with torch.no_grad():
        got = low.log_temperature(logits, image).double().numpy()
        pooled = full.log_temperature(torch.from_numpy(_pool(logits.double().numpy(), s)).float(),
                                      torch.from_numpy(_pool(image.double().numpy(), s)).float())
    expected = np.clip(_bilinear(pooled.double().numpy(), 27, 33), -np.log(100), np.log(100))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    out = low(logits, image)
    assert torch.equal(out.argmax(dim=1), logits.argmax(dim=1))
    # too small for the padding at 1 / s: full resolution
    small_l, small_i = logits[..., :9, :9], image[..., :9, :9]
    torch.testing.assert_close(low(small_l, small_i), full(small_l, small_i))


def test_identity_at_initialisation():
    cal = build_calibrator("lts", 3, downsample=4)
    logits = torch.randn(1, 3, 32, 40)
    torch.testing.assert_close(cal(logits, torch.randn(1, 3, 32, 40)), logits)


def test_low_resolution_lts_fits_a_planted_case():
    """Over-confident (x4) on the right half of each image, calibrated on the left: the
    temperature map at 1/4 of the resolution still beats one temperature."""
    g = torch.Generator().manual_seed(5)
    n, k, h, w = 20, 4, 32, 32
    z = torch.randn(n, k, h, w, generator=g) * 2
    target = torch.distributions.Categorical(logits=z.movedim(1, -1)).sample()
    image = torch.zeros(n, 3, h, w)
    image[:, 0, :, w // 2:] = 1.0
    logits = z * torch.where(image[:, :1] > 0, 4.0, 1.0)

    def batches():
        return ((logits[i:i + 2], target[i:i + 2], image[i:i + 2]) for i in range(0, n, 2))

    def nll(x):
        return float(F.cross_entropy(x, target))

    cal = build_calibrator("lts", k, epochs=30, lr=0.05, patience=30, downsample=4)
    cal.fit(batches, ignore_index=255)
    ts = build_calibrator("ts", k)
    ts.fit(lambda: ((a, b) for a, b, _ in batches()), ignore_index=255)
    with torch.no_grad():
        assert nll(cal(logits, image)) < nll(ts(logits)) < nll(logits)


def _reflect_index(n: int, pad: int) -> list[int]:
    """Source index of each position of a side of ``n`` reflection-padded by ``pad``."""
    out = []
    for i in range(-pad, n + pad):
        while i < 0 or i >= n:
            i = -i if i < 0 else 2 * (n - 1) - i
        out.append(i)
    return out


def test_the_convolution_without_the_padded_copy_equals_the_padded_one():
    """lts's branches (``_reflect_conv``: zero-padded, channels-last, the borders recomputed
    from reflected strips) equal the convolution of the reflection-padded input (padding
    written out by index), values and gradients in float64, on generated sizes, kernels and
    dilations, including sides under ``3 pad`` (the padded path)."""
    from cals_seg.calibrators.lts import _reflect_conv

    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        k, d = (3, 5, 7)[trial % 3], (1, 2, 3)[trial // 3 % 3]
        pad = d * (k - 1) // 2
        n, c = 1 + trial % 2, 1 + trial % 5
        h, w = (int(torch.randint(pad + 1, 40, (1,), generator=g)) for _ in range(2))
        x = torch.randn(n, c, h, w, dtype=torch.float64, generator=g, requires_grad=True)
        weight = torch.randn(4, c, k, k, dtype=torch.float64, generator=g, requires_grad=True)
        bias = torch.randn(4, dtype=torch.float64, generator=g)
        rows, cols = _reflect_index(h, pad), _reflect_index(w, pad)
        padded = x[:, :, rows][:, :, :, cols]
        want = F.conv2d(padded, weight, bias, dilation=d)
        got = _reflect_conv(x, weight, bias, pad, d)
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-10, (trial, h, w, k, d)
        grad = torch.randn(want.shape, dtype=torch.float64, generator=g)
        want_g = torch.autograd.grad((want * grad).sum(), (x, weight))
        got_g = torch.autograd.grad((got * grad).sum(), (x, weight))
        for a, b in zip(got_g, want_g, strict=True):
            assert (a - b).abs().max() < 1e-10, trial
