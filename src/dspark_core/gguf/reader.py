"""The gguf-py adapter: open a drafter GGUF strictly and read typed metadata fields.

Every problem with the file (missing, not a regular file, not a GGUF,
truncated, a count or length beyond the limits below, a mistyped field) is a
:class:`DrafterMetadataError` naming the file; gguf-py's own exceptions never
leak out. :mod:`dspark_core.gguf.drafter_info` builds
:class:`~dspark_core.DrafterInfo` from these fields.

Limits: every read is bounded by the file's size (a count that claims more
than the file holds is "truncated"); the header may claim at most
:data:`MAX_GGUF_KV_PAIRS` metadata pairs and :data:`MAX_GGUF_TENSORS` tensors,
a string at most :data:`MAX_GGUF_STRING_BYTES` bytes and a tensor at most
:data:`MAX_GGUF_TENSOR_DIMS` dimensions (ggml's own ``GGML_MAX_DIMS``). A
message's text is escaped to be printable (:func:`~dspark_core.gguf.printable.printable`).
"""

from __future__ import annotations

import os
import struct
import sys
from typing import Any, Mapping

from .metadata_error import DrafterMetadataError
from .printable import printable
from .regular_file import open_regular

__all__ = [
    "DrafterMetadataError", "MAX_GGUF_KV_PAIRS", "MAX_GGUF_TENSORS", "MAX_GGUF_STRING_BYTES",
    "MAX_GGUF_TENSOR_DIMS", "check_trained_range",
]

#: The most metadata key / value pairs a drafter GGUF's header may claim (drafters
#: carry a few dozen, a target's tokenizer included).
MAX_GGUF_KV_PAIRS = 1 << 16
#: The most tensors a drafter GGUF's header may claim (a drafter has tens to hundreds).
MAX_GGUF_TENSORS = 1 << 16
#: The longest string (a key, a value, a tensor name) read from a GGUF, in bytes:
#: room for a whole ``tokenizer.huggingface.json``.
MAX_GGUF_STRING_BYTES = 64 << 20
#: The most dimensions a tensor may have (``GGML_MAX_DIMS``).
MAX_GGUF_TENSOR_DIMS = 4

_GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_SUPPORTED_VERSIONS = (2, 3)

# Families whose key spellings are accepted whatever the file's architecture.
_FAMILY_PREFIXES = ("dspark.dspark", "dspark", "dflash", "dflash.dflash")


# ---------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------


def check_trained_range(path: str, n_train: int, source: str, block_size: int) -> None:
    """A drafter's trained range must hold a window with room for a rebase: ``n_ctx_train > 2 * block_size``.

    ``source``: where ``n_train`` came from (a key, or ``"override"``), named in the error.

    Raises:
        DrafterMetadataError: naming the file, the value and its source.
    """
    if n_train <= 2 * block_size:
        src = "the override" if source == "override" else source
        raise DrafterMetadataError(
            path,
            f"n_ctx_train ({n_train}, from {src}) must be greater than 2 * block_size "
            f"(2 * {block_size} = {2 * block_size}): no drafter window could hold a rebase",
        )


class _OverLimit(Exception):
    """Raised by the strict reader when the file claims more than a limit allows."""

    def __init__(self, what: str, claimed: int, limit: int) -> None:
        super().__init__(f"{what} of {claimed} exceeds the limit of {limit}")


class _Truncated(Exception):
    """Raised by the strict reader when a read runs past the end of the file."""

    def __init__(self, offset: int, size: int) -> None:
        super().__init__(offset, size)
        self.offset = offset
        self.size = size


_READER_CLASS: Any = None


