"""Region-adaptive CALS-ALM (cals_alm_bands, the opt-in contrib module ``cals_bands``): the band
maps, the loss and its analytic backward against float64 references, per-band updates over two
epochs, one band = CALS-ALM, resume, the training transform's band map, backward memory; the
opt-in itself (the module registers the loss; ``cals_seg.BandCALSALMLoss`` is a deprecated
name that opts in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cals_seg.contrib.auto_margin import beyond_chance, next_margin
from cals_seg.contrib.cals_bands import BandCALSALMLoss, BandMap, band_penalty, distance_bands
from cals_seg.data.extra_inputs import request_extra_inputs
from cals_seg.data.transforms import train_transform
from cals_seg.losses import CALSALMLoss, build_loss, get_penalty
from cals_seg.losses.margin_rules import MARGIN_RATE, MARGIN_SKILL
from cals_seg.losses.temperature_stats import (
    NUM_BINS,
    class_counts,
    effective_margin_sums,
    largest_gap_bound,
    solve_temperature,
)
from cals_seg.metrics import BoundaryCalibrationMeter

K = 4
IGN = 255
BANDS = (1.5, 3.0)  # small test masks: every band populated


def _mask(n=2, s=(12, 14), seed=0, void=0.05, block=4):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n, -(-s[0] // block), -(-s[1] // block)), generator=g)
    y = y.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, : s[0], : s[1]].contiguous()
    y[torch.rand((n, *s), generator=g) < void] = IGN
    return y


def _data(n=2, s=(12, 14), scale=6.0, seed=0, void=0.02, block=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 100)
    x = (torch.randn((n, K, *s), generator=g, dtype=torch.float64) * scale).to(dtype)
    return x, _mask(n, s, seed, void, block)


# ----------------------------------------------------------------- band maps
@pytest.mark.parametrize("bands", [(3.0, 8.0), (1.5, 2.0, 4.5), (2.0,)])
def test_band_map_equals_the_boundary_meter(bands):
    y = _mask(n=3, s=(30, 27), seed=4, void=0.03, block=7).numpy()
    meter = BoundaryCalibrationMeter(K, bands=bands, ignore_index=IGN)
    ours = distance_bands(y, bands, IGN)
    expected = meter._groups(y)
    valid = y != IGN
    np.testing.assert_array_equal(ours[valid], expected[valid])
    assert (ours[~valid] == -1).all()


def test_band_map_brute_force_and_padding_is_not_a_boundary():
    """A 1 x 11 strip [0 0 0 1 1 1 1 1 1 void void]. As padding (inside False) the void is
    outside the image: the label change is the only boundary (pixels 2 and 3). As void it is a
    different value: pixel 8 is a boundary pixel too."""
    y = np.array([[[0, 0, 0, 1, 1, 1, 1, 1, 1, IGN, IGN]]])
    inside = np.array([[[True] * 9 + [False] * 2]])
    # distances to {2, 3}: 2 1 0 0 1 2 3 4 5; bands d < 2 -> 0, 2 <= d < 4 -> 1, else 2
    np.testing.assert_array_equal(distance_bands(y, (2.0, 4.0), IGN, inside)[0, 0],
                                  [1, 0, 0, 0, 0, 1, 1, 2, 2, -1, -1])
    # distances to {2, 3, 8}: 2 1 0 0 1 2 2 1 0
    np.testing.assert_array_equal(distance_bands(y, (2.0, 4.0), IGN)[0, 0],
                                  [1, 0, 0, 0, 0, 1, 1, 0, 0, -1, -1])


def test_training_transform_adds_the_band_map_of_the_augmented_mask():
    """The band map is the meter's rule on the augmented mask, the padding the augmentation
    adds being outside the image (the source mask has no void, so every output void pixel is
    padding); the augmentation itself is unchanged."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)
    mask = np.zeros((40, 50), np.uint8)
    mask[10:30, 12:40] = 2
    plain = train_transform(48, scale_range=(0.6, 1.1), ignore_index=IGN)
    banded = train_transform(48, scale_range=(0.6, 1.1), ignore_index=IGN)

    class _Set:
        transform = banded

    request_extra_inputs(_Set(), BandCALSALMLoss(K, ignore_index=IGN))
    padded = 0
    for seed in range(6):
        plain.compose.set_random_seed(seed)
        banded.compose.set_random_seed(seed)
        a = plain(image=image, mask=mask)
        b = banded(image=image, mask=mask)
        torch.testing.assert_close(a["image"], b["image"])  # the same augmentation
        torch.testing.assert_close(a["mask"], b["mask"])
        band, m = b["band"].numpy(), b["mask"].numpy()
        assert band.shape == (48, 48) and band.dtype == np.int64
        pad = m == IGN
        ref = distance_bands(m[None], (3.0, 8.0), IGN, ~pad[None])[0]
        np.testing.assert_array_equal(band, ref)
        if pad.any():
            padded += 1
            # pixels along the padding are not boundary pixels (unless a label changes there)
            assert (distance_bands(m[None], (3.0, 8.0), IGN)[0] != band).any()
    assert padded >= 2
    assert "band" not in plain(image=image, mask=mask)


