"""CRaC: the authors' formula without void, per-region multiplier updates over two epochs
against a float64 loop reference (void included), streaming, resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cals_seg.losses import CRaCLoss, build_loss

K = 4
IGN = 255


def _data(n=2, s=(6, 7), scale=2.0, seed=0, void=0.15):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, K, *s), generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, K, (n, (s[0] + 2) // 3, (s[1] + 2) // 3), generator=g)
    y = y.repeat_interleave(3, 1).repeat_interleave(3, 2)[:, : s[0], : s[1]].contiguous()
    y[torch.rand((n, *s), generator=g) < void] = IGN
    return x, y


# ----------------------------------------------------------------- the authors' formula
def _authors_phr(h, lam, rho):
    x = lam + rho * h
    return torch.where(x >= 0, (x**2 - lam**2) / (2 * rho), -(lam**2) / (2 * rho))


def _authors_crac(x, y, lambdas, rhos, margin=1.0):
    """SpatialBndClsAugLagrangian.get + CE, re-derived (float64): zero-padded unfold, proportions
    count / 9, easy |m q - l| / diff |q - l| constraints, 2K columns (boundary, interior), mean of
    PHR over every pixel and column. The region is the intended one: a window not uniform."""
    n, k, h, w = x.shape
    u = F.unfold(y[:, None].to(torch.float64), kernel_size=3, padding=1)  # (N, 9, HW)
    q = torch.stack([(u == c).sum(1).to(torch.float64) / 9 for c in range(k)], 1)
    q = q.reshape(n, k, h, w)
    easy, diff = (margin * q - x).abs(), (q - x).abs()
    reg = (u != u[:, 4:5]).any(1).reshape(n, 1, h, w).to(torch.float64)
    cons = reg * diff + (1 - reg) * easy
    hcat = torch.cat([cons * reg, cons * (1 - reg)], 1).movedim(1, -1)  # (N, H, W, 2K)
    p = _authors_phr(hcat, lambdas.reshape(-1), rhos.reshape(-1))
    return F.cross_entropy(x, y) + p.mean()


@pytest.mark.parametrize("margin", [1.0, 1.5])
def test_equals_the_authors_formula_without_void(margin):
    x, y = _data(void=0.0, seed=1)
    loss = CRaCLoss(K, margin=margin)
    g = torch.Generator().manual_seed(3)
    loss.lambdas.copy_(torch.rand(2, K, generator=g, dtype=torch.float64) * 2)
    loss.rhos.copy_(1 + torch.rand(2, K, generator=g, dtype=torch.float64) * 3)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, theirs = loss(a, y), _authors_crac(b, y, loss.lambdas, loss.rhos, margin)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)


def _formula(loss, x, y):
    """CE + the penalty written with autograd ops on the whole batch (void excluded): the
    reference of the analytic backward, any penalty."""
    valid = y != IGN
    t, boundary = loss.targets(y, valid, x.dtype)
    b = boundary.unsqueeze(1)
    rho = torch.where(b, loss.rhos[0].view(1, -1, 1, 1), loss.rhos[1].view(1, -1, 1, 1))
    lam = torch.where(b, loss.lambdas[0].view(1, -1, 1, 1), loss.lambdas[1].view(1, -1, 1, 1))
    p = loss.penalty.value((t - x).abs(), rho.to(x.dtype), lam.to(x.dtype)).sum(1)
    count = valid.sum()
    return (F.cross_entropy(x, y, ignore_index=IGN, reduction="sum") / count
            + p.masked_fill(~valid, 0.0).sum() / (count * 2 * K))


@pytest.mark.parametrize("penalty", ["phr", "p2", "p3"])
@pytest.mark.parametrize("margin", [1.0, 2.0])
def test_analytic_backward_equals_autograd_with_void(penalty, margin):
    """Value and gradient against autograd on the formula, float64, void pixels included, some
    logits exactly at their target (|t - l| = 0: no gradient, as autograd's abs)."""
    x, y = _data(n=3, s=(7, 8), seed=4)
    loss = CRaCLoss(K, margin=margin, penalty=penalty, ignore_index=IGN)
    g = torch.Generator().manual_seed(5)
    loss.lambdas.copy_(torch.rand(2, K, generator=g, dtype=torch.float64) * 2)
    loss.rhos.copy_(1 + torch.rand(2, K, generator=g, dtype=torch.float64) * 3)
    t, _ = loss.targets(y, y != IGN, x.dtype)
    x[:, :, :2] = t[:, :, :2]  # ties with the target
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, ref = loss(a, y), _formula(loss, b, y)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)
    assert (a.grad[:, :, :2][(y[:, :2] == IGN).unsqueeze(1).expand(-1, K, -1, -1)] == 0).all()


