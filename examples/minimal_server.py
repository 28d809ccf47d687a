#!/usr/bin/env python3
"""A minimal speculative-decoding server loop over ``dspark_core.Stager``.

No model files: a small fake target and a fake drafter stand in for the real ones, so the loop
runs anywhere in a second. It follows docs/protocol.md call for call:

* prefill: ``begin``, then ``process`` after every target decode of the prompt;
* each round: ``draft`` -> (``clear_cache``) decode the plan's rows + the block -> crop ->
  ``commit`` (or ``fail``); a verify batch of the ``B + 1`` tokens ``[last, d_1 .. d_B]``
  -> ``process`` its ``B + 1`` rows -> ``accept(n)`` -> the target rolls back its rejected
  positions; a skipped plan or a failed round decodes ``last`` alone;
* an edit of the conversation: the target rolls back, ``rollback`` follows it, the new tokens
  are prefilled and generation goes on.

The Stager runs with ``strict=True``, so a call out of protocol (say, a forgotten ``accept``)
raises instead of quietly skipping rounds.

The fake target is a deterministic greedy "model" whose feature rows look like real hidden
states: a token embedding on N(0, 1) noise, a few massive channels (2e3 to 6e4) and a huge-norm
row at position 0. The fake drafter reads the previous token back from the rows it was given and
drafts with a rule that is right most of the time, so acceptance is high but not 100%. It checks
that its cache holds exactly drafter positions ``[0, crop_from)`` and never sees a position
``>= W``; the loop checks every staged row against the row the target produced at that absolute
position, and at the end that the output equals the target's own greedy decoding (lossless).

    python examples/minimal_server.py                  # bf16 storage
    python examples/minimal_server.py --storage q4_0   # any of f32 f16 bf16 q8_0 q4_0

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from dspark_core import Stager, StagerConfig

VOCAB = 97
MASK = VOCAB  # the drafter's mask token (outside the target's vocabulary)
D = 256  # feature row width (n_capture * n_embd of a real target)
BLOCK = 4  # B: draft tokens per round
WINDOW = 64  # W: the drafter runs at positions [0, W) only
PREFILL_CHUNK = 128  # prompt tokens per target decode (the server's n_batch)
MAX_POSITIONS = 4096
#: Positions the edit rolls back: at most W - K, so the restage after it still gets a full
#: K-row context (docs/design.md section 8).
EDIT_ROLLBACK = 20
#: (channel, value): the few "massive activation" channels of every row
MASSIVE = ((7, 2.0e3), (100, -3.1e4), (201, 6.0e4))


def next_token(prev: int, cur: int) -> int:
    """The target's greedy choice after ``cur`` (preceded by ``prev``)."""
    return (31 * cur + 7 * prev + 11) % VOCAB


def greedy(tokens: list[int], n: int) -> list[int]:
    """Plain greedy decoding: the ``n`` tokens the target produces after ``tokens``."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(next_token(seq[-2] if len(seq) > 1 else 0, seq[-1]))
    return seq[len(tokens):]


@dataclass
class TargetOutput:
    next_tokens: list[int]  # greedy next token after each decoded position
    rows: np.ndarray  # (n, D) float32 captured feature rows


class FakeTarget:
    """The target model of one sequence: a KV cache of tokens and a greedy rule."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.embedding = rng.standard_normal((VOCAB, D)).astype(np.float32)
        self.noise = (0.05 * rng.standard_normal((MAX_POSITIONS, D))).astype(np.float32)
        self.tokens: list[int] = []

    def row(self, position: int, token: int) -> np.ndarray:
        r = self.embedding[token] + self.noise[position]
        if position == 0:
            r = r * 100.0  # the first position's hidden state has a huge norm
        for channel, value in MASSIVE:
            r[channel] = value * (1.0 + 0.01 * np.sin(position))
        return r

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        return np.stack([self.row(int(p), self.tokens[int(p)]) for p in positions])

    def decode(self, tokens: list[int]) -> TargetOutput:
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in tokens)
        positions = np.arange(start, len(self.tokens))
        nxt = [next_token(self.tokens[p - 1] if p else 0, self.tokens[p]) for p in positions]
        return TargetOutput(nxt, self.rows_at(positions))

    def rollback(self, n_past: int) -> None:
        del self.tokens[n_past:]


class DrafterError(RuntimeError):
    def __init__(self, stage: str) -> None:
        super().__init__(f"injected drafter {stage} failure")
        self.stage = stage


