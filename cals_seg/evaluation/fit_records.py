"""How the JSON fits of the evaluation are read back, validated key by key.

The conformal thresholds (:mod:`cals_seg.evaluation.conformal_fit`) and the entropy reference
(:mod:`cals_seg.evaluation.ood`) are JSON files with a ``fitted_for`` record (a
:class:`~cals_seg.utils.fits.FitKey`'s, compared with the use at hand by the key); a file is
read back by :func:`read_checked_json` (validated key by key, one line when not).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cals_seg.errors import UserError

# key -> (the check of its value, what is allowed, for the message)
Checks = Mapping[str, tuple[Callable[[Any], bool], str]]


def is_int(x: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return (isinstance(x, int | float) and not isinstance(x, bool)
            and math.isfinite(float(x)))


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


__all__ = ["Checks", "is_int", "is_number", "read_checked_json"]
