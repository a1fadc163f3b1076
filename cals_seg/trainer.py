"""The training run shared by ``tools/train_seg.py`` and ``tools/train_cls.py``.

Reads top to bottom: device and seed -> criterion -> optimizer and schedule -> (resume) -> for
each epoch: train, one validation pass that feeds the meters AND ``criterion.observe``, then
``criterion.update_multipliers``, checkpoints (last + best) and one ``history.jsonl`` line ->
the BEST checkpoint is tested before and after temperature scaling fitted on validation.
The task (data and model) is built by the tool and handed over as a :class:`Task`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from . import plotting
from .config import Config, config_to_dict, save_config
from .distributed import (
    barrier,
    broadcast_buffers,
    check_identical,
    is_distributed,
    is_main_process,
)
from .engine import (
    evaluate,
    load_checkpoint,
    make_loader,
    predict,
    rng_state,
    save_checkpoint,
    seed_epoch,
    seed_everything,
    set_rng_state,
    train_one_epoch,
)
from .losses import build_loss
from .precision import resolve_amp
from .temperature import fit_temperature

SCALAR_TYPES = (int, float)


@dataclass
class Task:
    """What a tool hands to :func:`fit`: the three splits, the model and display information."""

    train_set: Dataset
    val_set: Dataset
    test_set: Dataset
    model: nn.Module
    num_classes: int
    ignore_index: int
    class_names: list[str] = field(default_factory=list)
    segmentation: bool = True


def resolve_device(name: str) -> torch.device:
    """``auto`` -> this process' GPU under torchrun, CUDA when available, else CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device(name)


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
    raise ValueError(f"optim.name: unknown optimizer {o.name!r}; valid names are ['adamw', 'sgd'].")


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer):
    """Learning-rate schedule stepped once per epoch."""
    o, epochs = cfg.optim, cfg.train.epochs
    if o.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1))
    if o.schedule == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, o.milestones, gamma=o.gamma)
    if o.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    raise ValueError(
        f"optim.schedule: unknown schedule {o.schedule!r}; valid names are "
        "['cosine', 'multistep', 'constant']."
    )


