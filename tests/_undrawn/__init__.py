"""Figures undrawn in a test's child processes (the tools a test runs as subprocesses: compare's
and margin's training runs, torchrun's workers): the folder's ``sitecustomize.py`` is put first
on their ``PYTHONPATH``. For tests that check what is computed and which files are written;
the figures are drawn for real in tests/test_plotting*.py."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parent


@contextlib.contextmanager
def children_undrawn() -> Iterator[None]:
    """Inside the block, every child process started with this process's environment (or a
    copy of it) saves its matplotlib figures as a placeholder PNG without drawing them."""
    with pytest.MonkeyPatch.context() as patch:
        rest = os.environ.get("PYTHONPATH")
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(FOLDER), rest))))
        yield
