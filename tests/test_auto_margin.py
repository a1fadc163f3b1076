"""``margin: auto``: its statistics against a float64 loop, the temperature solve by hand, the
update rule, and that checkpoints carry the margin (the 2-process case is in
test_losses_distributed.py)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from cals_seg.losses import CALSALMLoss, CALSHRLoss, MbLSLoss, build_loss
from cals_seg.losses.auto_margin import (
    BIN_WIDTH,
    IMAGE_SUM_KEYS,
    NUM_BINS,
    REASONS,
    T_RANGE,
    balanced_skill,
    beyond_chance,
    class_counts,
    effective_margin_sums,
    evidence_step,
    gap_and_accuracy,
    image_sums,
    largest_gap_bound,
    mean_confidence,
    next_margin,
    skill_above_chance,
    solve_temperature,
    solve_temperature_at,
    still_learning,
    temperature_interval,
)

from .conftest import ROOT, load_tool

K, IGN = 5, 255


def _reference_sums(logits, target, ignore_index):
    """Loop over positions in float64: m_eff and the largest gap from their definitions, and
    the correct count."""
    hist = [0.0] * NUM_BINS
    gaps = [0.0] * NUM_BINS
    correct = 0.0
    n, k = logits.shape[:2]
    x = logits.double().reshape(n, k, -1)
    t = target.reshape(n, -1)
    for i in range(n):
        for s in range(x.shape[2]):
            if int(t[i, s]) == ignore_index:
                continue
            col = [float(v) for v in x[i, :, s]]
            top = max(range(k), key=lambda c: (col[c], -c))  # first maximum, as argmax
            rest = sum(math.exp(col[c] - col[top]) for c in range(k) if c != top)
            m_eff = math.log(k - 1) - math.log(rest)
            hist[min(NUM_BINS - 1, max(0, math.floor(m_eff / BIN_WIDTH)))] += 1
            largest = max(col) - min(col)
            gaps[min(NUM_BINS - 1, math.floor(largest / BIN_WIDTH))] += 1
            correct += float(top == int(t[i, s]))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return as_tensor(hist), as_tensor(gaps), correct


def test_effective_margin_sums_match_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, K, 6, 7, generator=g, dtype=torch.float64) * 4
    logits[0, :, 0, 0] = torch.tensor([50.0, 0.0, 0.0, 0.0, 0.0])  # m_eff = 50: the open bin
    target = torch.randint(0, K, (3, 6, 7), generator=g)
    target[torch.rand(3, 6, 7, generator=g) < 0.2] = IGN
    valid = target != IGN
    hist, gap_hist, correct = effective_margin_sums(
        logits.reshape(3, K, -1), target.reshape(3, -1), valid.reshape(3, -1)
    )
    ref_hist, ref_gaps, ref_correct = _reference_sums(logits, target, IGN)
    assert torch.equal(hist, ref_hist)
    assert torch.equal(gap_hist, ref_gaps)
    assert largest_gap_bound(gap_hist) == (int(ref_gaps.nonzero().max()) + 1) * BIN_WIDTH
    assert float(correct) == ref_correct
    assert hist.sum() == valid.sum()
    assert hist[-1] >= 1


def test_equal_gaps_give_the_margin_and_the_cap():
    # Every non-top logit 3 below the top: m_eff = 3 exactly, confidence = cap(3).
    logits = torch.tensor([3.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64).view(1, K, 1)
    hist, _, _ = effective_margin_sums(logits, torch.zeros(1, 1, dtype=torch.long),
                                       torch.ones(1, 1, dtype=torch.bool))
    assert int(hist.argmax()) == int(3.0 / BIN_WIDTH)
    conf = torch.softmax(logits.view(-1), 0)[0].item()
    assert conf == pytest.approx(1 / (1 + (K - 1) * math.exp(-3.0)), rel=1e-12)


def test_solve_temperature_by_hand():
    # All pixels in one bin (centre c) with accuracy a: cap(c / T) = a, so
    # T = c / (log(K - 1) + logit(a)).
    hist = torch.zeros(NUM_BINS, dtype=torch.float64)
    b = 100
    hist[b] = 1000.0
    c = (b + 0.5) * BIN_WIDTH
    for acc in (0.6, 0.8, 0.95):
        expected = c / (math.log(K - 1) + math.log(acc / (1 - acc)))
        t = solve_temperature(hist, acc * 1000.0, K)
        assert t == pytest.approx(expected, rel=1e-9)
        assert mean_confidence(hist, K, t) == pytest.approx(acc, rel=1e-9)
    # Accuracy beyond what any temperature in range reaches: the range's ends.
    assert solve_temperature(hist, 1000.0, K) == T_RANGE[0]
    tiny = torch.zeros(NUM_BINS, dtype=torch.float64)
    tiny[0] = 10.0  # m_eff ~ 0: confidence ~ 1/K whatever T
    assert solve_temperature(tiny, 0.0, K) == T_RANGE[1]
    with pytest.raises(ValueError, match="empty"):
        solve_temperature(torch.zeros(NUM_BINS, dtype=torch.float64), 0.0, K)


def _batch(scale: float, flip: float, seed: int = 0):
    """Logits of known confidence: the target is the top class except on a fraction ``flip``
    of the positions."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, K, (4, 8, 8), generator=g)
    logits = torch.nn.functional.one_hot(target, K).permute(0, 3, 1, 2).double() * scale
    wrong = torch.rand(4, 8, 8, generator=g) < flip
    target = torch.where(wrong, (target + 1) % K, target)
    return logits, target


