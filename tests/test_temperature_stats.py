"""The validation temperature (cals_seg.losses.temperature_stats): its statistics against float64
loops, the temperature solve by hand, the image-level interval; and the under-confidence hint
it feeds after training and evaluation (cals_seg.evaluation.confidence_regime). The
``margin: auto`` rule built on them is tested in test_contrib_auto_margin.py."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from cals_seg.losses.temperature_stats import (
    BIN_WIDTH,
    IMAGE_SUM_KEYS,
    NUM_BINS,
    T_RANGE,
    class_counts,
    effective_margin_sums,
    gap_and_accuracy,
    image_sums,
    largest_gap_bound,
    mean_confidence,
    solve_temperature,
    solve_temperature_at,
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


def test_class_counts_skip_void_positions():
    target = torch.tensor([[0, 2, 2, IGN], [1, IGN, 2, 0]])
    counts = class_counts(target, target != IGN, 4)
    assert counts.dtype == torch.float64 and counts.tolist() == [2.0, 1.0, 3.0, 0.0]


def _sums_of(n, c, a) -> torch.Tensor:
    """:func:`image_sums`'s vector from per-image pixel counts, confidence sums and correct
    counts (float64 lists), by its definition."""
    n, c, a = (torch.tensor(v, dtype=torch.float64) for v in (n, c, a))
    return torch.stack([torch.tensor(float(len(n)), dtype=torch.float64), n.sum(), c.sum(),
                        a.sum(), (n * n).sum(), (c * c).sum(), (a * a).sum(), (c * n).sum(),
                        (a * n).sum(), (c * a).sum()])


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


@pytest.mark.parametrize(("conf", "correct", "below"), [(0.5, 180, True), (0.99, 160, False),
                                                        (0.8, 160, False)])
def test_planted_network_gets_the_line_only_when_under_confident(conf, correct, below):
    # The trainer's check at the end of a run, on a planted network whose outputs are the
    # planted logits (the identity on its inputs), through the evaluation pass it uses.
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from cals_seg.evaluation.confidence_regime import measured_under_confidence
    from cals_seg.evaluation.stream import Inference

    logits, target = _planted(conf, correct)
    loader = DataLoader(TensorDataset(logits.float(), target), batch_size=32)
    infer = Inference(torch.nn.Identity(), torch.device("cpu"))
    for family in ("segmentation", "classification"):
        task = SimpleNamespace(num_classes=10, ignore_index=-100, family=family)
        record = measured_under_confidence(infer, loader, task.num_classes, task.ignore_index,
                                           "runs/planted", family)
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
