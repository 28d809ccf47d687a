"""Drafter metadata: what a DSpark / DFlash drafter GGUF says about itself.

:meth:`DrafterInfo.from_gguf` reads the key/value header and the tensor table
of a drafter GGUF with :class:`gguf.GGUFReader` and never touches the tensor
payload, so a multi-GB file opens in milliseconds and costs a few pages of
memory (the reader memory-maps the file; only the header pages are read).

Keys read (``A`` = ``general.architecture``; for each field the first key
present wins)::

    block_size      A.A.block_size, A.block_size, then the other family's
                    spellings: dspark.dspark.*, dspark.*, dflash.*, dflash.dflash.*
    mask_token_id   same spellings, then tokenizer.ggml.mask_token_id
                    (where llama.cpp's DFlash converter puts it)
    target_layers   same spellings (also *.target_layer_ids); an integer array
                    (i32 / u32 / i64 / u64 seen in the wild; any integer width accepted)
    n_ctx_train     the caller's override, else A.trained_context_length
                    (also A.A.trained_context_length), else A.context_length
    feature_dim     A.feature_dim, else len(target_layers) * A.target_embedding_length,
                    else from the shape of the feature projection tensor
                    (see :func:`_feature_dim_from_tensors`), else unknown

Target layer ids are reported as stored (llama.cpp's DFlash converter stores
them shifted by +1; this module does not reinterpret them).

A ``context_length`` that looks inherited from the target model (the 262144
placeholder seen in published drafters, or equal to the target's context when
one is given) draws one ``logging`` warning on the ``"dspark_core"`` logger:
that field silently decides the drafter's window.

Every problem with the file is a :class:`DrafterMetadataError`
(a :class:`~dspark_core.ConfigError`, hence a ``ValueError``) whose message is
``"<path>: <problem>"``; parser internals never leak out as a traceback.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..config import positive_int
from ..errors import ConfigError

__all__ = [
    "DrafterInfo",
    "DrafterMetadataError",
    "PLACEHOLDER_CONTEXT_LENGTH",
    "inherited_context_warning",
]

logger = logging.getLogger("dspark_core")

#: ``context_length`` value that published drafter GGUFs carry when the
#: converter copied the target's config (Qwen3-family targets): it is not a
#: trained range, so it draws a warning.
PLACEHOLDER_CONTEXT_LENGTH = 262144

_GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_SUPPORTED_VERSIONS = (2, 3)

# Families whose key spellings are accepted whatever the file's architecture.
_FAMILY_PREFIXES = ("dspark.dspark", "dspark", "dflash", "dflash.dflash")


class DrafterMetadataError(ConfigError):
    """A drafter GGUF that cannot be used: missing, not a GGUF, truncated, or
    missing / mistyped metadata. The message is ``"<path>: <problem>"``.

    Attributes:
        path: the file, as given.
        problem: what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# ---------------------------------------------------------------------------
# Reading the file
# ---------------------------------------------------------------------------


class _Truncated(Exception):
    """Raised by the strict reader when a read runs past the end of the file."""

    def __init__(self, offset: int, size: int) -> None:
        super().__init__(offset, size)
        self.offset = offset
        self.size = size


_READER_CLASS: Any = None


