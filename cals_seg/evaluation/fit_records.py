"""What the saved fits of the evaluation record, and how their JSON files are read back.

The conformal thresholds (:mod:`cals_seg.evaluation.conformal_fit`) and the entropy reference
(:mod:`cals_seg.evaluation.ood`) are JSON files with a ``fitted_for`` record
(:mod:`cals_seg.utils.fits`): the protocol in it is :func:`protocol_record`'s, a file is read
back by :func:`read_checked_json` (validated key by key, one line when not) and compared with
the use at hand by :func:`record_mismatch`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from cals_seg.errors import UserError
from cals_seg.utils.fits import fit_mismatch

# key -> (the check of its value, what is allowed, for the message)
Checks = Mapping[str, tuple[Callable[[Any], bool], str]]


def is_int(x: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return (isinstance(x, int | float) and not isinstance(x, bool)
            and math.isfinite(float(x)))


def protocol_record(protocol: Any) -> dict[str, Any]:
    """The parts of the evaluation protocol that change the logits: ``{"mode", "resize",
    "pad", "mean", "std"}`` (and ``window``, ``stride`` when sliding); ``{}`` for None."""
    if protocol is None:
        return {}
    out = {"mode": protocol.mode, "resize": protocol.resize, "pad": protocol.pad,
           "mean": list(protocol.mean), "std": list(protocol.std)}
    if protocol.mode == "slide":
        out.update(window=protocol.window, stride=protocol.stride)
    return out


def read_checked_json(path: Path, fix: str, what: str, name: str, checks: Checks,
                      error_detail: bool = True) -> dict[str, Any]:
    """The JSON object saved at ``path``, every key of ``checks`` present and passing its
    check (in order).

    Args:
        fix: how to get a good file, ending each message.
        what: what the file is, with its article (``"a saved conformal fit"``).
        name: what a complete file is (``"conformal fit"``).
        error_detail: name the JSON parser's complaint in the invalid-JSON message.

    Raises:
        UserError: one line ``<path>: <what is wrong>; <fix>.``: unreadable, not JSON, not an
            object, a key missing or a value not allowed (shown, cut to 40 characters).
    """

    def bad(problem: str) -> UserError:
        return UserError(f"{path}: {problem}; {fix}.")

    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise bad(f"cannot be read ({err.strerror or type(err).__name__})") from None
    except (ValueError, UnicodeDecodeError) as err:
        detail = f" {' '.join(str(err).split())[:80]}" if error_detail else ""
        raise bad(f"is not valid JSON (truncated or edited?{detail})") from None
    if not isinstance(d, dict):
        raise bad(f"holds a {type(d).__name__}, not {what}")
    for key, (ok, allowed) in checks.items():
        if key not in d:
            raise bad(f"has no {key!r} (not a complete {name})")
        if not ok(d[key]):
            raise bad(f"{key}: expected {allowed}, got {json.dumps(d[key])[:40]}")
    return d


def record_mismatch(saved: Mapping[str, Any], wanted: Mapping[str, Any],
                    unchecked: Iterable[str] = ()) -> str | None:
    """:func:`~cals_seg.utils.fits.fit_mismatch` of a saved record and the use at hand, the
    keys ``unchecked`` (what a use without the validation data cannot know: the image ids)
    taken as saved. None when the fit is for this use, else the reason in a few words."""
    wanted = dict(wanted)
    for key in unchecked:
        if key in saved:
            wanted[key] = saved[key]
    return fit_mismatch(saved, wanted)


__all__ = ["Checks", "is_int", "is_number", "protocol_record", "read_checked_json",
           "record_mismatch"]
