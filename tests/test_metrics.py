"""Tests for the streaming meters against independent loop / sort-based float64 references.

The references below re-derive every metric from docs/design.md, "Metrics", with numpy in float64.
Their only shared input with the meters is the probability tensor, ``torch.softmax`` of the
float32 logits (the meters' documented definition of ``p``); binning, sums, the adaptive
ECE's sort, NLL (float64 log-softmax of the logits) and IoU are recomputed from scratch.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from cals_seg.metrics import CalibrationMeter, SegmentationMeter

VOID = 255


# ------------------------------------------------------------------------------- references


def _flatten(logits: torch.Tensor, target: torch.Tensor, ignore_index: int):
    """Class-last float64 arrays of the valid positions, plus each position's image index."""
    n, k = logits.shape[:2]
    lx = logits if logits.dtype == torch.float64 else logits.float()
    p = torch.softmax(lx, dim=1).double().numpy()
    p = np.moveaxis(p.reshape(n, k, -1), 1, 2).reshape(-1, k)
    l64 = np.moveaxis(lx.double().numpy().reshape(n, k, -1), 1, 2).reshape(-1, k)
    y = target.reshape(-1).numpy().astype(np.int64)
    image = np.repeat(np.arange(n), y.size // max(n, 1))
    keep = y != ignore_index
    return p[keep], l64[keep], y[keep], image[keep]


def _bin_of(x: np.ndarray, n_bins: int) -> np.ndarray:
    """The bin of each value: b with x in (b/n, (b+1)/n], 0 in the first bin; that is, the
    number of inner edges b/n (b = 1 .. n-1, float64) strictly below x."""
    edges = np.array([b / n_bins for b in range(1, n_bins)])
    return np.searchsorted(edges, x, side="left")


def _ref_ece(conf: np.ndarray, hit: np.ndarray, n_bins: int) -> tuple[float, float]:
    """(ECE, MCE) with a loop over the bins (each value's bin found once, its sums per bin)."""
    m, ece, mce = len(conf), 0.0, 0.0
    b = _bin_of(conf, n_bins)
    count = np.bincount(b, minlength=n_bins)
    hits = np.bincount(b, weights=hit, minlength=n_bins)
    confs = np.bincount(b, weights=conf, minlength=n_bins)
    for i in range(n_bins):
        if count[i]:
            gap = abs(hits[i] / count[i] - confs[i] / count[i])
            ece += count[i] / m * gap
            mce = max(mce, gap)
    return float(ece), float(mce)


def _ref_aece(conf: np.ndarray, hit: np.ndarray, n_bins: int) -> float:
    """Exact adaptive ECE: stable sort, numpy.array_split into n_bins bins."""
    order = np.argsort(conf, kind="stable")
    total = 0.0
    for part in np.array_split(order, n_bins):
        if len(part):
            total += abs(hit[part].sum() - conf[part].sum())
    return total / len(conf)


def _ref_metrics(p, l64, y, n_bins: int) -> dict:
    m, k = p.shape
    pred = l64.argmax(axis=1)
    conf = p[np.arange(m), pred]
    hit = (pred == y).astype(np.float64)
    ece, mce = _ref_ece(conf, hit, n_bins)
    shifted = l64 - l64.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    onehot = np.eye(k)[y]
    classwise = [_ref_ece(p[:, c], onehot[:, c], n_bins)[0] for c in range(k)]
    return {
        "count": m,
        "ece": ece,
        "mce": mce,
        "aece": _ref_aece(conf, hit, n_bins),
        "cwce": float(np.mean(classwise)),
        "classwise_ece": classwise,
        "nll": float(-log_softmax[np.arange(m), y].mean()),
        "brier": float(((p - onehot) ** 2).sum(axis=1).mean()),
        "acc": float(hit.mean()),
        "conf": float(conf.mean()),
    }


def reference_calibration(logits, target, n_bins=15, ignore_index=VOID, per_image=True) -> dict:
    p, l64, y, image = _flatten(logits, target, ignore_index)
    out = _ref_metrics(p, l64, y, n_bins)
    if per_image:
        rows = [
            _ref_metrics(p[image == i], l64[image == i], y[image == i], n_bins)
            for i in range(logits.shape[0])
            if (image == i).any()
        ]
        out["num_images"] = len(rows)
        for key in ("ece", "mce", "acc", "nll", "brier", "cwce"):
            out[f"{key}_image_mean"] = float(np.mean([r[key] for r in rows]))
    return out


def reference_segmentation(pred: np.ndarray, y: np.ndarray, k: int, ignore_index=VOID) -> dict:
    keep = y != ignore_index
    pred, y = pred[keep], y[keep]
    iou, class_acc = [], []
    for c in range(k):
        tp = np.sum((pred == c) & (y == c))
        union = np.sum((pred == c) | (y == c))
        iou.append(tp / union if union else None)
        class_acc.append(tp / np.sum(y == c) if np.sum(y == c) else None)
    present = [v for v in iou if v is not None]
    fg = [v for v in iou[1:] if v is not None]
    return {
        "miou": float(np.mean(present)),
        "miou_fg": float(np.mean(fg)),
        "iou_per_class": iou,
        "pixel_acc": float(np.mean(pred == y)),
        "mean_class_acc": float(np.mean([v for v in class_acc if v is not None])),
    }


def assert_close(got: dict, want: dict, rel: float = 1e-9, abs_: float = 0.0) -> None:
    """Every key of ``want`` is in ``got``; ints and None equal, floats (and lists) to rel."""
    for key, value in want.items():
        assert key in got, key
        if isinstance(value, dict):
            assert_close(got[key], value, rel, abs_)
        elif value is None or isinstance(value, int):
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=rel, abs=abs_ or None), key


