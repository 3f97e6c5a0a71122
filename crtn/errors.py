"""User-facing errors.

A :class:`UserError` is raised for bad input that the user can fix: a missing
corpus file, an invalid config value, a corrupt checkpoint. The command-line
entry points print its message as a single line (``crtn-train: error: ...``)
and exit with status 2, without a traceback. Every message names the file,
config key or value at fault and says what was expected.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (file, config key or value) reported as one line, no traceback."""


class ConfigError(UserError):
    """An invalid configuration value; the message names the key, e.g. ``model.tgt_len``."""


class DataError(UserError):
    """A missing, empty or malformed corpus file; the message names the file."""


class CheckpointError(UserError):
    """A missing, corrupt or mismatched checkpoint; the message names the file."""


def check_choice(key: str, value: object, options: tuple | dict | list) -> None:
    """Raise :class:`ConfigError` ``KEY=VALUE is not one of: A, B`` unless ``value`` is in ``options``."""
    if value not in options:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(str, options))}")
