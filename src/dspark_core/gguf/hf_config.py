"""Drafter metadata from a Hugging Face ``config.json`` (EAGLE, EAGLE-3, MTP, DFlash, DSpark).

Drafters that are not GGUF files ship a ``config.json`` beside their weights.
What the staging needs of one is what :class:`DrafterInfo` holds for a GGUF:
the drafter's kind, its trained range (which bounds the window), the target
layers it reads (the tap layers), the feature width, and the block size.

Keys read (the first present wins)::

    kind            "block": a ``dflash_config`` / ``dspark_config`` object, or a
                    DFlash / DSpark architecture; "chain": an EAGLE-3 architecture
                    or ``eagle_aux_hidden_state_layer_ids`` (EAGLE-3), an EAGLE
                    architecture or ``model_type`` "eagle" (EAGLE), or
                    ``num_nextn_predict_layers`` > 0 (MTP)
    n_ctx_train     the caller's override, else ``max_position_embeddings``
    block_size      block kinds: ``<kind>_config.block_size``, else ``block_size``;
                    chain kinds draft one token per step, as many as the server
                    asks (vLLM's ``num_speculative_tokens``): the caller's
                    ``block_size=``, which wins for block kinds too
    target_layers   ``<kind>_config.target_layer_ids``, ``dspark_target_layer_ids``,
                    ``target_layer_ids``, ``eagle_aux_hidden_state_layer_ids`` (a chain
                    drafter's first); as stored (DFlash ids count from 0 and vLLM
                    adds 1; this module does not reinterpret them); an empty list
                    names none
    feature_dim     taps * ``target_hidden_size`` (else ``hidden_size``); taps is
                    the number of target layers when the file names them, else
                    the kind's own (EAGLE-3: 3; EAGLE, MTP: 1; a block drafter
                    that names none: unknown)
    mask_token_id   ``<kind>_config.mask_token_id``, else ``mask_token_id``

Every problem is a :class:`DrafterMetadataError` (``"<path>: <problem>"``): a
missing or unreadable file, one that is not a regular file (a FIFO, a device),
larger than :data:`~dspark_core.gguf.bounded_json.MAX_CONFIG_BYTES` or nested
deeper than :data:`~dspark_core.gguf.bounded_json.MAX_CONFIG_DEPTH`, JSON that is
not an object, a key of the wrong type (an integer longer than
:data:`~dspark_core.gguf.bounded_json.MAX_JSON_INT_DIGITS` digits included), a
kind the file does not show, and a trained range or block size that neither the
file nor the caller gives. The architecture and name read are escaped to be
printable (:func:`~dspark_core.gguf.printable.printable`).
"""

from __future__ import annotations

import os
from typing import Any

from .bounded_json import MAX_CONFIG_BYTES, load_config_json
from .override import override_int
from .printable import printable
from .reader import DrafterMetadataError, check_trained_range
from .regular_file import read_regular

__all__ = ["read_hf_config", "CHAIN_TAPS", "CONFIG_NAME"]

#: The file a model directory holds its configuration in.
CONFIG_NAME = "config.json"

#: Target layers a chain drafter reads when its file does not list them
#: (EAGLE-3 concatenates three: low, middle, high; EAGLE and MTP read the last).
CHAIN_TAPS = {"eagle3": 3, "eagle": 1, "mtp": 1}

_BLOCK_FAMILIES = ("dflash", "dspark")
_NAMES = {"dflash": "DFlash", "dspark": "DSpark", "eagle3": "EAGLE-3", "eagle": "EAGLE", "mtp": "MTP"}


def _config_path(path: str) -> str:
    return os.path.join(path, CONFIG_NAME) if os.path.isdir(path) else path


def _load(path: str) -> tuple[dict[str, Any], int]:
    """The config's JSON object and the file's size in bytes."""
    raw = read_regular(path, CONFIG_NAME, MAX_CONFIG_BYTES, missing="cannot read the file (no such file)")
    data = load_config_json(path, raw)
    if not isinstance(data, dict):
        raise DrafterMetadataError(path, f"a config.json holds a JSON object, got {type(data).__name__}")
    return data, len(raw)


