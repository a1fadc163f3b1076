"""CALS-ALM with PyTorch Lightning: smp DeepLabV3 on generated scenes.

The multiplier update of CALS-ALM (observe every validation batch, update once per epoch) is run
by :class:`cals_seg.integrations.lightning.AdaptiveLossCallback`; the validation ECE, adaptive
ECE and mIoU are torchmetrics ``Metric`` s from :mod:`cals_seg.integrations.torchmetrics`, logged
with ``self.log_dict``. The data are the toolkit's synthetic scenes, drawn in memory (no
download, no files)::

    pip install -e ".[lightning]"   # once, from the repository root
    python examples/lightning_smp.py --epochs 5
    python examples/lightning_smp.py --accelerator gpu

Checkpoints (with the multipliers) and a CSV log go to ``--out`` (default
``runs/lightning_smp``).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L
import numpy as np
import segmentation_models_pytorch as smp
import torch
from torch.utils.data import DataLoader, Dataset
from torchmetrics import MetricCollection

from cals_seg.data.synthetic import render_scene
from cals_seg.integrations.lightning import AdaptiveLossCallback
from cals_seg.integrations.torchmetrics import ECE, AdaptiveECE, MeanIoU
from cals_seg.losses import build_loss

NUM_CLASSES = 11  # background and 10 object classes
VOID = 255
MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


class Scenes(Dataset):
    """``count`` synthetic scenes of ``size x size`` pixels, deterministic from ``seed``;
    yields a normalised float ``(3, H, W)`` image and an int64 ``(H, W)`` mask."""

    def __init__(self, count: int, seed: int, size: int = 32) -> None:
        rng = np.random.default_rng(seed)
        self.samples = [render_scene(size, rng) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.samples[i]
        x = torch.from_numpy(((image - MEAN) / STD).transpose(2, 0, 1).copy())
        return x, torch.from_numpy(mask.astype(np.int64))


def build(seed: int, margin: float) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The network (weights drawn from ``seed``) and the CALS-ALM criterion."""
    torch.manual_seed(seed)
    model = smp.DeepLabV3(encoder_name="resnet18", encoder_weights=None, classes=NUM_CLASSES,
                          decoder_channels=32)
    criterion = build_loss("cals_alm", NUM_CLASSES, ignore_index=VOID, margin=margin)
    return model, criterion


def loaders(seed: int, batch_size: int, size: int = 32) -> tuple[DataLoader, DataLoader]:
    """Train (shuffled by a generator seeded with ``seed``) and validation loaders."""
    train = DataLoader(Scenes(32, seed=1, size=size), batch_size=batch_size, shuffle=True,
                       drop_last=True, generator=torch.Generator().manual_seed(seed))
    val = DataLoader(Scenes(12, seed=2, size=size), batch_size=batch_size)
    return train, val


class Segmenter(L.LightningModule):
    """A segmentation network trained with an adaptive loss; ``validation_step`` returns the
    logits and targets that :class:`AdaptiveLossCallback` observes."""

    def __init__(self, model: torch.nn.Module, criterion: torch.nn.Module, lr: float = 1e-3):
        super().__init__()
        self.model, self.criterion, self.lr = model, criterion, lr
        self.val_metrics = MetricCollection({
            "val_ece": ECE(NUM_CLASSES, ignore_index=VOID),
            "val_aece": AdaptiveECE(NUM_CLASSES, ignore_index=VOID),
            "val_miou": MeanIoU(NUM_CLASSES, ignore_index=VOID),
        })

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.criterion(self.model(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.val_metrics.update(logits, y)
        return {"logits": logits, "target": y}

    def on_validation_epoch_end(self) -> None:
        self.log_dict({k: v.float() for k, v in self.val_metrics.compute().items()})
        self.val_metrics.reset()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=1e-4)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--margin", type=float, default=3.0,
                        help="CALS margin m; small for a small network trained from scratch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--accelerator", default="cpu", help="cpu, gpu, auto")
    parser.add_argument("--out", default="runs/lightning_smp")
    args = parser.parse_args(argv)

    model, criterion = build(args.seed, args.margin)
    train_loader, val_loader = loaders(args.seed, args.batch_size)
    module = Segmenter(model, criterion)
    callback = AdaptiveLossCallback()  # drives module.criterion
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator=args.accelerator, devices=1,
        default_root_dir=args.out, logger=L.loggers.CSVLogger(args.out),
        callbacks=[callback], enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, train_loader, val_loader)
    for entry in callback.history:
        lam = ", ".join(f"{v:.3g}" for v in entry["lambda"])
        print(f"epoch {entry['epoch'] + 1}: lambda [{lam}]")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    shown = ("val_ece", "val_aece", "val_miou", "lambda_mean")
    print("validation: " + ", ".join(
        f"{k} {100 * metrics[k]:.2f}%" if "ece" in k else f"{k} {metrics[k]:.4f}"
        for k in shown if k in metrics))
    return {
        "lambda": criterion.lambdas.tolist(),
        "history": callback.history,
        "metrics": metrics,
        "checkpoint": trainer.checkpoint_callback.last_model_path
        or trainer.checkpoint_callback.best_model_path,
    }


if __name__ == "__main__":
    main()
