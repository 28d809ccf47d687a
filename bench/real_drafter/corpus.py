"""The documents: real, deterministic text every machine with Python has, its standard library's sources.

Long files, so that each document reaches past ``16 T`` positions (T = 256: 4,096
tokens and more); code is text a small model predicts well enough for a small
drafter to learn from. Training and evaluation use disjoint files. A document's
text is read from the running interpreter's standard library, so another Python
version gives other text (and other cache keys: the capture's key holds the text's
digest).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Document", "TRAIN_MODULES", "EVAL_MODULES", "load", "SMOKE_TRAIN", "SMOKE_EVAL"]

#: Standard-library modules the drafters are trained on (each source over 50 kB).
TRAIN_MODULES = (
    "argparse", "subprocess", "typing", "inspect", "tarfile", "collections", "logging", "doctest", "pydoc",
)
#: Held-out modules the drafters are evaluated on, offline and live.
EVAL_MODULES = ("difflib", "ssl", "shutil", "threading", "enum", "dataclasses", "configparser", "ast")
#: The CI smoke run's few documents.
SMOKE_TRAIN = ("argparse",)
SMOKE_EVAL = ("difflib", "shutil")


@dataclass(frozen=True)
class Document:
    """A document: its name (the file's path inside the standard library) and text."""

    name: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load(modules: tuple[str, ...] | list[str]) -> list[Document]:
    """The documents of ``modules`` (standard-library modules: a module's source, a package's
    ``__init__``), each named by its file's path inside this interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for module in modules:
        single = Path(*module.split(".")).with_suffix(".py")
        package = Path(*module.split("."), "__init__.py")
        name = next((p for p in (single, package) if (root / p).is_file()), None)
        if name is None:
            raise FileNotFoundError(f"the standard library has no module {module} (looked in {root})")
        out.append(Document(name.as_posix(), (root / name).read_text(encoding="utf-8")))
    return out
