"""What a saved fit was fitted for, and the check that it is used only for that.

Every fit the toolkit saves (a post-hoc calibrator, a conformal threshold, drift statistics)
carries a ``fitted_for`` record: a flat mapping of plain values naming the network (by content
digest: a byte-identical copy of a checkpoint is the same network, a retrained one is not), the
classes, the split and image ids it saw, and every argument that changes the fit (score, alpha,
mode, seed, parameters, the calibrator before it). A fit is reused only when the record it holds
equals the record of the use at hand on every key (:func:`fit_mismatch`); otherwise it is refit,
or refused in one line naming the key that differs.

    wanted = {"network": network_digest(run), "classes": 19, "split": "val",
              "ids": ids_digest(val_ids), "alpha": 0.1}
    reason = fit_mismatch(saved.get("fitted_for"), wanted)   # None: the fit is for this use
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# (resolved path, size, mtime_ns) -> digest: a file is hashed once per process.
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of the bytes of ``path`` (hex, first 32 characters), cached per process by
    path, size and modification time."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()[:32]
    return _DIGESTS[key]


def members_digest(paths: Iterable[str | os.PathLike]) -> str:
    """The digest of a set of checkpoints (an ensemble): order-free, one entry per distinct
    network; a single checkpoint gives its own :func:`file_digest`."""
    digests = sorted({file_digest(p) for p in paths})
    if len(digests) == 1:
        return digests[0]
    return value_digest(digests)


def value_digest(value: Any) -> str:
    """SHA-256 (first 32 hex characters) of ``value`` as canonical JSON (sorted keys):
    e.g. the list of image ids a fit saw."""
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def ids_digest(ids: Iterable[Any]) -> str:
    """:func:`value_digest` of the image ids, in order, as strings."""
    return value_digest([str(i) for i in ids])


def plain_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` as JSON-plain values (tuples as lists, keys as strings), so that a record
    read back from a file compares equal to one built in memory."""
    return json.loads(json.dumps(dict(record), sort_keys=True, default=str))


def fit_mismatch(saved: Any, wanted: Mapping[str, Any]) -> str | None:
    """Why a fit whose record is ``saved`` is not for the use ``wanted``; None when it is.

    Every key of ``wanted`` must be in ``saved`` with an equal value (compared as plain JSON),
    and ``saved`` may hold no key that ``wanted`` lacks. A fit without a record (written by an
    older version) is never reused.

    Returns:
        e.g. ``"fitted for seed=1, not seed=0"``, or ``"it records nothing of what it was
        fitted for"``.
    """
    if not isinstance(saved, Mapping) or not saved:
        return "it records nothing of what it was fitted for"
    saved, wanted = plain_record(saved), plain_record(wanted)
    for key in sorted(set(saved) | set(wanted)):
        if key not in wanted:
            return f"it records {key}={_short(saved[key])}, which this use does not have"
        if key not in saved:
            return f"it does not record {key} (this use has {key}={_short(wanted[key])})"
        if saved[key] != wanted[key]:
            return f"fitted for {key}={_short(saved[key])}, not {key}={_short(wanted[key])}"
    return None


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = ["file_digest", "fit_mismatch", "ids_digest", "members_digest", "plain_record",
           "value_digest"]
