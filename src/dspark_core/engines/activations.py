"""Massive activations in captured rows, and what each storage and non-finite policy makes of them.

Real hidden states carry a few "massive activation" channels, orders of
magnitude above the rest (Gemma 3 270M reaches ~9e4 on ordinary text, above
f16's 65,504). :func:`massive_activations` measures them per tap layer;
:func:`storage_outcomes` runs rows that hold them through a Stager of every
storage under every non-finite policy and reports what was staged, computed
from the staged values (nothing here is a table of expectations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["LayerActivations", "massive_activations", "StorageOutcome", "storage_outcomes"]

#: A channel is "massive" when its median |x| over tokens exceeds this many times its layer's median |x|.
MASSIVE_FACTOR = 20.0

_QK = 32  # GGML q-format block width


@dataclass
class LayerActivations:
    """Magnitudes of one tap layer's values over the captured tokens.

    Attributes:
        layer: the tap layer (``l_out`` index).
        max_abs: largest |x|; ``max_token`` / ``max_channel``: where.
        max_abs_rest: largest |x| over the tokens after the first (the first is BOS in a prompt).
        median_abs: median |x| over every value of the layer.
        massive_channels: channels whose median |x| over the tokens exceeds ``factor * median_abs``
            (persistently massive; a huge-norm BOS row alone lifts every channel), largest first.
        massive_channel_max: each such channel's largest |x|.
        tokens_with_massive: tokens holding a value above ``factor * median_abs``.
    """

    layer: int
    max_abs: float
    max_token: int
    max_channel: int
    max_abs_rest: float
    median_abs: float
    massive_channels: list[int]
    massive_channel_max: list[float]
    tokens_with_massive: int


def massive_activations(
    rows: np.ndarray, layers: Sequence[int], n_embd: int, factor: float = MASSIVE_FACTOR
) -> list[LayerActivations]:
    """Per tap layer of ``rows`` (``(n, len(layers) * n_embd)``, the drafter layout): see :class:`LayerActivations`."""
    x = np.abs(np.asarray(rows, dtype=np.float32).reshape(len(rows), len(layers), n_embd))
    out = []
    for k, il in enumerate(layers):
        a = x[:, k, :]
        flat = int(np.argmax(a))
        tok, ch = divmod(flat, n_embd)
        med = float(np.median(a))
        ch_max = a.max(axis=0)
        thr = factor * med
        # persistent, not one token's: a huge-norm row (BOS) lifts every channel once
        massive = np.flatnonzero(np.median(a, axis=0) > thr)
        massive = massive[np.argsort(-ch_max[massive], kind="stable")]
        out.append(LayerActivations(
            layer=int(il), max_abs=float(a[tok, ch]), max_token=int(tok), max_channel=int(ch),
            max_abs_rest=float(a[1:].max()) if len(a) > 1 else 0.0, median_abs=med,
            massive_channels=[int(c) for c in massive], massive_channel_max=[float(ch_max[c]) for c in massive],
            tokens_with_massive=int(np.count_nonzero((a > thr).any(axis=1))),
        ))
    return out


@dataclass
class StorageOutcome:
    """What a Stager of ``storage`` with ``nonfinite`` did with rows holding massive values.

    Attributes:
        outcome: ``"rejected (ExcType)"``, ``"inf staged"``, ``"nan staged"``, ``"zeroed"``,
            ``"clamped"`` or ``"kept"`` (the staged values at the input's largest |x|).
        staged_max: the staged value where the input is largest in magnitude (None if rejected).
        input_max: that input value.
        nonfinite_staged: non-finite staged values.
        changed_beyond_rounding: staged values further from the input than the format's rounding
            (the values a policy replaced).
        small_lost: in q formats, nonzero inputs sharing a block with a massive value that
            decode to 0 (the block scale is set by the massive value); 0 for float formats.
        message: the exception message when rejected.
    """

    storage: str
    nonfinite: str
    outcome: str
    staged_max: float | None
    input_max: float
    nonfinite_staged: int
    changed_beyond_rounding: int
    small_lost: int
    message: str = ""


# Largest relative error of one element's encode, by storage (q formats: relative to the block's
# largest |x|). A value further off than this was replaced by a policy, not rounded.
# q8_0: half a step of d = amax / 127, plus d's f16 rounding times |q| <= 127. q4_0: d = max / -8 maps
# the max exactly but clamps -max to 7 d, a whole step off, plus d's f16 rounding times |q| <= 8.
_REL_ROUNDING = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8, "q8_0": 0.5 / 127 + 2.0**-11,
                 "q4_0": 1.0 / 8 + 2.0**-11}


def _beyond_rounding(x: np.ndarray, s: np.ndarray, storage: str) -> np.ndarray:
    """Mask of staged values ``s`` further from ``x`` than ``storage``'s rounding allows."""
    rel = _REL_ROUNDING[storage]
    if storage.startswith("q"):
        scale = np.repeat(np.abs(x).reshape(len(x), -1, _QK).max(axis=2), _QK, axis=1)
        # the block scale d is stored in f16: it may saturate at 65504 / 127 etc.; allow its rounding too
        tol = rel * scale * (1 + 2.0**-10) + 1e-30
    else:
        tol = rel * np.abs(x) + np.where(storage == "f16", 2.0**-24, 0.0)
    with np.errstate(invalid="ignore"):
        return ~(np.abs(s.astype(np.float64) - x.astype(np.float64)) <= tol)


def storage_outcomes(
    rows: np.ndarray,
    make_stager: Callable[[str, str], Any],
    storages: Sequence[str],
    policies: Sequence[str],
) -> list[StorageOutcome]:
    """Run ``rows`` through a Stager of each storage x policy and classify what was staged.

    ``make_stager(storage, policy)`` returns a Stager whose window exceeds ``len(rows) + B``;
    the rows are processed at positions ``[0, n)`` and staged by one ``draft(0, n)``.
    """
    x = np.ascontiguousarray(rows, dtype=np.float32)
    n = len(x)
    massive_threshold = MASSIVE_FACTOR * float(np.median(np.abs(x[np.isfinite(x)])))
    i_max = np.unravel_index(int(np.argmax(np.where(np.isfinite(x), np.abs(x), -1.0))), x.shape)  # largest finite
    x_max = float(x[i_max])
    out = []
    for storage in storages:
        for policy in policies:
            st = make_stager(storage, policy)
            st.begin(0)
            try:
                st.process(0, np.arange(n), x)
            except (ValueError, OverflowError) as exc:
                out.append(StorageOutcome(storage, policy, f"rejected ({type(exc).__name__})", None, x_max, 0, 0, 0,
                                          message=str(exc)))
                continue
            plan = st.draft(0, n)
            if plan.skip is not None or len(plan.positions) != n:
                raise RuntimeError(f"{storage}/{policy}: the plan staged {len(plan.positions)} of {n} rows ({plan.skip})")
            st.commit(0)
            s = np.asarray(plan.rows, dtype=np.float32)
            v = float(s[i_max])
            nonfin = int(np.count_nonzero(~np.isfinite(s)))
            changed = int(np.count_nonzero(_beyond_rounding(x, s, storage)))
            lost = 0
            if storage.startswith("q"):
                xb, sb = x.reshape(n, -1, _QK), s.reshape(n, -1, _QK)
                big = np.abs(xb).max(axis=2, keepdims=True) > massive_threshold  # blocks holding a massive value
                lost = int(np.count_nonzero(big & (xb != 0) & (sb == 0)))
            if np.isnan(v):
                outcome = "nan staged"
            elif np.isinf(v):
                outcome = "inf staged"
            elif v == 0.0 and x_max != 0.0:
                outcome = "zeroed"
            elif abs(v) < abs(x_max) * (1 - 2 * _REL_ROUNDING[storage]) - 1e-30:
                outcome = "clamped"
            else:
                outcome = "kept"
            out.append(StorageOutcome(storage, policy, outcome, v, x_max, nonfin, changed, lost))
    return out
