"""``cms_ap`` / ``cms_op``: the decision is the network's (mIoU identical), the map is
translation invariant and the identity until fitted, the held-out NLL is never above
temperature scaling's, and one regularised stage of the streamed fit is the float64 full-batch
optimum of an independent formulation (dense matrices per permutation, solved by scipy's
bounded L-BFGS-B)."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from cals_seg.calibrators import build_calibrator, load_calibrator, save_calibrator
from cals_seg.calibrators.ts import fit_temperature
from cals_seg.metrics import SegmentationMeter

# The library's figures are saved undrawn (tests/conftest.py: figures_undrawn): this file
# checks numbers, messages and which files are written, not how a figure looks.
pytestmark = pytest.mark.usefixtures("undrawn_figures")

VOID = 255
K = 3


def _data(seed: int = 0, n: int = 4, h: int = 12, w: int = 12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K, h, w, generator=g, dtype=torch.float64) * 2.5
    target = torch.where(torch.rand(n, h, w, generator=g) < 0.75, logits.argmax(1),
                         torch.randint(0, K, (n, h, w), generator=g))
    target[torch.rand(n, h, w, generator=g) < 0.1] = VOID
    return logits, target


def _batches(logits, target):
    return lambda: [(logits[:1], target[:1]), (logits[1:], target[1:])]


FAST = {"holdout_every": 2, "max_iter": 15}


def _edge_logits():
    """Ties (two or three equal logits), saturated gaps and a per-pixel constant shift."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, K, 9, 9, generator=g) * 3
    x[0, 1] = x[0, 0]  # ties between classes 0 and 1 everywhere in image 0
    x[1, :, :2] = 1.5  # a three-way tie
    x[1, 2, 5:] += 200.0  # saturated
    return x


@pytest.mark.parametrize("name", ["cms_ap", "cms_op"])
def test_decision_is_the_networks_and_miou_identical(name, tmp_path):
    logits, target = _data()
    cal = build_calibrator(name, K, **FAST)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fitted map that moved: no identity warning
        info = cal.fit(_batches(logits, target), ignore_index=VOID)
    assert info["identity"] is False
    for x in (logits.float(), _edge_logits()):
        out = cal(x)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.equal(out.argmax(1), x.argmax(1))
        if name == "cms_op":  # the whole ranking (stable: ties by class index)
            assert torch.equal(torch.sort(out, dim=1, descending=True, stable=True)[1],
                               torch.sort(x, dim=1, descending=True, stable=True)[1])
        miou = []
        for z in (x, out):
            m = SegmentationMeter(K)
            m.update(z, x.argmax(1).roll(1, dims=-1))
            miou.append(m.compute()["miou"])
        assert miou[0] == miou[1]
    # translation invariance: a constant per pixel changes no probability
    x = logits.float()
    shift = torch.randn(x.shape[0], 1, *x.shape[2:]) * 50
    torch.testing.assert_close(cal(x + shift).softmax(1), cal(x).softmax(1), atol=1e-5, rtol=0)
    # save / load round trip
    path = save_calibrator(cal, tmp_path / f"{name}.pt")
    torch.testing.assert_close(load_calibrator(path)(x), cal(x))