def test_request_extra_inputs_refuses_data_without_a_segmentation_transform():
    class _Set:
        transform = None

    with pytest.raises(ValueError, match="band"):
        request_extra_inputs(_Set(), BandCALSALMLoss(K))
    request_extra_inputs(_Set(), CALSALMLoss(K))  # a loss without extra inputs: nothing asked


# ----------------------------------------------------------------- the loss
def _naive(x, y, band, margins, lambdas, rhos, penalty="phr"):
    """CE + (1/(|V| K)) sum_{i in V} sum_k P(z_ik; rho_b(i)k, lambda_b(i)k), by autograd."""
    pen = get_penalty(penalty)
    valid = y != IGN
    b = band.clamp(min=0)
    m = margins[b].unsqueeze(1)  # (N, 1, H, W)
    lam = lambdas[b].permute(0, 3, 1, 2)
    rho = rhos[b].permute(0, 3, 1, 2)
    z = (x.amax(dim=1, keepdim=True) - x) / m - 1
    v = valid.unsqueeze(1)
    return F.cross_entropy(x, y, ignore_index=IGN) + (pen.value(z, rho, lam) * v).sum() / (
        v.sum() * x.shape[1])


def _loop_penalty(x, y, band, margins, lambdas, rhos):
    xs, ys = x.numpy(), y.numpy()
    total, count = 0.0, 0
    for a in range(xs.shape[0]):
        for i in range(xs.shape[2]):
            for j in range(xs.shape[3]):
                if ys[a, i, j] == IGN:
                    continue
                count += 1
                b = int(band[a, i, j])
                col = xs[a, :, i, j]
                for c in range(xs.shape[1]):
                    z = (col.max() - col[c]) / float(margins[b]) - 1
                    lam, rho = float(lambdas[b, c]), float(rhos[b, c])
                    total += lam * z + rho * z * z / 2 if lam + rho * z >= 0 else (
                        -lam * lam / (2 * rho))
    return total / (count * xs.shape[1])


def _loss_with_params(seed=0, **kw):
    loss = BandCALSALMLoss(K, bands=BANDS, ignore_index=IGN, margin=4.0, **kw)
    g = torch.Generator().manual_seed(seed)
    loss.lambdas.copy_(torch.rand(loss.lambdas.shape, generator=g, dtype=torch.float64) * 2)
    loss.rhos.copy_(1 + torch.rand(loss.rhos.shape, generator=g, dtype=torch.float64) * 4)
    loss.margins.copy_(torch.tensor([2.0, 4.0, 7.0][: loss.num_bands], dtype=torch.float64))
    return loss


@pytest.mark.parametrize("block", [None, 9, 200])
@pytest.mark.parametrize("penalty", ["phr", "p2"])
def test_loss_and_gradient_equal_references(block, penalty, monkeypatch):
    if block is not None:
        monkeypatch.setattr("cals_seg.losses._functional.BLOCK_ELEMENTS", block)
    x, y = _data(seed=1)
    loss = _loss_with_params(penalty=penalty)
    band = torch.from_numpy(distance_bands(y.numpy(), loss.bands, IGN))
    assert len(set(band[y != IGN].tolist())) == 3  # every band is populated
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = loss(a, y, band=band)
    ref = _naive(b, y, band, loss.margins, loss.lambdas, loss.rhos, penalty)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    if penalty == "phr":  # the value, by loops
        ce = F.cross_entropy(x, y, ignore_index=IGN)
        expected = ce + _loop_penalty(x, y, band, loss.margins, loss.lambdas, loss.rhos)
        torch.testing.assert_close(ours.detach(), expected, rtol=1e-12, atol=1e-12)
    # without band= it computes the same map from the target
    torch.testing.assert_close(loss(x, y), ours.detach(), rtol=0, atol=0)


