"""Snapshot format v2: CRC-32C, the byte layout, zero-copy snapshot_into / restore,
damage rejection, the nonfinite fingerprint, version-1 reading.

Oracles: a bit-by-bit CRC-32C written here (not the core's kernels, not the
reference's lanes), RFC 3720 / "123456789" check values, a struct parse of
the documented layout, zlib for version 1, and the reference twin's bytes.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from dspark_core import Stager, StagerConfig
from dspark_core._ext import _stager
from dspark_core import kernels
from dspark_core.errors import StateError
from dspark_core.stager import snapshot_format as sf
from dspark_core.stager.config import NONFINITE_POLICIES, STAGE_DTYPES, STORAGES
from dspark_core.reference import ReferenceStager

DATA = Path(__file__).parent / "data"
HEADER = 96


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    """CRC-32C by its definition, one bit at a time."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def activations(n: int, dim: int, seed: int, first: int = 1) -> np.ndarray:
    """N(0,1) with a few massive channels; a huge-norm BOS row when the rows start at 0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x[:, [2, dim // 2]] *= np.float32(5e3)
    x[:, dim - 3] += np.float32(8e4)
    if first == 0 and n:
        x[0] *= np.float32(3.0)  # q4_0's fp16 block scale (max / 8) still holds it
    return x


@pytest.fixture(params=kernels.supported("crc32c"))
def crc_path(request):
    """Run on each CRC-32C kernel this CPU has (the process-wide switch is restored after)."""
    with kernels.use("crc32c", request.param):
        yield request.param


# -- CRC-32C -----------------------------------------------------------------


def test_crc32c_check_values(crc_path):
    # The catalogue check value and RFC 3720 B.4's iSCSI vectors.
    vectors = [(b"123456789", 0xE3069283), (b"", 0), (bytes(32), 0x8A9136AA), (b"\xff" * 32, 0x62A8AB43),
               (bytes(range(32)), 0x46DD794E), (bytes(range(31, -1, -1)), 0x113FDB5C)]
    for data, want in vectors:
        assert _stager.crc32c(data) == want
        assert sf.crc32c(data) == want
        assert crc32c_bitwise(data) == want


def test_crc32c_paths_cover_this_cpu():
    assert kernels.supported("crc32c")[0] == "portable"
    assert kernels.active("crc32c") in kernels.supported("crc32c")
    with pytest.raises(ValueError, match="unknown crc32c path 'pclmul'"):
        kernels.set_path("crc32c", "pclmul")


@settings(max_examples=40)
@given(data=hs.binary(min_size=0, max_size=3000), cut=hs.integers(0, 3000), path=hs.sampled_from(kernels.supported("crc32c")))
def test_crc32c_random_buffers_match_the_definition(data, cut, path):
    with kernels.use("crc32c", path):
        want = crc32c_bitwise(data)
        assert _stager.crc32c(data) == want
        assert sf.crc32c(data) == want
        k = min(cut, len(data))
        assert _stager.crc32c(data[k:], _stager.crc32c(data[:k])) == want
        assert sf.crc32c(data[k:], sf.crc32c(data[:k])) == want


@pytest.mark.parametrize("n", [24575, 24577, 73731])
def test_crc32c_long_buffers_on_every_path(crc_path, n):
    """Past the three-way stream sizes (3 x 256 B, 3 x 8 KiB) and into the reference's lanes."""
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = crc32c_bitwise(data.tobytes())
    assert _stager.crc32c(data) == want
    assert sf.crc32c(data) == want
    assert _stager.crc32c(data, 0x12345678) == sf.crc32c(data, 0x12345678) == crc32c_bitwise(data.tobytes(), 0x12345678)


# -- layout ------------------------------------------------------------------


