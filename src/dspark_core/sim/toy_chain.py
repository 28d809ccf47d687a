"""A toy chain drafter (the EAGLE-3 / EAGLE / MTP shape) for :class:`~dspark_core.sim.loop.SpeculativeLoop`.

A chain drafter consumes each captured row once, paired with the id of the
token after it, into its own per-sequence cache, and then drafts one token per
step, each step's entry going into the cache too (the loop crops them). The
Stager keeps the ids (``StagerConfig(kind="chain")``) and a plan hands them out
(``plan.successors(last)``), windowed and rebased as for block drafters.

:class:`ToyChainDrafter` reads the toy target of :mod:`dspark_core.sim.toy`:

* an entry at drafter position ``p`` (row ``r``, successor ``t``) gets the key
  ``rotate(presence(r), p)`` and the value ``code[T^L t] + code_of(r) / 2``,
  where ``code_of(r)`` is the plan code the target put in the row (the code of
  ``T^(L+1)`` of the row's own token) and ``T`` is the target's permutation:
  both say which token the target expects ``L + 1`` positions after the row,
  the successor's half exactly, even at the target's deviations;
* draft step ``j`` queries from the position of the newest entry (the last
  context row, then each drafted entry) with a planted RoPE offset of ``L - 1``,
  so it reads the entry whose expected token is the one being drafted; the
  step's logits are each token's code against what it read (the draft is the
  best, a tree's leaf the second best).

So the drafts are right when the rows sit at the right relative positions
and each row comes with the id of the token after it: a row paired with its
own token instead reads the code of the token one position early (acceptance
collapses); rows staged at a wrong position, or a cache not cropped, miss the
planted offset (and ``strict`` asserts it). As :class:`~dspark_core.sim.toy.ToyDrafter`,
the position encoding is defined on ``[0, n_ctx_train)`` only: past it the
rotations are seeded pseudo-random angles, so drafting at absolute positions
past the trained range falls to chance while drafting inside a window holds.
"""

from __future__ import annotations

import numpy as np

from .loop import Tokens
from .toy import _CODE, ToyTarget, cos_sin, rotate, trained_angles

__all__ = ["ToyChainDrafter"]

#: The planted head's sharpness: softmax over keys whose rotation matches the offset.
_AMP = 150.0
#: The weight of the row's own plan code in an entry's value (the successor's counts 1).
_ROW_WEIGHT = 0.5


