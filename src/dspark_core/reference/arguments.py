"""The reference twin's own argument rules: every check and message of the contract, spelled out.

The oracle must not borrow the rules it is there to check, so nothing here
comes from the core or the binding: the limits, the name tables and the
wording of each message are written again, from docs/design.md section 2.
The differential tests compare every exception's type and message with the
core's, so a rule that drifts on either side shows up as a desync.

The order of a call's checks (docs/design.md 2.1): the sequence id, its
round state, the kind and shape of each argument in signature order, then
the values (ranges, positions, contents) and strict mode's protocol check.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from ..errors import StateError

#: Positions and counts stay below this: ``pos + block`` never overflows int64.
MAX_POSITION = 1 << 62
#: Head rows below the horizon are dropped this many at a time (the core's lazy trim).
TRIM_CHUNK = 512
#: Where a drafter round can fail (``fail(seq, stage)``).
FAIL_STAGES = ("decode", "crop")
#: Why a draft staged nothing, in the order the reasons are checked (a batch plan's
#: ``skip_code`` is 1 + the index here, 0 for a round that opened).
SKIP_REASONS = ("disabled", "empty", "no_context", "missing_rows", "drafting_off")
#: The snapshot header's codes of the non-finite policies and staged types (format v2).
NONFINITE_POLICIES = ("error", "zero", "clamp_f16", "clamp")
STAGE_DTYPES = ("float32", "float16", "bfloat16")
#: The int64 range of the core's arguments: a larger integer is rejected by
#: the value's own rule, quoting the nearest int64.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_ROW_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


# -- kinds and shapes -----------------------------------------------------------


def integer(name: str, value: Any) -> int:
    """An integer argument, clamped into int64 (TypeError naming it otherwise)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    return min(max(v, INT64_MIN), INT64_MAX)


def positions(value: Any) -> np.ndarray:
    """Positions as a 1-D int64 array (TypeError: not integers; ValueError: not 1-D)."""
    return _integers("positions", value)


def integers(what: str, value: Any) -> np.ndarray:
    """A per-sequence call's integer array ``what`` (``parents``, ``nodes``): 1-D int64."""
    return _integers(what, value)


def _integers(what: str, value: Any) -> np.ndarray:
    """``value`` as a 1-D int64 array, its errors naming it ``what``: TypeError when it
    does not hold integers, ValueError when it is not 1-D; beyond int64, the nearest int64
    (rejected by the value's own rule)."""
    arr = np.asarray(value)
    if arr.dtype == object and arr.ndim == 1:  # Python ints beyond int64: each clamped, as integer() does
        try:
            arr = np.array([integer(what, v) for v in arr], np.int64)
        except TypeError:
            pass  # not integers: named by the dtype below
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind == "u":
        arr = np.minimum(arr, np.uint64(INT64_MAX)).astype(np.uint64)
    return arr.astype(np.int64)


def tokens(call: str, value: Any, n: int) -> np.ndarray | None:
    """A chain drafter's token ids (``tokens=``): None, or ``n`` int32 ids; TypeError when
    they are not integers, ValueError when not 1-D, not one per row, or outside int32."""
    if value is None:
        return None
    who = f"{call}: tokens" if call else "tokens"
    arr = np.asarray(value)
    if arr.dtype == object and arr.ndim == 1:
        try:
            arr = np.array([integer(who, v) for v in arr], np.int64)
        except TypeError:
            pass  # named by the dtype below
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{who} must be integers (token ids), got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{who} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"{who}: {arr.shape[0]} token ids for {n} rows (one per row)")
    for k, v in enumerate(arr.tolist()):
        if not -(1 << 31) <= v < 1 << 31:
            raise ValueError(f"{who}[{k}] is {v}: token ids must fit int32")
    return arr.astype(np.int32)


