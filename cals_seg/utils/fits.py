"""What a saved fit was fitted for, where it is kept, and the one rule by which it is reused.

Every fit the toolkit saves (a post-hoc calibrator, a calibrator fitted under drift, a
conformal threshold, an entropy limit) carries the record of one :class:`FitKey` under
``fitted_for``: the network (by content digest: a byte-identical copy of a checkpoint is the
same network, a retrained one is not), the classes, the split and image ids it saw, every
parameter that changes the fit, the precision and protocol of the forward pass, its seed, and
what it was made after. A :class:`FitStore` names the files of a folder of fits and reuses a
saved fit only when its record equals the key of the use at hand on every field
(:meth:`FitKey.problem`); otherwise it is refit, or refused in one line naming the field that
differs.

    key = FitKey("calibrator", "ts", network_digest, {"num_classes": 19, "names": None},
                 ids=ids_digest(val_ids), params={"ignore_index": 255}, precision="none")
    fit, problem = FitStore("runs/r/calibrators").reuse(path, key, load)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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


# The fields of every fit's key, in the order a difference is reported.
KEY_FIELDS = ("kind", "name", "network", "classes", "split", "ids", "params", "precision",
              "protocol", "seed", "after")


@dataclass(frozen=True)
class FitKey:
    """What one saved fit is for: the one key type of every fit the toolkit saves (post-hoc
    calibrators, drift calibrators, conformal thresholds, entropy limits).

    A saved fit holds :meth:`record` under ``fitted_for``; it is reused only when the key of the
    use at hand equals it on every field (:meth:`problem`).

    Attributes:
        kind: ``calibrator``, ``conformal`` or ``entropy``.
        name: what was fitted: the calibrator's name, the conformal mode, the entropy limit's
            calibration (``T1.2345`` or ``calibrator-NAME``).
        network: content digest of the checkpoint (an ensemble: of its members).
        classes: ``{"num_classes": K, "names": [...] or None}``.
        split, ids: the split the fit saw and the digest of its image ids in order.
        params: every argument that changes the fit (a calibrator's resolved constructor
            parameters and ``ignore_index``; a conformal fit's score, alpha, every, grid; the
            entropy quantile).
        precision, protocol: of the forward pass (:func:`protocol_record`).
        seed: the fit's seed (None when it has none).
        after: what the fit was made after: the data it saw (``clean`` or a corruption
            mixture with its seed), the calibrator before it (name and state digest), the
            calibrator file it is for (digest).
        unknown: fields this use cannot know (``predict_seg`` has no data: no ids, no
            parameters); they are not compared, and a key with unknown fields is never saved.
    """

    kind: str
    name: str
    network: str
    classes: Mapping[str, Any]
    split: str | None = "val"
    ids: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    precision: str | None = None
    protocol: Mapping[str, Any] | None = None
    seed: int | None = None
    after: Any = None
    unknown: tuple[str, ...] = ()

    def record(self) -> dict[str, Any]:
        """The key as JSON-plain values (``fitted_for`` of a saved fit); unknown fields left
        out."""
        return plain_record({f: getattr(self, f) for f in KEY_FIELDS if f not in self.unknown})

    def problem(self, saved: Any) -> tuple[str, str] | None:
        """``(field, reason)`` of the first field on which a fit whose record is ``saved``
        differs from this use; None when the fit is for it. Every known field must be equal
        (as plain JSON), the record may hold no other field, and a fit without a record
        (written by an older version) is for no use.

        Returns:
            e.g. ``("network", "was fitted for another network (checkpoint digest 3fa2...,
            this one 8b1c...)")`` or ``("record", "records nothing of what it was fitted
            for ...")``.
        """
        if not isinstance(saved, Mapping) or not saved:
            return "record", ("records nothing of what it was fitted for (written by an older "
                              "version)")
        saved, wanted = plain_record(saved), self.record()
        if "kind" not in saved:
            return "record", "was written by an older version (its record has another form)"
        for key in [*KEY_FIELDS, *sorted(set(saved) - set(KEY_FIELDS))]:
            if key in self.unknown:
                continue
            if key not in wanted:
                return key, f"records {key}={_short(saved[key])}, which this use does not have"
            if key not in saved:
                return key, f"does not record {key} (this use has {key}={_short(wanted[key])})"
            if saved[key] == wanted[key]:
                continue
            if key == "network":
                return key, (f"was fitted for another network (checkpoint digest "
                             f"{str(saved[key])[:12]}, this one {str(wanted[key])[:12]})")
            if key == "ids":
                return key, "was fitted on other images (another list of image ids)"
            return key, (f"was fitted for {key}={_short(saved[key])}, not "
                         f"{key}={_short(wanted[key])}")
        return None

    def mismatch(self, saved: Any) -> str | None:
        """The reason of :meth:`problem` alone; None when the fit is for this use."""
        found = self.problem(saved)
        return None if found is None else found[1]


def protocol_record(protocol: Any) -> dict[str, Any] | None:
    """The evaluation protocol as plain values, ``tile_batch`` left out (how many tiles share a
    forward pass does not change the logits); None for none."""
    if protocol is None or not dataclasses.is_dataclass(protocol):
        return None
    fields = dataclasses.asdict(protocol)
    fields.pop("tile_batch", None)
    return plain_record(fields)


class FitStore:
    """The saved fits of one folder (a run's ``calibrators/``, or an evaluation's own): where
    each kind lives, and the one rule by which a saved fit is reused.

    Files: ``<name>.pt`` (a calibrator), ``drift_s<seed>/<name>.pt`` (fitted under drift),
    ``conformal_<mode>_<score>_a<alpha>_s<seed>.json`` and ``entropy_p<q>_<how>.json``. Each
    holds its :class:`FitKey`'s record under ``fitted_for``.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)

    def __repr__(self) -> str:
        return f"FitStore({str(self.folder)!r})"

    def calibrator(self, name: str) -> Path:
        """The file of calibrator ``name``."""
        return self.folder / f"{name}.pt"

    def drift(self, seed: int) -> FitStore:
        """The store of the calibrators fitted under the drift mixture of ``seed``."""
        return FitStore(self.folder / f"drift_s{seed}")

    def conformal(self, mode: str, score: str, alpha: float, seed: int) -> Path:
        """The file of a conformal fit (``:`` of ``image:TAU`` written ``-``)."""
        return self.folder / f"conformal_{mode.replace(':', '-')}_{score}_a{alpha:g}_s{seed}.json"

    def entropy(self, quantile: float, how: str) -> Path:
        """The file of the validation images' entropy limit for ``how``."""
        return self.folder / f"entropy_p{round(100 * quantile)}_{how}.json"

    @staticmethod
    def reuse(path: Path, key: FitKey, read: Callable[[Path], Any]
              ) -> tuple[Any, tuple[str, str] | None]:
        """``(the fit, None)`` when ``path`` holds a fit for ``key``'s use, else ``(None,
        (field, why not))``: no file (``("file", "does not exist")``), a damaged one
        (``read`` raised :class:`~cals_seg.errors.UserError`; ``("file", its reason)``), or
        another use (:meth:`FitKey.problem`). ``read(path)`` returns the validated fit, whose
        record is its ``fitted_for`` (an attribute or a key)."""
        from cals_seg.errors import UserError

        if not path.is_file():
            return None, ("file", "does not exist")
        try:
            fit = read(path)
        except UserError as err:
            reason = getattr(err, "reason", None) or getattr(err, "problem", None) or \
                str(err).removeprefix(f"{path}: ").removeprefix(f"{path} ").split("; ")[0]
            return None, ("file", reason)
        saved = fit.get("fitted_for") if isinstance(fit, Mapping) else \
            getattr(fit, "fitted_for", None)
        problem = key.problem(saved)
        return (fit, None) if problem is None else (None, problem)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["KEY_FIELDS", "FitKey", "FitStore", "file_digest", "ids_digest", "members_digest",
           "plain_record", "protocol_record", "value_digest"]