# ------------------------------------------------------------------------------------ data


def make_batch(n=4, k=11, h=250, w=250, seed=0, void=0.1, saturated=0.0, near_one=0.0):
    """Logits that are informative on ~60% of the positions, with void (255) positions.

    ``saturated``: fraction of positions with a logit gap of 200 (softmax exactly 1.0 in
    float32). ``near_one``: fraction with a gap near 18 (confidences like 1 - 1e-7, many ties).
    """
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, k, (n, h, w), generator=g)
    logits = torch.randn(n, k, h, w, generator=g) * 2.0
    informative = torch.rand(n, 1, h, w, generator=g) < 0.6
    onehot = torch.nn.functional.one_hot(target, k).permute(0, 3, 1, 2).float()
    logits += 3.0 * onehot * informative
    u = torch.rand(n, h, w, generator=g)
    # The boosted class is the target 70% of the time.
    boosted = torch.where(torch.rand(n, h, w, generator=g) < 0.7, target,
                          torch.randint(0, k, (n, h, w), generator=g))
    boost = torch.nn.functional.one_hot(boosted, k).permute(0, 3, 1, 2).float()
    gap = torch.zeros(n, 1, h, w)
    gap[(u < saturated).unsqueeze(1)] = 200.0
    near = ((u >= saturated) & (u < saturated + near_one)).unsqueeze(1)
    gap[near] = 16.0 + 4.0 * torch.rand(int(near.sum()), generator=g)
    logits = torch.where(gap > 0, logits.clamp(-3, 3) + gap * boost, logits)
    target[torch.rand(n, h, w, generator=g) < void] = VOID
    return logits, target


def run_meter(logits, target, n_bins=15, classwise=True, chunks=1):
    meter = CalibrationMeter(logits.shape[1], n_bins=n_bins, ignore_index=VOID, classwise=classwise)
    for lc, tc in zip(logits.chunk(chunks), target.chunk(chunks), strict=True):
        meter.update(lc, tc)
    return meter.compute()


# ----------------------------------------------------------------------- hand-computed cases


