"""The toolkit's exceptions, in one light module (no torch import), so that a command can name
what it catches before it imports anything heavy.

Every error that a user can fix by changing a config value, a ``--set`` item, a command-line
argument, a data file or a checkpoint is a :class:`UserError`: the command-line tools catch that
one type and print it as one line (``error: <message>``, exit status 2). Anything else is a bug
of the toolkit (or of a library it calls) and keeps its traceback.

:class:`UserError` is a ``ValueError``, so code that caught the ``ValueError`` of a bad input
keeps working; the kinds below also keep the built-in type their callers knew (a missing file is
still a ``FileNotFoundError``, a diverging run still a ``RuntimeError``).

Message format (see :mod:`cals_seg.config.rules`): the key or file, what is allowed, the value, the
fix::

    train.epochs: expected an integer >= 1, got 0; e.g. --set train.epochs=30.
"""

from __future__ import annotations


class UserError(ValueError):
    """An error caused by the user's input; its message names the key or file and the fix."""


class ConfigError(UserError):
    """A config file or override that does not match :class:`cals_seg.config.Config`."""


class RunFileError(UserError):
    """A file of a run folder that cannot be used as it is (empty, truncated, not the kind of
    file its name says, a key missing, a value out of range): one line naming the file, what
    is wrong and the way out, ``<file> <problem>; <fix>.`` (``RunFileError(message)`` alone
    rebuilds one from its text, as a DataLoader worker's error is rebuilt)."""

    def __init__(self, path: object, problem: str | None = None, fix: str | None = None) -> None:
        text = str(path) if problem is None else " ".join(
            f"{path} {problem}; {(fix or '').rstrip('.')}.".split())
        super().__init__(text)
        self.path, self.problem, self.fix = path, problem, fix


class CheckpointError(RunFileError):
    """A checkpoint that cannot be read (missing, truncated, or not written by this toolkit)."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint whose pickle would build Python objects beyond tensors and plain types."""


class DataError(UserError):
    """A dataset that cannot be used as it is: a missing folder or file, a malformed split
    file, a mask with values outside the classes, an image and a mask of different sizes."""


class MissingPathError(UserError, FileNotFoundError):
    """A file or folder the user named (or that a run needs) does not exist."""


class RunExistsError(UserError, FileExistsError):
    """A run folder that already holds a run, where a new run was asked for."""


class NonFiniteLossError(UserError, RuntimeError):
    """The training loss became NaN or infinite; training stops, checkpoints stay intact."""


class WeightsUnavailableError(UserError, RuntimeError):
    """Pretrained weights were asked for but could not be downloaded."""


# What the tools catch (a tuple for code that writes ``except USER_ERRORS``): the one type.
USER_ERRORS: tuple[type[Exception], ...] = (UserError,)

__all__ = [
    "USER_ERRORS",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "MissingPathError",
    "NonFiniteLossError",
    "RunExistsError",
    "RunFileError",
    "UntrustedCheckpointError",
    "UserError",
    "WeightsUnavailableError",
]
