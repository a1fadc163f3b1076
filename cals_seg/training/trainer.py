"""The training run shared by every task: :func:`fit`.

Reads top to bottom like the run itself:

1. device, precision, run directory; model, criterion, optimizer, schedule, loaders;
2. (resume) :func:`restore_training_state`, next to :func:`training_state` that writes it;
3. each epoch: :func:`train_one_epoch`; one validation pass that feeds the meters AND
   ``criterion.observe``; ``criterion.update_multipliers``; the epoch's files (history line,
   last checkpoint, best checkpoint, in that order);
4. the best checkpoint is tested once, before and after temperature scaling fitted on the
   validation split (:func:`calibrated_test`), and the plots are drawn.

The task (data, model, meters) is built from the config by :func:`cals_seg.tasks.build_task`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from cals_seg.calibrators import Calibrated
from cals_seg.calibrators.temperature import fit_temperature
from cals_seg.config.checks import (
    bounded_input,
    check_best_metric,
    check_resume,
    check_splits,
)
from cals_seg.config.rules import check_model_input
from cals_seg.config.schema import Config, ConfigError, config_to_dict, save_config
from cals_seg.data.extra_inputs import request_extra_inputs
from cals_seg.errors import RunExistsError
from cals_seg.evaluation.stream import Scaled, compute, evaluate, predict, scalars
from cals_seg.losses import AdaptiveLoss, build_loss
from cals_seg.runs.folder import RunDir
from cals_seg.runs.loading import load_weights
from cals_seg.tasks import Task
from cals_seg.training.engine import NonFiniteLossError, make_loader, seed_epoch, train_one_epoch
from cals_seg.training.loggers import RunLoggers
from cals_seg.utils.distributed import (
    barrier,
    broadcast_buffers,
    check_identical,
    get_world_size,
    is_distributed,
    is_main_process,
)
from cals_seg.utils.io import (
    link_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_json,
)
from cals_seg.utils.lock import RunLock
from cals_seg.utils.memory import check_batch_memory
from cals_seg.utils.precision import precision_name, resolve_amp, resolve_device


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optim
    if o.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay
        )
    raise ConfigError(
        f"optim.name: unknown optimizer {o.name!r}; valid names are ['adamw', 'sgd']."
    )


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer):
    """Learning-rate schedule stepped once per epoch."""
    o, epochs = cfg.optim, cfg.train.epochs
    if o.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1))
    if o.schedule == "multistep":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, o.milestones, gamma=o.gamma)
    if o.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    raise ConfigError(
        f"optim.schedule: unknown schedule {o.schedule!r}; valid names are "
        "['cosine', 'multistep', 'constant']."
    )


# ----------------------------------------------------------------------------- checkpoint
def training_state(
    model: nn.Module, optimizer, scheduler, criterion: nn.Module, scaler, cfg: Config,
    num_classes: int, epoch: int, score: float, best_score: float, best_epoch: int,
) -> dict[str, Any]:
    """Everything an exact resume needs; read back by :func:`restore_training_state`."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "criterion": criterion.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "epoch": epoch,
        "score": score,
        "best_score": best_score,
        "best_epoch": best_epoch,
        "num_classes": num_classes,
        "config": config_to_dict(cfg),
        "rng": rng_state(),
    }


def restore_training_state(
    state: dict[str, Any], model: nn.Module, optimizer, scheduler, criterion: nn.Module, scaler,
    num_classes: int, where: Path,
) -> tuple[int, float | None, int | None]:
    """Inverse of :func:`training_state`; returns ``(next epoch, best score, best epoch)``."""
    load_weights(model, state, where, where.parent / "config.yaml", num_classes)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    criterion.load_state_dict(state["criterion"])
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return state["epoch"] + 1, state["best_score"], state.get("best_epoch")