def primed(cls, cfg: StagerConfig, seq: int = 0, n: int = 40):
    # f16 cannot hold the largest activations (|x| >= 65520 is rejected): keep them in range there.
    narrow = cfg.storage == "f16" or cfg.stage_dtype == "float16"
    fit = (lambda x: np.clip(x, -6e4, 6e4)) if narrow else (lambda x: x)
    st = cls(cfg)
    st.begin(seq)
    st.process(seq, np.arange(n), fit(activations(n, cfg.feature_dim, 3, first=0)))
    p = st.draft(seq, n)
    if not p.skip:
        st.commit(seq)
    v = np.arange(n, n + cfg.block_size + 1)
    st.process(seq, v, fit(activations(len(v), cfg.feature_dim, 4)))
    st.accept(seq, 1)
    return st


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("nonfinite", NONFINITE_POLICIES)
@pytest.mark.parametrize("stage", ["float32", "float16"])
def test_layout_matches_the_documented_format(storage, nonfinite, stage, crc_path):
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=2, storage=storage, nonfinite=nonfinite,
                       stage_dtype=stage)
    core, ref = primed(Stager, cfg), primed(ReferenceStager, cfg)
    data = core.snapshot(0)
    assert data == ref.snapshot(0)
    (magic, version, header, dim, st_code, nf_code, content, window, block, row_bytes, _flags, end, horizon,
     n_cache, pos_base, _tentative, failures, stage_code, reserved, n_rows, rows_crc, header_crc) = struct.unpack_from(
        "<4sHHIBBHIIIIqqqqqIB3sQII", data, 0)
    assert (magic, version, header, content, reserved) == (b"DSPK", 2, HEADER, 0, bytes(3))
    assert (dim, STORAGES[st_code], NONFINITE_POLICIES[nf_code], window, block) == (64, storage, nonfinite, 24, 4)
    assert STAGE_DTYPES[stage_code] == cfg.stage_dtype
    assert row_bytes == cfg.row_bytes
    state = core.state(0)
    assert (end, horizon, n_cache, pos_base, failures) == (
        state["end"], state["horizon"], state["n_cache"], state["pos_base"], state["consecutive_failures"])
    assert n_rows == end - horizon and len(data) == HEADER + n_rows * row_bytes == core.snapshot_size(0)
    assert header_crc == crc32c_bitwise(data[:92])
    assert rows_crc == crc32c_bitwise(data[HEADER:])
    assert data[HEADER:] == ref.snapshot(0)[HEADER:]
    assert ref.snapshot_size(0) == len(data)


def test_fresh_sequence_snapshot_is_a_bare_header(make_stager):
    st = make_stager(feature_dim=32, block_size=2, window=9)
    assert st.snapshot_size(0) == HEADER
    data = st.snapshot(0)
    assert len(data) == HEADER and struct.unpack_from("<I", data, 88)[0] == 0  # CRC-32C of nothing


def test_size_formula_and_worst_case():
    """snapshot_bytes(n, row_bytes) = 96 + n * row_bytes; a sequence never holds more than W + B + 1 rows."""
    cfg = StagerConfig(feature_dim=128, block_size=4, window=16, storage="q8_0")
    assert sf.snapshot_bytes(0, cfg.row_bytes) == 96
    assert sf.snapshot_bytes(10, cfg.row_bytes) == 96 + 10 * 136
    st = Stager(cfg)
    st.begin(0)
    st.process(0, np.arange(300), activations(300, 128, 9, first=0))
    assert st.snapshot_size(0) <= sf.snapshot_bytes(cfg.window + cfg.block_size + 1, cfg.row_bytes)


# -- zero-copy ---------------------------------------------------------------


def _targets(n: int):
    """Writable buffers of at least n bytes a server would hand over."""
    shm = shared_memory.SharedMemory(create=True, size=n + 7)
    mm = mmap.mmap(-1, n + 64)
    try:
        yield "bytearray", bytearray(n + 5)
        yield "ndarray-u8", np.zeros(n + 3, np.uint8)
        yield "ndarray-f32", np.zeros((n + 3) // 4 + 1, np.float32)
        yield "memoryview-slice", memoryview(bytearray(n + 20))[10:]
        yield "mmap", mm
        yield "shared_memory", shm.buf
    finally:
        mm.close()
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_snapshot_into_any_writable_buffer(storage, crc_path):
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=3, storage=storage)
    core, ref = primed(Stager, cfg), primed(ReferenceStager, cfg)
    want = ref.snapshot(0)
    n = len(want)
    for name, buf in _targets(n):
        for st in (core, ref):
            view = memoryview(buf).cast("B")
            view[:] = b"\xab" * len(view)
            assert st.snapshot_into(0, buf) == n, name
            assert bytes(view[:n]) == want, name
            assert bytes(view[n:]) == b"\xab" * (len(view) - n), name  # nothing past the snapshot
            # and back, straight from the same buffer
            st.restore(2, view[:n])
            assert st.snapshot(2)[HEADER:] == want[HEADER:]
            st.begin(2)
            del view


