"""CALS-ALM in a plain PyTorch training loop: smp DeepLabV3, albumentations, autocast.

Reads top to bottom: arguments -> seed/device -> data -> model -> criterion -> optimizer ->
loop (train, then validate: observe + update the multipliers) -> temperature scaling -> test.
It uses only the public API of cals_seg (losses, metrics, temperature, precision) and makes its
own tiny data set (rectangles and discs on a noisy background), so it needs no download::

    pip install -e .   # once, from the repository root
    python examples/train_smp_loop.py --epochs 5
    python examples/train_smp_loop.py --device cuda
"""

from __future__ import annotations

import argparse
import math
from contextlib import nullcontext

import albumentations as A
import numpy as np
import segmentation_models_pytorch as smp
import torch
from albumentations.pytorch import ToTensorV2
from torch.utils.data import DataLoader, Dataset

from cals_seg.calibrators.ts import fit_temperature
from cals_seg.losses import build_loss
from cals_seg.metrics import CalibrationMeter, SegmentationMeter
from cals_seg.utils.precision import resolve_amp

NUM_CLASSES = 3  # background, rectangle, disc
VOID = 255
SIZE = 64


# ------------------------------------------------------------------------------------ data
def make_sample(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One ``SIZE x SIZE`` RGB uint8 image and its mask: 1-3 rectangles (class 1) or discs
    (class 2) of random colours on a noisy background (class 0), a 1-pixel void (255) border
    around each shape, as VOC masks have."""
    image = rng.normal(110, 40, (SIZE, SIZE, 3)).clip(0, 255)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    yy, xx = np.mgrid[:SIZE, :SIZE]
    for _ in range(rng.integers(1, 4)):
        cy, cx, r = rng.integers(12, SIZE - 12, 2).tolist() + [int(rng.integers(5, 12))]
        if rng.random() < 0.5:
            inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r * 0.7)
            outer = (abs(yy - cy) <= r + 1) & (abs(xx - cx) <= r * 0.7 + 1)
            label = 1
        else:
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
            outer = (yy - cy) ** 2 + (xx - cx) ** 2 <= (r + 1) ** 2
            label = 2
        image[inside] = rng.uniform(60, 220, 3) + rng.normal(0, 25, (int(inside.sum()), 3))
        mask[outer] = VOID
        mask[inside] = label
    return image.clip(0, 255).astype(np.uint8), mask


class ShapesDataset(Dataset):
    """``count`` generated samples, deterministic from ``seed``, through an albumentations
    pipeline; yields a float ``(3, H, W)`` image and an int64 ``(H, W)`` mask."""

    def __init__(self, count: int, seed: int, transform: A.Compose) -> None:
        rng = np.random.default_rng(seed)
        self.samples = [make_sample(rng) for _ in range(count)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.samples[i]
        out = self.transform(image=image, mask=mask)
        return out["image"], out["mask"].long()


def transforms(train: bool) -> A.Compose:
    augment = [A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5)] if train else []
    return A.Compose([*augment, A.Normalize(), ToTensorV2()])


# --------------------------------------------------------------------------------- helpers
def predict(model, loader, device, autocast):
    """Yield ``(logits, target)`` over ``loader`` in eval mode; the logits are float32 (the
    criterion and the meters compute in float32 anyway, whatever autocast produced)."""
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            with autocast():
                logits = model(x.to(device))
            yield logits.float(), y.to(device)


def evaluate(model, loader, device, autocast, temperature: float = 1.0) -> dict[str, float]:
    """Pooled ECE / NLL and mIoU over ``loader`` at a given temperature."""
    calib = CalibrationMeter(NUM_CLASSES, ignore_index=VOID).to(device)
    seg = SegmentationMeter(NUM_CLASSES, ignore_index=VOID).to(device)
    for logits, y in predict(model, loader, device, autocast):
        calib.update(logits / temperature, y)
        seg.update(logits, y)
    c, s = calib.compute(), seg.compute()
    return {"ece": c["ece"], "nll": c["nll"], "miou": s["miou"]}


# ------------------------------------------------------------------------------------ main
# Not split (over 80 lines): the example is a training script a user reads top to bottom.
def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--margin", type=float, default=3.0,
                        help="CALS margin m; small for a small network trained from scratch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    # Mixed precision: fp16 + GradScaler on CUDA; on CPU bf16 only where it is native (fast).
    amp = "fp16" if device.type == "cuda" else resolve_amp("auto", device)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(amp)

    def autocast():
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")

    train_loader = DataLoader(ShapesDataset(40, seed=1, transform=transforms(True)),
                              batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(ShapesDataset(16, seed=2, transform=transforms(False)),
                            batch_size=args.batch_size)
    test_loader = DataLoader(ShapesDataset(16, seed=3, transform=transforms(False)),
                             batch_size=args.batch_size)

    model = smp.DeepLabV3(encoder_name="resnet18", encoder_weights=None, classes=NUM_CLASSES,
                          decoder_channels=32).to(device)
    # BatchNorm running statistics as a plain average over all training batches: with a few
    # dozen steps from scratch the default momentum leaves them near their initial values.
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None
    criterion = build_loss("cals_alm", NUM_CLASSES, ignore_index=VOID, margin=args.margin)
    criterion = criterion.to(device)  # the multipliers are buffers: they move and checkpoint
    lambda_init = criterion.lambdas.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    steps = args.epochs * len(train_loader)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps))
    )

    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            with autocast():
                logits = model(x)
                loss = criterion(logits, y)  # computed in float32 whatever autocast does
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            schedule.step()

        # Validation: stream the multiplier statistics over every batch, then update once.
        for logits, y in predict(model, val_loader, device, autocast):
            criterion.observe(logits, y)
        stats = criterion.update_multipliers(epoch)
        val = evaluate(model, val_loader, device, autocast)
        lam = ", ".join(f"{v:.3g}" for v in stats["lambda"])
        # A satisfied PHR constraint adds -lambda^2 / (2 rho) (-5e-13 at lambda 1e-6): shown to
        # 4 decimals, + 0.0 turns the rounded -0.0 into 0.0.
        penalty = round(criterion.terms["penalty"].item(), 4) + 0.0
        print(f"epoch {epoch + 1}: loss {loss.item():.3f} (penalty {penalty:.4f}), val ECE "
              f"{100 * val['ece']:.2f}% mIoU {val['miou']:.3f}, lambda [{lam}]")

    # Post-hoc temperature scaling, fitted on validation (each pass re-runs the model).
    temperature = fit_temperature(lambda: predict(model, val_loader, device, autocast),
                                  ignore_index=VOID)
    before = evaluate(model, test_loader, device, autocast)
    after = evaluate(model, test_loader, device, autocast, temperature)
    print(f"test mIoU {before['miou']:.3f}; ECE pre-TS {100 * before['ece']:.2f}%, post-TS "
          f"{100 * after['ece']:.2f}% (T = {temperature:.3f}); NLL {before['nll']:.4f} -> "
          f"{after['nll']:.4f}")
    return {
        "temperature": temperature,
        "test_pre_ts": before,
        "test_post_ts": after,
        "lambda_init": lambda_init.tolist(),
        "lambda": criterion.lambdas.tolist(),
        "precision": amp,
    }


if __name__ == "__main__":
    main()