@pytest.mark.parametrize("cls", [CALSALMLoss, CALSHRLoss])
def test_rule_shrinks_when_over_and_grows_when_under_confident(cls):
    # No rate limit (margin_rate = inf), no learning window (margin_patience = 0): the target
    # itself, m / T_lo, the end of the interval nearest 1 (the rate is tested below).
    crit = cls(K, ignore_index=IGN, margin="auto", margin_init=8.0, margin_max=12.0,
               margin_rate=math.inf, margin_patience=0)
    # Over-confident: gaps of 9 (confidence 0.9995) on 70%-accurate pixels.
    crit.observe(*_batch(9.0, 0.3))
    stats = crit.update_multipliers(0)
    t_hat, t_low = stats["margin_temperature"], stats["margin_t_low"]
    assert 1 < t_low < t_hat < stats["margin_t_high"]
    assert stats["margin_reason"] == "over-confident"
    assert stats["margin"] == pytest.approx(8.0 / t_low, rel=1e-12) == crit.margin
    assert float(crit.margin_value) == crit.margin
    # Under-confident: gaps of 3 (confidence 0.83) on 100%-accurate pixels: grows, up to
    # margin_max when the largest validation gap is beyond it ...
    for epoch in range(1, 4):
        logits, target = _batch(3.0, 0.0)
        logits[0, :, 0, 0] = torch.tensor([30.0, 0.0, 0.0, 0.0, 0.0])  # largest gap 30
        crit.observe(logits, target)
        stats = crit.update_multipliers(epoch)
        assert stats["margin_temperature"] < 1
        assert stats["margin_ceiling"] > 30
    assert crit.margin == 12.0
    # ... and never down on under-confidence: above the largest gap it is inert, and kept.
    crit.observe(*_batch(3.0, 0.0))
    stats = crit.update_multipliers(4)
    assert stats["margin_ceiling"] == pytest.approx(3.05)
    assert stats["margin_reason"] == "under-confident, at a bound" and crit.margin == 12.0


def test_warmup_keeps_the_initial_margin():
    crit = CALSALMLoss(K, ignore_index=IGN, margin="auto", margin_init=6.0, margin_warmup=2,
                       margin_rate=math.inf, margin_patience=0)
    for epoch in range(3):
        crit.observe(*_batch(9.0, 0.3))
        stats = crit.update_multipliers(epoch)
        assert stats["margin"] == (6.0 if epoch < 2 else pytest.approx(6.0 / stats[
            "margin_t_low"]))
        assert stats["margin_reason"] == ("warmup" if epoch < 2 else "over-confident")


def test_the_margin_in_force_is_what_the_penalty_uses():
    logits, target = _batch(9.0, 0.3)
    logits.requires_grad_(True)
    auto = CALSALMLoss(K, ignore_index=IGN, margin="auto", margin_init=8.0, margin_patience=0)
    auto.observe(logits.detach(), target)
    auto.update_multipliers(0)
    assert auto.margin < 8.0
    fixed = CALSALMLoss(K, ignore_index=IGN, margin=auto.margin)
    fixed.load_state_dict({k: v for k, v in auto.state_dict().items()
                           if not k.startswith("margin_")})
    assert torch.equal(auto(logits, target), fixed(logits, target))


def test_resume_continues_with_the_same_margin():
    # Over-, under-, over-, under-confident epochs: the margin goes down, up, down, up.
    batches = [_batch(9.0, 0.3, 0), _batch(3.0, 0.05, 1), _batch(9.0, 0.3, 2), _batch(3.0, 0.05, 3)]

    def run(crit, epochs):
        out = []
        for e in epochs:
            crit.observe(*batches[e])
            out.append(crit.update_multipliers(e)["margin"])
        return out

    # margin_patience = 1: the accuracy track (a checkpointed state) decides epoch 2's move.
    # (Below the largest gap, 3.05, of the under-confident batches: there they move it up.)
    make = lambda: CALSALMLoss(K, ignore_index=IGN, margin="auto",  # noqa: E731
                               margin_init=2.0, margin_patience=1)
    straight = run(make(), range(4))
    first = make()
    head = run(first, range(2))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert resumed.margin == first.margin
    assert torch.equal(resumed.margin_track, first.margin_track)
    assert head + run(resumed, range(2, 4)) == straight
    assert straight[0] == 2.0 < straight[1]
    assert straight[2] < straight[1] and straight[3] > straight[2]
    # A checkpoint of the previous rule (no accuracy track) still loads: the track starts empty.
    old = {k: v for k, v in first.state_dict().items()
           if k not in ("margin_track", "margin_seen")}
    again = make()
    again.load_state_dict(old)
    assert again.margin == first.margin and int(again.margin_seen) == 0


def test_bad_auto_parameters_are_refused():
    with pytest.raises(ValueError, match="'auto'"):
        build_loss("cals_alm", K, margin="adaptive")
    with pytest.raises(ValueError, match="margin_min <= margin_init <= margin_max"):
        build_loss("cals_alm", K, margin="auto", margin_init=30.0)
    with pytest.raises(ValueError, match="margin_warmup"):
        build_loss("cals_hr", K, margin="auto", margin_warmup=-1)
    with pytest.raises(ValueError, match="margin_rate"):
        build_loss("cals_alm", K, margin="auto", margin_rate=1.0)
    with pytest.raises(ValueError, match="margin_skill"):
        build_loss("cals_hr", K, margin="auto", margin_skill=1.0)
    with pytest.raises(ValueError, match="margin_skill"):
        build_loss("cals_alm", K, margin="auto", margin_skill=-0.1)
    for bad in (0.0, -1.0, math.inf, "2", True):
        with pytest.raises(ValueError, match="margin_z"):
            CALSALMLoss(K, margin="auto", margin_z=bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="margin_patience"):
            CALSHRLoss(K, margin="auto", margin_patience=bad)
    with pytest.raises(ValueError, match="loss.params.margin: expected a number"):
        build_loss("mbls", K, margin="auto")
    with pytest.raises(ValueError, match="MbLS has no validation pass"):
        MbLSLoss(K, margin="auto")
    # A fixed margin has no margin_value buffer: checkpoints of fixed-margin runs are unchanged.
    assert "margin_value" not in build_loss("cals_alm", K, margin=6.0).state_dict()


def test_classification_logits_work_too():
    # (N, K) logits (classification, text): the same rule, S = 1.
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, K, (64,), generator=g)
    logits = torch.nn.functional.one_hot(target, K).double() * 9.0
    target[:20] = (target[:20] + 1) % K  # 69% accurate at confidence 0.9995: over-confident
    crit = build_loss("cals_alm", K, margin="auto", margin_init=8.0, margin_patience=0)
    crit.observe(logits, target)
    stats = crit.update_multipliers(0)
    assert stats["margin_t_low"] > 1 and stats["margin"] < 8.0


# ----------------------------------------------------------------------------- issue 29: a rule
# that cannot collapse (chance gate, rate limit) and multipliers that follow the margin