def _int(path: str, key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DrafterMetadataError(path, f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _int_list(path: str, key: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DrafterMetadataError(path, f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


def _architecture(data: dict[str, Any]) -> str:
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    model_type = data.get("model_type")
    return model_type if isinstance(model_type, str) else ""


def _kind(path: str, data: dict[str, Any], arch: str) -> tuple[str, str]:
    """``(kind, family)``: "block" or "chain", and the family (dflash, dspark, eagle3, eagle, mtp).

    A family's own config object decides first (a DFlash config may also carry
    ``eagle_aux_hidden_state_layer_ids`` for engines that read only that key), then
    the names: the first architecture and ``model_type``."""
    for family in _BLOCK_FAMILIES:
        if isinstance(data.get(f"{family}_config"), dict):
            return "block", family
    model_type = data.get("model_type")
    names = " ".join(n.lower() for n in (arch, model_type) if isinstance(n, str))
    for family in _BLOCK_FAMILIES:
        if family in names:
            return "block", family
    if "eagle3" in names or data.get("eagle_aux_hidden_state_layer_ids") is not None:
        return "chain", "eagle3"
    if "eagle" in names:
        return "chain", "eagle"
    nextn = data.get("num_nextn_predict_layers")
    if nextn is not None and _int(path, "num_nextn_predict_layers", nextn, 0) > 0:
        return "chain", "mtp"
    raise DrafterMetadataError(
        path, f"architecture {arch or '(none)'!r}: not a drafter this package knows (DFlash / DSpark block "
              "drafters: a dflash_config or dspark_config; EAGLE-3, EAGLE and MTP chain drafters: an Eagle3 or "
              "Eagle architecture, eagle_aux_hidden_state_layer_ids, or num_nextn_predict_layers)")


def read_hf_config(path: str | os.PathLike[str], *, block_size: int | None = None,
                   n_ctx_train: int | None = None, target_n_ctx: int | None = None) -> dict[str, Any]:
    """The metadata of a drafter's ``config.json`` (or of the directory holding it), as
    :class:`~dspark_core.gguf.drafter_info.DrafterInfo`'s fields (see the module for the keys).
    A ``max_position_embeddings`` equal to ``target_n_ctx`` looks inherited from the target
    (an MTP head's config is its target's) and draws a warning, as a GGUF's ``context_length``.

    Raises:
        DrafterMetadataError: see the module.
        TypeError: ``block_size`` / ``n_ctx_train`` / ``target_n_ctx`` is a bool.
        ConfigError: ``block_size`` / ``n_ctx_train`` / ``target_n_ctx`` is not a positive integer.
    """
    override_b = override_int("block_size", block_size)
    override_n = override_int("n_ctx_train", n_ctx_train)
    target = override_int("target_n_ctx", target_n_ctx)
    spath = _config_path(os.fspath(path))
    data, file_size = _load(spath)
    arch = _architecture(data)
    kind, family = _kind(spath, data, arch)
    sub = data.get(f"{family}_config") if kind == "block" else None
    sub = sub if isinstance(sub, dict) else {}
    sources: dict[str, str] = {}
    warnings: list[str] = []

    def first(*keys: str) -> tuple[str | None, Any]:
        for key in keys:
            owner, _, name = key.rpartition(".")
            value = (sub if owner else data).get(name)
            if value is not None:
                return key, value
        return None, None

    prefix = f"{family}_config."
    # block size: the caller's, else (block drafters) the file's
    key, value = first(prefix + "block_size", "block_size")
    if override_b is not None:
        b, sources["block_size"] = override_b, "override"
    elif kind == "block" and key is not None:
        b, sources["block_size"] = _int(spath, key, value, 1), key
    elif kind == "block":
        raise DrafterMetadataError(spath, f"missing block_size (looked for {prefix}block_size, block_size): "
                                          "pass block_size=")
    else:
        raise DrafterMetadataError(
            spath, f"{_NAMES[family]} is a chain drafter: it drafts one token per step, as many as the server asks; "
                   "pass block_size= (the server's num_speculative_tokens; inspect --block-size)")
    # trained range
    if override_n is not None:
        n_train, sources["n_ctx_train"] = override_n, "override"
    elif data.get("max_position_embeddings") is not None:
        n_train = _int(spath, "max_position_embeddings", data["max_position_embeddings"], 1)
        sources["n_ctx_train"] = "max_position_embeddings"
        if target is not None and n_train == target:
            warnings.append(f"drafter max_position_embeddings = {n_train} equals the target's context ({target}): it "
                            "looks inherited from the target model, not the drafter's trained range, and it decides "
                            "the drafter window; pass n_ctx_train= (dspark-core inspect --n-ctx-train)")
    else:
        raise DrafterMetadataError(spath, "the drafter's trained range is unknown (no max_position_embeddings): "
                                          "pass n_ctx_train= (inspect --n-ctx-train)")
    check_trained_range(spath, n_train, sources["n_ctx_train"], b)
    # tap layers and the feature width
    # A block drafter's own key first (a DFlash config may also carry the EAGLE-3 key,
    # shifted for engines that read only that one); a chain drafter's is the EAGLE-3 key.
    own = (prefix + "target_layer_ids", "dspark_target_layer_ids", "target_layer_ids")
    aux = ("eagle_aux_hidden_state_layer_ids",)
    key, value = first(*(own + aux if kind == "block" else aux + own))
    layers: tuple[int, ...] = ()
    if key is not None:
        layers = _int_list(spath, key, value)
        if layers:  # an empty list names no layer: the kind's own taps below
            sources["target_layers"] = key
    hkey, hidden = first("target_hidden_size", "hidden_size")
    taps = len(layers) if layers else CHAIN_TAPS.get(family)
    feature_dim = None
    if hkey is not None and taps:
        width = _int(spath, hkey, hidden, 1)
        feature_dim = taps * width
        sources["feature_dim"] = f"{len(layers)} target layers * {hkey}" if layers else f"{taps} taps ({family}) * {hkey}"
    mkey, mask = first(prefix + "mask_token_id", "mask_token_id")
    mask_token_id = None
    if mkey is not None:
        mask_token_id, sources["mask_token_id"] = _int(spath, mkey, mask, 0), mkey
    name = data.get("_name_or_path")
    max_pos = data.get("max_position_embeddings")
    hidden_size = data.get("hidden_size")
    return {
        "path": spath,
        "architecture": printable(arch) or family,
        "kind": kind,
        "block_size": b,
        "mask_token_id": mask_token_id,
        "target_layers": layers,
        "n_ctx_train": n_train,
        "n_ctx_train_source": sources["n_ctx_train"],
        "context_length": None if max_pos is None else _int(spath, "max_position_embeddings", max_pos, 1),
        "feature_dim": feature_dim,
        "feature_dim_source": sources.get("feature_dim"),
        "embedding_length": None if hidden_size is None else _int(spath, "hidden_size", hidden_size, 1),
        "name": printable(name) if isinstance(name, str) else None,
        "file_size": file_size,
        "warnings": tuple(warnings),
        "sources": sources,
    }
