"""A cache of the benchmark's stages, each under a key made of its inputs.

A stage's result lives in ``<root>/<stage>-<key>/``; the key is a digest of a JSON
object of everything the result depends on (model file digest, tap layers, text
digests, sizes, seeds, the upstream stages' keys). A directory is complete once its
``done`` marker exists, written last, so an interrupted stage is redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["Cache", "key_of", "file_digest"]

#: Hex digits of a stage key.
KEY_LEN = 16
_DONE = "done"


def key_of(inputs: dict[str, Any]) -> str:
    """The key of a stage's inputs (order-independent)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:KEY_LEN]


_digests: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file (memoised by path, size and mtime: a model file is read once per run)."""
    st = os.stat(path)
    k = (os.fspath(path), st.st_size, st.st_mtime_ns)
    if k not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _digests[k] = h.hexdigest()
    return _digests[k]


class Cache:
    """Stage directories under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def dir(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key}"

    def done(self, stage: str, key: str) -> bool:
        return (self.dir(stage, key) / _DONE).is_file()

    def fresh(self, stage: str, key: str, inputs: dict[str, Any]) -> Path:
        """An empty directory for the stage (a stale partial one removed), its inputs written."""
        d = self.dir(stage, key)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        (d / "inputs.json").write_text(json.dumps(inputs, indent=1, sort_keys=True, default=str))
        return d

    def finish(self, stage: str, key: str) -> None:
        (self.dir(stage, key) / _DONE).write_text("")
