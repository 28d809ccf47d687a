"""Prefix store: every rejected call, core and reference side by side.

Each bad call runs on the C++ core and on the reference twin (held and
external rows): the same exception type and the same message (each side
spells its messages out on its own), in the order of docs/prefix_cache.md
"Calls" (the sequence first, then the conversions, then the values), and
nothing changes: not the store's keys, counters or table, not the Stager's
state.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import massive_rows

from dspark_core import ConfigError, PrefixStore, StateError, Stager, StagerConfig
from dspark_core.prefix import block_format as prefix_block_format
from dspark_core.reference import ReferencePrefixStore, ReferenceStager

D, B, W, BT = 64, 4, 64, 8
CFG = StagerConfig(D, B, W, max_seqs=4)
ROWS = np.clip(massive_rows(np.random.default_rng(5), 200, D, peak=3e4), -6e4, 6e4)
KEYS = [1000 + i for i in range(25)]  # block i of the prompt: [8 i, 8 i + 8)


def setup(Stg, Store, rows: str = "held"):
    """A store holding blocks of [0, 40) from sequence 0; sequence 1 has an open round, sequence
    2 holds rows [0, 120) (the first ones gone from its window), sequence 3 nothing."""
    cfg = CFG.replace(rows=rows)
    st, store = Stg(cfg), Store(cfg, BT, 1 << 22)
    ext = rows == "external"

    def feed(seq, lo, hi):
        st.process(seq, np.arange(lo, hi), None if ext else ROWS[lo:hi])

    feed(0, 0, 40)
    store.publish(st, 0, KEYS[:5], 0, 40)
    feed(1, 0, 10)
    st.draft(1, 10)
    feed(2, 0, 120)
    return st, store


def seen(st, store):
    """Everything observable a rejected call must leave alone."""
    return ([st.state(s) for s in range(4)], store.keys(), store.stats(), st.moves_issued,
            [store.block_slots(k).tolist() for k in store.keys()])


def block_of(**changes) -> bytes:
    """An exported block of [8, 16), from a store of CFG with ``changes``."""
    store = PrefixStore(CFG.replace(**changes), BT, 1 << 22)
    store.publish_rows([KEYS[1]], 8, 16, ROWS[8:16])
    return store.export_block(KEYS[1])


def with_value(rows: np.ndarray, row: int, channel: int, value: float) -> np.ndarray:
    out = rows.copy()
    out[row, channel] = value
    return out


def damaged(which: str) -> bytes:
    """A block of KEYS[1] with one field broken (checksums refreshed where the check is behind them)."""
    store = PrefixStore(CFG, BT, 1 << 22)
    store.publish_rows([KEYS[1]], 8, 16, ROWS[8:16])
    good = bytearray(store.export_block(KEYS[1]))
    edits = {
        "short": lambda b: b[:40],
        "magic": lambda b: b"X" + b[1:],
        "version": lambda b: b[:4] + b"\x02\x00" + b[6:],
        "header size": lambda b: b[:6] + b"\x41\x00" + b[8:],
        "header crc": lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],
        "fingerprint": lambda b: b[:8] + (128).to_bytes(4, "little") + b[12:],
        "unknown code": lambda b: b[:12] + b"\x09" + b[13:],
        "block tokens": lambda b: b[:28] + (16).to_bytes(4, "little") + b[32:],
        "reserved": lambda b: b[:52] + b"\x01" + b[53:],
        "rows field": lambda b: b[:48] + (7).to_bytes(4, "little") + b[52:],
        "unaligned": lambda b: b[:32] + (9).to_bytes(8, "little") + (17).to_bytes(8, "little") + b[48:],
        "length": lambda b: b + b"\0",
        "body crc": lambda b: b[:-1] + bytes([b[-1] ^ 1]),
    }
    out = bytearray(edits[which](bytes(good)))
    if which not in ("short", "header crc", "body crc", "magic", "version", "header size"):
        prefix_block_format.refresh_checksums(out)
    return bytes(out)


# (name, call(st, store), exception type, what the message says)
BAD = [
    # The sequence's own errors come first, whatever else is wrong.
    ("unknown seq first", lambda st, s: s.publish(st, 9, "not keys", "x", 5), ValueError, "unknown sequence 9"),
    ("open round first", lambda st, s: s.hit(st, 1, [1.5], -3), StateError, "open round"),
    ("seq of a bad kind", lambda st, s: s.hit(st, "0", KEYS[:1], 8), TypeError, "seq must be an integer"),
    # Then the conversions, in the order of the signature.
    ("keys of a bad kind", lambda st, s: s.publish(st, 0, "text", 0, 8), TypeError, "keys must be a sequence"),
    ("a key of a bad kind", lambda st, s: s.hit(st, 0, [1.5], 8), TypeError, "a key must be bytes or an int"),
    ("int key beyond 64 bits", lambda st, s: s.hit(st, 0, [2**64], 8), ValueError, r"\[-2\*\*63, 2\*\*64\)"),
    ("start of a bad kind", lambda st, s: s.publish(st, 0, KEYS[:1], 0.0, 8), TypeError, "start must be an integer"),
    ("n_tokens of a bad kind", lambda st, s: s.hit(st, 0, KEYS[:1], None), TypeError, "n_tokens must be an integer"),
    # Then the values: the store, the positions, the chain, the sequence's rows, the contents.
    ("other configuration", lambda st, s: s.publish(type(st)(CFG.replace(storage="q8_0", rows=st.config.rows)), 0,
                                                    KEYS[:1], -5, 8), ConfigError, "storage differ"),
    ("negative start", lambda st, s: s.publish(st, 0, KEYS[:1], -8, 0), ValueError, "0 <= start < end"),
    ("empty range", lambda st, s: s.publish(st, 0, [], 8, 8), ValueError, "0 <= start < end"),
    ("unaligned", lambda st, s: s.publish(st, 0, KEYS[:1], 4, 12), ValueError, "block boundary"),
    ("too few keys", lambda st, s: s.publish(st, 0, KEYS[:1], 0, 16), ValueError, "1 keys for positions"),
    ("empty key", lambda st, s: s.publish(st, 0, [b"", b"x"], 0, 16), ValueError, "key 0 has 0 bytes"),
    ("long key", lambda st, s: s.publish(st, 0, [b"x", b"y" * 65], 0, 16), ValueError, "key 1 has 65 bytes"),
    ("key twice", lambda st, s: s.publish(st, 0, [7, 7], 0, 16), ValueError, "appears twice"),
    ("key moved", lambda st, s: s.publish(st, 0, [KEYS[1]], 0, 8), ValueError, "must name the same block"),
    ("no rows", lambda st, s: s.publish(st, 3, [7], 0, 8), ValueError, "sequence 3 holds no rows"),
    ("not final", lambda st, s: s.publish(st, 0, [7, 8], 32, 48), ValueError, "reach past its final rows"),
    ("rows gone", lambda st, s: s.publish(st, 2, [7], 8, 16), ValueError, "are no longer held"),
    ("hit: n_tokens", lambda st, s: s.hit(st, 0, [], -1), ValueError, r"n_tokens must be in \[0, 2\*\*62\)"),
    ("hit: chain length", lambda st, s: s.hit(st, 0, KEYS[:4], 40), ValueError, "4 keys for a hit of 40 tokens"),
    ("hit: chain order", lambda st, s: s.hit(st, 0, KEYS[1:6], 40), ValueError, "does not match the positions"),
    ("lookup: chain", lambda st, s: s.lookup(KEYS[1:6], 40), ValueError, "does not match the positions"),
    ("lookup: huge", lambda st, s: s.lookup([1], 2**70), ValueError, "n_tokens must be in"),
    ("evict: bad key", lambda st, s: s.evict([b"x" * 65]), ValueError, "key 0 has 65 bytes"),
    ("info: not held", lambda st, s: s.info(b"\x01" * 20), ValueError, r"no block with key 0x(01){12}\.\.\."),
    ("block_slots: not held", lambda st, s: s.block_slots(5), ValueError, "no block with key 0x0500000000000000"),
    ("export: not held", lambda st, s: s.export_block(5, b""), ValueError, "no block with key"),
    ("export: rows of a bad kind", lambda st, s: s.export_block(KEYS[0], np.zeros(4, np.float32)), TypeError,
     "rows must be uint8"),
    ("import: not bytes", lambda st, s: s.import_block(12), TypeError, "block data must be bytes-like"),
    ("publish_rows: rows of a bad kind", lambda st, s: s.publish_rows([7], 40, 48, ROWS[40:48].astype(np.float64)),
     TypeError, "float32, float16 or bfloat16"),
]

HELD_ONLY = [
    ("other rows", lambda st, s: s.publish_rows(KEYS[:1], 0, 8, ROWS[:8] * 0.5), ValueError,
     r"the block at \[0, 8\) \(key 0xe803000000000000\) is already held with other rows"),
    ("publish_rows: count", lambda st, s: s.publish_rows([7], 40, 48, ROWS[40:47]), ValueError,
     "rows must be 8 x 64 float32 values for positions \\[40, 48\\), got 7 rows"),
    ("publish_rows: infinite", lambda st, s: s.publish_rows([7], 40, 48, with_value(ROWS[40:48], 2, 5, np.inf)),
     ValueError, r"row 2 \(position 42\), channel 5 holds inf, a non-finite value; nothing was published"),
    ("publish_slots needs external", lambda st, s: s.publish_slots([7], 40, 48), TypeError,
     "publish_slots needs an external-row store"),
    ("export: rows given", lambda st, s: s.export_block(KEYS[0], b""), ValueError, "exports its own rows"),
]

EXTERNAL_ONLY = [
    ("publish_rows needs held", lambda st, s: s.publish_rows([7], 40, 48, ROWS[40:48]), TypeError,
     "publish_rows needs a held-row store"),
    ("export: no rows", lambda st, s: s.export_block(KEYS[0]), ValueError, "got none"),
    ("export: short rows", lambda st, s: s.export_block(KEYS[0], b"\0" * 10), ValueError, "got 10 bytes"),
    # An absurd range is refused before anything is allocated for it.
    ("publish_slots: absurd range", lambda st, s: s.publish_slots([7], 0, 2**61), ValueError, "1 keys for positions"),
]

IMPORTS = ["short", "magic", "version", "header size", "header crc", "fingerprint", "unknown code", "block tokens",
           "reserved", "rows field", "unaligned", "length", "body crc"]


def _outcome(call, st, store):
    try:
        call(st, store)
    except Exception as exc:  # noqa: BLE001 - the type and message are compared
        return type(exc), str(exc)
    return None


CASES = ([("held", *c) for c in BAD + HELD_ONLY] + [("external", *c) for c in BAD + EXTERNAL_ONLY])


@pytest.mark.parametrize("rows,name,call,exc,match", CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES])
def test_a_bad_call_raises_the_same_everywhere_and_changes_nothing(rows, name, call, exc, match):
    got = []
    for Stg, Store in ((Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)):
        st, store = setup(Stg, Store, rows)
        before = seen(st, store)
        with pytest.raises(exc, match=match) as info:
            call(st, store)
        assert seen(st, store) == before, (Stg.__name__, name)
        got.append((info.type, str(info.value)))
    assert got[0] == got[1]


def test_a_stager_of_another_kind_is_refused_first():
    """Before its sequence can be looked at (each side names its own Stager class)."""
    for Stg, Store in ((Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)):
        st, store = setup(Stg, Store)
        before = seen(st, store)
        for call in (lambda s: s.publish(object(), 9, "bad", 0, 8), lambda s: s.hit(None, 9, "bad", 8)):
            with pytest.raises(TypeError, match=f"stager must be a dspark_core.*{Stg.__name__}, got"):
                call(store)
        assert seen(st, store) == before


@pytest.mark.parametrize("rows", ["held", "external"])
@pytest.mark.parametrize("which", IMPORTS)
def test_a_damaged_block_is_refused_with_the_same_message(rows, which):
    data = damaged(which)
    got = []
    for Stg, Store in ((Stager, PrefixStore), (ReferenceStager, ReferencePrefixStore)):
        st, store = setup(Stg, Store, rows)
        store.evict([KEYS[1]])
        before = seen(st, store)
        got.append(_outcome(lambda _st, s: s.import_block(data), st, store))
        assert seen(st, store) == before
    assert got[0] is not None and got[0][0] is ValueError and got[0] == got[1], got


def test_a_block_of_another_configuration_names_both():
    data = block_of(storage="q8_0", nonfinite="clamp")
    got = []
    for Store in (PrefixStore, ReferencePrefixStore):
        store = Store(CFG, BT, 1 << 22)
        got.append(_outcome(lambda _st, s: s.import_block(data), None, store))
    assert got[0] == got[1]
    assert got[0][1] == ("prefix block was exported with (feature_dim=64, storage=q8_0, nonfinite=clamp, "
                         "stage_dtype=float32, window=64, block_size=4) but this store has (feature_dim=64, "
                         "storage=f32, nonfinite=error, stage_dtype=float32, window=64, block_size=4)")


CONSTRUCT = [
    ("config", lambda S: S("cfg", BT, 1 << 20), TypeError, "config must be a StagerConfig"),
    ("block_tokens kind", lambda S: S(CFG, "8", 1 << 20), TypeError, "block_tokens must be an integer"),
    ("budget kind", lambda S: S(CFG, BT, 1.0), TypeError, "budget_bytes must be an integer"),
    ("block_tokens 0", lambda S: S(CFG, 0, 1 << 20), ConfigError, "block_tokens must be >= 1, got 0"),
    ("block_tokens huge", lambda S: S(CFG, 2**30 + 1, 1 << 20), ConfigError, r"must be <= 2\*\*30"),
    ("budget 0", lambda S: S(CFG, BT, 0), ConfigError, "budget_bytes must be >= 1, got 0"),
    ("budget < a block", lambda S: S(CFG, BT, 2047), ConfigError,
     r"budget_bytes \(2047\) is smaller than one block: 8 rows of 256 bytes in 1 page\(s\) of 2048 bytes need 2048"),
    ("budget beyond int64", lambda S: S(CFG, 2**70, 2**70), ConfigError, r"block_tokens \(9223372036854775807\)"),
]


@pytest.mark.parametrize("name,make,exc,match", CONSTRUCT, ids=[c[0] for c in CONSTRUCT])
def test_a_bad_store_is_refused_with_the_same_message(name, make, exc, match):
    got = []
    for Store in (PrefixStore, ReferencePrefixStore):
        with pytest.raises(exc, match=match) as info:
            make(Store)
        got.append((info.type, str(info.value)))
    assert got[0] == got[1]