def _reader_class() -> Any:
    """A :class:`gguf.GGUFReader` subclass that is strict and fast on metadata.

    Three changes to the stock reader, on its (stable since 2023) helpers
    ``_get``, ``_get_str``, ``_get_field_parts`` and ``_get_tensor_info_field``:

    * a read past the end of the file raises :class:`_Truncated` instead of
      returning a short array (the stock reader then fails later with an
      unrelated ``IndexError``, or loops over a corrupt array length);
    * arrays are not walked element by element: an array of fixed-size
      scalars is one memory-mapped view, and an array of strings (the
      tokenizer's ``tokens`` / ``merges``, 150k+ entries each in drafters that
      carry the target's tokenizer) is skipped over by reading its length
      prefixes only. The stock reader builds two numpy views per entry, which
      takes about 6 s for a Qwen-sized vocabulary. Skipped string arrays read
      back as empty; nothing here needs their contents;
    * a string longer than :data:`MAX_GGUF_STRING_BYTES` or a tensor with more than
      :data:`MAX_GGUF_TENSOR_DIMS` dimensions raises :class:`_OverLimit`.

    If the installed gguf lacks those helpers the stock reader is used as is.
    """
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    helpers = ("_get", "_get_str", "_get_field_parts", "_get_tensor_info_field")
    if not all(callable(getattr(GGUFReader, h, None)) for h in helpers):
        _READER_CLASS = GGUFReader  # pragma: no cover - other gguf versions
        return _READER_CLASS

    class _MetadataReader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            count = int(count)
            itemsize = np.dtype(dtype).itemsize
            if offset < 0 or offset + itemsize * count > self.data.shape[0]:
                raise _Truncated(offset + itemsize * count, int(self.data.shape[0]))
            return super()._get(offset, dtype, count, override_order)

        def _get_str(self, offset: int) -> Any:
            slen = self._get(offset, np.uint64)
            if int(slen[0]) > MAX_GGUF_STRING_BYTES:
                raise _OverLimit(f"a string at offset {offset}: a length", int(slen[0]), MAX_GGUF_STRING_BYTES)
            return slen, self._get(offset + 8, np.uint8, slen[0])

        def _get_tensor_info_field(self, orig_offs: int) -> Any:
            fld = super()._get_tensor_info_field(orig_offs)
            n_dims = int(fld.parts[2][0])
            if n_dims > MAX_GGUF_TENSOR_DIMS:
                raise _OverLimit(f"tensor {printable(fld.name)!r}: a dimension count", n_dims, MAX_GGUF_TENSOR_DIMS)
            return fld

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            offs = orig_offs
            raw_itype = self._get(offs, np.uint32)
            offs += 4
            alen = self._get(offs, np.uint64)
            offs += 8
            itype = GGUFValueType(int(raw_itype[0]))
            n = int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                offs += int(values.nbytes)
                return offs - orig_offs, [raw_itype, alen, values], ([2] if n else []), [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING:
                size = int(self.data.shape[0])
                if n > (size - offs) // 8:
                    raise _Truncated(offs + 8 * n, size)
                big = (self.byte_order == "S") == (sys.byteorder == "little")
                unpack = struct.Struct(">Q" if big else "<Q").unpack_from
                view = self.data.data  # the file's bytes (memoryview of the memmap)
                try:
                    for _ in range(n):
                        if offs + 8 > size:
                            raise _Truncated(offs + 8, size)
                        offs += 8 + unpack(view, offs)[0]
                finally:
                    view.release()
                if offs > size:
                    raise _Truncated(offs, size)
                return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]
            # arrays of arrays: the stock element-by-element walk
            return super()._get_field_parts(orig_offs, raw_type)

    _READER_CLASS = _MetadataReader
    return _READER_CLASS


def _open_reader(path: str) -> Any:
    """Check the file up front (clear messages), then parse it with the reader."""
    with open_regular(path, "GGUF file") as f:
        return _parse(path, f)