def test_hand_computed_calibration():
    # c = .9 (right), .7 (wrong), .75 (right), .55 (wrong); 5 bins of width .2.
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.25, 0.75], [0.45, 0.55]])
    logits = probs.log().T.reshape(1, 2, 2, 2)
    target = torch.tensor([0, 1, 1, 0]).reshape(1, 2, 2)
    meter = CalibrationMeter(2, n_bins=5)
    meter.update(logits, target)
    out = meter.compute()
    tol = dict(abs=1e-6)
    # bins: .55 -> (.4,.6]; .7, .75 -> (.6,.8]; .9 -> (.8,1]
    assert out["ece"] == pytest.approx((0.55 + abs(1 - 1.45) + 0.1) / 4, **tol)  # 0.275
    assert out["mce"] == pytest.approx(0.55, **tol)
    assert out["acc"] == 0.5 and out["count"] == 4 and out["num_images"] == 1
    assert out["nll"] == pytest.approx(0.5988807721633288, **tol)
    assert out["brier"] == pytest.approx((0.02 + 0.98 + 0.125 + 0.605) / 4, **tol)
    # class 0: p0 = .9 .7 .25 .45 vs [1 0 0 1], each alone in a bin: (.1+.7+.25+.55)/4; same k=1
    assert out["cwce"] == pytest.approx(0.4, **tol)
    assert out["classwise_ece"] == pytest.approx([0.4, 0.4], **tol)
    # array_split(4, 5) = sizes 1,1,1,1,0: every sample alone -> mean |a - c| = 1.6 / 4
    assert out["aece"] == pytest.approx(0.4, **tol)
    assert out["ece_image_mean"] == pytest.approx(0.275, **tol)
    rel = out["reliability"]
    assert rel["bin_edges"] == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert rel["count"] == [0, 0, 1, 2, 1]
    assert rel["confidence"] == pytest.approx([0, 0, 0.55, 0.725, 0.9], **tol)
    assert rel["accuracy"] == [0.0, 0.0, 0.0, 0.5, 1.0]


def test_hand_computed_aece_with_two_bins():
    probs = torch.tensor([[0.9, 0.1], [0.7, 0.3], [0.25, 0.75], [0.45, 0.55]])
    meter = CalibrationMeter(2, n_bins=2)
    meter.update(probs.log(), torch.tensor([0, 1, 1, 0]))
    # sorted: .55(0) .7(0) | .75(1) .9(1): (|0 - 1.25| + |2 - 1.65|) / 4
    assert meter.compute()["aece"] == pytest.approx(0.4, abs=1e-6)


