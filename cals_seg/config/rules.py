"""One table of rules for every config key, checked by every tool before any work: the one home
of a config rule.

A key's *type* comes from the config dataclasses (:mod:`cals_seg.config.schema`, checked when the
config is built); its *range or choices* from :data:`RULES` below (one entry per key, a test keeps
the table complete); the checks that depend on what consumes a value or on other keys (a device
this machine has, a name a registry knows, values that must agree, a loss's own parameter checks,
the evaluation protocol's own validation, an installed logger) are the functions of
:data:`CROSS_RULES`; then the paths (:func:`check_paths`). :func:`check_all` runs the three in that
order, once per command (``cals_seg.config.checks.check_config``). Every refusal has one format,
the key, what is allowed, the value and the fix::

    train.epochs: expected an integer >= 1, got 0; e.g. --set train.epochs=30.

The builders of :mod:`cals_seg.tasks` call the same functions for what they create (the evaluation
protocol, the class count found in the data, the colour table), so a builder used without
``check_config`` refuses the same values with the same words. Rules that need the built network
(``data.crop_size`` against its output stride, a classifier's ``data.image_size``):
:func:`check_model_input`. Which keys may differ between two configs of one run (a resume, a
study's reused run): :data:`KEY_GROUPS` and :func:`flatten_config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cals_seg.config.schema import Config, ConfigError, field_types, yaml_text

# Largest image side, tile or input size a config may ask for (a 16384 x 16384 float32 input of
# one channel is 1 GiB: anything larger is a typo, not a protocol).
MAX_SIZE = 16384
MAX_SEED = 2**32 - 1  # NumPy's seeds
# Datasets generated at data.root when it is missing; every other dataset must exist there.
EMBEDDED_DATASETS = ("synthetic", "synthetic_cls", "synthetic_text")


@dataclass(frozen=True)
class Rule:
    """What a key allows: ``ok(value)``, said as ``allowed``; the fix suggests ``example``
    (the default when None) or says ``fix``."""

    allowed: str
    ok: Callable[[Any], bool]
    example: Any = None
    fix: str | None = None


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _colours(value: Any) -> bool:
    from cals_seg.data.colours import is_colour  # the colour table's own rule; no torch

    return all(is_colour(c) for c in value)


def ints(lo: int, hi: int | None = None, example: Any = None, fix: str | None = None) -> Rule:
    """An integer in ``[lo, hi]``."""
    text = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return Rule(text, lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v
                and (hi is None or v <= hi), example, fix)


def nums(lo: float, hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
         example: Any = None, fix: str | None = None) -> Rule:
    """A finite number in the interval (open or closed at each end)."""
    if hi is None:
        text = f"a number {'>' if lo_open else '>='} {lo:g}"
    else:
        text = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def ok(v: Any) -> bool:
        if not _finite(v):
            return False
        above = v > lo if lo_open else v >= lo
        below = hi is None or (v < hi if hi_open else v <= hi)
        return above and below

    return Rule(text, ok, example, fix)


def choices(*values: Any, fix: str | None = None) -> Rule:
    shown = [repr(v) for v in values]
    text = " or ".join(shown) if len(values) == 2 else f"one of [{', '.join(shown)}]"
    return Rule(text, lambda v: v in values, values[0], fix)


def optional(rule: Rule, fix: str | None = None) -> Rule:
    """``rule`` or null."""
    return Rule(f"{rule.allowed} or null", lambda v: v is None or rule.ok(v), rule.example,
                fix or rule.fix)


def interval(lo: float, hi: float, lo_open: bool = True) -> Rule:
    """``[low, high]`` with ``lo < low <= high <= hi`` (``lo <= low`` when not ``lo_open``)."""
    left = "<" if lo_open else "<="
    return Rule(
        f"a list [low, high] with {lo:g} {left} low <= high <= {hi:g}",
        lambda v: isinstance(v, list) and len(v) == 2 and all(_finite(x) for x in v)
        and (v[0] > lo if lo_open else v[0] >= lo) and v[0] <= v[1] <= hi,
    )


SIZE = ints(1, MAX_SIZE)
TYPE_ONLY = None  # the dataclass type is the whole rule (or a cross rule below checks it)

# Every leaf key of Config -> its range or choices.
RULES: dict[str, Rule | None] = {
    "name": Rule("a folder name (not empty, no '/', not '.' or '..')",
                 lambda v: v not in ("", ".", "..") and "/" not in v and "\\" not in v,
                 fix="e.g. --set name=my_run"),
    "output_dir": Rule("a folder path (not empty)", lambda v: v != "", fix="e.g. --set "
                       "output_dir=runs"),
    "data.name": TYPE_ONLY,  # a registered dataset: cross rule
    "data.root": Rule("a folder path (not empty)", lambda v: v != ""),
    "data.num_classes": ints(2, 100_000),
    "data.ignore_index": TYPE_ONLY,  # depends on the task family: cross rule
    "data.crop_size": SIZE,
    "data.scale_range": interval(0, 10),
    "data.eval_size": optional(SIZE),  # segmentation refuses it: cross rule
    "data.val_fraction": nums(0, 1, hi_open=True),
    "data.split_seed": ints(0, MAX_SEED),
    "data.num_workers": ints(0, 256),
    "data.synthetic": TYPE_ONLY,  # the generator's own keyword checks (named data.synthetic)
    "data.image_size": SIZE,
    "data.crop_scale": interval(0, 1),
    "data.color_jitter": nums(0, 1),
    "data.random_erasing": nums(0, 1),
    "data.val_per_class": ints(1),
    "data.split_files": TYPE_ONLY,  # files: cross rule
    "data.val_count": ints(1),
    "data.max_len": ints(1, 1_000_000),
    "data.min_freq": ints(1),
    "data.vocab_size": optional(ints(2, 100_000_000)),
    "data.class_names": TYPE_ONLY,  # num_classes different names: cross rule
    "data.image_dir": Rule("a folder name (not empty)", lambda v: v.strip() != ""),
    "data.mask_dir": Rule("a folder name (not empty)", lambda v: v.strip() != ""),
    "data.palette": optional(Rule(  # one per class: cross rule
        "a list of [r, g, b] colours with values in [0, 255]", lambda v: _colours(v),
        fix="e.g. --set 'data.palette=[[0, 0, 0], [128, 0, 0]]' (one per class)")),
    "data.void_colours": Rule("a list of [r, g, b] colours with values in [0, 255]",
                              lambda v: _colours(v), fix="e.g. --set 'data.void_colours=[[255, "
                              "255, 255]]'"),
    "data.unknown_colours": choices("error", "void"),
    "data.text_strip": Rule(
        "a list of steps out of ['headers', 'quotes', 'signature']",
        lambda v: set(v) <= {"headers", "quotes", "signature"}, fix="e.g. --set "
        "data.text_strip=[headers, quotes, signature] (or [] to keep posts whole)"),
    "model.arch": TYPE_ONLY,  # an architecture of the task's model library: cross rule
    "model.encoder_name": TYPE_ONLY,  # a backbone of that library: cross rule
    "model.encoder_weights": TYPE_ONLY,  # imagenet, null or a file: cross rule
    "model.params": TYPE_ONLY,  # the model's constructor keywords, checked when it is built
    "model.embed_dim": ints(1, 100_000),
    "model.glove_path": TYPE_ONLY,  # a file: cross rule
    "model.factory": TYPE_ONLY,  # a factory that imports, with arch external: cross rule
    "model.weights": TYPE_ONLY,  # a weights file: checked where it is read (import_model)
    "model.weights_key": optional(Rule("an entry name (not empty)", lambda v: v != "")),
    "model.key_map": Rule("a mapping of key prefixes to their replacements (strings)",
                          lambda v: all(isinstance(k, str) and isinstance(x, str)
                                        for k, x in v.items()),
                          fix="e.g. --set 'model.key_map={module.: \"\"}'"),
    "model.mean": Rule("three numbers in [0, 1] (statistics of [0, 1] pixels)",
                       lambda v: len(v) == 3 and all(_finite(x) and 0 <= x <= 1 for x in v),
                       fix="divide statistics of 0-255 pixels by 255, e.g. --set "
                       "'model.mean=[0.485, 0.456, 0.406]'"),
    "model.std": Rule("three numbers > 0 (statistics of [0, 1] pixels)",
                      lambda v: len(v) == 3 and all(_finite(x) and x > 0 for x in v),
                      fix="divide statistics of 0-255 pixels by 255, e.g. --set "
                      "'model.std=[0.229, 0.224, 0.225]'"),
    "model.output_stride": optional(ints(1, 1024), fix="or null for the network's own"),
    "model.output_key": optional(Rule("an entry name (not empty)", lambda v: v != "")),
    "model.align_corners": TYPE_ONLY,
    "loss.name": TYPE_ONLY,  # a registered loss: cross rule
    "contrib": TYPE_ONLY,  # modules of cals_seg/contrib/, checked when the config is built
    "loss.params": TYPE_ONLY,  # the loss's own checks (build_loss), named loss.params.<key>
    "optim.name": choices("adamw", "sgd"),
    "optim.lr": nums(0, lo_open=True, example=0.001),
    "optim.weight_decay": nums(0, 1, fix="use 0 for none, e.g. 0.0001"),
    "optim.momentum": nums(0, 1, hi_open=True),
    "optim.schedule": choices("cosine", "multistep", "constant"),
    "optim.milestones": Rule(
        "a list of increasing epochs >= 1",
        lambda v: all(isinstance(m, int) and m >= 1 for m in v)
        and all(a < b for a, b in zip(v, v[1:], strict=False)), fix="e.g. --set "
        "optim.milestones=[20, 40]"),
    "optim.gamma": nums(0, 1, lo_open=True),
    "train.epochs": ints(1, example=30),
    "train.batch_size": ints(1, example=8),
    "train.seed": ints(0, MAX_SEED),
    "train.device": TYPE_ONLY,  # a device this PyTorch knows and this machine has: cross rule
    "train.amp": choices("auto", "none", "bf16", "fp16"),
    "train.grad_clip": optional(nums(0, lo_open=True), fix="use null for no clipping"),
    "train.best_metric": TYPE_ONLY,  # its direction: cross rule; a metric of the meters:
    # checks.check_best_metric (needs the task)
    "train.best_mode": choices("max", "min"),
    "train.threads": optional(ints(1, 4096)),
    "train.progress": TYPE_ONLY,
    "train.sync_bn": TYPE_ONLY,
    "train.channels_last": TYPE_ONLY,
    "train.compile": TYPE_ONLY,
    "train.loggers": TYPE_ONLY,  # known names whose package is installed: cross rule
    "train.debug_checks": TYPE_ONLY,
    "eval.batch_size": ints(1, example=8),
    "eval.n_bins": ints(1, 10_000, example=15),
    "eval.temperature_scaling": TYPE_ONLY,
    "eval.num_maps": ints(0),
    "eval.mode": choices("whole", "slide", fix="e.g. --set eval.mode=slide eval.window=512 "
                         "eval.stride=341 (tiles), or eval.mode=whole with eval.resize=1024"),
    "eval.resize": optional(SIZE, fix="or null for none"),
    "eval.pad": optional(SIZE, fix="or null for none"),
    "eval.window": ints(1, MAX_SIZE, example=512),
    "eval.stride": TYPE_ONLY,  # in [1, eval.window]: the protocol's own rule (cross rule)
    "eval.calibrators": TYPE_ONLY,  # registered calibrators: cross rule (check_eval_plan)
    "eval.calibrator_params": TYPE_ONLY,  # their parameters: cross rule
    "eval.conformal": TYPE_ONLY,  # the words of --conformal: cross rule
    "eval.shift": TYPE_ONLY,  # registered corruptions and severities: cross rule
    "eval.shift_seed": ints(0, MAX_SEED),
    "eval.calibrator_fit_shift": TYPE_ONLY,
}

def config_keys(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the config dataclasses -> its default."""
    keys: dict[str, Any] = {}
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys.update(config_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
                else f.default
            keys[f"{prefix}{f.name}"] = default
    return keys


def refuse(key: str, allowed: str, value: Any, fix: str) -> ConfigError:
    """The one message format: ``key: expected <allowed>, got <value>; <fix>.``"""
    return ConfigError(f"{key}: expected {allowed}, got {value!r}; {fix.rstrip('.')}.")


def value_of(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_rules(cfg: Config) -> None:
    """Every key's range or choices (:data:`RULES`).

    Raises:
        ConfigError: the first key whose value is outside its rule, in the one format.
    """
    defaults = config_keys()
    for key, rule in RULES.items():
        if rule is None:
            continue
        value = value_of(cfg, key)
        try:
            ok = rule.ok(value)
        except (TypeError, AttributeError):  # a value set in Python, past load_config
            ok = False
        if not ok:
            example = rule.example if rule.example is not None else defaults[key]
            fix = rule.fix or f"e.g. --set {key}={yaml_text(example)}"
            given = _in_force(cfg, key)
            if rule.fix is None and given is not None and given != value and _passes(rule, given):
                fix = f"e.g. --set {key}={yaml_text(given)} (the config file's value)"
            raise refuse(key, rule.allowed, value, fix)


def _in_force(cfg: Config, key: str) -> Any:
    """The value of ``key`` in the config file ``cfg`` was read from, before ``--set`` (None
    when the file does not set it, or ``cfg`` was not read from a file)."""
    node: Any = cfg.__dict__.get("_in_force")
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _passes(rule: Rule, value: Any) -> bool:
    try:
        return bool(rule.ok(value))
    except (TypeError, AttributeError, ValueError):
        return False


# Keys by what a difference in their value changes, for two configs of one run. A key in no group
# changes what the run computes. ``neutral``: where the run is written and how it is shown, never
# a result (a study reuses a finished run whatever they say); ``resumable``: what a resume may
# change beside those: names and paths, the device, the live logs, the length of the run (the
# learning-rate schedule is rebuilt for it) and the evaluation, which is re-run after training.
KEY_GROUPS: dict[str, tuple[str, ...]] = {
    "neutral": ("output_dir", "train.progress", "train.threads"),
    "resumable": (
        "name", "data.root", "data.num_workers", "train.epochs", "train.device", "train.loggers",
        "train.debug_checks", "eval.batch_size", "eval.n_bins", "eval.temperature_scaling",
        "eval.num_maps", "eval.mode", "eval.resize", "eval.pad", "eval.window", "eval.stride",
        "eval.calibrators", "eval.calibrator_params", "eval.conformal", "eval.shift",
        "eval.shift_seed", "eval.calibrator_fit_shift",  # the plan of the final test
        "data.class_names",  # display names only
        "contrib",  # which experiments are registered, not what a run computes
    ),
}


def keys_of(*groups: str) -> tuple[str, ...]:
    """The keys of the named :data:`KEY_GROUPS`, in table order."""
    return tuple(k for g in groups for k in KEY_GROUPS[g])


def flatten_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict (:func:`cals_seg.config.schema.config_to_dict`) as ``{dotted key: value}``
    down to the keys of :class:`Config` (sections are opened; a mapping-valued key such as
    ``loss.params`` or ``data.synthetic`` is one value)."""
    sections = {f.name for f in dataclasses.fields(Config)}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if not prefix and key in sections and isinstance(value, dict):
            out.update(flatten_config(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted keys (:func:`flatten_config`) whose values differ between two config dicts (a key
    only one of them has, from a config saved before the key existed, is not a change)."""
    a, b = flatten_config(old), flatten_config(new)
    return sorted(k for k in b if k in a and a[k] != b[k])


# ----------------------------------------------------------------------------- cross rules
def family(cfg: Config) -> str | None:
    """``segmentation``, ``classification`` or ``text``: the kind the dataset ``data.name``
    registered with (:data:`cals_seg.data.registry.DATASETS`); None: unknown dataset."""
    from cals_seg.data.registry import dataset_kind

    return dataset_kind(cfg.data.name)


def check_dataset_name(cfg: Config) -> None:
    """``data.name``: a registered dataset; a misspelt one is refused listing them all."""
    from cals_seg.data.registry import DATASETS

    if family(cfg) is None:
        raise refuse("data.name", f"one of {list(DATASETS)}", cfg.data.name,
                     "e.g. --set data.name=synthetic")


def check_ignore_index(cfg: Config) -> None:
    d = cfg.data
    if family(cfg) == "segmentation":
        if not d.num_classes <= d.ignore_index <= 255:
            raise refuse("data.ignore_index", f"an integer in [data.num_classes, 255] = "
                         f"[{d.num_classes}, 255] (masks are 8-bit)", d.ignore_index,
                         "e.g. --set data.ignore_index=255 (VOC's void label)")
    elif d.ignore_index >= 0:
        raise refuse("data.ignore_index", "a negative integer (classification ignores no "
                     "sample)", d.ignore_index, "use --set data.ignore_index=-100")


def check_device(cfg: Config) -> None:
    """``train.device``: ``auto``, or a device this PyTorch accepts and this machine has; and
    ``train.amp: fp16`` only where that device is CUDA."""
    import torch

    value, key = cfg.train.device, "train.device"
    allowed = "auto, cpu, cuda or cuda:N"
    if value != "auto":
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise refuse(key, allowed, value, "e.g. --set train.device=auto") from None
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise refuse(key, f"{allowed} (this machine has no CUDA GPU: auto or cpu)",
                             value, "use --set train.device=cpu (or auto)")
            if device.index is not None and device.index >= count:
                raise refuse(key, f"cuda:0 .. cuda:{count - 1} (this machine has {count} "
                             "GPU(s))", value, "e.g. --set train.device=cuda:0")
        elif device.type == "mps":
            if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
                raise refuse(key, f"{allowed} (this machine has no MPS device)", value,
                             "use --set train.device=cpu (or auto)")
        elif device.type != "cpu":
            raise refuse(key, allowed, value, "e.g. --set train.device=auto")
    if cfg.train.amp == "fp16":
        from cals_seg.utils.precision import resolve_device

        if resolve_device(value).type != "cuda":
            raise refuse("train.amp", "auto, none or bf16 on a CPU (fp16 needs a CUDA device)",
                         "fp16", "use --set train.amp=auto (bf16 where the CPU has it natively)")


def check_names(cfg: Config) -> None:
    """``loss.name``, ``model.arch``, ``model.encoder_name``: names their registries know."""
    from cals_seg.losses import LOSSES

    if cfg.loss.name not in LOSSES:
        raise refuse("loss.name", f"one of {sorted(LOSSES)}", cfg.loss.name,
                     LOSSES.beside_hint(cfg.loss.name) or "e.g. --set loss.name=ce")
    check_model_names(cfg)


def check_eval_plan(cfg: Config) -> None:
    """``eval.calibrators``, ``eval.calibrator_params``, ``eval.conformal``, ``eval.shift``: the
    plan of the evaluation, checked against the registries before any work (the same checks
    as the flags that write these keys)."""
    from cals_seg.calibrators import CALIBRATORS
    from cals_seg.errors import UserError

    e = cfg.eval
    for name in e.calibrators:
        if name not in CALIBRATORS:
            raise refuse("eval.calibrators", f"names out of {list(CALIBRATORS)}", name,
                         CALIBRATORS.beside_hint(name) or "e.g. --set eval.calibrators=[ts]")
    try:
        from cals_seg.evaluation.evaluator import check_calibrator_params, parse_conformal_spec

        check_calibrator_params(e.calibrator_params, "eval.calibrator_params")
        if e.conformal:
            parse_conformal_spec(e.conformal, "eval.conformal")
        if e.shift:
            from cals_seg.data.corruptions import parse_shifts

            parse_shifts(list(e.shift), e.shift_seed)
    except ConfigError:
        raise
    except UserError as err:
        message = str(err)
        if e.shift and message.startswith("--shift"):
            message = "eval.shift" + message[len("--shift"):]
        raise ConfigError(message) from None
    try:  # what the task family can run (classification: no space), before any work
        from cals_seg.evaluation.evaluator import check_plan_for

        kind = family(cfg)  # the dataset registry's kind (check_dataset_name refused others)
        if kind is not None:
            check_plan_for("segmentation" if kind == "segmentation" else "classification",
                           e.calibrators,
                           parse_conformal_spec(e.conformal) if e.conformal else None, e.shift)
    except ConfigError:
        raise
    except UserError as err:
        raise ConfigError(str(err)) from None
    if e.calibrator_fit_shift and not e.calibrators:
        raise refuse("eval.calibrator_fit_shift", "false without eval.calibrators", True,
                     "name the calibrators, e.g. --set eval.calibrators=[ts]")


def check_model_names(cfg: Config) -> None:
    """``model.arch`` and ``model.encoder_name`` of the dataset's family (an smp architecture and
    encoder; ``timm`` and a timm model; ``gpcn``), and ``model.params`` by the model's signature
    (:func:`check_model_params`). The task builders call it too."""
    m, kind = cfg.model, family(cfg)
    if kind == "segmentation" and m.arch != "external":  # external: check_external_model
        import segmentation_models_pytorch as smp

        archs = sorted(smp.MODEL_ARCHITECTURES_MAPPING)
        if m.arch.lower() not in archs:
            raise refuse("model.arch", f"an smp architecture, one of {archs}", m.arch,
                         "e.g. --set model.arch=deeplabv3")
        import timm

        known = m.encoder_name in smp.encoders.get_encoder_names() or (
            m.encoder_name.startswith("tu-") and timm.is_model(m.encoder_name[3:]))
        if not known:
            raise refuse("model.encoder_name", "an smp encoder (smp.encoders."
                         "get_encoder_names()) or tu-<timm model>", m.encoder_name,
                         "e.g. --set model.encoder_name=resnet18")
        check_model_params(m.params, smp.MODEL_ARCHITECTURES_MAPPING[m.arch.lower()],
                           timm_encoder=m.encoder_name.startswith("tu-"),
                           own=("encoder_name", "encoder_weights", "classes", "activation",
                                "in_channels", "aux_params"))  # images are RGB, logits out
    elif kind == "classification":
        import timm

        if m.arch != "timm":
            raise refuse("model.arch", "'timm' for image classification", m.arch,
                         "use --set model.arch=timm")
        if not timm.is_model(m.encoder_name):
            raise refuse("model.encoder_name", "a timm model (timm.list_models())",
                         m.encoder_name, "e.g. --set model.encoder_name=resnet50")
    elif kind == "text":
        if m.arch != "gpcn":
            raise refuse("model.arch", "'gpcn' for text", m.arch, "use --set model.arch=gpcn")
        from cals_seg.models.text import GlobalPoolingCNN

        params = dict(m.params)
        freeze = params.pop("freeze_glove", False)
        if not isinstance(freeze, bool):
            raise refuse("model.params.freeze_glove", "true or false", freeze,
                         "e.g. --set model.params.freeze_glove=false")
        check_model_params(params, GlobalPoolingCNN, timm_encoder=False,
                           own=("vocab_size", "embed_dim", "num_classes", "embedding",
                                "freeze"))

MAX_WIDTH = 65536  # largest layer width, kernel or pool a model keyword may ask for


def _param_rule(name: str, default: Any, hint: Any) -> Rule | None:
    """The rule of a model keyword, by kind: its ``Literal`` choices; a probability when its
    name says dropout; a width or size in ``[1, MAX_WIDTH]`` for integers (one or a list);
    true/false for flags; None when the default says nothing (``None``)."""
    if typing.get_origin(hint) is typing.Literal:
        return choices(*typing.get_args(hint))
    if "dropout" in name:
        return nums(0, 1)
    if isinstance(default, bool):
        return Rule("true or false", lambda v: isinstance(v, bool))
    if isinstance(default, int):
        return ints(1, MAX_WIDTH)
    if isinstance(default, float):
        return nums(0)
    if isinstance(default, tuple | list) and default and all(
            isinstance(x, int) and not isinstance(x, bool) for x in default):
        return Rule(f"a non-empty list of integers in [1, {MAX_WIDTH}]",
                    lambda v: isinstance(v, list | tuple) and len(v) > 0 and all(
                        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= MAX_WIDTH
                        for x in v))
    return None


def check_model_params(params: dict[str, Any], model_class: type, timm_encoder: bool,
                       own: tuple[str, ...] = ()) -> None:
    """``model.params``: keywords of the model's constructor, each by the rule of its kind
    (:func:`_param_rule`); the keys the config sets itself (``own``) are not among them. With
    an smp model, keywords it does not name reach the encoder, where only a timm encoder
    (``tu-...``) checks them: elsewhere they would be dropped silently, so they are refused."""
    import inspect

    signature = inspect.signature(model_class.__init__)
    try:
        hints = typing.get_type_hints(model_class.__init__)
    except Exception:  # annotations this Python cannot evaluate: the kinds of the defaults
        hints = {}
    named = {p.name: p.default for p in signature.parameters.values()
             if p.name not in ("self", "kwargs") and p.name not in own
             and p.kind is not inspect.Parameter.VAR_KEYWORD}
    for key, value in params.items():
        where = f"model.params.{key}"
        if key in own or (key not in named and not timm_encoder):
            raise refuse(where, f"a keyword of {model_class.__name__}, one of {list(named)}",
                         value, f"remove {where}" + (
                             f" and set model.{key}" if key.startswith("encoder_") else ""))
        default = named.get(key, inspect.Parameter.empty)
        rule = _param_rule(key, default, hints.get(key))
        if rule is not None and not rule.ok(value):
            shown = "" if default is inspect.Parameter.empty else f" (the default: {default!r})"
            raise refuse(where, rule.allowed, value, f"e.g. remove {where}{shown}")


def check_class_names(cfg: Config) -> None:
    """``data.class_names``: null, or ``data.num_classes`` different, non-empty names.

    Raises:
        ConfigError: naming the key and the fix.
    """
    names, k = cfg.data.class_names, cfg.data.num_classes
    if names is None:
        return
    if len(names) != k:
        raise ConfigError(
            f"data.class_names: {len(names)} names for data.num_classes={k} classes; give one "
            "name per class, in class-index order (or null for the dataset's own names)."
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice or not all(n.strip() for n in names):
        what = f"the names {twice} occur twice" if twice else "a name is empty"
        raise ConfigError(f"data.class_names: {what}; each class needs its own name.")


def check_eval_protocol(cfg: Config) -> None:
    """``eval.mode``, ``window``, ``stride``, ``resize``, ``pad`` as
    :class:`cals_seg.evaluation.inference.EvalProtocol` takes them: the rule is the protocol's own
    (it validates itself when it is built, e.g. ``1 <= stride <= window``, written there once);
    here it is reported under the config keys, with a fix.

    Raises:
        ConfigError: naming the key and the fix.
    """
    from cals_seg.evaluation.inference import EvalProtocol

    e = cfg.eval
    stride = max(1, e.window * 2 // 3) if isinstance(e.window, int) else 341
    fixes = {
        "mode": "e.g. --set eval.mode=slide eval.window=512 eval.stride=341 (tiles), or "
                "eval.mode=whole with eval.resize=1024",
        "window": "e.g. --set eval.window=512",
        "stride": f"e.g. --set eval.stride={stride} (two thirds of the window)",
        "resize": "or null for none",
        "pad": "or null for none",
    }
    try:
        EvalProtocol(mode=e.mode, resize=e.resize, pad=e.pad, window=e.window, stride=e.stride)
    except ValueError as err:
        text = str(err)
        field = text.split("`")[1] if text.count("`") >= 2 else "mode"
        message = text.replace("`window`", "eval.window").replace(f"`{field}`", f"eval.{field}")
        raise ConfigError(f"{message.rstrip('.')}; {fixes.get(field, '')}.") from None


def check_eval_size(cfg: Config) -> None:
    """``data.eval_size`` is for classification: a segmentation split is evaluated at each
    image's own resolution, its network input chosen by ``eval.*``."""
    size = cfg.data.eval_size
    if size is not None and family(cfg) == "segmentation":
        raise ConfigError(
            f"data.eval_size: {size} would shrink the masks of a segmentation split; "
            "metrics are now taken at each image's own resolution. Set data.eval_size: null "
            f"and choose the network input with eval.pad: {size} (pad, the paper's VOC "
            f"protocol), eval.resize: {size} (longest side), or eval.mode: slide (tiles)."
        )


def check_palette(cfg: Config) -> None:
    """``data.palette``: one colour per class; ``data.void_colours`` only beside it (the colours
    themselves: :data:`RULES`, and the colour table when it is built)."""
    d = cfg.data
    if d.palette is None:
        if d.void_colours:
            raise ConfigError("data.void_colours is only read with data.palette (colour masks); "
                              "set data.palette or remove data.void_colours.")
        return
    if len(d.palette) != d.num_classes:
        raise ConfigError(f"data.palette: {len(d.palette)} colours for data.num_classes="
                          f"{d.num_classes}; give one [r, g, b] per class, in class order.")


# The direction of each validation metric a run can select its best epoch by.
LOWER_BETTER = ("ece", "aece", "mce", "cwce", "nll", "brier", "loss")
HIGHER_BETTER = ("miou", "acc")


def check_best_mode(cfg: Config) -> None:
    """``train.best_mode`` in the direction of ``train.best_metric`` (else the worst epoch
    would be kept)."""
    t = cfg.train
    direction = ("min" if t.best_metric in LOWER_BETTER
                 else "max" if t.best_metric in HIGHER_BETTER else None)
    if direction is not None and direction != t.best_mode:
        better = "lower" if direction == "min" else "higher"
        raise ConfigError(
            f"train.best_metric={t.best_metric!r} is {better}-better, but train.best_mode="
            f"{t.best_mode!r} would keep its worst epoch; set train.best_mode={direction}."
        )


def check_loss_params(cfg: Config) -> None:
    """``loss.params``: finite numbers, and the loss's own checks of their types and ranges
    (the loss is built once, before any data is read), named ``loss.params.<key>``."""
    from cals_seg.losses import build_loss

    for key, value in cfg.loss.params.items():  # NaN and infinities: refused like everywhere
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"loss.params.{key}: expected a finite number, got {value!r}; "
                              f"remove it (the loss's default) or set a number.")
    try:
        build_loss(cfg.loss.name, cfg.data.num_classes, ignore_index=cfg.data.ignore_index,
                   **cfg.loss.params)
    except (ValueError, TypeError) as err:
        raise ConfigError(_loss_message(str(err), cfg)) from None


def _loss_message(message: str, cfg: Config) -> str:
    """A loss's own refusal (``Expected `alpha` in [0, 1], but got -1.``) as the one format,
    naming the key: ``loss.params.alpha: expected ... ; set loss.params.alpha=...``."""
    if message.startswith("loss."):
        return message
    named = re.search(r"`(\w+)`", message)
    if named and named.group(1) in cfg.loss.params:
        key = f"loss.params.{named.group(1)}"
        return (f"{key}: {message[0].lower()}{message[1:].rstrip('.')}; set {key} in that "
                f"range (the loss {cfg.loss.name!r} refuses {cfg.loss.params[named.group(1)]!r}).")
    if named and named.group(1) != cfg.loss.name:
        key = f"loss.params.{named.group(1)}"
        return f"{key} (default): {message} Set {key} to a value the loss takes."
    return f"loss.params ({cfg.loss.name}): {message}"


# logger name -> (module that must import, pip package, extra of cals_seg that installs it)
LOGGERS: dict[str, tuple[str | None, str | None, str | None]] = {
    "csv": (None, None, None),
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb", "wandb"),
}


class LoggerError(ConfigError):
    """An unknown logger name, or a logger whose package is not installed."""


def check_loggers(names: Sequence[str]) -> None:
    """Refuse unknown names and loggers whose package is missing (before any training).

    Raises:
        LoggerError: naming ``train.loggers`` and the fix (the valid names, or the ``pip``
            command that installs the package).
    """
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise LoggerError(
            f"train.loggers: expected a list of names, got {names!r}; e.g. [csv, tensorboard]."
        )
    for name in names:
        if name not in LOGGERS:
            raise LoggerError(
                f"train.loggers: unknown logger {name!r}; valid names are {sorted(LOGGERS)}."
            )
        module, package, extra = LOGGERS[name]
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise LoggerError(
                f"train.loggers: {name!r} needs the {package} package, which is not installed; "
                f'install it with: pip install "cals_seg[{extra}]" (or: pip install {package}).'
            ) from None


def check_train_loggers(cfg: Config) -> None:
    """``train.loggers``: :func:`check_loggers` (a missing package fails here, with its install
    command, before any data is read)."""
    check_loggers(cfg.train.loggers)


# Every rule between keys, or of what consumes a value, in the order check_all runs them.
def check_external_model(cfg: Config) -> None:
    """``model.arch: external`` (segmentation) needs a ``model.factory`` that resolves
    (:func:`cals_seg.models.external.resolve_factory`); ``factory`` and ``weights`` are read
    with that arch only."""
    m = cfg.model
    if m.arch != "external":
        for key, value in (("factory", m.factory), ("weights", m.weights)):
            if value is not None:
                raise refuse(f"model.{key}", "null unless model.arch is 'external'", value,
                             f"set model.arch=external to use a network of your own, or remove "
                             f"model.{key}")
        return
    if family(cfg) != "segmentation":
        return  # check_names refuses the arch for that family
    if m.factory is None:
        raise refuse("model.factory", "'package.module:function' or torchvision:NAME / "
                     "smp:NAME / transformers:NAME with model.arch: external", None,
                     "e.g. --set model.factory=torchvision:deeplabv3_resnet50")
    from cals_seg.models.external import resolve_factory

    resolve_factory(m.factory)  # ConfigError naming model.factory and the fix


CROSS_RULES: list[Callable[[Config], None]] = [
    check_dataset_name, check_ignore_index, check_device, check_names, check_external_model,
    check_eval_protocol, check_eval_size, check_class_names, check_palette, check_best_mode,
    check_loss_params, check_train_loggers, check_eval_plan,
]


# ----------------------------------------------------------------------------- paths
def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_folder(key: str, value: str, must_exist: bool, writable: bool = False) -> None:
    """A folder that exists (``must_exist``), or a path where one can be created."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise refuse(key, "a folder", value, f"{value} is a file: name a folder")
        if writable and not os.access(path, os.W_OK):
            raise refuse(key, "a writable folder", value, "name a folder you can write to")
        return
    if must_exist:
        raise refuse(key, "an existing folder", value, f"{value} does not exist: name the "
                     "folder that holds the data (or check its spelling)")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise refuse(key, "a folder path", value, f"{base} is a file, so no folder can be "
                     "created under it")
    if not os.access(base, os.W_OK):
        raise refuse(key, "a folder that can be created", value, f"{base} is not writable")


def check_file(key: str, value: str, allowed: str = "an existing file") -> None:
    path = Path(value).expanduser()
    if path.is_dir():
        raise refuse(key, allowed, value, f"{value} is a folder: name a file")
    if not path.is_file():
        raise refuse(key, allowed, value, f"{value} does not exist")


def check_paths(cfg: Config, reads_data: bool = False, writes_run: bool = False) -> None:
    """Paths by what they must be: the data folder (where the data is read), the run folder
    (where a run is written), weights and word-vector files (always: the model needs them)."""
    d, m = cfg.data, cfg.model
    if reads_data:
        check_folder("data.root", d.root, must_exist=d.name not in EMBEDDED_DATASETS,
                     writable=False)
        if d.name in EMBEDDED_DATASETS and not Path(d.root).exists():
            check_folder("data.root", d.root, must_exist=False, writable=True)
        if d.name == "split_files":
            for split, name in d.split_files.items():
                if not isinstance(name, str) or not name:
                    raise refuse(f"data.split_files.{split}", "a list file path", name,
                                 "e.g. --set data.split_files.train=train.txt")
                path = Path(name) if Path(name).is_absolute() else Path(d.root) / name
                check_file(f"data.split_files.{split}", str(path))
    if writes_run:
        check_folder("output_dir", cfg.output_dir, must_exist=False, writable=True)
        run = Path(cfg.output_dir) / cfg.name
        if run.exists() and not run.is_dir():
            raise refuse("name", "the name of a run folder", cfg.name,
                         f"{run} is a file: choose another name (--set name=...)")
    if m.encoder_weights not in (None, "imagenet"):
        check_file("model.encoder_weights", m.encoder_weights,
                   "'imagenet', null or an existing weights file")
    if m.glove_path is not None:
        check_file("model.glove_path", m.glove_path, "null or an existing GloVe .txt file")


def check_all(cfg: Config, reads_data: bool = False, writes_run: bool = False) -> None:
    """Every rule of the table, the cross rules and the paths, in that order.

    Args:
        cfg: the resolved config.
        reads_data: the command reads the data (the data paths must exist).
        writes_run: the command writes a run folder (``output_dir`` must be writable).

    Raises:
        ConfigError: the first value refused, in the one format.
    """
    check_rules(cfg)
    for rule in CROSS_RULES:
        rule(cfg)
    check_paths(cfg, reads_data, writes_run)


# ----------------------------------------------------------------------------- the data's classes
def check_num_classes(cfg: Config, found: int, what: str) -> None:
    """``data.num_classes`` against the classes the dataset has (``found``, known once its
    files are listed or its generator named): the one rule for every dataset.

    Raises:
        ConfigError: naming both counts and the fix.
    """
    if cfg.data.num_classes != found:
        raise ConfigError(
            f"data.num_classes: {what} has {found} classes, but the config says "
            f"{cfg.data.num_classes}; set data.num_classes: {found}."
        )

# ----------------------------------------------------------------------------- model input
def check_model_input(cfg: Config, task: Any) -> None:
    """Sizes that must suit the built network: a segmentation crop must be a multiple of the
    network's input multiple (its output stride); a classifier must take ``image_size`` inputs
    (one forward pass of a blank image tells)."""
    import torch

    if task.family == "segmentation":
        multiple = task.protocol.multiple if task.protocol is not None else 1
        crop = cfg.data.crop_size
        if crop % multiple:
            near = max(multiple, round(crop / multiple) * multiple)
            raise refuse("data.crop_size", f"a multiple of {multiple} (the network's output "
                         "stride)", crop, f"e.g. --set data.crop_size={near}")
        return
    if cfg.model.arch != "timm":
        return
    size = cfg.data.image_size
    model = task.model
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size))
    except Exception as err:  # the network cannot take this size: the value, not a bug
        wanted = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224))[-1]
        raise refuse("data.image_size", f"a size {cfg.model.encoder_name} takes", size,
                     f"e.g. --set data.image_size={wanted} "
                     f"({str(err).strip().splitlines()[0][:80]})") from None
    finally:
        model.train(was_training)

__all__ = [
    "CROSS_RULES", "KEY_GROUPS", "LOGGERS", "RULES", "LoggerError", "Rule", "changed_keys",
    "check_all", "check_class_names", "check_eval_protocol", "check_eval_size", "check_loggers",
    "check_model_input", "check_num_classes", "check_rules", "config_keys", "flatten_config",
    "keys_of",
]
