"""On a CUDA device: the training step without synchronisation, and the compiled criteria.

Run with ``pytest -q -m cuda tests/test_cuda_compile.py`` (``benchmarks/gpu_check.sh`` runs it
as its own stage); every test is skipped without a CUDA device.

- ``torch.cuda.set_sync_debug_mode("error")`` around the training steps of ``train_one_epoch``
  (every step but the first, which initialises the optimizer's state and, compiled, compiles):
  eager with every loss, and with ``torch.compile`` of the model and of CALS-ALM.
- The compiled criteria (inductor, Triton) give eager's value and gradient on the device, to
  float32 rounding, with two batch / spatial sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cals_seg.training.engine import train_one_epoch

from .test_compile_sync import NAMES, _data, _make, _value_and_grad

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
K = 5


class SyncErrorLoader:
    """Device batches; synchronisations raise while steps 1..n-1 run (the first step and
    the end of the epoch, which reads the checks once, are outside)."""

    def __init__(self, count: int, device: torch.device) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = []
        for i in range(count):
            _, y = _data(4, 16, 16, seed=i)
            self.batches.append((torch.randn(4, 3, 16, 16, generator=g).to(device),
                                 y.to(device)))
        self.steps_checked = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        try:
            for i, batch in enumerate(self.batches):
                if i == 1:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                yield batch
                self.steps_checked += i >= 1
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, K, 1)).to(device)


@pytest.mark.parametrize("name", NAMES)
def test_training_steps_do_not_synchronise(name):
    device = torch.device("cuda")
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = SyncErrorLoader(4, device)
    out = train_one_epoch(model, _make(name).to(device), loader, opt, device, grad_clip=1.0,
                          progress=True)
    assert loader.steps_checked == 3 and out["loss"] == out["loss"]


def test_compiled_training_steps_do_not_synchronise():
    device = torch.device("cuda")
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = SyncErrorLoader(4, device)
    criterion = torch.compile(_make("cals_alm").to(device))
    train_one_epoch(torch.compile(model), criterion, loader, opt, device, progress=False)
    assert loader.steps_checked == 3


@pytest.mark.parametrize("name", ["ce", "mbls", "cals_hr", "cals_alm"])
def test_compiled_criterion_matches_eager_on_cuda(name):
    eager = _make(name).cuda()
    loss = _make(name).cuda()
    loss.deferred_checks = True
    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for i, shape in enumerate([(2, 16, 12), (3, 8, 20)]):
        logits, target = _data(*shape, seed=i)
        logits, target = logits.cuda(), target.cuda()
        v0, g0 = _value_and_grad(eager, logits, target)
        v1, g1 = _value_and_grad(compiled, logits, target)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-8)
