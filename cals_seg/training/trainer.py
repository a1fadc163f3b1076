"""The training run shared by every task: :func:`fit`.

Reads top to bottom like the run itself:

1. setup (``_setup``, the one reader of the config, which it resolves into typed pieces):
   the checks that need the built task, run directory, device, precision; model, criterion,
   optimizer, schedule, loaders;
2. (resume, in the setup) :func:`restore_training_state`, next to :func:`training_state` that
   writes it;
3. each epoch: :func:`train_one_epoch`; one validation pass that feeds the meters AND
   ``criterion.observe`` (and a margin rule's ``observe``); ``criterion.update_multipliers``
   (then the rule's ``step``); the epoch's files (history line, last checkpoint, best
   checkpoint, in that order);
4. the best checkpoint is tested once, before and after temperature scaling fitted on the
   validation split (:func:`cals_seg.evaluation.engine.calibrated_test`, the one test pass of every
   tool), and the plots are drawn; when its validation temperature's interval lies below 1
   (under-confident, where a margin penalty cannot help), one line says so and names the
   post-hoc command (:mod:`cals_seg.evaluation.confidence_regime`), also in
   ``test_metrics.json`` under ``under_confident``.

The task (data, model, meters) is built from the config by :func:`cals_seg.tasks.build_task`.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from cals_seg.config.checks import bounded_input, check_best_metric, check_resume
from cals_seg.config.rules import check_loggers, check_model_input
from cals_seg.config.schema import (
    Config,
    ConfigError,
    EvalConfig,
    TrainConfig,
    config_to_dict,
    save_config,
)
from cals_seg.data.checks import check_task_data
from cals_seg.data.crops import crop_warning, sample_sizes
from cals_seg.data.extra_inputs import request_extra_inputs
from cals_seg.errors import UserError
from cals_seg.evaluation.evaluator import EvalPlan, Evaluator
from cals_seg.evaluation.inference import NonFiniteLogitsError
from cals_seg.evaluation.stream import Inference, compute, scalars
from cals_seg.losses import AdaptiveLoss, build_loss
from cals_seg.losses.margin_rules import margin_rule_of
from cals_seg.runs.run import Run, load_weights
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
    rng_state,
    save_checkpoint,
    set_rng_state,
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
    model: nn.Module, optimizer, scheduler, criterion: nn.Module, scaler, config: dict[str, Any],
    num_classes: int, epoch: int, score: float, best_score: float, best_epoch: int,
    class_names: list[str] | None = None,
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
        "class_names": list(class_names) if class_names is not None else None,
        "config": config,  # config_to_dict of the run's config
        "rng": rng_state(),
    }


def restore_training_state(
    state: dict[str, Any], model: nn.Module, optimizer, scheduler, criterion: nn.Module, scaler,
    num_classes: int, where: Path,
) -> tuple[int, float | None, int | None]:
    """Inverse of :func:`training_state`; returns ``(next epoch, best score, best epoch)``."""
    load_weights(model, state, where, Run(where.parent).config_file, num_classes)
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
    infer: Inference, task: Task, loader: DataLoader, criterion: nn.Module, n_bins: int,
    progress: bool = False,
) -> dict[str, Any]:
    """One validation pass of ``infer`` (model, device, precision, protocol) feeding the task's
    meters and, for adaptive losses, ``criterion.observe`` (the statistics of the multiplier
    update) and the ``observe`` of a margin rule attached to it (``margin: auto``)."""
    meters = infer.meters(lambda: task.meters(n_bins))
    consumers: list[Any] = [_check_outputs, *meters.values()]
    if isinstance(criterion, AdaptiveLoss):
        consumers.append(criterion.observe)
    rule = margin_rule_of(criterion)
    if rule is not None:
        consumers.append(rule.observe)
    try:
        infer.evaluate(loader, consumers, progress, desc="val")
    except NonFiniteLogitsError:  # found by the evaluation's own check: in training, divergence
        raise NonFiniteLossError(_DIVERGED) from None
    return compute(meters)


_DIVERGED = (
    "validation: the model's outputs are NaN or infinite after this epoch (the training "
    "diverged); stopping. The last good checkpoint is left intact: lower the learning "
    "rate (optim.lr), enable train.grad_clip, or check the labels.")


def _check_outputs(logits: torch.Tensor, target: torch.Tensor) -> None:
    """A diverged training can leave finite weights whose outputs are not: stop with advice."""
    if not bool(logits.isfinite().all()):
        raise NonFiniteLossError(_DIVERGED)


def plot_run(run: Run, test: dict[str, Any] | None, class_names: list[str]) -> list[Path]:
    """Write the run's plots (multipliers, the ``margin: auto`` rule, training curves, test
    reliability diagrams)."""
    from cals_seg.visualization import plotting  # matplotlib is loaded only when a plot is drawn

    history = run.history()
    run.plots.mkdir(parents=True, exist_ok=True)
    written = []
    if plotting.plot_multiplier_curves(history, run.plots / "lambda_curves.png", class_names):
        written.append(run.plots / "lambda_curves.png")
    if plotting.plot_margin_evidence(history, run.plots / "margin_evidence.png"):  # auto
        written.append(run.plots / "margin_evidence.png")
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
def _epoch_line(epoch: int, epochs: int, train: dict, val: dict, metric: str, score: float,
                multipliers: dict[str, Any], improved: bool, seconds: float,
                remaining: float) -> str:
    lambdas = multipliers.get("lambda")
    lam = f"  mean lambda {sum(lambdas) / len(lambdas):.3g}" if lambdas else ""
    if multipliers.get("margin") is not None:  # margin: auto
        lam += f"  margin {multipliers['margin']:.2f}"
    eta = f"  ~{remaining / 60:.1f} min left" if remaining > 0 else ""
    return (
        f"epoch {epoch + 1:3d}/{epochs}  loss {train['loss']:.4f}  "
        f"val ECE {100 * val['ece']:.2f}%  {metric} {score:.4f}{lam}  "
        f"{'*' if improved else ' '} {seconds:.1f}s{eta}"
    )


@dataclass
class _Training:
    """What :func:`fit` resolves from the config once, at setup: past this point the loop and
    its helpers read these typed pieces, never the config."""

    run: Run
    t: TrainConfig
    e: EvalConfig
    plan: EvalPlan  # the final test's evaluation (the config's eval section)
    config: dict[str, Any]  # the resolved config as saved in every checkpoint
    infer: Inference  # the model (eval passes), device, precision, protocol
    train_model: nn.Module  # what the training step calls (DDP / compiled)
    criterion: nn.Module
    train_criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    loaders: tuple[DataLoader, DataLoader, DataLoader]  # train, val, test
    start_epoch: int = 0
    best_score: float | None = None
    best_epoch: int | None = None


# Not split further (over 80 lines): the run reads top to bottom, as nanoGPT's training script;
# the setup (where the config is read), the validation and update, and the final test are
# helpers.
def fit(cfg: Config, task: Task, resume: str | Path | None = None) -> dict[str, Any]:
    """:func:`train_and_test` holding the run folder's lock (:class:`RunLock`): one process
    trains or resumes a run at a time; a second is refused naming the holder's pid."""
    check_loggers(cfg.train.loggers)  # a missing package: its install command, before any folder
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
    s = _setup(cfg, task, resume)  # the only reader of cfg
    run, t, infer, main = s.run, s.t, s.infer, is_main_process()
    model, device, amp, k = infer.model, infer.device, infer.amp, task.num_classes
    train_loader, val_loader, _ = s.loaders
    loggers = RunLoggers(t.loggers if main else [], run.path, s.config, task.class_names,
                         s.start_epoch)
    best_score, best_epoch = s.best_score, s.best_epoch
    sign = 1.0 if t.best_mode == "max" else -1.0
    durations: list[float] = []
    for epoch in range(s.start_epoch, t.epochs):
        start = time.perf_counter()
        seed_epoch(train_loader, t.seed, epoch)
        lr = s.optimizer.param_groups[0]["lr"]
        train_stats = train_one_epoch(
            s.train_model, s.train_criterion, train_loader, s.optimizer, device, amp, s.scaler,
            t.grad_clip, t.progress, desc=f"epoch {epoch + 1}/{t.epochs}",
            debug_checks=t.debug_checks,
        )
        s.scheduler.step()
        val, multipliers, score = _validate_and_update(epoch, infer, task, val_loader,
                                                       s.criterion, s.e.n_bins, t)
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
            state = training_state(model, s.optimizer, s.scheduler, s.criterion, s.scaler,
                                   s.config, k, epoch, score, best_score, best_epoch,
                                   task.class_names)
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
    test = _test_best(run, infer, task, s.plan, t)
    if main:
        loggers.log_test(test)
    loggers.close()
    return test


