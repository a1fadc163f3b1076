"""SVLS and NACL: hand cases, independent float64 loop references, void, the authors' formulas
without void, and the (N, K, H, W) contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cals_seg.losses import NACLLoss, SVLSLoss, build_loss

K = 4
IGN = 255


def _data(n=2, k=K, s=(7, 6), scale=3.0, seed=0, void=0.15):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, k, *s), generator=g, dtype=torch.float64) * scale
    # blocky labels: real neighbourhoods mix few classes
    y = torch.randint(0, k, (n, (s[0] + 1) // 2, (s[1] + 1) // 2), generator=g)
    y = y.repeat_interleave(2, 1).repeat_interleave(2, 2)[:, : s[0], : s[1]].contiguous()
    y[torch.rand((n, *s), generator=g) < void] = IGN
    return x, y


# ----------------------------------------------------------------- float64 loop references
def _ref_distribution(y, k, weights, padding):
    """q[a, c, i, j] by loops: weighted label counts of the window pixels (a void one counts
    1/K for every class) over their weights; outside the image class 0 ("zeros") or the nearest
    pixel ("replicate")."""
    y = y.numpy()
    n, h, w = y.shape
    r = len(weights) // 2
    q = np.zeros((n, k, h, w))
    for a in range(n):
        for i in range(h):
            for j in range(w):
                num, den = np.zeros(k), 0.0
                for dy in range(-r, r + 1):
                    for dx in range(-r, r + 1):
                        ii, jj = i + dy, j + dx
                        inside = 0 <= ii < h and 0 <= jj < w
                        if padding == "zeros" and not inside:
                            lab = 0
                        else:
                            lab = y[a, min(max(ii, 0), h - 1), min(max(jj, 0), w - 1)]
                        wt = weights[dy + r][dx + r]
                        if lab == IGN:  # unknown label: 1/K to every class
                            num += wt / k
                        else:
                            num[lab] += wt
                        den += wt
                if den > 0:
                    q[a, :, i, j] = num / den
    return torch.from_numpy(q)


def _svls_weights(sigma=1.0, size=3):
    r = size // 2
    g = [[math.exp(-(dy * dy + dx * dx) / (2 * sigma * sigma)) for dx in range(-r, r + 1)]
         for dy in range(-r, r + 1)]
    total = sum(map(sum, g))
    g = [[v / total for v in row] for row in g]
    rest = 1.0 - g[r][r]
    g[r][r] = rest
    return [[v / rest for v in row] for row in g]


def _ref_svls(x, y, sigma=1.0, size=3):
    q = _ref_distribution(y, x.shape[1], _svls_weights(sigma, size), "replicate")
    logp = torch.log_softmax(x, dim=1)
    total, count = 0.0, 0
    for a in range(y.shape[0]):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                if y[a, i, j] != IGN:
                    total -= float((q[a, :, i, j] * logp[a, :, i, j]).sum())
                    count += 1
    return total / max(count, 1)


def _ref_nacl(x, y, alpha=0.1, size=3):
    k = x.shape[1]
    q = _ref_distribution(y, k, [[1.0] * size] * size, "zeros")
    logp = torch.log_softmax(x, dim=1)
    ce, pen, count = 0.0, 0.0, 0
    for a in range(y.shape[0]):
        for i in range(y.shape[1]):
            for j in range(y.shape[2]):
                t = int(y[a, i, j])
                if t == IGN:
                    continue
                count += 1
                ce -= float(logp[a, t, i, j])
                pen += sum(abs(float(q[a, c, i, j] - x[a, c, i, j])) for c in range(k))
    return ce / count + alpha * pen / (count * k)


# ----------------------------------------------------------------- the authors' formulas
def _authors_svls(x, y, sigma=1.0):
    """CELossWithSVLS_2D (MarginLoss / SVLS repositories), re-derived: one-hot labels through a
    depthwise 3x3 convolution with replicate padding and the SVLS kernel, divided by the
    kernel's sum; mean over every pixel of -sum_k q_k log p_k."""
    k = x.shape[1]
    kern = torch.tensor(_svls_weights(sigma), dtype=torch.float64)
    onehot = F.one_hot(y, k).permute(0, 3, 1, 2).to(torch.float64)
    padded = F.pad(onehot, (1, 1, 1, 1), mode="replicate")
    q = F.conv2d(padded, kern.expand(k, 1, 3, 3), groups=k) / kern.sum()
    return (-(q * torch.log_softmax(x, dim=1)).sum(dim=1)).mean()