def check_tokens(call: str, chain: bool, ids: np.ndarray | None, n: int) -> None:
    """The core's check of a process call's token ids: given exactly when the Stager keeps
    them (a chain drafter's), each >= 0."""
    at = f"{call}: " if call else ""
    if not chain:
        if ids is not None:
            raise ValueError(f'{at}tokens are kept for a chain drafter (kind="chain") only; this Stager\'s '
                             'drafter kind is "block"')
        return
    if ids is None:
        if n:
            raise ValueError(f'{at}a chain drafter\'s Stager (kind="chain") needs the token id of every row '
                             "(tokens: the token the target read at each row's position)")
        return
    for k, v in enumerate(ids.tolist()):
        if v < 0:
            raise ValueError(f"{at}tokens[{k}] is {v}: token ids are >= 0; nothing was appended")


def token_table(call: str, value: Any, writable: bool) -> np.ndarray | None:
    """The device step's slot token table: None, or the caller's own 1-D C-contiguous, aligned
    int32 array (used in place); TypeError for another type or dtype, ValueError for another
    shape or layout, or a read-only one where ``writable``."""
    if value is None:
        return None
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{call}: tokens must be the slot token table, a numpy int32 array "
                        f"(Stager.new_token_table()), got {type(value).__name__}")
    if value.dtype != np.int32:
        raise TypeError(f"{call}: the slot token table must be int32, got dtype {value.dtype}")
    if value.ndim != 1 or not value.flags.c_contiguous or not value.flags.aligned:
        raise ValueError(f"{call}: the slot token table must be a 1-D C-contiguous, aligned array, got shape "
                         f"{value.shape}" + ("" if value.flags.aligned else " (misaligned)"))
    if writable and not value.flags.writeable:
        raise ValueError(f"{call}: the slot token table must be writable ({call} writes the ids into it)")
    return value


def check_token_table(call: str, chain: bool, table: np.ndarray | None, want: int) -> None:
    """The core's check of a slot token table: given exactly when the Stager keeps ids, one
    per global slot (``want``)."""
    if not chain:
        if table is not None:
            raise ValueError(f'{call}: tokens (the slot token table) are kept for a chain drafter (kind="chain") '
                             'only; this Stager\'s drafter kind is "block"')
        return
    if table is None:
        raise ValueError(f"{call}: a chain drafter's Stager hands its rows' token ids over by slot: it needs the "
                         f"slot token table (tokens: int32, max_seqs * ring_rows = {want} ids; in C, the "
                         "dspark_to_device_tokens / dspark_to_host_tokens forms)")
    if len(table) != want:
        raise ValueError(f"{call}: the slot token table holds {len(table)} ids; it needs one per global slot, "
                         f"max_seqs * ring_rows = {want}")


def rows(value: Any, feature_dim: int) -> np.ndarray:
    """Rows as a native ``(n, feature_dim)`` float32 / float16 / bfloat16 array."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"rows must be a numpy array, got {type(value).__name__}")
    if value.dtype.newbyteorder("=") not in _ROW_DTYPES:
        raise TypeError(f"rows must be float32, float16 or bfloat16 (ml_dtypes), got dtype {value.dtype}")
    if value.ndim != 2 or value.shape[1] != feature_dim:
        raise ValueError(f"rows must have shape (n, {feature_dim}), got {value.shape}")
    return value.astype(value.dtype.newbyteorder("="))


def encoded(value: Any, n: int, row_bytes: int) -> np.ndarray:
    """Encoded rows as flat uint8 bytes (their count is a value, checked by the caller)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = np.frombuffer(value, np.uint8)
        except (ValueError, BufferError) as exc:
            raise TypeError(f"encoded rows must be a contiguous buffer ({exc})") from None
    arr = np.asarray(value)
    if arr.dtype != np.uint8:
        raise TypeError(f"encoded rows must be uint8, got dtype {arr.dtype}")
    if arr.ndim == 2 and arr.shape != (n, row_bytes):
        raise ValueError(f"encoded rows must have shape ({n}, {row_bytes}), got {arr.shape}")
    if arr.ndim not in (1, 2):
        raise ValueError(f"encoded rows must be ({n}, {row_bytes}) or flat, got shape {arr.shape}")
    return arr.reshape(-1)