class FakeDrafter:
    """A block drafter with a KV cache addressed by drafter position."""

    def __init__(self, embedding: np.ndarray, fail_every: int) -> None:
        # Read tokens back from rows by cosine similarity, on the 32-channel blocks that hold no
        # massive channel (a q4_0 / q8_0 block flattens the small values next to a massive one).
        massive_blocks = {c // 32 for c, _ in MASSIVE}
        self.clean = np.array([c for c in range(D) if c // 32 not in massive_blocks])
        e = embedding[:, self.clean]
        self.unit = e / np.linalg.norm(e, axis=1, keepdims=True)
        self.cache: dict[int, np.ndarray] = {}
        self.fail_every = fail_every
        self.decodes = 0
        self.max_position = -1

    def remove(self, from_pos: int = 0) -> None:
        for p in [p for p in self.cache if p >= from_pos]:
            del self.cache[p]

    def token_of(self, row: np.ndarray) -> int:
        return int(np.argmax(self.unit @ row[self.clean].astype(np.float32)))

    def draft_rule(self, prev: int, cur: int) -> int:
        guess = next_token(prev, cur)
        return (guess + 1) % VOCAB if cur % 5 == 0 else guess  # wrong for one token in five

    def decode(self, rows: np.ndarray, positions: np.ndarray, block: list[int],
               block_positions: np.ndarray) -> list[int]:
        self.decodes += 1
        if self.fail_every and self.decodes % self.fail_every == 0:
            raise DrafterError("decode")
        top = int(block_positions[-1])
        if top >= WINDOW or (len(positions) and int(positions.min()) < 0):
            raise AssertionError(f"drafter position {top} outside [0, {WINDOW})")
        self.max_position = max(self.max_position, top)
        for p, r in zip(positions.tolist(), rows):
            self.cache[p] = r
        first = int(block_positions[0])
        if sorted(self.cache) != list(range(first)):
            raise AssertionError(f"drafter cache holds {sorted(self.cache)[:8]}..., expected [0, {first})")
        prev = self.token_of(self.cache[first - 1]) if first else 0
        drafts, cur = [], block[0]
        for _ in range(BLOCK):  # a real block drafter predicts the block in one pass
            prev, cur = cur, self.draft_rule(prev, cur)
            drafts.append(cur)
        return drafts


@dataclass
class Counters:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    failures: int = 0
    skips: int = 0
    max_rel_err: float = 0.0
    first_restage_rows: int = -1


class Server:
    """One slot of a speculative-decoding server."""

    def __init__(self, storage: str, fail_every: int, seq: int = 0, zero_copy: bool = False) -> None:
        # strict: a call out of protocol raises instead of skipping (docs/protocol.md section 3)
        self.cfg = StagerConfig(feature_dim=D, block_size=BLOCK, window=WINDOW, storage=storage, strict=True)
        self.stager = Stager(self.cfg)
        self.target = FakeTarget()
        self.drafter = FakeDrafter(self.target.embedding, fail_every)
        self.seq = seq
        # zero_copy: plans hand the drafter views of the Stager's ring instead of a copy; they
        # are read (check_rows, the drafter's decode) before the verify batch's process.
        self.copy = not zero_copy
        self.c = Counters()
        self.n_past = 0
        self.last = -1

    def prefill(self, tokens: list[int], begin: bool) -> None:
        st, seq = self.stager, self.seq
        if begin:
            st.begin(seq)
        for lo in range(0, len(tokens), PREFILL_CHUNK):
            out = self.target.decode(tokens[lo:lo + PREFILL_CHUNK])
            st.process(seq, np.arange(self.n_past, self.n_past + len(out.rows)), out.rows)
            self.n_past += len(out.rows)
        self.last = out.next_tokens[-1]

    def check_rows(self, plan) -> None:
        """Every staged row is the target's row at that absolute position."""
        if plan.n_rows == 0:
            return
        want = self.target.rows_at(plan.pos_base + plan.positions)
        err = np.abs(np.asarray(plan.rows, np.float32) - want) / np.maximum(np.abs(want), 1e-30)
        self.c.max_rel_err = max(self.c.max_rel_err, float(err.max()))

    def drafter_round(self, plan) -> list[int] | None:
        st, seq, d = self.stager, self.seq, self.drafter
        self.c.rounds += 1
        self.check_rows(plan)
        try:
            if plan.clear_cache:
                d.remove()
            drafts = d.decode(plan.rows, plan.positions, [self.last] + [MASK] * (BLOCK - 1),
                              plan.block_positions)
            d.remove(plan.crop_from)
        except DrafterError as e:
            st.fail(seq, e.stage)
            self.c.failures += 1
            return None
        st.commit(seq)
        return drafts

    def step(self) -> list[int]:
        """One round; returns the tokens it produced."""
        st, seq = self.stager, self.seq
        plan = st.draft(seq, self.n_past, copy=self.copy)
        drafts = None
        if plan.skip is None:
            if plan.rebase and self.c.first_restage_rows < 0:
                self.c.first_restage_rows = plan.n_rows
            drafts = self.drafter_round(plan)
        else:
            self.c.skips += 1
        if drafts is None:  # no drafts this round: decode `last` alone
            out = self.target.decode([self.last])
            st.process(seq, [self.n_past], out.rows)
            self.n_past += 1
            self.last = out.next_tokens[0]
            return [self.last]
        # the verify batch: [last, d_1 .. d_B] at positions n_past .. n_past + B
        out = self.target.decode([self.last, *drafts])
        st.process(seq, np.arange(self.n_past, self.n_past + BLOCK + 1), out.rows)
        n = 0
        while n < BLOCK and drafts[n] == out.next_tokens[n]:
            n += 1
        st.accept(seq, n)  # keeps the rows of last, d_1 .. d_n
        self.target.rollback(self.n_past + n + 1)  # the target drops the rejected positions
        self.c.drafted += BLOCK
        self.c.accepted += n
        self.n_past += n + 1
        self.last = out.next_tokens[n]
        return drafts[:n] + [self.last]

    def generate(self, n: int) -> list[int]:
        out = [self.last]
        while len(out) < n:
            out += self.step()
        return out[:n]

    def rollback(self, n_past: int) -> None:
        self.target.rollback(n_past)
        self.stager.rollback(self.seq, n_past)
        self.n_past = n_past
        self.c.first_restage_rows = -1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", default="bf16", choices=("f32", "f16", "bf16", "q8_0", "q4_0"))
    ap.add_argument("--prompt", type=int, default=300, help="prompt tokens (default 300)")
    ap.add_argument("--generate", type=int, default=300, help="tokens generated per request (default 300)")
    ap.add_argument("--fail-every", type=int, default=10, help="fail every N-th drafter decode (0: never)")
    ap.add_argument("--zero-copy", action="store_true",
                    help="draft with copy=False: the drafter reads the staged rows in the Stager's ring")
    a = ap.parse_args(argv)

    srv = Server(a.storage, a.fail_every, zero_copy=a.zero_copy)
    cfg = srv.cfg
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(0, VOCAB, a.prompt)]
    print(f"minimal_server: storage={cfg.storage} D={D} B={BLOCK} W={WINDOW} (K={cfg.w_keep}), "
          f"prompt {len(prompt)} tokens, {'zero-copy' if a.zero_copy else 'copied'} staged rows")

    # Request: prefill, then generate.
    srv.prefill(prompt, begin=True)
    first = srv.generate(a.generate)
    ok = first == greedy(prompt, a.generate)
    c = srv.c
    stats = srv.stager.stats(srv.seq)
    print(f"request: {a.generate} tokens in {c.rounds} drafter rounds, acceptance "
          f"{100 * c.accepted / max(1, c.drafted):.1f}%, {stats['rebases']} rebases, "
          f"{c.failures} drafter failures recovered, {c.skips} skips")

    # Edit: the user rewrites the last positions; target and Stager roll back together.
    history = prompt + first
    cut = srv.n_past - EDIT_ROLLBACK
    edit = [int(t) for t in rng.integers(0, VOCAB, 6)]
    srv.rollback(cut)
    srv.prefill(edit, begin=False)
    second = srv.generate(a.generate)
    ok = ok and second == greedy(history[:cut] + edit, a.generate)
    print(f"edit: rolled back {EDIT_ROLLBACK} positions, prefilled {len(edit)} new tokens, generated "
          f"{a.generate} more; first restage after it: {c.first_restage_rows} rows (K = {cfg.w_keep})")

    stats = srv.stager.stats(srv.seq)
    bound = cfg.ring_rows
    within = srv.drafter.max_position < WINDOW and stats["peak_rows"] <= bound
    print(f"largest drafter position: {srv.drafter.max_position} (W = {WINDOW})")
    print(f"peak rows held: {stats['peak_rows']} (bound W + 512 + B + 1 = {bound})")
    print(f"staged rows vs the target's rows: max relative error {c.max_rel_err:.3g}")
    print(f"lossless: {'yes' if ok else 'NO'} ({2 * a.generate} generated tokens "
          f"{'equal' if ok else 'differ from'} the target's own greedy decoding)")
    return 0 if ok and within else 1


if __name__ == "__main__":
    sys.exit(main())