def test_snapshot_into_rejects_bad_buffers(make_stager):
    st = make_stager(feature_dim=32, block_size=2, window=9, max_seqs=2)
    st.process(0, np.arange(12), activations(12, 32, 1, first=0))
    n = st.snapshot_size(0)
    small = bytearray(b"\x11" * (n - 1))
    with pytest.raises(ValueError, match="too small"):
        st.snapshot_into(0, small)
    assert small == bytearray(b"\x11" * (n - 1))  # nothing written
    with pytest.raises(ValueError, match="too small"):
        st.snapshot_into(0, bytearray())
    for bad in (bytes(n), memoryview(bytes(n)), np.zeros(2 * n, np.uint8)[::2], "text", 123):
        with pytest.raises(TypeError):
            st.snapshot_into(0, bad)
    frozen = np.zeros(n, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        st.snapshot_into(0, frozen)
    with pytest.raises(ValueError, match="unknown sequence"):
        st.snapshot_into(7, bytearray(n))


def test_snapshot_into_with_an_open_round_is_a_state_error(make_stager):
    from dspark_core import StateError

    st = make_stager(feature_dim=32, block_size=2, window=9)
    st.process(0, np.arange(6), activations(6, 32, 1, first=0))
    st.draft(0, 6)
    with pytest.raises(StateError):
        st.snapshot_into(0, bytearray(10_000))
    with pytest.raises(StateError):
        st.snapshot_size(0)


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "ndarray", "ndarray-strided", "mmap"])
def test_restore_reads_any_buffer(make_stager, kind):
    st = make_stager(feature_dim=32, block_size=2, window=9, max_seqs=2, storage="bf16")
    st.process(0, np.arange(12), activations(12, 32, 1, first=0))
    data = st.snapshot(0)
    if kind == "bytes":
        src = data
    elif kind == "bytearray":
        src = bytearray(data)
    elif kind == "memoryview":
        src = memoryview(b"pad" + data)[3:]
    elif kind == "ndarray":
        src = np.frombuffer(data, np.uint8)
    elif kind == "ndarray-strided":  # not contiguous: read through one copy
        wide = np.zeros(2 * len(data), np.uint8)
        wide[::2] = np.frombuffer(data, np.uint8)
        src = wide[::2]
    else:
        src = mmap.mmap(-1, len(data))
        src[:] = data
    st.restore(1, src)
    assert st.snapshot(1)[HEADER:] == data[HEADER:]
    assert st.state(1)["end"] == 12 and st.state(1)["restage_owed"]


def test_restore_of_a_non_buffer_is_a_type_error(make_stager):
    st = make_stager(feature_dim=32, block_size=2, window=9)
    for bad in (12345, "DSPK", [1, 2, 3], None):
        with pytest.raises(TypeError):
            st.restore(0, bad)


# -- damage --------------------------------------------------------------------


def _full_state(st, seq):
    return st.state(seq), {k: v for k, v in st.stats(seq).items() if k in ("rounds", "commits", "live_rows")}, st.snapshot(seq)


@pytest.fixture(scope="module")
def damage_setup():
    """A snapshot with real rows, and the two kinds of slot it may be restored into."""
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=3, storage="q4_0")
    good = primed(Stager, cfg).snapshot(0)
    return cfg, good


def _slots(cfg):
    """(stager, seq) pairs: a slot still holding rows (checked, then copied) and an emptied one (one pass)."""
    core = primed(Stager, cfg, seq=1, n=13)
    core.begin(2)
    ref = primed(ReferenceStager, cfg, seq=1, n=13)
    ref.begin(2)
    return [(core, 1), (core, 2), (ref, 1), (ref, 2)]