def readable(value: Any) -> memoryview:
    """Snapshot data: any buffer, as flat bytes."""
    try:
        view = memoryview(value)
    except (TypeError, ValueError):
        raise TypeError(f"snapshot data must be bytes-like, got {type(value).__name__}") from None
    return memoryview(view.tobytes())


def writable(value: Any) -> memoryview:
    """A writable C-contiguous buffer, as flat bytes."""
    try:
        view = memoryview(value)
    except (TypeError, ValueError):
        raise TypeError(f"buffer must support the buffer protocol, got {type(value).__name__}") from None
    if view.readonly:
        raise TypeError(f"buffer must be writable, got a read-only {type(value).__name__}")
    if not view.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got a strided {type(value).__name__}")
    return view.cast("B")


def fail_stage(value: Any, name: str = "stage") -> str:
    """A fail stage's name (``name``: the argument's, ``"outcome"`` for ``to_host``'s)."""
    if isinstance(value, str) and value in FAIL_STAGES:
        return value
    raise ValueError(f"{name} must be one of {FAIL_STAGES}, got {value!r}")


def rows_given(external: bool, value: Any, call: str = "process") -> None:
    """``process`` / ``process_many``: rows in held mode, none in external-row mode."""
    if external and value is not None:
        usage = {"process": "process(seq, positions)", "process_tree": "process_tree(seq, n_past, parents)",
                 "process_tree_many": "process_tree_many(seqs, cu_seqlens, n_pasts, parents)"}.get(
            call, f"{call}(seqs, cu_seqlens, positions)")
        raise TypeError(
            f"{call}: this Stager runs in external-row mode (rows='external') and holds no rows: "
            f"call {usage} without rows and write each row at the slot it returns"
        )
    if not external and value is None:
        raise TypeError(
            f"{call}: rows are required: this Stager holds its rows (rows='held'); pass the (n, feature_dim) rows "
            "or configure StagerConfig(rows='external')"
        )


def zero_copy(external: bool, copy: Any, call: str = "draft") -> bool:
    """``draft``'s (``draft_many``'s) ``copy`` is ``False``: views of held rows asked for
    (a TypeError for a non-bool, or in external-row mode, which holds no rows)."""
    if not (copy is True or copy is False or isinstance(copy, np.bool_)):
        raise TypeError(f"copy must be True or False, got {type(copy).__name__}")
    if copy:
        return False
    if external:
        raise TypeError(
            f"{call}(copy=False): this Stager runs in external-row mode (rows='external') and holds no rows: "
            "its plans carry no rows to view (read them from your table at plan.slots)"
        )
    return True


def held_rows(external: bool, call: str) -> None:
    if external:
        raise TypeError(f"{call}: this Stager runs in external-row mode (rows='external') and holds no rows")


# -- a batch's arrays (one call for many sequences) ---------------------------------
#
# A batch's arrays are converted whole and their errors name the call; an
# error about one sequence is that sequence's own error (the per-sequence
# call's), prefixed by :func:`batch_context`.


def _int_array(call: str, name: str, value: Any) -> np.ndarray:
    """A batch's integer array ``name``: 1-D int64, its errors naming the call."""
    return _integers(f"{call}: {name}", value)


def seq_ids(call: str, value: Any) -> np.ndarray:
    """A batch's sequence ids."""
    return _int_array(call, "seqs", value)


def batch_ints(call: str, name: str, value: Any, n: int) -> np.ndarray:
    """One integer per sequence of a batch of ``n`` (``n_pasts``, ``n_accepted``)."""
    arr = _int_array(call, name, value)
    if len(arr) != n:
        raise ValueError(f"{call}: {n} sequences for {len(arr)} {name} values")
    return arr


