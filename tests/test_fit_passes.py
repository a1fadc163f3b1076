"""A fit's repeated passes over one loader inside an evaluation (``LogitCache.replay``, through
``stream.predict``): after one complete pass held within the budget, later passes read no
sample and run no network, and give the very tensors a new pass gives; a pass stopped early or
over the budget is not held; another network, or no cache, streams again. Generated cases:
split sizes, batch sizes (ragged last batch), mixed image sizes, budgets around the exact size
needed. And a calibrator fitted with the passes replayed equals the same fit streamed."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from cals_seg.evaluation.logit_cache import logit_cache
from cals_seg.evaluation.stream import evaluation_loader, predict

K = 5
CPU = torch.device("cpu")


class Counted(Dataset):
    """``n`` generated ``(image (3, s, s), label)`` samples; ``reads`` counts ``__getitem__``."""

    def __init__(self, n: int, seed: int, sides: tuple[int, ...] = (4,)) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [(torch.randn(3, sides[i % len(sides)], sides[i % len(sides)], generator=g),
                       int(torch.randint(0, K, (), generator=g))) for i in range(n)]
        self.reads = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        self.reads += 1
        image, label = self.items[i]
        return image.clone(), label


class Net(nn.Module):
    """Pooled features to K logits; ``calls`` counts the images it runs on."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(3, K)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += x.shape[0]
        return self.head(x.mean(dim=(2, 3)) * 3.0)


def _pass(net, loader, with_inputs=True, stop_after=None):
    out = []
    for i, batch in enumerate(predict(net, loader, CPU, with_inputs=with_inputs)):
        if stop_after is not None and i == stop_after:
            break
        out.append(batch)
    return out


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        for s, t in zip(x, y, strict=True):
            assert s.dtype == t.dtype and torch.equal(s, t)


def _bytes(batches) -> int:
    return sum(t.numel() * t.element_size() for b in batches for t in b)


CASES = list(itertools.product([1, 7, 12], [1, 3, 5], [(4,), (4, 6)]))


@pytest.mark.parametrize(("n", "batch", "sides"), CASES)
def test_later_passes_are_served_from_memory_and_equal_a_new_pass(n, batch, sides):
    data = Counted(n, seed=n * 10 + batch, sides=sides)
    loader = evaluation_loader(data, batch)
    net = Net(seed=batch)
    want = _pass(net, loader)  # no cache: the reference
    assert data.reads == n and net.calls == n
    logits_bytes = n * K * 4

    data.reads = net.calls = 0
    with logit_cache() as cache:
        first = _pass(net, loader)
        assert data.reads == n and net.calls == n
        for _ in range(3):
            again = _pass(net, loader)
            _same(again, want)
            for logits, target, image in again:  # a consumer that works in place
                logits.mul_(-7.0)
                target.fill_(99)
                image.zero_()
        _same(_pass(net, loader, with_inputs=False), [b[:2] for b in want])
        assert data.reads == n and net.calls == n  # read and run once in all
        assert cache.stats["served"] == 4 * n and cache.stats["forwarded"] == n
        assert cache.held_bytes == logits_bytes + _bytes(want)
        _same(first, want)
        # another network: a pass of its own, then held for it too
        other = Net(seed=batch + 100)
        _same(_pass(other, loader), _pass(other, loader))
        assert data.reads == 2 * n and other.calls == n

    # a pass stopped early is not held: the next one streams (and is held)
    data.reads = net.calls = 0
    with logit_cache():
        _pass(net, loader, stop_after=len(want) - 1)  # all but the last piece taken
        stopped = data.reads
        assert stopped > 0
        _same(_pass(net, loader), want)
        _same(_pass(net, loader), want)
        assert data.reads == stopped + n


@pytest.mark.parametrize(("n", "batch"), [(7, 3), (12, 5), (1, 1)])
def test_the_budget_bounds_what_is_held(n, batch):
    data = Counted(n, seed=n + batch)
    loader = evaluation_loader(data, batch)
    net = Net(seed=0)
    want = _pass(net, loader)
    needed = n * K * 4 + _bytes(want)  # the images' logits, then the pass
    for budget, held in [(needed, True), (needed - 1, False), (0, False)]:
        data.reads = 0
        with logit_cache(budget) as cache:
            for _ in range(3):
                _same(_pass(net, loader), want)
            assert cache.held_bytes <= budget
        assert data.reads == (n if held else 3 * n), (budget, needed)


def test_a_fit_on_replayed_passes_equals_the_streamed_fit():
    """``vector`` (full-batch L-BFGS, one pass per iteration) fitted inside a cache block reads
    the split once and ends bit for bit where the streamed fit ends."""
    from cals_seg.calibrators import build_calibrator

    data = Counted(40, seed=3)
    loader = evaluation_loader(data, 8)
    net = Net(seed=3)
    fitted = []
    for cached in (False, True):
        data.reads = 0
        calibrator = build_calibrator("vector", K, max_iter=12)
        with logit_cache() if cached else torch.no_grad():
            calibrator.fit(lambda: predict(net, loader, CPU, with_inputs=True))
        fitted.append((calibrator.state_dict(), data.reads))
    (streamed, reads_streamed), (replayed, reads_replayed) = fitted
    assert reads_streamed > 2 * 40 and reads_replayed == 40
    assert streamed.keys() == replayed.keys()
    for key in streamed:
        assert torch.equal(streamed[key], replayed[key]), key