def _reader_class() -> Any:
    """A :class:`gguf.GGUFReader` subclass that is strict and fast on metadata.

    Two changes to the stock reader, both on its (stable since 2023) helpers
    ``_get`` and ``_get_field_parts``:

    * a read past the end of the file raises :class:`_Truncated` instead of
      returning a short array (the stock reader then fails later with an
      unrelated ``IndexError``, or loops over a corrupt array length);
    * arrays are not walked element by element: an array of fixed-size
      scalars is one memory-mapped view, and an array of strings (the
      tokenizer's ``tokens`` / ``merges``, 150k+ entries each in drafters that
      carry the target's tokenizer) is skipped over by reading its length
      prefixes only. The stock reader builds two numpy views per entry, which
      takes about 6 s for a Qwen-sized vocabulary. Skipped string arrays read
      back as empty; nothing here needs their contents.

    If the installed gguf lacks those helpers the stock reader is used as is.
    """
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    if not (callable(getattr(GGUFReader, "_get", None)) and callable(getattr(GGUFReader, "_get_field_parts", None))):
        _READER_CLASS = GGUFReader  # pragma: no cover - other gguf versions
        return _READER_CLASS

    class _MetadataReader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            count = int(count)
            itemsize = np.dtype(dtype).itemsize
            if offset < 0 or offset + itemsize * count > self.data.shape[0]:
                raise _Truncated(offset + itemsize * count, int(self.data.shape[0]))
            return super()._get(offset, dtype, count, override_order)

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
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DrafterMetadataError(path, "no such file") from None
    except OSError as exc:
        raise DrafterMetadataError(path, f"cannot open: {exc.strerror or exc}") from None
    if os.path.isdir(path):
        raise DrafterMetadataError(path, "is a directory, not a GGUF file")
    size = st.st_size
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER_BYTES)
    except OSError as exc:
        raise DrafterMetadataError(path, f"cannot read: {exc.strerror or exc}") from None
    if size == 0 or not head:
        raise DrafterMetadataError(path, "empty file, not a GGUF file")
    if head[:4] != _GGUF_MAGIC:
        raise DrafterMetadataError(path, f"not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER_BYTES:
        raise DrafterMetadataError(path, f"truncated GGUF: {size} bytes, shorter than the {_HEADER_BYTES}-byte header")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF == 0:  # written with the other byte order
        version = int.from_bytes(head[4:8], "big")
    if version not in _SUPPORTED_VERSIONS:
        raise DrafterMetadataError(path, f"unsupported GGUF version {version} (supported: 2, 3)")

    # The problem is raised outside the ``except`` blocks so that the error keeps
    # no reference to the parser's exception (whose frames hold the mapping).
    problem = None
    try:
        return _reader_class()(path, "r")
    except _Truncated as exc:
        problem = f"truncated GGUF: needs {exc.offset} bytes, the file has {exc.size}"
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


# ---------------------------------------------------------------------------
# DrafterInfo
# ---------------------------------------------------------------------------


def inherited_context_warning(key: str, value: int, arch: str, target_n_ctx: int | None = None) -> str | None:
    """The warning text for a ``context_length`` that looks inherited, or ``None``.

    It looks inherited when it is the :data:`PLACEHOLDER_CONTEXT_LENGTH`
    placeholder or equals the target's context ``target_n_ctx``.
    """
    if value == PLACEHOLDER_CONTEXT_LENGTH:
        why = "is the placeholder that drafters converted with the target's config carry"
    elif target_n_ctx is not None and value == target_n_ctx:
        why = f"equals the target's context ({target_n_ctx})"
    else:
        return None
    return (
        f"drafter {key} = {value} {why}: it looks inherited from the target model, not the "
        f"drafter's trained range, and it decides the drafter window; pass n_ctx_train= "
        f"(dspark-core inspect --n-ctx-train) or add a {arch}.trained_context_length key"
    )



@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter GGUF says about itself (see the module docstring for the keys).

    Attributes:
        path: the file read.
        architecture: ``general.architecture`` (e.g. ``"dspark"``, ``"dflash"``).
        block_size: ``B``, query rows per round (= the draft length).
        mask_token_id: the mask token filling the block after the last token, if stated.
        target_layers: target layer ids whose features the drafter reads, as stored
            (empty when the file does not say).
        n_ctx_train: the drafter's trained range, which bounds its window
            (``None`` when neither the file nor the caller says).
        n_ctx_train_source: ``"override"`` or the key it came from (``None`` if unknown).
        context_length: the raw ``<arch>.context_length`` value, if present.
        trained_context_length: the raw ``<arch>.trained_context_length`` value, if present.
        feature_dim: ``D`` (``n_capture * n_embd_target``) when the file gives it.
        feature_dim_source: the key or tensor it came from.
        embedding_length: the drafter's ``<arch>.embedding_length``, if present.
        name: ``general.name``, if present.
        n_tensors: number of tensors in the file.
        file_size: size of the file in bytes.
        warnings: warnings emitted while reading (already logged once).
        sources: field name -> key each value was read from.
    """

    path: str
    architecture: str
    block_size: int
    mask_token_id: int | None = None
    target_layers: tuple[int, ...] = ()
    n_ctx_train: int | None = None
    n_ctx_train_source: str | None = None
    context_length: int | None = None
    trained_context_length: int | None = None
    feature_dim: int | None = None
    feature_dim_source: str | None = None
    embedding_length: int | None = None
    name: str | None = None
    n_tensors: int = 0
    file_size: int = 0
    warnings: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        object.__setattr__(self, "warnings", tuple(self.warnings))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @property
    def n_capture(self) -> int:
        """Number of target layers captured (``len(target_layers)``)."""
        return len(self.target_layers)

    @property
    def context_length_looks_inherited(self) -> bool:
        """Whether reading the file warned that ``context_length`` looks inherited."""
        return bool(self.warnings)

    # -- construction ---------------------------------------------------
    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        n_ctx_train: int | None = None,
        target_n_ctx: int | None = None,
    ) -> "DrafterInfo":
        """Read a drafter GGUF's metadata (never its tensor data).

        Args:
            path: the drafter ``.gguf`` file.
            n_ctx_train: the drafter's trained range, overriding both
                ``<arch>.trained_context_length`` and ``<arch>.context_length``.
            target_n_ctx: the target's context, if known: a ``context_length``
                equal to it looks inherited and draws a warning.

        Returns:
            The metadata.

        Raises:
            DrafterMetadataError: the file is missing, not a GGUF, truncated or
                corrupt; ``block_size`` is missing; a key has the wrong type or an
                impossible value; or ``n_ctx_train <= 2 * block_size`` (no window
                could hold a rebase). The message names the file and the key.
            ConfigError: ``n_ctx_train`` / ``target_n_ctx`` is not a positive integer.
        """
        spath = os.fspath(path)
        override = None if n_ctx_train is None else positive_int("n_ctx_train", n_ctx_train)
        target = None if target_n_ctx is None else positive_int("target_n_ctx", target_n_ctx)

        reader = _open_reader(spath)
        error = None
        try:
            info = cls._from_reader(spath, reader, override, target)
        except DrafterMetadataError as exc:
            # re-raised fresh below: its traceback would otherwise keep the
            # reader (and the file mapping) alive as long as the error lives
            error = DrafterMetadataError(exc.path, exc.problem)
        finally:
            del reader
        if error is not None:
            raise error
        for w in info.warnings:
            logger.warning("%s: %s", spath, w)
        return info

    @classmethod
    def _from_reader(cls, path: str, reader: Any, override: int | None, target: int | None) -> "DrafterInfo":
        f = _Fields(path, reader)
        sources: dict[str, str] = {}

        arch = f.string("general.architecture")
        if arch is None:
            raise DrafterMetadataError(path, "missing general.architecture")
        name = f.string("general.name")

        # block size (required)
        keys = _spellings(arch, "block_size")
        key, fld = f.first(keys)
        if fld is None:
            raise DrafterMetadataError(path, f"missing block_size (looked for {', '.join(keys)})")
        block_size = f.integer(key, fld, minimum=1)
        sources["block_size"] = key

        # mask token (optional)
        key, fld = f.first(_spellings(arch, "mask_token_id") + ["tokenizer.ggml.mask_token_id"])
        mask_token_id = None
        if fld is not None:
            mask_token_id = f.integer(key, fld, minimum=0)
            sources["mask_token_id"] = key

        # target layers (optional)
        key, fld = f.first(_spellings(arch, "target_layers", ("target_layer_ids",)))
        target_layers: tuple[int, ...] = ()
        if fld is not None:
            target_layers = f.int_array(key, fld)
            sources["target_layers"] = key

        # trained range
        context_length = trained = None
        ctx_key = f"{arch}.context_length"
        if (fld := f.fields.get(ctx_key)) is not None:
            context_length = f.integer(ctx_key, fld, minimum=1)
        tkey, fld = f.first([f"{arch}.trained_context_length", f"{arch}.{arch}.trained_context_length"])
        if fld is not None:
            trained = f.integer(tkey, fld, minimum=1)
        warnings: list[str] = []
        if override is not None:
            n_train, n_train_src = override, "override"
        elif trained is not None:
            n_train, n_train_src = trained, tkey
        elif context_length is not None:
            n_train, n_train_src = context_length, ctx_key
            w = inherited_context_warning(ctx_key, context_length, arch, target)
            if w is not None:
                warnings.append(w)
        else:
            n_train, n_train_src = None, None
        if n_train_src is not None:
            sources["n_ctx_train"] = n_train_src
        if n_train is not None and n_train <= 2 * block_size:
            src = "the override" if n_train_src == "override" else n_train_src
            raise DrafterMetadataError(
                path,
                f"n_ctx_train ({n_train}, from {src}) must be greater than 2 * block_size "
                f"(2 * {block_size} = {2 * block_size}): no drafter window could hold a rebase",
            )

        # sizes
        embedding_length = None
        ekey = f"{arch}.embedding_length"
        if (fld := f.fields.get(ekey)) is not None:
            embedding_length = f.integer(ekey, fld, minimum=1)
        feature_dim = feature_src = None
        key, fld = f.first(_spellings(arch, "feature_dim"))
        if fld is not None:
            feature_dim, feature_src = f.integer(key, fld, minimum=1), key
        else:
            key, fld = f.first(_spellings(arch, "target_embedding_length"))
            target_embd = f.integer(key, fld, minimum=1) if fld is not None else None
            if target_embd is not None and target_layers:
                feature_dim, feature_src = len(target_layers) * target_embd, f"{len(target_layers)} * {key}"
            else:
                hidden = tuple(h for h in (target_embd, embedding_length) if h)
                found = _feature_dim_from_tensors(list(reader.tensors), len(target_layers), hidden)
                if found is not None:
                    feature_dim, feature_src = found
        if feature_src is not None:
            sources["feature_dim"] = feature_src

        return cls(
            path=path,
            architecture=arch,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layers=target_layers,
            n_ctx_train=n_train,
            n_ctx_train_source=n_train_src,
            context_length=context_length,
            trained_context_length=trained,
            feature_dim=feature_dim,
            feature_dim_source=feature_src,
            embedding_length=embedding_length,
            name=name,
            n_tensors=len(reader.tensors),
            file_size=int(reader.data.shape[0]),
            warnings=tuple(warnings),
            sources=sources,
        )

    # -- output ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return {
            "path": self.path,
            "architecture": self.architecture,
            "name": self.name,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layers": list(self.target_layers),
            "n_ctx_train": self.n_ctx_train,
            "n_ctx_train_source": self.n_ctx_train_source,
            "context_length": self.context_length,
            "trained_context_length": self.trained_context_length,
            "feature_dim": self.feature_dim,
            "feature_dim_source": self.feature_dim_source,
            "embedding_length": self.embedding_length,
            "n_tensors": self.n_tensors,
            "file_size": self.file_size,
            "warnings": list(self.warnings),
            "sources": dict(self.sources),
        }

    def table_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows for a human-readable table."""

        def src(fld: str) -> str:
            s = self.sources.get(fld)
            return f"  ({s})" if s else ""

        def opt(v: Any) -> str:
            return "-" if v is None else str(v)

        layers = ", ".join(str(x) for x in self.target_layers) if self.target_layers else "-"
        rows = [
            ("file", self.path),
            ("architecture", self.architecture + (f"  ({self.name})" if self.name else "")),
            ("block_size", f"{self.block_size}{src('block_size')}"),
            ("mask_token_id", f"{opt(self.mask_token_id)}{src('mask_token_id')}"),
            ("target_layers", f"[{layers}]{src('target_layers')}" if self.target_layers else "-"),
            ("n_ctx_train", f"{opt(self.n_ctx_train)}{src('n_ctx_train')}"),
            ("context_length", opt(self.context_length)),
            ("trained_context_length", opt(self.trained_context_length)),
            ("feature_dim", f"{opt(self.feature_dim)}{src('feature_dim')}"),
            ("embedding_length", opt(self.embedding_length)),
            ("tensors", str(self.n_tensors)),
            ("file_size", f"{self.file_size:,} bytes"),
        ]
        return rows