def _chance_overconfident(k: int, n_per_class: int, gap: float, seed: int = 0):
    """Validation logits of a network at chance level that is sure of itself: balanced
    targets, a random top class with every gap ``gap`` (confidence cap(gap)), right on about 1/K
    of the positions."""
    g = torch.Generator().manual_seed(seed)
    target = torch.arange(k).repeat(n_per_class)
    top = torch.randint(0, k, target.shape, generator=g)
    logits = torch.nn.functional.one_hot(top, k).double() * gap
    return logits, target


def test_skill_above_chance_by_hand():
    # 1000 positions, 600 of class 0 (the majority): chance 0.6; 700 correct: accuracy 0.7.
    counts = torch.tensor([600.0, 300.0, 100.0], dtype=torch.float64)
    skill, excess, noise = skill_above_chance(700.0, counts)
    assert skill == pytest.approx(0.1 / 0.4, rel=1e-12)
    assert excess == pytest.approx(0.1, rel=1e-12)
    assert noise == pytest.approx(3 * math.sqrt(0.6 * 0.4 / 1000), rel=1e-12)
    assert beyond_chance(700.0, counts, 0.1) == (True, pytest.approx(0.25))
    assert beyond_chance(700.0, counts, 0.3)[0] is False  # skill 0.25 < 0.3
    # Predicting the majority class everywhere: accuracy = chance, skill 0.
    assert beyond_chance(600.0, counts, 0.0)[0] is False
    # Skill 0.2 on 20 positions is within the binomial noise of chance (3 sd = 0.33).
    few = torch.tensor([10.0, 10.0], dtype=torch.float64)
    assert skill_above_chance(12.0, few)[0] == pytest.approx(0.2)
    assert beyond_chance(12.0, few, 0.1)[0] is False
    # One class only: nothing to learn above chance.
    assert beyond_chance(5.0, torch.tensor([5.0, 0.0], dtype=torch.float64), 0.0) == (False, 0.0)
    with pytest.raises(ValueError, match="no validation position"):
        skill_above_chance(0.0, torch.zeros(3, dtype=torch.float64))


def test_class_counts_skip_void_positions():
    target = torch.tensor([[0, 2, 2, IGN], [1, IGN, 2, 0]])
    counts = class_counts(target, target != IGN, 4)
    assert counts.dtype == torch.float64 and counts.tolist() == [2.0, 1.0, 3.0, 0.0]


@pytest.mark.parametrize("cls", [CALSALMLoss, CALSHRLoss])
def test_chance_level_overconfident_network_keeps_the_margin(cls):
    # The histogram issue 29 saw after the first epoch: accuracy ~ 1/K at confidence 0.98. The
    # temperature solve hits the top of its range (the old rule: m 10 -> 10 / 16 -> margin_min).
    k = 10
    logits, target = _chance_overconfident(k, 20, gap=6.0)
    hist, _, correct = effective_margin_sums(logits.unsqueeze(-1), target.unsqueeze(-1),
                                             torch.ones(len(target), 1, dtype=torch.bool))
    assert abs(float(correct) / len(target) - 1 / k) < 0.05  # chance level ...
    assert mean_confidence(hist, k, 1.0) > 0.95  # ... and over-confident
    assert solve_temperature(hist, float(correct), k) == T_RANGE[1]
    crit = cls(k, margin="auto")
    before = {name: b.clone() for name, b in crit.state_dict().items()}
    crit.observe(logits, target)
    stats = crit.update_multipliers(0)
    assert stats["margin_temperature"] == T_RANGE[1]
    assert abs(stats["margin_skill"]) < 0.06
    assert stats["margin"] == crit.margin == float(crit.margin_value) == 10.0
    # The same network with a majority class (segmentation's background): predicting it
    # everywhere is accurate (75%) but at chance, and keeps the margin too.
    g = torch.Generator().manual_seed(1)
    target = torch.where(torch.rand(400, generator=g) < 0.75, 0, torch.randint(1, k, (400,),
                                                                                 generator=g))
    crit.observe(torch.nn.functional.one_hot(torch.zeros(400, dtype=torch.long), k).double() * 9,
                 target)
    stats = crit.update_multipliers(1)
    assert stats["margin_skill"] == 0.0 and stats["margin_temperature"] > 1
    assert crit.margin == 10.0
    if cls is CALSALMLoss:  # lambda followed its own rule; nothing was rescaled
        assert crit.zbar_prev.tolist() == stats["constraint"]
    assert torch.equal(crit.margin_value, before["margin_value"])


def _sums_of(n, c, a) -> torch.Tensor:
    """:func:`image_sums`'s vector from per-image pixel counts, confidence sums and correct
    counts (float64 lists), by its definition."""
    n, c, a = (torch.tensor(v, dtype=torch.float64) for v in (n, c, a))
    return torch.stack([torch.tensor(float(len(n)), dtype=torch.float64), n.sum(), c.sum(),
                        a.sum(), (n * n).sum(), (c * c).sum(), (a * a).sum(), (c * n).sum(),
                        (a * n).sum(), (c * a).sum()])


def _random_stats(g: torch.Generator, k: int) -> dict:
    """A random validation pass's statistics as the adaptive-loss contract hands them to the
    update: random images (1 to 40 positions each), m_eff and largest-gap histograms over random
    bins, a random accuracy (per image), random class counts and per-class correct counts."""
    images = int(torch.randint(2, 300, (1,), generator=g))
    per = torch.randint(1, 40, (images,), generator=g).double()
    n = int(per.sum())
    spread = float(torch.rand(1, generator=g)) * 10
    centre = float(torch.rand(1, generator=g)) * 12
    meff = (centre + spread * torch.randn(n, generator=g, dtype=torch.float64)).clamp(0, 60)
    gaps = meff + torch.rand(n, generator=g, dtype=torch.float64) * 5
    to_hist = lambda v: torch.bincount(  # noqa: E731
        (v / BIN_WIDTH).floor().clamp(0, NUM_BINS - 1).long(), minlength=NUM_BINS
    ).double()
    hist = to_hist(meff)
    conf = torch.sigmoid(meff - math.log(k - 1))  # cap(m_eff): the confidences
    acc = float(torch.rand(1, generator=g))
    right = (torch.rand(n, generator=g) < acc).double()
    owner = torch.repeat_interleave(torch.arange(images), per.long())
    c = torch.zeros(images, dtype=torch.float64).index_add_(0, owner, conf)
    a = torch.zeros(images, dtype=torch.float64).index_add_(0, owner, right)
    labels = torch.randint(0, k, (n,), generator=g)
    if bool(torch.rand(1, generator=g) < 0.3):  # a majority class
        labels[torch.rand(n, generator=g) < 0.7] = 0
    counts = torch.bincount(labels, minlength=k).double()
    class_correct = torch.bincount(labels[right.bool()], minlength=k).double()
    return {"_meff_hist": hist, "_gap_hist": to_hist(gaps),
            "_correct": right.sum(), "_class_count": counts,
            "_img_sums": _sums_of(per.tolist(), c.tolist(), a.tolist()),
            "_class_correct": class_correct}


