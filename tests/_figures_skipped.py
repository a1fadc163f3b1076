"""Helpers of round two of the suite's time (issue 58): evaluations whose figures are not built.

Tests that check what an evaluation computes, prints or locks, never its figures, can run the
command with :func:`figures_skipped`: building the figures, even saved undrawn
(``conftest.figures_undrawn``), is most of a tiny ``eval_seg`` (in a forked child that a busy
machine does not overlap with the rest of the command). ``eval_seg``'s figures are drawn for
real in tests/test_pipeline.py, ``eval_cls``'s built (saved undrawn) in tests/test_eval_cls.py,
every plot checked in tests/test_plotting*.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from ._commands_cheap import clean_figures_left_out


@contextlib.contextmanager
def figures_skipped() -> Iterator[None]:
    """Inside the block, ``eval_seg``'s clean figures
    (:func:`tests._commands_cheap.clean_figures_left_out`), ``eval_cls``'s figures and the
    multiplier curves are not built: the commands still call the functions, which return at
    once."""
    from cals_seg.commands import eval_cls
    from cals_seg.visualization import plotting

    def nothing(*_args: object, **_kwargs: object) -> None:
        return None

    with clean_figures_left_out(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_cls, "draw_figures", nothing)
        patch.setattr(plotting, "plot_multiplier_curves", nothing)
        yield
