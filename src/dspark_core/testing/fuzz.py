"""``python -m dspark_core.testing.fuzz``: coverage-guided fuzzing of the core against the reference.

Targets (``--target``):

* ``ops`` (default): the input decodes to a config and a sequence of Stager
  calls (:func:`dspark_core.testing.decode_ops`); they run on the C++ core and
  on the pure-Python reference, every result and state is compared and the
  invariants are checked (:func:`dspark_core.testing.run_differential`). An
  external-row core runs them too, its rows in a mirror table written and
  moved as an owner does, checked against the held core after every call.
* ``threads``: the same ops (on at least two sequences); then the calls made
  on single sequences are replayed on fresh cores, held and external, from two
  threads at once and serially: every outcome and every final snapshot must be
  the serial replay's (:func:`dspark_core.testing.replay_threads`).
* ``snapshot``: ``restore`` of arbitrary bytes (raw, with a fixed checksum,
  or behind a valid header so the field checks are reached) on both sides:
  it must succeed or raise ``ValueError`` (``TypeError`` for a non-bytes
  argument) identically, a rejected restore leaves state and snapshot
  unchanged, and a restored slot must keep behaving identically.
* ``decode``: ``dspark_core.formats.dequantize_rows`` of arbitrary bytes must
  not crash and must equal ``dspark_core.reference.formats.decode`` bit for
  bit (NaNs compared by their bits) on every SIMD path.

Usage::

    python -m dspark_core.testing.fuzz --target ops --max-time 60 --corpus tests/fuzz_corpus/ops
    python -m dspark_core.testing.fuzz --target ops crash-1234      # replay: prints the op trace
    dspark-core fuzz ...                                    # the same, as a subcommand

Fuzzing needs atheris (``pip install dspark_core[fuzz]``); replaying files
does not. Exit status: 0 when nothing was found; on a finding, libFuzzer's
error exit code (77 unless ``-error_exitcode`` says otherwise) when fuzzing,
after it writes the input as ``crash-*``, and 1 when replaying; 2 for a usage
problem.

Only dspark_core's own Python code is instrumented for coverage; the
``decode`` target also gets a dictionary of float edge bit patterns
(:data:`FLOAT_EDGE_BITS`).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import time
import traceback
from typing import Callable, Sequence

import numpy as np

__all__ = ["TARGETS", "target_ops", "target_threads", "target_snapshot", "target_decode", "replay", "main",
           "build_parser"]


# ---------------------------------------------------------------------------
# Targets (plain functions of bytes; a finding is an exception)
# ---------------------------------------------------------------------------


def target_ops(data: bytes) -> None:
    """Decode ``data`` to calls, run them on core, reference and an external-row core with a
    mirror table; compare and check."""
    from . import decode_ops, run_differential

    config, ops = decode_ops(data)
    run_differential(config, ops, external=True)


def target_threads(data: bytes) -> None:
    """The ops on at least two sequences, then their single-sequence calls replayed from two
    threads against a serial replay (held and external-row cores)."""
    from . import decode_ops, replay_threads, run_differential

    config, ops = decode_ops(data)
    config = config.replace(max_seqs=max(2, config.max_seqs))
    report = run_differential(config, ops, check=False)
    replay_threads(config, report.made)


def _snapshot_bytes(config, head: bytes, rest: bytes, mode: int) -> bytes:
    from ..stager import snapshot_format as sf

    if mode % 3 == 0:
        return rest  # raw
    if mode % 3 == 1:
        fixed = bytearray(rest)  # raw bytes behind right checksums
        sf.refresh_checksums(fixed)
        return bytes(fixed)
    # A valid header (magic, version, fingerprint), fields and rows from the input, right checksum.
    r = list(head) + [0] * 16
    n_rows = r[0] % (config.window + config.block_size + 3)
    small = [int(b) - 8 for b in r[1:6]]
    state = sf.SnapshotState(
        started=bool(r[6] & 1), disabled=bool(r[6] & 2), restage_owed=bool(r[6] & 4),
        first_round=bool(r[6] & 8), accept_open=bool(r[6] & 16),
        end=small[0] + n_rows if r[7] & 1 else small[0], horizon=small[1], n_cache=small[2], pos_base=small[3],
        tentative=small[4] % 16, failures=r[8] % 4, rows=(rest * (1 + n_rows * config.row_bytes))[: n_rows * config.row_bytes]
        if rest else bytes(n_rows * config.row_bytes),
    )
    try:
        return sf.pack(state, config.snapshot_fingerprint())
    except struct.error:
        return b""


def target_snapshot(data: bytes) -> None:
    """``restore`` of arbitrary bytes must behave identically on core and reference."""
    from ..errors import StateError
    from . import CONFIG_BYTES, Desync, Op, _Runner, decode_config
    from ..reference import ReferenceStager
    from .._ext._stager import Stager

    data = bytes(data)
    config = decode_config(data[:CONFIG_BYTES])
    mode = data[CONFIG_BYTES] if len(data) > CONFIG_BYTES else 0
    head = data[CONFIG_BYTES + 1: CONFIG_BYTES + 17]
    rest = data[CONFIG_BYTES + 17:]
    runner = _Runner(config, Stager(config), ReferenceStager(config), True)
    # Some real state first: a long prompt and two rounds on the last sequence.
    seq = config.max_seqs - 1
    for op in (Op("long_prefill", (("seq", seq), ("n", "w+1"), ("chunks", 1), ("seed", 1))),
               Op("round", (("seq", seq), ("close", "commit"), ("n_verify", 0), ("accepted", 1),
                            ("rounds", 2), ("seed", 2)))):
        runner.run_op(op)
    blob = _snapshot_bytes(config, head, rest, mode)
    target = (mode >> 2) % config.max_seqs
    from . import Call

    kind, _, _ = runner.call(Call("restore", (target, blob), f"restore({target}, <{len(blob)} fuzz bytes, mode {mode % 3}>)"))
    if kind == "raise":
        return  # _Runner.call checked: same type, documented, nothing changed
    # Restored: it must keep behaving identically (and keep the invariants),
    # starting with what a server does after restoring mid-verify: accept.
    for op in (Op("accept", (("seq", target), ("n", 0))),
               Op("round", (("seq", target), ("close", "commit"), ("n_verify", 0), ("accepted", 0),
                            ("rounds", 2), ("seed", 3))),
               Op("accept", (("seq", target), ("n", 0))),
               Op("round", (("seq", target), ("close", "decode"), ("n_verify", 1), ("accepted", 2),
                            ("rounds", 3), ("seed", 4))),
               Op("rollback", (("seq", target), ("back", 2))),
               Op("snapshot", (("seq", target),))):
        runner.run_op(op)
    del Desync, StateError


def _nan_bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def target_decode(data: bytes) -> None:
    """``formats.dequantize_rows`` of arbitrary bytes equals the reference decoder bit for bit."""
    import ml_dtypes

    from .. import formats
    from ..reference import formats as rf

    data = bytes(data)
    if len(data) < 2:
        return
    storage = formats.STORAGES[data[0] % 5]
    out_dtype = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))[(data[0] >> 3) % 3]
    if storage.startswith("q"):
        dim = 32 * (1 + data[1] % 3)
    else:
        dim = 1 + data[1] % 80
    rb = formats.row_bytes(storage, dim)
    raw = data[2:]
    n = len(raw) // rb
    if n == 0:
        return
    arr = np.frombuffer(raw[: n * rb], np.uint8).reshape(n, rb)
    want = rf.decode(arr, storage, dim, out_dtype)
    for path in formats.simd_paths():
        with formats.simd_path(path):
            got = formats.dequantize_rows(arr, storage, dim, out_dtype)
        if not _nan_bits_equal(got, want):
            flat_g = got.reshape(-1).view(np.uint32 if got.itemsize == 4 else np.uint16)
            flat_w = want.reshape(-1).view(np.uint32 if want.itemsize == 4 else np.uint16)
            i = int(np.flatnonzero(flat_g != flat_w)[0]) if got.shape == want.shape else -1
            detail = (f"element {i}: core 0x{int(flat_g[i]):x}, reference 0x{int(flat_w[i]):x}" if i >= 0
                      else f"shapes {got.shape} vs {want.shape}")
            raise AssertionError(
                f"dequantize_rows({storage}, dim={dim}, {out_dtype}) on SIMD path {path!r} differs from "
                f"reference_formats.decode: {detail}"
            )


# Bit patterns at the edges of the float formats (little-endian, as the decode
# target reads rows): infinities, quiet and signalling NaNs with high-only and
# low-only payloads, the largest finite values, f16 overflow and subnormal
# edges, -0. Random bytes almost never hit them (a signalling f32 NaN with
# only low payload bits is ~1 in 2^18 words), and since only dspark_core is
# instrumented, no oracle comparison hands them to libFuzzer either.
FLOAT_EDGE_BITS: tuple[tuple[int, int], ...] = tuple(
    [(v, 4) for v in (0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F801FFF,
                      0x7F802000, 0x7FA00000, 0x7FFFFFFF, 0x7F7FFFFF, 0x477FE000, 0x477FF000, 0x47800000,
                      0x38800000, 0x387FE000, 0x33000000, 0x33000001, 0x00000001, 0x80000000,
                      # overflow edges (encode_bounds): f16 65519.996 / 65520, bf16 0x1.ffp127 and
                      # just below, q8_0 127 * 65520 and below, q4_0 8 * 65520 and below, and a
                      # massive activation (87,929) with its negative
                      0x477FEFFF, 0x7F7F7FFF, 0x7F7F8000, 0x4AFDF01F, 0x4AFDF020, 0x48FFEFFF, 0x48FFF000,
                      0x47ABBC80, 0xC7ABBC80)]
    + [(v, 2) for v in (0x7C00, 0xFC00, 0x7E00, 0x7C01, 0x7D00, 0x7FFF, 0x7BFF, 0x0001, 0x0400, 0x8000,
                        0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0x7F7F)]
)


def float_edge_dictionary() -> str:
    """:data:`FLOAT_EDGE_BITS` as a libFuzzer ``-dict`` file's text."""
    lines = []
    for value, width in FLOAT_EDGE_BITS:
        raw = value.to_bytes(width, "little")
        lines.append(f'edge_{width * 8}_{value:0{width * 2}x}="' + "".join(f"\\x{b:02x}" for b in raw) + '"')
    return "\n".join(lines) + "\n"


