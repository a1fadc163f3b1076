"""Cheaper command calls for the files that call the commands on small runs many times
(tests/test_fit_records_conformal.py, test_shift.py, test_compare.py, test_compare_extras.py):
what they check is what the commands compute from a run's files and which files they write,
not the random weights a network gets before its checkpoint is read, nor how eval_seg's clean
figures look."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from ._networks import build_networks_once

# The real builders, saved while networks_built_once replaces them (innermost last).
_REAL: list[tuple[Any, Any]] = []


@contextlib.contextmanager
def networks_built_once() -> Iterator[None]:
    """Inside the block each smp / timm network is built with random weights once, later
    builds with the same arguments get a copy (:func:`tests._networks.build_networks_once`):
    every command loading a run built its network again before reading the checkpoint's
    weights into it. A run made with seeded random weights is made inside
    :func:`seeded_networks`."""
    import segmentation_models_pytorch as smp
    import timm

    _REAL.append((smp.create_model, timm.create_model))
    try:
        with pytest.MonkeyPatch.context() as patch:
            build_networks_once(patch)
            yield
    finally:
        _REAL.pop()


@contextlib.contextmanager
def seeded_networks() -> Iterator[None]:
    """The real smp / timm builders inside :func:`networks_built_once`: the weights of a run
    made (or trained) here are those of ``torch.manual_seed`` (runs of different seeds are
    different networks)."""
    if not _REAL:
        yield
        return
    import segmentation_models_pytorch as smp
    import timm

    create_smp, create_timm = _REAL[-1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(smp, "create_model", create_smp)
        patch.setattr(timm, "create_model", create_timm)
        yield


@contextlib.contextmanager
def clean_figures_left_out() -> Iterator[None]:
    """eval_seg's figures of the clean evaluation (reliability diagrams and region plots,
    drawn in a forked child) not made: the files checking numbers, messages and fit files do
    not read them; eval_seg's clean figures are checked in tests/test_pipeline.py."""
    from cals_seg.commands import eval_seg

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(eval_seg, "draw_clean_figures", lambda *args, **kwargs: None)
        yield