class ToyChainDrafter:
    """A chain drafter with a per-sequence cache of (row, successor id) entries.

    Args:
        vocab_size: the target's vocabulary.
        feature_dim: width ``D`` of a captured row.
        block_size: ``B``: tokens drafted per round (one per step).
        lookahead: the target's ``lookahead`` ``L`` (>= 1).
        successor_code: ``(vocab_size, 32)``: the code of ``T^L t`` for each token ``t``
            (what the drafter "learned" of the target; :meth:`for_target` builds it).
        seed: seed of the untrained positions' encoding.
        strict: assert that consumed positions continue the cache and the draft steps follow them.
        n_ctx_train: the trained range (``None``: RoPE everywhere).
    """

    kind = "chain"

    def __init__(
        self,
        vocab_size: int,
        feature_dim: int,
        block_size: int,
        lookahead: int,
        successor_code: np.ndarray,
        seed: int = 0,
        strict: bool = True,
        n_ctx_train: int | None = None,
    ) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        if n_ctx_train is not None and n_ctx_train < 1:
            raise ValueError(f"n_ctx_train must be >= 1 or None, got {n_ctx_train}")
        code = np.asarray(successor_code, np.float64)
        if code.shape != (vocab_size, _CODE):
            raise ValueError(f"successor_code must have shape ({vocab_size}, {_CODE}), got {code.shape}")
        self.vocab_size = vocab_size
        self.mask_token_id = vocab_size  # unused by a chain drafter; the loop's Drafter protocol names it
        self.feature_dim = feature_dim
        self.block_size = block_size
        self.lookahead = lookahead
        self.seed = seed
        self.strict = strict
        self.n_ctx_train = n_ctx_train
        self._succ_code = code
        self._code: np.ndarray | None = None  # the target's code, to read a row's plan code and pick tokens
        self._k: dict[int, np.ndarray] = {}
        self._v: dict[int, np.ndarray] = {}
        self._n: dict[int, int] = {}
        self._peak: dict[int, int] = {}

    @classmethod
    def for_target(cls, target: ToyTarget, block_size: int, **kw: object) -> "ToyChainDrafter":
        """A drafter matched to ``target`` (its vocabulary, width, lookahead and codes)."""
        t_l = np.arange(target.vocab_size)
        for _ in range(target.lookahead):
            t_l = target.perm[t_l]
        d = cls(target.vocab_size, target.feature_dim, block_size, target.lookahead, target.code[t_l],
                **kw)  # type: ignore[arg-type]
        d._code = np.asarray(target.code, np.float64)
        return d

    # -- cache ------------------------------------------------------------------
    def clear(self, seq: int) -> None:
        """Remove every cached entry of ``seq``."""
        self._n[seq] = 0

    def crop(self, seq: int, from_pos: int) -> None:
        """Remove cached positions ``>= from_pos``."""
        self._n[seq] = min(self._n.get(seq, 0), max(0, int(from_pos)))

    def cache_len(self, seq: int) -> int:
        return self._n.get(seq, 0)

    def peak_cache_len(self, seq: int | None = None) -> int:
        """Largest number of entries ``seq`` (or any sequence) ever held, draft steps included."""
        if seq is not None:
            return self._peak.get(seq, 0)
        return max(self._peak.values(), default=0)

    def _reserve(self, seq: int, n: int) -> None:
        k = self._k.get(seq)
        if k is not None and len(k) >= n:
            return
        cap = max(64, n, 2 * (0 if k is None else len(k)))
        nk, nv = np.zeros((cap, _CODE)), np.zeros((cap, _CODE))
        m = self._n.get(seq, 0)
        if k is not None:
            nk[:m], nv[:m] = k[:m], self._v[seq][:m]
        self._k[seq], self._v[seq] = nk, nv

    # -- math -------------------------------------------------------------------
    def position_angles(self, positions: np.ndarray) -> np.ndarray:
        """RoPE angles inside ``[0, n_ctx_train)``, seeded pseudo-random ones past it."""
        return trained_angles(positions, _CODE // 2, self.n_ctx_train, self.seed)

    def _entries(self, positions: np.ndarray, rows: np.ndarray, successors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of (row, successor) entries at ``positions``."""
        n = len(positions)
        key = np.zeros((n, 1, _CODE))
        key[:, 0, : _CODE // 2] = rows[:, _CODE : _CODE + 1]  # the presence feature
        k = rotate(key, cos_sin(self.position_angles(positions), np.dtype(np.float64)))[:, 0]
        v = self._succ_code[successors] + _ROW_WEIGHT * rows[:, :_CODE]
        return k, v

    def _query(self, position: int) -> np.ndarray:
        """The planted query at ``position``: it matches keys ``lookahead - 1`` positions back."""
        half = _CODE // 2
        theta = 10000.0 ** (-np.arange(half) / half)
        q = np.zeros((1, 1, _CODE))
        q[0, 0, :half] = _AMP * np.cos(-theta * (self.lookahead - 1))
        q[0, 0, half:] = _AMP * np.sin(-theta * (self.lookahead - 1))
        return rotate(q, cos_sin(self.position_angles(np.array([position])), np.dtype(np.float64)))[0, 0]

    def _logits(self, k: np.ndarray, v: np.ndarray, position: int, n_blank: int = 0) -> np.ndarray:
        """The logits of the step drafted from ``position`` over entries ``k`` / ``v`` and ``n_blank``
        draft-step entries (zero key and value: they only dilute the softmax)."""
        s = k @ self._query(position) / np.sqrt(_CODE)
        top = max(float(s.max()), 0.0) if n_blank else float(s.max())
        w = np.exp(s - top)
        out = (w @ v) / (w.sum() + n_blank * np.exp(-top))
        assert self._code is not None, "use ToyChainDrafter.for_target"
        return self._code @ out

    def decode_chain(
        self, seq: int, positions: np.ndarray, rows: np.ndarray, successors: Tokens, draft_positions: np.ndarray
    ) -> np.ndarray:
        """Consume ``rows`` at drafter ``positions`` with their successor ids, then draft.

        ``draft_positions``: the ``B`` positions after the context (``plan.block_positions``);
        draft step ``j`` queries from the position before ``draft_positions[j]`` and leaves an
        entry at ``draft_positions[j]`` (all but the last step's), which the caller crops.
        Returns the steps' logits ``(B, vocab_size)``: step ``j`` drafts ``argmax(logits[j])``.
        """
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        dpos = np.asarray(draft_positions, dtype=np.int64).reshape(-1)
        succ = np.asarray(successors, dtype=np.int64).reshape(-1)
        x = np.asarray(rows, dtype=np.float64).reshape(len(pos), self.feature_dim)
        if len(succ) != len(pos):
            raise ValueError(f"{len(succ)} successor ids for {len(pos)} rows")
        n = self._n.get(seq, 0)
        if self.strict:
            if len(pos) and not np.array_equal(pos, np.arange(n, n + len(pos))):
                raise AssertionError(f"seq {seq}: consumed positions [{pos[0]}..{pos[-1]}] do not continue the "
                                     f"cache end {n}")
            if not np.array_equal(dpos, np.arange(n + len(pos), n + len(pos) + len(dpos))):
                raise AssertionError(f"seq {seq}: draft positions {dpos.tolist()} do not follow the context end "
                                     f"{n + len(pos)}")
        if n + len(pos) == 0:
            raise ValueError(f"seq {seq}: nothing to draft from (an empty cache and no rows)")
        self._reserve(seq, n + len(pos) + len(dpos))
        k, v = self._entries(pos, x, succ)
        self._k[seq][n : n + len(pos)] = k
        self._v[seq][n : n + len(pos)] = v
        end = ctx_end = n + len(pos)
        logits = np.empty((len(dpos), self.vocab_size))
        for j, p in enumerate(dpos.tolist()):
            logits[j] = self._logits(self._k[seq][:ctx_end], self._v[seq][:ctx_end], p - 1, end - ctx_end)
            if j + 1 < len(dpos):  # the step's own entry: no presence, so the planted head skips it
                self._k[seq][end] = 0.0
                self._v[seq][end] = 0.0
                end += 1
        self._n[seq] = end
        self._peak[seq] = max(self._peak.get(seq, 0), end)
        return logits

    def recompute_chain(self, rows: np.ndarray, positions: np.ndarray, successors: Tokens,
                        draft_positions: np.ndarray) -> np.ndarray:
        """The same logits from scratch over ``rows`` at ``positions`` (no cache)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        x = np.asarray(rows, dtype=np.float64).reshape(len(pos), self.feature_dim)
        k, v = self._entries(pos, x, np.asarray(successors, dtype=np.int64).reshape(-1))
        dpos = np.asarray(draft_positions, np.int64).tolist()
        return np.array([self._logits(k, v, p - 1, j) for j, p in enumerate(dpos)]).reshape(len(dpos), self.vocab_size)
