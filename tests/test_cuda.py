"""The CUDA path against the CPU: losses, gradients, multipliers, meters, temperature, autocast.

Run with ``pytest -q -m cuda tests`` (``-m cuda`` overrides pyproject's ``-m 'not slow'``); every
test is skipped without a CUDA device. ``CALS_TEST_DEVICE=cpu`` runs the same comparisons with
the CPU as the "device" (a check of the tests themselves on a machine without a GPU).

- Every loss of ``LOSSES``: value and gradient on the device equal the CPU float64 reference
  (device float64: to 1e-9; device float32: to float32 rounding), and for CALS-ALM / CALS-HR the
  multipliers after ``observe`` + ``update_multipliers`` over two epochs as well.
- ``CalibrationMeter`` and ``SegmentationMeter``: device states equal CPU states, counts exactly,
  float sums to 1e-6 relative.
- Temperature scaling: ``fit_temperature`` / ``nll_at_temperature`` / ``TemperatureScaler``.
- Autocast fp16 / bf16 around the criterion: loss value, gradient and the multipliers after
  ``update_multipliers`` equal the float32 results (relative 1e-6).
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import cals_seg.contrib.cals_bands  # noqa: F401  (opt-in; tested with the built-ins)
from cals_seg.calibrators.ts import TemperatureScaler, fit_temperature, nll_at_temperature
from cals_seg.losses import LOSSES, build_loss
from cals_seg.metrics import CalibrationMeter, SegmentationMeter

from .conftest import assert_tree_close

DEVICE = os.environ.get("CALS_TEST_DEVICE", "cuda")
K, VOID = 11, 255
ADAPTIVE = ("cals_alm", "cals_hr", "crac", "cals_alm_bands")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]


def _batch(seed: int, n: int = 2, k: int = K, h: int = 24, w: int = 20, scale: float = 3.0):
    """float64 logits ``(n, k, h, w)`` on the CPU (scale 3: many gaps beyond a margin of 3) and
    targets with ~10% void."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, h, w, generator=g, dtype=torch.float64) * scale
    target = torch.randint(0, k, (n, h, w), generator=g)
    target[torch.rand(n, h, w, generator=g) < 0.1] = VOID
    return logits, target


def _make(name: str):
    params = {}
    accepted = inspect.signature(LOSSES[name]).parameters
    if "margin" in accepted:
        params["margin"] = 3.0  # active constraints on logits of scale 3
    if "rho_period" in accepted:
        params["rho_period"] = 1  # exercise the rho rule in the second update
    return build_loss(name, K, ignore_index=VOID, **params)


def _value_and_grad(loss, logits: torch.Tensor, target: torch.Tensor, autocast=None):
    x = logits.detach().clone().requires_grad_(True)
    if autocast is None:
        value = loss(x, target)
    else:
        with torch.autocast(x.device.type, dtype=autocast):
            value = loss(x, target)
    value.backward()
    return value.detach(), x.grad


def _multipliers(loss, batches, device, dtype, autocast=None) -> list[dict]:
    """Two epochs of observe (two batches each) + update_multipliers; the returned dicts."""
    out = []
    for epoch in range(2):
        for logits, target in batches:
            x, y = logits.to(device=device, dtype=dtype), target.to(device)
            if autocast is None:
                loss.observe(x, y)
            else:
                with torch.autocast(x.device.type, dtype=autocast):
                    loss.observe(x, y)
        out.append(loss.update_multipliers(epoch))
    return out


def _assert_multipliers_close(got: list[dict], ref: list[dict], rtol: float) -> None:
    for g, r in zip(got, ref, strict=True):
        assert g.keys() == r.keys()
        for key in r:
            if r[key] is None:  # e.g. a distance band without validation pixels
                assert g[key] is None, key
                continue
            f64 = torch.float64
            torch.testing.assert_close(
                torch.tensor(g[key], dtype=f64), torch.tensor(r[key], dtype=f64),
                rtol=rtol, atol=rtol * max(1e-12, max(abs(v) for v in r[key])), msg=key,
            )


