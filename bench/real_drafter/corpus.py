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

#: Standard-library files the drafters are trained on (each over 50 kB).
TRAIN_MODULES = (
    "argparse.py", "subprocess.py", "typing.py", "inspect.py", "tarfile.py",
    "collections/__init__.py", "logging/__init__.py", "doctest.py", "pydoc.py",
)
#: Held-out files the drafters are evaluated on, offline and live.
EVAL_MODULES = (
    "difflib.py", "ssl.py", "shutil.py", "threading.py", "enum.py", "dataclasses.py",
    "configparser.py", "ast.py",
)
#: The CI smoke run's few documents.
SMOKE_TRAIN = ("argparse.py",)
SMOKE_EVAL = ("difflib.py", "shutil.py")


@dataclass(frozen=True)
class Document:
    """A document: its name (the file's path inside the standard library) and text."""

    name: str
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def load(names: tuple[str, ...] | list[str]) -> list[Document]:
    """The documents of ``names`` (paths inside this interpreter's standard library)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in names:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"the standard library has no {name} (looked in {root})")
        out.append(Document(name, path.read_text(encoding="utf-8")))
    return out