@pytest.mark.parametrize("name", ["cms_ap", "cms_op"])
def test_unfitted_is_the_identity(name):
    x = _edge_logits()
    cal = build_calibrator(name, K)
    torch.testing.assert_close(cal(x).softmax(1), x.softmax(1), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ full-batch reference
def _reference_nll(params: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor,
                   mode: str) -> torch.Tensor:
    """Mean NLL with dense K x K maps: ``out = A_c l + d_c`` for every pixel of a given
    (top class, ranking) group, built from ``B_c`` and ``mu_c`` with explicit matrices."""
    m = K - 1
    weight = params[: K * m * m].view(K, m, m)
    bias = params[K * m * m:].view(K, m)
    total = rows.new_zeros(())
    order = np.argsort(-rows.numpy(), axis=1, kind="stable")
    for perm in itertools.permutations(range(K)):
        sel = torch.from_numpy((order == np.array(perm)).all(axis=1))
        if not bool(sel.any()):
            continue
        c = perm[0]
        if mode == "argmax":
            others = [j for j in range(K) if j != c]
            diff = torch.zeros(m, K, dtype=rows.dtype)  # g = diff @ l
            scatter = torch.zeros(K, m, dtype=rows.dtype)  # out = -scatter @ (B g + mu)
            for i, j in enumerate(others):
                diff[i, c], diff[i, j] = 1.0, -1.0
                scatter[j, i] = 1.0
        else:
            diff = torch.zeros(m, K, dtype=rows.dtype)
            for i in range(m):
                diff[i, perm[i]], diff[i, perm[i + 1]] = 1.0, -1.0
            scatter = torch.zeros(K, m, dtype=rows.dtype)  # out_(r) = -sum_{i < r} steps_i
            for r in range(1, K):
                for i in range(r):
                    scatter[perm[r], i] = 1.0
        a = -scatter @ weight[c] @ diff
        d = -scatter @ bias[c]
        z = rows[sel] @ a.T + d
        total = total + (torch.logsumexp(z, 1) - z.gather(1, labels[sel][:, None])[:, 0]).sum()
    return total / rows.shape[0]


def _reference_penalty(params: torch.Tensor, temperature: float, lam: float) -> torch.Tensor:
    """The pull towards TS written on ``(B, mu)``: ``lam / K (sum_j log(T B_jj)^2 +
    sum_{i != j} (T B_ij)^2 + sum mu^2)``."""
    m = K - 1
    weight = params[: K * m * m].view(K, m, m) * temperature
    bias = params[K * m * m:]
    eye = torch.eye(m, dtype=torch.bool).expand(K, m, m)
    return lam / K * (weight[eye].log().pow(2).sum() + weight[~eye].pow(2).sum()
                      + bias.pow(2).sum())


def _ts_temperature(logits, target):
    """The ``ts`` fit (its float64 value; the ``ts`` buffer is float32)."""
    return fit_temperature(_batches(logits, target), ignore_index=VOID)


@pytest.mark.parametrize("name,mode", [("cms_ap", "argmax"), ("cms_op", "order")])
def test_streamed_fit_equals_a_float64_full_batch_reference(name, mode):
    logits, target = _data(seed=1)
    valid = target != VOID
    rows = logits.movedim(1, -1)[valid]
    labels = target[valid]
    lam = 1e-3
    temp = _ts_temperature(logits, target)
    m = K - 1
    eye = np.eye(m, dtype=bool)
    x0 = np.concatenate([np.tile(np.eye(m) / temp, (K, 1, 1)).ravel(), np.zeros(K * m)])
    bounds = ([(1e-9, None) if eye[i, j] else (0.0, None)
               for _ in range(K) for i in range(m) for j in range(m)]
              + [(0.0, None)] * (K * m))

    def fun(v):
        p = torch.tensor(v, dtype=torch.float64, requires_grad=True)
        loss = _reference_nll(p, rows, labels, mode) + _reference_penalty(p, temp, lam)
        loss.backward()
        return float(loss.detach()), p.grad.numpy()

    ref = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10})
    fits = {}
    for key, batches in (("streamed", _batches(logits, target)),
                         ("one batch", lambda: [(logits, target)])):
        cal = build_calibrator(name, K, max_iter=300, lams=[lam], holdout_every=0)
        info = cal.fit(batches, ignore_index=VOID)
        assert info["temperature"] == pytest.approx(temp, rel=1e-12)
        fits[key] = cal
    cal = fits["streamed"]
    torch.testing.assert_close(cal.weight, fits["one batch"].weight, atol=1e-5, rtol=0)
    torch.testing.assert_close(cal.bias, fits["one batch"].bias, atol=1e-5, rtol=0)
    ours = torch.cat([cal.weight.double().ravel(), cal.bias.double().ravel()])
    obj_ours = float(_reference_nll(ours, rows, labels, mode) + _reference_penalty(ours, temp,
                                                                                   lam))
    assert info["fit_nll"] == pytest.approx(float(_reference_nll(ours, rows, labels, mode)),
                                            abs=1e-6)  # float32 buffers vs float64 fit
    # coefficients whose optimum is on the bound (B_ij = 0, mu = 0) are approached through
    # softplus, so the objective ends slightly above the bounded optimum (documented: 1e-4)
    assert ref.fun - 1e-9 <= obj_ours <= ref.fun + 1e-4
    ce = float(torch.nn.functional.cross_entropy(rows / temp, labels))
    assert float(_reference_nll(ours, rows, labels, mode)) < ce - 1e-3  # better than TS
    # the optimum's probabilities, by the reference formula on each pixel
    p_ref = torch.tensor(ref.x)
    probe = logits[:1].float()
    r = probe.movedim(1, -1).reshape(-1, K).double()[:40]
    ones = torch.zeros(r.shape[0], dtype=torch.long)
    z_ours = cal(probe).movedim(1, -1).reshape(-1, K).double().softmax(1)[:40]
    per_pixel = []
    for i in range(r.shape[0]):
        pix = r[i:i + 1]
        per_pixel.append(torch.stack([(-_reference_nll(p_ref, pix, ones[:1] + k, mode)).exp()
                                      for k in range(K)]))
    torch.testing.assert_close(z_ours, torch.stack(per_pixel), atol=1e-2, rtol=0)