@settings(max_examples=60)
@given(flips=hs.lists(hs.integers(0, 10**9), min_size=1, max_size=3, unique=True))
def test_bit_flips_anywhere_are_rejected(damage_setup, flips):
    """CRC-32C has Hamming distance >= 4 at these lengths: up to 3 flipped bits are always caught."""
    cfg, good = damage_setup
    data = bytearray(good)
    bits = {f % (8 * len(data)) for f in flips}
    for b in bits:
        data[b // 8] ^= 1 << (b % 8)
    for st, seq in _slots(cfg):
        before = _full_state(st, seq)
        with pytest.raises(ValueError):
            st.restore(seq, data)
        assert _full_state(st, seq) == before


def test_every_single_bit_flip_is_rejected_by_the_core(damage_setup, crc_path):
    cfg, good = damage_setup
    for st, seq in _slots(cfg)[:2]:
        before = _full_state(st, seq)
        buf = bytearray(good)
        for i in range(len(buf)):
            for bit in (0, 3, 7):
                buf[i] ^= 1 << bit
                with pytest.raises(ValueError):
                    st.restore(seq, buf)
                buf[i] ^= 1 << bit
        assert _full_state(st, seq) == before
        st.restore(seq, buf)  # the undamaged bytes still restore


def test_truncation_and_extension_are_rejected(damage_setup):
    cfg, good = damage_setup
    for st, seq in _slots(cfg):
        before = _full_state(st, seq)
        for k in range(len(good)):
            with pytest.raises(ValueError):
                st.restore(seq, good[:k])
        for tail in (b"\0", b"\0" * 4, good[HEADER:HEADER + cfg.row_bytes]):
            with pytest.raises(ValueError, match="length|truncated"):
                st.restore(seq, good + tail)
        assert _full_state(st, seq) == before


def _edited(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    sf.refresh_checksums(out)
    return bytes(out)


@pytest.mark.parametrize("offset, fmt, value, match", [
    (4, "<H", 3, "unsupported snapshot version 3"),
    (4, "<H", 0, "unsupported snapshot version 0"),
    (6, "<H", 88, "header size"),
    (14, "<H", 1, "holds no rows"),  # bit 0: rows held outside (external-row mode), not this Stager's mode
    (14, "<H", 0x8000, "content flags"),
    (77, "<B", 1, "reserved"),
    (79, "<B", 0x80, "reserved"),
    (28, "<I", 1 << 7, "reserved"),
])
def test_other_version_and_unknown_content_are_rejected(damage_setup, offset, fmt, value, match):
    """Even with right checksums: an unknown version, a bookkeeping-only (external rows) snapshot, reserved bits."""
    cfg, good = damage_setup
    data = _edited(good, offset, fmt, value)
    for st, seq in _slots(cfg):
        before = _full_state(st, seq)
        with pytest.raises(ValueError, match=match):
            st.restore(seq, data)
        assert _full_state(st, seq) == before


@pytest.mark.parametrize("change", [
    {"feature_dim": 96}, {"storage": "q8_0"}, {"window": 25}, {"block_size": 3}, {"nonfinite": "zero"},
    {"nonfinite": "clamp_f16"}, {"nonfinite": "clamp"}, {"stage_dtype": "bfloat16"},
])
def test_another_config_is_rejected_by_name(damage_setup, change):
    cfg, good = damage_setup
    other = cfg.replace(**change)
    key = next(iter(change))
    label = "block_size" if key == "block_size" else key
    for cls in (Stager, ReferenceStager):
        st = primed(cls, other, seq=1, n=13)
        before = _full_state(st, 1)
        with pytest.raises(ValueError, match=f"snapshot was taken with .*{label}="):
            st.restore(1, good)
        assert _full_state(st, 1) == before


# -- nonfinite policy ----------------------------------------------------------


def test_nonfinite_policy_is_fingerprinted(make_stager):
    """Rows stored under "zero" hold no NaN; a Stager under "error" must not take them
    (it would then stage rows its own policy never produced)."""
    zero = StagerConfig(feature_dim=32, block_size=2, window=9, max_seqs=2, nonfinite="zero")
    src = make_stager(zero)
    x = activations(8, 32, 2, first=0)
    x[6, 5] = np.nan
    x[7, 1] = np.inf
    src.process(0, np.arange(8), x)
    data = src.snapshot(0)
    strict = make_stager(zero.replace(nonfinite="error"))
    strict.process(0, np.arange(3), activations(3, 32, 5, first=0))
    before = _full_state(strict, 0)
    with pytest.raises(ValueError, match="nonfinite=zero.*nonfinite=error"):
        strict.restore(0, data)
    assert _full_state(strict, 0) == before
    same = make_stager(zero)
    same.restore(1, data)
    plan = same.draft(1, 8)
    at = {int(p) + plan.pos_base: i for i, p in enumerate(plan.positions)}
    assert {6, 7} <= set(at) and np.isfinite(plan.rows).all()
    assert plan.rows[at[6], 5] == 0 and plan.rows[at[7], 1] == 0


# -- version 1 -----------------------------------------------------------------


def parse_v1(data: bytes) -> dict:
    """The version-1 layout, parsed here independently (88-byte header, zlib CRC-32 trailer)."""
    assert zlib.crc32(data[:-4]) & 0xFFFFFFFF == struct.unpack_from("<I", data, len(data) - 4)[0]
    f = struct.unpack_from("<4sHHIB3sIIIIqqqqqIIQ", data, 0)
    keys = ("magic", "version", "header", "dim", "storage", "res0", "window", "block", "row_bytes", "flags",
            "end", "horizon", "n_cache", "pos_base", "tentative", "failures", "res1", "n_rows")
    out = dict(zip(keys, f))
    out["rows"] = data[88:-4]
    return out


@pytest.mark.parametrize("storage", ["f32", "q4_0"])
def test_version_1_snapshots_still_restore(make_stager, storage):
    data = (DATA / f"snapshot_v1_{storage}.bin").read_bytes()
    v1 = parse_v1(data)
    assert (v1["magic"], v1["version"], STORAGES[v1["storage"]]) == (b"DSPK", 1, storage)
    # The config the fixture was written under (tests/data/make_snapshot_v1.py); any nonfinite policy.
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, storage=storage, nonfinite="zero")
    st = make_stager(cfg)
    st.restore(0, data)
    state = st.state(0)
    assert (state["end"], state["n_cache"], state["pos_base"], state["consecutive_failures"]) == (
        v1["end"], v1["n_cache"], v1["pos_base"], v1["failures"])
    assert state["restage_owed"] and state["started"]
    # Every restored row is the fixture's row for its position.
    again = st.snapshot(0)
    assert again[:4] == b"DSPK" and struct.unpack_from("<H", again, 4)[0] == 2
    h = state["horizon"]
    rb = v1["row_bytes"]
    assert again[HEADER:] == v1["rows"][(h - v1["horizon"]) * rb:]
    # The next round restages exactly those rows.
    plan = st.draft(0, v1["end"])
    assert plan.rebase and plan.clear_cache
    first = plan.positions[0] + plan.pos_base
    assert plan.encoded_rows.tobytes() == v1["rows"][(first - v1["horizon"]) * rb:]


def test_version_1_damage_is_still_rejected(make_stager):
    data = bytearray((DATA / "snapshot_v1_q4_0.bin").read_bytes())
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, storage="q4_0")
    st = make_stager(cfg)
    data[100] ^= 0x04
    with pytest.raises(ValueError, match="checksum"):
        st.restore(0, data)
    with pytest.raises(ValueError, match="snapshot was taken with"):
        make_stager(cfg.replace(window=25)).restore(0, (DATA / "snapshot_v1_q4_0.bin").read_bytes())


