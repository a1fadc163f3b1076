"""Checkpoint files read once per test module, for files whose commands load the same run
again and again (tests/test_run_files.py): what those commands check is how a run's other
files are read, not the unpickling of one unchanged checkpoint (torch.load with weights_only:
a pure-Python unpickler)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch


def read_once(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load`` (:func:`cals_seg.utils.io.load_checkpoint`) remembering what it read from each
    file, known by its inode, size and modification time (a damaged file is a new one: it is
    read for real, and a refusal is raised again each time); a later read of the same file gets
    a copy (the tensors cloned: a resumed training steps its optimizer's state in place)."""
    from torch.utils._pytree import tree_map

    read: dict[tuple, Any] = {}

    def load_once(path: Any, map_location: Any = "cpu", fix: str | None = None) -> Any:
        try:
            st = os.stat(path)
        except OSError:
            return load(path, map_location, fix)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, str(map_location))
        if key not in read:
            read[key] = load(path, map_location, fix)
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, read[key])

    return load_once


@contextlib.contextmanager
def checkpoints_read_once() -> Iterator[None]:
    """:func:`read_once` in place of the checkpoint reader of every run the toolkit loads
    (:meth:`cals_seg.runs.run.Run.read_checkpoint`, a run's repair), put back on exit."""
    from cals_seg.runs import run as lib

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lib, "load_checkpoint", read_once(lib.load_checkpoint))
        yield