def test_gradcheck():
    x, y = _data(n=2, s=(5, 6), seed=6)
    loss = CRaCLoss(K, margin=1.5, ignore_index=IGN)
    loss.lambdas.fill_(0.7)
    assert torch.autograd.gradcheck(lambda v: loss(v, y), (x.requires_grad_(True),))


def test_backward_keeps_one_logits_tensor_besides_the_logits():
    """What the penalty keeps for backward: the target t (one logits-sized float32 tensor),
    the boundary and valid maps and the (2, K) parameters; autograd on the formula kept about
    seven logits-sized tensors."""
    x, y = _data(n=2, s=(32, 32), seed=7)
    x = x.float().requires_grad_(True)
    loss = CRaCLoss(K, ignore_index=IGN)
    sizes: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
            sizes.append(t.untyped_storage().nbytes())
        return t

    t, boundary = loss.targets(y, y != IGN, torch.float32)
    from cals_seg.losses.crac import _RegionPenalty

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _RegionPenalty.apply(x, t, boundary, y != IGN, loss.rhos.float().view(2, -1, 1, 1),
                                   loss.lambdas.float().view(2, -1, 1, 1), loss.penalty,
                                   torch.tensor(1.0))
    out.backward()
    # t is a view of the proportions' (K + 1)-channel accumulator (the void channel)
    t_bytes = x.numel() * 4 * (K + 1) // K
    assert sum(sizes) <= t_bytes + 2 * 2 * 32 * 32 + 2 * 2 * K * 4