def replay_schedule(cfg: Config, optimizer: torch.optim.Optimizer, epochs_done: int):
    """The schedule of a fresh ``cfg.train.epochs``-epoch run after ``epochs_done`` epochs: what
    a resume that changes ``train.epochs`` continues with (the restored schedule was built for
    the old length, e.g. a cosine that has already reached zero)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]
    scheduler = build_scheduler(cfg, optimizer)
    with warnings.catch_warnings():  # stepped without optimizer steps: only the lr moves
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(epochs_done):
            scheduler.step()
    return scheduler


# ----------------------------------------------------------------------------- evaluation
def validate(
    model: nn.Module, task: Task, loader: DataLoader, device: torch.device, criterion: nn.Module,
    n_bins: int, amp: str, progress: bool,
) -> dict[str, Any]:
    """One validation pass feeding the task's meters and, for adaptive losses,
    ``criterion.observe`` (the statistics of the multiplier update)."""
    meters = {k: m.to(device) for k, m in task.meters(n_bins).items()}
    consumers: list[Any] = [_check_outputs, *meters.values()]
    if isinstance(criterion, AdaptiveLoss):
        consumers.append(criterion.observe)
    evaluate(model, loader, device, consumers, amp, progress, desc="val", protocol=task.protocol)
    return compute(meters)


def _check_outputs(logits: torch.Tensor, target: torch.Tensor) -> None:
    """A diverged training can leave finite weights whose outputs are not: stop with advice."""
    if not bool(logits.isfinite().all()):
        raise NonFiniteLossError(
            "validation: the model's outputs are NaN or infinite after this epoch (the training "
            "diverged); stopping. The last good checkpoint is left intact: lower the learning "
            "rate (optim.lr), enable train.grad_clip, or check the labels."
        )


def calibrated_test(
    model: nn.Module, task: Task, val_loader: DataLoader, test_loader: DataLoader,
    device: torch.device, amp: str = "none", n_bins: int = 15,
    temperature_scaling: bool = True, progress: bool = False,
    calibrators: Mapping[str, nn.Module] | None = None,
) -> dict[str, Any]:
    """Test metrics before and after temperature scaling fitted on ``val_loader``, from ONE
    pass over ``test_loader`` (the post-TS meters see the same logits divided by T; each of
    the fitted ``calibrators`` feeds its own set of meters in the same pass).

    Returns:
        ``{"temperature": T, "pre_ts": {...}, "post_ts": {...} or None}`` (and
        ``"calibrators": {name: {...}}`` when calibrators are given), the metrics being the
        merged outputs of ``task.meters(n_bins, test=True)``.
    """
    protocol = task.protocol  # segmentation: logits at the images' size
    temperature = 1.0
    if temperature_scaling:
        temperature = fit_temperature(
            lambda: predict(model, val_loader, device, amp, protocol=protocol),
            ignore_index=task.ignore_index,
        )
    pre = {k: m.to(device) for k, m in task.meters(n_bins, test=True).items()}
    post = {}
    consumers: list[Any] = list(pre.values())
    if temperature_scaling:
        post = {k: m.to(device) for k, m in task.meters(n_bins, test=True).items()}
        consumers.append(Scaled(temperature, post.values()))
    calibrated = {name: {k: m.to(device) for k, m in task.meters(n_bins, test=True).items()}
                  for name in calibrators or {}}  # fmt: skip
    image_consumers = [Calibrated(cal.to(device).eval(), calibrated[name])
                       for name, cal in (calibrators or {}).items()]  # fmt: skip
    evaluate(model, test_loader, device, consumers, amp, progress, desc="test",
             protocol=protocol, image_consumers=image_consumers)
    out = {
        "temperature": temperature,
        "pre_ts": compute(pre),
        "post_ts": compute(post) if post else None,
    }
    if calibrators:
        out["calibrators"] = {name: compute(m) for name, m in calibrated.items()}
    return out


def plot_run(run: RunDir, test: dict[str, Any] | None, class_names: list[str]) -> list[Path]:
    """Write the run's plots (multipliers, training curves, test reliability diagrams)."""
    from cals_seg.visualization import plotting  # matplotlib is loaded only when a plot is drawn

    history = run.history()
    run.plots.mkdir(parents=True, exist_ok=True)
    written = []
    if plotting.plot_multiplier_curves(history, run.plots / "lambda_curves.png", class_names):
        written.append(run.plots / "lambda_curves.png")
    if plotting.plot_training_curves(
        history, run.plots / "training_curves.png",
        keys=("val_ece", "val_ece_band_weighted", "val_miou", "val_acc"),
    ):
        written.append(run.plots / "training_curves.png")
    for key, label in (("pre_ts", "pre-TS"), ("post_ts", "post-TS")):
        m = (test or {}).get(key)
        if m:
            title = f"{run.path.name} test, {label}"
            if key == "post_ts":
                title += f" (T = {test['temperature']:.2f})"
            path = run.plots / f"reliability_{key}.png"
            plotting.plot_reliability_diagram(m["reliability"], path, title=title, ece=m["ece"])
            written.append(path)
    return written


