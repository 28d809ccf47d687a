#!/usr/bin/env python3
"""Prefix-store blocks in Redis: a second process hits on the rows a first one published.

A server whose KV blocks live in a shared cache (LMCache, Mooncake, Redis) keeps the drafter's
rows next to them: each published block goes out as the bytes ``PrefixStore.export_block``
writes (a versioned, CRC-32C checksummed block: ``dspark_core.prefix.block_format``), under a
Redis key made of the block's own key, and any process whose store has the same configuration
imports it. Two commands, run as two processes:

    python examples/prefix_redis.py --port 6379 publish   # prefill a prompt, publish its blocks to Redis
    python examples/prefix_redis.py --port 6379 hit       # a fresh process: fetch what a hit needs, hit

``hit`` asks its (empty) store which rows a hit at ``h`` needs (``lookup``: the last ``K`` rows,
or all of them for a prompt of at most ``W - B`` tokens), fetches only those blocks from Redis,
imports them (a damaged block is refused and counts as a miss), starts its sequence from the
hit, prefills from ``replay_from`` (``h`` unless a block was missing) and checks that its first
round stages exactly what a full prefill of the whole prompt stages (plan and row bytes); it
prints one JSON line.

No Redis client library is needed: a 40-line RESP client (the Redis protocol) below is enough
for SET / GET / EXISTS / PING. Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys

import numpy as np

from dspark_core import PrefixStore, Stager, StagerConfig

D, B, W, BLOCK_TOKENS = 256, 4, 128, 16
PROMPT, NEW = 300, 7  # the cached prompt, and the new tokens of the request that hits it
CONFIG = StagerConfig(D, B, W, max_seqs=2, storage="q8_0")
BUDGET = 8 << 20


class Redis:
    """A minimal RESP2 client: commands as arrays of bulk strings, replies parsed by their type byte."""

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=10)
        self.buf = b""

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(max(65536, n + 2 - len(self.buf)))
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def _reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(f"Redis error: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected Redis reply {line!r}")

    def call(self, *args: bytes | str):
        parts = [a.encode() if isinstance(a, str) else a for a in args]
        self.sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        return self._reply()


def prompt_tokens(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 32000, n)


def rows_for(n: int) -> np.ndarray:
    """The target's capture rows of the prompt (a fixed function of the prompt here)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((n, D)).astype(np.float32)
    x[:, [3, 100]] *= np.float32(2e3)
    x[0] *= np.float32(20.0)
    return x


def chain(tokens: np.ndarray, n: int) -> list[bytes]:
    """The server's chained block hashes of tokens[:n] (vLLM-style; the last block may be partial)."""
    keys, prev = [], b""
    for s in range(0, n, BLOCK_TOKENS):
        prev = hashlib.sha256(prev + tokens[s:min(s + BLOCK_TOKENS, n)].astype("<i8").tobytes()).digest()
        keys.append(prev)
    return keys


def redis_key(key: bytes) -> bytes:
    return b"dspark:prefix:" + key.hex().encode()


def publish(r: Redis) -> dict:
    st = Stager(CONFIG)
    store = PrefixStore(CONFIG, BLOCK_TOKENS, BUDGET)
    tokens, rows = prompt_tokens(PROMPT), rows_for(PROMPT)
    keys = chain(tokens, PROMPT)
    st.begin(0)
    sent = 0
    for at in range(0, PROMPT, 48):  # prefill chunks; publish each block as it completes
        hi = min(PROMPT, at + 48)
        st.process(0, np.arange(at, hi), rows[at:hi])
        lo_b, hi_b = at // BLOCK_TOKENS * BLOCK_TOKENS, (hi if hi == PROMPT else hi // BLOCK_TOKENS * BLOCK_TOKENS)
        if hi_b > lo_b:
            new = keys[lo_b // BLOCK_TOKENS: -(-hi_b // BLOCK_TOKENS)]
            store.publish(st, 0, new, lo_b, hi_b)
            for k in new:  # next to the KV block: the same key
                r.call("SET", redis_key(k), store.export_block(k))
                sent += 1
    return {"published_blocks": sent, "store_bytes": store.stats()["bytes"]}


def hit(r: Redis) -> dict:
    st = Stager(CONFIG)
    store = PrefixStore(CONFIG, BLOCK_TOKENS, BUDGET)
    tokens = np.concatenate([prompt_tokens(PROMPT), np.arange(NEW)])
    rows = np.concatenate([rows_for(PROMPT), rows_for(PROMPT + NEW)[PROMPT:]])
    h = PROMPT  # the server's KV cache holds the prompt: the request computes NEW tokens
    keys = chain(tokens, h)
    need = store.lookup(keys, h).need_first  # which rows a hit at h needs
    fetched = damaged = 0
    for i in range(need // BLOCK_TOKENS, len(keys)):
        data = r.call("GET", redis_key(keys[i]))
        if data is None:
            continue
        try:
            store.import_block(data)  # checksummed: a damaged block is refused, nothing changes
            fetched += 1
        except ValueError:
            damaged += 1  # a miss: the hit replays from there (at most K tokens)
    result = store.hit(st, 0, keys, h)
    st.process(0, np.arange(result.replay_from, h + NEW), rows[result.replay_from:h + NEW])
    plan = st.draft(0, h + NEW)
    full = Stager(CONFIG)  # what a full prefill of the whole prompt stages
    full.begin(0)
    full.process(0, np.arange(h + NEW), rows[:h + NEW])
    want = full.draft(0, h + NEW)
    same = (plan.pos_base == want.pos_base and np.array_equal(plan.positions, want.positions)
            and plan.encoded_rows.tobytes() == want.encoded_rows.tobytes())
    return {"fetched_blocks": fetched, "damaged_blocks": damaged, "of_blocks": len(keys), "rows": result.rows,
            "replay_from": result.replay_from,
            "n_tokens": h, "first_round_rows": int(plan.n_rows), "same_as_full_prefill": bool(same)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("publish", "hit"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=6379)
    args = p.parse_args(argv)
    r = Redis(args.host, args.port)
    assert r.call("PING") == "PONG"
    out = publish(r) if args.command == "publish" else hit(r)
    print(json.dumps(out))
    return 0 if args.command == "publish" or out["same_as_full_prefill"] else 1


if __name__ == "__main__":
    sys.exit(main())
