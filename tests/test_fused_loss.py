"""CE and the class penalty in one walk over the logits (``ce_penalty``): value and gradient
against autograd of the naive formula (every penalty, ties at the maximum, blocks of every kind,
float32 and float64, compiled), the terms, what is kept for backward, and one backward only."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cals_seg.losses import get_penalty
from cals_seg.losses._functional import ce_penalty, hinge_gap_terms

K, IGN, M = 5, 255, 10.0


def _data(n=2, s=(6, 7), scale=12.0, seed=0, dtype=torch.float64, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((n, K, *s), generator=g) * scale).to(dtype)
    y = torch.randint(0, K, (n, *s), generator=g)
    y[torch.rand((n, *s), generator=g) < 0.2] = IGN
    if ties:  # classes 1 and 3 tie for the maximum everywhere
        x[:, 1] = x[:, 3] = x.amax(dim=1) + 1.0
    return x, y


def _params(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    lam = (torch.rand(1, K, 1, generator=g, dtype=torch.float64) * 2 + 0.1).to(dtype)
    rho = (torch.rand(1, K, 1, generator=g, dtype=torch.float64) * 4 + 1).to(dtype)
    return lam, rho


def _case(name, dtype=torch.float64):
    """(gap terms, elementwise f of z (N, K, *S)) of a penalty."""
    lam, rho = _params(dtype)
    if name == "hinge":
        return hinge_gap_terms(lam, M), lambda z: lam.unsqueeze(-1) * M * torch.relu(z)
    pen = get_penalty(name)
    return (pen.gap_terms(rho, lam, M),
            lambda z: pen.value(z, rho.unsqueeze(-1), lam.unsqueeze(-1)))


def _naive(t, y, f):
    z = (t.amax(dim=1, keepdim=True) - t) / M - 1  # the max is not detached
    v = (y != IGN).unsqueeze(1)
    ce = F.cross_entropy(t, y, ignore_index=IGN)
    return ce, (f(z) * v).sum() / (v.sum() * K)


def _fused(t, y, terms):
    n = t.shape[0]
    y2 = y.reshape(n, -1)
    return ce_penalty(t.reshape(n, K, -1), y2, y2 != IGN, terms)


@pytest.mark.parametrize("block", [None, 7, 60])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", ["phr", "p2", "p3", "hinge"])
def test_value_terms_and_gradient_equal_naive_autograd(name, ties, block, monkeypatch):
    if block is not None:  # several spatial strips (7), several images per block (60)
        monkeypatch.setattr("cals_seg.losses._functional.BLOCK_ELEMENTS", block)
    x, y = _data(ties=ties, seed=3)
    terms, f = _case(name)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    loss, ce, pen = _fused(a, y, terms)
    ce_ref, pen_ref = _naive(b, y, f)
    loss.backward()
    (ce_ref + pen_ref).backward()
    torch.testing.assert_close(ce, ce_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pen, pen_ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, (ce_ref + pen_ref).detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert not ce.requires_grad and not pen.requires_grad


def test_float32_and_every_position_void():
    x, y = _data(dtype=torch.float32, seed=4)
    terms, f = _case("phr", torch.float32)
    a, b = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    _fused(a, y, terms)[0].backward()
    terms64, f64 = _case("phr")
    sum(_naive(b, y, f64)).backward()
    torch.testing.assert_close(a.grad, b.grad.float(), rtol=1e-4, atol=1e-7)
    c = x.clone().requires_grad_(True)
    loss, ce, pen = _fused(c, torch.full_like(y, IGN), terms)
    loss.backward()
    assert loss.item() == ce.item() == pen.item() == 0.0 and (c.grad == 0).all()


def test_keeps_one_gradient_and_serves_one_backward():
    """Eager: forward keeps the gradient (the logits' size) and backward scales it in place,
    handed to the logits without a copy; a second backward through the graph raises."""
    x, y = _data(dtype=torch.float32, s=(16, 16))
    terms, _ = _case("phr", torch.float32)
    a = x.clone().requires_grad_(True)
    sizes = []

    def pack(t):
        sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _fused(a, y, terms)[0]
    assert sizes == [x.numel() * 4]
    (loss * 3.0).backward(retain_graph=True)
    b = x.clone().requires_grad_(True)
    (_fused(b, y, terms)[0] * 3.0).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@pytest.mark.parametrize("name", ["phr", "hinge"])
def test_compiled_equals_eager(name):
    """aot_eager: the compiled path (per-position maps, one pointwise backward), dynamic sizes
    and a 0-dim tensor margin."""
    lam, rho = _params()
    margin = torch.tensor(M, dtype=torch.float64)

    def fn(t, y):
        terms = (hinge_gap_terms(lam, margin) if name == "hinge"
                 else get_penalty(name).gap_terms(rho, lam, margin))
        return _fused(t, y, terms)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for shape in [(6, 7), (4, 9)]:
        x, y = _data(s=shape, ties=True)
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        got, want = compiled(a, y), fn(b, y)
        got[0].backward()
        want[0].backward()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cals_alm", "cals_hr"])
def test_compiled_keeps_no_logits_sized_tensor(name):
    """inductor (its partitioner chooses what backward keeps): per-position maps only, no
    tensor of the logits' size (a float derivative or a bool mask) besides the logits."""
    from cals_seg.losses import build_loss

    k = 16
    x = torch.randn(2, k, 32, 32) * 6
    y = torch.randint(0, k, (2, 32, 32))
    loss = build_loss(name, k, ignore_index=IGN)
    loss.lambdas.fill_(0.5)
    loss.deferred_checks = True
    compiled = torch.compile(loss)
    compiled(x.clone().requires_grad_(True), y).backward()  # compile
    a = x.clone().requires_grad_(True)
    shapes = []

    def pack(t):
        if t.untyped_storage().data_ptr() != a.untyped_storage().data_ptr():
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = compiled(a, y)
    out.backward()
    assert all(math.prod(s) <= 2 * 32 * 32 for s in shapes), shapes
