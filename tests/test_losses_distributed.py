"""observe/update over a validation set split across 2 gloo ranks equals one process."""

from __future__ import annotations

import json

import torch

from cals_seg.losses import CALSALMLoss, CALSHRLoss, build_loss
from cals_seg.losses.margin_rules import margin_rule_of

from ._dist import run_distributed

K, IGN = 4, 255


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(6):
        x = torch.randn(2, K, 5, 5, generator=g, dtype=torch.float64) * 15
        y = torch.randint(0, K, (2, 5, 5), generator=g)
        # Mostly the top class, so the accuracy is above chance and the auto margin moves.
        y = torch.where(torch.rand(2, 5, 5, generator=g) < 0.7, x.argmax(1), y)
        y[torch.rand(2, 5, 5, generator=g) < 0.2] = IGN
        out.append((x, y))
    return out


def _run(criteria, batches, rank=0, world=1):
    results = []
    for epoch in range(3):
        for i, (x, y) in enumerate(batches):
            if i % world == rank:
                for c in criteria:
                    for observer in (c, margin_rule_of(c)):
                        if observer is not None:
                            observer.observe(x * (1 + epoch), y)
        results.append([_update(c, epoch) for c in criteria])
    return results


def _update(c, epoch):
    logs = c.update_multipliers(epoch)
    rule = margin_rule_of(c)
    return logs if rule is None else {**logs, **rule.step(c, epoch)}


def _criteria():
    # The margin rule's sums are reduced too (no learning window: it moves from the first epoch).
    import cals_seg.contrib.auto_margin  # noqa: F401  (margin: auto)

    auto = {"margin": "auto", "margin_min": 0.01, "margin_patience": 0}
    return [
        CALSALMLoss(K, ignore_index=IGN, rho_period=1),
        CALSHRLoss(K, ignore_index=IGN),
        build_loss("cals_alm", K, ignore_index=IGN, rho_period=1, **auto),
        build_loss("cals_hr", K, ignore_index=IGN, **auto),
    ]


def _rank_fn(rank, world, path):
    res = _run(_criteria(), _batches(), rank, world)
    with open(f"{path}.{rank}", "w") as f:
        json.dump(res, f)


def test_two_ranks_equal_one_process(tmp_path):
    path = str(tmp_path / "res")
    run_distributed(_rank_fn, 2, path, start_method="fork")
    single = _run(_criteria(), _batches())
    margins = [epoch[2]["margin"] for epoch in single]
    assert len(set(margins)) == 3 and all(0.01 <= m < 10 for m in margins)  # the rule acted
    for rank in range(2):
        with open(f"{path}.{rank}") as f:
            got = json.load(f)
        for epoch_got, epoch_ref in zip(got, single, strict=True):
            for a, b in zip(epoch_got, epoch_ref, strict=True):
                for key in b:
                    if isinstance(b[key], str) or b[key] is None:  # margin_reason, no rise yet
                        assert a[key] == b[key], key
                        continue
                    torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]),
                                               rtol=1e-12, atol=0)