def scalars(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    """The scalar entries of a metrics dict, keys prefixed (lists and dicts dropped)."""
    return {
        f"{prefix}{k}": v
        for k, v in metrics.items()
        if isinstance(v, SCALAR_TYPES) and not isinstance(v, bool)
    }


def calibrated_test(
    model: nn.Module, task: Task, cfg: Config, device: torch.device, progress: bool = False
) -> dict[str, Any]:
    """Test metrics before and after temperature scaling fitted on the validation split.

    Returns:
        ``{"temperature": T, "pre_ts": {...}, "post_ts": {...}}`` (post_ts is None when
        ``eval.temperature_scaling`` is off). Class-wise ECE is included.
    """
    e = cfg.eval
    amp = resolve_amp(cfg.train.amp, device, warn=False)
    val_loader = make_loader(
        task.val_set, e.batch_size, train=False, num_workers=cfg.data.num_workers
    )
    test_loader = make_loader(
        task.test_set, e.batch_size, train=False, num_workers=cfg.data.num_workers
    )
    temperature = 1.0
    if e.temperature_scaling:
        temperature = fit_temperature(
            lambda: predict(model, val_loader, device, amp=amp),
            ignore_index=task.ignore_index,
        )
    common = dict(
        num_classes=task.num_classes,
        ignore_index=task.ignore_index,
        n_bins=e.n_bins,
        classwise=True,
        segmentation=task.segmentation,
        amp=amp,
        progress=progress,
    )
    pre = evaluate(model, test_loader, device, desc="test", **common)
    post = None
    if e.temperature_scaling:
        post = evaluate(
            model, test_loader, device, temperature=temperature, desc="test-TS", **common
        )
    return {"temperature": temperature, "pre_ts": pre, "post_ts": post}


def _read_history(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(
    run_dir: Path,
    history: list[dict[str, Any]],
    test: dict[str, Any] | None,
    class_names: list[str],
) -> list[Path]:
    """Write the run's plots (DESIGN.md section 7) and return their paths."""
    plots = run_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    if plotting.plot_multiplier_curves(history, plots / "lambda_curves.png", class_names):
        written.append(plots / "lambda_curves.png")
    if plotting.plot_training_curves(
        history, plots / "training_curves.png", keys=("val_ece", "val_miou", "val_acc")
    ):
        written.append(plots / "training_curves.png")
    if test is not None:
        for key, label in (("pre_ts", "pre-TS"), ("post_ts", "post-TS")):
            if test.get(key):
                m = test[key]
                title = f"{run_dir.name} test, {label}"
                if key == "post_ts":
                    title += f" (T = {test['temperature']:.2f})"
                path = plots / f"reliability_{key}.png"
                plotting.plot_reliability_diagram(m["reliability"], path, title=title, ece=m["ece"])
                written.append(path)
    return written


def fit(cfg: Config, task: Task, resume: str | Path | None = None) -> dict[str, Any]:
    """Train, validate, update the multipliers, checkpoint, and test the best checkpoint.

    Args:
        cfg: the resolved config (written to ``<run_dir>/config.yaml``).
        task: data and model.
        resume: a run directory holding ``checkpoint_last.pt`` to continue from.

    Returns:
        The test metrics written to ``<run_dir>/test_metrics.json``.
    """
    t, k = cfg.train, task.num_classes
    device = resolve_device(t.device)
    amp = resolve_amp(t.amp, device)  # a bad train.amp fails here, before any work
    if t.threads:
        torch.set_num_threads(t.threads)
    seed_everything(t.seed)
    run_dir = Path(resume) if resume is not None else cfg.run_dir
    last_path, best_path = run_dir / "checkpoint_last.pt", run_dir / "checkpoint_best.pt"
    history_path = run_dir / "history.jsonl"
    if resume is None and last_path.exists():
        raise FileExistsError(
            f"{run_dir} already holds a run. Continue it with --resume {run_dir}, or choose "
            "another name (--set name=...)."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    main = is_main_process()
    model = task.model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if is_distributed() and t.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    train_model: nn.Module = model
    if is_distributed():
        ids = [device.index] if device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if t.compile:
        train_model = torch.compile(train_model)
    criterion = build_loss(cfg.loss.name, k, ignore_index=task.ignore_index, **cfg.loss.params).to(
        device
    )
    adaptive = hasattr(criterion, "update_multipliers")
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" and device.type == "cuda" else None
    train_loader = make_loader(
        task.train_set, t.batch_size, train=True, num_workers=cfg.data.num_workers, seed=t.seed
    )
    val_loader = make_loader(
        task.val_set, cfg.eval.batch_size, train=False, num_workers=cfg.data.num_workers
    )
    if len(train_loader) == 0:
        raise ValueError(
            f"The training split has {len(task.train_set)} samples, fewer than "
            f"train.batch_size={t.batch_size} per process."
        )

    start_epoch, best_score = 0, None
    if resume is not None:
        ckpt = load_checkpoint(last_path, map_location=device)
        if ckpt["num_classes"] != k:
            raise ValueError(
                f"{last_path} was trained with {ckpt['num_classes']} classes, but "
                f"the config has data.num_classes={k}."
            )
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        criterion.load_state_dict(ckpt["criterion"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_epoch, best_score = ckpt["epoch"] + 1, ckpt["best_score"]
        set_rng_state(ckpt["rng"])
        if main:  # lines written after the checkpoint (a crash in between) would repeat
            kept = [h for h in _read_history(history_path) if h["epoch"] < start_epoch]
            history_path.write_text("".join(json.dumps(h) + "\n" for h in kept))
    if main:
        save_config(cfg, run_dir / "config.yaml")

    sign = 1.0 if t.best_mode == "max" else -1.0
    for epoch in range(start_epoch, t.epochs):
        start = time.perf_counter()
        seed_epoch(train_loader, t.seed, epoch)
        lr = optimizer.param_groups[0]["lr"]
        train_stats = train_one_epoch(
            train_model,
            criterion,
            train_loader,
            optimizer,
            device,
            amp,
            scaler,
            t.grad_clip,
            t.progress,
            desc=f"epoch {epoch + 1}/{t.epochs}",
        )
        scheduler.step()
        broadcast_buffers(model)  # every rank validates (and rank 0 saves) rank 0's BN stats
        val = evaluate(
            model,
            val_loader,
            device,
            k,
            task.ignore_index,
            cfg.eval.n_bins,
            segmentation=task.segmentation,
            observe=criterion.observe if adaptive else None,
            amp=amp,
            progress=t.progress,
            desc="val",
        )
        multipliers = criterion.update_multipliers(epoch) if adaptive else {}
        if is_distributed():  # cheap guards: DDP keeps parameters and multipliers identical
            check_identical(_fingerprint(model), "the model parameters")
            if adaptive:
                check_identical(criterion.lambdas, "the CALS multipliers")
        if t.best_metric not in val:
            raise ValueError(
                f"train.best_metric={t.best_metric!r} is not a validation metric; "
                f"choose one of {sorted(scalars(val, ''))}."
            )
        score = float(val[t.best_metric])
        improved = best_score is None or sign * score > sign * best_score
        if improved:
            best_score = score
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "criterion": criterion.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch,
            "best_score": best_score,
            "score": score,
            "num_classes": k,
            "config": config_to_dict(cfg),
            "rng": rng_state(),
        }
        record = {
            "epoch": epoch,
            "lr": lr,
            **scalars(train_stats, "train_"),
            **scalars(val, "val_"),
            **multipliers,
            "best": improved,
            "time": time.perf_counter() - start,
        }
        if main:
            if improved:
                save_checkpoint(state, best_path)
            save_checkpoint(state, last_path)
            with history_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            lam = (
                f"  mean lambda {sum(multipliers['lambda']) / k:.3g}"
                if "lambda" in multipliers
                else ""
            )
            print(
                f"epoch {epoch + 1:3d}/{t.epochs}  loss {train_stats['loss']:.4f}  "
                f"val ece {val['ece']:.4f}  {t.best_metric} {score:.4f}{lam}  "
                f"{'*' if improved else ' '} {record['time']:.1f}s",
                flush=True,
            )

    barrier()  # rank 0 has written checkpoint_best.pt
    best = load_checkpoint(best_path, map_location=device)
    model.load_state_dict(best["model"])
    test = calibrated_test(model, task, cfg, device, progress=t.progress)
    test.update(
        checkpoint=best_path.name,
        epoch=best["epoch"],
        best_metric=t.best_metric,
        best_score=best["best_score"],
    )
    if main:
        (run_dir / "test_metrics.json").write_text(json.dumps(_json_safe(test), indent=1))
        plot_run(run_dir, _read_history(history_path), test, task.class_names)
    return test


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter tensor: equal on every rank iff DDP kept them in sync."""
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


def _json_safe(obj: Any) -> Any:
    """Replace NaN/inf floats by None so the JSON is standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj
