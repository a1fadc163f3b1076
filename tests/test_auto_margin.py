"""``margin: auto``: its statistics against a float64 loop, the temperature solve by hand, the
update rule, and that checkpoints carry the margin (the 2-process case is in
test_losses_distributed.py)."""

from __future__ import annotations

import math

import pytest
import torch

from cals_seg.losses import CALSALMLoss, CALSHRLoss, MbLSLoss, build_loss
from cals_seg.losses._auto_margin import (
    BIN_WIDTH,
    NUM_BINS,
    T_RANGE,
    effective_margin_sums,
    largest_gap_bound,
    mean_confidence,
    solve_temperature,
)

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
    crit = cls(K, ignore_index=IGN, margin="auto", margin_init=8.0, margin_max=12.0)
    # Over-confident: gaps of 9 (confidence 0.9995) on 70%-accurate pixels.
    crit.observe(*_batch(9.0, 0.3))
    stats = crit.update_multipliers(0)
    t_hat = stats["margin_temperature"]
    assert t_hat > 1
    assert stats["margin"] == pytest.approx(8.0 / t_hat, rel=1e-12) == crit.margin
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
    # ... and up to the largest gap (inert) when that is smaller.
    crit.observe(*_batch(3.0, 0.0))
    stats = crit.update_multipliers(4)
    assert stats["margin_ceiling"] == pytest.approx(3.05)
    assert crit.margin == stats["margin_ceiling"]


def test_warmup_keeps_the_initial_margin():
    crit = CALSALMLoss(K, ignore_index=IGN, margin="auto", margin_init=6.0, margin_warmup=2)
    for epoch in range(3):
        crit.observe(*_batch(9.0, 0.3))
        stats = crit.update_multipliers(epoch)
        assert stats["margin"] == (6.0 if epoch < 2 else pytest.approx(6.0 / stats[
            "margin_temperature"]))


def test_the_margin_in_force_is_what_the_penalty_uses():
    logits, target = _batch(9.0, 0.3)
    logits.requires_grad_(True)
    auto = CALSALMLoss(K, ignore_index=IGN, margin="auto", margin_init=8.0)
    auto.observe(logits.detach(), target)
    auto.update_multipliers(0)
    fixed = CALSALMLoss(K, ignore_index=IGN, margin=auto.margin)
    fixed.load_state_dict({k: v for k, v in auto.state_dict().items() if k != "margin_value"})
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

    straight = run(CALSALMLoss(K, ignore_index=IGN, margin="auto"), range(4))
    first = CALSALMLoss(K, ignore_index=IGN, margin="auto")
    head = run(first, range(2))
    resumed = CALSALMLoss(K, ignore_index=IGN, margin="auto")
    resumed.load_state_dict(first.state_dict())
    assert resumed.margin == first.margin
    assert head + run(resumed, range(2, 4)) == straight
    assert len(set(straight)) == 4


def test_bad_auto_parameters_are_refused():
    with pytest.raises(ValueError, match="'auto'"):
        build_loss("cals_alm", K, margin="adaptive")
    with pytest.raises(ValueError, match="margin_min <= margin_init <= margin_max"):
        build_loss("cals_alm", K, margin="auto", margin_init=30.0)
    with pytest.raises(ValueError, match="margin_warmup"):
        build_loss("cals_hr", K, margin="auto", margin_warmup=-1)
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
    crit = build_loss("cals_alm", K, margin="auto", margin_init=8.0)
    crit.observe(logits, target)
    stats = crit.update_multipliers(0)
    assert stats["margin_temperature"] > 1 and stats["margin"] < 8.0