# -- docs ------------------------------------------------------------------------


def test_docs_size_table_follows_the_formula():
    """docs/moving_sequences.md's size table is 96 + W * row_bytes, row_bytes from gguf-py's block geometry."""
    import gguf

    text = (Path(__file__).parent.parent / "docs" / "moving_sequences.md").read_text()
    body = text.split("<!-- sizes:begin")[1].split("<!-- sizes:end -->")[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    windows = [int(h.split("=")[1].replace(",", "")) for h in header[3:]]
    quant = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}
    seen = 0
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        dim, storage, rb = int(cells[0].replace(",", "")), cells[1], int(cells[2].replace(",", ""))
        block, type_size = gguf.GGML_QUANT_SIZES[quant[storage]]
        assert rb == dim // block * type_size
        for w, cell in zip(windows, cells[3:]):
            assert cell == f"{(96 + w * rb) / 1e6:,.1f} MB", (dim, storage, w)
        seen += 1
    assert seen == 20


@pytest.mark.parametrize("env, want, warning", [
    ({"DSPARK_SIMD": "portable"}, "portable", None),
    ({"DSPARK_SIMD": "scalar"}, "portable", None),
    # The old variable still works, with a FutureWarning naming its replacement.
    ({"DSPARK_CRC32C": "portable"}, "portable", "FutureWarning: DSPARK_CRC32C is deprecated"),
    # DSPARK_SIMD wins over it.
    ({"DSPARK_CRC32C": "portable", "DSPARK_SIMD": kernels.best("crc32c")}, kernels.best("crc32c"), "FutureWarning"),
])
def test_environment_picks_the_crc32c_kernel(env, want, warning):
    import os
    import subprocess
    import sys

    code = ("from dspark_core import kernels; from dspark_core._ext import _stager as s; "
            "print(kernels.active('crc32c'), hex(s.crc32c(b'123456789')))")
    base = {k: v for k, v in os.environ.items() if k not in ("DSPARK_SIMD", "DSPARK_CRC32C")}
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    assert r.stdout.split() == [want, "0xe3069283"]
    if warning is None:
        assert "Warning" not in r.stderr, r.stderr
    else:
        assert warning in r.stderr, r.stderr


