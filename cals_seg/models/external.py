"""Networks trained elsewhere: a torchvision, smp or Transformers model by name, or any factory.

A config whose ``model.arch`` is ``external`` names the network in ``model.factory``:

- ``torchvision:NAME``: a builder of ``torchvision.models.segmentation`` (``deeplabv3_resnet50``,
  ``fcn_resnet50``, ``lraspp_mobilenet_v3_large`` ...), built with ``weights=None,
  weights_backbone=None, num_classes=K`` (nothing is downloaded) and ``model.params``;
- ``smp:NAME``: an smp architecture (``unet``, ``deeplabv3plus`` ...) with ``model.encoder_name``,
  ``encoder_weights=None``, ``classes=K`` and ``model.params``;
- ``transformers:NAME``: a Hugging Face Transformers segmentation class
  (``SegformerForSemanticSegmentation``, or ``segformer`` for short), built from its config
  class with ``num_labels=K`` and ``model.params`` as the config's keywords (needs
  ``pip install "cals_seg[transformers]"``);
- ``package.module:function``: your own function, called as ``function(**model.params)``; it
  returns an ``nn.Module`` mapping normalised images ``(N, 3, H, W)`` to logits
  ``(N, K, h, w)``.

Every weight comes from ``model.weights`` (:func:`load_weights_file`), read with
``torch.load(weights_only=True)`` (or safetensors), so a weights file cannot run code.

:class:`ExternalSegmenter` wraps the network so that the toolkit sees what it sees from its own
models (:mod:`cals_seg.evaluation.inference`): ImageNet-normalised images in, logits at the
input's size out. It

1. re-normalises the input from the toolkit's statistics to the network's own ``model.mean`` /
   ``model.std`` (statistics of ``[0, 1]`` pixels; nothing is done when they are ImageNet's);
2. reads the logits out of the output: a tensor as is, ``output.logits`` (Transformers),
   ``output["out"]`` (torchvision), the first element of a tuple or list, or the entry named by
   ``model.output_key``;
3. upsamples logits smaller than the input (SegFormer's are 1/4 of it) to the input's size,
   bilinearly with ``align_corners=False``: what Transformers' ``post_process_semantic_
   segmentation``, torchvision's segmentation heads and mmsegmentation's ``resize`` do
   (``model.align_corners: true`` for networks trained with the other convention).

The toolkit pads each input at the bottom / right to a multiple of ``model.output_stride``
(null: an smp encoder's own output stride, else 1, no padding) and crops the logits back.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cals_seg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from cals_seg.errors import ConfigError, UserError
from cals_seg.models._weights import (  # noqa: F401 (the weights half of this module's API)
    STATE_KEYS,
    load_weights_file,
    map_keys,
    read_state_dict,
    suggest_key_map,
)
from cals_seg.models.consent import check_consent, is_known_builder, known_library

# Short names of Transformers segmentation classes.
TRANSFORMERS_ALIASES = {"segformer": "SegformerForSemanticSegmentation"}
FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class OutputShapeError(UserError):
    """A network whose output is not ``(N, K, h, w)`` logits for ``K`` classes."""


def split_factory(factory: str) -> tuple[str, str]:
    """``"package.module:function"`` -> ``("package.module", "function")``.

    Raises:
        ConfigError: not of that form.
    """
    if not isinstance(factory, str) or not FACTORY_PATTERN.match(factory):
        raise ConfigError(
            f"model.factory: expected 'package.module:function' or a model by name "
            f"(torchvision:NAME, smp:NAME, transformers:NAME), got {factory!r}; e.g. --set "
            "model.factory=torchvision:deeplabv3_resnet50."
        )
    module, name = factory.rsplit(":", 1)
    return module, name


def _transformers_class(name: str) -> type:
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise ConfigError(
            f"model.factory: transformers:{name} needs the transformers package, which is not "
            'installed; install it with: pip install "cals_seg[transformers]".'
        ) from None
    cls = getattr(transformers, TRANSFORMERS_ALIASES.get(name, name), None)
    if not (inspect.isclass(cls) and hasattr(cls, "config_class")):
        raise ConfigError(
            f"model.factory: transformers has no model class {name!r}; e.g. "
            "transformers:SegformerForSemanticSegmentation (or transformers:segformer)."
        )
    return cls


def resolve_factory(factory: str) -> Any:
    """The callable or class ``factory`` names (imports its module; builds nothing).

    Raises:
        ConfigError: a malformed string, a library that is not installed, an unknown name, a
            module that does not import, or a name that is not callable.
    """
    module, name = split_factory(factory)
    if module == "torchvision":
        import torchvision.models.segmentation as segmentation
        from torchvision.models import list_models

        known = list_models(module=segmentation)
        if name not in known:
            raise ConfigError(f"model.factory: {factory!r} is not a torchvision segmentation "
                              f"model; valid names are {known}.")
        return getattr(segmentation, name)
    if module == "smp":
        import segmentation_models_pytorch as smp

        known = sorted(smp.MODEL_ARCHITECTURES_MAPPING)
        if name.lower() not in known:
            raise ConfigError(f"model.factory: {factory!r} is not an smp architecture; valid "
                              f"names are {known}.")
        return smp.MODEL_ARCHITECTURES_MAPPING[name.lower()]
    if module == "transformers":
        return _transformers_class(name)
    check_consent(factory)  # before any import: a factory outside the known builders needs consent
    library = known_library(factory)
    if library is not None and not is_known_builder(factory):
        raise ConfigError(f"model.factory: {factory!r} is not a model builder registered in "
                          f"{library}; name one of its registered models, or your own function.")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"model.factory: cannot import {module!r} ({err}); install the package or put its "
            "folder on PYTHONPATH."
        ) from None
    function = getattr(found, name, None)
    if not callable(function):
        raise ConfigError(f"model.factory: {module} has no function {name!r}.")
    if library is not None and function is not _registered_builder(library, name):
        raise ConfigError(f"model.factory: {factory!r} is not the builder {library} registers "
                          f"as {name!r}; use {library}'s own module path.")
    return function


def _registered_builder(library: str, name: str) -> Any:
    """The builder ``library`` registers under ``name`` (torchvision, timm or smp)."""
    if library == "torchvision":
        from torchvision.models import get_model_builder

        return get_model_builder(name)
    if library == "timm":
        import timm

        return timm.models.model_entrypoint(name)
    import segmentation_models_pytorch as smp

    classes = {cls.__name__: cls for cls in smp.MODEL_ARCHITECTURES_MAPPING.values()}
    return smp.MODEL_ARCHITECTURES_MAPPING.get(name.lower(), classes.get(name))


def build_network(factory: str, num_classes: int, params: Mapping[str, Any] | None = None,
                  encoder_name: str = "resnet18") -> nn.Module:
    """The network ``factory`` names, with random weights (nothing is downloaded).

    Args:
        factory: ``torchvision:NAME``, ``smp:NAME``, ``transformers:NAME`` or
            ``package.module:function`` (see the module docstring).
        num_classes: K, given to the library builders (your function gets ``params`` only).
        params: keyword arguments of the builder (of the config class, for Transformers).
        encoder_name: the smp encoder (``smp:NAME`` only).

    Raises:
        ConfigError: the factory cannot be found or refuses ``params``; it returns no module.
    """
    params = dict(params or {})
    module, name = split_factory(factory)
    builder = resolve_factory(factory)
    try:
        if module == "torchvision":
            net = builder(**{**params, "weights": None, "weights_backbone": None,
                             "num_classes": num_classes})
        elif module == "smp":
            import segmentation_models_pytorch as smp

            net = smp.create_model(name, **{"encoder_name": encoder_name, **params,
                                            "encoder_weights": None, "classes": num_classes,
                                            "activation": None})
        elif module == "transformers":
            net = builder(builder.config_class(**{**params, "num_labels": num_classes}))
        elif known_library(factory) == "torchvision":  # a registered builder: no download
            net = builder(**{**params, "weights": None, **(
                {"weights_backbone": None} if "weights_backbone" in
                inspect.signature(builder).parameters else {})})
        elif known_library(factory) == "timm":
            net = builder(**{**params, "pretrained": False})
        else:
            net = builder(**params)
    except (TypeError, ValueError, KeyError, AssertionError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ConfigError(
            f"model.factory: {factory} cannot be built with model.params {params} "
            f"({type(err).__name__}: {first}); check the keywords it takes."
        ) from None
    if not isinstance(net, nn.Module):
        raise ConfigError(f"model.factory: {factory} returned a {type(net).__name__}, not a "
                          "torch.nn.Module.")
    return net


def logits_of(output: Any, key: str | None = None) -> Tensor:
    """The logits in a network's output: a tensor as is; else ``output[key]`` /
    ``output.key`` when ``key`` is given; else ``output.logits`` (Transformers), ``output["out"]``
    (torchvision), the single entry of a one-entry dict, the first element of a tuple or list.

    Raises:
        OutputShapeError: no tensor found, naming what the output holds.
    """
    if isinstance(output, Tensor):
        return output
    if key is not None:
        found = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if isinstance(found, Tensor):
            return found
        raise OutputShapeError(f"model.output_key: the network's output has no tensor {key!r} "
                               f"({_describe(output)}).")
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, Mapping):
        if isinstance(output.get("out"), Tensor):
            return output["out"]
        if len(output) == 1 and isinstance(next(iter(output.values())), Tensor):
            return next(iter(output.values()))
    if isinstance(output, tuple | list) and output and isinstance(output[0], Tensor):
        return output[0]
    raise OutputShapeError(f"the network's output holds no logits the toolkit can find "
                           f"({_describe(output)}); name the entry with model.output_key.")


def _describe(output: Any) -> str:
    if isinstance(output, Mapping):
        return f"a dict with keys {list(output)[:8]}"
    return f"a {type(output).__name__}"


def default_output_stride(net: nn.Module) -> int:
    """An smp network's encoder output stride (its inputs must be divisible by it), else 1."""
    if getattr(net, "requires_divisible_input_shape", False):
        return int(getattr(getattr(net, "encoder", None), "output_stride", 1))
    return 1


