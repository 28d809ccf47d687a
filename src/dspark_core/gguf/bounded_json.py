"""Parsing a drafter's ``config.json`` within bounds.

Python's ``json`` recurses once per nesting level (a deeply nested file raises
``RecursionError``) and converts integers of any length (past 4,300 digits
``int`` refuses them with a ``ValueError`` that names no file; below that the
conversion is quadratic). A drafter's config is a small, shallow object, so:

* a file larger than :data:`MAX_CONFIG_BYTES` is refused before it is read whole
  (the caller reads it with :func:`~dspark_core.gguf.regular_file.read_regular`);
* arrays and objects nested deeper than :data:`MAX_CONFIG_DEPTH` are refused
  before parsing;
* an integer of more than :data:`MAX_JSON_INT_DIGITS` digits is not converted:
  it reads back as a :class:`LongInteger`, which no key accepts as an integer,
  so the error names the key that holds it (one no key reads is ignored).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .metadata_error import DrafterMetadataError

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_JSON_INT_DIGITS", "LongInteger", "load_config_json"]

#: The largest ``config.json`` read, in bytes (published drafter configs are a few kilobytes).
MAX_CONFIG_BYTES = 4 << 20
#: The deepest nesting of arrays and objects (the top-level object is depth 1; drafter
#: configs reach 4 or 5, a quantization config included).
MAX_CONFIG_DEPTH = 64
#: The longest integer converted, in digits (``2**64`` has 20).
MAX_JSON_INT_DIGITS = 20

# A JSON string (escapes included): removed before counting brackets, which may appear in strings.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]")


class LongInteger:
    """An integer literal longer than :data:`MAX_JSON_INT_DIGITS` digits, left unconverted."""

    def __init__(self, literal: str) -> None:
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits (at most {MAX_JSON_INT_DIGITS} are read)"


def _parse_int(literal: str) -> int | LongInteger:
    return LongInteger(literal) if len(literal.lstrip("-")) > MAX_JSON_INT_DIGITS else int(literal)


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``data`` (0: a scalar)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", data))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def load_config_json(path: str, data: bytes) -> Any:
    """The JSON value of the file ``path``, whose bytes are ``data``.

    Raises:
        DrafterMetadataError: not UTF-8, not JSON, or nested deeper than :data:`MAX_CONFIG_DEPTH`.
    """
    depth = nesting_depth(data)
    if depth > MAX_CONFIG_DEPTH:
        raise DrafterMetadataError(path, f"nested {depth} levels deep, deeper than the {MAX_CONFIG_DEPTH} "
                                         "a config.json may be")
    try:
        return json.loads(data.decode("utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DrafterMetadataError(path, f"not a JSON config ({exc})") from None
    except RecursionError:  # not reached within MAX_CONFIG_DEPTH; never let it out
        raise DrafterMetadataError(path, "not a JSON config (nested too deep to parse)") from None
