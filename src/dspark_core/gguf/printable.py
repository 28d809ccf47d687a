"""Text read from a drafter's file, made safe to print.

A file's strings (an architecture, a model name) end up in tables, logs and
error messages. A lone surrogate (``"\\ud800"``, which JSON's ``\\u`` escapes
can spell) cannot be encoded to UTF-8, so printing it raises; a control
character (an ANSI escape, a carriage return) rewrites the terminal. Every
character that is not printable (``str.isprintable``) is written as its
Python escape (``\\ud800``, ``\\x1b``, ``\\n``); printable text, backslashes
included, is kept as is, so escaping twice changes nothing.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with every non-printable character (controls, lone surrogates, ...) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