def _parse(path: str, f: Any) -> Any:
    """Check the header of the open regular file ``f``, then parse it (the reader maps ``f``
    itself, not the path, which may name another file by now)."""
    size = os.fstat(f.fileno()).st_size
    try:
        head = f.read(_HEADER_BYTES)
    except OSError as exc:
        raise DrafterMetadataError(path, f"cannot read: {exc.strerror or exc}") from None
    if size == 0 or not head:
        raise DrafterMetadataError(path, "empty file, not a GGUF file")
    if head[:4] != _GGUF_MAGIC:
        raise DrafterMetadataError(path, f"not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER_BYTES:
        raise DrafterMetadataError(path, f"truncated GGUF: {size} bytes, shorter than the {_HEADER_BYTES}-byte header")
    order: Any = "little"
    version = int.from_bytes(head[4:8], order)
    if version & 0xFFFF == 0:  # written with the other byte order
        order = "big"
        version = int.from_bytes(head[4:8], order)
    if version not in _SUPPORTED_VERSIONS:
        raise DrafterMetadataError(path, f"unsupported GGUF version {version} (supported: 2, 3)")
    # The counts bound the parser's loops: checked before it runs.
    for what, start, limit in (("tensors", 8, MAX_GGUF_TENSORS), ("metadata pairs", 16, MAX_GGUF_KV_PAIRS)):
        claimed = int.from_bytes(head[start:start + 8], order)
        if claimed > limit:
            raise DrafterMetadataError(path, f"corrupt GGUF: the header claims {claimed} {what}, more than the "
                                             f"{limit} a drafter may have")

    # The problem is raised outside the ``except`` blocks so that the error keeps
    # no reference to the parser's exception (whose frames hold the mapping).
    problem = None
    try:
        return _reader_class()(f, "r")
    except _Truncated as exc:
        problem = f"truncated GGUF: needs {exc.offset} bytes, the file has {exc.size}"
    except _OverLimit as exc:
        problem = f"corrupt GGUF: {exc}"
    except MemoryError:
        problem = "corrupt GGUF: a header field claims an impossible size"
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    except Exception as exc:  # noqa: BLE001 - anything the parser raises means a bad file
        detail = str(exc) or type(exc).__name__
        # The stock reader fails a short payload with "cannot reshape array of size 0 ...".
        kind = "truncated or corrupt GGUF" if "reshape" in detail or isinstance(exc, (IndexError, struct.error)) else "corrupt GGUF"
        problem = f"{kind} ({type(exc).__name__}: {detail})"
    raise DrafterMetadataError(path, problem)


# ---------------------------------------------------------------------------
# Typed access to fields
# ---------------------------------------------------------------------------


def _type_name(fld: Any) -> str:
    from gguf import GGUFValueType

    types = list(fld.types)
    if not types:
        return "unknown"
    if types[0] == GGUFValueType.ARRAY:
        sub = _array_item_type(fld)
        return f"ARRAY[{sub.name if sub is not None else '?'}]"
    return GGUFValueType(types[0]).name


def _array_item_type(fld: Any) -> Any:
    from gguf import GGUFValueType

    if len(fld.types) > 1:
        return GGUFValueType(fld.types[-1])
    try:  # empty array: the item type is the first part after key and value type
        return GGUFValueType(int(fld.parts[3][0]))
    except Exception:  # noqa: BLE001
        return None


def _int_types() -> frozenset[Any]:
    from gguf import GGUFValueType as T

    return frozenset({T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64})


class _Fields:
    """The reader's fields plus the path, for error messages."""

    def __init__(self, path: str, reader: Any) -> None:
        self.path = path
        self.fields: Mapping[str, Any] = reader.fields

    def first(self, keys: list[str]) -> tuple[str, Any | None]:
        """The first of ``keys`` present and its field; ``(keys[0], None)`` when none is."""
        for k in keys:
            fld = self.fields.get(k)
            if fld is not None:
                return k, fld
        return keys[0], None

    def bad(self, key: str, problem: str) -> DrafterMetadataError:
        return DrafterMetadataError(self.path, f"{key}: {problem}")

    def string(self, key: str) -> str | None:
        from gguf import GGUFValueType

        fld = self.fields.get(key)
        if fld is None:
            return None
        if list(fld.types) != [GGUFValueType.STRING]:
            raise self.bad(key, f"expected a string, found {_type_name(fld)}")
        try:
            return bytes(fld.parts[-1]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(key, "is not valid UTF-8") from None

    def integer(self, key: str, fld: Any, minimum: int = 0) -> int:
        types = list(fld.types)
        if len(types) != 1 or types[0] not in _int_types():
            raise self.bad(key, f"expected an integer, found {_type_name(fld)}")
        v = int(fld.parts[fld.data[0]][0])
        if v < minimum:
            raise self.bad(key, f"must be >= {minimum}, found {v}")
        return v

    def int_array(self, key: str, fld: Any) -> tuple[int, ...]:
        from gguf import GGUFValueType

        types = list(fld.types)
        if not types or types[0] != GGUFValueType.ARRAY:
            raise self.bad(key, f"expected an integer array, found {_type_name(fld)}")
        if _array_item_type(fld) not in _int_types():
            raise self.bad(key, f"expected an integer array, found {_type_name(fld)}")
        values = tuple(int(v) for idx in fld.data for v in fld.parts[idx].tolist())
        if not values:
            raise self.bad(key, "is an empty array")
        if min(values) < 0:
            raise self.bad(key, f"layer ids must be >= 0, found {list(values)}")
        return values


def _spellings(arch: str, name: str, extra_names: tuple[str, ...] = ()) -> list[str]:
    """Keys tried for ``name``, in order: ``A.A.name``, ``A.name``, then the families'."""
    keys: list[str] = []
    for n in (name, *extra_names):
        for prefix in (f"{arch}.{arch}", arch, *_FAMILY_PREFIXES):
            k = f"{prefix}.{n}"
            if k not in keys:
                keys.append(k)
    return keys


# Tensor names taken for the feature projection (the layer that maps the
# concatenated target features, width n_capture * n_embd_target, into the
# drafter): a dotted component equal to one of these, or ending in "proj".
_FC_COMPONENTS = frozenset({"fc", "enc", "encoder", "feature_proj", "hidden_proj", "input_proj"})


def _is_fc_name(name: str) -> bool:
    parts = name.lower().split(".")
    if parts[-1] != "weight":
        return False
    stem = parts[:-1]
    return any(p in _FC_COMPONENTS or p.endswith("proj") for p in stem)


def _feature_dim_from_tensors(
    tensors: list[Any], n_layers: int, hidden_sizes: tuple[int, ...]
) -> tuple[int, str] | None:
    """Best-effort feature width from the feature projection tensor's shape.

    Among 2-D tensors named like a feature projection (``fc.weight``,
    ``dflash.fc.weight``, ``enc.weight``, ``*proj.weight``; see
    :data:`_FC_COMPONENTS`), GGUF inner dim ``ne[0]``:

    1. a tensor with ``ne[0] == n_layers * h`` for a known hidden size ``h``
       (the target's or the drafter's ``embedding_length``), if exactly one
       width matches;
    2. else a tensor whose name's last component before ``weight`` is exactly
       ``fc`` with ``ne[0] % n_layers == 0`` (DFlash's ``fc.weight`` is
       ``[n_capture * n_embd_target, n_embd]``), if exactly one width matches;
    3. else unknown (``None``). Never an error.
    """
    if n_layers <= 0:
        return None
    cands = []
    for t in tensors:
        dims = [int(d) for d in t.shape]
        if len(dims) == 2 and _is_fc_name(t.name):
            cands.append((t.name, dims[0]))
    tier1 = {(n, d) for n, d in cands if any(d == n_layers * h for h in hidden_sizes if h > 0)}
    if len({d for _, d in tier1}) == 1:
        name, d = sorted(tier1)[0]
        return d, f"tensor {name}"
    tier2 = {(n, d) for n, d in cands if n.lower().split(".")[-2] == "fc" and d % n_layers == 0}
    if len({d for _, d in tier2}) == 1:
        name, d = sorted(tier2)[0]
        return d, f"tensor {name}"
    return None
