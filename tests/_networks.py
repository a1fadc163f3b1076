"""Networks built once per set of arguments, for test files whose cases each build the same
network again (a run loaded by every command, a config checked through every tool): what
those cases check is the reading of files and configs, not a network's random weights."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any


def built_once(create: Callable[..., Any]) -> Callable[..., Any]:
    """``create`` (``smp.create_model`` / ``timm.create_model``) building each network with
    random weights once: a later call with the same arguments gets a copy of that network (a
    new value still goes through the real call; an error is raised again each time).
    Pretrained weights (``pretrained``, ``encoder_weights``) are always loaded for real."""
    built: dict[str, Any] = {}

    def create_once(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pretrained") or kwargs.get("encoder_weights") is not None:
            return create(*args, **kwargs)
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            built[key] = create(*args, **kwargs)
        return copy.deepcopy(built[key])

    return create_once


def build_networks_once(patch: Any) -> None:
    """:func:`built_once` in place of ``smp.create_model`` and ``timm.create_model`` (``patch``:
    a ``pytest.MonkeyPatch``, which puts them back)."""
    import segmentation_models_pytorch as smp
    import timm

    patch.setattr(smp, "create_model", built_once(smp.create_model))
    patch.setattr(timm, "create_model", built_once(timm.create_model))