def batch_rows(call: str, external: bool, feature_dim: int, n: int, cu_seqlens: Any, positions: Any,
               value: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A varlen batch: ``cu_seqlens`` (``n + 1`` entries), the flat positions and, in held
    mode, the flat rows (one per position)."""
    rows_given(external, value, call)
    cu = _int_array(call, "cu_seqlens", cu_seqlens)
    if len(cu) != n + 1:
        raise ValueError(f"{call}: cu_seqlens must have {n + 1} entries (one more than seqs), got {len(cu)}")
    pos = _int_array(call, "positions", positions)
    if external:
        return cu, pos, None
    arr = rows(value, feature_dim)
    if len(arr) != len(pos):
        raise ValueError(f"{call}: {len(pos)} positions for {len(arr)} rows")
    return cu, pos, arr


def fail_stages(call: str, stages: Any, seqs: np.ndarray) -> list[str]:
    """``fail_many``'s stages: one name for every sequence, or one name (or index in
    ``FAIL_STAGES``) per sequence; a bad one is ``fail``'s error about its sequence."""
    n = len(seqs)
    if isinstance(stages, str):
        stages = [stages] * n
    arr = np.asarray(stages)
    if arr.ndim != 1:
        raise ValueError(f"{call}: stages must be one name or 1-D, got shape {arr.shape}")
    if len(arr) != n:
        raise ValueError(f"{call}: {n} sequences for {len(arr)} stages")
    if arr.dtype.kind in "iu":
        given: list[Any] = [FAIL_STAGES[v] if 0 <= v < len(FAIL_STAGES) else v for v in arr.tolist()]
    else:
        given = list(stages)
    out = []
    for i, stage in enumerate(given):
        with in_batch(call, i, int(seqs[i])):
            out.append(fail_stage(stage))
    return out


def batch_context(call: str, i: int, seq: int) -> str:
    """What an error about ``seqs[i]`` of a batch call starts with."""
    return f"{call}: seqs[{i}] (sequence {seq}): "


@contextmanager
def in_batch(call: str, i: int, seq: int) -> Iterator[None]:
    """Re-raise a rejection of ``seqs[i]`` as the same kind of error, named (:func:`batch_context`)."""
    try:
        yield
    except StateError as exc:
        raise StateError(batch_context(call, i, seq) + str(exc)) from None
    except TypeError as exc:
        raise TypeError(batch_context(call, i, seq) + str(exc)) from None
    except ValueError as exc:
        raise ValueError(batch_context(call, i, seq) + str(exc)) from None


def unique(call: str, seqs: np.ndarray) -> None:
    """Each sequence once: the first id that repeats an earlier one is named, with both places."""
    first: dict[int, int] = {}
    for j, s in enumerate(seqs.tolist()):
        if s in first:
            raise ValueError(
                f"{call}: sequence {s} appears twice (seqs[{first[s]}] and seqs[{j}]): a batch names each sequence once"
            )
        first[s] = j


def offsets(call: str, cu: np.ndarray, total: int) -> None:
    """``cu_seqlens`` start at 0, never decrease and end at the ``total`` rows."""
    who = f"{call}: cu_seqlens "
    if cu[0] != 0:
        raise ValueError(f"{who}must start at 0, got {int(cu[0])}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(
                f"{who}must not decrease, got cu_seqlens[{i + 1}] = {int(cu[i + 1])} < cu_seqlens[{i}] = {int(cu[i])}"
            )
    if cu[-1] != total:
        raise ValueError(f"{who}must end at the {total} rows, got {int(cu[-1])}")


def external_only(call: str) -> ValueError:
    """``reserve`` on a Stager that holds its rows."""
    return ValueError(
        f"{call} needs external-row mode, but this Stager holds its rows (use process / process_encoded)"
    )


# -- values -----------------------------------------------------------------------


