"""Argument conversion for the Stager binding: Python objects to what the C++ core takes.

Only conversions live here: an integer from any index-like object, positions
as an int64 array, rows as a C-contiguous float array of the right width, a
flat byte view of a buffer. Their errors are about the *kind* or *shape* of
an argument (TypeError, or ValueError for a wrong number of dimensions).
What a value must be (ranges, positions that continue the sequence, a byte
count, finite rows) is the core's rule, checked there once; the binding
raises a conversion error only after the core's sequence checks
(docs/design.md 2.1). The reference twin spells out its own copies.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import numpy as np

from ..rows import _bf16
from . import core_tables

__all__ = [
    "MAX_POSITION", "ROW_DTYPES", "as_index", "as_int64", "as_count", "as_choice", "as_positions", "as_rows",
    "as_encoded", "row_dtype_code", "readable_bytes", "writable_bytes", "check_rows_given", "require_held_rows",
    "process_args", "encoded_args", "as_seq_ids", "batch_ints", "batch_rows_args", "tree_args", "as_parents", "as_nodes",
    "batch_tree_args", "batch_paths_args", "fail_stage_codes", "outcome_codes",
    "as_flag", "view_args",
]

#: Positions and counts stay below this (the core's limit, ``dspark::MAX_POSITION``).
MAX_POSITION = core_tables.MAX_POSITION

#: Input row dtypes by core code (the core's ``ElemType`` table).
ROW_DTYPES = {name: code for code, name in enumerate(core_tables.ELEM_TYPES)}

#: The int64 range of the core's arguments.
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


def as_index(name: str, value: Any) -> int:
    """``operator.index(value)`` with a TypeError that names the argument."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def as_int64(name: str, value: Any) -> int:
    """An integer argument for the core, clamped into int64: every limit of the
    core lies far inside that range, so a clamped value is rejected just as the
    original would be (the message quotes the clamped value)."""
    v = value if type(value) is int else as_index(name, value)
    return _INT64_MIN if v < _INT64_MIN else _INT64_MAX if v > _INT64_MAX else v


def as_count(name: str, value: Any) -> int:
    """A position-like count (``n_past``, ``n_keep``, ...) for the core, which checks its range."""
    return as_int64(name, value)


def as_choice(name: str, value: Any, choices: Sequence[str]) -> int:
    """The index of ``value`` in a table of names (a fail stage, ...), or a ValueError naming them."""
    if isinstance(value, str) and value in choices:
        return list(choices).index(value)
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def as_positions(positions: Any) -> np.ndarray:
    """Positions as a 1-D contiguous int64 array (values beyond int64 clamped; the core checks the range).

    Raises:
        TypeError: not integers.
        ValueError: not 1-D.
    """
    return _int_array("", "positions", positions)


def row_dtype_code(dtype: np.dtype) -> int:
    """Core element-type code of a row dtype, or TypeError."""
    name = dtype.name
    code = ROW_DTYPES.get(name)
    if code is None or (name == "bfloat16" and not _bf16.is_bf16(dtype)):
        raise TypeError(f"rows must be float32, float16 or bfloat16 (ml_dtypes), got dtype {dtype}")
    return code


def as_rows(rows: Any, feature_dim: int) -> np.ndarray:
    """Rows as a C-contiguous ``(n, feature_dim)`` float32/float16/bfloat16 array.

    Raises:
        TypeError: not an array of a supported float dtype.
        ValueError: wrong number of dimensions or row width.
    """
    if not isinstance(rows, np.ndarray):
        raise TypeError(f"rows must be a numpy array, got {type(rows).__name__}")
    row_dtype_code(rows.dtype)
    if rows.ndim != 2 or rows.shape[1] != feature_dim:
        raise ValueError(f"rows must have shape (n, {feature_dim}), got {rows.shape}")
    if not rows.dtype.isnative:  # e.g. '>f4': the core reads native-endian values
        rows = rows.astype(rows.dtype.newbyteorder("="))
    return np.ascontiguousarray(rows)


