"""The colour rule of colour masks (``data.palette``, ``data.void_colours``), without the
datasets: :mod:`cals_seg.config.rules` checks a config with it before torch is imported, and
:class:`cals_seg.data.folder.ColourTable` checks its tables with the same function."""

from __future__ import annotations

from typing import Any


def is_colour(value: Any) -> bool:
    """The colour rule (of ``data.palette`` and ``data.void_colours`` too): ``[r, g, b]``,
    three integers in ``[0, 255]``."""
    return (isinstance(value, list | tuple) and len(value) == 3
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255
                    for v in value))