# -- check_restore: restore's checks, nothing changed ---------------------------


def primed_any(cls, cfg: StagerConfig, seq: int = 0, n: int = 40):
    """``primed`` in either row mode (external: the positions only)."""
    if cfg.rows == "held":
        return primed(cls, cfg, seq, n)
    st = cls(cfg)
    st.begin(seq)
    st.process(seq, np.arange(n))
    if not st.draft(seq, n).skip:
        st.commit(seq)
    st.process(seq, np.arange(n, n + cfg.block_size + 1))
    st.accept(seq, 1)
    return st


@pytest.mark.parametrize("rows", ["held", "external"])
def test_check_restore_says_what_restore_says_and_changes_nothing(rows):
    """On good data: the rows restore brings back (external: as many as its slots); on damaged,
    truncated, foreign or other-mode data: restore's own error, word for word; neither form of
    the call changes the sequence. Core and reference alike."""
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=3, storage="q8_0", rows=rows)
    other = cfg.replace(rows="held" if rows == "external" else "external")
    fresh = ReferenceStager(cfg).snapshot(0)
    for cls in (Stager, ReferenceStager):
        good = primed_any(cls, cfg).snapshot(0)
        flipped = bytearray(good)
        flipped[len(good) // 2] ^= 0x10
        cases = [good, fresh, flipped, good[:-1], good + b"\0", primed_any(cls, other).snapshot(0),
                 primed_any(cls, cfg.replace(window=32)).snapshot(0)]
        for data in cases:
            st = primed_any(cls, cfg, seq=1, n=13)
            before = _full_state(st, 1)
            try:
                n = st.check_restore(1, data)
            except ValueError as exc:
                assert _full_state(st, 1) == before
                with pytest.raises(ValueError) as restored:
                    st.restore(1, data)
                assert str(restored.value) == str(exc)
                continue
            assert _full_state(st, 1) == before
            slots = st.restore(1, data)
            state = st.state(1)
            assert n == (state["end"] - state["horizon"] if state["started"] else 0)
            if rows == "external":
                assert len(slots) == n
    # The sequence's own state comes first, as in restore: an open round is a StateError.
    st = primed_any(Stager, cfg, seq=1, n=13)
    st.draft(1, st.state(1)["end"])
    assert st.state(1)["open_round"]
    with pytest.raises(StateError) as checked:
        st.check_restore(1, fresh)
    with pytest.raises(StateError) as restored:
        st.restore(1, fresh)
    assert str(checked.value) == str(restored.value)
