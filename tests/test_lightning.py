"""examples/lightning_smp.py runs one epoch; its multipliers equal a plain loop's on the same data
and seed; the Lightning checkpoint holds the criterion's state and restores it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

# Found, not imported: lightning takes seconds to import, which every xdist worker paid while
# collecting this file, whether or not it runs it (the tests import it).
_MISSING = [m for m in ("lightning", "torchmetrics", "segmentation_models_pytorch")
            if importlib.util.find_spec(m) is None]
if _MISSING:
    pytest.skip(f"not installed: {_MISSING}", allow_module_level=True)


def AdaptiveLossCallback(*args, **kwargs):  # noqa: N802  (the class, imported when used)
    from cals_seg.integrations.lightning import AdaptiveLossCallback as callback

    return callback(*args, **kwargs)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_smp.py"


def _load():
    spec = importlib.util.spec_from_file_location("lightning_smp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain_loop(ex, seed: int, margin: float, batch_size: int) -> torch.Tensor:
    """The same epoch written as a plain PyTorch loop (examples/train_smp_loop.py's protocol)."""
    model, criterion = ex.build(seed, margin)
    train_loader, val_loader = ex.loaders(seed, batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    model.train()
    for x, y in train_loader:
        loss = criterion(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        for x, y in val_loader:
            criterion.observe(model(x), y)
    criterion.update_multipliers(0)
    return criterion.lambdas.clone()


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    ex = _load()
    out = tmp_path_factory.mktemp("lightning")
    result = ex.main(["--epochs", "1", "--out", str(out), "--margin", "0.05"])
    return ex, result


def test_example_one_epoch_equals_the_plain_loop(lightning_run, capsys):
    ex, result = lightning_run
    assert len(result["history"]) == 1  # the sanity check did not update the multipliers
    lam = torch.tensor(result["lambda"], dtype=torch.float64)
    init = ex.build(0, 0.05)[1].lambdas.double()
    assert not torch.equal(lam, init), "the validation protocol did not move the multipliers"
    plain = _plain_loop(ex, seed=0, margin=0.05, batch_size=8).double()
    # the same float operations in the same order: equal, not just close
    assert torch.equal(lam, plain), (lam - plain).abs().max()
    assert {"val_ece", "val_aece", "val_miou", "lambda_mean"} <= set(result["metrics"])


def test_checkpoint_holds_and_restores_the_multipliers(lightning_run):
    ex, result = lightning_run
    ckpt = torch.load(result["checkpoint"], map_location="cpu", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "AdaptiveLossCallback" in k]
    saved = state["criterion"]["lambdas"].double()
    assert torch.allclose(saved, torch.tensor(result["lambda"], dtype=torch.float64))
    # a fresh module gets them back from the callback's state (Trainer.fit(ckpt_path=...))
    model, criterion = ex.build(1, 0.5)
    module = ex.Segmenter(model, criterion)
    callback = AdaptiveLossCallback()
    callback.load_state_dict(state)  # before the module is known, as Lightning restores
    callback.setup(None, module, "fit")
    assert torch.equal(criterion.lambdas.double(), saved)
    assert callback.history == result["history"]


def test_callback_refuses_a_non_adaptive_criterion():
    ex = _load()
    model, _ = ex.build(0, 0.5)
    module = ex.Segmenter(model, torch.nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="not an adaptive loss"):
        AdaptiveLossCallback().setup(None, module, "fit")