def _setup(cfg: Config, task: Task, resume: str | Path | None) -> _Training:
    """Everything :func:`fit` needs, resolved from ``cfg`` once: the checks that need the built
    task, the run folder, device and precision, the model placed (channels-last, SyncBatchNorm,
    DDP, compile as the config asks), criterion, optimizer, schedule, loaders, and (resume)
    the restored state; writes ``config.yaml``."""
    t, e, run, main = cfg.train, cfg.eval, Run(resume if resume is not None else cfg.run_dir), \
        is_main_process()
    run.check_start(resume is not None)
    check_model_input(cfg, task)
    bounded = bounded_input(cfg)
    device = resolve_device(t.device)
    amp = resolve_amp(t.amp, device, warn=main)
    if t.threads:
        torch.set_num_threads(t.threads)
    model = task.model.to(device)
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if is_distributed() and t.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    train_model: nn.Module = model  # shares the parameters of model
    if is_distributed():
        ids = [device.index] if device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if t.compile:
        train_model = torch.compile(train_model)
    criterion = build_loss(cfg.loss.name, task.num_classes, ignore_index=task.ignore_index,
                           **cfg.loss.params).to(device)
    request_extra_inputs(task.train_set, criterion)  # e.g. the band map, made by the loader
    if task.family == "segmentation":  # a batch that cannot fit is refused before any work
        check_batch_memory(t.batch_size, cfg.data.crop_size, task.num_classes, device,
                           "data.crop_size", "lower it (--set data.crop_size=512) or "
                           "train.batch_size")
        side = max([v for v in (e.pad, e.resize) if v] + [e.window if e.mode == "slide" else 0])
        if side:
            check_batch_memory(e.batch_size, side, task.num_classes, device,
                               "eval.pad / eval.resize / eval.window",
                               "lower it, or eval.batch_size")
    check_best_metric(task, t.best_metric, e.n_bins)
    check_task_data(task, t.batch_size, bounded, get_world_size())
    if main and task.family == "segmentation":  # crops of mostly padding: slow, say so
        crops = crop_warning(cfg.data.crop_size, sample_sizes(task.train_set),
                             cfg.data.scale_range)
        if crops:
            print(f"warning: {crops}", file=sys.stderr, flush=True)
    optimizer = build_optimizer(cfg, model)
    workers = cfg.data.num_workers
    s = _Training(
        run=run, t=t, e=e, plan=EvalPlan.from_config(cfg, split="test"), config=config_to_dict(cfg),
        infer=Inference(model, device, amp, task.protocol), train_model=train_model,
        # the training loss compiled too (observe() and the update stay eager: once per epoch)
        criterion=criterion, train_criterion=torch.compile(criterion) if t.compile else criterion,
        optimizer=optimizer, scheduler=build_scheduler(cfg, optimizer),
        scaler=torch.amp.GradScaler("cuda") if amp == "fp16" else None,
        loaders=(make_loader(task.train_set, t.batch_size, True, workers, seed=t.seed),
                 make_loader(task.val_set, e.batch_size, False, workers),
                 make_loader(task.test_set, e.batch_size, False, workers)),
    )
    run.path.mkdir(parents=True, exist_ok=True)
    if resume is not None and run.last.is_file():  # else: a run without checkpoint, anew
        state = run.read_checkpoint("last", map_location=device)
        changed = check_resume(cfg, state["config"], run.last)
        s.start_epoch, s.best_score, s.best_epoch = restore_training_state(
            state, model, optimizer, s.scheduler, criterion, s.scaler, task.num_classes, run.last)
        if "train.epochs" in changed:
            s.scheduler = replay_schedule(cfg, optimizer, s.start_epoch)
        _refuse_finished(run, s.start_epoch, t.epochs)
        if main:
            run.trim_history(s.start_epoch)
            run.repair_best(state)
    if main:
        save_config(cfg, run.config_file)
        if cfg.model.arch == "external" and isinstance(cfg.model.factory, str):
            from cals_seg.models.consent import remember

            remember(run.path, cfg.model.factory)  # its factory was allowed to train it
        todo = (f"epochs {s.start_epoch + 1}..{t.epochs}" if s.start_epoch < t.epochs else
                f"all {t.epochs} epochs trained, testing the best checkpoint")
        print(f"{run.path}: {cfg.loss.name} on {device.type}, precision {precision_name(amp)}, "
              f"{todo}", flush=True)
    return s


