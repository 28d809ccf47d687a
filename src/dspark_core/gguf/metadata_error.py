"""The error every drafter reader raises for a file it cannot use."""

from __future__ import annotations

import os

from ..errors import ConfigError
from .printable import printable

__all__ = ["DrafterMetadataError"]


class DrafterMetadataError(ConfigError):
    """A drafter file (a GGUF or a ``config.json``) that cannot be used: missing, not a
    regular file, not a GGUF, truncated, beyond a limit, or missing / mistyped
    metadata. The message is ``"<path>: <problem>"``, escaped to be printable (a file's
    text may hold lone surrogates or control characters).

    Attributes:
        path: the file, as given.
        problem: what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(printable(f"{self.path}: {problem}"))
