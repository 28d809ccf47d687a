"""Exceptions raised by dspark_core.

Every error the C++ core reports reaches Python as one of these (or as a plain
``ValueError`` / ``TypeError`` for a bad argument); nothing a caller does can
abort the process.
"""

from __future__ import annotations

__all__ = ["ConfigError", "StateError"]


class ConfigError(ValueError):
    """A configuration that cannot work, e.g. ``window <= 2 * block_size``."""


class StateError(RuntimeError):
    """A call made in the wrong protocol state, e.g. ``process`` while a round is open."""