def _refuse_finished(run: Run, start_epoch: int, epochs: int) -> None:
    """``--resume`` of a run whose every epoch is trained and tested: nothing to continue (one
    stopped between its last epoch and the test is tested, as a resume of it should)."""
    if start_epoch >= epochs and run.test_metrics.is_file():
        raise UserError(
            f"--resume {run.path}: the run is finished (all {epochs} epochs trained and tested, "
            f"{run.test_metrics.name} written); to train it longer, add --set train.epochs=N "
            f"with N > {epochs}; to evaluate it again, use tools/eval_seg.py {run.path}."
        )


def _validate_and_update(epoch: int, infer: Inference, task: Task, loader: DataLoader,
                         criterion: nn.Module, n_bins: int, t: TrainConfig
                         ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """The validation pass of ``epoch`` (meters and ``criterion.observe``), the multiplier
    update, then the margin rule's step (``margin: auto``: the margin of the next epoch), the
    torchrun guards, and the score of ``train.best_metric``."""
    broadcast_buffers(infer.model)  # every rank validates (and rank 0 saves) rank 0's BN stats
    val = validate(infer, task, loader, criterion, n_bins, t.progress)
    adaptive = isinstance(criterion, AdaptiveLoss)
    multipliers = criterion.update_multipliers(epoch) if adaptive else {}
    rule = margin_rule_of(criterion)
    if rule is not None:
        multipliers.update(rule.step(criterion, epoch))
    if is_distributed():  # cheap guards: DDP keeps parameters and multipliers identical
        check_identical(_fingerprint(infer.model), "the model parameters")
        if adaptive:
            check_identical(criterion.state_fingerprint(), "the criterion's state")
    if t.best_metric not in val or val[t.best_metric] is None:
        raise ConfigError(
            f"train.best_metric={t.best_metric!r} has no value on the validation split; "
            f"choose one of {sorted(scalars(val))} (or check that the split has valid labels)."
        )
    return val, multipliers, float(val[t.best_metric])


def _test_best(run: Run, infer: Inference, task: Task, plan: EvalPlan,
               t: TrainConfig) -> dict[str, Any]:
    """Test the best checkpoint: the evaluation of the config's plan
    (:class:`~cals_seg.evaluation.evaluator.Evaluator`: temperature scaling fitted on
    validation, the planned calibrators, conformal sets and corruptions, one test pass); rank
    0 writes ``test_metrics.json``, ``temperature.json`` and the plots. The calibrators fitted
    are the run's own (``<run>/calibrators``, which predict and export use).

    The test pass runs at the inference precision (``train.amp: auto`` is float32 on every CPU,
    :func:`~cals_seg.utils.precision.resolve_amp`), as eval_seg, predict_seg and the export do:
    the run's test metrics and temperature are those a later evaluation reproduces on any CPU."""
    best = run.read_checkpoint("best", map_location=infer.device)
    infer.model.load_state_dict(best["model"])
    amp = resolve_amp(t.amp, infer.device, warn=False, inference=True)
    loaded = Run(run.path, checkpoint=run.best, config=run.config, model=infer.model,
                 device=infer.device, precision=amp, family=task.family,
                 score_metric=task.score_metric, class_names=task.class_names,
                 protocol=infer.protocol, epoch=best["epoch"], task=task)
    test = Evaluator(loaded, replace(plan, progress=t.progress)).run().metrics
    test.update(
        checkpoint=run.best.name,
        epoch=best["epoch"],
        best_metric=t.best_metric,
        best_score=best["best_score"],
        precision=amp,
        class_names=task.class_names,
        family=task.family,
        score_metric=task.score_metric,
    )
    if is_main_process():
        run.write_test_metrics(test)
        run.write_temperature(test["temperature"])
        plot_run(run, test, task.class_names)
    return test


def _fingerprint(model: nn.Module) -> torch.Tensor:
    """One float64 sum per parameter tensor: equal on every rank iff DDP kept them in sync."""
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


__all__ = [
    "build_optimizer",
    "build_scheduler",
    "fit",
    "resolve_device",
    "restore_training_state",
    "training_state",
    "validate",
]