def _write_dictionary() -> str:
    """Write the float-edge dictionary to one per-user temp file; returns its path.

    One fixed path, replaced atomically, so runs neither pile up files (libFuzzer
    may leave by ``exit()`` on a finding, past any cleanup) nor see a torn one.
    """
    path = os.path.join(tempfile.gettempdir(), f"dspark-fuzz-float-edges-{os.getuid()}.dict")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".dspark-fuzz-dict.")
    with os.fdopen(fd, "w") as f:
        f.write(float_edge_dictionary())
    os.replace(tmp, path)
    return path


# Targets whose inputs are float rows get the float-edge dictionary.
_DICTIONARY_TARGETS = ("decode",)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "ops": target_ops,
    "threads": target_threads,
    "snapshot": target_snapshot,
    "decode": target_decode,
}


# ---------------------------------------------------------------------------
# Replay and the atheris driver
# ---------------------------------------------------------------------------


def replay(target: str, paths: Sequence[str], out=sys.stdout) -> int:
    """Run ``target`` on each file (or every file of a directory); print findings. Returns #failures."""
    fn = TARGETS[target]
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, f) for f in os.listdir(p) if os.path.isfile(os.path.join(p, f)))
        else:
            files.append(p)
    failures = 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        if target in ("ops", "threads"):
            from . import decode_ops

            config, ops = decode_ops(data)
            print(f"{f}: {config}, {len(ops)} ops", file=out)
        try:
            fn(data)
        except Exception as exc:  # noqa: BLE001 - every exception is a finding
            failures += 1
            print(f"FINDING in {f}:", file=out)
            if isinstance(exc, AssertionError):
                print(f"{type(exc).__name__}: {exc}", file=out)
            else:
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=out)
        else:
            print(f"{f}: ok", file=out)
    print(f"replayed {len(files)} file(s): {failures} finding(s)", file=out)
    return failures


