"""`ConfigError` and `require`, the check every config dataclass uses. Standard library only."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration is missing a field, has an inconsistent one, or is of an unknown kind."""


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)
