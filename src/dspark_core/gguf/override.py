"""A caller's integer argument to a drafter reader (``block_size=``, ``n_ctx_train=``, ...).

``bool`` is an ``int`` subclass with ``__index__``, so ``block_size=True`` would
pass an integer check as 1: a flag given where a count belongs. It is refused
with a ``TypeError``, the error of an argument of the wrong kind; any other
non-integer (a float, a string) and a value below 1 stay the ``ConfigError``
the readers have always raised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..stager.config import positive_int

__all__ = ["override_int", "strict_int"]


def strict_int(name: str, value: Any) -> None:
    """Refuse a bool given for the integer argument ``name`` (a TypeError naming it)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool")


def override_int(name: str, value: Any) -> int | None:
    """``value`` as an int ``>= 1``, or ``None`` when not given.

    Raises:
        TypeError: ``value`` is a bool.
        ConfigError: not an integer, or below 1.
    """
    if value is None:
        return None
    strict_int(name, value)
    return positive_int(name, value)