# ------------------------------------------------------------------ never worse than TS
def _overfit_data(seed: int, n: int = 10):
    """Few pixels, labels from ``softmax(l / 1.7)`` plus class-dependent noise: an unregularised
    class-conditional map over-fits them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K, 6, 6, generator=g, dtype=torch.float64) * 3
    probs = (logits / 1.7).softmax(1)
    target = torch.multinomial(probs.movedim(1, -1).reshape(-1, K), 1, generator=g)
    return logits.float(), target.view(n, 6, 6)


def _nll64(z, y):
    return float(torch.nn.functional.cross_entropy(z.double(), y))


@pytest.mark.parametrize("name", ["cms_ap", "cms_op"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_held_out_nll_is_never_above_temperature_scalings(name, seed):
    logits, target = _overfit_data(seed)
    held = [j for j in range(logits.shape[0]) if j % 5 == 4]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = build_calibrator(name, K, max_iter=10)
        info = cal.fit(lambda: [(logits[i:i + 3], target[i:i + 3]) for i in range(0, 10, 3)])
        temp = fit_temperature(lambda: [(logits, target)])
    ts_held = _nll64(logits[held].double() / temp, target[held])
    ours = _nll64(cal(logits[held]), target[held])
    assert info["ts_heldout_nll"] == pytest.approx(ts_held, abs=1e-9)
    assert info["heldout_nll"] == pytest.approx(ours, abs=1e-6)  # float32 buffers
    assert info["heldout_nll"] <= info["ts_heldout_nll"]
    assert ours <= ts_held + 1e-6
    assert info["heldout_nll"] == min(info["heldout_trace"])
    assert info["heldout_trace"][0] == info["ts_heldout_nll"]  # evaluation 0 is TS
    assert torch.equal(cal(logits).argmax(1), logits.argmax(1))


def test_flat_logits_and_balanced_labels_leave_the_identity_and_say_so():
    y = torch.arange(K).repeat(4, 4, 1)[:, :, :K]  # every image holds each class equally
    y = y.expand(4, 4, K).clone()
    x = torch.zeros(4, K, 4, K)
    for name in ("cms_ap", "cms_op"):
        cal = build_calibrator(name, K, holdout_every=2, max_iter=5)
        with pytest.warns(UserWarning, match="identity"):
            info = cal.fit(lambda: [(x, y)])
        assert info["identity"] is True and info["evaluation"] == 0  # TS kept


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="lams"):
        build_calibrator("cms_ap", K, lams=[-1.0])
    with pytest.raises(ValueError, match="holdout_every"):
        build_calibrator("cms_op", K, holdout_every=1)
    logits, target = _data()
    with pytest.raises(ValueError, match="holdout_every"):
        build_calibrator("cms_ap", K, holdout_every=5).fit(_batches(logits[:3], target[:3]),
                                                          ignore_index=VOID)