def test_hand_computed_segmentation():
    meter = SegmentationMeter(4, ignore_index=VOID)
    meter.update(torch.tensor([[0, 1, 1, 1, 0, 2]]), torch.tensor([[0, 0, 1, 1, 2, VOID]]))
    out = meter.compute()
    assert out["confusion"] == [[1, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert out["iou_per_class"][:3] == pytest.approx([1 / 3, 2 / 3, 0.0])
    assert out["iou_per_class"][3] is None  # class 3 never appears: excluded from the means
    assert out["miou"] == pytest.approx(1 / 3)
    assert out["miou_fg"] == pytest.approx(1 / 3)
    assert out["pixel_acc"] == pytest.approx(3 / 5)
    assert out["mean_class_acc"] == pytest.approx((1 / 2 + 1 + 0) / 3)
    assert out["class_acc"][3] is None and out["count"] == 5


# -------------------------------------------------------------------- random, 1e6 positions


@pytest.fixture(scope="module")
def big_batch():
    return make_batch(n=4, k=11, h=500, w=500)  # 1e6 positions (9e5 valid), 1.1e7 logits


def test_random_million_pixels_against_reference(big_batch):
    logits, target = big_batch
    out = run_meter(logits, target)
    want = reference_calibration(logits, target)
    aece = want.pop("aece")
    assert_close(out, want, rel=1e-9)
    assert abs(out["aece"] - aece) < 1e-4
    json.dumps(out, allow_nan=False)


def test_segmentation_million_pixels_against_reference(big_batch):
    logits, target = big_batch
    meter = SegmentationMeter(11, ignore_index=VOID)
    meter.update(logits, target)
    out = meter.compute()
    want = reference_segmentation(logits.argmax(1).numpy().ravel(), target.numpy().ravel(), 11)
    assert_close(out, want, rel=1e-9)
    assert out["count"] == int((target != VOID).sum())
    # Integer predictions give the same matrix as logits.
    again = SegmentationMeter(11, ignore_index=VOID)
    again.update(logits.argmax(1).to(torch.int32), target)
    assert again.compute() == out


@pytest.mark.parametrize(
    "saturated, near_one", [(0.4, 0.0), (0.0, 0.7), (0.4, 0.4)], ids=["exact-1", "1-1e-7", "both"]
)
def test_saturated_confidences(saturated, near_one):
    # 2.5e5 positions: about 3 position blocks of the meter (position_block: 23808 positions
    # of 4 x 11 logits), a third or more of them saturated or in the ties below 1
    logits, target = make_batch(n=4, k=11, h=250, w=250, seed=1, saturated=saturated,
                                near_one=near_one)
    p = torch.softmax(logits, dim=1).amax(dim=1)
    if saturated:
        assert (p == 1.0).float().mean() > 0.35  # really saturated in float32
    if near_one:
        tail = (p < 1.0) & (p > 1 - 1e-5)
        assert tail.float().mean() > near_one / 2 and len(torch.unique(p[tail])) < 200  # ties
    out = run_meter(logits, target)
    want = reference_calibration(logits, target, per_image=False)
    aece = want.pop("aece")
    assert_close(out, want, rel=1e-9)
    assert abs(out["aece"] - aece) < 1e-4
    assert out["reliability"]["count"][-1] > 0.35 * out["count"]


def test_aece_error_is_small_on_a_calibrated_sample(n_bins=15):
    # Labels drawn from the softmax: acc - conf changes sign from bin to bin, so the errors of
    # the pro-rata split at the cuts do not cancel as they do when every bin is over-confident.
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1_000_000, 5, generator=g) * 3
    target = torch.multinomial(torch.softmax(logits, 1), 1, generator=g).squeeze(1)
    meter = CalibrationMeter(5, n_bins=n_bins, classwise=False)
    # one image of 1e6 positions: the adaptive ECE of the 1e6 items (N, K) as one image, without
    # the per-image means of 1e6 one-position images (10x the time, test_no_spatial_dims_...)
    meter.update(logits.T[None], target[None])
    p, l64, y, _ = _flatten(logits, target, -100)
    pred = l64.argmax(1)
    exact = _ref_aece(p[np.arange(len(y)), pred], (pred == y).astype(float), n_bins)
    assert abs(meter.compute()["aece"] - exact) < 1e-4  # measured: 6.4e-6


# ------------------------------------------------------------------------ invariances


def test_void_positions_change_nothing():
    logits, target = make_batch(n=3, k=5, h=40, w=40, seed=2, void=0.3)
    target[1] = VOID  # an image with no valid position is skipped by the per-image means
    changed = logits.clone()
    void = (target == VOID).unsqueeze(1).expand_as(logits)
    changed[void] = torch.randn(int(void.sum())) * 100
    out = run_meter(logits, target)
    assert run_meter(changed, target) == out
    assert out["num_images"] == 2
    assert_close(out, reference_calibration(logits, target), rel=1e-9, abs_=1e-12)
    seg_a, seg_b = SegmentationMeter(5, VOID), SegmentationMeter(5, VOID)
    seg_a.update(logits, target)
    seg_b.update(changed, target)
    assert seg_a.compute() == seg_b.compute()


def test_streaming_equals_one_shot():
    logits, target = make_batch(n=8, k=6, h=48, w=40, seed=4)
    one = run_meter(logits, target)
    many = CalibrationMeter(6, ignore_index=VOID)
    seg_one, seg_many = SegmentationMeter(6, VOID), SegmentationMeter(6, VOID)
    seg_one.update(logits, target)
    for sl in (slice(0, 1), slice(1, 4), slice(4, 5), slice(5, 8)):
        many.update(logits[sl], target[sl])
        seg_many.update(logits[sl], target[sl])
    assert_close(many.compute(), one, rel=1e-12)
    assert seg_many.compute() == seg_one.compute()


def test_no_spatial_dims_equals_one_by_one():
    g = torch.Generator().manual_seed(5)
    logits, target = torch.randn(300, 7, generator=g) * 3, torch.randint(0, 7, (300,), generator=g)
    target[:10] = VOID
    a, b = run_meter(logits, target), run_meter(logits[:, :, None, None], target[:, None, None])
    assert a == b
    assert a["num_images"] == 290  # each of the N items is one image
    assert_close(a, reference_calibration(logits, target), rel=1e-9, abs_=1e-12)
    c = run_meter(logits[:, :, None], target[:, None])  # one spatial dim
    d = run_meter(logits.T.reshape(1, 7, 10, 3, 10), target.reshape(1, 10, 3, 10))  # three
    assert c == a
    assert_close(d, reference_calibration(logits.T[None], target[None]), rel=1e-9, abs_=1e-12)


def test_low_precision_and_float64_logits():
    logits, target = make_batch(n=2, k=4, h=30, w=30, seed=6)
    for dtype in (torch.float16, torch.bfloat16):
        low = logits.to(dtype)
        assert run_meter(low, target) == run_meter(low.float(), target)
    out = run_meter(logits.double(), target)
    assert_close(out, reference_calibration(logits.double(), target), rel=1e-9, abs_=1e-12)


def test_counts_past_two_to_the_24_are_exact():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 2, 2**20, generator=g)
    target = torch.randint(0, 2, (1, 2**20), generator=g)
    once = run_meter(logits, target)
    meter = CalibrationMeter(2)
    seg = SegmentationMeter(2)
    for _ in range(17):
        meter.update(logits, target)
        seg.update(logits, target)
    out = meter.compute()
    assert out["count"] == 17 * 2**20 > 2**24
    assert out["reliability"]["count"] == [17 * c for c in once["reliability"]["count"]]
    assert out["acc"] == pytest.approx(once["acc"], rel=1e-12)
    for key in ("ece", "aece", "cwce", "nll", "brier", "mce"):
        assert out[key] == pytest.approx(once[key], rel=1e-12), key
    assert sum(map(sum, seg.compute()["confusion"])) == 17 * 2**20


# --------------------------------------------------------------- state, compute, bins


def test_state_size_is_fixed_and_matches_the_docstring():
    meter = CalibrationMeter(21, n_bins=15)
    before = {k: v.shape for k, v in meter.state_dict().items()}
    meter.update(torch.randn(2, 21, 64, 64), torch.randint(0, 21, (2, 64, 64)))
    assert {k: v.shape for k, v in meter.state_dict().items()} == before
    nbytes = sum(b.numel() * b.element_size() for b in meter.buffers())
    fine = meter.fine_count.numel()
    assert nbytes == 8 * (3 * 15 + 3 * fine + 9 + 2 * 21 * 15)
    assert all(b.dtype in (torch.int64, torch.float64) for b in meter.buffers())


def test_compute_twice_reset_state_dict_and_empty():
    logits, target = make_batch(n=2, k=3, h=20, w=20, seed=8)
    meter = CalibrationMeter(3, ignore_index=VOID)
    empty = meter.compute()
    assert empty["count"] == 0 and empty["ece"] is None and empty["ece_image_mean"] is None
    assert empty["reliability"]["count"] == [0] * 15
    json.dumps(empty, allow_nan=False)
    meter.update(logits[:1], target[:1])
    first = meter.compute()
    assert meter.compute() == first
    meter.update(logits[1:], target[1:])  # update continues after compute
    assert_close(meter.compute(), run_meter(logits, target), rel=1e-12)
    copy = CalibrationMeter(3, ignore_index=VOID)
    copy.load_state_dict(meter.state_dict())
    assert copy.compute() == meter.compute()
    meter.reset()
    assert meter.compute() == empty
    meter.update(logits[:0], target[:0])  # an empty batch is a no-op
    assert meter.compute() == empty
    seg = SegmentationMeter(3)
    assert seg.compute()["miou"] is None
    json.dumps(seg.compute(), allow_nan=False)


def test_classwise_false():
    logits, target = make_batch(n=2, k=3, h=20, w=20, seed=9)
    a, b = run_meter(logits, target, classwise=False), run_meter(logits, target)
    assert a["cwce"] is None and a["classwise_ece"] is None and a["cwce_image_mean"] is None
    for key in ("ece", "aece", "mce", "nll", "brier", "acc", "ece_image_mean", "reliability"):
        assert a[key] == b[key]


