"""Run one function in a forked child process while the caller goes on (figures drawn while the
evaluation streams its next split).

``eval_seg`` draws about a dozen matplotlib figures of the clean evaluation; each costs a few
hundred milliseconds of one core, and none depends on what is computed after the clean test
pass. :class:`Background` forks a child that draws them while the parent streams the corrupted
splits, and :meth:`Background.wait` joins it before the command ends, raising the child's error
in the parent. Where a second core or ``fork`` is missing (Windows, macOS's default, a process
pinned to one core) or ``CALS_SEG_BACKGROUND=0``, the function runs at once, in the caller:
the files written are the same either way.

The child never touches the parent's state that outlives it: it runs only the given function
and leaves through ``os._exit`` (multiprocessing's fork start), so no ``atexit`` handler, no
lock release and no buffered output of the parent runs twice.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

ENV = "CALS_SEG_BACKGROUND"


def background_available() -> bool:
    """Whether :class:`Background` forks: ``fork`` exists, the process may use two or more
    cores, and ``CALS_SEG_BACKGROUND`` is not ``0``."""
    if os.environ.get(ENV, "1") == "0" or "fork" not in multiprocessing.get_all_start_methods():
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return cores > 1


def _child(fn: Callable[..., Any], args: tuple, kwargs: dict, report: Any) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException:  # reported to the parent, which raises it
        report.send(traceback.format_exc())
        sys.exit(1)
    report.send(None)


class Background:
    """At most one function at a time in a forked child (see the module docstring)::

        figures = Background()
        figures.start(draw, result, out)   # returns at once (or after draw, without fork)
        ...                                # the parent goes on
        figures.wait()                     # joined; the child's error raised here

    Raises (from :meth:`wait`):
        RuntimeError: the function failed in the child (its traceback in the message) or the
            child died (its exit code).
    """

    def __init__(self) -> None:
        self._process: Any = None
        self._report: Any = None
        self.started = False  # a function was started (in a child, or run here)

    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, **kwargs)`` in a forked child, or here and now without one."""
        self.wait()
        self.started = True
        if not background_available():
            fn(*args, **kwargs)
            return
        ctx = multiprocessing.get_context("fork")
        self._report, child_end = ctx.Pipe(duplex=False)
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        self._process = ctx.Process(target=_child, args=(fn, args, kwargs, child_end),
                                    daemon=True)
        self._process.start()
        child_end.close()

    def wait(self) -> None:
        """Join the child started last (nothing to do without one); raise its error."""
        process, self._process = self._process, None
        if process is None:
            return
        error = None
        try:  # read before join (a large message would block the child); EOF: it died
            error = self._report.recv()
        except EOFError:
            pass
        finally:
            self._report.close()
        process.join()
        if error is not None:
            raise RuntimeError(f"a background job failed:\n{error}")
        if process.exitcode != 0:
            raise RuntimeError(f"a background job ended with exit code {process.exitcode}")


__all__ = ["ENV", "Background", "background_available"]