def test_penalty_gradcheck():
    x, y = _data(n=1, s=(6, 5), seed=2)
    loss = _loss_with_params()
    band = torch.from_numpy(distance_bands(y.numpy(), (1.0, 2.0), IGN)).reshape(1, -1)
    like = dict(dtype=torch.float64)
    fn = lambda t: band_penalty(t, band, loss.margins.to(**like), loss.lambdas, loss.rhos,  # noqa: E731
                                loss.penalty)
    inp = x.reshape(1, K, -1).clone().requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (inp,), eps=1e-6, atol=1e-7)


def test_band_argument_is_checked():
    x, y = _data()
    loss = BandCALSALMLoss(K, ignore_index=IGN)
    with pytest.raises(ValueError, match="band"):
        loss(x, y, band=torch.zeros(2, 3, 3, dtype=torch.long))
    loss(x, y, band=torch.full_like(y, 3))  # deferred by default: reported by check()
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        loss.check()
    loss.deferred_checks = False
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        loss(x, y, band=torch.full_like(y, 3))
    with pytest.raises(ValueError, match=r"\(N, K, H, W\)"):
        loss(x[:, :, 0], y[:, 0])
    with pytest.raises(ValueError, match="bands"):
        build_loss("cals_alm_bands", K, bands=[8, 3])


def test_void_pixels_and_their_band_change_nothing():
    x, y = _data(seed=3, void=0.2)
    loss = _loss_with_params()
    band = torch.from_numpy(distance_bands(y.numpy(), loss.bands, IGN))
    other = band.clone()
    other[y == IGN] = 2
    a = x.clone().requires_grad_(True)
    loss(a, y, band=band).backward()
    assert (a.grad[(y == IGN).unsqueeze(1).expand_as(x)] == 0).all()
    torch.testing.assert_close(loss(x, y, band=other), loss(x, y, band=band), rtol=0, atol=0)