def test_rate_limit_on_random_histograms():
    # 400 random validation passes, each applied to a criterion with a random margin, range and
    # rate: the margin never moves by more than margin_rate, stays in [margin_min,
    # margin_max], is kept when the gate is closed or the interval contains T = 1, moves only in
    # the direction the interval says, and to the clipped target m / T_lo or m / T_hi
    # whenever that is within the rate.
    g = torch.Generator().manual_seed(29)
    k = 7
    seen = dict.fromkeys(("held", "moved", "limited"), 0)
    for case in range(400):
        lo = 0.5 + float(torch.rand(1, generator=g)) * 3
        hi = lo + float(torch.rand(1, generator=g)) * 25
        init = lo + float(torch.rand(1, generator=g)) * (hi - lo)
        rate = 1.01 + float(torch.rand(1, generator=g)) * 2
        crit = CALSALMLoss(k, margin="auto", margin_init=init, margin_min=lo, margin_max=hi,
                           margin_rate=rate, margin_skill=0.05, margin_patience=0)
        stats = _random_stats(g, k)
        logs = crit._update_margin(case, stats)
        new = logs["margin"]
        assert lo <= new <= hi
        assert init / rate * (1 - 1e-12) <= new <= init * rate * (1 + 1e-12)
        assert logs["margin_reason"].split(",")[0] in REASONS
        gap, se, acc, _ = gap_and_accuracy(stats["_img_sums"])
        t_low, t_high = temperature_interval(stats["_meff_hist"], acc, se, 2.0, k)
        skill, excess, noise = balanced_skill(stats["_class_correct"], stats["_class_count"])
        high = max(min(hi, largest_gap_bound(stats["_gap_hist"])), lo)
        if not (skill >= 0.05 and excess > noise) or t_low <= 1 <= t_high:
            assert new == init
            seen["held"] += 1
            continue
        target = min(max(init / (t_low if t_low > 1 else t_high), lo), high)
        target = min(target, init) if t_low > 1 else max(target, init)
        if init / rate <= target <= init * rate:
            assert new == pytest.approx(target, rel=1e-12)
            seen["moved"] += 1
        else:
            assert new == pytest.approx(init * rate if target > init else init / rate, rel=1e-12)
            seen["limited"] += 1
    assert min(seen.values()) >= 20, seen  # every branch was exercised


def test_margin_walk_stays_in_bounds_and_rate():
    # 60 epochs of random validation passes through one criterion (default window): every step
    # within the rate and the bounds, and the reasons logged.
    g = torch.Generator().manual_seed(3)
    crit = CALSALMLoss(6, margin="auto", margin_skill=0.0)
    margins, reasons = [crit.margin], set()
    for epoch in range(60):
        logs = crit._update_margin(epoch, _random_stats(g, 6))
        margins.append(logs["margin"])
        reasons.add(logs["margin_reason"].split(",")[0])
    steps = [b / a for a, b in zip(margins[:-1], margins[1:], strict=True)]
    assert all(1 / 1.25 - 1e-12 <= s <= 1.25 + 1e-12 for s in steps)
    assert all(1.0 <= m <= 20.0 for m in margins)
    assert len(set(margins)) > 5
    assert {"still learning", "over-confident", "under-confident"} <= reasons


def test_next_margin_by_hand():
    # target inside the rate, below it, above it, and the ceiling G below the margin.
    assert next_margin(10.0, 1.1, 40.0, 1.0, 20.0, 1.25) == pytest.approx(10.0 / 1.1)
    assert next_margin(10.0, 16.0, 40.0, 1.0, 20.0, 1.25) == 8.0
    assert next_margin(10.0, 1 / 16, 40.0, 1.0, 20.0, 1.25) == 12.5
    assert next_margin(10.0, 0.5, 11.0, 1.0, 20.0, 1.25) == 11.0
    assert next_margin(10.0, 1.0, 3.0, 1.0, 20.0, 1.25) == 8.0  # towards G at the rate
    assert next_margin(10.0, 16.0, 40.0, 1.0, 20.0, math.inf) == 1.0  # no rate: the old rule
    assert next_margin(1.1, 16.0, 40.0, 1.0, 20.0, 1.25) == 1.0  # margin_min


def _z_mean(logits, target, margin, k):
    """Per-class mean normalised constraint over valid positions, in float64 loops."""
    out = [0.0] * k
    n = 0
    for i in range(logits.shape[0]):
        if int(target[i]) == IGN:
            continue
        n += 1
        top = max(float(v) for v in logits[i])
        for c in range(k):
            out[c] += (top - float(logits[i, c])) / margin - 1
    return [v / n for v in out]


def test_margin_change_rescales_lambda_and_restates_zbar():
    # A learning network (70% accurate) that is over-confident: the margin moves, lambda keeps
    # its force lambda / m on the gaps, and zbar_prev equals the mean constraint recomputed at
    # the new margin from the same validation logits (the rho rule compares like with like).
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, K, (300,), generator=g)
    logits = torch.nn.functional.one_hot(target, K).double() * 9 + torch.randn(300, K,
                                                                                generator=g)
    target = torch.where(torch.rand(300, generator=g) < 0.3, (target + 1) % K, target)
    target[:10] = IGN
    fixed = CALSALMLoss(K, margin=10.0, ignore_index=IGN, lambda_init=0.5)
    auto = CALSALMLoss(K, margin="auto", ignore_index=IGN, lambda_init=0.5, margin_patience=0)
    for crit in (fixed, auto):
        crit.observe(logits, target)
    ref = fixed.update_multipliers(0)
    stats = auto.update_multipliers(0)
    new = stats["margin"]
    assert new == 8.0  # over-confident, limited by the rate
    expected = (torch.tensor(ref["lambda"], dtype=torch.float64) * new / 10.0).clamp(1e-6, 1e6)
    torch.testing.assert_close(auto.lambdas, expected, rtol=1e-12, atol=0)
    assert stats["lambda"] == auto.lambdas.tolist()  # what is logged is what is in force
    torch.testing.assert_close(auto.zbar_prev,
                               torch.tensor(_z_mean(logits, target, new, K), dtype=torch.float64),
                               rtol=1e-9, atol=1e-12)
    assert ref["constraint"] == pytest.approx(_z_mean(logits, target, 10.0, K), rel=1e-9)
    torch.testing.assert_close(auto.rhos, fixed.rhos, rtol=0, atol=0)


