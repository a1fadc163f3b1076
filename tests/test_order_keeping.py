"""``cms_ap`` / ``cms_op``: the decision is the network's (mIoU identical), the map is
translation invariant and the identity until fitted, and the streamed fit is the float64
full-batch optimum of an independent formulation (dense matrices per permutation, solved by
scipy's bounded L-BFGS-B)."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from cals_seg.calibrators import build_calibrator, load_calibrator, save_calibrator
from cals_seg.metrics import SegmentationMeter

VOID = 255
K = 3


def _data(seed: int = 0, n: int = 3, h: int = 12, w: int = 12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K, h, w, generator=g, dtype=torch.float64) * 2.5
    target = torch.where(torch.rand(n, h, w, generator=g) < 0.75, logits.argmax(1),
                         torch.randint(0, K, (n, h, w), generator=g))
    target[torch.rand(n, h, w, generator=g) < 0.1] = VOID
    return logits, target


def _batches(logits, target):
    return lambda: [(logits[:1], target[:1]), (logits[1:], target[1:])]


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
    cal = build_calibrator(name, K)
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


@pytest.mark.parametrize("name,mode", [("cms_ap", "argmax"), ("cms_op", "order")])
def test_streamed_fit_equals_a_float64_full_batch_reference(name, mode):
    logits, target = _data(seed=1)
    valid = target != VOID
    rows = logits.movedim(1, -1)[valid]
    labels = target[valid]
    m = K - 1
    eye = np.eye(m, dtype=bool)
    x0 = np.concatenate([np.tile(np.eye(m), (K, 1, 1)).ravel(), np.zeros(K * m)])
    bounds = ([(1e-9, None) if eye[i, j] else (0.0, None)
               for _ in range(K) for i in range(m) for j in range(m)]
              + [(0.0, None)] * (K * m))

    def fun(v):
        p = torch.tensor(v, dtype=torch.float64, requires_grad=True)
        loss = _reference_nll(p, rows, labels, mode)
        loss.backward()
        return float(loss.detach()), p.grad.numpy()

    ref = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
                   options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-10})
    cal = build_calibrator(name, K, max_iter=300)
    info = cal.fit(_batches(logits, target), ignore_index=VOID)
    ours = torch.cat([cal.weight.double().ravel(), cal.bias.double().ravel()])
    nll_ours = float(_reference_nll(ours, rows, labels, mode))
    assert info["nll"] == pytest.approx(nll_ours, abs=1e-6)  # float32 buffers vs float64 fit
    assert nll_ours <= ref.fun + 1e-6
    assert nll_ours == pytest.approx(ref.fun, abs=1e-5)
    assert nll_ours < float(torch.nn.functional.cross_entropy(rows, labels)) - 1e-3
    # the optimum's probabilities are unique (strictly convex NLL in the logits)
    p_ref = torch.tensor(ref.x)
    for probe in (logits[:1].float(),):
        r = probe.movedim(1, -1).reshape(-1, K).double()[:40]
        ones = torch.zeros(r.shape[0], dtype=torch.long)
        z_ours = cal(probe).movedim(1, -1).reshape(-1, K).double().softmax(1)[:40]
        # the reference's probabilities, by the reference formula on each pixel
        per_pixel = []
        for i in range(r.shape[0]):
            pix = r[i:i + 1]
            per_pixel.append(torch.stack([(-_reference_nll(p_ref, pix, ones[:1] + k, mode)).exp()
                                          for k in range(K)]))
        torch.testing.assert_close(z_ours, torch.stack(per_pixel), atol=2e-3, rtol=0)