def test_penalty_keeps_only_the_max_map_and_band_for_backward():
    x, y = _data(n=2, s=(32, 32), dtype=torch.float32)
    loss = _loss_with_params()
    logits = x.reshape(2, K, -1).requires_grad_(True)
    band = torch.from_numpy(distance_bands(y.numpy(), loss.bands, IGN)).reshape(2, -1)
    sizes: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
            sizes.append(t.untyped_storage().nbytes())
        return t

    f32 = dict(dtype=torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = band_penalty(logits, band, loss.margins.to(**f32), loss.lambdas.to(**f32),
                           loss.rhos.to(**f32), loss.penalty)
    out.backward()
    per_position = 2 * 32 * 32
    # float32 max map + int8 band map + the (B,) and (B, K) parameters
    assert sum(sizes) <= per_position * (4 + 1) + 4 * (3 + 2 * 3 * K)


# ----------------------------------------------------------------- updates
def _epochs():
    """Two epochs of two batches whose logits favour the true class more far from the
    boundaries (the bands differ in calibration), sharper in the second epoch."""
    out = []
    for e in range(2):
        batches = []
        for b in range(2):
            x, y = _data(seed=10 * e + b, scale=3.0 + e, s=(16, 15))
            band = torch.from_numpy(distance_bands(y.numpy(), BANDS, IGN)).clamp(min=0)
            onehot = F.one_hot(y.clamp(max=K - 1), K).permute(0, 3, 1, 2).to(x.dtype)
            batches.append((x + onehot * (2.0 + 5.0 * band).unsqueeze(1), y))
        out.append(batches)
    return out


def _only_band(y, b, bands):
    """The target with every pixel outside band b set void (for a per-band CALS-ALM)."""
    band = torch.from_numpy(distance_bands(y.numpy(), bands, IGN))
    return y.masked_fill(band != b, IGN)


class _PreviousRuleALM(CALSALMLoss):
    """CALS-ALM with the ``margin: auto`` rule the bands keep (chance gate on the majority
    class, ``m <- next_margin(m, T_hat, G)``, put in force by ``set_margin``) run after its
    update; CALS-ALM's own ``margin: auto`` (cals_seg.contrib.auto_margin) moves only on
    evidence."""

    log_keys = (*CALSALMLoss.log_keys, "margin", "margin_temperature")

    def __init__(self, num_classes, margin=10.0, margin_min=1.0, **kwargs):
        self.auto = margin == "auto"
        super().__init__(num_classes, margin=10.0 if self.auto else margin, **kwargs)
        self.margin_min = margin_min
        for name, shape in (("_meff_hist", NUM_BINS), ("_gap_hist", NUM_BINS), ("_correct", ()),
                            ("_class_count", num_classes)):
            self.add_statistic(name, shape)

    def _observe(self, logits, target, valid):
        out = super()._observe(logits, target, valid)
        if self.auto:
            hist, gap_hist, correct = effective_margin_sums(logits, target, valid)
            out.update(_meff_hist=hist, _gap_hist=gap_hist, _correct=correct,
                       _class_count=class_counts(target, valid, self.num_classes))
        return out

    def _update(self, epoch, stats, n):
        logs = super()._update(epoch, stats, n)
        if not self.auto:
            return logs
        correct = float(stats["_correct"])
        t_hat = solve_temperature(stats["_meff_hist"], correct, self.num_classes)
        ceiling = largest_gap_bound(stats["_gap_hist"])
        if beyond_chance(correct, stats["_class_count"], MARGIN_SKILL)[0]:
            self.set_margin(next_margin(self.margin, t_hat, ceiling, self.margin_min, 20.0,
                                        MARGIN_RATE))
        return {**logs, **self.multipliers(), "margin": self.margin, "margin_temperature": t_hat}


@pytest.mark.parametrize("margin", [3.0, "auto"])
def test_each_band_updates_like_cals_alm_on_its_pixels(margin):
    """Two epochs: band b's multipliers, rho and margin equal those of a CALS-ALM that observes
    only band b's validation pixels (the rest void)."""
    epochs = _epochs()
    common = dict(rho_period=1, margin=margin, margin_min=0.5)
    ours = BandCALSALMLoss(K, bands=BANDS, ignore_index=IGN, margin_steer="band", **common)
    per_band = [_PreviousRuleALM(K, ignore_index=IGN, **common) for _ in range(ours.num_bands)]
    for e, batches in enumerate(epochs):
        for x, y in batches:
            ours.observe(x, y)
            for b, ref in enumerate(per_band):
                ref.observe(x, _only_band(y, b, ours.bands))
        logs = ours.update_multipliers(e)
        for b, ref in enumerate(per_band):
            ref_logs = ref.update_multipliers(e)
            np.testing.assert_allclose(logs[f"lambda_band{b}"], ref_logs["lambda"], rtol=1e-12)
            np.testing.assert_allclose(logs[f"rho_band{b}"], ref_logs["rho"], rtol=1e-12)
            np.testing.assert_allclose(logs[f"constraint_band{b}"], ref_logs["constraint"],
                                       rtol=1e-12)
            if margin == "auto":
                assert logs[f"margin_band{b}"] == pytest.approx(ref_logs["margin"], rel=1e-12)
            torch.testing.assert_close(ours.lambdas[b], ref.lambdas)
    assert all(n > 0 for n in logs["band_pixels"])
    if margin == "auto":  # the bands were steered apart
        assert len({round(logs[f"margin_band{b}"], 6) for b in range(3)}) == 3
    assert (ours.rhos > 1).any()


def _in_bands(y, keep, bands):
    """The target with every pixel outside the bands ``keep`` set void."""
    band = torch.from_numpy(distance_bands(y.numpy(), bands, IGN))
    return y.masked_fill(~torch.isin(band, torch.tensor(sorted(keep))), IGN)


@pytest.mark.parametrize("steer", ["adjacent", "pooled_gate"])
def test_margin_steering_reads_the_right_pixels(steer):
    """Three epochs, margin: auto. ``adjacent``: band b's T_hat is the T_hat of a CALS-ALM that
    observes bands b-1..b+1 only. ``pooled_gate``: band b's own T_hat while all the pixels
    together are over-confident (T_all >= 1), T_all otherwise. The margin then follows
    next_margin from the band's own ceiling; the multipliers follow the margin."""
    epochs = _epochs()
    def onehot(y):
        return F.one_hot(y.clamp(max=K - 1), K).permute(0, 3, 1, 2).to(torch.float64)

    epochs = epochs + [[(x * 3.0, y) for x, y in epochs[1]],  # sharper: over-confident
                       [(0.1 * x + onehot(y), y) for x, y in epochs[1]]]  # right, unsure
    common = dict(rho_period=1, margin="auto", margin_min=0.5)
    ours = BandCALSALMLoss(K, bands=BANDS, ignore_index=IGN, margin_steer=steer, **common)
    nb = ours.num_bands
    groups = ([set(range(max(b - 1, 0), min(b + 2, nb))) for b in range(nb)]
              if steer == "adjacent" else [{b} for b in range(nb)])
    refs = [_PreviousRuleALM(K, ignore_index=IGN, **common) for _ in groups]
    pooled = _PreviousRuleALM(K, ignore_index=IGN, **common)
    seen_gate = set()
    for e, batches in enumerate(epochs):
        before = ours.margins.clone()
        correct, counts = np.zeros(len(groups)), np.zeros((len(groups), K))
        for x, y in batches:
            ours.observe(x, y)
            pooled.observe(x, y)
            for g, (keep, ref) in enumerate(zip(groups, refs, strict=True)):
                yg = _in_bands(y, keep, ours.bands)
                ref.observe(x, yg)
                ok = yg != IGN
                correct[g] += float((x.argmax(1) == yg)[ok].sum())
                counts[g] += np.bincount(yg[ok].numpy(), minlength=K)
        logs = ours.update_multipliers(e)
        t_all = pooled.update_multipliers(e)["margin_temperature"]
        for b, ref in enumerate(refs):
            t_ref = ref.update_multipliers(e)["margin_temperature"]
            if steer == "pooled_gate" and t_all < 1:
                t_ref = t_all
            seen_gate.add(steer != "pooled_gate" or t_all < 1)
            assert logs[f"margin_temperature_band{b}"] == pytest.approx(t_ref, rel=1e-12)
            expected = next_margin(float(before[b]), t_ref, logs[f"margin_ceiling_band{b}"],
                                   0.5, 20.0, MARGIN_RATE)
            if not beyond_chance(correct[b], torch.from_numpy(counts[b]), MARGIN_SKILL)[0]:
                expected = float(before[b])  # at chance: held
            assert logs[f"margin_band{b}"] == pytest.approx(expected, rel=1e-12)
    assert seen_gate == {True, False} or steer == "adjacent"  # both sides of the gate ran
    if steer == "adjacent":  # the groups differ: the bands are steered differently than alone
        alone = BandCALSALMLoss(K, bands=BANDS, ignore_index=IGN, margin_steer="band", **common)
        for x, y in epochs[0][0:2]:
            alone.observe(x, y)
        ours2 = BandCALSALMLoss(K, bands=BANDS, ignore_index=IGN, margin_steer=steer, **common)
        for x, y in epochs[0][0:2]:
            ours2.observe(x, y)
        a, o = alone.update_multipliers(0), ours2.update_multipliers(0)
        assert a["margin_temperature_band0"] != pytest.approx(o["margin_temperature_band0"])


def test_margin_steer_is_checked():
    with pytest.raises(ValueError, match="margin_steer"):
        BandCALSALMLoss(K, bands=BANDS, margin_steer="pooled")


def test_update_matches_loop_reference():
    """lambda_bk = clip(mean over band b of max(0, lambda + rho z)), zbar_bk = mean z, by loops."""
    epochs = _epochs()
    loss = _loss_with_params()
    lam0, rho0, m = loss.lambdas.clone(), loss.rhos.clone(), loss.margins.clone()
    for x, y in epochs[0]:
        loss.observe(x, y)
    logs = loss.update_multipliers(0)
    s1, s2, n = np.zeros((3, K)), np.zeros((3, K)), np.zeros(3)
    for x, y in epochs[0]:
        band = distance_bands(y.numpy(), loss.bands, IGN)
        xs = x.numpy()
        for a, i, j in zip(*np.nonzero(y.numpy() != IGN), strict=True):
            b = band[a, i, j]
            col = xs[a, :, i, j]
            n[b] += 1
            for c in range(K):
                z = (col.max() - col[c]) / float(m[b]) - 1
                s1[b, c] += max(0.0, float(lam0[b, c]) + float(rho0[b, c]) * z)
                s2[b, c] += z
    for b in range(3):
        np.testing.assert_allclose(logs[f"lambda_band{b}"], np.clip(s1[b] / n[b], 1e-6, 1e6),
                                   rtol=1e-12)
        np.testing.assert_allclose(logs[f"constraint_band{b}"], s2[b] / n[b], rtol=1e-12)
    assert logs["band_pixels"] == n.tolist()


@pytest.mark.parametrize("steer", ["band", "adjacent", "pooled_gate"])
def test_one_band_is_cals_alm(steer):
    epochs = _epochs()
    ours = BandCALSALMLoss(K, bands=(), ignore_index=IGN, margin="auto", rho_period=1,
                           margin_steer=steer)
    ref = _PreviousRuleALM(K, ignore_index=IGN, margin="auto", rho_period=1)  # the bands'
    for e, batches in enumerate(epochs):                                        # margin rule
        for x, y in batches:
            ours.observe(x, y)
            ref.observe(x, y)
        logs, ref_logs = ours.update_multipliers(e), ref.update_multipliers(e)
        np.testing.assert_allclose(logs["lambda_band0"], ref_logs["lambda"], rtol=1e-12)
        assert logs["margin_band0"] == pytest.approx(ref_logs["margin"], rel=1e-12)
    x, y = epochs[0][0]
    torch.testing.assert_close(ours(x, y), ref(x, y), rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip_mid_trajectory():
    epochs = _epochs() + _epochs()[::-1]
    kw = dict(bands=BANDS, ignore_index=IGN, margin="auto", rho_period=2)
    full = BandCALSALMLoss(K, **kw)
    logs_full = []
    for e, batches in enumerate(epochs):
        for x, y in batches:
            full.observe(x, y)
        logs_full.append(full.update_multipliers(e))
    first = BandCALSALMLoss(K, **kw)
    for e, batches in enumerate(epochs[:2]):
        for x, y in batches:
            first.observe(x, y)
        first.update_multipliers(e)
    resumed = BandCALSALMLoss(K, **kw)
    resumed.load_state_dict(first.state_dict())
    x, y = epochs[0][0]
    torch.testing.assert_close(resumed(x, y), first(x, y), rtol=0, atol=0)
    for e, batches in enumerate(epochs[2:], start=2):
        for x, y in batches:
            resumed.observe(x, y)
        assert resumed.update_multipliers(e) == logs_full[e]
    assert set(full.state_dict()) == {"lambdas", "rhos", "zbar_prev", "has_prev", "margins"}
    assert sum(t.numel() for t in full.state_dict().values()) == 3 * (3 * K + 2)  # O(K B)


def test_band_map_function_is_picklable():
    import pickle

    fn = pickle.loads(pickle.dumps(BandMap((3.0, 8.0), IGN)))
    y = _mask(n=1, s=(20, 20), seed=7)[0].numpy()
    np.testing.assert_array_equal(fn(y), distance_bands(y[None], (3.0, 8.0), IGN)[0])


def test_training_step_passes_the_band_map_to_the_criterion():
    from torch import nn

    from cals_seg.training.engine import train_one_epoch

    seen: list[torch.Tensor] = []

    class Recording(BandCALSALMLoss):
        def forward(self, logits, target, band=None):
            seen.append(band)
            return super().forward(logits, target, band=band)

    _, y = _data(n=2, s=(8, 8))
    band = torch.from_numpy(distance_bands(y.numpy(), BANDS, IGN))
    batch = {"image": torch.randn(2, 3, 8, 8), "mask": y, "band": band, "id": ["a", "b"]}
    model = nn.Conv2d(3, K, 1)
    crit = Recording(K, bands=BANDS, ignore_index=IGN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_one_epoch(model, crit, [batch], opt, torch.device("cpu"), progress=False)
    assert len(seen) == 1 and torch.equal(seen[0], band)
    # a loss without extra inputs is called as before
    train_one_epoch(model, CALSALMLoss(K, ignore_index=IGN), [batch], opt, torch.device("cpu"),
                    progress=False)


def test_trains_end_to_end_with_bands_from_the_loader(tmp_path, monkeypatch):
    """One epoch of the trainer on a tiny embedded dataset: every training batch brings its band
    map (made by the loader), the history holds the per-band multipliers and margins."""
    import json
    from pathlib import Path

    from cals_seg.config.schema import load_config
    from cals_seg.tasks import build_task
    from cals_seg.training.engine import seed_everything
    from cals_seg.training.trainer import fit

    calls: list[bool] = []
    forward = BandCALSALMLoss.forward

    def spy(self, logits, target, band=None):
        calls.append(band is not None and band.shape == target.shape)
        return forward(self, logits, target, band=band)

    monkeypatch.setattr(BandCALSALMLoss, "forward", spy)
    config = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3_short.yaml"
    cfg = load_config(config, [
        "name=bands", f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
        "data.synthetic={num_train: 12, num_test: 4, image_size: 32}", "data.crop_size=32",
        "train.epochs=1", "train.batch_size=4", "eval.batch_size=4", "train.progress=false",
        "train.threads=1", "eval.num_maps=0", "loss.name=cals_alm_bands",
        "loss.params={bands: [3, 8]}",
        "model.params={encoder_output_stride: 16, decoder_channels: 32}",
    ])
    seed_everything(0)
    fit(cfg, build_task(cfg))
    assert calls and all(calls)
    history = json.loads((cfg.run_dir / "history.jsonl").read_text().splitlines()[0])
    assert len(history["band_pixels"]) == 3 and sum(history["band_pixels"]) > 0
    assert {"lambda_band0", "margin_band2", "rho_band1"} <= set(history)


def test_opt_in_by_import_by_setup_file_and_by_the_deprecated_name():
    """A fresh process: the core's LOSSES lacks ``cals_alm_bands``; the setup files' method entry
    opts in (``contrib: [cals_bands]``); ``cals_seg.BandCALSALMLoss`` still gives the class, with
    a DeprecationWarning, and is not among the public names."""
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "synthetic_deeplabv3.yaml"
    code = (
        "import warnings\n"
        "from cals_seg.losses import LOSSES\n"
        "print('cals_alm_bands' in LOSSES)\n"
        "from cals_seg.config.schema import load_config\n"
        f"cfg = load_config({str(config)!r}, [], 'cals_alm_bands')\n"
        "print(cfg.contrib, cfg.loss.name, LOSSES['cals_alm_bands'].__module__)\n"
        "import cals_seg\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    cls = cals_seg.BandCALSALMLoss\n"
        "print(cls is LOSSES['cals_alm_bands'], [x.category.__name__ for x in w],\n"
        "      'BandCALSALMLoss' in cals_seg.__all__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["False", "['cals_bands'] cals_alm_bands cals_seg.contrib.cals_bands",
                   "True ['DeprecationWarning'] False"]


def test_the_core_names_the_module_of_a_loss_kept_beside_it():
    """Before the opt-in, asking the core for ``cals_alm_bands`` (by name, or a config's
    ``loss.name``) says which contrib module has it and how to opt in."""
    import subprocess
    import sys

    code = (
        "from cals_seg.losses import build_loss\n"
        "from cals_seg.config.schema import config_from_dict\n"
        "from cals_seg.config.rules import check_names\n"
        "for f in (lambda: build_loss('cals_alm_bands', 3),\n"
        "          lambda: check_names(config_from_dict({'loss': {'name': 'cals_alm_bands'}}))):\n"
        "    try:\n"
        "        f()\n"
        "    except Exception as err:\n"
        "        print(type(err).__name__, err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 2, out
    for line in out:
        assert "contrib module 'cals_bands'" in line and "contrib: [cals_bands]" in line, line
    assert out[1].startswith("ConfigError loss.name:")
