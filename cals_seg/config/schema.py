"""Run configuration: dataclasses with defaults, YAML loading that rejects unknown keys, and
``--set key=value`` overrides.

Only ``tools/`` and this module know about the config object; library classes take plain
keyword arguments. A YAML file mirrors :class:`Config`::

    name: synthetic_cals_alm
    data: {name: synthetic, root: data/synthetic, num_classes: 11}
    loss: {name: cals_alm, params: {margin: 10.0}}
    train: {epochs: 30, batch_size: 8}

A *setup* file replaces ``loss`` by a ``methods`` table (method name -> loss section) and a
default ``method``; ``configs/<setup>_<method>.yaml`` reads ``configs/<setup>.yaml`` with that
method, so one edit changes a setting for every method (:func:`load_config`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cals_seg.errors import ConfigError, UserError
from cals_seg.utils.registry import enable_contrib


@dataclass
class DataConfig:
    """Dataset and loading. ``name``: ``voc`` (a VOC2012 tree at ``root``), ``synthetic`` (the
    embedded dataset in VOC layout, generated at ``root`` when missing).

    Classification (``tools/train_cls.py``; ``ignore_index`` must be -100 there): ``imagefolder``
    (``root/{train,val,test}/<class>/*``), ``split_files`` (``<path> <label>`` lists named by
    ``split_files``), ``tiny_imagenet``, ``imagenet``, ``imagenet_lt``, ``synthetic_cls`` (the
    embedded long-tailed image set, generated at ``root`` when missing); text: ``20news``,
    ``synthetic_text``. ``eval_size`` (classification only) is the shorter side images are
    resized to before the centre crop of ``image_size`` (``None``: ``image_size``); segmentation
    refuses it and takes its evaluation protocol from :class:`EvalConfig`; ``val_fraction`` is
    the part of ImageNet's official val used as validation (the rest is the test set);
    ``synthetic`` holds the keyword arguments of the embedded generators. Fields used by
    classification and text:

    - ``image_size``: input side; ``crop_scale``: area range of the training
      ``RandomResizedCrop``; ``color_jitter``: brightness/contrast/saturation strength (0: off);
      ``random_erasing``: probability of erasing a random rectangle (0: off).
    - ``val_per_class``: Tiny-ImageNet images per class held out of train as validation.
    - ``split_files``: ``{train, val, test}`` list files (relative to ``root`` or absolute).
    - ``val_count``: 20 Newsgroups documents held out of train as validation.
    - ``max_len``: tokens kept per document (padded with ``<pad>``); ``min_freq`` and
      ``vocab_size``: the vocabulary (training split only, ``<pad>`` and ``<unk>`` included);
      ``text_strip``: what is removed from a post, a subset of ``[headers, quotes, signature]``.

    Segmentation also reads ``cityscapes`` (``root`` holds ``leftImg8bit/`` and ``gtFine/``),
    ``ade20k`` (``root`` holds ``images/`` and ``annotations/`` of ADEChallengeData2016) and
    ``folder`` (images and masks matched by stem, see :mod:`cals_seg.data.folder`):

    - ``class_names``: ``num_classes`` display names for metrics, plots and predictions (any
      dataset; ``null``: the dataset's own names, else ``class 0 ...``).
    - ``image_dir``, ``mask_dir`` (folder): the image and mask folder names.
    - ``palette`` (folder): one ``[r, g, b]`` per class to decode RGB colour masks exactly
      (``null``: masks hold class indices); ``void_colours``: colours that are void;
      ``unknown_colours``: ``error`` (a colour in neither list is an error naming the file)
      or ``void``.
    """

    name: str = "synthetic"
    root: str = "data/synthetic"
    num_classes: int = 11
    ignore_index: int = 255
    crop_size: int = 64
    scale_range: list[float] = field(default_factory=lambda: [0.75, 1.5])
    eval_size: int | None = None
    val_fraction: float = 0.2
    split_seed: int = 0
    num_workers: int = 0
    synthetic: dict[str, Any] = field(default_factory=dict)
    image_size: int = 224
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    color_jitter: float = 0.4
    random_erasing: float = 0.0
    val_per_class: int = 50
    split_files: dict[str, Any] = field(default_factory=dict)
    val_count: int = 900
    max_len: int = 1000
    min_freq: int = 1
    vocab_size: int | None = 20000
    text_strip: list[str] = field(default_factory=lambda: ["headers", "quotes", "signature"])
    class_names: list[str] | None = None
    image_dir: str = "images"
    mask_dir: str = "masks"
    palette: list[list[int]] | None = None
    void_colours: list[list[int]] = field(default_factory=list)
    unknown_colours: str = "error"


@dataclass
class ModelConfig:
    """smp model. ``encoder_weights``: ``imagenet``, ``null`` (random init) or a local file;
    ``params``: further keyword arguments of the smp architecture (e.g.
    ``encoder_output_stride: 16``, ``decoder_channels: 128``).

    Classification: ``arch: timm`` with the timm model name in ``encoder_name`` (``resnet50``,
    ``swinv2_tiny_window8_256``) and ``encoder_weights`` ``imagenet`` / ``null`` / a local file
    of the whole classifier; ``params`` go to ``timm.create_model``. Text: ``arch: gpcn``
    (Global Pooling CNN, ``params`` go to its constructor), ``embed_dim`` the word-vector length
    and ``glove_path`` a GloVe ``.txt`` file (``null``: random, trainable embeddings).

    A network trained elsewhere (segmentation, :mod:`cals_seg.models.external`, made a run by
    ``tools/import_model.py``): ``arch: external`` and ``factory`` ``package.module:function``
    (called with ``params``) or ``torchvision:NAME`` / ``smp:NAME`` / ``transformers:NAME``;
    ``weights`` its state-dict file (``null``: the factory's own weights), ``weights_key`` the
    entry of a checkpoint dict holding it, ``key_map`` key-prefix replacements (``{"module.":
    ""}``); ``mean`` / ``std`` its input statistics of ``[0, 1]`` pixels; ``output_stride`` the
    side multiple its inputs are padded to (``null``: an smp encoder's own, else 1);
    ``output_key`` the output entry holding the logits (``null``: a tensor, ``.logits``,
    ``["out"]``); ``align_corners`` of the bilinear upsampling of smaller logits."""

    arch: str = "deeplabv3"
    encoder_name: str = "resnet18"
    encoder_weights: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    embed_dim: int = 100
    glove_path: str | None = None
    factory: str | None = None
    weights: str | None = None
    weights_key: str | None = None
    key_map: dict[str, Any] = field(default_factory=dict)
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    output_stride: int | None = None
    output_key: str | None = None
    align_corners: bool = False


@dataclass
class LossConfig:
    """Criterion: a name of ``cals_seg.losses.LOSSES`` and its keyword parameters."""

    name: str = "ce"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimConfig:
    """Optimizer (``adamw`` or ``sgd``) and learning-rate schedule (``cosine``, ``multistep``,
    ``constant``; stepped once per epoch)."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 1e-4
    momentum: float = 0.9
    schedule: str = "cosine"
    milestones: list[int] = field(default_factory=list)
    gamma: float = 0.1


@dataclass
class TrainConfig:
    """Training loop. ``best_metric`` is a validation metric (``miou``, ``ece``, ``acc``,
    ``nll`` ...) and ``best_mode`` ``max`` or ``min``. ``amp``: ``none``, ``bf16`` (CUDA or
    CPU) or ``fp16`` (CUDA only, with a gradient scaler) for the model's forward pass; the
    criterion and the meters compute in float32. ``sync_bn``: SyncBatchNorm under
    torch.distributed. ``compile``: ``torch.compile`` the model and the criterion. ``loggers``:
    live logs besides ``history.jsonl``, any of ``csv``, ``tensorboard``, ``wandb``
    (:mod:`cals_seg.training.loggers`). ``debug_checks``: check the labels and the loss on the
    host at
    every step (a device synchronisation per step; by default they are checked on the device
    and read every 50 steps)."""

    epochs: int = 30
    batch_size: int = 8
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"
    grad_clip: float | None = None
    best_metric: str = "miou"
    best_mode: str = "max"
    threads: int | None = None
    progress: bool = True
    sync_bn: bool = False
    channels_last: bool = False
    compile: bool = False
    loggers: list[str] = field(default_factory=list)
    debug_checks: bool = False


@dataclass
class EvalConfig:
    """Evaluation: calibration bins, temperature scaling, number of calibration maps, and, for
    segmentation, how the network input is made from an image
    (:mod:`cals_seg.evaluation.inference`).

    Segmentation metrics are always taken at each image's own resolution against its
    unmodified mask: the logits are cropped and bilinearly upsampled to the image's size before
    the softmax. ``mode``: ``whole`` (the image in one forward pass) or ``slide`` (tiles of
    ``window x window`` every ``stride`` pixels, overlapping logits averaged, ``batch_size``
    tiles per pass). ``resize``: longest side of the network input (aspect kept), ``null`` for
    the image's own size. ``pad``: pad the network input at the bottom/right to at least
    ``pad x pad`` (``512``: the paper's VOC protocol), ``null`` for none.

    The plan of the evaluation (:class:`cals_seg.evaluation.evaluator.EvalPlan`), which the
    trainer's final test and ``eval_seg`` / ``eval_cls`` run (their flags write these keys:
    ``--calibrators ts`` is ``--set eval.calibrators=[ts]``): ``calibrators``, post-hoc
    calibrators fitted on validation; ``calibrator_params``, ``{name: {parameter: value}}``;
    ``conformal``, prediction sets (``{alpha: 0.1, mode: risk, score: aps}``, or the words of
    ``--conformal``), null for none; ``shift``, image corruptions ``NAME:SEVERITY``
    (``all:3``, ``all``) with their seed ``shift_seed``; ``calibrator_fit_shift``, each
    calibrator also fitted under drift.
    """

    batch_size: int = 8
    n_bins: int = 15
    temperature_scaling: bool = True
    num_maps: int = 4
    mode: str = "whole"
    resize: int | None = None
    pad: int | None = None
    window: int = 512
    stride: int = 341
    calibrators: list[str] = field(default_factory=list)
    calibrator_params: dict[str, Any] = field(default_factory=dict)
    conformal: dict[str, Any] | str | None = None
    shift: list[str] = field(default_factory=list)
    shift_seed: int = 0
    calibrator_fit_shift: bool = False


@dataclass
class Config:
    """A whole run. The resolved config is written to ``<output_dir>/<name>/config.yaml``."""

    name: str = "run"
    output_dir: str = "runs"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    contrib: list[str] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, but ``1e-6`` is a float (YAML 1.1 demands ``1.0e-6``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"""),
    list("-+0123456789"),
)


def _yaml_load(text: str) -> Any:
    """The parsed YAML ``text``: a fresh copy of a cached parse (a tool loads the same setup
    file and values many times; PyYAML's pure-Python parser is the cost of every config)."""
    return copy.deepcopy(_yaml_parse(text))


@functools.lru_cache(maxsize=512)
def _yaml_parse(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise yaml.YAMLError("nested deeper than a config can be (hundreds of levels of "
                             "[ or {)") from None




class _WrongType(Exception):
    """A value whose type does not match its field (turned into a ConfigError by _build)."""


def type_text(tp: Any) -> str:
    """``int | None`` -> ``an integer or null``: a field's type as a message says it."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        text = " or ".join(type_text(a) for a in args if a is not type(None))
        return text + (" or null" if type(None) in args else "")
    if origin is list:
        (item,) = typing.get_args(tp)
        names = {int: "integers", float: "numbers", str: "strings"}
        return "a list of " + names.get(item, "values")
    if origin is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, "a value")


def yaml_text(value: Any) -> str:
    """A value as it is written after ``--set key=`` (``null``, ``true``, ``[0.75, 1.5]``)."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _check_type(value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` (int -> float only) or raise _WrongType."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg)
            except _WrongType:
                pass
        raise _WrongType
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list | tuple):
            raise _WrongType
        (item,) = typing.get_args(tp)
        return [_check_type(v, item) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise _WrongType
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise _WrongType
    if tp in (int, float, str) and (not isinstance(value, tp) or isinstance(value, bool)):
        raise _WrongType
    return value


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)`` of a config dataclass, evaluated once: the annotations are
    strings (``from __future__ import annotations``), and evaluating them again for every
    section of every config read and checked was most of the time of a check. Read only."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict[str, Any], where: str, in_force: Any = None) -> Any:
    """``cls`` built from ``data``, checked key by key; ``in_force``: the same section as the
    config file gives it before ``--set`` (the value a wrong override's message suggests)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys, got {data!r}.")
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or 'config'}: unknown key(s) {unknown}; valid keys are {list(fields)}.")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        tp = hints[name]
        given = in_force.get(name) if isinstance(in_force, dict) else None
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value or {}, key, given)
            continue
        try:
            kwargs[name] = _check_type(value, tp)
        except _WrongType:
            raise ConfigError(f"{key}: expected {type_text(tp)}, got {value!r}; e.g. --set "
                              f"{_suggestion(fields[name], tp, key, given, in_force)}."
                              ) from None
    return cls(**kwargs)


def _suggestion(f: dataclasses.Field, tp: Any, key: str, given: Any, in_force: Any) -> str:
    """``KEY=VALUE (where it comes from)`` for a wrong value of ``key``: the config file's own
    value when it is a right one (the value in force before ``--set``), else the default."""
    if isinstance(in_force, dict) and f.name in in_force:
        try:
            return f"{key}={yaml_text(_check_type(given, tp))} (the config file's value)"
        except _WrongType:
            pass
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return f"{key}={yaml_text(default)} (the default)"


def config_from_dict(data: dict[str, Any], in_force: dict[str, Any] | None = None) -> Config:
    """Build a :class:`Config`, rejecting unknown keys (the valid ones are listed) and values
    of the wrong type (``in_force``: the config file's values before ``--set``, suggested in
    the message of a wrong override). The modules of ``cals_seg/contrib/`` that ``contrib``
    names are imported (their losses, calibrators and margin rules registered) before anything
    checks a name."""
    cfg = _build(Config, data, "", in_force)
    try:
        enable_contrib(cfg.contrib)
    except UserError as err:
        raise ConfigError(str(err)) from None
    return cfg


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"--set {dotted}=...: expected a dotted key such as train.epochs.")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k!r} is not a section.")
    node[keys[-1]] = value


METHOD_ALIASES = {"cals": "cals_alm"}


def resolve_config_path(path: str | Path, method: str | None = None) -> tuple[Path, str | None]:
    """``(setup file, method)`` for a config path.

    A setup file holds every setting of a setup plus a ``methods`` table (method name -> loss).
    ``configs/<setup>_<method>.yaml`` need not exist as a file: it names ``configs/<setup>.yaml``
    with that method (``cals`` is short for ``cals_alm``).

    Raises:
        ConfigError: neither the file nor a setup file with that method exists.
    """
    p = Path(path)
    if p.is_file():
        return p, method
    stem, parent = p.stem, p.parent
    candidates = []
    for i in range(len(stem) - 1, 0, -1):
        if stem[i] != "_":
            continue
        setup = parent / f"{stem[:i]}{p.suffix or '.yaml'}"
        if setup.is_file():
            candidates.append((setup, stem[i + 1:]))
    for setup, name in candidates:  # longest setup name first
        name = METHOD_ALIASES.get(name, name)
        if method is not None and method != name:
            raise ConfigError(f"{p} names the method {name!r}, but --method says {method!r}.")
        return setup, name
    raise ConfigError(
        f"Config file {p} does not exist"
        + (f" (nor a setup file {parent}/<setup>.yaml for it)." if parent.is_dir() else ".")
    )


def _apply_method(data: dict[str, Any], method: str | None, where: Path) -> dict[str, Any]:
    """Resolve a setup file's ``methods`` table into ``loss`` (and the run name)."""
    methods = data.pop("methods", None)
    default = data.pop("method", None)
    if methods is None:
        if method is not None:
            raise ConfigError(
                f"{where} has no `methods` table, so it cannot be run with method {method!r}; "
                "set the loss with --set loss.name=... instead."
            )
        return data
    if not isinstance(methods, dict) or not methods:
        raise ConfigError(f"{where}: `methods` must map method names to loss sections.")
    chosen = METHOD_ALIASES.get(method, method) if method is not None else default
    if chosen is None:
        raise ConfigError(
            f"{where} defines the methods {sorted(methods)}; name one with --method NAME."
        )
    if chosen not in methods:
        raise ConfigError(
            f"{where}: unknown method {chosen!r}; valid methods are {sorted(methods)}."
        )
    if "loss" in data:
        raise ConfigError(f"{where}: a setup file with `methods` must not also set `loss`.")
    entry = methods[chosen]
    if isinstance(entry, dict) and "contrib" in entry:  # the method's opt-in experiments
        entry = dict(entry)
        extra = entry.pop("contrib")
        if not isinstance(extra, list):
            raise ConfigError(f"{where}: methods.{chosen}.contrib: expected a list of module "
                              f"names, got {extra!r}.")
        given = data.get("contrib", [])
        data["contrib"] = [*given, *extra] if isinstance(given, list) else given
    data["loss"] = entry
    data["name"] = f"{data.get('name', where.stem)}_{chosen}"
    return data


def load_config(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    method: str | None = None,
) -> Config:
    """Read a YAML config, pick its method and apply ``key.sub=value`` overrides (values parsed
    as YAML, applied in order: a later one wins).

    Args:
        path: a config file, a setup file (with a ``methods`` table), or
            ``<dir>/<setup>_<method>.yaml`` naming a setup file and one of its methods.
        overrides: ``["train.epochs=5", "loss.params.margin=6"]``.
        method: the method of a setup file (default: the file's ``method``).

    Raises:
        ConfigError: missing file, invalid YAML, unknown method or key, or wrong type, naming the
            file.
    """
    data: dict[str, Any] = {}
    where = "config"
    if path is not None:
        p, method = resolve_config_path(path, method)
        where = str(path)
        try:
            data = _yaml_load(p.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{p}: byte {err.object[err.start]:#04x} at offset {err.start} "
                              "is not UTF-8; save the config as UTF-8.") from None
        except OSError as err:
            raise ConfigError(f"{p}: cannot read it ({os.strerror(err.errno or 0)}); check "
                              "the path and its permissions.") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{p}: invalid YAML: {err}") from err
        if data is None:
            raise ConfigError(f"{p} is empty; a config needs at least its data section.")
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: expected a mapping of sections, got {type(data).__name__}.")
        data = _apply_method(data, method, p)
    elif method is not None:
        raise ConfigError("--method needs a config file with a `methods` table.")
    in_force = copy.deepcopy(data) if path is not None else None  # the file's, before --set
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.epochs=5.")
        key, raw = item.split("=", 1)
        try:
            value = _yaml_load(raw)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ConfigError(
                f"{key.strip()}: expected a YAML value, got {raw!r} ({problem}); e.g. --set "
                f"{key.strip()}=5, --set '{key.strip()}=[1, 2]' or --set '{key.strip()}={{a: 1}}' "
                "(quote the item for the shell)."
            ) from None
        _set(data, key.strip(), value)
    try:
        cfg = config_from_dict(data, in_force)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    # the file's own values, before --set: what a refused override's message suggests
    # (cals_seg.config.rules.check_rules); not a field, so never saved
    cfg.__dict__["_in_force"] = in_force
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (for YAML output and checkpoints)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically (:func:`cals_seg.utils.io.atomic_write`)."""
    from cals_seg.utils.io import atomic_write

    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
