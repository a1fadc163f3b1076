"""utils.background: a function run in a forked child while the caller goes on, its errors raised
in the parent, and the same function run inline where no fork or second core is available."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cals_seg.utils import background
from cals_seg.utils.background import Background, background_available


def _write(path: Path, text: str) -> None:
    path.write_text(f"{text} {os.getpid()}")


def _fail() -> None:
    raise ValueError("the child's own message")


def _die() -> None:
    os._exit(3)


@pytest.mark.skipif(not background_available(), reason="no fork or a single core here")
def test_the_function_runs_in_a_child_and_is_joined(tmp_path):
    job = Background()
    job.start(_write, tmp_path / "out.txt", text="done")
    job.wait()
    text, pid = (tmp_path / "out.txt").read_text().split()
    assert text == "done" and int(pid) != os.getpid()
    job.wait()  # nothing left to join: a no-op


@pytest.mark.skipif(not background_available(), reason="no fork or a single core here")
@pytest.mark.parametrize("fn, message", [(_fail, "ValueError: the child's own message"),
                                         (_die, "exit code 3")])
def test_a_failure_in_the_child_is_raised_by_wait(fn, message):
    job = Background()
    job.start(fn)
    with pytest.raises(RuntimeError, match=message):
        job.wait()


def test_without_fork_or_a_second_core_it_runs_inline(tmp_path, monkeypatch):
    monkeypatch.setenv(background.ENV, "0")
    assert not background_available()
    job = Background()
    job.start(_write, tmp_path / "out.txt", text="inline")
    assert (tmp_path / "out.txt").read_text() == f"inline {os.getpid()}"  # before wait
    job.wait()
    with pytest.raises(ValueError, match="own message"):
        job.start(_fail)  # inline: the error is the function's own


def test_a_second_start_joins_the_first(tmp_path):
    job = Background()
    job.start(_write, tmp_path / "a.txt", text="a")
    job.start(_write, tmp_path / "b.txt", text="b")
    job.wait()
    assert (tmp_path / "a.txt").is_file() and (tmp_path / "b.txt").is_file()