def _authors_nacl(x, y, alpha=0.1):
    """AdaptMarginSVLS with kernel_ops mean, l1 on logits: zero-padded unfold, proportions
    count / 9, CE + alpha * mean over every pixel and class of |q - l|."""
    k = x.shape[1]
    n, h, w = y.shape
    u = F.unfold(y[:, None].to(torch.float64), kernel_size=3, padding=1)  # (N, 9, HW)
    q = torch.stack([(u == c).sum(1).to(torch.float64) / 9 for c in range(k)], 1)
    q = q.reshape(n, k, h, w)
    return F.cross_entropy(x, y) + alpha * (q - x).abs().mean()


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_the_authors_formulas_without_void(seed):
    x, y = _data(seed=seed, void=0.0)
    torch.testing.assert_close(SVLSLoss(K)(x, y), _authors_svls(x, y), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(NACLLoss(K)(x, y), _authors_nacl(x, y), rtol=1e-12, atol=1e-12)
    # gradients too (the authors' code is plain autograd)
    for ours, theirs in ((SVLSLoss(K), _authors_svls), (NACLLoss(K), _authors_nacl)):
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ours(a, y).backward()
        theirs(b, y).backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", [0, 3])
def test_equal_loop_references_with_void(seed):
    x, y = _data(seed=seed, void=0.25)
    assert (y == IGN).any()
    torch.testing.assert_close(
        SVLSLoss(K, ignore_index=IGN)(x, y), torch.tensor(_ref_svls(x, y), dtype=torch.float64),
        rtol=1e-12, atol=1e-12,
    )
    torch.testing.assert_close(
        NACLLoss(K, ignore_index=IGN)(x, y), torch.tensor(_ref_nacl(x, y), dtype=torch.float64),
        rtol=1e-12, atol=1e-12,
    )
    # a 5x5 window, another sigma and weight
    torch.testing.assert_close(
        SVLSLoss(K, kernel_size=5, sigma=2.0, ignore_index=IGN)(x, y),
        torch.tensor(_ref_svls(x, y, 2.0, 5), dtype=torch.float64), rtol=1e-12, atol=1e-12,
    )
    torch.testing.assert_close(
        NACLLoss(K, alpha=0.3, kernel_size=5, ignore_index=IGN)(x, y),
        torch.tensor(_ref_nacl(x, y, 0.3, 5), dtype=torch.float64), rtol=1e-12, atol=1e-12,
    )


def test_hand_computed_neighbourhood_proportions():
    """2x2 image [[1, 1], [2, void]], K = 3, zero padding (class 0 outside the image). Pixel
    (0, 0): 5 padded zeros, two 1s, one 2, one void (1/3 to each class) -> (5 1/3, 2 1/3,
    1 1/3) / 9 (the authors' formula: (5, 2, 1) / 9, leaving out: (5, 2, 1) / 8)."""
    y = torch.tensor([[[1, 1], [2, IGN]]])
    q = NACLLoss(3, ignore_index=IGN).proportions(y, y != IGN, torch.float64)
    expected = (torch.tensor([5, 2, 1], dtype=torch.float64) + 1 / 3) / 9
    torch.testing.assert_close(q[0, :, 0, 0], expected)
    # (0, 1): 5 zeros outside, the 1s at (0,0) and (0,1), the 2 at (1,0), void at (1,1)
    torch.testing.assert_close(q[0, :, 0, 1], expected)
    # (1, 0): 5 zeros, 1s at (0,0) (0,1), the 2 itself, void
    torch.testing.assert_close(q[0, :, 1, 0], expected)
    # the loss: CE over the three valid pixels + 0.1 * mean_{i, k} |q_ik - l_ik| with l = 0
    x = torch.zeros(1, 3, 2, 2, dtype=torch.float64)
    expected = math.log(3) + 0.1 * (3 * 8 / 8) / (3 * 3)
    torch.testing.assert_close(NACLLoss(3, ignore_index=IGN)(x, y),
                               torch.tensor(expected, dtype=torch.float64))


def test_hand_computed_gaussian_soft_labels():
    """One class-1 pixel in the middle of a 3x3 class-0 image, sigma 1: the centre keeps half
    its own label; a 4-neighbour gets half of the edge weight e^-1/2 / (4 e^-1/2 + 4 e^-1) of
    class 1, a diagonal neighbour half of the corner weight."""
    y = torch.zeros(1, 3, 3, dtype=torch.long)
    y[0, 1, 1] = 1
    q = SVLSLoss(2).soft_labels(y, torch.ones_like(y, dtype=torch.bool), torch.float64)
    ring = 4 * math.exp(-0.5) + 4 * math.exp(-1.0)
    edge, corner = math.exp(-0.5) / ring, math.exp(-1.0) / ring
    assert q[0, 1, 1, 1].item() == pytest.approx(0.5, abs=1e-15)
    for i, j in ((0, 1), (1, 0), (1, 2), (2, 1)):
        assert q[0, 1, i, j].item() == pytest.approx(edge / 2, abs=1e-15)
    for i, j in ((0, 0), (0, 2), (2, 0), (2, 2)):
        assert q[0, 1, i, j].item() == pytest.approx(corner / 2, abs=1e-15)
    torch.testing.assert_close(q.sum(1), torch.ones(1, 3, 3, dtype=torch.float64))
    # replicate padding: a class-1 column on the left border of a 3x3 image
    y = torch.zeros(1, 3, 3, dtype=torch.long)
    y[0, :, 0] = 1
    q = SVLSLoss(2).soft_labels(y, torch.ones_like(y, dtype=torch.bool), torch.float64)
    # (1, 1): the left column of its window is class 1: two corners and one edge
    assert q[0, 1, 1, 1].item() == pytest.approx((edge + 2 * corner) / 2, abs=1e-15)
    # (1, 0): the replicated column outside is class 1 too: 0.5 + (edge + 2 corners) / 2 from
    # the left outside column, plus the two vertical edges
    assert q[0, 1, 1, 0].item() == pytest.approx(0.5 + (3 * edge + 2 * corner) / 2, abs=1e-15)


def test_void_neighbours_spread_and_void_pixels_get_no_gradient():
    x, y = _data(seed=5, void=0.3)
    for loss in (SVLSLoss(K, ignore_index=IGN), NACLLoss(K, ignore_index=IGN)):
        a = x.clone().requires_grad_(True)
        base = loss(a, y)
        base.backward()
        void = (y == IGN).unsqueeze(1).expand_as(x)
        assert (a.grad[void] == 0).all()
        # valid rows of q sum to 1 (a void neighbour is 1/K of every class)
        q = (loss.soft_labels if isinstance(loss, SVLSLoss) else loss.proportions)(
            y, y != IGN, torch.float64)
        torch.testing.assert_close(q.sum(1)[y != IGN], torch.ones(int((y != IGN).sum()),
                                                                  dtype=torch.float64))
        # every pixel void: 0 with a zero gradient
        b = x.clone().requires_grad_(True)
        out = loss(b, torch.full_like(y, IGN))
        out.backward()
        assert out.item() == 0.0 and (b.grad == 0).all()


def test_float32_matches_float64():
    x, y = _data(seed=2, s=(16, 12))
    for name in ("svls", "nacl"):
        loss = build_loss(name, K, ignore_index=IGN)
        torch.testing.assert_close(loss(x.float(), y), loss(x, y).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["svls", "nacl"])
def test_other_shapes_are_refused(name):
    loss = build_loss(name, K, ignore_index=IGN)
    x, y = _data()
    with pytest.raises(ValueError, match=r"\(N, K, H, W\).*2-D neighbourhood"):
        loss(x[:, :, 0], y[:, 0])
    with pytest.raises(ValueError, match=r"\(N, K, H, W\)"):
        loss(x[:, :, :, :, None], y[:, :, :, None])
    with pytest.raises(ValueError, match="kernel_size"):
        build_loss(name, K, kernel_size=4)


def test_bad_parameters():
    with pytest.raises(ValueError, match="sigma"):
        SVLSLoss(K, sigma=0.0)
    with pytest.raises(ValueError, match="alpha"):
        NACLLoss(K, alpha=-1.0)