def _assert_grad_close(got: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    got = got.detach().cpu().double()
    # Elements near zero are compared against the largest gradient entry (scale-free).
    torch.testing.assert_close(got, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


# ---------------------------------------------------------------------------------- losses
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_value_and_gradient_match_cpu_float64(name, dtype):
    logits, target = _batch(0)
    ref_v, ref_g = _value_and_grad(_make(name), logits, target)
    assert ref_v.dtype == torch.float64 and ref_g.dtype == torch.float64  # a float64 reference
    loss = _make(name).to(DEVICE)
    v, g = _value_and_grad(loss, logits.to(DEVICE, dtype), target.to(DEVICE))
    assert v.device.type == torch.device(DEVICE).type and v.dtype == dtype
    rtol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(v.cpu().double(), ref_v, rtol=rtol, atol=rtol)
    _assert_grad_close(g, ref_g, rtol=rtol if dtype == torch.float64 else 1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", ADAPTIVE)
def test_multipliers_match_cpu_float64(name, dtype):
    batches = [_batch(1), _batch(2)]
    ref = _multipliers(_make(name), batches, "cpu", torch.float64)
    loss = _make(name).to(DEVICE)
    got = _multipliers(loss, batches, DEVICE, dtype)
    assert loss.lambdas.device.type == torch.device(DEVICE).type
    _assert_multipliers_close(got, ref, rtol=1e-9 if dtype == torch.float64 else 1e-5)
    # the loss with the updated multipliers still matches
    cpu = _make(name)
    _multipliers(cpu, batches, "cpu", torch.float64)
    logits, target = _batch(3)
    ref_v, ref_g = _value_and_grad(cpu, logits, target)
    v, g = _value_and_grad(loss, logits.to(DEVICE, dtype), target.to(DEVICE))
    rtol = 1e-9 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(v.cpu().double(), ref_v, rtol=rtol, atol=rtol)
    _assert_grad_close(g, ref_g, rtol=rtol if dtype == torch.float64 else 1e-4)


# ------------------------------------------------------------------------------- autocast
AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _autocast_ok(dtype: torch.dtype) -> bool:
    if torch.device(DEVICE).type != "cuda":
        return dtype == torch.bfloat16  # CPU autocast knows bf16 (and fp16 only in new torch)
    return dtype != torch.bfloat16 or torch.cuda.is_bf16_supported()


@pytest.mark.parametrize("amp", list(AUTOCAST))
@pytest.mark.parametrize("name", list(LOSSES))
def test_autocast_around_the_criterion_gives_the_float32_numbers(name, amp):
    """Requirement: loss value, gradient and lambdas after update_multipliers under each
    autocast dtype equal the float32 results, relative 1e-6 for the statistics."""
    dtype = AUTOCAST[amp]
    if not _autocast_ok(dtype):
        pytest.skip(f"no {amp} autocast on {DEVICE}")
    logits, target = _batch(4)
    x, y = logits.to(DEVICE, torch.float32), target.to(DEVICE)
    ref_v, ref_g = _value_and_grad(_make(name).to(DEVICE), x, y)
    v, g = _value_and_grad(_make(name).to(DEVICE), x, y, autocast=dtype)
    assert v.dtype == torch.float32, "the criterion computes in float32 under autocast"
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-7)
    _assert_grad_close(g, ref_g.cpu().double(), rtol=1e-6)
    # half-precision logits, as a model under autocast returns them: the same numbers as
    # their float32 upcast without autocast
    half = x.to(dtype)
    ref_h, _ = _value_and_grad(_make(name).to(DEVICE), half.float(), y)
    v_h, _ = _value_and_grad(_make(name).to(DEVICE), half, y, autocast=dtype)
    torch.testing.assert_close(v_h.float(), ref_h, rtol=1e-6, atol=1e-7)
    if name in ADAPTIVE:
        batches = [_batch(5), _batch(6)]
        ref = _multipliers(_make(name).to(DEVICE), batches, DEVICE, torch.float32)
        got = _multipliers(_make(name).to(DEVICE), batches, DEVICE, torch.float32, autocast=dtype)
        _assert_multipliers_close(got, ref, rtol=1e-6)


# --------------------------------------------------------------------------------- meters
def _meters():
    return CalibrationMeter(K, n_bins=15, ignore_index=VOID, classwise=True), SegmentationMeter(
        K, ignore_index=VOID
    )


def _feed(meters, batches, device, dtype) -> None:
    for logits, target in batches:
        x, y = logits.to(device, dtype), target.to(device)
        for m in meters:
            m.update(x, y)


def _assert_states_equal(got: dict, ref: dict, rtol: float) -> None:
    assert got.keys() == ref.keys()
    for key, r in ref.items():
        g = got[key].cpu()
        assert g.dtype == r.dtype, key
        if r.is_floating_point():
            torch.testing.assert_close(g, r, rtol=rtol, atol=rtol * float(r.abs().max().clamp(
                min=1e-30)), msg=key)
        else:
            assert torch.equal(g, r), f"{key}: counts differ"


def test_meters_match_cpu_float64_logits():
    """float64 logits: the same softmax on both sides, so every count is exact."""
    batches = [_batch(7, n=3, h=40, w=36), _batch(8, n=2, h=40, w=36)]
    ref, dev = _meters(), [m.to(DEVICE) for m in _meters()]
    _feed(ref, batches, "cpu", torch.float64)
    _feed(dev, batches, DEVICE, torch.float64)
    for r, d in zip(ref, dev, strict=True):
        assert next(iter(d.buffers())).device.type == torch.device(DEVICE).type
        _assert_states_equal(d.state_dict(), r.state_dict(), rtol=1e-6)
        assert_tree_close(d.compute(), r.compute(), rel=1e-6, abs_=1e-12)


def test_meters_match_cpu_float32_logits():
    """float32 logits: the softmax may differ by an ulp between devices, which can move a
    confidence across a fine aECE cell; totals, confusion and the metrics still agree."""
    batches = [_batch(9, n=3, h=40, w=36), _batch(10, n=2, h=40, w=36)]
    ref, dev = _meters(), [m.to(DEVICE) for m in _meters()]
    _feed(ref, batches, "cpu", torch.float32)
    _feed(dev, batches, DEVICE, torch.float32)
    assert torch.equal(dev[1].confusion.cpu(), ref[1].confusion)
    assert dev[1].compute() == ref[1].compute()
    cal_d, cal_r = dev[0].compute(), ref[0].compute()
    assert cal_d["count"] == cal_r["count"] and cal_d["num_images"] == cal_r["num_images"]
    assert int(dev[0].bin_count.sum()) == int(ref[0].bin_count.sum())
    assert int(dev[0].bin_correct.sum()) == int(ref[0].bin_correct.sum())
    assert_tree_close(cal_d, cal_r, rel=1e-5, abs_=1e-6)


def test_meters_accept_half_logits_on_device():
    """A model under autocast hands the meters bf16 / fp16 logits: they are upcast (float32)."""
    logits, target = _batch(11)
    for dtype in (torch.float16, torch.bfloat16):
        half = logits.to(dtype)
        ref, dev = _meters(), [m.to(DEVICE) for m in _meters()]
        _feed(ref, [(half.float(), target)], "cpu", torch.float32)
        _feed(dev, [(half, target)], DEVICE, dtype)
        assert dev[1].compute() == ref[1].compute()
        assert_tree_close(dev[0].compute(), ref[0].compute(), rel=1e-5, abs_=1e-6)


# ---------------------------------------------------------------------------- temperature
def test_temperature_scaling_matches_cpu():
    batches = []
    for seed in (12, 13):  # labels drawn from softmax(z), logits 3 z: the fitted T is near 3
        z, _ = _batch(seed, n=2, h=32, w=32, scale=2.0)
        g = torch.Generator().manual_seed(seed)
        probs = z.movedim(1, -1).reshape(-1, K).softmax(dim=1)
        y = torch.multinomial(probs, 1, generator=g).view(2, 32, 32)
        y[torch.rand(y.shape, generator=g) < 0.1] = VOID
        batches.append((3.0 * z, y))

    def feed(device, dtype):
        return lambda: [(x.to(device, dtype), y.to(device)) for x, y in batches]

    t_ref = fit_temperature(feed("cpu", torch.float64), ignore_index=VOID)
    assert 2.0 < t_ref < 4.5
    for dtype in (torch.float64, torch.float32):
        t = fit_temperature(feed(DEVICE, dtype), ignore_index=VOID)
        assert t == pytest.approx(t_ref, rel=1e-6), dtype
        nll = nll_at_temperature(feed(DEVICE, dtype), t_ref, ignore_index=VOID)
        nll_ref = nll_at_temperature(feed("cpu", torch.float64), t_ref, ignore_index=VOID)
        assert nll == pytest.approx(nll_ref, rel=1e-6), dtype
    scaler = TemperatureScaler(t_ref).to(DEVICE)
    x = batches[0][0].to(DEVICE, torch.float32)
    torch.testing.assert_close(scaler(x).cpu(), TemperatureScaler(t_ref)(x.cpu()))