#: The package whose functions are instrumented (``__package__`` here is ``dspark_core.testing``).
_TOP_PACKAGE = (__package__ or "dspark_core").split(".")[0]


#: Modules left uninstrumented for the state-machine targets (ops, threads, snapshot): the
#: reference's bit-exact encoders and the pure-Python CRC-32C are arithmetic loops whose
#: branches say nothing about the protocol, and instrumented they made each input ~10x slower.
_BYTE_LOOPS = ("dspark_core.reference.formats", "dspark_core.stager.snapshot_format")


def _instrument_package(atheris, skip: tuple[str, ...] = ()) -> int:
    """Add coverage instrumentation to dspark_core's own Python functions only
    (less the modules in ``skip``).

    Not ``atheris.instrument_all()``: that also instruments numpy, gguf-py and
    the standard library, whose coverage says nothing about dspark_core, and it
    made the decode target's process grow by ~1 KB per input, to libFuzzer's
    2 GB RSS limit within 4 minutes (instrumented gguf-py quantizers grow on
    their own; with only dspark_core instrumented the process stays flat).
    """
    import gc
    import types

    count = 0
    for obj in gc.get_objects():
        module = getattr(obj, "__module__", None) if isinstance(obj, types.FunctionType) else None
        # __name__: the targets here, which live in __main__ under ``python -m``.
        if isinstance(module, str) and (module.split(".")[0] == _TOP_PACKAGE or module == __name__) \
                and module not in skip:
            atheris.instrument_func(obj)
            count += 1
    return count


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Options of ``python -m dspark_core.testing.fuzz`` (also used by ``dspark-core fuzz``)."""
    p = parser or argparse.ArgumentParser(
        prog="python -m dspark_core.testing.fuzz",
        description="Fuzz the C++ core against the pure-Python reference (atheris), or replay inputs.",
    )
    p.add_argument("--target", choices=sorted(TARGETS), default="ops", help="what to fuzz (default: ops)")
    p.add_argument("--runs", type=int, default=None, metavar="N", help="stop after N inputs")
    p.add_argument("--max-time", type=float, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="corpus directory: seeds are read from it and new inputs written to it")
    p.add_argument("--artifact-prefix", default=None, metavar="PREFIX",
                   help="where atheris writes crash files (default: the current directory)")
    p.add_argument("files", nargs="*", metavar="CRASH_FILE",
                   help="replay these inputs (files or directories) without atheris and print the op trace")
    return p


def run(args: argparse.Namespace) -> int:
    """Run the fuzzer (or the replay) for parsed ``args``; returns the exit status."""
    if args.files:
        return 1 if replay(args.target, args.files) else 0
    try:
        import atheris
    except ImportError:
        print("dspark_core.testing.fuzz: atheris is not installed; install it with "
              "`pip install dspark_core[fuzz]` (or `pip install atheris`). "
              "Replaying files (CRASH_FILE arguments) works without it.", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("dspark_core").setLevel(logging.ERROR)
    fn = TARGETS[args.target]
    # Import everything the target touches before instrumenting, so coverage sees it.
    from .. import formats, reference, testing  # noqa: F401
    from ..stager import snapshot_format  # noqa: F401
    from ..reference import formats as reference_formats  # noqa: F401

    n_instrumented = _instrument_package(atheris, () if args.target == "decode" else _BYTE_LOOPS)
    print(f"dspark_core.testing.fuzz: instrumented {n_instrumented} dspark_core functions", file=sys.stderr)
    lf = [sys.argv[0] or "dspark_core.testing.fuzz"]
    if args.runs is not None:
        lf.append(f"-runs={args.runs}")
    if args.max_time is not None:
        lf.append(f"-max_total_time={int(max(1, args.max_time))}")
    if args.artifact_prefix:
        lf.append(f"-artifact_prefix={args.artifact_prefix}")
    lf.append("-print_final_stats=1")
    if args.target in _DICTIONARY_TARGETS:
        lf.append(f"-dict={_write_dictionary()}")
    if args.corpus:
        os.makedirs(args.corpus, exist_ok=True)
        lf.append(args.corpus)

    def one_input(data: bytes) -> None:
        fn(data)

    start = time.monotonic()
    atheris.Setup(lf, one_input)
    try:
        atheris.Fuzz()
    except SystemExit as exc:  # libFuzzer exits when a limit is reached
        code = exc.code if isinstance(exc.code, int) else 0
        print(f"dspark_core.testing.fuzz: {args.target}: finished in {time.monotonic() - start:.1f}s "
              f"({'no finding' if code == 0 else 'FINDING'})", file=sys.stderr)
        return 0 if code == 0 else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dspark_core.testing.fuzz``."""
    args = build_parser().parse_args(argv)
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