# ----------------------------------------------------------------------------- end to end


def _train_auto(tmp_path, epochs: int, extra: list[str]):
    """``tools/train_cls.py configs/synthetic_cls.yaml --method cals_alm_auto`` (the shipped
    setup), returning the history lines."""
    overrides = [
        "name=auto", f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}",
        f"train.epochs={epochs}", "train.progress=false", "train.threads=1", *extra,
    ]
    code = load_tool("train_cls").main(
        [str(ROOT / "configs" / "synthetic_cls.yaml"), "--method", "cals_alm_auto",
         "--set", *overrides]
    )
    assert code == 0
    lines = (tmp_path / "runs" / "auto" / "history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _check_safe(history, epochs: int) -> None:
    assert [h["epoch"] for h in history] == list(range(epochs))
    margins = [10.0] + [h["margin"] for h in history]
    for h, before, after in zip(history, margins[:-1], margins[1:], strict=True):
        for key in ("train_loss", "train_ce", "train_penalty", "val_nll", "margin_temperature"):
            assert math.isfinite(h[key]), (h["epoch"], key)
        assert 1.0 <= after <= 20.0
        assert 1 / 1.25 - 1e-12 <= after / before <= 1.25 + 1e-12
        if h["margin_skill"] < 0.1:  # near chance: the margin is kept
            assert after == before
        if after != before:  # every move has its evidence in the history
            assert h["margin_reason"] in ("over-confident", "under-confident")
            assert (h["margin_t_low"] > 1) if after < before else (h["margin_t_high"] < 1)
        assert all(1e-6 <= v <= 1e6 and math.isfinite(v) for v in h["lambda"])


def test_shipped_classification_setup_first_epochs(tmp_path):
    # Tiny data (16 px, 4 validation images per class), 3 epochs, float32: finite losses, the
    # margin inside its bounds, within the rate, and kept while the accuracy is near chance.
    small = {"max_train": 120, "min_train": 5, "num_val": 4, "num_test": 6, "image_size": 16}
    history = _train_auto(tmp_path, 3, [
        f"data.synthetic={json.dumps(small)}", "data.image_size=16", "train.batch_size=32",
        "eval.batch_size=64", "train.amp=none",
    ])
    _check_safe(history, 3)
    assert history[0]["margin_skill"] < 0.1 and history[0]["margin"] == 10.0
    assert history[0]["margin_reason"] == "at chance"
    assert (tmp_path / "runs" / "auto" / "plots" / "margin_evidence.png").is_file()


@pytest.mark.slow
def test_shipped_classification_setup_issue_29(tmp_path):
    # Issue 29's command at full size (about 30 s on one core): the old rule dropped the margin
    # to 1 after the first epoch, and the loss was NaN in epoch 5. Slow: the test above covers
    # the same rule on tiny data.
    history = _train_auto(tmp_path, 6, [])
    _check_safe(history, 6)  # every move with its evidence (the evidence rule may hold it)
    assert history[0]["margin"] == 10.0


# ----------------------------------------------------------------------------- issue 37: moves only
# on evidence (image-level interval), balanced skill, no shrink while still learning


def _image_reference(logits, target, ignore_index):
    """Per image, in float64 loops: valid positions n_j, confidence sum c_j (top softmax
    probability from its definition), correct count a_j; and correct positions per class."""
    n_img, k = logits.shape[:2]
    x = logits.double().reshape(n_img, k, -1)
    t = target.reshape(n_img, -1)
    ns, cs, as_, per_class = [], [], [], [0.0] * k
    for i in range(n_img):
        n = c = a = 0.0
        for s in range(x.shape[2]):
            y = int(t[i, s])
            if y == ignore_index:
                continue
            col = [float(v) for v in x[i, :, s]]
            top = max(range(k), key=lambda q: (col[q], -q))
            c += 1.0 / sum(math.exp(v - col[top]) for v in col)
            n += 1
            if top == y:
                a += 1
                per_class[y] += 1
        if n:
            ns.append(n), cs.append(c), as_.append(a)
    return ns, cs, as_, per_class


def _ratio_reference(y, n):
    """The ratio sum y / sum n and its image-level standard error, written out:
    sqrt(J / (J - 1) * sum_j (y_j - r n_j)^2) / sum_j n_j."""
    r = sum(y) / sum(n)
    resid = sum((yj - r * nj) ** 2 for yj, nj in zip(y, n, strict=True))
    return r, math.sqrt(len(y) / (len(y) - 1) * resid) / sum(n)


def _seg_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, K, 5, 7, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, K, (6, 5, 7), generator=g)
    target[torch.rand(6, 5, 7, generator=g) < 0.2] = IGN
    target[2] = IGN  # an image without a valid position is not a sampling unit
    return logits, target


def test_image_sums_match_a_float64_loop():
    logits, target = _seg_batch(0)
    valid = target != IGN
    sums, class_correct = image_sums(logits.reshape(6, K, -1), target.reshape(6, -1),
                                     valid.reshape(6, -1))
    ns, cs, as_, per_class = _image_reference(logits, target, IGN)
    assert len(ns) == 5 and sums.dtype == torch.float64
    torch.testing.assert_close(sums, _sums_of(ns, cs, as_), rtol=1e-12, atol=0)
    assert class_correct.tolist() == per_class
    assert dict(zip(IMAGE_SUM_KEYS, sums.tolist(), strict=True))["images"] == 5.0