class ExternalSegmenter(nn.Module):
    """A network trained elsewhere, seen as the toolkit's own: ImageNet-normalised images in,
    logits at the input's size out (see the module docstring for each step).

    ``forward(x) = up(logits_of(net(a * x + b)))`` with ``a = s / std``, ``b = (m - mean) / std``
    (``m``, ``s``: the toolkit's ImageNet statistics) and ``up`` bilinear to ``x``'s size.

    Args:
        net: the network; its state dict is this module's under the prefix ``net.``.
        num_classes: K, the channels its logits must have.
        mean, std: the network's own input statistics of ``[0, 1]`` RGB pixels.
        output_stride: the side multiple inputs are padded to (:attr:`input_multiple`).
        output_key: the output entry holding the logits (None: found as :func:`logits_of` says).
        align_corners: of the bilinear upsampling of smaller logits.

    Shape:
        ``x (N, 3, H, W)`` -> ``(N, K, H, W)``.
    """

    def __init__(self, net: nn.Module, num_classes: int,
                 mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD,
                 output_stride: int | None = None, output_key: str | None = None,
                 align_corners: bool = False) -> None:
        super().__init__()
        self.net = net
        self.num_classes = int(num_classes)
        self.output_key, self.align_corners = output_key, bool(align_corners)
        # Read by cals_seg.evaluation.inference.input_multiple: the evaluation pads to it.
        self.input_multiple = int(output_stride or default_output_stride(net))
        given_mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64)
        given_std = torch.tensor(IMAGENET_STD, dtype=torch.float64)
        own_mean = torch.tensor(list(mean), dtype=torch.float64)
        own_std = torch.tensor(list(std), dtype=torch.float64)
        self.renormalise = not (torch.equal(own_mean, given_mean)
                                and torch.equal(own_std, given_std))
        # Not persistent: the state dict is the network's alone, so any checkpoint of it loads.
        scale, shift = given_std / own_std, (given_mean - own_mean) / own_std
        self.register_buffer("scale", scale.float().view(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", shift.float().view(1, 3, 1, 1), persistent=False)

    def raw_logits(self, x: Tensor) -> Tensor:
        """The network's own logits of ``x`` (re-normalised), before any upsampling.

        Shape:
            ``x (N, 3, H, W)`` -> ``(N, K, h, w)`` with ``h <= H``, ``w <= W``.
        """
        if self.renormalise:
            x = x * self.scale.to(x.dtype) + self.shift.to(x.dtype)
        out = logits_of(self.net(x), self.output_key)
        if out.dim() != 4 or out.shape[1] != self.num_classes:
            raise OutputShapeError(
                f"the network returns logits of shape {tuple(out.shape)} for an input of "
                f"{tuple(x.shape)}; expected (N, {self.num_classes}, h, w): check that it is "
                f"built for data.num_classes={self.num_classes} classes and returns logits.")
        return out

    def forward(self, x: Tensor) -> Tensor:
        out = self.raw_logits(x)
        # Exported programs always interpolate (an identity at equal sizes): a branch on the
        # symbolic sizes would tie the program to one of the cases.
        if torch.compiler.is_exporting() or out.shape[-2:] != x.shape[-2:]:
            out = F.interpolate(out, size=x.shape[-2:], mode="bilinear",
                                align_corners=self.align_corners)
        return out

    @torch.no_grad()
    def check_output(self, x: Tensor) -> tuple[int, int]:
        """Run ``x`` once and refuse an output that is not ``(N, K, h, w)`` logits no larger
        than the input; returns ``(h, w)``.

        Raises:
            OutputShapeError: one line naming the shapes and what was expected.
        """
        out = self.raw_logits(x)
        n, _, height, width = x.shape
        h, w = out.shape[-2:]
        if out.shape[0] != n or h > height or w > width or h < 1 or w < 1:
            raise OutputShapeError(
                f"the network returns logits of shape {tuple(out.shape)} for an input of "
                f"{tuple(x.shape)}; expected (N, {self.num_classes}, h, w) with h <= {height} "
                f"and w <= {width} (logits smaller than the input are upsampled).")
        return int(h), int(w)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, input_multiple={self.input_multiple}, "
                f"renormalise={self.renormalise}, align_corners={self.align_corners}")


def build_external_model(factory: str, num_classes: int, *,
                         params: Mapping[str, Any] | None = None, encoder_name: str = "resnet18",
                         mean: Sequence[float] = IMAGENET_MEAN,
                         std: Sequence[float] = IMAGENET_STD, output_stride: int | None = None,
                         output_key: str | None = None,
                         align_corners: bool = False) -> ExternalSegmenter:
    """:func:`build_network` wrapped in :class:`ExternalSegmenter`, with random weights (load
    them with :func:`load_weights_file` into ``model.net``)."""
    net = build_network(factory, num_classes, params, encoder_name)
    return ExternalSegmenter(net, num_classes, mean, std, output_stride, output_key,
                             align_corners)


__all__ = ["ExternalSegmenter", "OutputShapeError", "build_external_model",
           "build_network", "load_weights_file", "logits_of", "map_keys", "read_state_dict",
           "resolve_factory", "split_factory", "suggest_key_map"]
