"""Small numpy models that make the speculative loop real enough to test end to end.

:class:`ToyTarget`
    A deterministic "language model" over a small vocabulary. Its state is a
    chaotic recurrence over the whole prefix, so every capture row depends on
    every earlier token. Its greedy next token mostly follows a fixed random
    permutation ``T`` of the vocabulary and, at prefix-dependent pseudo-random
    points (rate ``deviation``), jumps to a token chosen by the state. Each
    capture row carries the target's *plan*: a code of ``T^(lookahead+1)`` of
    its token (the token it expects ``lookahead + 1`` positions later if no
    deviation happens), plus state features. The target keeps its per-position
    state, so rolling back rejected tokens is O(1).

:class:`ToyDrafter`
    A KV-injection block drafter (the DSpark / DFlash shape): every context
    row ``x`` goes through per-layer projections straight into K/V, with RoPE
    applied to K at the row's drafter position; the block queries come from
    the embeddings of ``[last_token, mask, ..., mask]`` with RoPE at the block
    positions; block rows attend non-causally to every cached context row and
    to each other. Weights are random except one planted head: it attends to
    the context row exactly ``lookahead`` positions back (a pure RoPE relative
    position match) and reads its plan code, so the drafter predicts the
    target well whenever its positions are right. Because the head keys on
    *relative* positions, staging a row at a wrong drafter position or
    forgetting a crop shows up as lost acceptance, and the cache asserts make
    such bugs loud. With ``n_ctx_train`` the position encoding is defined on
    ``[0, n_ctx_train)`` only (seeded pseudo-random rotations past it), as a
    trained drafter's is on the positions it was trained on: drafting at
    absolute positions past the range falls to chance, drafting inside a
    window holds.

    The drafter keeps an incremental KV cache per sequence (``clear``,
    ``crop``); :meth:`ToyDrafter.recompute` evaluates the same block from
    scratch for the "incremental equals recompute" check.

:class:`FlakyDrafter`
    Wraps a drafter and raises :class:`DrafterFailure` on a schedule or with a
    probability, in ``decode`` (after corrupting the cache, as a half-finished
    decode would) or in ``crop`` (leaving the block rows in the cache).

Numerics: the drafter computes in float64 by default. Incremental and
from-scratch evaluation then differ only by BLAS summation order in the K/V
projections (a dot product of ``D`` terms) and in the attention sums (at most
``W + B`` terms), i.e. a relative error around ``n * 2**-53 ~ 1e-13``; tests
use ``rtol = atol = 1e-9``. With ``dtype=np.float32`` the same bound is
``~n * 2**-24 ~ 1e-4`` relative on logits of order 10, so use ``rtol = 1e-4``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .loop import DrafterError, Tokens

__all__ = [
    "ToyTarget",
    "ToyDrafter",
    "FlakyDrafter",
    "DrafterFailure",
    "TargetOutput",
    "rope",
    "rope_angles",
    "rotate",
    "cos_sin",
    "untrained_angles",
    "trained_angles",
    "greedy_reference",
]

logger = logging.getLogger("dspark_core")

_CODE = 32  # width of the plan code in a capture row


class DrafterFailure(DrafterError):
    """Raised by :class:`FlakyDrafter` (an injected drafter failure).

    Attributes:
        stage: ``"decode"`` or ``"crop"``: where the round failed.
    """

    def __init__(self, stage: str, message: str = "") -> None:
        super().__init__(message or f"injected drafter failure ({stage})")
        self.stage = stage


@dataclass
class TargetOutput:
    """What one target decode returns.

    Attributes:
        next_tokens: int64 ``(n,)``: the greedy next token after each decoded position.
        rows: float32 ``(n, feature_dim)``: the capture rows of the decoded positions.
    """

    next_tokens: np.ndarray
    rows: np.ndarray


# ----------------------------------------------------------------------------
# target


class ToyTarget:
    """A deterministic toy target with prefix-dependent capture rows (see module docstring).

    Args:
        vocab_size: number of tokens.
        feature_dim: width ``D`` of a capture row (>= 64; a multiple of 32 for q formats).
        state_dim: width of the recurrent state.
        lookahead: how far ahead the plan code in each capture row looks (the
            drafter's planted head must use the same value; ``>= block_size``
            gives every block row a context row to read).
        deviation: rate of prefix-dependent jumps away from the permutation.
        seed: seed of the random weights.

    The weights depend only on ``seed`` (and the sizes), so two targets built
    with the same arguments decode identically.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        feature_dim: int = 128,
        state_dim: int = 64,
        lookahead: int = 8,
        deviation: float = 0.05,
        seed: int = 0,
    ) -> None:
        if feature_dim < _CODE + 2:
            raise ValueError(f"feature_dim must be >= {_CODE + 2}, got {feature_dim}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        if not 0.0 <= deviation <= 1.0:
            raise ValueError(f"deviation must be in [0, 1], got {deviation}")
        self.vocab_size = vocab_size
        self.feature_dim = feature_dim
        self.state_dim = state_dim
        self.lookahead = lookahead
        self.deviation = deviation
        self.seed = seed
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x7A67]))
        s = state_dim
        a = rng.standard_normal((s, s))
        self._A = 1.3 * a / np.sqrt(s)  # gain > 1: chaotic, so the state depends on the whole prefix
        self._E = rng.standard_normal((vocab_size, s))
        self._Wn = rng.standard_normal((s, vocab_size))
        self._wu = rng.standard_normal(s)
        self._P = rng.standard_normal((s, feature_dim - _CODE - 1)) / np.sqrt(s)
        self.perm = rng.permutation(vocab_size).astype(np.int64)
        plan = np.arange(vocab_size)
        for _ in range(lookahead + 1):
            plan = self.perm[plan]
        self.plan_table = plan  # T^(lookahead+1)
        self.code = rng.choice([-1.0, 1.0], size=(vocab_size, _CODE)) / np.sqrt(_CODE)
        self.reset()

    # -- state --------------------------------------------------------------
    def reset(self) -> None:
        """Forget every decoded token (a new request)."""
        self._n = 0
        cap = 1024
        self._states = np.zeros((cap, self.state_dim))
        self._tokens = np.zeros(cap, dtype=np.int64)

    @property
    def n_past(self) -> int:
        """Number of decoded positions (the next decode starts here)."""
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        """The decoded tokens, positions ``[0, n_past)``."""
        return self._tokens[: self._n].copy()

    def rollback(self, n_past: int) -> None:
        """Drop positions ``>= n_past`` (rejected draft tokens)."""
        if not 0 <= n_past <= self._n:
            raise ValueError(f"cannot roll back to {n_past}: the target is at {self._n}")
        self._n = n_past

    def _grow(self, need: int) -> None:
        cap = len(self._tokens)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        st = np.zeros((cap, self.state_dim))
        st[: self._n] = self._states[: self._n]
        tk = np.zeros(cap, dtype=np.int64)
        tk[: self._n] = self._tokens[: self._n]
        self._states, self._tokens = st, tk

    # -- decoding -------------------------------------------------------------
    def _step(self, prev: np.ndarray, tok: int) -> tuple[np.ndarray, int]:
        s = np.tanh(self._A @ prev + self._E[tok])
        u = (abs(float(self._wu @ s)) * 997.0) % 1.0  # a pseudo-random function of the prefix
        if u < self.deviation:
            nxt = int(np.argmax(s @ self._Wn))
        else:
            nxt = int(self.perm[tok])
        return s, nxt

    def decode(self, tokens: Tokens) -> TargetOutput:
        """Decode ``tokens`` at positions ``[n_past, n_past + len(tokens))``.

        Returns the greedy next token after each position and the capture rows.
        Token choices are computed one position at a time with fixed-shape
        operations, so they do not depend on how decodes are batched.
        """
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(toks)
        if n and (toks.min() < 0 or toks.max() >= self.vocab_size):
            raise ValueError(f"token out of range [0, {self.vocab_size})")
        self._grow(self._n + n)
        prev = self._states[self._n - 1] if self._n else np.zeros(self.state_dim)
        nxt = np.empty(n, dtype=np.int64)
        for i in range(n):
            prev, nxt[i] = self._step(prev, int(toks[i]))
            self._states[self._n + i] = prev
        self._tokens[self._n : self._n + n] = toks
        states = self._states[self._n : self._n + n]
        self._n += n
        return TargetOutput(nxt, self._rows(toks, states))

    def _rows(self, toks: np.ndarray, states: np.ndarray) -> np.ndarray:
        rows = np.empty((len(toks), self.feature_dim), dtype=np.float32)
        rows[:, :_CODE] = self.code[self.plan_table[toks]]
        rows[:, _CODE] = 1.0  # "presence": what the planted drafter head keys on
        rows[:, _CODE + 1 :] = np.tanh(states @ self._P)
        return rows

    def rows_at(self, lo: int, hi: int) -> np.ndarray:
        """The capture rows of positions ``[lo, hi)`` (recomputed from the stored state)."""
        if not 0 <= lo <= hi <= self._n:
            raise ValueError(f"rows [{lo}, {hi}) outside [0, {self._n})")
        return self._rows(self._tokens[lo:hi], self._states[lo:hi])


