"""The adaptive-loss contract: what a loss declares is what the trainer relies on.

A loss that leaves out a declared piece is refused when it is built, on one process; a loss that
declares everything gets observe/update, reset, resume and the all-reduce for free, so a new loss
written in a few lines gives the same update on 2 processes as on one.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import Tensor

from cals_seg.losses import LOSSES, AdaptiveLoss, build_loss
from cals_seg.losses._functional import ce_sum

from ._dist import run_distributed

K, IGN = 3, 255


class MeanGapLoss(AdaptiveLoss):
    """A small adaptive loss written against the contract only: CE + w_k * mean gap, where
    ``w_k`` is set after each epoch to the mean validation probability of class k."""

    log_keys = ("weight",)

    def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
        super().__init__(num_classes, ignore_index)
        self.add_state("weights", torch.zeros(num_classes, dtype=torch.float64))
        self.add_statistic("_prob_sum", num_classes)

    def _forward(self, logits: Tensor, target: Tensor, valid: Tensor) -> Tensor:
        ce = ce_sum(logits, target, self.ignore_index) / valid.sum().clamp(min=1)
        gap = logits.amax(dim=1, keepdim=True) - logits  # (N, K, S)
        w = self.weights.to(logits.dtype).view(1, -1, 1)
        pen = (gap * w * valid.unsqueeze(1)).sum() / valid.sum().clamp(min=1)
        return ce + pen

    def _observe(self, logits: Tensor, target: Tensor, valid: Tensor) -> dict[str, Tensor]:
        p = logits.softmax(dim=1) * valid.unsqueeze(1)
        return {"_prob_sum": p.sum(dim=(0, 2)).to(torch.float64)}

    def _update(self, epoch: int, stats: dict[str, Tensor], n: int) -> dict:
        self.weights.copy_(stats["_prob_sum"] / n)
        return {"weight": self.weights.tolist()}


def _batches(seed: int = 0, count: int = 4) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(2, K, 4, 4, generator=g, dtype=torch.float64) * 3
        y = torch.randint(0, K, (2, 4, 4), generator=g)
        y[torch.rand(2, 4, 4, generator=g) < 0.25] = IGN
        out.append((x, y))
    return out


def test_a_loss_written_against_the_contract_updates_like_a_float64_reference():
    loss = MeanGapLoss(K, ignore_index=IGN)
    batches = _batches()
    for x, y in batches:
        loss.observe(x, y)
    logs = loss.update_multipliers(0)
    # reference: loops over every valid position, float64
    total, n = torch.zeros(K, dtype=torch.float64), 0
    for x, y in batches:
        for b in range(x.shape[0]):
            for i in range(4):
                for j in range(4):
                    if y[b, i, j] != IGN:
                        total += torch.softmax(x[b, :, i, j], dim=0)
                        n += 1
    torch.testing.assert_close(torch.tensor(logs["weight"], dtype=torch.float64), total / n)
    assert float(loss._count) == 0 and float(loss._prob_sum.abs().sum()) == 0  # reset
    assert set(loss.state_dict()) == {"weights"}  # the state is saved, the sums are not
    with pytest.raises(RuntimeError, match="no observed validation positions"):
        loss.update_multipliers(1)


def test_every_registered_adaptive_loss_declares_its_pieces():
    adaptive = [n for n, cls in LOSSES.items() if issubclass(cls, AdaptiveLoss)]
    assert {"cals_alm", "cals_hr"} <= set(adaptive)
    for name in adaptive:
        # cals_alm_bands moves its margins itself; CRaC has no auto margin; margin: auto of
        # CALS-ALM / CALS-HR is a rule beside the loss (test_contrib_auto_margin.py)
        margins = ((10.0, "auto") if name == "cals_alm_bands" else
                   (10.0,) if name.startswith("cals_") else (1.0,))
        for margin in margins:
            loss = build_loss(name, K, ignore_index=IGN, margin=margin)
            assert loss.state_tensors() and len(loss.statistics()) >= 2
            saved = set(loss.state_dict())
            assert saved == set(loss.state_tensors())  # what is declared is what is saved
            assert loss.state_fingerprint().dtype == torch.float64


def _missing(piece: str) -> type:
    """A subclass of MeanGapLoss that leaves out one declared piece."""

    class Broken(MeanGapLoss):
        log_keys = ("weight", "val_ece") if piece == "log_key" else ("weight",)

        def __init__(self, num_classes: int, ignore_index: int = -100) -> None:
            AdaptiveLoss.__init__(self, num_classes, ignore_index)
            if piece == "plain_tensor":
                self.weights = torch.zeros(num_classes, dtype=torch.float64)
            elif piece != "state":
                self.add_state("weights", torch.zeros(num_classes, dtype=torch.float64))
            if piece != "statistic":
                self.add_statistic("_prob_sum", num_classes)

    if piece == "update":
        Broken._update = AdaptiveLoss._update
    if piece == "observe":
        Broken._observe = AdaptiveLoss._observe
    return Broken


@pytest.mark.parametrize(
    ("piece", "message"),
    [
        ("state", "declares no state"),
        ("statistic", "declares no statistic"),
        ("plain_tensor", "outside its declared state"),
        ("log_key", "collide with the trainer's history keys"),
        ("update", "does not implement"),
        ("observe", "does not implement"),
    ],
)
def test_a_loss_missing_a_declared_piece_is_refused_when_built(piece, message):
    with pytest.raises(TypeError, match=message):
        _missing(piece)(K, ignore_index=IGN)


def test_an_undeclared_log_key_is_refused_at_the_update():
    class Loose(MeanGapLoss):
        def _update(self, epoch, stats, n):
            return {"weight": [], "surprise": 1.0}

    loss = Loose(K, ignore_index=IGN)
    x, y = _batches()[0]
    loss.observe(x, y)
    with pytest.raises(TypeError, match="surprise"):
        loss.update_multipliers(0)


def _rank_fn(rank: int, world: int, path: str) -> None:
    loss = MeanGapLoss(K, ignore_index=IGN)
    out = []
    for epoch in range(2):
        for i, (x, y) in enumerate(_batches(epoch)):
            if i % world == rank:
                loss.observe(x, y)
        out.append(loss.update_multipliers(epoch))
    with open(f"{path}.{rank}", "w") as f:
        json.dump(out, f)


def test_a_new_adaptive_loss_gives_the_same_update_on_two_processes(tmp_path):
    """The contract, not the loss, does the all-reduce: a loss that declares its pieces is
    exact under torch.distributed without a line about it."""
    path = str(tmp_path / "res")
    run_distributed(_rank_fn, 2, path, start_method="fork")
    _rank_fn(0, 1, path + "_one")
    one = json.load(open(path + "_one.0"))
    for rank in range(2):
        got = json.load(open(f"{path}.{rank}"))
        for a, b in zip(got, one, strict=True):
            torch.testing.assert_close(torch.tensor(a["weight"]), torch.tensor(b["weight"]),
                                       rtol=1e-12, atol=0)
