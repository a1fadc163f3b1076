"""Tests for post-hoc temperature scaling against an independent brute-force reference."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from cals_seg.calibrators.ts import TemperatureScaler, fit_temperature, nll_at_temperature


def _synthetic(n: int, k: int, scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels drawn from softmax(z); the "model" reports scale * z, so the ideal T is ~scale."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g) * 2.0
    y = torch.multinomial(z.softmax(dim=1), 1, generator=g).squeeze(1)
    return scale * z, y


def _brute_force(logits: torch.Tensor, target: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """Summed float64 NLL at each temperature, the textbook way (log_softmax + gather)."""
    l64 = logits.double()
    out = torch.empty(len(temps), dtype=torch.float64)
    for start in range(0, len(temps), 500):
        t = temps[start : start + 500].view(-1, 1, 1)
        logp = torch.log_softmax(l64.unsqueeze(0) / t, dim=2)  # (G, P, K)
        idx = target.view(1, -1, 1).expand(len(t), -1, 1)
        out[start : start + 500] = -logp.gather(2, idx).squeeze(2).sum(dim=1)
    return out


def _one(logits, target):
    return lambda: [(logits, target)]


def test_recovers_known_temperature():
    logits, target = _synthetic(20000, 5, scale=3.0)
    t = fit_temperature(_one(logits, target))
    assert abs(t - 3.0) / 3.0 < 0.03


def test_matches_brute_force_dense_grid():
    logits, target = _synthetic(1000, 4, scale=3.0, seed=1)
    temps = torch.logspace(math.log10(0.05), math.log10(20.0), 20000, dtype=torch.float64)
    ref = _brute_force(logits, target, temps)
    i = int(ref.argmin())
    t_ref, nll_ref = float(temps[i]), float(ref[i])

    t = fit_temperature(_one(logits, target))
    nll_fit = float(_brute_force(logits, target, torch.tensor([t], dtype=torch.float64))[0])
    assert nll_fit <= nll_ref * (1 + 1e-7)
    assert abs(t - t_ref) / t_ref < 1e-3
    # The library's mean NLL agrees with the textbook formula.
    mean = nll_at_temperature(_one(logits, target), t)
    assert mean == pytest.approx(nll_fit / len(target), rel=1e-12)


def test_segmentation_shape_and_ignored_positions():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, 7, 9, generator=g) * 4
    target = (logits + 3 * torch.randn(3, 6, 7, 9, generator=g)).argmax(dim=1)
    target[:, :2] = 255
    t1 = fit_temperature(_one(logits, target), ignore_index=255)
    n1 = nll_at_temperature(_one(logits, target), t1, ignore_index=255)

    changed = logits.clone()
    changed[:, :, :2] = torch.randn(3, 6, 2, 9, generator=g) * 100  # only void positions
    assert fit_temperature(_one(changed, target), ignore_index=255) == t1
    assert nll_at_temperature(_one(changed, target), t1, ignore_index=255) == n1

    # Same result as the (P, K) classification view of the valid positions.
    rows = logits.movedim(1, -1)[target != 255]
    t_rows = fit_temperature(_one(rows, target[target != 255]), ignore_index=255)
    assert t_rows == pytest.approx(t1, rel=1e-9)


def test_streaming_equals_one_batch():
    logits, target = _synthetic(3000, 5, scale=2.0, seed=3)
    one = fit_temperature(_one(logits, target))
    chunks = list(zip(logits.split(97), target.split(97), strict=True))
    many = fit_temperature(lambda: iter(chunks))
    assert many == pytest.approx(one, rel=1e-9)
    assert nll_at_temperature(lambda: iter(chunks), 1.7) == pytest.approx(
        nll_at_temperature(_one(logits, target), 1.7), rel=1e-12
    )


def test_callable_called_once_per_pass_and_generators_work():
    logits, target = _synthetic(500, 3, scale=2.0, seed=4)
    calls = []

    def batches():
        calls.append(1)
        for lo in range(0, 500, 100):
            yield logits[lo : lo + 100], target[lo : lo + 100]

    fit_temperature(batches, passes=4)
    assert len(calls) == 4


def test_exhausted_generator_is_reported():
    logits, target = _synthetic(100, 3, scale=2.0)
    gen = iter([(logits, target)])
    with pytest.raises(ValueError, match="fresh iterable"):
        fit_temperature(lambda: gen)


def test_model_with_grad_builds_no_graph():
    model = torch.nn.Linear(4, 3)
    x = torch.randn(64, 4)
    with torch.no_grad():
        y = model(x).argmax(dim=1)
    y[::3] = (y[::3] + 1) % 3  # a third wrong: the optimum T is finite
    t = fit_temperature(lambda: [(model(x), y)])
    assert t > 0 and model.weight.grad is None


def test_boundary_warns_and_flat_returns_one():
    logits = torch.tensor([[5.0, 0.0], [0.0, 5.0]])
    target = torch.tensor([0, 1])  # always right: NLL decreases as T -> 0
    with pytest.warns(UserWarning, match="boundary"):
        assert fit_temperature(_one(logits, target), t_min=0.1) == pytest.approx(0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fit_temperature(_one(torch.zeros(4, 3), torch.tensor([0, 1, 2, 0]))) == 1.0


def test_errors():
    logits, target = _synthetic(10, 3, scale=1.0)
    with pytest.raises(ValueError, match="valid position"):
        fit_temperature(_one(logits, torch.full((10,), -100)))
    with pytest.raises(ValueError, match="valid position"):
        fit_temperature(lambda: [])
    with pytest.raises(ValueError, match="t_max"):
        fit_temperature(_one(logits, target), t_min=2.0, t_max=2.0)
    with pytest.raises(ValueError, match="t_min"):
        fit_temperature(_one(logits, target), t_min=0.0)
    with pytest.raises(ValueError, match="num_grid"):
        fit_temperature(_one(logits, target), num_grid=2)
    with pytest.raises(ValueError, match="passes"):
        fit_temperature(_one(logits, target), passes=0)
    with pytest.raises(ValueError, match="shape"):
        fit_temperature(_one(logits, target[:5]))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        fit_temperature(_one(logits, torch.full((10,), 3)))
    bad = logits.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        fit_temperature(_one(bad, target))
    with pytest.raises(ValueError, match="temperature"):
        nll_at_temperature(_one(logits, target), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        TemperatureScaler(-1.0)


def test_scaler_module():
    scaler = TemperatureScaler(2.5)
    x = torch.randn(2, 4, 3, 3)
    assert torch.allclose(scaler(x), x / 2.5)
    assert "temperature" in scaler.state_dict() and not list(scaler.parameters())
    model = torch.nn.Sequential(torch.nn.Identity(), scaler).double()
    assert torch.equal(model(x.double()).argmax(1), x.argmax(1))
    restored = TemperatureScaler()
    restored.load_state_dict(scaler.state_dict())
    assert float(restored.temperature) == 2.5
    # one temperature scaling: the scaler is the ts calibrator, which loads the same state
    from cals_seg.calibrators import build_calibrator
    from cals_seg.calibrators.ts import TemperatureScaling

    ts = build_calibrator("ts", 4)
    ts.load_state_dict(scaler.state_dict())
    assert isinstance(scaler, TemperatureScaling) and torch.equal(ts(x), scaler(x))