def unknown_sequence(i: int, max_seqs: int) -> ValueError:
    return ValueError(f"unknown sequence {i} (this Stager has sequences 0..{max_seqs - 1})")


def count(name: str, v: int) -> int:
    """A position-like count: ``[0, MAX_POSITION)``."""
    if not 0 <= v < MAX_POSITION:
        raise ValueError(f"{name} must be in [0, 2**62), got {v}")
    return v


def position_values(seq: int, pos: np.ndarray, end: int | None) -> None:
    """Every position in range (the first one that is not is named), contiguous,
    continuing the sequence at ``end`` (None before its first row)."""
    bad = np.flatnonzero((pos < 0) | (pos >= MAX_POSITION - 1))
    if len(bad):
        raise ValueError(f"position {int(pos[bad[0]])} is out of range [0, 2**62 - 1)")
    if len(pos) > 1 and not np.all(np.diff(pos) == 1):
        raise ValueError(f"sequence {seq}: positions must be contiguous (+1 each row)")
    if end is not None and len(pos) and int(pos[0]) != end:
        p0 = int(pos[0])
        why = (
            f"rows up to {end - 1} are buffered: was accept() not called after the verify batch, "
            "or is a rollback() to the target's n_past missing?"
            if p0 < end
            else f"rows {end}..{p0 - 1} were never processed: every target decode must be passed to process()"
        )
        raise ValueError(f"sequence {seq}: positions must continue at {end}, got {p0} ({why})")


def bad_value(p0: int, row: int, channel: int, value: float, storage: str, stage_dtype: str, limit: float) -> str:
    """Where a value a row cannot carry sits and why: non-finite, or beyond ``limit`` once stored
    (and staged). The Stager's and the prefix store's messages both start with it."""
    if np.isfinite(value):
        staged = "" if stage_dtype == "float32" else f" staged as {stage_dtype}"
        what = f", which overflows {storage} storage{staged} (|x| must stay below {float(limit):.9g})"
    else:
        what = ", a non-finite value"
    shown = "nan" if np.isnan(value) else f"{float(value):.9g}"
    return f"row {row} (position {p0 + row}), channel {channel} holds {shown}{what}"


def unstageable(seq: int, p0: int, row: int, channel: int, value: float, storage: str, stage_dtype: str,
                limit: float) -> ValueError:
    """A value a row cannot carry: non-finite, or beyond ``limit`` once stored (and staged)."""
    return ValueError(
        f"sequence {seq}: {bad_value(p0, row, channel, value, storage, stage_dtype, limit)}; nothing was "
        'appended. Models with massive activations need storage="bf16" (or f32), or nonfinite="clamp" to clamp '
        "to the largest value the storage can hold"
    )


def mismatch_cause(n_past: int, end: int) -> str:
    """Why rows ending at ``end`` do not end at ``n_past``."""
    if end > n_past:
        return (
            f"rows {n_past}..{end - 1} are still buffered: was accept() not called after the verify batch "
            "(it keeps n_accepted + 1 of its rows), or is a rollback() to the target's n_past missing?"
        )
    return (
        f"rows {end}..{n_past - 1} were never processed: every target decode (prefill chunk, verify batch) "
        "must be passed to process()"
    )


def strict_mismatch(seq: int, n_past: int, end: int) -> StateError:
    return StateError(
        f"sequence {seq}: draft(n_past={n_past}) does not match the buffered rows (newest {end - 1}): "
        f"{mismatch_cause(n_past, end)} (strict=True; nothing changed)"
    )


#: The two warnings the reference logs: a sequence disabled, a protocol mismatch (once until begin).
DISABLED_WARNING = (
    "sequence %d: drafting disabled after %d consecutive drafter failures (last: %s); begin() re-enables it"
)
MISMATCH_WARNING = "sequence %d: draft(n_past=%d) skipped (%s): the newest buffered row is %d; %s"
