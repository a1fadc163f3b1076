"""Losses: hand-computed cases, independent float64 references, contract and error checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import cals_seg.contrib.cals_bands  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.losses import LOSSES, CALSALMLoss, CALSHRLoss, build_loss, get_penalty
from cals_seg.losses._functional import class_penalty

K = 5
IGN = 255
SPATIAL = ("svls", "nacl", "crac", "cals_alm_bands")  # (N, K, H, W) only
LOGIT_PULLS = ("nacl", "crac")  # penalties on the logits themselves: no shift invariance


def _data(n=2, k=K, s=(6, 7), scale=8.0, seed=0, void=0.2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, k, *s), generator=g) * scale).to(dtype)
    y = torch.randint(0, k, (n, *s), generator=g)
    y[torch.rand((n, *s), generator=g) < void] = IGN
    return x, y


# ---------------------------------------------------------------- penalties
@pytest.mark.parametrize("name", ["phr", "p2", "p3"])
def test_penalty_derivative_matches_autograd_and_axioms(name):
    pen = get_penalty(name)
    g = torch.Generator().manual_seed(1)
    z = torch.linspace(-4, 4, 801, dtype=torch.float64).view(-1, 1)
    rho = torch.rand(1, 6, generator=g, dtype=torch.float64) * 9 + 0.5
    lam = torch.rand(1, 6, generator=g, dtype=torch.float64) * 3 + 1e-3
    zz = z.expand(-1, 6).clone().requires_grad_(True)
    (auto,) = torch.autograd.grad(pen.value(zz, rho, lam).sum(), zz)
    ours = pen.derivative(z.expand(-1, 6).clone(), rho, lam)
    torch.testing.assert_close(ours, auto, rtol=1e-10, atol=1e-12)
    assert (ours >= 0).all()  # axiom 1
    at0 = pen.derivative(torch.zeros(1, 6, dtype=torch.float64), rho, lam)
    torch.testing.assert_close(at0, lam)  # axiom 2: P'(0) = lambda
    # P is continuous and C1 at the branch points: finite differences agree with P'.
    h = 1e-6
    fd = (pen.value(z + h, rho, lam) - pen.value(z - h, rho, lam)) / (2 * h)
    torch.testing.assert_close(fd, ours, rtol=1e-5, atol=1e-5)


def test_penalty_formulas_pointwise():
    lam, rho = torch.tensor(0.5, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    z = torch.tensor([-1.0, -0.1, 0.3], dtype=torch.float64)
    phr, p2, p3 = (get_penalty(n).value(z.clone(), rho, lam) for n in ("phr", "p2", "p3"))
    # PHR: lambda + rho z = -1.5 (inactive), 0.3, 1.1
    torch.testing.assert_close(
        phr, torch.tensor([-0.0625, -0.05 + 0.01, 0.15 + 0.09], dtype=torch.float64)
    )
    # P2 / P3 negative branch lambda z / (1 - rho z); positive branch polynomials
    torch.testing.assert_close(p2[:2], torch.tensor([-0.5 / 3, -0.05 / 1.2], dtype=torch.float64))
    torch.testing.assert_close(
        p2[2], torch.tensor(0.15 + 0.5 * 2 * 0.09 + 4 * 0.027 / 6, dtype=torch.float64)
    )
    torch.testing.assert_close(p3[2], torch.tensor(0.15 + 0.5 * 2 * 0.09, dtype=torch.float64))


def test_unknown_penalty_and_custom_callable():
    with pytest.raises(ValueError, match="Unknown penalty 'quad'"):
        CALSALMLoss(K, penalty="quad")
    custom = CALSALMLoss(
        K, penalty=lambda z, rho, lam: lam * z + rho * z * z, lambda_init=0.3, ignore_index=IGN
    )
    x, y = _data()
    assert torch.isfinite(custom(x, y))
    d = custom.penalty.derivative(
        torch.tensor([0.0, 1.0], dtype=torch.float64),
        torch.tensor(2.0, dtype=torch.float64),
        torch.tensor(0.3, dtype=torch.float64),
    )
    torch.testing.assert_close(d, torch.tensor([0.3, 4.3], dtype=torch.float64))


# ---------------------------------------------------------------- hand-computed cases
def _one(logits, y, name, **kw):
    x = torch.tensor([logits], dtype=torch.float64)
    return build_loss(name, len(logits), **kw)(x, torch.tensor([y])).item()


def test_hand_computed_baselines():
    ln3 = math.log(3.0)  # p = (0.25, 0.75)
    assert _one([0.0, ln3], 1, "ce") == pytest.approx(math.log(4 / 3), rel=1e-12)
    ls = -(0.05 * math.log(0.25) + 0.95 * math.log(0.75))
    assert _one([0.0, ln3], 1, "ls", alpha=0.1) == pytest.approx(ls, rel=1e-12)
    assert _one([0.0, ln3], 1, "fl", gamma=2.0) == pytest.approx(
        0.0625 * math.log(4 / 3), rel=1e-12
    )
    assert _one([0.0, ln3], 1, "flsd") == pytest.approx(0.25**3 * math.log(4 / 3), rel=1e-12)
    # p_y = 0.1 < 0.2 -> gamma = 5
    assert _one([math.log(9.0), 0.0], 1, "flsd") == pytest.approx(0.9**5 * math.log(10), rel=1e-12)
    ent = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert _one([0.0, ln3], 1, "ecp", beta=0.1, entropy="sum") == pytest.approx(
        math.log(4 / 3) - 0.1 * ent, rel=1e-12
    )
    ce3 = math.log(1 + math.exp(-3.0))  # logits (0, 3), y = 1; d = (3, 0)
    # MbLS, m = 1: mean_k relu(d_k - 1) = (2 + 0) / 2 = 1
    assert _one([0.0, 3.0], 1, "mbls", margin=1.0, alpha=0.1) == pytest.approx(ce3 + 0.1, rel=1e-12)
    hr = build_loss("cals_hr", 2, margin=1.0)
    hr.lambdas.copy_(torch.tensor([0.2, 0.4], dtype=torch.float64))
    x = torch.tensor([[0.0, 3.0]], dtype=torch.float64)
    assert hr(x, torch.tensor([1])).item() == pytest.approx(
        ce3 + (0.2 * 2 + 0.4 * 0) / 2, rel=1e-12
    )


def test_hand_computed_cals_alm_and_update():
    # m = 2, logits (0, 3): z = (3/2 - 1, -1) = (0.5, -1); lambda = 0.5, rho = 1.
    # PHR(0.5) = 0.25 + 0.125 = 0.375 ; PHR(-1): 0.5 - 1 < 0 -> -0.25 / 2 = -0.125
    alm = CALSALMLoss(2, margin=2.0, lambda_init=0.5, rho_init=1.0)
    x = torch.tensor([[0.0, 3.0]], dtype=torch.float64)
    y = torch.tensor([1])
    ce3 = math.log(1 + math.exp(-3.0))
    assert alm(x, y).item() == pytest.approx(ce3 + (0.375 - 0.125) / 2, rel=1e-12)
    assert alm.terms["penalty"].item() == pytest.approx(0.125, rel=1e-12)
    alm.observe(x, y)
    out = alm.update_multipliers(0)
    # P'(0.5) = 1.0, P'(-1) = max(0, -0.5) = 0 -> clipped to lambda_min 1e-6
    assert out["lambda"] == pytest.approx([1.0, 1e-6])
    assert out["constraint"] == pytest.approx([0.5, -1.0])
    assert out["rho"] == [1.0, 1.0]


# ---------------------------------------------------------------- reference CALS-ALM
def _reference_alm_loss(x, y, lam, rho, m, ignore=IGN):
    """Loop-based float64 reference of docs/design.md, "The loss" (PHR)."""
    xn, yn = x.detach().numpy(), y.numpy()
    n, k = xn.shape[:2]
    xf = xn.reshape(n, k, -1)
    yf = yn.reshape(n, -1)
    ce, pen, count = 0.0, 0.0, 0
    for a in range(n):
        for i in range(xf.shape[2]):
            if yf[a, i] == ignore:
                continue
            count += 1
            col = xf[a, :, i]
            mx = col.max()
            ce += -(col[yf[a, i]] - mx - math.log(np.exp(col - mx).sum()))
            for c in range(k):
                z = (mx - col[c]) / m - 1
                if lam[c] + rho[c] * z >= 0:
                    pen += lam[c] * z + 0.5 * rho[c] * z * z
                else:
                    pen += -(lam[c] ** 2) / (2 * rho[c])
    return ce / count + pen / (count * k)


def test_cals_alm_equals_reference_with_void():
    x, y = _data(scale=12.0)
    alm = CALSALMLoss(K, margin=10.0, ignore_index=IGN)
    g = torch.Generator().manual_seed(3)
    alm.lambdas.copy_(torch.rand(K, generator=g, dtype=torch.float64) * 2)
    alm.rhos.copy_(1 + torch.rand(K, generator=g, dtype=torch.float64) * 4)
    ref = _reference_alm_loss(x, y, alm.lambdas.numpy(), alm.rhos.numpy(), 10.0)
    assert alm(x, y).item() == pytest.approx(ref, rel=1e-12)
    # float32 logits: the same value to float32 precision
    assert alm(x.float(), y).item() == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("block", [None, 7, 60])
@pytest.mark.parametrize("name", ["cals_alm", "cals_alm_p2", "cals_alm_p3", "mbls", "cals_hr"])
def test_analytic_backward_matches_naive_autograd(name, block, monkeypatch):
    if block is not None:  # force several spatial strips (7) or several images per block (60)
        monkeypatch.setattr("cals_seg.losses._functional.BLOCK_ELEMENTS", block)
    x, y = _data(scale=12.0, seed=5)
    penalty = {"cals_alm_p2": "p2", "cals_alm_p3": "p3"}.get(name, "phr")
    m = 10.0
    if name.startswith("cals_alm"):
        loss = CALSALMLoss(K, margin=m, penalty=penalty, ignore_index=IGN)
        loss.lambdas.uniform_(0.1, 2.0)
        loss.rhos.uniform_(1.0, 5.0)
        pen = get_penalty(penalty)
        f = lambda z: pen.value(z, loss.rhos.view(1, -1, 1, 1), loss.lambdas.view(1, -1, 1, 1))  # noqa: E731
    elif name == "mbls":
        loss = build_loss("mbls", K, ignore_index=IGN, margin=m, alpha=0.3)
        f = lambda z: 0.3 * m * torch.relu(z)  # noqa: E731
    else:
        loss = build_loss("cals_hr", K, ignore_index=IGN, margin=m)
        loss.lambdas.uniform_(0.1, 2.0)
        f = lambda z: loss.lambdas.view(1, -1, 1, 1) * m * torch.relu(z)  # noqa: E731

    def naive(t):
        z = (t.amax(dim=1, keepdim=True) - t) / m - 1  # the max is not detached
        v = (y != IGN).unsqueeze(1)
        return F.cross_entropy(t, y, ignore_index=IGN) + (f(z) * v).sum() / (v.sum() * K)

    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    la, lb = loss(a, y), naive(b)
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("penalty", ["phr", "p2", "p3"])
def test_gradcheck_class_penalty(penalty):
    x, y = _data(n=2, s=(3, 2), scale=12.0, seed=7)
    valid = (y != IGN).reshape(2, -1)
    pen = get_penalty(penalty)
    lam = torch.rand(1, K, 1, dtype=torch.float64) + 0.1
    rho = torch.rand(1, K, 1, dtype=torch.float64) * 3 + 1

    def fn(t):
        return class_penalty(
            t, valid, 10.0, lambda z: pen.value(z, rho, lam), lambda z: pen.derivative(z, rho, lam)
        )

    inp = x.reshape(2, K, -1).clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (inp,), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------- contract for every loss
@pytest.mark.parametrize("name", list(LOSSES))
def test_contract_every_loss(name):
    x, y = _data(seed=11)
    loss = build_loss(name, K, ignore_index=IGN)
    if hasattr(loss, "rhos"):
        loss.lambdas.fill_(0.7)
    base = loss(x, y)
    assert base.dim() == 0 and torch.isfinite(base)
    # invariance to a per-position constant (not NACL / CRaC: they pull the logits themselves)
    if name not in LOGIT_PULLS:
        shift = torch.randn(x.shape[0], 1, *x.shape[2:], dtype=x.dtype) * 5
        torch.testing.assert_close(loss(x + shift, y), base, rtol=1e-10, atol=1e-10)
    # logits and labels at void positions change nothing, and get no gradient
    x2 = x.clone()
    void = (y == IGN).unsqueeze(1).expand_as(x)
    x2[void] = torch.randn(int(void.sum()), dtype=x.dtype) * 50
    a = x2.clone().requires_grad_(True)
    torch.testing.assert_close(loss(a, y), base, rtol=1e-12, atol=1e-12)
    loss(a, y).backward()
    assert (a.grad[void] == 0).all()
    # (N, K) equals (N, K, 1, 1) and the flattened pixels; the spatial losses refuse (N, K)
    flat_x = x.permute(0, 2, 3, 1).reshape(-1, K)
    flat_y = y.reshape(-1)
    if name in SPATIAL:
        with pytest.raises(ValueError, match=r"\(N, K, H, W\)"):
            loss(flat_x, flat_y)
    else:
        torch.testing.assert_close(loss(flat_x, flat_y), base, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            loss(flat_x[:, :, None, None], flat_y[:, None, None]), base, rtol=1e-10, atol=1e-12
        )
    # every position ignored: 0 with a zero gradient, not NaN
    b = x.clone().requires_grad_(True)
    out = loss(b, torch.full_like(y, IGN))
    out.backward()
    assert out.item() == 0.0 and (b.grad == 0).all()
    # half precision logits are computed in float32
    assert torch.isfinite(loss(x.to(torch.bfloat16), y))


def test_cals_alm_equals_ce_when_lambda_zero_and_rho_small():
    x, y = _data(scale=15.0)
    alm = CALSALMLoss(
        K, lambda_init=0.0, rho_init=1e-9, rho_min=1e-9, lambda_min=0.0, ignore_index=IGN
    )
    ce = F.cross_entropy(x, y, ignore_index=IGN)
    torch.testing.assert_close(alm(x, y), ce, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("name", list(LOSSES))
def test_bad_input_errors(name):
    loss = build_loss(name, K, ignore_index=IGN)
    x, y = _data()
    with pytest.raises(ValueError, match="shape"):
        loss(x, y[:, :-1])
    bad = y.clone()
    bad[0, 0, 0] = K
    loss.check()  # nothing pending
    # the default call raises at the call (on the CPU: listing the values), like F.cross_entropy
    with pytest.raises(ValueError, match=r"values \[5\] outside \[0, 5\)"):
        loss(x, bad)
    loss.check()  # nothing left pending: the call itself reported it
    loss.deferred_checks = False  # the host check raises at once too, listing the values
    with pytest.raises(ValueError, match=r"values \[5\] outside \[0, 5\)"):
        loss(x, bad)
    loss.deferred_checks = True
    with pytest.raises(ValueError, match="floating point"):
        loss(x.long(), y)
    with pytest.raises(ValueError, match="classes"):
        loss(x[:, :-1], y)


def _bad_label_cases():
    """(ignore_index, bad labels) pairs: above K, far above, negative, the other convention's
    void value, a label that int32 would wrap into range."""
    return [(255, [K]), (255, [K + 5]), (255, [-2]), (255, [-100]), (-100, [255]),
            (-100, [K, -1]), (-1, [-100, K + 1]), (255, [2**32 + 1])]


@pytest.mark.parametrize("name", list(LOSSES))
def test_bad_labels_raise_at_the_call_like_f_cross_entropy(name):
    """Every registered loss at its defaults, several ignore_index conventions and bad labels:
    the call raises at once (listing the values) exactly when F.cross_entropy (the reference)
    raises; a label equal to ignore_index never raises; the loss stays usable after."""
    g = torch.Generator().manual_seed(7)
    for case, (ignore, values) in enumerate(_bad_label_cases()):
        loss = build_loss(name, K, ignore_index=ignore)
        x = torch.randn(2, K, 5, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, K, (2, 5, 6), generator=g)
        y[torch.rand(2, 5, 6, generator=g) < 0.2] = ignore
        assert torch.isfinite(loss(x, y))  # valid labels and void: no error
        F.cross_entropy(x, y, ignore_index=ignore)
        bad = y.clone()
        flat = bad.view(-1)
        where = torch.randperm(flat.numel(), generator=g)[:len(values)]
        flat[where] = torch.tensor(values)
        with pytest.raises((IndexError, RuntimeError, ValueError)):  # the reference raises
            F.cross_entropy(x, bad, ignore_index=ignore)
        shown = sorted(set(values))
        for deferred in (True, False):
            loss.deferred_checks = deferred
            with pytest.raises(ValueError, match=r"values \[" + ", ".join(map(str, shown))
                               + rf"\] outside \[0, {K}\) that are not ignore_index={ignore}"):
                loss(x, bad)
        loss.deferred_checks = True
        loss.check()  # nothing pending after the call raised
        assert torch.isfinite(loss(x, y)), case


def test_build_loss_errors():
    with pytest.raises(ValueError, match="valid names are"):
        build_loss("dice", K)
    with pytest.raises(ValueError, match="Unknown parameter"):
        build_loss("ce", K, margin=3)


# ---------------------------------------------------------------- multiplier updates
def _reference_update(
    xs,
    ys,
    lam,
    rho,
    zprev,
    has_prev,
    epoch,
    m=10.0,
    gamma=1.2,
    tau=0.9,
    period=10,
    bounds=(1e-6, 1e6),
    rbounds=(1.0, 10.0),
):
    """Loop-based float64 reference of the lambda and rho rules."""
    k = len(lam)
    s1, s2, n = np.zeros(k), np.zeros(k), 0
    for x, y in zip(xs, ys, strict=True):
        xf = x.numpy().reshape(x.shape[0], k, -1)
        yf = y.numpy().reshape(y.shape[0], -1)
        for a in range(xf.shape[0]):
            for i in range(xf.shape[2]):
                if yf[a, i] == IGN:
                    continue
                n += 1
                col = xf[a, :, i].astype(np.float64)
                for c in range(k):
                    z = (col.max() - col[c]) / m - 1
                    s1[c] += max(0.0, lam[c] + rho[c] * z)
                    s2[c] += z
    new_lam = np.clip(s1 / n, *bounds)
    zbar = s2 / n
    new_rho = rho.copy()
    if (epoch + 1) % period == 0 and has_prev:
        for c in range(k):
            if zbar[c] > tau * max(0.0, zprev[c]):
                new_rho[c] = min(max(rho[c] * gamma, rbounds[0]), rbounds[1])
    return new_lam, new_rho, zbar


def test_update_matches_reference_and_streaming_equals_one_shot():
    batches = [_data(n=2, s=(5, 4), scale=14.0, seed=s) for s in range(4)]
    xs = [b[0] for b in batches]
    ys = [b[1] for b in batches]
    one = CALSALMLoss(K, ignore_index=IGN, rho_period=2, lambda_init=0.4)
    many = CALSALMLoss(K, ignore_index=IGN, rho_period=2, lambda_init=0.4)
    lam, rho = one.lambdas.numpy().copy(), one.rhos.numpy().copy()
    zprev, has_prev = np.zeros(K), False
    for epoch in range(4):
        # shift logits each epoch so the constraints change
        ex = [x * (1 + 0.3 * epoch) for x in xs]
        ref_lam, ref_rho, zbar = _reference_update(
            ex, ys, lam, rho, zprev, has_prev, epoch, period=2
        )
        one.observe(torch.cat(ex), torch.cat(ys))
        for x, y in zip(ex, ys, strict=True):
            many.observe(x.float(), y)
        a, b = one.update_multipliers(epoch), many.update_multipliers(epoch)
        np.testing.assert_allclose(a["lambda"], ref_lam, rtol=1e-12)
        np.testing.assert_allclose(a["rho"], ref_rho, rtol=1e-12)
        np.testing.assert_allclose(a["constraint"], zbar, rtol=1e-12)
        np.testing.assert_allclose(b["lambda"], ref_lam, rtol=1e-5)
        np.testing.assert_allclose(b["rho"], ref_rho, rtol=1e-12)
        lam, rho, zprev, has_prev = ref_lam, ref_rho, zbar, True
    assert (one.rhos > 1).any(), "the rho rule never fired; the test data is too easy"


def test_update_without_observe_is_an_error():
    with pytest.raises(RuntimeError, match="observe"):
        CALSALMLoss(K).update_multipliers(0)


def test_cals_hr_rule():
    hr = CALSHRLoss(2, margin=1.0, lambda_init=0.1, score="unweighted")
    y = torch.tensor([1])
    seq = [3.0, 6.0, 6.1, 3.0]  # d_0 = 3 -> P_0 = 2, then 5 (up), 5.1 (same), 2 (down)
    lams = []
    for epoch, gap in enumerate(seq):
        hr.observe(torch.tensor([[0.0, gap]]), y)
        lams.append(hr.update_multipliers(epoch)["lambda"][0])
    assert lams == pytest.approx([0.1, 0.11, 0.11, 0.1])


def test_state_dict_round_trip_and_device_move():
    a = CALSALMLoss(K, ignore_index=IGN, rho_period=1)
    for epoch in range(2):
        x, y = _data(seed=epoch, scale=20.0)
        a.observe(x, y)
        a.update_multipliers(epoch)
    sd = a.state_dict()
    assert {"lambdas", "rhos", "zbar_prev", "has_prev"} <= set(sd)
    b = CALSALMLoss(K, ignore_index=IGN, rho_period=1)
    b.load_state_dict(sd)
    for key in ("lambdas", "rhos", "zbar_prev", "has_prev"):
        assert torch.equal(getattr(a, key), getattr(b, key))
    x, y = _data(seed=9)
    torch.testing.assert_close(a(x, y), b(x, y))
    b.to("meta")
    assert b.lambdas.device.type == "meta"


def test_penalty_keeps_only_the_max_map_for_backward():
    """The penalty saves the logits and an (N, 1, S) map, nothing logits-sized beyond that."""
    x, y = _data(n=2, s=(32, 32), scale=12.0, dtype=torch.float32)
    alm = CALSALMLoss(K, ignore_index=IGN, lambda_init=0.5)
    logits = x.reshape(2, K, -1).requires_grad_(True)
    valid = (y != IGN).reshape(2, -1)
    sizes: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            sizes.append(t.untyped_storage().nbytes())
        return t

    lam = alm.lambdas.float().view(1, -1, 1)
    rho = alm.rhos.float().view(1, -1, 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = class_penalty(
            logits,
            valid,
            10.0,
            lambda z: alm.penalty.value(z, rho, lam),
            lambda z: alm.penalty.derivative(z, rho, lam),
        )
    out.backward()
    per_position = 2 * 32 * 32
    assert sum(sizes) <= per_position * (4 + 1)  # float32 max map + bool valid mask
    assert logits.numel() * 4 > 2 * sum(sizes)


def test_ties_at_the_max_share_the_gradient_like_amax():
    x, y = _data(scale=12.0, seed=13)
    x[:, 1] = x[:, 3] = x.amax(dim=1) + 1.0  # classes 1 and 3 tie for the max everywhere
    alm = CALSALMLoss(K, margin=4.0, ignore_index=IGN, lambda_init=0.5)
    lam, rho = alm.lambdas.view(1, -1, 1, 1), alm.rhos.view(1, -1, 1, 1)

    def naive(t):
        z = (t.amax(dim=1, keepdim=True) - t) / 4.0 - 1
        v = (y != IGN).unsqueeze(1)
        pen = get_penalty("phr").value(z, rho, lam)
        return F.cross_entropy(t, y, ignore_index=IGN) + (pen * v).sum() / (v.sum() * K)

    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    alm(a, y).backward()
    naive(b).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- ECP at the authors' scale
def _ecp_reference(rows, targets, beta, ignore=IGN, per_class=True):
    """float64 loops: CE - beta * mean over valid positions (and classes) of -p log p."""
    ce = ent = 0.0
    n = 0
    for row, y in zip(rows, targets, strict=True):
        if y == ignore:
            continue
        n += 1
        z = sum(math.exp(v) for v in row)
        p = [math.exp(v) / z for v in row]
        ce -= math.log(p[y])
        ent += sum(-q * math.log(q) for q in p)
    k = len(rows[0])
    return ce / n - beta * ent / (n * k if per_class else n)


def test_ecp_class_mean_hand_computed_2x3():
    # p = (1/6, 2/6, 3/6) with y = 2, and p = (1/3, 1/3, 1/3) with y = 0.
    rows = [[0.0, math.log(2.0), math.log(3.0)], [0.0, 0.0, 0.0]]
    h1 = -(1 / 6 * math.log(1 / 6) + 1 / 3 * math.log(1 / 3) + 1 / 2 * math.log(1 / 2))
    h2 = math.log(3.0)
    ce = (math.log(2.0) + math.log(3.0)) / 2
    hand = ce - 0.1 * (h1 + h2) / (2 * 3)  # mean of -p log p over 2 positions x 3 classes
    assert hand == pytest.approx(_ecp_reference(rows, [2, 0], 0.1), rel=1e-14)
    x, y = torch.tensor(rows, dtype=torch.float64), torch.tensor([2, 0])
    loss = build_loss("ecp", 3, ignore_index=IGN, beta=0.1)
    assert loss(x, y).item() == pytest.approx(hand, rel=1e-12)
    assert loss.entropy == "class_mean"
    assert loss.terms["entropy"].item() == pytest.approx((h1 + h2) / 6, rel=1e-12)
    # the former form, kept under entropy="sum": the per-position entropy, K = 3 times stronger
    old = build_loss("ecp", 3, ignore_index=IGN, beta=0.1, entropy="sum")
    assert old(x, y).item() == pytest.approx(ce - 0.1 * (h1 + h2) / 2, rel=1e-12)


def test_ecp_class_mean_with_void_matches_loop():
    x, y = _data(n=2, s=(3, 4), scale=3.0, seed=5)
    rows = x.permute(0, 2, 3, 1).reshape(-1, K).tolist()
    targets = y.reshape(-1).tolist()
    assert IGN in targets
    got = build_loss("ecp", K, ignore_index=IGN, beta=0.3)(x, y).item()
    assert got == pytest.approx(_ecp_reference(rows, targets, 0.3), rel=1e-12)
    got = build_loss("ecp", K, ignore_index=IGN, beta=0.3, entropy="sum")(x, y).item()
    assert got == pytest.approx(_ecp_reference(rows, targets, 0.3, per_class=False), rel=1e-12)


def test_ecp_bad_entropy_form():
    with pytest.raises(ValueError, match="entropy.*class_mean.*sum"):
        build_loss("ecp", 3, entropy="mean")


# ---------------------------------------------------------------- CALS-HR: the authors' score
def _hr_batch(p0, p1, p2):
    """3 positions, K = 3, margin 1, whose per-class mean hinges are (p0, p1, p2): position a has
    d = (g, 0, 0), b d = (0, c, 0), c d = (0, 0, h), with relu(x - 1) / 3 = P."""
    g, c, h = (1 + 3 * p for p in (p0, p1, p2))
    x = torch.tensor([[[0.0, g, g], [c, 0.0, c], [h, h, 0.0]]], dtype=torch.float64)
    return x.transpose(1, 2), torch.tensor([[0, 0, 0]])  # (1, K, S=3)


HR_P = [(1.0, 0.0, 1.0), (1.2, 0.5, 0.8), (1.25, 0.52, 0.75)]


def _hr_trajectory(hr, ps):
    out = []
    for epoch, p in enumerate(ps):
        hr.observe(*_hr_batch(*p))
        stats = hr.update_multipliers(epoch)
        assert stats["penalty"] == pytest.approx(list(p), abs=1e-12)
        out.append(stats["lambda"])
    return out


def test_cals_hr_weighted_score_hand_computed():
    hr = CALSHRLoss(3, margin=1.0, lambda_init=0.1)
    lams = _hr_trajectory(hr, HR_P)
    # epoch 0: no previous score -> no update.
    # epoch 1: S = 0.1 * (1.2, 0.5, 0.8) = (0.12, 0.05, 0.08) vs prev (0.1, 0, 0.1):
    #   0.12 > 0.11 up; 0.05 > 0 up; 0.08 < 0.1 / 1.1 down.
    # epoch 2: S = (0.11 * 1.25, 0.11 * 0.52, 0.1 / 1.1 * 0.75) = (0.1375, 0.0572, 0.0682)
    #   vs prev (0.12, 0.05, 0.08): 0.1375 > 0.132 up; 0.0572 > 0.055 up; 0.0682 < 0.0727 down.
    expected = [[0.1, 0.1, 0.1], [0.11, 0.11, 0.1 / 1.1], [0.121, 0.121, 0.1 / 1.21]]
    for got, ref in zip(lams, expected, strict=True):
        assert got == pytest.approx(ref, rel=1e-12)
    assert hr.score == "weighted"


def test_cals_hr_unweighted_score_hand_computed():
    lams = _hr_trajectory(CALSHRLoss(3, margin=1.0, lambda_init=0.1, score="unweighted"), HR_P)
    # epoch 1: P (1.2, 0.5, 0.8) vs (1, 0, 1): up, up, down (1 > 1.1 * 0.8).
    # epoch 2: P (1.25, 0.52, 0.75) vs (1.2, 0.5, 0.8): 1.25 < 1.32, 0.52 < 0.55, 0.8 < 0.825:
    #   all unchanged -- where the weighted rule moves all three.
    expected = [[0.1, 0.1, 0.1], [0.11, 0.11, 0.1 / 1.1], [0.11, 0.11, 0.1 / 1.1]]
    for got, ref in zip(lams, expected, strict=True):
        assert got == pytest.approx(ref, rel=1e-12)


def test_cals_hr_issue_divergence_example():
    """P = 1.0 -> 1.2 -> 1.25: the weighted score raises lambda again, the unweighted one not."""
    ps = [(1.0, 0.0, 0.0), (1.2, 0.0, 0.0), (1.25, 0.0, 0.0)]
    w = _hr_trajectory(CALSHRLoss(3, margin=1.0, lambda_init=0.1), ps)
    u = _hr_trajectory(CALSHRLoss(3, margin=1.0, lambda_init=0.1, score="unweighted"), ps)
    assert [lam[0] for lam in w] == pytest.approx([0.1, 0.11, 0.121], rel=1e-12)
    assert [lam[0] for lam in u] == pytest.approx([0.1, 0.11, 0.11], rel=1e-12)


def test_cals_hr_weighted_skips_update_after_all_zero_scores():
    ps = [(0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (1.2, 0.0, 0.0)]
    w = _hr_trajectory(CALSHRLoss(3, margin=1.0, lambda_init=0.1), ps)
    # epoch 1: previous scores all zero -> skipped; epoch 2: 0.12 > 1.1 * 0.1 -> up.
    assert [lam[0] for lam in w] == pytest.approx([0.1, 0.1, 0.11], rel=1e-12)
    u = _hr_trajectory(CALSHRLoss(3, margin=1.0, lambda_init=0.1, score="unweighted"), ps)
    # unweighted: 1 > 1.1 * 0 -> up at epoch 1, 1.2 > 1.1 -> up again at epoch 2.
    assert [lam[0] for lam in u] == pytest.approx([0.1, 0.11, 0.121], rel=1e-12)


def test_cals_hr_state_round_trip_mid_trajectory_and_old_state():
    a = CALSHRLoss(3, margin=1.0, lambda_init=0.1)
    _hr_trajectory(a, HR_P[:2])
    sd = a.state_dict()
    assert {"lambdas", "penalty_prev", "lambdas_prev", "has_prev"} <= set(sd)
    assert sd["lambdas_prev"].tolist() == pytest.approx([0.1, 0.1, 0.1])  # in force at epoch 1
    b = CALSHRLoss(3, margin=1.0, lambda_init=0.1)
    b.load_state_dict(sd)
    for hr in (a, b):
        hr.observe(*_hr_batch(*HR_P[2]))
    assert a.update_multipliers(2) == b.update_multipliers(2)
    assert b.lambdas.tolist() == pytest.approx([0.121, 0.121, 0.1 / 1.21], rel=1e-12)
    # a state saved before lambdas_prev existed loads under the unweighted rule only
    old = {k: v for k, v in sd.items() if k != "lambdas_prev"}
    CALSHRLoss(3, score="unweighted").load_state_dict(old)
    with pytest.raises(RuntimeError, match="lambdas_prev"):
        CALSHRLoss(3).load_state_dict(old)


def test_cals_hr_bad_score_rule():
    with pytest.raises(ValueError, match="score.*weighted.*unweighted"):
        build_loss("cals_hr", 3, score="lambda")
