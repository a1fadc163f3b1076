"""The toolkit's exceptions, in one light module (no torch import), so that a command can name
what it catches before it imports anything heavy."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override that does not match :class:`cals_seg.config.Config`."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (missing, truncated, or not written by this toolkit)."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; training stops, checkpoints stay intact."""


class WeightsUnavailableError(RuntimeError):
    """Pretrained weights were asked for but could not be downloaded."""


# Errors caused by the user's input (config, data, checkpoint, network): the tools print them as
# "error: <message>" with exit code 2 instead of a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NonFiniteLossError,
    WeightsUnavailableError,
)

__all__ = [
    "USER_ERRORS",
    "CheckpointError",
    "ConfigError",
    "NonFiniteLossError",
    "WeightsUnavailableError",
]
