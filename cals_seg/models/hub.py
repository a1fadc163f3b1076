"""Pretrained weights from the Hugging Face Hub (smp and timm download there): find out at once
whether they can be had, instead of after half a minute of retries on a machine offline.

The check costs nothing when the file is in the local cache, and one TCP connection (at most
``timeout`` seconds) otherwise. ``HF_HUB_OFFLINE=1`` skips the connection: offline then means
"the cache only".
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from urllib.parse import urlparse

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def hub_offline_set() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or huggingface_hub's own switch) asks for no network."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return flag or bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's host (``HF_ENDPOINT``, default huggingface.co) accepts a connection."""
    if hub_offline_set():
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout).close()
    except OSError:
        return False
    return True


def hub_repo(encoder_name: str, weights: str) -> tuple[str, str | None] | None:
    """``(repo id, revision)`` of the pretrained weights of an smp encoder (``tu-<name>``: the
    timm model's), or None when unknown (then only a connection can tell)."""
    try:
        if encoder_name.startswith("tu-"):
            import timm

            cfg = timm.models.get_pretrained_cfg(encoder_name[3:])
            return (cfg.hf_hub_id, None) if cfg is not None and cfg.hf_hub_id else None
        import segmentation_models_pytorch as smp

        settings = smp.encoders.encoders[encoder_name]["pretrained_settings"][weights]
        return settings["repo_id"], settings.get("revision")
    except (KeyError, AttributeError, RuntimeError):
        return None


def is_cached(repo: tuple[str, str | None] | None) -> bool:
    """Whether the weights file of ``repo`` is in the local Hugging Face cache (no network)."""
    if repo is None:
        return False
    from huggingface_hub import try_to_load_from_cache

    repo_id, revision = repo
    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision), str)
               for name in WEIGHT_FILES)


def weights_problem(encoder_name: str, weights: str, key: str = "model.encoder_weights"
                    ) -> str | None:
    """Why the pretrained ``weights`` of ``encoder_name`` cannot be had here, or None (cached,
    or the Hub answers). The message names ``key`` and the three ways on."""
    if is_cached(hub_repo(encoder_name, weights)) or hub_reachable():
        return None
    return unavailable_message(encoder_name, weights, key)


def unavailable_message(encoder_name: str, weights: str, key: str = "model.encoder_weights"
                        ) -> str:
    """The one-line error of weights that are neither cached nor downloadable here."""
    why = ("HF_HUB_OFFLINE is set" if hub_offline_set() else
           "huggingface.co cannot be reached (offline?)")
    return (f"{key}: {weights!r} weights of encoder {encoder_name!r} would be downloaded, but "
            f"they are not in this machine's cache and {why}. Connect once (the file is then "
            f"cached), set {key} to a local weights file, or use --set {key}=null to train "
            "from random initialisation.")


@contextlib.contextmanager
def cache_only(active: bool) -> Iterator[None]:
    """While ``active``, huggingface_hub reads its cache without trying the network (no
    retries): for weights found cached on a machine that is offline."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    if active:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved
