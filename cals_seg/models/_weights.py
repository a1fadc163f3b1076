"""Weights files of networks trained elsewhere: read without running code, unwrapped from a
training checkpoint, keys renamed by prefix, and loaded only when every key and shape matches
(:func:`load_weights_file`; the errors name ``model.weights`` / ``model.weights_key`` /
``model.key_map`` and the fix)."""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from cals_seg.errors import CheckpointError, MissingPathError, UntrustedCheckpointError

# Entries of a checkpoint dict that commonly hold the state dict (tried in this order).
STATE_KEYS = ("state_dict", "model_state_dict", "model", "state", "net", "network", "module")


def read_state_dict(path: str | Path, weights_key: str | None = None) -> dict[str, Tensor]:
    """The state dict in a weights file, read without running code from it: ``.safetensors``
    with safetensors, anything else with ``torch.load(weights_only=True)``. A checkpoint dict
    is unwrapped: ``weights_key`` names the entry, else the first of :data:`STATE_KEYS` that
    holds tensors.

    Raises:
        MissingPathError: no such file.
        UntrustedCheckpointError: the file's pickle would build Python objects (a whole model
            saved with ``torch.save(model)``): it could run code, so it is refused.
        CheckpointError: an unreadable file, or no state dict in it.
    """
    path = Path(path)
    key = "model.weights"
    if not path.is_file():
        raise MissingPathError(f"{key}: {path} does not exist; name the file of the network's "
                               "state dict (torch.save(model.state_dict(), FILE)).")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: Any = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = _unsafe_globals(path) or re.findall(r"GLOBAL ([\w.]+)", str(err))
        if not found and "global" not in str(err).lower():
            raise CheckpointError(f"{key}: {path} cannot be read (UnpicklingError: "
                                  f"{_first_line(err)}); it is truncated or not a weights "
                                  "file.") from None
        found = sorted(found, key=lambda name: (name.startswith(("torch.", "collections.")),
                                                name))  # the user's own classes first
        what = f" ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''})" if found else ""
        raise UntrustedCheckpointError(
            f"{key}: {path} holds Python objects{what}, not only tensors: loading it could run "
            "code from the file, so it is refused; save the state dict instead: "
            "torch.save(model.state_dict(), FILE)."
        ) from None
    except ImportError:
        raise CheckpointError(f"{key}: {path} is a safetensors file; install safetensors "
                              "(pip install safetensors).") from None
    except Exception as err:  # torch raises RuntimeError, EOFError ... on a damaged file
        raise CheckpointError(f"{key}: {path} cannot be read ({type(err).__name__}: "
                              f"{_first_line(err)}); it is truncated or not a weights "
                              "file.") from None
    return _unwrap(state, path, weights_key)


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0][:120]


def _unsafe_globals(path: Path) -> list[str]:
    """The Python objects (module.name) a zip weights file's pickle would build."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # not a zip file: the load's own error tells
        return []


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())


def _unwrap(state: Any, path: Path, weights_key: str | None) -> dict[str, Tensor]:
    if not isinstance(state, Mapping):
        raise CheckpointError(f"model.weights: {path} holds a {type(state).__name__}, not a "
                              "state dict; save torch.save(model.state_dict(), FILE).")
    if weights_key is not None:
        if weights_key not in state:
            raise CheckpointError(f"model.weights_key: {path} has no entry {weights_key!r}; its "
                                  f"entries are {list(state)[:10]}.")
        state = state[weights_key]
    elif not _is_state_dict(state):
        state = next((state[k] for k in STATE_KEYS if _is_state_dict(state.get(k))), state)
    tensors = {k: v for k, v in state.items() if isinstance(v, Tensor)} \
        if isinstance(state, Mapping) else {}
    if not tensors:
        entries = list(state)[:10] if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(f"model.weights: {path} holds no tensors where the state dict "
                              f"should be (entries: {entries}); name the entry holding it with "
                              "model.weights_key.")
    return tensors


def map_keys(state: Mapping[str, Tensor], key_map: Mapping[str, str]) -> dict[str, Tensor]:
    """Rename keys by prefix: each key starting with a prefix of ``key_map`` (the first that
    matches, in order) gets it replaced; ``{"module.": ""}`` strips DataParallel's prefix,
    ``{"": "backbone."}`` adds one."""
    out = {}
    for key, value in state.items():
        for old, new in key_map.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out


def suggest_key_map(expected: Sequence[str], found: Sequence[str]) -> dict[str, str] | None:
    """A one-prefix ``key_map`` that makes most of ``found`` match ``expected``, if one does:
    stripping the first dotted part of the file's keys (``module.``, ``model.``), or adding the
    first dotted part of the network's."""
    want = set(expected)
    candidates: list[tuple[str, str]] = []
    for key in list(found)[:1] + list(expected)[:1]:
        head = key.split(".", 1)[0] + "."
        candidates += [(head, ""), ("", head)]
    best, score = None, len(want & set(found))
    for old, new in dict.fromkeys(candidates):
        hits = len(want & set(map_keys(dict.fromkeys(found), {old: new})))
        if hits > score:
            best, score = {old: new}, hits
    return best if best is not None and score >= len(want) // 2 else None


def load_weights_file(net: nn.Module, path: str | Path, weights_key: str | None = None,
                      key_map: Mapping[str, str] | None = None) -> None:
    """Load a weights file into ``net``, every key and shape matching (after ``key_map``).

    Raises:
        CheckpointError: keys missing from the file, keys the network lacks, or shapes that
            differ, in one line with examples and, when one prefix explains it, the
            ``model.key_map`` that fixes it. Also the errors of :func:`read_state_dict`.
    """
    state = map_keys(read_state_dict(path, weights_key), key_map or {})
    own = net.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    reshaped = [f"{k}: {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in the network"
                for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or reshaped:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the network's keys missing (e.g. {missing[:2]})")
        if unexpected:
            parts.append(f"{len(unexpected)} keys the network lacks (e.g. {unexpected[:2]})")
        if reshaped:
            parts.append(f"{len(reshaped)} shapes differ (e.g. {reshaped[0]})")
        hint = suggest_key_map(list(own), list(state)) if missing else None
        fix = (f"set model.key_map: {hint}" if hint else
               "check model.factory, model.params and data.num_classes against the network "
               "that wrote the file")
        raise CheckpointError(f"model.weights: {path} does not match the network "
                              f"({'; '.join(parts)}); {fix}.")
    net.load_state_dict(state)


__all__ = ["STATE_KEYS", "load_weights_file", "map_keys", "read_state_dict", "suggest_key_map"]
