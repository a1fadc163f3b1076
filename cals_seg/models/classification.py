"""Image classifiers from timm (ResNet-50, SwinV2-T, ...), returning logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from cals_seg.errors import MissingPathError, UserError
from cals_seg.models import hub
from cals_seg.models.segmentation import WeightsUnavailableError

__all__ = ["WeightsUnavailableError", "build_classification_model"]


def build_classification_model(
    name: str, num_classes: int, weights: str | None = None, **params: Any
) -> nn.Module:
    """``timm.create_model(name, num_classes=K)`` with no output activation.

    Args:
        name: a timm model name, e.g. ``resnet50``, ``resnet18``, ``swinv2_tiny_window8_256``
            (``timm.list_models()`` lists them).
        num_classes: K, the number of logits.
        weights: ``None`` (random initialisation, the default), ``"imagenet"`` (timm's default
            pretrained weights, downloaded from the Hugging Face hub on first use and cached), or
            the path of a local ``.pth`` / ``.safetensors`` file with timm's weights of ``name``.
            Pretrained classifier heads are replaced when K differs from theirs.
        **params: further keyword arguments of ``timm.create_model`` (``drop_rate``,
            ``drop_path_rate``, ``img_size`` ...).

    Returns:
        A module mapping ``(N, 3, H, W)`` images to ``(N, K)`` logits.

    Raises:
        ValueError: unknown model name or bad parameter.
        FileNotFoundError: ``weights`` looks like a path but the file does not exist.
        WeightsUnavailableError: pretrained weights could not be obtained (offline); the message
            says how to proceed.
    """
    import timm  # (seconds of imports: when a network is built)

    if not timm.is_model(name):
        raise UserError(
            f"model.encoder_name: {name!r} is not a timm model; see timm.list_models(), e.g. "
            "'resnet50', 'resnet18', 'swinv2_tiny_window8_256'."
        )
    kwargs: dict[str, Any] = dict(num_classes=num_classes, **params)
    if weights is not None and weights != "imagenet":
        path = Path(weights)
        if not path.is_file():
            raise MissingPathError(
                f"model.encoder_weights: {path} does not exist; give a local weights file, "
                "'imagenet', or null."
            )
        kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    elif weights == "imagenet":
        kwargs["pretrained"] = True
    offline = False
    if weights == "imagenet":  # fail at once offline, not after the download's retries
        offline = not hub.hub_reachable()
        if offline and not hub.is_cached(hub.hub_repo(f"tu-{name}", weights)):
            raise WeightsUnavailableError(hub.unavailable_message(name, weights))
    try:
        with hub.cache_only(offline):
            return timm.create_model(name, **kwargs)
    except (TypeError, KeyError) as err:
        raise UserError(f"model: cannot build timm model {name!r}"
                        + (f" with model.params {params}" if params else "") + f": {err}") from err
    except Exception as err:  # network errors surface as many exception types
        if not kwargs.get("pretrained"):
            raise
        raise WeightsUnavailableError(
            f"Could not load pretrained weights for timm model {name!r} ({type(err).__name__}: "
            f"{err}). This machine may be offline: download them once where there is internet "
            "(timm caches them under ~/.cache/huggingface), or set `model.encoder_weights` to a "
            "local weights file, or to null to train from random initialisation."
        ) from err