def test_the_authors_region_test_misses_mixed_windows():
    """Why the region is "the window is not uniform" rather than the authors' literal
    ``sum(mean(u) - u) != 0``: in float32 that sum is a rounding residual, zero for uniform
    windows but also for some mixed ones (docs/spatial_losses.md)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (4, 1, 8, 8), generator=g).float()
    y = F.interpolate(y, size=(64, 64), mode="nearest")
    u = F.unfold(y, kernel_size=3, padding=1)
    literal = ((u.mean(1, keepdim=True) - u).sum(1)) != 0
    mixed = (u != u[:, 4:5]).any(1)
    assert not (literal & ~mixed).any()  # never flags a uniform window
    assert (mixed & ~literal).any()  # but misses some mixed ones


# ----------------------------------------------------------------- the update, by loops
def _phr(h, lam, rho):
    return lam * h + rho * h * h / 2 if lam + rho * h >= 0 else -lam * lam / (2 * rho)


def _phr_grad(h, lam, rho):
    return max(0.0, lam + rho * h)


def _pixels(x, y, margin):
    """(region, [h_k]) of every valid pixel, by loops (region 0 boundary, 1 interior)."""
    xs, ys = x.numpy(), y.numpy()
    n, k, hh, ww = xs.shape
    out = []
    for a in range(n):
        for i in range(hh):
            for j in range(ww):
                if ys[a, i, j] == IGN:
                    continue
                counts, total, mixed = np.zeros(k), 0, False
                for di in (-1, 0, 1):
                    for dj in (-1, 0, 1):
                        ii, jj = i + di, j + dj
                        lab = ys[a, ii, jj] if 0 <= ii < hh and 0 <= jj < ww else 0
                        mixed |= lab != ys[a, i, j]
                        if lab != IGN:
                            counts[lab] += 1
                        else:  # unknown label: 1/K to every class
                            counts += 1.0 / k
                        total += 1
                q = counts / total
                scale = 1.0 if mixed else margin
                out.append((0 if mixed else 1, [abs(scale * q[c] - xs[a, c, i, j])
                                                for c in range(k)]))
    return out


def _reference(epochs, margin, rho0, gamma=1.2, tau=0.9, period=1, lmin=1e-6, lmax=1e6):
    lam = np.full((2, K), 1e-6)
    rho = np.full((2, K), rho0)
    prev, history = None, []
    for e, batches in enumerate(epochs):
        pixels = [p for x, y in batches for p in _pixels(x, y, margin)]
        n = len(pixels)
        s_grad, s_h = np.zeros((2, K)), np.zeros((2, K))
        for region, hs in pixels:
            for r in range(2):
                for c in range(K):
                    h = hs[c] if r == region else 0.0
                    s_grad[r, c] += min(max(_phr_grad(h, lam[r, c], rho[r, c]), lmin), lmax)
                    s_h[r, c] += h
        lam = np.clip(s_grad / n, lmin, lmax)
        hbar = s_h / n
        if (e + 1) % period == 0 and prev is not None:
            rho = np.clip(np.where(hbar > tau * np.maximum(prev, 0), rho * gamma, rho), rho0, 10)
        prev = hbar
        history.append((lam.copy(), rho.copy(), hbar))
    return history


def _epochs():
    return [[_data(seed=10 * e + b, scale=2.0 + e) for b in range(2)] for e in range(2)]


# (5, 0.1): the defaults, the authors' published runs; (1, 1): their YAML's default
@pytest.mark.parametrize("margin,rho0", [(5.0, 0.1), (1.0, 1.0), (2.0, 0.1)])
def test_two_epochs_of_updates_equal_the_loop_reference(margin, rho0):
    epochs = _epochs()
    if (margin, rho0) == (5.0, 0.1):
        loss = CRaCLoss(K, rho_period=1, ignore_index=IGN)  # the defaults are the published ones
    else:
        loss = CRaCLoss(K, margin=margin, rho_init=rho0, rho_min=rho0, rho_period=1,
                        ignore_index=IGN)
    ref = _reference(epochs, margin, rho0)
    for e, batches in enumerate(epochs):
        for x, y in batches:
            loss.observe(x, y)
        logs = loss.update_multipliers(e)
        lam, rho, hbar = ref[e]
        for row, region in enumerate(("boundary", "interior")):
            np.testing.assert_allclose(logs[f"lambda_{region}"], lam[row], rtol=1e-12)
            np.testing.assert_allclose(logs[f"rho_{region}"], rho[row], rtol=1e-12)
            np.testing.assert_allclose(logs[f"constraint_{region}"], hbar[row], rtol=1e-12,
                                       atol=1e-15)
    assert (ref[1][1] > rho0).any() and (ref[1][0][1] > 1e-6).any()  # rho, interior lambda moved
    # the training penalty with these multipliers equals the loop formula
    x, y = epochs[0][0]
    pixels = _pixels(x, y, margin)
    lam, rho, _ = ref[1]
    pen = sum(_phr(h, lam[r, c], rho[r, c]) for r, hs in pixels for c, h in enumerate(hs))
    ce = F.cross_entropy(x, y, ignore_index=IGN)
    expected = ce + pen / (len(pixels) * 2 * K)
    torch.testing.assert_close(loss(x, y), expected, rtol=1e-12, atol=1e-12)


def test_streaming_equals_one_shot_and_float32():
    epochs = _epochs()
    one = CRaCLoss(K, ignore_index=IGN)
    many = CRaCLoss(K, ignore_index=IGN)
    single = CRaCLoss(K, ignore_index=IGN)
    xs = torch.cat([b[0] for b in epochs[0]])
    ys = torch.cat([b[1] for b in epochs[0]])
    one.observe(xs, ys)
    for x, y in epochs[0]:
        many.observe(x, y)
        single.observe(x.float(), y)
    a, b, c = (loss.update_multipliers(0) for loss in (one, many, single))
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-12)
        np.testing.assert_allclose(a[key], c[key], rtol=1e-6)


def test_state_dict_round_trip_mid_trajectory():
    epochs = _epochs() + _epochs()[::-1]
    full = CRaCLoss(K, rho_period=2, ignore_index=IGN)
    logs_full = []
    for e, batches in enumerate(epochs):
        for x, y in batches:
            full.observe(x, y)
        logs_full.append(full.update_multipliers(e))
    first = CRaCLoss(K, rho_period=2, ignore_index=IGN)
    for e, batches in enumerate(epochs[:2]):
        for x, y in batches:
            first.observe(x, y)
        first.update_multipliers(e)
    resumed = CRaCLoss(K, rho_period=2, ignore_index=IGN)
    resumed.load_state_dict(first.state_dict())
    for e, batches in enumerate(epochs[2:], start=2):
        for x, y in batches:
            resumed.observe(x, y)
        assert resumed.update_multipliers(e) == logs_full[e]
    assert set(full.state_dict()) == {"lambdas", "rhos", "hbar_prev", "has_prev"}


def test_bad_parameters():
    with pytest.raises(ValueError, match="margin"):
        build_loss("crac", K, margin=0.0)
    with pytest.raises(ValueError, match="rho_period"):
        build_loss("crac", K, rho_period=0)
    with pytest.raises(ValueError, match=r"\(N, K, H, W\)"):
        CRaCLoss(K).observe(torch.randn(3, K), torch.zeros(3, dtype=torch.long))


def test_defaults_are_the_published_setting_and_the_setups_label_the_yaml_one():
    """Every command of Bala93/CRac's README runs ``lag.margin=5 lag.rho=0.1`` (rho starts at
    its minimum 0.1, maximum 10); their YAML's margin 1 / rho 1 is kept only as ``crac_yaml``."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    loss = CRaCLoss(K)
    assert loss.margin == 5.0
    assert torch.equal(loss.rhos, torch.full((2, K), 0.1, dtype=torch.float64))
    assert (loss.rho_min, loss.rho_max) == (0.1, 10.0)
    for setup in ("configs/synthetic_deeplabv3.yaml", "configs/synthetic_deeplabv3_short.yaml"):
        methods = yaml.safe_load((root / setup).read_text())["methods"]
        assert methods["crac"] == {"name": "crac"}
        assert methods["crac_yaml"] == {"name": "crac", "params": {
            "margin": 1.0, "rho_init": 1.0, "rho_min": 1.0}}