def test_gap_interval_matches_a_float64_reference():
    logits, target = _seg_batch(1)
    valid = target != IGN
    sums, _ = image_sums(logits.reshape(6, K, -1), target.reshape(6, -1), valid.reshape(6, -1))
    ns, cs, as_, _ = _image_reference(logits, target, IGN)
    gap, gap_se, acc, acc_se = gap_and_accuracy(sums)
    ref_gap, ref_gap_se = _ratio_reference([c - a for c, a in zip(cs, as_, strict=True)], ns)
    ref_acc, ref_acc_se = _ratio_reference(as_, ns)
    assert gap == pytest.approx(ref_gap, rel=1e-10)
    assert gap_se == pytest.approx(ref_gap_se, rel=1e-9)
    assert acc == pytest.approx(ref_acc, rel=1e-12)
    assert acc_se == pytest.approx(ref_acc_se, rel=1e-9)
    # One position per image (classification): the usual standard error of a mean.
    d = [0.9 - 1, 0.8 - 0, 0.7 - 1, 0.95 - 1, 0.6 - 0, 0.85 - 1]
    one = _sums_of([1.0] * 6, [0.9, 0.8, 0.7, 0.95, 0.6, 0.85], [1.0, 0, 1, 1, 0, 1])
    gap, gap_se, _, _ = gap_and_accuracy(one)
    assert gap == pytest.approx(statistics.fmean(d), rel=1e-12)
    assert gap_se == pytest.approx(statistics.stdev(d) / math.sqrt(6), rel=1e-10)
    # One image: no error can be estimated, and the interval is the whole range (no evidence).
    assert gap_and_accuracy(_sums_of([4.0], [3.0], [2.0]))[1] is None
    hist = torch.zeros(NUM_BINS, dtype=torch.float64)
    hist[80] = 10.0
    assert temperature_interval(hist, 0.5, None, 2.0, K) == T_RANGE
    # The ends of the interval match the confidence to accuracy +- z se.
    t_low, t_high = temperature_interval(hist, 0.7, 0.05, 2.0, K)
    assert mean_confidence(hist, K, t_low) == pytest.approx(0.8, rel=1e-9)
    assert mean_confidence(hist, K, t_high) == pytest.approx(0.6, rel=1e-9)
    assert t_low < solve_temperature_at(hist, 0.7, K) < t_high
    with pytest.raises(ValueError, match="no validation position"):
        gap_and_accuracy(torch.zeros(len(IMAGE_SUM_KEYS), dtype=torch.float64))


@pytest.mark.parametrize("cls", [CALSALMLoss, CALSHRLoss])
def test_two_halves_equal_one_pass(cls):
    # What torch.distributed does: each process streams its share, the sums are added before the
    # rule. Two criteria on two halves, summed, equal one criterion streaming both halves
    # (exactly: the same additions in the same order), and a one-shot pass up to rounding.
    logits, target = _seg_batch(2)
    halves = [(logits[:3], target[:3]), (logits[3:], target[3:])]
    make = lambda: cls(K, ignore_index=IGN, margin="auto", margin_patience=0)  # noqa: E731
    one, a, b, shot = make(), make(), make(), make()
    for half in halves:
        one.observe(*half)
    a.observe(*halves[0])
    b.observe(*halves[1])
    shot.observe(logits, target)
    for name, value in a.statistics().items():
        value.add_(b.statistics()[name])  # the all-reduce
        assert torch.equal(value, one.statistics()[name]), name
        torch.testing.assert_close(value, shot.statistics()[name], rtol=1e-12, atol=0)
    assert a.update_multipliers(0) == one.update_multipliers(0)
    assert torch.equal(a.state_fingerprint(), one.state_fingerprint())


def _planted(conf: float, correct: int, n: int = 200, k: int = 10, seed: int = 0):
    """Classification validation logits where every sample has confidence ``conf`` (all gaps
    ``log(K - 1) + logit(conf)``), balanced classes, and exactly ``correct`` right."""
    g = torch.Generator().manual_seed(seed)
    top = torch.arange(n) % k
    logits = torch.nn.functional.one_hot(top, k).double() * (
        math.log(k - 1) + math.log(conf / (1 - conf)))
    target = top.clone()
    wrong = torch.randperm(n, generator=g)[: n - correct]
    target[wrong] = (top[wrong] + 1) % k
    return logits, target


@pytest.mark.parametrize("cls", [CALSALMLoss, CALSHRLoss])
def test_planted_noise_keeps_the_margin(cls):
    # 200 validation images at confidence 0.8 and accuracy 0.78 ... 0.82: the gap (at most 0.02)
    # is inside its noise (z se = 2 * 0.4 / sqrt(200) = 0.057). The margin stays, on a plateau
    # (no learning) with no learning window either; the previous rule moved it every epoch.
    crit = cls(10, margin="auto", margin_patience=0)
    for epoch, correct in enumerate([156, 164, 158, 162, 160, 157, 163]):
        logits, target = _planted(0.8, correct, seed=epoch)
        crit.observe(logits, target)
        logs = crit.update_multipliers(epoch)
        assert logs["margin_reason"] == "calibrated within noise"
        assert logs["margin_t_low"] <= 1 <= logs["margin_t_high"]
        assert abs(logs["margin_gap"]) <= 2 * logs["margin_gap_se"]
        assert logs["margin"] == crit.margin == 10.0
        t_hat = logs["margin_temperature"]
        if correct != 160:  # the previous rule would have moved
            assert next_margin(10.0, t_hat, 40.0, 1.0, 20.0, 1.25) != 10.0


@pytest.mark.parametrize("cls", [CALSALMLoss, CALSHRLoss])
def test_clear_over_and_under_confidence_move_within_three_epochs(cls):
    # Default settings. Over-confident (confidence 0.99, accuracy 0.8, 200 images), not
    # learning: held for the first two epochs (the learning window), down on the third.
    crit = cls(10, margin="auto")
    reasons = []
    for epoch in range(3):
        crit.observe(*_planted(0.99, 160, seed=epoch))
        logs = crit.update_multipliers(epoch)
        reasons.append(logs["margin_reason"])
        assert logs["margin_t_low"] > 1
    assert reasons == ["still learning", "still learning", "over-confident"]
    assert crit.margin == 8.0  # down, at the rate
    # Under-confident (confidence 0.5, accuracy 0.9): up from the first epoch, learning or not.
    crit = cls(10, margin="auto", margin_init=1.5)
    crit.observe(*_planted(0.5, 180))
    logs = crit.update_multipliers(0)
    assert logs["margin_t_high"] < 1 and logs["margin_reason"] == "under-confident"
    assert crit.margin == 1.5 * 1.25
    # A margin above every validation gap is inert: an under-confident network keeps it.
    crit = cls(10, margin="auto")
    crit.observe(*_planted(0.5, 180))
    logs = crit.update_multipliers(0)
    assert logs["margin_reason"] == "under-confident, at a bound" and crit.margin == 10.0