# ----------------------------------------------------------------------------- the run
def _check_before_training(run: RunDir, resume: bool) -> None:
    if run.config.is_file() and not any(p.is_file() for p in (run.last, run.best,
                                                                 run.test_metrics)):
        # a run stopped before its first checkpoint (a data error in epoch 1, Ctrl-C): start it
        # again, with or without --resume, instead of asking for the folder to be deleted
        run.history_file.unlink(missing_ok=True)
        return
    if not resume and run.holds_run():
        raise RunExistsError(
            f"{run.path} already holds a run ({', '.join(run.holds_run())}). Continue it with "
            f"--resume {run.path}, or choose another name (--set name=...)."
        )
    if resume:
        run.check_resumable()


def _epoch_line(epoch: int, epochs: int, train: dict, val: dict, metric: str, score: float,
                multipliers: dict[str, Any], improved: bool, seconds: float,
                remaining: float) -> str:
    lambdas = multipliers.get("lambda")
    lam = f"  mean lambda {sum(lambdas) / len(lambdas):.3g}" if lambdas else ""
    if multipliers.get("margin") is not None:  # margin: auto
        lam += f"  margin {multipliers['margin']:.2f}"
    eta = f"  ~{remaining / 60:.1f} min left" if remaining > 0 else ""
    return (
        f"epoch {epoch + 1:3d}/{epochs}  loss {train['loss']:.4f}  val ece {val['ece']:.4f}  "
        f"{metric} {score:.4f}{lam}  {'*' if improved else ' '} {seconds:.1f}s{eta}"
    )


# Not split further (over 80 lines): the run reads top to bottom, as nanoGPT's training script;
# the model placement, the resume, the validation and update, and the final test are helpers.
def fit(cfg: Config, task: Task, resume: str | Path | None = None) -> dict[str, Any]:
    """:func:`train_and_test` holding the run folder's lock (:class:`RunLock`): one process
    trains or resumes a run at a time; a second is refused naming the holder's pid."""
    if not is_main_process():  # the main process holds the lock for the process group
        return train_and_test(cfg, task, resume)
    with RunLock(resume if resume is not None else cfg.run_dir, "train"):
        return train_and_test(cfg, task, resume)


