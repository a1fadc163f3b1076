"""One network call per distinct input: ``eval_seg RUN --calibrators ts boundary_ts --conformal
... --shift fog:1`` sends each distinct image (validation, test, each corrupted test image)
through the network once (counted inside the network's own forward), and its numbers equal
those of the same evaluation with the logit cache off (every consumer running the network)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from cals_seg.commands import eval_seg
from cals_seg.evaluation.logit_cache import LogitCache, cached_logits, image_digest, logit_cache
from tests.conftest import SEEN, assert_tree_close, copy_run

# The figures eval_seg writes are saved undrawn: these tests check numbers and file names.
pytestmark = pytest.mark.usefixtures("undrawn_figures")


@pytest.fixture(scope="module")
def run(imported_run, tmp_path_factory) -> Path:
    """This file's copy of the session's imported run (eval_seg saves its calibrators and
    conformal fits into the run): its network counts every image in ``SEEN``."""
    return copy_run(imported_run, tmp_path_factory.mktemp("run"))


OPTIONS = ["--calibrators", "ts", "boundary_ts", "--conformal", "alpha=0.5", "mode=risk,band",
           "--shift", "fog:1", "--num-maps", "2", "--refit-calibrators"]


def _evaluate(run: Path, out: Path, *extra: str) -> dict:
    SEEN.clear()
    code = eval_seg.main([str(run), "--out", str(out), *OPTIONS, *extra])
    assert code in (0, 1)
    return json.loads((out / "metrics.json").read_text())


def _numbers(metrics: dict) -> dict:
    """The metrics without what records how they were computed."""
    return {k: v for k, v in metrics.items() if k not in ("network_passes", "calibrator_fits")}


@pytest.fixture(scope="module")
def cached_evaluation(run, tmp_path_factory) -> tuple[dict, dict]:
    """``metrics.json`` of the evaluation with every option and the logit cache on, and the
    network calls of each distinct input image during it (shared by the two tests below)."""
    metrics = _evaluate(run, tmp_path_factory.mktemp("cached"))
    return metrics, dict(SEEN)


def test_each_distinct_input_goes_through_the_network_once(run, cached_evaluation, tmp_path):
    cached, calls = cached_evaluation
    assert calls and max(calls.values()) == 1, Counter(calls.values())
    passes = cached["network_passes"]
    assert passes["forwarded"] == len(calls) and passes["recomputed"] == 0
    assert passes["served"] > passes["forwarded"]  # the consumers that no longer run it

    plain = _evaluate(run, tmp_path / "plain", "--logit-cache-gb", "0")
    assert max(SEEN.values()) > 1  # without the cache the same images run several times
    assert set(SEEN) == set(calls)  # the same distinct inputs
    assert_tree_close(_numbers(cached), _numbers(plain), rel=1e-9, abs_=1e-12)


def test_budget_and_batches():
    """Generated batches: served from memory only when every image is held; a batch with a new
    image runs the network on the whole batch; the budget caps what is held."""
    net = nn.Conv2d(3, 2, 1)
    calls = []

    def compute(x):
        calls.append(len(x))
        return net(x)

    gen = torch.Generator().manual_seed(0)
    images = torch.randn(6, 3, 4, 4, generator=gen)
    per_image = 2 * 4 * 4 * 4  # K * H * W * float32 bytes
    for b in range(7):  # images the budget holds
        calls.clear()
        with torch.no_grad(), logit_cache(b * per_image) as cache:
            first = cached_logits(net, images, "p", lambda: compute(images))
            again = cached_logits(net, images, "p", lambda: compute(images))
            if b:
                head = images[:b]
                some = cached_logits(net, head, "p", lambda h=head: compute(h))
                torch.testing.assert_close(some, first[:b], rtol=0, atol=0)
            other = cached_logits(net, images[:2], "q", lambda: compute(images[:2]))
            want = net(images[:2])
        torch.testing.assert_close(first, again, rtol=0, atol=0)
        torch.testing.assert_close(other, want, rtol=0, atol=0)
        assert cache.held_bytes == b * per_image
        assert calls == [6] + ([] if b == 6 else [6]) + [2]
        assert cache.stats["served"] == (6 if b == 6 else 0) + b
    # outside a block, and with gradients on, nothing is held
    calls.clear()
    cached_logits(net, images, "p", lambda: compute(images))
    with logit_cache() as cache:
        cached_logits(net, images, "p", lambda: compute(images))
        assert cache.held_bytes == 0 and cache.stats["forwarded"] == 0
    assert calls == [6, 6]


def test_digest_tells_images_apart():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, 8, generator=gen)
    y = x.clone()
    y[2, 7, 7] = torch.nextafter(y[2, 7, 7], torch.tensor(float("inf")))
    assert image_digest(x) == image_digest(x.clone())
    assert image_digest(x) != image_digest(y)
    assert image_digest(x) != image_digest(x.double())
    assert image_digest(x) != image_digest(x.reshape(3, 4, 16))
    assert isinstance(LogitCache().stats, dict)


def test_the_consumers_of_the_test_pass_equal_their_own_passes(run, cached_evaluation):
    """The conformal sets and the clean entropy statistics measured inside the one test pass
    equal the same measured in a pass of their own (as eval_seg measured them before the
    engine): every number of ``metrics.json["conformal"]`` and the flag's clean rate."""
    from cals_seg.commands._conformal import parse_conformal
    from cals_seg.evaluation.conformal_eval import conformal_evaluation
    from cals_seg.evaluation.ood import MeanEntropy, flagged_rate
    from cals_seg.evaluation.shift import entropy_temperature
    from cals_seg.evaluation.stream import evaluate, run_loader
    from cals_seg.runs.run import load_run

    metrics, _ = cached_evaluation
    loaded = load_run(run, with_data=True, trust_code=True)
    spec = parse_conformal(OPTIONS[OPTIONS.index("--conformal") + 1:OPTIONS.index("--shift")])
    task = loaded.task
    own = conformal_evaluation(loaded, spec, task.val_set, task.test_set, loader=run_loader(loaded))
    numbers = ("risk", "coverage", "set_size", "multi", "coverage_band", "threshold",
               "calibration_images")
    for mode, result in own.items():
        for key in numbers:
            if key in result:
                assert metrics["conformal"][mode][key] == pytest.approx(result[key], rel=1e-12), \
                    (mode, key)
    ref = MeanEntropy(entropy_temperature(metrics))
    evaluate(loaded.model, run_loader(loaded)(task.test_set), loaded.device, [],
             loaded.precision, protocol=task.protocol, image_consumers=[ref])
    flag = metrics["entropy_flag"]
    assert flag["clean_rate"] == flagged_rate(ref.values, flag["limit_nats"])