def greedy_reference(target: ToyTarget, prompt: Tokens, n_generate: int) -> np.ndarray:
    """The target's own greedy decoding: prefill ``prompt``, then one token at a time.

    Returns the ``n_generate`` generated tokens (the first is the greedy token
    after the prompt). Resets ``target``.
    """
    target.reset()
    out = np.empty(n_generate, dtype=np.int64)
    if n_generate == 0:
        return out
    last = int(target.decode(prompt).next_tokens[-1])
    out[0] = last
    for i in range(1, n_generate):
        last = int(target.decode([last]).next_tokens[0])
        out[i] = last
    return out


# ----------------------------------------------------------------------------
# drafter


def rope_angles(positions: np.ndarray, half: int, base: float = 10000.0) -> np.ndarray:
    """RoPE's rotation angles ``p * base**(-i / half)``, ``(n, half)`` float64."""
    theta = base ** (-np.arange(half, dtype=np.float64) / half)
    return np.asarray(positions, dtype=np.float64).reshape(-1)[:, None] * theta[None, :]


def rope(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Rotary embedding (NeoX half-split layout) of ``x`` ``(n, heads, head_dim)`` at ``positions``."""
    return rotate(x, cos_sin(rope_angles(positions, x.shape[-1] // 2, base), x.dtype))


def cos_sin(ang: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of angles ``(n, half)`` in ``dtype``, shaped ``(n, 1, half)`` for :func:`rotate`."""
    return np.cos(ang).astype(dtype)[:, None, :], np.sin(ang).astype(dtype)[:, None, :]


def rotate(x: np.ndarray, cs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Rotate ``x`` ``(n, heads, head_dim)`` by the angles whose :func:`cos_sin` is ``cs``
    (NeoX half-split pairs)."""
    half = x.shape[-1] // 2
    cos, sin = cs
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 ``x``: a counter-based hash (wraps mod 2**64 on purpose)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def untrained_angles(positions: np.ndarray, half: int, seed: int) -> np.ndarray:
    """Rotation angles of positions a drafter never trained on: uniform in ``[0, 2 pi)``,
    a pure function of ``(seed, position, frequency)`` (so a cached key and a recompute agree).
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1).astype(np.uint64)
    key = pos[:, None] * np.uint64(half) + np.arange(half, dtype=np.uint64)[None, :]
    h = _splitmix64(key ^ _splitmix64(np.full(1, seed & (2**64 - 1), dtype=np.uint64)))
    return (h >> np.uint64(11)).astype(np.float64) * (2.0 * np.pi / 2.0**53)


def trained_angles(positions: np.ndarray, half: int, n_ctx_train: int | None, seed: int) -> np.ndarray:
    """A toy drafter's rotation angles at ``positions``, ``(n, half)``: RoPE inside its trained
    range ``[0, n_ctx_train)`` (everywhere when ``None``), :func:`untrained_angles` past it."""
    ang = rope_angles(positions, half)
    if n_ctx_train is not None:
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        past = pos >= n_ctx_train
        if past.any():
            ang[past] = untrained_angles(pos[past], half, seed)
    return ang


class _KVCache:
    """One sequence's drafter cache: K (after RoPE) and V, ``(layers, heads, capacity, head_dim)``.

    Position ``p`` of the sequence lives at index ``p``; ``n`` is the cache end.
    """

    k: np.ndarray  # (layers, heads, capacity, head_dim), allocated by _alloc
    v: np.ndarray

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, dtype: np.dtype) -> None:
        self.shape = (n_layers, n_heads, head_dim)
        self.dtype = dtype
        self.n = 0
        self.peak = 0
        self._alloc(64)

    def _alloc(self, cap: int) -> None:
        L, H, hd = self.shape
        k = np.zeros((L, H, cap, hd), self.dtype)
        v = np.zeros((L, H, cap, hd), self.dtype)
        if hasattr(self, "k"):
            k[:, :, : self.n] = self.k[:, :, : self.n]
            v[:, :, : self.n] = self.v[:, :, : self.n]
        self.k, self.v = k, v

    def reserve(self, n: int) -> None:
        cap = self.k.shape[2]
        if n > cap:
            while cap < n:
                cap *= 2
            self._alloc(cap)


