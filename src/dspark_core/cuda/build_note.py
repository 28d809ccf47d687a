"""The build's note about CUDA, read back from the installed package.

The build (csrc/cuda/CMakeLists.txt, ``dspark_build_note``) says in one line
what it compiled for CUDA (``CUDA kernels: none (...)``, ``CUDA kernels
enabled (...)``). pip shows a build's output only with ``-v`` and the line's
terminal copy goes to ``/dev/tty``, which a CI log or a redirected build never
sees; so the build also installs the line as ``dspark_core/_ext/build_note.txt``,
next to the extensions, and :func:`build_note` reads it (``dspark-core
kernels`` prints it as ``build: CUDA kernels: ...``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["NOTE_FILE", "build_note"]

#: The note's file, in the folder of the compiled extensions.
NOTE_FILE = "build_note.txt"


def build_note() -> str | None:
    """The build's CUDA line (``"CUDA kernels: ..."``), or None where the build recorded none.

    Found beside a compiled extension rather than this file, so that it is right for editable
    installs too (their Python files stay in the source tree, the build's output does not).
    """
    from .._ext import _row_format

    path = Path(_row_format.__file__).resolve().parent / NOTE_FILE
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text or None