def as_encoded(data: Any, n: int, row_bytes: int) -> np.ndarray:
    """Rows already in storage format as a flat contiguous uint8 array.

    Accepts uint8 ``(n, row_bytes)`` or flat arrays and any bytes-like object
    (``bytes``, ``bytearray``, ``memoryview``), read as raw bytes whatever its
    item format. The byte count is the core's to check (``n * row_bytes``).

    Raises:
        TypeError: not uint8 / not bytes-like.
        ValueError: a 2-D array of another shape, or more dimensions.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = np.frombuffer(data, np.uint8)  # the raw bytes, whatever the item format
        except (ValueError, BufferError) as exc:
            raise TypeError(f"encoded rows must be a contiguous buffer ({exc})") from None
    arr = np.asarray(data)
    if arr.dtype != np.uint8:
        raise TypeError(f"encoded rows must be uint8, got dtype {arr.dtype}")
    if arr.ndim == 2 and arr.shape != (n, row_bytes):
        raise ValueError(f"encoded rows must have shape ({n}, {row_bytes}), got {arr.shape}")
    if arr.ndim not in (1, 2):
        raise ValueError(f"encoded rows must be ({n}, {row_bytes}) or flat, got shape {arr.shape}")
    return np.ascontiguousarray(arr).reshape(-1)


def readable_bytes(data: Any) -> memoryview:
    """``data`` (any buffer: bytes, bytearray, memoryview, ndarray, mmap) as a flat byte view.

    No copy for a C-contiguous buffer; a strided one is copied once.
    """
    try:
        view = memoryview(data)
    except (TypeError, ValueError):
        raise TypeError(f"snapshot data must be bytes-like, got {type(data).__name__}") from None
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


def writable_bytes(buffer: Any) -> memoryview:
    """``buffer`` as a flat writable byte view (no copy); ``TypeError`` unless it is a
    writable C-contiguous buffer (bytearray, ndarray, mmap, shared memory)."""
    try:
        view = memoryview(buffer)
    except (TypeError, ValueError):
        raise TypeError(f"buffer must support the buffer protocol, got {type(buffer).__name__}") from None
    if view.readonly:
        raise TypeError(f"buffer must be writable, got a read-only {type(buffer).__name__}")
    if not view.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got a strided {type(buffer).__name__}")
    return view.cast("B")


#: How a call that takes rows is made without them (external-row mode).
_ROWLESS_USAGE = {"process": "process(seq, positions)", "process_tree": "process_tree(seq, n_past, parents)",
                  "process_tree_many": "process_tree_many(seqs, cu_seqlens, n_pasts, parents)"}


def check_rows_given(external: bool, rows: Any, call: str = "process") -> None:
    """``process`` (``process_many``): rows must be given in held mode and must not be in external-row mode.

    Raises:
        TypeError: naming the mode.
    """
    if external and rows is not None:
        usage = _ROWLESS_USAGE.get(call, f"{call}(seqs, cu_seqlens, positions)")
        raise TypeError(
            f"{call}: this Stager runs in external-row mode (rows='external') and holds no rows: "
            f"call {usage} without rows and write each row at the slot it returns"
        )
    if not external and rows is None:
        raise TypeError(
            f"{call}: rows are required: this Stager holds its rows (rows='held'); pass the (n, feature_dim) rows "
            "or configure StagerConfig(rows='external')"
        )


def as_flag(name: str, value: Any) -> bool:
    """A yes / no argument (``copy``): ``True`` or ``False`` (a numpy bool too), else a TypeError naming it."""
    if value is True or value is False or isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def view_args(external: bool, copy: Any, call: str = "draft") -> bool:
    """``draft``'s (``draft_many``'s) ``copy``: ``False`` asks for views of the held rows, which
    external-row mode has none of.

    Raises:
        TypeError: ``copy`` is not a bool, or is ``False`` in external-row mode.
    """
    if as_flag("copy", copy):
        return True
    if external:
        raise TypeError(
            f"{call}(copy=False): this Stager runs in external-row mode (rows='external') and holds no rows: "
            "its plans carry no rows to view (read them from your table at plan.slots)"
        )
    return False


def require_held_rows(external: bool, call: str) -> None:
    """A call that needs the rows themselves (``process_encoded``): a TypeError
    naming the mode in external-row mode (the Python API's choice of call)."""
    if external:
        raise TypeError(f"{call}: this Stager runs in external-row mode (rows='external') and holds no rows")


# -- one call's arguments, in the order of its signature -----------------------


def _ints_and_rows(call: str, name: str, external: bool, feature_dim: int, values: Any,
                   rows: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """One integer per row (``name``) and, in held mode, the rows, as the core reads them."""
    check_rows_given(external, rows, call)
    ints = _int_array("", name, values)  # as_positions / as_parents
    if external:
        return ints, None
    arr = as_rows(rows, feature_dim)
    if arr.shape[0] != ints.shape[0]:
        raise ValueError(f"{ints.shape[0]} {name} for {arr.shape[0]} rows")
    return ints, arr


def process_args(external: bool, feature_dim: int, positions: Any, rows: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``process``: the positions, and the rows (held mode), as the core reads them."""
    return _ints_and_rows("process", "positions", external, feature_dim, positions, rows)


def tree_args(external: bool, feature_dim: int, parents: Any, rows: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """``process_tree``: the parents, and the nodes' rows (held mode), as the core reads them."""
    return _ints_and_rows("process_tree", "parents", external, feature_dim, parents, rows)


def as_parents(parents: Any) -> np.ndarray:
    """``process_tree``'s parents as a 1-D contiguous int64 array (TypeError: not integers; ValueError: not 1-D)."""
    return _int_array("", "parents", parents)


def as_nodes(nodes: Any) -> np.ndarray:
    """``accept_path``'s nodes as a 1-D contiguous int64 array (TypeError: not integers; ValueError: not 1-D)."""
    return _int_array("", "nodes", nodes)


def encoded_args(external: bool, row_bytes: int, positions: Any, data: Any) -> tuple[np.ndarray, np.ndarray]:
    """``process_encoded``: the positions and the flat bytes."""
    require_held_rows(external, "process_encoded")
    pos = as_positions(positions)
    return pos, as_encoded(data, pos.shape[0], row_bytes)


# -- a batch call's arguments (docs/design.md 2.9) --------------------------------
#
# A batch's arrays are converted whole; their errors name the call. What a
# value must be (unique ids, cu_seqlens that rise from 0 to the rows, each
# sequence's positions and counts) is the core's to check.


def _clamped_objects(arr: np.ndarray) -> np.ndarray:
    """An object array of Python integers (numpy's dtype for ints beyond int64) as int64, each
    clamped as a per-sequence call's integer argument is; any other array as it is."""
    if arr.dtype != object or arr.ndim != 1:
        return arr
    try:
        return np.array([min(max(operator.index(v), _INT64_MIN), _INT64_MAX) for v in arr], np.int64)
    except TypeError:
        return arr  # not integers: the caller's TypeError names the dtype


def _int_array(call: str, name: str, value: Any) -> np.ndarray:
    """``value`` as a 1-D contiguous int64 array, values beyond int64 clamped (TypeError: not
    integers; ValueError: not 1-D). Errors start with ``call`` ("" for a per-sequence call)."""
    arr = _clamped_objects(np.asarray(value))
    if arr.size == 0:
        arr = arr.astype(np.int64)
    who = f"{call}: {name}" if call else name
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{who} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{who} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
        arr = np.minimum(arr, np.uint64(_INT64_MAX))
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_tokens(call: str, tokens: Any, n: int) -> np.ndarray | None:
    """A chain drafter's token ids (``process(..., tokens=)``): None, or a 1-D contiguous
    int32 array of ``n`` ids. Whether the Stager keeps tokens, and ids below 0, are the
    core's to check.

    Raises:
        TypeError: not integers.
        ValueError: not 1-D, not one id per row, or an id outside int32.
    """
    if tokens is None:
        return None
    who = f"{call}: tokens" if call else "tokens"
    arr = _clamped_objects(np.asarray(tokens))
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{who} must be integers (token ids), got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{who} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{who}: {arr.shape[0]} token ids for {n} rows (one per row)")
    if arr.dtype != np.int32 and arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        k = int(np.flatnonzero((arr < _INT32_MIN) | (arr > _INT32_MAX))[0])
        raise ValueError(f"{who}[{k}] is {int(arr[k])}: token ids must fit int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def as_token_table(call: str, tokens: Any, writable: bool) -> np.ndarray | None:
    """The device step's slot token table (``to_device`` / ``to_host`` of a chain drafter's
    Stager): None, or the caller's own 1-D C-contiguous int32 array, used in place
    (``to_device`` writes into it, so it is never a converted copy). Its length, and
    whether the Stager takes one, are the core's to check.

    Raises:
        TypeError: not a numpy array, or not int32.
        ValueError: not 1-D and C-contiguous, or read-only where ``writable``.
    """
    if tokens is None:
        return None
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"{call}: tokens must be the slot token table, a numpy int32 array "
                        f"(Stager.new_token_table()), got {type(tokens).__name__}")
    if tokens.dtype != np.int32:
        raise TypeError(f"{call}: the slot token table must be int32, got dtype {tokens.dtype}")
    if tokens.ndim != 1 or not tokens.flags.c_contiguous or not tokens.flags.aligned:
        raise ValueError(f"{call}: the slot token table must be a 1-D C-contiguous, aligned array, got shape "
                         f"{tokens.shape}" + ("" if tokens.flags.aligned else " (misaligned)"))
    if writable and not tokens.flags.writeable:
        raise ValueError(f"{call}: the slot token table must be writable ({call} writes the ids into it)")
    return tokens


def as_seq_ids(call: str, seqs: Any) -> np.ndarray:
    """A batch's sequence ids: a 1-D int64 array."""
    return _int_array(call, "seqs", seqs)


def batch_ints(call: str, name: str, values: Any, n: int) -> np.ndarray:
    """One int64 value per sequence of a batch of ``n`` (``n_pasts``, ``n_accepted``)."""
    arr = _int_array(call, name, values)
    if arr.shape[0] != n:
        raise ValueError(f"{call}: {n} sequences for {arr.shape[0]} {name} values")
    return arr


def batch_rows_args(call: str, external: bool, feature_dim: int, n: int, cu_seqlens: Any, positions: Any,
                    rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``process_many`` / ``reserve_many``: cu_seqlens (n + 1), the flat positions and rows (held mode)."""
    check_rows_given(external, rows, call)
    cu = _int_array(call, "cu_seqlens", cu_seqlens)
    if cu.shape[0] != n + 1:
        raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {cu.shape[0]}")
    pos = _int_array(call, "positions", positions)
    if external:
        return cu, pos, None
    arr = as_rows(rows, feature_dim)
    if arr.shape[0] != pos.shape[0]:
        raise ValueError(f"{call}: {pos.shape[0]} positions for {arr.shape[0]} rows")
    return cu, pos, arr


def batch_tree_args(call: str, external: bool, feature_dim: int, n: int, cu_seqlens: Any, n_pasts: Any,
                    parents: Any, rows: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``process_tree_many``: cu_seqlens (n + 1), one n_past per sequence, the flat parents and rows (held mode)."""
    check_rows_given(external, rows, call)
    cu = _int_array(call, "cu_seqlens", cu_seqlens)
    if cu.shape[0] != n + 1:
        raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {cu.shape[0]}")
    roots = batch_ints(call, "n_pasts", n_pasts, n)
    par = _int_array(call, "parents", parents)
    if external:
        return cu, roots, par, None
    arr = as_rows(rows, feature_dim)
    if arr.shape[0] != par.shape[0]:
        raise ValueError(f"{call}: {par.shape[0]} parents for {arr.shape[0]} rows")
    return cu, roots, par, arr


def batch_paths_args(call: str, n: int, cu_seqlens: Any, nodes: Any) -> tuple[np.ndarray, np.ndarray]:
    """``accept_path_many``: cu_seqlens (n + 1) and the flat nodes of every path."""
    cu = _int_array(call, "cu_seqlens", cu_seqlens)
    if cu.shape[0] != n + 1:
        raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {cu.shape[0]}")
    return cu, _int_array(call, "nodes", nodes)


def fail_stage_codes(call: str, stages: Any, seqs: np.ndarray, choices: Sequence[str],
                     context: Callable[[str, int, int], str]) -> np.ndarray:
    """``fail_many``'s stages as uint8 codes: one name for every sequence, or one name or
    code per sequence. A bad name is ``fail``'s error, after ``context(call, i, seq)``."""
    n = seqs.shape[0]
    if isinstance(stages, str):
        stages = [stages] * n
    arr = np.asarray(stages)
    if arr.ndim != 1:
        raise ValueError(f"{call}: stages must be one name or 1-D, got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{call}: {n} sequences for {arr.shape[0]} stages")
    if arr.dtype.kind in "iu":
        values: list[Any] = arr.tolist()
        names = [choices[v] if 0 <= v < len(choices) else v for v in values]
    else:
        names = list(stages)
    codes = np.empty(n, np.uint8)
    for i, name in enumerate(names):
        try:
            codes[i] = as_choice("stage", name, choices)
        except ValueError as exc:
            raise ValueError(context(call, i, int(seqs[i])) + str(exc)) from None
    return codes


def outcome_codes(call: str, outcomes: Any, seqs: np.ndarray, choices: Sequence[str],
                  context: Callable[[str, int, int], str]) -> np.ndarray | None:
    """``to_host``'s outcomes as int32 codes: None (every sequence's round committed), or one per
    sequence: None or -1 (the drafter ran), a fail stage's name or code. A bad name is the
    stage's error, after ``context(call, i, seq)``."""
    n = seqs.shape[0]
    if outcomes is None:
        return None
    items = list(outcomes)
    if len(items) != n:
        raise ValueError(f"{call}: {n} sequences for {len(items)} outcomes")
    codes = np.empty(n, np.int32)
    for i, o in enumerate(items):
        if o is None:
            codes[i] = -1
        elif isinstance(o, str):
            try:
                codes[i] = as_choice("outcome", o, choices)
            except ValueError as exc:
                raise ValueError(context(call, i, int(seqs[i])) + str(exc)) from None
        else:  # clamped into int32, as as_int64 clamps: the core refuses it just as the original
            v = as_index("outcome", o)
            codes[i] = _INT32_MIN if v < _INT32_MIN else _INT32_MAX if v > _INT32_MAX else v
    return codes
