"""Segmentation models from segmentation-models-pytorch (smp), returning logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from cals_seg.errors import MissingPathError, UserError, WeightsUnavailableError
from cals_seg.models import hub


def build_segmentation_model(
    arch: str, encoder_name: str, encoder_weights: str | None, num_classes: int, **params: Any
) -> nn.Module:
    """An smp model (``deeplabv3``, ``deeplabv3plus``, ``unet``, ...) with no output activation.

    Args:
        arch: smp architecture name (``smp.create_model``).
        encoder_name: smp encoder, e.g. ``resnet34``.
        encoder_weights: ``"imagenet"`` (downloaded by smp/timm on first use), ``None`` (random
            initialisation), or the path of a local ``.pt``/``.pth`` state dict of the encoder.
        num_classes: K, the number of output channels.
        **params: further smp keyword arguments (``encoder_output_stride``, ...).

    Returns:
        A module mapping ``(N, 3, H, W)`` images to ``(N, K, H, W)`` logits.

    Raises:
        WeightsUnavailableError: the pretrained weights could not be obtained (offline); the
            message says how to proceed. Offline with the weights not cached, it is raised
            before smp is called (no download retries).
    """
    import segmentation_models_pytorch as smp  # (with timm, seconds of imports: when used)

    local = encoder_weights is not None and (
        Path(encoder_weights).suffix in (".pt", ".pth", ".bin") or Path(encoder_weights).exists()
    )
    hub_weights = None if (encoder_weights is None or local) else encoder_weights
    offline = False
    if hub_weights is not None:  # fail at once offline, not after smp's retries
        offline = not hub.hub_reachable()
        if offline and not hub.is_cached(hub.hub_repo(encoder_name, hub_weights)):
            raise WeightsUnavailableError(hub.unavailable_message(encoder_name, hub_weights))
    try:
        with hub.cache_only(offline):
            model = smp.create_model(
                arch,
                encoder_name=encoder_name,
                encoder_weights=hub_weights,
                classes=num_classes,
                activation=None,
                **params,
            )
    except (KeyError, ValueError, TypeError, AssertionError) as err:
        raise UserError(
            f"model: cannot build {arch!r} with encoder {encoder_name!r}"
            + (f" and model.params {params}" if params else "") + f": {err}"
        ) from err
    except Exception as err:  # network errors surface as many exception types
        if hub_weights is None and params:  # smp/torch refusing a value of model.params
            raise UserError(
                f"model.params: cannot build {arch!r} with {params} ({type(err).__name__}: "
                f"{str(err).strip().splitlines()[0][:120]}); check the values, or remove them."
            ) from None
        if hub_weights is None:
            raise
        raise WeightsUnavailableError(
            f"Could not download {hub_weights!r} weights for encoder {encoder_name!r} ({err}). "
            "Either connect to the internet once (smp caches the file), set "
            "`model.encoder_weights` to a local encoder state-dict file, or set it to null to "
            "train from random initialisation."
        ) from err
    if local:
        path = Path(encoder_weights)
        if not path.is_file():
            raise MissingPathError(
                f"model.encoder_weights: {path} does not exist; give an encoder state dict file, "
                "'imagenet', or null."
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        missing, unexpected = model.encoder.load_state_dict(state, strict=False)
        if len(missing) == len(model.encoder.state_dict()):
            raise UserError(
                f"model.encoder_weights: {path} matches none of the parameters of encoder "
                f"{encoder_name!r} (unexpected keys such as {list(unexpected)[:3]})."
            )
    return model