def train_and_test(cfg: Config, task: Task, resume: str | Path | None = None) -> dict[str, Any]:
    """Train, validate, update the multipliers, checkpoint, and test the best checkpoint.

    Args:
        cfg: the resolved config (written to ``<run_dir>/config.yaml``), checked with
            :func:`cals_seg.config.checks.check_config` (as the training commands do).
        task: data, model and meters (:func:`cals_seg.tasks.build_task`).
        resume: a run directory holding ``checkpoint_last.pt`` to continue from.

    Returns:
        The test metrics written to ``<run_dir>/test_metrics.json``.
    """
    t, k = cfg.train, task.num_classes
    run = RunDir(resume if resume is not None else cfg.run_dir)
    _check_before_training(run, resume is not None)
    device = resolve_device(t.device)
    if task.family == "segmentation":  # a batch that cannot fit is refused before any work
        check_batch_memory(t.batch_size, cfg.data.crop_size, k, device, "data.crop_size",
                           "lower it (--set data.crop_size=512) or train.batch_size")
        e = cfg.eval
        side = max([v for v in (e.pad, e.resize) if v] + [e.window if e.mode == "slide" else 0])
        if side:
            check_batch_memory(e.batch_size, side, k, device, "eval.pad / eval.resize / "
                               "eval.window", "lower it, or eval.batch_size")
    amp = resolve_amp(t.amp, device, warn=is_main_process())
    if t.threads:
        torch.set_num_threads(t.threads)
    main = is_main_process()

    model, train_model = _place_model(task.model, cfg, device)
    criterion = build_loss(cfg.loss.name, k, ignore_index=task.ignore_index, **cfg.loss.params)
    criterion = criterion.to(device)
    request_extra_inputs(task.train_set, criterion)  # e.g. the band map, made by the loader
    # The training loss compiled too (observe() and the update stay eager: once per epoch).
    train_criterion = torch.compile(criterion) if t.compile else criterion
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    check_model_input(cfg, task)
    check_splits(task, t.batch_size, bounded_input(cfg), get_world_size())
    check_best_metric(task, t.best_metric, cfg.eval.n_bins)
    workers = cfg.data.num_workers
    train_loader = make_loader(task.train_set, t.batch_size, True, workers, seed=t.seed)
    val_loader = make_loader(task.val_set, cfg.eval.batch_size, False, workers)
    test_loader = make_loader(task.test_set, cfg.eval.batch_size, False, workers)

    start_epoch, best_score, best_epoch = 0, None, None
    run.path.mkdir(parents=True, exist_ok=True)
    if resume is not None and run.last.is_file():  # else: a run without checkpoint, anew
        start_epoch, best_score, best_epoch, scheduler = _resume(
            cfg, run, device, model, optimizer, scheduler, criterion, scaler, k)
    if main:
        save_config(cfg, run.config)
        print(f"{run.path}: {cfg.loss.name} on {device.type}, precision {precision_name(amp)}, "
              f"epochs {start_epoch + 1}..{t.epochs}", flush=True)
    loggers = RunLoggers(t.loggers if main else [], run.path, config_to_dict(cfg),
                         task.class_names, start_epoch)

    sign = 1.0 if t.best_mode == "max" else -1.0
    durations: list[float] = []
    for epoch in range(start_epoch, t.epochs):
        start = time.perf_counter()
        seed_epoch(train_loader, t.seed, epoch)
        lr = optimizer.param_groups[0]["lr"]
        train_stats = train_one_epoch(
            train_model, train_criterion, train_loader, optimizer, device, amp, scaler,
            t.grad_clip, t.progress, desc=f"epoch {epoch + 1}/{t.epochs}",
            debug_checks=t.debug_checks,
        )
        scheduler.step()
        val, multipliers, score = _validate_and_update(
            epoch, model, task, val_loader, device, criterion, cfg, amp)
        improved = best_score is None or sign * score > sign * best_score
        if improved:
            best_score, best_epoch = score, epoch
        durations.append(time.perf_counter() - start)
        record = {
            "epoch": epoch,
            "lr": lr,
            "precision": amp,
            **scalars(train_stats, "train_"),
            **scalars(val, "val_"),
            **multipliers,
            "best": improved,
            "time": durations[-1],
        }
        if main:  # history line, last, best: a consistent run whenever the process dies
            state = training_state(model, optimizer, scheduler, criterion, scaler, cfg, k, epoch,
                                   score, best_score, best_epoch)
            run.append_history(record)
            loggers.log_epoch(record, val, run.history())
            save_checkpoint(state, run.last)
            if improved:
                link_checkpoint(run.last, run.best)
            remaining = sum(durations) / len(durations) * (t.epochs - epoch - 1)
            print(_epoch_line(epoch, t.epochs, train_stats, val, t.best_metric, score,
                              multipliers, improved, durations[-1], remaining),
                  flush=True)

    barrier()  # rank 0 has written checkpoint_best.pt
    test = _test_best(run, model, task, val_loader, test_loader, device, amp, cfg)
    if main:
        loggers.log_test(test)
    loggers.close()
    return test