class ToyDrafter:
    """KV-injection block drafter with an incremental per-sequence KV cache.

    Args:
        vocab_size: output vocabulary (the target's); the mask token is ``vocab_size``.
        feature_dim: width ``D`` of a context (feature) row.
        block_size: ``B``, query rows per round.
        lookahead: the relative distance the planted head attends to (the target's ``lookahead``).
        n_layers, n_heads, head_dim: shape; ``n_heads * head_dim`` is the model width.
        dtype: compute dtype (float64 default, see the module docstring for tolerances).
        seed: seed of the random (non-planted) weights (and of the untrained positions' encoding).
        strict: assert that staged positions continue the cache contiguously and
            that the block sits right after the context (catches staging bugs).
        n_ctx_train: the trained range: the drafter's position encoding is defined
            on ``[0, n_ctx_train)`` only, as a trained drafter's is on the positions it
            was trained on. Inside it, RoPE (exactly relative); at a position ``>=
            n_ctx_train``, a seeded pseudo-random rotation, out of distribution, so the
            planted head no longer finds the row ``lookahead`` back and the drafts fall
            to chance (the toy's version of acceptance collapsing past the training
            length). ``None`` (default): RoPE everywhere, exactly relative.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        feature_dim: int = 128,
        block_size: int = 8,
        lookahead: int = 8,
        n_layers: int = 2,
        n_heads: int = 2,
        head_dim: int = 32,
        dtype: type = np.float64,
        seed: int = 0,
        strict: bool = True,
        n_ctx_train: int | None = None,
    ) -> None:
        if n_ctx_train is not None and n_ctx_train < 1:
            raise ValueError(f"n_ctx_train must be >= 1 or None, got {n_ctx_train}")
        if feature_dim < _CODE + 1:
            raise ValueError(f"feature_dim must be >= {_CODE + 1}, got {feature_dim}")
        if head_dim != _CODE or n_heads < 1 or n_layers < 1:
            raise ValueError(f"need head_dim == {_CODE}, n_heads >= 1, n_layers >= 1")
        self.vocab_size = vocab_size
        self.mask_token_id = vocab_size
        self.feature_dim = feature_dim
        self.block_size = block_size
        self.lookahead = lookahead
        self.n_layers, self.n_heads, self.head_dim = n_layers, n_heads, head_dim
        self.dtype = np.dtype(dtype)
        self.strict = strict
        self.seed = seed
        self.n_ctx_train = n_ctx_train
        dm = n_heads * head_dim
        self.d_model = dm
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xD2A7]))
        small = 0.05
        f = self.dtype

        def rnd(*shape: int) -> np.ndarray:
            return (small * rng.standard_normal(shape)).astype(f)

        # hidden layout: [0] bias (=1 for every token), [1, dm - 32) token features, [dm - 32, dm) plan readout
        emb = np.zeros((vocab_size + 1, dm), f)
        emb[:, 0] = 1.0
        emb[:, 1 : dm - _CODE] = rng.standard_normal((vocab_size + 1, dm - _CODE - 1))
        self.tok_emb = emb
        self.wq = [rnd(dm, dm) for _ in range(n_layers)]
        self.wk_ctx = [rnd(feature_dim, dm) for _ in range(n_layers)]
        self.wv_ctx = [rnd(feature_dim, dm) for _ in range(n_layers)]
        self.wk_blk = [rnd(dm, dm) for _ in range(n_layers)]
        self.wv_blk = [rnd(dm, dm) for _ in range(n_layers)]
        self.wo = [rnd(dm, dm) for _ in range(n_layers)]
        # planted head (layer 0, head 0): peak at relative distance `lookahead`, read the plan code
        half = head_dim // 2
        theta = 10000.0 ** (-np.arange(half) / half)
        amp = 150.0
        self.wq[0][:, :head_dim] = 0.0
        self.wq[0][0, :half] = amp * np.cos(-theta * lookahead)
        self.wq[0][0, half:head_dim] = amp * np.sin(-theta * lookahead)
        self.wk_ctx[0][:, :head_dim] = 0.0
        self.wk_ctx[0][_CODE, :half] = 1.0  # the presence feature
        self.wk_blk[0][:, :head_dim] = 0.0
        self.wv_ctx[0][:, :head_dim] = 0.0
        self.wv_ctx[0][:_CODE, :head_dim] = np.eye(_CODE)
        self.wo[0][:head_dim, :] = 0.0
        self.wo[0][:head_dim, dm - _CODE :] = 4.0 * np.eye(_CODE)
        # output head: random small + the plan readout (the target's code, which the drafter "learned")
        self.w_out = rnd(dm, vocab_size)
        self.w_out[dm - _CODE :, :] = 0.0
        self._caches: dict[int, _KVCache] = {}

    def learn_code(self, code: np.ndarray) -> "ToyDrafter":
        """Install the target's plan code in the output head (the "training" of this toy)."""
        code = np.asarray(code, dtype=self.dtype)
        if code.shape != (self.vocab_size, _CODE):
            raise ValueError(f"code must have shape ({self.vocab_size}, {_CODE}), got {code.shape}")
        self.w_out[self.d_model - _CODE :, :] = 8.0 * code.T
        return self

    @classmethod
    def for_target(cls, target: ToyTarget, block_size: int, **kw: object) -> "ToyDrafter":
        """A drafter matched to ``target`` (same vocabulary, width, lookahead and plan code)."""
        d = cls(
            vocab_size=target.vocab_size, feature_dim=target.feature_dim, block_size=block_size,
            lookahead=target.lookahead, **kw,  # type: ignore[arg-type]
        )
        return d.learn_code(target.code)

    # -- cache ------------------------------------------------------------------
    def _cache(self, seq: int) -> _KVCache:
        c = self._caches.get(seq)
        if c is None:
            c = self._caches[seq] = _KVCache(self.n_layers, self.n_heads, self.head_dim, self.dtype)
        return c

    def clear(self, seq: int) -> None:
        """Remove every cached row of ``seq``."""
        self._cache(seq).n = 0

    def crop(self, seq: int, from_pos: int) -> None:
        """Remove cached positions ``>= from_pos``."""
        c = self._cache(seq)
        c.n = min(c.n, max(0, int(from_pos)))

    def cache_len(self, seq: int) -> int:
        """Cached positions of ``seq`` (they are always ``[0, cache_len)``)."""
        return self._cache(seq).n

    def peak_cache_len(self, seq: int | None = None) -> int:
        """Largest number of KV rows ``seq`` (or any sequence) ever held, block rows included."""
        if seq is not None:
            return self._cache(seq).peak
        return max((c.peak for c in self._caches.values()), default=0)

    # -- math -------------------------------------------------------------------
    def position_angles(self, positions: np.ndarray) -> np.ndarray:
        """The drafter's rotation angles at ``positions``, ``(n, head_dim // 2)``: RoPE inside
        the trained range ``[0, n_ctx_train)``, :func:`untrained_angles` past it."""
        return trained_angles(positions, self.head_dim // 2, self.n_ctx_train, self.seed)

    def _cs(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return cos_sin(self.position_angles(positions), self.dtype)

    def _ctx_kv(self, rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K (after RoPE at ``positions``) and V of context rows, all layers: ``(L, H, n, hd)`` each."""
        n = len(rows)
        L, H, hd = self.n_layers, self.n_heads, self.head_dim
        w = np.concatenate([np.concatenate(self.wk_ctx, axis=1), np.concatenate(self.wv_ctx, axis=1)], axis=1)
        kv = (rows @ w).reshape(n, 2, L, H, hd)
        k = rotate(kv[:, 0].reshape(n, L * H, hd), self._cs(positions)).reshape(n, L, H, hd)
        return k.transpose(1, 2, 0, 3), kv[:, 1].transpose(1, 2, 0, 3)

    def _block_qkv(
        self, layer: int, h: np.ndarray, bcs: tuple[np.ndarray, np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Block queries, keys (rotated to the block positions, whose :func:`cos_sin` is ``bcs``)
        and values of one layer, ``(H, B, hd)`` each."""
        shp = (len(h), self.n_heads, self.head_dim)
        q = rotate((h @ self.wq[layer]).reshape(shp), bcs).transpose(1, 0, 2)
        kb = rotate((h @ self.wk_blk[layer]).reshape(shp), bcs).transpose(1, 0, 2)
        vb = (h @ self.wv_blk[layer]).reshape(shp).transpose(1, 0, 2)
        return q, kb, vb

    def _attend(self, layer: int, h: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Non-causal attention of the block over ``k``/``v`` ``(H, n, hd)`` (context + block); new ``h``."""
        o = np.empty((len(h), self.n_heads, self.head_dim), dtype=h.dtype)
        scale = 1.0 / np.sqrt(self.head_dim)
        for hh in range(self.n_heads):  # 2-D products per head: numpy's batched matmul is slow on strided views
            # Scale q, not the (B, n) scores, and normalise the (B, hd) output, not the
            # weights: two passes fewer over (B, n) when n is a whole 24k-token prompt.
            s = (q[hh] * scale) @ k[hh].T  # (B, n)
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            o[:, hh] = (s @ v[hh]) / s.sum(axis=-1, keepdims=True)
        return h + o.reshape(len(h), self.d_model) @ self.wo[layer]

    def _check_block(self, block_tokens: Tokens, block_positions: np.ndarray) -> np.ndarray:
        toks = np.asarray(block_tokens, dtype=np.int64).reshape(-1)
        if len(toks) != len(block_positions):
            raise ValueError(f"{len(toks)} block tokens for {len(block_positions)} block positions")
        if len(toks) and (toks.min() < 0 or toks.max() > self.vocab_size):
            raise ValueError("block token out of range")
        return toks

    def decode(
        self,
        seq: int,
        positions: np.ndarray,
        rows: np.ndarray,
        block_tokens: Tokens,
        block_positions: np.ndarray,
    ) -> np.ndarray:
        """Append context ``rows`` at drafter ``positions``, then run the block.

        The block's K/V are appended to the cache too (as a real drafter's
        batch would leave them); the caller must ``crop`` them away.

        Returns:
            logits ``(B, vocab_size)``: block row ``k`` predicts the token at
            block position ``k + 1`` (row 0 holds the last accepted token).
        """
        c = self._cache(seq)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        bpos = np.asarray(block_positions, dtype=np.int64).reshape(-1)
        x = np.asarray(rows).astype(self.dtype, copy=False).reshape(len(pos), self.feature_dim)
        toks = self._check_block(block_tokens, bpos)
        if self.strict:
            if len(pos) and not np.array_equal(pos, np.arange(c.n, c.n + len(pos))):
                raise AssertionError(
                    f"seq {seq}: staged positions [{pos[0]}..{pos[-1]}] do not continue the cache end {c.n}"
                )
            n_ctx = c.n + len(pos)
            if not np.array_equal(bpos, np.arange(n_ctx, n_ctx + len(bpos))):
                raise AssertionError(f"seq {seq}: block positions {bpos.tolist()} do not follow the context end {n_ctx}")
        c.reserve(c.n + len(pos) + len(bpos))
        lo = c.n
        hi = lo + len(pos)
        k, v = self._ctx_kv(x, pos)
        c.k[:, :, lo:hi] = k
        c.v[:, :, lo:hi] = v
        end = hi + len(bpos)
        c.n = end
        h = self.tok_emb[toks]
        bcs = self._cs(bpos)
        for layer in range(self.n_layers):
            q, kb, vb = self._block_qkv(layer, h, bcs)
            c.k[layer, :, hi:end] = kb
            c.v[layer, :, hi:end] = vb
            h = self._attend(layer, h, q, c.k[layer, :, :end], c.v[layer, :, :end])
        c.peak = max(c.peak, c.n)
        return h @ self.w_out

    def recompute(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        block_tokens: Tokens,
        block_positions: np.ndarray,
    ) -> np.ndarray:
        """The block logits from scratch over context ``rows`` at ``positions`` (no cache)."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        bpos = np.asarray(block_positions, dtype=np.int64).reshape(-1)
        x = np.asarray(rows).astype(self.dtype, copy=False).reshape(len(pos), self.feature_dim)
        toks = self._check_block(block_tokens, bpos)
        h = self.tok_emb[toks]
        k, v = self._ctx_kv(x, pos)
        bcs = self._cs(bpos)
        for layer in range(self.n_layers):
            q, kb, vb = self._block_qkv(layer, h, bcs)
            h = self._attend(
                layer, h, q, np.concatenate([k[layer], kb], axis=1), np.concatenate([v[layer], vb], axis=1)
            )
        return h @ self.w_out


class FlakyDrafter:
    """A drafter wrapper that fails on purpose, to exercise the Stager's recovery.

    Args:
        inner: the wrapped drafter (a block drafter, or a chain drafter: ``decode_chain``).
        every: fail every ``every``-th drafter round (``None``: never on schedule).
        probability: additionally fail each round with this probability.
        stage: ``"decode"``, ``"crop"`` or ``"mixed"`` (alternate).
        seed: seed of the probability draws.

    A decode failure first runs the inner decode (so the cache is left holding a
    half-finished round, as a real failure might) and then raises; a crop
    failure raises before cropping, leaving the block rows in the cache. The
    loop must report both with ``Stager.fail`` and the next round must clear.
    """

    def __init__(
        self,
        inner: Any,
        every: int | None = None,
        probability: float = 0.0,
        stage: str = "mixed",
        seed: int = 0,
    ) -> None:
        if stage not in ("decode", "crop", "mixed"):
            raise ValueError(f"stage must be 'decode', 'crop' or 'mixed', got {stage!r}")
        self.inner = inner
        self.every = every
        self.probability = probability
        self.stage = stage
        self._rng = np.random.default_rng(seed)
        self._round = 0
        self._n_failed = 0
        self._pending_crop_failure: set[int] = set()
        self.failures: list[tuple[int, int, str]] = []  # (round, seq, stage)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _fails_now(self) -> str | None:
        self._round += 1
        hit = self.every is not None and self._round % self.every == 0
        if self.probability > 0 and self._rng.random() < self.probability:
            hit = True
        if not hit:
            return None
        self._n_failed += 1
        if self.stage == "mixed":
            return "decode" if self._n_failed % 2 else "crop"
        return self.stage

    def clear(self, seq: int) -> None:
        self.inner.clear(seq)

    def decode(
        self, seq: int, positions: np.ndarray, rows: np.ndarray, block_tokens: Tokens, block_positions: np.ndarray
    ) -> np.ndarray:
        return self._round_of(seq, lambda: self.inner.decode(seq, positions, rows, block_tokens, block_positions))

    def decode_chain(
        self, seq: int, positions: np.ndarray, rows: np.ndarray, successors: Tokens, draft_positions: np.ndarray
    ) -> np.ndarray:
        """A chain drafter's round (:class:`~dspark_core.sim.toy_chain.ToyChainDrafter`), failing as ``decode``."""
        inner: Any = self.inner
        return self._round_of(seq, lambda: inner.decode_chain(seq, positions, rows, successors, draft_positions))

    def _round_of(self, seq: int, run: Callable[[], np.ndarray]) -> np.ndarray:
        """Run the inner decode, then fail it (decode) or arm the crop's failure, on schedule."""
        stage = self._fails_now()
        out = run()
        if stage == "decode":
            self.failures.append((self._round, seq, "decode"))
            raise DrafterFailure("decode")
        if stage == "crop":
            self._pending_crop_failure.add(seq)
        return out

    def crop(self, seq: int, from_pos: int) -> None:
        if seq in self._pending_crop_failure:
            self._pending_crop_failure.discard(seq)
            self.failures.append((self._round, seq, "crop"))
            raise DrafterFailure("crop")
        self.inner.crop(seq, from_pos)
