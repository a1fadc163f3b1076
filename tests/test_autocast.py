"""Every loss, its gradient, ``observe`` and ``update_multipliers`` give the float32 results
whatever autocast context surrounds them (CPU and CUDA, bf16 and fp16, TF32 allowed)."""

from __future__ import annotations

import pytest
import torch

from cals_seg.losses import LOSSES, build_loss

K = 21
IGN = 255
MARGIN = 3.0  # logit gaps of randn * 4 logits often exceed it: the penalties are active
# lambda = 8, rho = 2 where the loss has them (P' >= 8 - 2 > 0: every class is penalised).
PARAMS = {
    "cals_alm": {"margin": MARGIN, "lambda_init": 8.0, "rho_init": 2.0},
    "cals_hr": {"margin": MARGIN, "lambda_init": 8.0},
    "mbls": {"margin": MARGIN},
    "crac": {"lambda_init": 8.0, "rho_init": 2.0},
    "cals_alm_bands": {"margin": MARGIN, "lambda_init": 8.0, "rho_init": 2.0},
}
ADAPTIVE = ["cals_alm", "cals_hr", "crac", "cals_alm_bands"]
HALF = [torch.bfloat16, torch.float16]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.fixture(autouse=True)
def _allow_tf32():
    """TF32 matmuls allowed, as many training scripts do; the criterion must not use them."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _data(device, n=2, s=(32, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, K, *s), generator=g) * 4.0
    y = torch.randint(0, K, (n, *s), generator=g)
    y[torch.rand((n, *s), generator=g) < 0.05] = IGN  # a few void pixels
    return x.to(device), y.to(device)


def _loss(name, device):
    return build_loss(name, K, ignore_index=IGN, **PARAMS.get(name, {})).to(device)


def _value_and_grad(loss, x, y, dtype=None):
    a = x.detach().clone().requires_grad_(True)
    if dtype is None:
        out = loss(a, y)
    else:
        with torch.autocast(device_type=x.device.type, dtype=dtype):
            out = loss(a, y)
    out.backward()
    return out.detach(), a.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_and_gradient_under_autocast_equal_float32(name, dtype, device):
    x, y = _data(device)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, x, y)
    if name in PARAMS:
        assert loss.terms["penalty"] > 0.1  # the penalty is active
    out, grad = _value_and_grad(loss, x, y, dtype)
    assert out.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_backward_inside_autocast_equals_float32(name, dtype, device):
    x, y = _data(device)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, x, y)
    a = x.clone().requires_grad_(True)
    with torch.autocast(device_type=device, dtype=dtype):
        out = loss(a, y)
        out.backward()
    torch.testing.assert_close(out.detach(), ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.grad, ref_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_half_logits_are_computed_in_float32(name, dtype, device):
    x, y = _data(device)
    half = x.to(dtype)
    loss = _loss(name, device)
    ref, ref_grad = _value_and_grad(loss, half.float(), y)
    for ctx in (None, dtype):
        out, grad = _value_and_grad(loss, half, y, ctx)
        assert out.dtype == torch.float32
        assert grad.dtype == dtype  # autograd requires the logits' dtype
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad.to(dtype))


def _epochs(device, cast=None):
    """Two epochs of two validation batches; the second epoch's logits are sharper, so that
    CALS-HR's lambdas move too."""
    out = []
    for epoch in range(2):
        batches = []
        for seed in range(2):
            x, y = _data(device, seed=seed)
            x = x * (1.0 + 0.5 * epoch)
            batches.append((x if cast is None else x.to(cast), y))
        out.append(batches)
    return out


def _observe_and_update(name, device, epochs, dtype=None):
    loss = _loss(name, device)
    history = []
    for epoch, batches in enumerate(epochs):
        for x, y in batches:
            if dtype is None:
                loss.observe(x, y)
            else:
                with torch.autocast(device_type=device, dtype=dtype):
                    loss.observe(x, y)
        history.append(loss.update_multipliers(epoch))
    return loss, history


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ADAPTIVE)
def test_observe_and_update_under_autocast_equal_float32(name, dtype, device):
    epochs = _epochs(device)
    ref, ref_history = _observe_and_update(name, device, epochs)
    got, history = _observe_and_update(name, device, epochs, dtype)
    assert not torch.equal(ref.lambdas, torch.full_like(ref.lambdas, 8.0))  # lambdas moved
    torch.testing.assert_close(got.lambdas, ref.lambdas, rtol=1e-6, atol=0)
    for a, b in zip(history, ref_history, strict=True):
        for key in b:
            if b[key] is None:  # e.g. a distance band without validation pixels
                assert a[key] is None, key
                continue
            torch.testing.assert_close(
                torch.tensor(a[key]), torch.tensor(b[key]), rtol=1e-6, atol=0
            )
    # half logits: the float32 statistics of the same (upcast) values
    half = _epochs(device, cast=dtype)
    upcast = [[(x.float(), y) for x, y in batches] for batches in half]
    ref_half, _ = _observe_and_update(name, device, upcast)
    got_half, _ = _observe_and_update(name, device, half, dtype)
    torch.testing.assert_close(got_half.lambdas, ref_half.lambdas, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_issue_example_fp16_lambdas_are_finite(device):
    # K = 21, logits 2x21x128x128, lambda = 8, rho = 2: under fp16 autocast the per-image sums of
    # P' (~1e5) used to overflow float16, giving lambda = 1e6 for every class.
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, K, 128, 128), generator=g).to(device)
    y = torch.randint(0, K, (2, 128, 128), generator=g).to(device)
    lambdas = []
    for dtype in (None, torch.float16):
        crit = build_loss("cals_alm", K, ignore_index=IGN, lambda_init=8.0, rho_init=2.0)
        crit = crit.to(device)
        if dtype is None:
            crit.observe(x, y)
        else:
            with torch.autocast(device_type=device, dtype=dtype):
                crit.observe(x, y)
        crit.update_multipliers(0)
        lambdas.append(crit.lambdas)
    ref, got = lambdas
    assert torch.isfinite(got).all() and float(got.max()) < 100.0
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ADAPTIVE)
def test_observe_rejects_non_finite_logits(name, bad):
    x, y = _data("cpu")
    x[1, 3, 5, 7] = bad
    loss = _loss(name, "cpu")
    with pytest.raises(ValueError, match=r"Expected `logits` to be finite, but got 1 non-finite"):
        loss.observe(x, y)
    with pytest.raises(RuntimeError, match="no observed validation positions"):
        loss.update_multipliers(0)  # nothing of the rejected batch was accumulated