def _place_model(model: nn.Module, cfg: Config, device: torch.device
                 ) -> tuple[nn.Module, nn.Module]:
    """``(model, train_model)``: the model on ``device`` (channels-last and SyncBatchNorm as the
    config asks) and what the training step calls (wrapped in DDP under torchrun, compiled with
    ``train.compile``); both share the same parameters."""
    t = cfg.train
    model = model.to(device)
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
    return model, train_model


def _resume(cfg: Config, run: RunDir, device: torch.device, model: nn.Module, optimizer,
            scheduler, criterion: nn.Module, scaler, num_classes: int):
    """Restore ``run``'s last checkpoint into the training objects (a changed ``train.epochs``
    replays the schedule); returns ``(next epoch, best score, best epoch, scheduler)``."""
    state = load_checkpoint(run.last, map_location=device)
    changed = check_resume(cfg, state["config"], run.last)
    start_epoch, best_score, best_epoch = restore_training_state(
        state, model, optimizer, scheduler, criterion, scaler, num_classes, run.last
    )
    if "train.epochs" in changed:
        scheduler = replay_schedule(cfg, optimizer, start_epoch)
    if is_main_process():
        run.trim_history(start_epoch)
        run.repair_best(state)
    return start_epoch, best_score, best_epoch, scheduler


def _validate_and_update(epoch: int, model: nn.Module, task: Task, loader: DataLoader,
                         device: torch.device, criterion: nn.Module, cfg: Config, amp: str
                         ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The validation pass of ``epoch`` (meters and ``criterion.observe``), the multiplier
    update, the torchrun guards, and the score of ``train.best_metric``."""
    t = cfg.train
    broadcast_buffers(model)  # every rank validates (and rank 0 saves) rank 0's BN stats
    val = validate(model, task, loader, device, criterion, cfg.eval.n_bins, amp, t.progress)
    adaptive = isinstance(criterion, AdaptiveLoss)
    multipliers = criterion.update_multipliers(epoch) if adaptive else {}
    if is_distributed():  # cheap guards: DDP keeps parameters and multipliers identical
        check_identical(_fingerprint(model), "the model parameters")
        if adaptive:
            check_identical(criterion.state_fingerprint(), "the criterion's state")
    if t.best_metric not in val or val[t.best_metric] is None:
        raise ConfigError(
            f"train.best_metric={t.best_metric!r} has no value on the validation split; "
            f"choose one of {sorted(scalars(val))} (or check that the split has valid labels)."
        )
    return val, multipliers, float(val[t.best_metric])


def _test_best(run: RunDir, model: nn.Module, task: Task, val_loader: DataLoader,
               test_loader: DataLoader, device: torch.device, amp: str, cfg: Config
               ) -> dict[str, Any]:
    """Test the best checkpoint before and after temperature scaling; rank 0 writes
    ``test_metrics.json``, ``temperature.json`` and the plots."""
    best = load_checkpoint(run.best, map_location=device)
    model.load_state_dict(best["model"])
    test = calibrated_test(model, task, val_loader, test_loader, device, amp, cfg.eval.n_bins,
                           cfg.eval.temperature_scaling, cfg.train.progress)
    test.update(
        checkpoint=run.best.name,
        epoch=best["epoch"],
        best_metric=cfg.train.best_metric,
        best_score=best["best_score"],
        precision=amp,
        class_names=task.class_names,
        family=task.family,
        score_metric=task.score_metric,
    )
    if is_main_process():
        write_json(run.test_metrics, test)
        run.write_temperature(test["temperature"])
        plot_run(run, test, task.class_names)
    return test


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter tensor: equal on every rank iff DDP kept them in sync."""
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


__all__ = [
    "build_optimizer",
    "build_scheduler",
    "calibrated_test",
    "fit",
    "resolve_device",
    "restore_training_state",
    "training_state",
    "validate",
]