def test_still_learning_holds_down_moves():
    # An over-confident network whose validation accuracy rises 0.5 -> 0.9 by 0.1 per epoch
    # (beyond the noise of a 2-epoch rise, about 0.08-0.1): the margin is held; once the
    # accuracy stays at 0.9 it comes down as soon as the 2-epoch rise is within its noise.
    crit = CALSALMLoss(10, margin="auto")
    accs = [100, 120, 140, 160, 180, 180, 180]
    margins, reasons = [], []
    for epoch, correct in enumerate(accs):
        crit.observe(*_planted(0.995, correct, seed=epoch))
        logs = crit.update_multipliers(epoch)
        margins.append(logs["margin"])
        reasons.append(logs["margin_reason"])
        if logs["margin_acc_rise"] is not None:
            past = accs[epoch - 2] / 200
            assert logs["margin_acc_rise"] == pytest.approx(correct / 200 - past, abs=1e-12)
            se = lambda p: math.sqrt(p * (1 - p) / 199)  # noqa: E731
            assert logs["margin_acc_noise"] == pytest.approx(
                2 * math.hypot(se(correct / 200), se(past)), rel=1e-9)
    assert reasons[:6] == ["still learning"] * 6 and margins[:6] == [10.0] * 6
    assert reasons[6] == "over-confident" and margins[6] == 8.0
    # The same accuracies with an under-confident network: the margin grows meanwhile.
    crit = CALSALMLoss(10, margin="auto", margin_init=1.5)
    crit.observe(*_planted(0.5, 120))
    crit.update_multipliers(0)
    crit.observe(*_planted(0.5, 160))
    assert crit.update_multipliers(1)["margin_reason"] == "under-confident"
    assert crit.margin > 1.5 * 1.25
    # The rule by hand: rise 0.1 against noise 2 sqrt(0.03^2 + 0.04^2) = 0.1 is not beyond it.
    assert still_learning(0.9, 0.03, [(0.8, 0.04), (0.85, 0.0)], 2, 2.0) == (
        False, pytest.approx(0.1), pytest.approx(0.1))
    assert still_learning(0.9, 0.03, [(0.7, 0.04)], 1, 2.0)[0] is True
    assert still_learning(0.9, 0.03, [(0.7, 0.04)], 2, 2.0) == (True, None, None)
    assert still_learning(0.9, 0.03, [], 0, 2.0) == (False, None, None)


def test_balanced_skill_lets_a_segmentation_network_pass():
    # 90% background; the network gets 95% of the background and half of each of the four
    # foreground classes: pixel accuracy 0.905 is barely above the majority rate (old skill
    # 0.05 < 0.1, gate closed), the balanced accuracy (0.95 + 4 * 0.5) / 5 = 0.59 is far above
    # its chance 1/5 (skill 0.4875).
    counts = torch.tensor([9000.0, 250.0, 250.0, 250.0, 250.0], dtype=torch.float64)
    right = torch.tensor([8550.0, 125.0, 125.0, 125.0, 125.0], dtype=torch.float64)
    assert beyond_chance(float(right.sum()), counts, 0.1)[0] is False
    skill, excess, noise = balanced_skill(right, counts)
    assert excess == pytest.approx(0.59 - 0.2, rel=1e-12)
    assert skill == pytest.approx(0.39 / 0.8, rel=1e-12)
    assert noise == pytest.approx(3 * math.sqrt(0.2 * 0.8 * (1 / 9000 + 4 / 250)) / 5, rel=1e-12)
    # The background predicted everywhere: balanced accuracy 1/5, skill 0.
    assert balanced_skill(torch.tensor([9000.0, 0, 0, 0, 0], dtype=torch.float64), counts)[0] == 0
    # Absent classes do not count; one class present: nothing to learn.
    assert balanced_skill(torch.tensor([5.0, 0, 0]), torch.tensor([10.0, 0, 10.0]))[0] == (
        pytest.approx((0.25 - 0.5) / 0.5))
    assert balanced_skill(torch.tensor([5.0, 0.0]), torch.tensor([5.0, 0.0])) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no validation position"):
        balanced_skill(torch.zeros(2), torch.zeros(2))


def test_evidence_step_by_hand():
    # (margin, T_lo, T_hi, G, learning) -> (margin, reason); range [1, 20], rate 1.25.
    step = lambda *a: evidence_step(*a, 1.0, 20.0, 1.25)  # noqa: E731
    assert step(10.0, 0.9, 1.2, 40.0, False) == (10.0, "calibrated within noise")
    assert step(10.0, 1.1, 1.3, 40.0, True) == (10.0, "still learning")
    assert step(10.0, 1.1, 1.3, 40.0, False) == (pytest.approx(10 / 1.1), "over-confident")
    assert step(10.0, 3.0, 4.0, 40.0, False) == (8.0, "over-confident")
    assert step(10.0, 1.05, 2.0, 9.0, False) == (9.0, "over-confident")  # down to G
    assert step(10.0, 0.5, 0.9, 40.0, True) == (pytest.approx(10 / 0.9), "under-confident")
    assert step(10.0, 0.5, 0.7, 40.0, True) == (12.5, "under-confident")  # learning: up is fine
    assert step(10.0, 0.5, 0.9, 11.0, False) == (11.0, "under-confident")
    assert step(10.0, 0.5, 0.9, 3.0, False) == (10.0, "under-confident, at a bound")  # inert
    assert step(1.0, 2.0, 3.0, 40.0, False) == (1.0, "over-confident, at a bound")


# ----------------------------------------------------------------------------- issue 49: say when
# a margin penalty cannot help (the validation temperature's interval below 1)

_ENDS = (0.1, 0.5, 0.9, 0.99, 1.0, 1.01, 1.2, 4.0)
INTERVALS = [(lo, hi) for lo in _ENDS for hi in _ENDS if lo <= hi]


