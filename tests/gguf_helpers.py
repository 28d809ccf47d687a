"""Helpers that write small (or sparse, large) drafter GGUF files for the tests.

Import from a test module as ``from gguf_helpers import write_gguf`` (pytest puts
``tests/`` on ``sys.path`` because it has no ``__init__.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from gguf import GGUFEndian, GGUFValueType, GGUFWriter

__all__ = ["T", "typed", "write_gguf", "dspark_kv", "dflash_kv", "data_offset"]

T = GGUFValueType
_ALIGN = 32


class typed:
    """A metadata value with an explicit GGUF type: ``typed([1, 2], T.ARRAY, T.UINT64)``."""

    def __init__(self, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        self.value, self.vtype, self.sub_type = value, vtype, sub_type


def _pad(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


def write_gguf(
    path: str | os.PathLike[str],
    arch: str | None = "dspark",
    kv: Mapping[str, Any] | None = None,
    tensors: Iterable[tuple[str, Sequence[int], Any]] = (),
    endianess: GGUFEndian = GGUFEndian.LITTLE,
) -> Path:
    """Write a GGUF with metadata ``kv`` and tensors whose data are zeros.

    ``kv`` values: ``int`` -> UINT32, ``float`` -> FLOAT32, ``str`` -> STRING,
    ``bool`` -> BOOL, a list of ints -> ARRAY[INT32], or a :class:`typed`.
    ``tensors``: ``(name, numpy_shape, numpy_dtype)``; the GGUF dims are the
    numpy shape reversed (``ne[0]`` is the last numpy axis). The payload is not
    written: the file is extended with ``truncate``, so a 400 MB tensor costs no
    disk blocks on a filesystem with sparse files, and no time.
    ``arch=None`` writes no ``general.architecture`` key; ``endianess`` picks
    the file's byte order.
    """
    path = Path(path)
    w = GGUFWriter(path, arch or "x", endianess=endianess)
    if arch is None:
        w.kv_data[0].pop("general.architecture", None)
    for key, value in (kv or {}).items():
        if isinstance(value, typed):
            w.add_key_value(key, value.value, value.vtype, sub_type=value.sub_type)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, (list, tuple)):
            w.add_key_value(key, list(value), T.ARRAY, sub_type=T.INT32)
        else:  # pragma: no cover - helper misuse
            raise TypeError(f"unsupported metadata value {value!r}")
    payload = 0
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, tuple(shape), np.dtype(dtype), nbytes)
        payload += _pad(nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(_pad(size) + payload)
    return path


def data_offset(path: str | os.PathLike[str]) -> int:
    """Where the tensor data of a file written by :func:`write_gguf` starts."""
    from gguf import GGUFReader

    return int(GGUFReader(path).data_offset)


def dspark_kv(
    block_size: int = 16,
    mask_token_id: int = 151669,
    target_layers: Sequence[int] = (1, 16, 31, 46, 61),
    context_length: int | None = 4096,
    style: str = "dspark.dspark",
    **extra: Any,
) -> dict[str, Any]:
    """Drafter metadata in the DSpark spelling ``<style>.block_size`` etc."""
    kv: dict[str, Any] = {
        f"{style}.block_size": block_size,
        f"{style}.mask_token_id": mask_token_id,
        f"{style}.target_layers": list(target_layers),
    }
    if context_length is not None:
        kv["dspark.context_length"] = context_length
    kv.update(extra)
    return kv


def dflash_kv(
    block_size: int = 10,
    mask_token_id: int = 200000,
    target_layers: Sequence[int] = (2, 10, 18, 26, 34),
    context_length: int | None = 4096,
    **extra: Any,
) -> dict[str, Any]:
    """Drafter metadata as llama.cpp's DFlash converter writes it (mask token on the tokenizer key)."""
    kv: dict[str, Any] = {
        "dflash.block_size": block_size,
        "tokenizer.ggml.mask_token_id": mask_token_id,
        "dflash.target_layers": list(target_layers),
    }
    if context_length is not None:
        kv["dflash.context_length"] = context_length
    kv.update(extra)
    return kv
