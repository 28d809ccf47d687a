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
                    (see :func:`dspark_core.gguf.reader._feature_dim_from_tensors`), else unknown

Target layer ids are reported as stored (llama.cpp's DFlash converter stores
them shifted by +1; this module does not reinterpret them).

A ``context_length`` that looks inherited from the target model (the 262144
placeholder seen in published drafters, or equal to the target's context when
one is given) draws one ``logging`` warning on the ``"dspark_core"`` logger:
that field silently decides the drafter's window.

Every problem with the file is a :class:`DrafterMetadataError`
(a :class:`~dspark_core.ConfigError`, hence a ``ValueError``) whose message is
``"<path>: <problem>"``; parser internals never leak out as a traceback. Only
regular files are opened, within the limits :mod:`dspark_core.gguf.reader`
lists; a ``general.architecture`` that is not printable text is refused (it
spells the keys looked up), and ``general.name`` is escaped to be printable.
"""

from __future__ import annotations

import logging
import operator
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .override import override_int, strict_int
from .printable import printable
from .reader import (
    DrafterMetadataError, _feature_dim_from_tensors, _Fields, _open_reader, _spellings, check_trained_range,
)

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



#: DrafterInfo's integer fields (``None`` allowed but for the required ones).
_INT_FIELDS = ("block_size", "mask_token_id", "n_ctx_train", "context_length", "trained_context_length",
               "feature_dim", "embedding_length", "n_tensors", "file_size")
_REQUIRED_INT_FIELDS = ("block_size", "n_tensors", "file_size")


def _integer(name: str, value: Any) -> int:
    """A DrafterInfo integer field: an int (numpy integers too), never a bool, float or string,
    which ``int()`` would quietly turn into one (``int(1.9) == 1``)."""
    strict_int(name, value)
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


@dataclass(frozen=True)
class DrafterInfo:
    """What a drafter GGUF says about itself (see the module docstring for the keys).

    Attributes:
        path: the file read.
        architecture: ``general.architecture`` (e.g. ``"dspark"``, ``"dflash"``; a
            ``config.json``'s first architecture).
        kind: ``"block"`` (DSpark / DFlash: a block of B queries per round) or
            ``"chain"`` (EAGLE, EAGLE-3, MTP: one token per step, read from a
            ``config.json`` by :meth:`from_hf_config`).
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
    kind: str = "block"
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
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None or name in _REQUIRED_INT_FIELDS:
                object.__setattr__(self, name, _integer(name, value))
        object.__setattr__(self, "target_layers",
                           tuple(_integer(f"target_layers[{k}]", x) for k, x in enumerate(self.target_layers)))
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
            TypeError: ``n_ctx_train`` / ``target_n_ctx`` is a bool.
            ConfigError: ``n_ctx_train`` / ``target_n_ctx`` is not a positive integer.
        """
        spath = os.fspath(path)
        override = override_int("n_ctx_train", n_ctx_train)
        target = override_int("target_n_ctx", target_n_ctx)

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
    def from_hf_config(
        cls,
        path: str | os.PathLike[str],
        *,
        block_size: int | None = None,
        n_ctx_train: int | None = None,
        target_n_ctx: int | None = None,
    ) -> "DrafterInfo":
        """Read a drafter's Hugging Face ``config.json`` (or the directory holding it):
        EAGLE-3, EAGLE and MTP chain drafters, DFlash / DSpark block drafters
        (:mod:`dspark_core.gguf.hf_config` lists the keys).

        Args:
            path: the ``config.json`` file or its directory.
            block_size: the tokens a round drafts; required for chain drafters (the
                server's ``num_speculative_tokens``), an override for block drafters.
            n_ctx_train: the drafter's trained range, overriding ``max_position_embeddings``.
            target_n_ctx: the target's context, if known: a ``max_position_embeddings``
                equal to it looks inherited and draws a warning.

        Raises:
            DrafterMetadataError: the file is missing or not a JSON object; its kind
                is not one this package knows; a key has the wrong type; the trained
                range or the block size is known neither from the file nor from the
                caller; or ``n_ctx_train <= 2 * block_size``; or the file is not a regular
                file, is larger than ``MAX_CONFIG_BYTES`` or nested deeper than
                ``MAX_CONFIG_DEPTH`` (:mod:`dspark_core.gguf.bounded_json`). The message
                names the file.
            TypeError: ``block_size`` / ``n_ctx_train`` / ``target_n_ctx`` is a bool.
            ConfigError: ``block_size`` / ``n_ctx_train`` / ``target_n_ctx`` is not a positive integer.
        """
        from .hf_config import read_hf_config

        info = cls(**read_hf_config(path, block_size=block_size, n_ctx_train=n_ctx_train, target_n_ctx=target_n_ctx))
        for w in info.warnings:
            logger.warning("%s: %s", info.path, w)
        return info

    @classmethod
    def _from_reader(cls, path: str, reader: Any, override: int | None, target: int | None) -> "DrafterInfo":
        f = _Fields(path, reader)
        sources: dict[str, str] = {}

        arch = f.string("general.architecture")
        if arch is None:
            raise DrafterMetadataError(path, "missing general.architecture")
        if not arch.isprintable():  # it spells every key looked up: no escaped stand-in would do
            raise DrafterMetadataError(path, f"general.architecture {arch!r} is not a printable name")
        name = f.string("general.name")
        name = None if name is None else printable(name)

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
        if n_train is not None:
            check_trained_range(path, n_train, str(n_train_src), block_size)

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
            "kind": self.kind,
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
        """``(label, value)`` rows for a human-readable table, every value printable
        (a path may hold characters a terminal cannot show, e.g. undecodable bytes)."""

        def src(fld: str) -> str:
            s = self.sources.get(fld)
            return f"  ({s})" if s else ""

        def opt(v: Any) -> str:
            return "-" if v is None else str(v)

        layers = ", ".join(str(x) for x in self.target_layers) if self.target_layers else "-"
        rows = [
            ("file", self.path),
            ("architecture", self.architecture + (f"  ({self.name})" if self.name else "")),
            ("kind", self.kind),
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
        return [(label, printable(value)) for label, value in rows]
