"""One process owns a run folder: an advisory lock on ``<run>/.cals_seg.lock``.

The lock is ``fcntl.flock`` on a file in the run folder, held for as long as the process trains,
resumes or writes its evaluation into the run. The operating system drops it when the process
ends, however it ends (a crash, ``kill -9``, a power cut leaves no lock held), so there is never
a stale lock to delete by hand. The file keeps the pid of the holder, so a second process is
refused with one line naming it::

    with RunLock("runs/voc_cals"):
        ...  # train; another RunLock("runs/voc_cals") raises RunLockedError

On a system without ``fcntl`` (Windows) the lock is a no-op.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from cals_seg.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".cals_seg.lock"


class RunLockedError(UserError):
    """Another process holds the run folder's lock."""


class RunLock:
    """The lock of one run folder (a context manager; re-entrant within one process).

    Args:
        folder: the run folder (created when missing).
        doing: what the holder does, written next to its pid (``train``, ``eval``).
    """

    _held: dict[Path, int] = {}  # resolved folder -> open descriptor, for this process

    def __init__(self, folder: str | os.PathLike, doing: str = "train") -> None:
        self.folder = Path(folder)
        self.doing = doing
        self.fd: int | None = None
        self.owned = False

    def acquire(self) -> RunLock:
        """Take the lock, or refuse at once.

        Raises:
            RunLockedError: another process holds it, naming its pid.
            UserError: the folder cannot be created or the lock file written (one line).
        """
        from cals_seg.utils.paths import os_error

        if fcntl is None:
            return self
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            key = self.folder.resolve()
        except OSError as err:
            raise os_error(err, self.folder, "create the run folder") from None
        if key in RunLock._held:  # this process already owns it (fit inside a study ...)
            self.fd = RunLock._held[key]
            return self
        path = self.folder / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise os_error(err, path, "create the lock file") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
            os.close(fd)
            pid = holder[0] if holder else "unknown"
            what = holder[1] if len(holder) > 1 else "run"
            raise RunLockedError(
                f"{self.folder} is in use by process {pid} ({what}); wait for it to finish or "
                f"stop it (kill {pid}), then run again."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.doing}\n".encode(), 0)
        self.fd, self.owned = fd, True
        RunLock._held[key] = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: it is not a sign of a running process)."""
        if not self.owned or self.fd is None:
            return
        RunLock._held.pop(self.folder.resolve(), None)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd, self.owned = None, False

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


__all__ = ["LOCK_FILE", "RunLock", "RunLockedError"]