@pytest.mark.parametrize("family", ["segmentation", "classification"])
@pytest.mark.parametrize(("lo", "hi"), INTERVALS)
def test_advice_only_when_the_interval_lies_below_one(lo, hi, family):
    from cals_seg.evaluation.confidence_regime import confidence_advice, under_confidence

    t = math.sqrt(lo * hi)
    line = confidence_advice(t, (lo, hi), run="runs/my run", family=family)
    record = under_confidence(t, (lo, hi), run="runs/my run", family=family)
    if hi < 1:
        assert line is not None and "\n" not in line, line
        assert "only lowers confidence" in line and f"[{lo:.2f}, {hi:.2f}]" in line
        if family == "segmentation":  # the command, runnable as printed (the path quoted)
            assert line.endswith(
                "python tools/eval_seg.py 'runs/my run' --calibrators ts boundary_ts")
        else:
            assert "temperature scaling" in line and "eval_seg" not in line
        assert record == {"T": t, "T_interval": [lo, hi], "advice": line}
        assert json.loads(json.dumps(record)) == record
    else:
        assert line is None and record is None


@pytest.mark.parametrize(("conf", "correct", "below"), [
    (0.5, 180, True),     # confidence 0.5, accuracy 0.9: clearly under-confident
    (0.6, 150, True),     # 0.6 against 0.75
    (0.8, 160, False),    # calibrated
    (0.8, 166, False),    # within the noise of 200 images
    (0.99, 160, False),   # over-confident
])
def test_validation_temperature_is_the_rules_interval_on_planted_values(conf, correct, below):
    from cals_seg.evaluation.confidence_regime import ValidationTemperature

    logits, target = _planted(conf, correct)
    evidence = ValidationTemperature(10)
    for part in range(0, 200, 64):  # in batches, as a loader gives them
        evidence.update(logits[part:part + 64].float(), target[part:part + 64])
    t_hat, (lo, hi) = evidence.compute()
    rule = CALSALMLoss(10, margin="auto", margin_patience=0)
    rule.observe(logits.float(), target)
    logs = rule.update_multipliers(0)
    assert t_hat == pytest.approx(logs["margin_temperature"], rel=1e-9)
    assert (lo, hi) == pytest.approx((logs["margin_t_low"], logs["margin_t_high"]), rel=1e-9)
    assert (hi < 1) == below


def test_validation_temperature_on_segmentation_batches_with_void():
    # images as the sampling unit, void pixels left out: the same numbers as the rule's
    from cals_seg.evaluation.confidence_regime import ValidationTemperature

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, K, 5, 7, generator=g) * 3
    target = torch.randint(0, K, (6, 5, 7), generator=g)
    target[:, 0, :] = IGN
    evidence = ValidationTemperature(K, IGN)
    evidence.update(logits[:4], target[:4])
    evidence.update(logits[4:], target[4:])
    rule = CALSALMLoss(K, ignore_index=IGN, margin="auto", margin_patience=0)
    rule.observe(logits, target)
    logs = rule.update_multipliers(0)
    t_hat, (lo, hi) = evidence.compute()
    assert t_hat == pytest.approx(logs["margin_temperature"], rel=1e-9)
    assert (lo, hi) == pytest.approx((logs["margin_t_low"], logs["margin_t_high"]), rel=1e-9)
    assert ValidationTemperature(K, IGN).compute() is None  # nothing seen


@pytest.mark.parametrize(("conf", "correct", "below"), [(0.5, 180, True), (0.99, 160, False),
                                                        (0.8, 160, False)])
def test_planted_network_gets_the_line_only_when_under_confident(conf, correct, below):
    # The trainer's check at the end of a run, on a planted network whose outputs are the
    # planted logits (the identity on its inputs), through the evaluation pass it uses.
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from cals_seg.evaluation.stream import Inference
    from cals_seg.training.trainer import _under_confidence

    logits, target = _planted(conf, correct)
    loader = DataLoader(TensorDataset(logits.float(), target), batch_size=32)
    infer = Inference(torch.nn.Identity(), torch.device("cpu"))
    for family in ("segmentation", "classification"):
        task = SimpleNamespace(num_classes=10, ignore_index=-100, family=family)
        record = _under_confidence(SimpleNamespace(path="runs/planted"), infer, task, loader,
                                   False)
        assert (record is not None) == below
        if below:
            assert record["T_interval"][1] < 1 and record["T"] < 1
            assert ("tools/eval_seg.py runs/planted" in record["advice"]) == (
                family == "segmentation")


@pytest.mark.parametrize("interval", [(0.5, 0.8), (0.9, 1.1), (1.2, 1.5)])
def test_training_prints_the_line_and_writes_it_only_when_under_confident(
        tmp_path, monkeypatch, capsys, interval):
    # A planted run: a one-epoch training of the shipped classification setup whose validation
    # temperature interval is planted; the line is printed once the run is tested, and is in
    # test_metrics.json, exactly when the interval lies below 1.
    from cals_seg.evaluation import confidence_regime

    monkeypatch.setattr(confidence_regime.ValidationTemperature, "compute",
                        lambda self: (math.sqrt(interval[0] * interval[1]), interval))
    small = {"max_train": 30, "min_train": 3, "num_val": 2, "num_test": 2, "image_size": 16}
    code = load_tool("train_cls").main([
        str(ROOT / "configs" / "synthetic_cls.yaml"), "--method", "ce", "--set", "name=planted",
        f"output_dir={tmp_path / 'runs'}", f"data.root={tmp_path / 'data'}", "train.epochs=1",
        f"data.synthetic={json.dumps(small)}", "data.image_size=16", "train.batch_size=32",
        "eval.batch_size=64", "train.amp=none", "train.progress=false", "train.threads=1",
    ])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    metrics = json.loads((tmp_path / "runs" / "planted" / "test_metrics.json").read_text())
    said = [line for line in lines if "only lowers confidence" in line]
    if interval[1] < 1:
        # training's last line, after the test and the run directory
        last_epoch = max(i for i, line in enumerate(lines) if line.startswith("epoch "))
        assert len(said) == 1 and lines[-1] == said[0] and last_epoch < len(lines) - 1, lines
        assert lines[-2].startswith("run directory: ")
        assert metrics["under_confident"]["T_interval"] == list(interval)
        assert metrics["under_confident"]["advice"] == said[0]
    else:
        assert not said and "under_confident" not in metrics