def test_bin_index_is_exact_at_the_edges():
    from cals_seg.metrics.functional import bin_index

    for n in (1, 3, 7, 10, 15, 100):
        for dtype, npt in ((torch.float32, np.float32), (torch.float64, np.float64)):
            values = {0.0, 1.0, float(np.finfo(npt).tiny)}
            for b in range(n + 1):
                v = npt(b / n)
                for x in (v, np.nextafter(v, npt(0)), np.nextafter(v, npt(2))):
                    if 0 <= x <= 1:
                        values.add(float(x))
            xs = sorted(values)
            got = bin_index(torch.tensor(xs, dtype=dtype), n).tolist()
            want = [min(max(math.ceil(Fraction(x) * n) - 1, 0), n - 1) for x in xs]
            assert got == want, (n, dtype)


def test_fine_histogram_cells_are_ordered_and_resolve_the_tail():
    from cals_seg.metrics.functional import NUM_FINE_CELLS, fine_cell

    g = torch.Generator().manual_seed(10)
    tail = 1 - torch.arange(0, 5000, dtype=torch.float64) * 2.0**-24
    xs = torch.cat([torch.rand(10000, generator=g).double(), tail]).float().sort().values
    cells = fine_cell(xs)
    assert bool((cells.diff() >= 0).all())
    assert cells.min() >= 0 and cells.max() == NUM_FINE_CELLS - 1  # 1.0 in the last cell
    top = xs >= 1 - 2.0**-12
    assert len(torch.unique(cells[top])) == len(torch.unique(xs[top]))  # one cell per float


# -------------------------------------------------------------------------------- errors


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"Expected `n_bins` to be a positive integer, but got 0"):
        CalibrationMeter(3, n_bins=0)
    with pytest.raises(ValueError, match="`n_bins`"):
        CalibrationMeter(3, n_bins=2.5)
    for cls in (CalibrationMeter, SegmentationMeter):
        with pytest.raises(ValueError, match=r"`num_classes` to be an integer >= 2, but got 1"):
            cls(1)
        with pytest.raises(ValueError, match="`num_classes`"):
            cls(True)
        with pytest.raises(ValueError, match="`ignore_index`"):
            cls(3, ignore_index=None)
    with pytest.raises(ValueError, match="`classwise`"):
        CalibrationMeter(3, classwise="yes")


@pytest.mark.parametrize("cls", [CalibrationMeter, SegmentationMeter])
def test_update_errors(cls):
    meter = cls(4, ignore_index=VOID)
    logits, target = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    with pytest.raises(ValueError, match=r"`target` of shape \(N, \*S\) = \(2, 3, 3\)"):
        meter.update(logits, target[:, :2])
    with pytest.raises(ValueError, match=r"`logits` of shape \(N, K=4, \*S\)"):
        meter.update(logits[:, :3], target)
    with pytest.raises(ValueError, match="integer tensor"):
        meter.update(logits, target.float())
    bad = target.clone()
    bad[0, 0, 0], bad[1, 1, 1], bad[1, 2, 2] = 4, -1, 4
    msg = r"\[0, 4\) or `ignore_index`=255, but got 3 positions with values \[-1, 4\]"
    with pytest.raises(ValueError, match=msg):
        meter.update(logits, bad)
    for value in (float("nan"), float("inf"), float("-inf")):
        x = logits.clone()
        x[0, 1, 0, 0] = x[1, 3, 2, 1] = value
        with pytest.raises(ValueError, match="finite, but got 2 non-finite values"):
            meter.update(x, target)
    if cls is CalibrationMeter:
        with pytest.raises(ValueError, match="floating point tensor"):
            meter.update(target.unsqueeze(1).expand(2, 4, 3, 3), target)
    else:
        with pytest.raises(ValueError, match=r"`preds` values in \[0, 4\)"):
            meter.update(target + 1, target)
        with pytest.raises(ValueError, match="integer class indices"):
            meter.update(target > 0, target)
    # Nothing was accumulated by the failed updates.
    assert meter.compute()["count"] == 0
