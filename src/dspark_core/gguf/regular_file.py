"""Opening a drafter's metadata file: regular files only, read within a size bound.

A drafter path comes from a user or a server's settings: it may name a FIFO,
a device, a socket or a file of any size. The readers open only regular files
(a FIFO would block the process forever, ``/dev/zero`` never ends) and read a
whole file only up to a bound (:func:`read_regular`). The type is checked on the
opened descriptor (``fstat``, after an ``O_NONBLOCK`` open that cannot wait on
a FIFO's writer), so a file swapped between the check and the open is caught.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .metadata_error import DrafterMetadataError

__all__ = ["open_regular", "read_regular"]

# Opening a FIFO for reading waits for a writer unless O_NONBLOCK is given
# (a regular file ignores the flag). Not every platform has it.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def _kind(mode: int) -> str:
    """What a non-regular file is, for the error message."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str, what: str, missing: str = "no such file") -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file.

    ``what`` names the file the caller expects (``"GGUF file"``), ``missing`` the
    problem a missing file is, for the messages.

    Raises:
        DrafterMetadataError: missing, unreadable, or not a regular file.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DrafterMetadataError(path, missing) from None
    except OSError as exc:
        raise DrafterMetadataError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):  # checked before opening: opening a FIFO could block
        raise DrafterMetadataError(path, f"is {_kind(st.st_mode)}, not a {what}: only regular files are read")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise DrafterMetadataError(path, f"cannot read the file ({exc.strerror or exc})") from None
    f = os.fdopen(fd, "rb")
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced between the stat and the open
        f.close()
        raise DrafterMetadataError(path, f"is {_kind(mode)}, not a {what}: only regular files are read")
    return f


def read_regular(path: str, what: str, max_bytes: int, missing: str = "no such file") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Raises:
        DrafterMetadataError: missing, unreadable, not a regular file, or larger than ``max_bytes``.
    """
    with open_regular(path, what, missing) as f:
        try:
            data = f.read(max_bytes + 1)  # one more: a larger file is refused, never read whole
        except OSError as exc:
            raise DrafterMetadataError(path, f"cannot read the file ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise DrafterMetadataError(path, f"larger than {max_bytes} bytes, the most a {what} may hold")
    return data
