"""`ConfigError`: a flag or combination of flags that cannot run (torch-free, no imports of ours)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag or combination of flags that cannot run; the message names the flag."""


def fail(flag: str, message: str) -> ConfigError:
    """The error for `flag`, its message starting with the flag."""
    return ConfigError(f"{flag}: {message}")
