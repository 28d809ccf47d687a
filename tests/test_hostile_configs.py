"""Hostile drafter files and arguments: every one is a clean error, never a hang, a leak or a wrong value.

The readers (``DrafterInfo.from_hf_config`` / ``from_gguf``) refuse with a
``DrafterMetadataError`` naming the file (and the key, where one holds the
problem) a config.json nested past ``MAX_CONFIG_DEPTH``, larger than
``MAX_CONFIG_BYTES`` or holding an integer past ``MAX_JSON_INT_DIGITS``, a FIFO
or device in place of a file, and GGUF headers past the reader's limits; text
read from a file is escaped to be printable; ``bool`` is no integer argument;
``prometheus_text`` converts ``seqs`` as the Stager's batch calls convert ids.
``dspark-core inspect`` runs in a subprocess where it could hang (a FIFO) or
crash on printing (a lone surrogate), under a timeout.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig
from dspark_core.cli import main
from dspark_core.gguf.bounded_json import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_JSON_INT_DIGITS
from dspark_core.gguf.drafter_info import DrafterInfo, DrafterMetadataError
from dspark_core.gguf.reader import MAX_GGUF_STRING_BYTES, MAX_GGUF_TENSOR_DIMS, MAX_GGUF_TENSORS
from dspark_core.metrics import prometheus_text
from dspark_core.reference import ReferenceStager
from gguf_helpers import dspark_kv, write_gguf

EAGLE3 = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
          "max_position_embeddings": 2048}

#: Seconds a subprocess ``inspect`` may take before the test calls it hung.
_HANG_TIMEOUT_S = 20
#: Address space a subprocess ``inspect`` may take: a reader that reads an endless file
#: whole fails there, not on the machine.
_SUBPROCESS_MEMORY_BYTES = 4 << 30


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_SUBPROCESS_MEMORY_BYTES, _SUBPROCESS_MEMORY_BYTES))


def _write(tmp_path: Path, text: str, name: str = "config.json") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def _inspect(*args: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """``dspark-core inspect ARGS`` in a fresh interpreter, its stdout strictly UTF-8 (as a
    pipe or a UTF-8 terminal is), under a timeout: ``TimeoutExpired`` means it hung."""
    code = "import sys; from dspark_core.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    env.pop("DSPARK_WINDOW_CAP", None)
    # Under a preloaded sanitizer runtime (CI's ASan run of the suite) the cap is left off: ASan
    # reserves its shadow memory up front and cannot start inside 4 GiB of address space.
    capped = os.name == "posix" and "asan" not in os.environ.get("LD_PRELOAD", "")
    return subprocess.run([sys.executable, "-c", code, "inspect", *args], capture_output=True, cwd=cwd, env=env,
                          timeout=_HANG_TIMEOUT_S, preexec_fn=_cap_memory if capped else None)


def _nested(depth: int) -> str:
    """EAGLE3 with one more key whose value nests ``depth - 1`` arrays (the object is depth 1)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return json.dumps(EAGLE3)[:-1] + f', "deep": {inner}}}'


# -- config.json: nesting, size, long integers ---------------------------------


def test_deep_nesting_is_a_metadata_error_naming_the_file(tmp_path: Path) -> None:
    p = _write(tmp_path, _nested(100_000))  # json itself raises RecursionError on this
    with pytest.raises(DrafterMetadataError, match=f"nested 100000 levels deep, deeper than the {MAX_CONFIG_DEPTH}") as e:
        DrafterInfo.from_hf_config(p, block_size=4)
    assert e.value.path == str(p)
    # the limit itself is accepted, one more is not
    p = _write(tmp_path, _nested(MAX_CONFIG_DEPTH))
    assert DrafterInfo.from_hf_config(p, block_size=4).n_ctx_train == EAGLE3["max_position_embeddings"]
    p = _write(tmp_path, _nested(MAX_CONFIG_DEPTH + 1))
    with pytest.raises(DrafterMetadataError, match=f"nested {MAX_CONFIG_DEPTH + 1} levels"):
        DrafterInfo.from_hf_config(p, block_size=4)
    # brackets (and escaped quotes) inside strings are text, not nesting
    text = json.dumps({**EAGLE3, "_name_or_path": '\\"' + "[{" * 10_000})
    assert DrafterInfo.from_hf_config(_write(tmp_path, text), block_size=4).name == '\\"' + "[{" * 10_000


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    body = json.dumps(EAGLE3)
    p = _write(tmp_path, body + " " * (MAX_CONFIG_BYTES - len(body)))  # exactly the limit: read
    assert DrafterInfo.from_hf_config(p, block_size=4).file_size == MAX_CONFIG_BYTES
    p = _write(tmp_path, body + " " * (MAX_CONFIG_BYTES + 1 - len(body)))
    with pytest.raises(DrafterMetadataError, match=f"larger than {MAX_CONFIG_BYTES} bytes") as e:
        DrafterInfo.from_hf_config(p, block_size=4)
    assert e.value.path == str(p)


def test_a_5000_digit_integer_names_the_file_and_the_key(tmp_path: Path) -> None:
    p = _write(tmp_path, json.dumps(EAGLE3)[:-1] + ', "max_position_embeddings": ' + "9" * 5000 + "}")
    with pytest.raises(DrafterMetadataError, match="max_position_embeddings must be an integer >= 1, got an integer "
                                                   "of 5000 digits") as e:
        DrafterInfo.from_hf_config(p, block_size=4)
    assert e.value.path == str(p) and str(e.value).startswith(f"{p}: ")
    # the longest integer read is read; one digit more is not
    n = int("9" * MAX_JSON_INT_DIGITS)
    p = _write(tmp_path, json.dumps({**EAGLE3, "max_position_embeddings": n}))
    assert DrafterInfo.from_hf_config(p, block_size=4).n_ctx_train == n
    p = _write(tmp_path, json.dumps({**EAGLE3, "max_position_embeddings": n * 10 + 9}))
    with pytest.raises(DrafterMetadataError, match=f"of {MAX_JSON_INT_DIGITS + 1} digits"):
        DrafterInfo.from_hf_config(p, block_size=4)
    # one in a key nothing reads is ignored
    p = _write(tmp_path, json.dumps(EAGLE3)[:-1] + ', "vocab_size": ' + "9" * 5000 + "}")
    assert DrafterInfo.from_hf_config(p, block_size=4).n_ctx_train == EAGLE3["max_position_embeddings"]


# -- text safe to print --------------------------------------------------------------


def test_a_lone_surrogate_architecture_prints_escaped(tmp_path: Path) -> None:
    name = "Eagle3\ud800\x1b[2J"  # a lone surrogate and a terminal escape
    _write(tmp_path, json.dumps({**EAGLE3, "architectures": [name], "_name_or_path": name}))
    info = DrafterInfo.from_hf_config(tmp_path, block_size=4)
    assert info.architecture == info.name == "Eagle3\\ud800\\x1b[2J"
    done = _inspect(str(tmp_path), "--block-size", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    rows = {ln.split()[0]: ln for ln in done.stdout.decode("utf-8").splitlines() if ln.split()}
    assert "Eagle3\\ud800\\x1b[2J" in rows["architecture"] and "\x1b" not in done.stdout.decode("utf-8")
    # a path that is not UTF-8 (its bytes decode to lone surrogates) prints escaped too
    odd = tmp_path / os.fsdecode(b"d\xff")
    odd.mkdir()
    _write(odd, json.dumps(EAGLE3))
    done = _inspect(str(odd), "--block-size", "4", cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert "d\\udcff" in done.stdout.decode("utf-8")


def test_gguf_text_is_printable_or_refused(tmp_path: Path) -> None:
    p = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv(**{"general.name": "q\x1b]0;x\x07"}))
    info = DrafterInfo.from_gguf(p)
    assert info.name == "q\\x1b]0;x\\x07" and info.name.isprintable()
    # the architecture spells every key looked up: refused, not guessed at
    p = write_gguf(tmp_path / "e.gguf", "dspark\x1b", dspark_kv())
    with pytest.raises(DrafterMetadataError, match=r"general.architecture 'dspark\\x1b' is not a printable name") as e:
        DrafterInfo.from_gguf(p)
    assert str(e.value).isprintable()


# -- regular files only --------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name,args", [("config.json", ("--block-size", "4")), ("drafter.gguf", ())])
def test_a_fifo_is_refused_never_opened(tmp_path: Path, name: str, args: tuple[str, ...]) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    done = _inspect(str(fifo), *args, cwd=tmp_path)  # on a FIFO, opening to read waits for a writer
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.startswith(f"dspark-core inspect: error: {fifo}: is a FIFO (named pipe)") and "Traceback" not in err
    with pytest.raises(DrafterMetadataError, match="only regular files are read"):
        if name.endswith(".json"):
            DrafterInfo.from_hf_config(fifo, block_size=4)
        else:
            DrafterInfo.from_gguf(fifo)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "config.json"
    link.symlink_to("/dev/zero")  # endless: read whole, it never ends (in a subprocess, under a memory cap)
    done = _inspect(str(tmp_path), "--block-size", "4", cwd=tmp_path)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.startswith(f"dspark-core inspect: error: {link}: is a device, not a config.json")
    with pytest.raises(DrafterMetadataError, match="is a device, not a GGUF file"):
        DrafterInfo.from_gguf("/dev/zero")


# -- GGUF header bounds ----------------------------------------------------------------


def _gguf_bytes(n_dims: int = 1, key_len: int | None = None, n_tensors: int = 1) -> bytes:
    """A little-endian GGUF v3: ``general.architecture = "dspark"`` and one tensor of ``n_dims``
    dimensions; ``key_len`` overrides the key's stated length, ``n_tensors`` the tensor count."""
    key = b"general.architecture"
    out = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, 1)
    out += struct.pack("<Q", len(key) if key_len is None else key_len) + key
    out += struct.pack("<IQ", 8, 6) + b"dspark"  # type 8: STRING
    out += struct.pack("<Q", 1) + b"t" + struct.pack("<I", n_dims) + struct.pack(f"<{n_dims}Q", *([1] * n_dims))
    out += struct.pack("<IQ", 0, 0)  # F32, at offset 0
    return out + b"\0" * (-len(out) % 32) + b"\0" * 32


@pytest.mark.parametrize("kw,match", [
    ({"n_tensors": MAX_GGUF_TENSORS + 1}, f"claims {MAX_GGUF_TENSORS + 1} tensors, more than the {MAX_GGUF_TENSORS}"),
    ({"key_len": MAX_GGUF_STRING_BYTES + 1}, f"length of {MAX_GGUF_STRING_BYTES + 1} exceeds the limit"),
    ({"n_dims": MAX_GGUF_TENSOR_DIMS + 1}, f"dimension count of {MAX_GGUF_TENSOR_DIMS + 1} exceeds the limit"),
])
def test_gguf_counts_and_lengths_are_bounded(tmp_path: Path, kw: dict[str, int], match: str) -> None:
    ok = tmp_path / "ok.gguf"
    ok.write_bytes(_gguf_bytes(n_dims=MAX_GGUF_TENSOR_DIMS))  # the builder is a GGUF: it fails later, on block_size
    with pytest.raises(DrafterMetadataError, match="missing block_size"):
        DrafterInfo.from_gguf(ok)
    p = tmp_path / "bad.gguf"
    p.write_bytes(_gguf_bytes(**kw))
    with pytest.raises(DrafterMetadataError, match=match) as e:
        DrafterInfo.from_gguf(p)
    assert e.value.path == str(p)


# -- inspect: every hostile file a clean error --------------------------------------


@pytest.mark.parametrize("text,problem", [
    (_nested(100_000), "nested 100000 levels deep"),
    (json.dumps(EAGLE3)[:-1] + ', "max_position_embeddings": ' + "1" * 5000 + "}",
     "max_position_embeddings must be an integer >= 1, got an integer of 5000 digits"),
    (json.dumps(EAGLE3) + " " * MAX_CONFIG_BYTES, f"larger than {MAX_CONFIG_BYTES} bytes"),
], ids=["deep", "long-int", "too-big"])
def test_inspect_prints_one_line_and_exits_2(tmp_path: Path, text: str, problem: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, text)
    assert main(["inspect", str(p), "--block-size", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"dspark-core inspect: error: {p}: {problem}")


# -- bool is no integer argument ---------------------------------------------------


def test_bool_arguments_are_type_errors(tmp_path: Path) -> None:
    p = _write(tmp_path, json.dumps(EAGLE3))
    for kw in ({"block_size": True}, {"block_size": 4, "n_ctx_train": True}, {"block_size": 4, "target_n_ctx": np.True_}):
        name = next(k for k, v in kw.items() if isinstance(v, (bool, np.bool_)))
        with pytest.raises(TypeError, match=f"{name} must be an integer, got bool"):
            DrafterInfo.from_hf_config(p, **kw)  # type: ignore[arg-type]
    g = write_gguf(tmp_path / "d.gguf", "dspark", dspark_kv())
    with pytest.raises(TypeError, match="n_ctx_train must be an integer, got bool"):
        DrafterInfo.from_gguf(g, n_ctx_train=True)
    # the constructor takes no bool or float for an integer field either (int(1.9) would be 1)
    with pytest.raises(TypeError, match="block_size must be an integer, got bool"):
        DrafterInfo(path="d", architecture="dspark", block_size=True)
    with pytest.raises(TypeError, match=r"target_layers\[1\] must be an integer, got float"):
        DrafterInfo(path="d", architecture="dspark", block_size=4, target_layers=(2, 1.9))  # type: ignore[arg-type]
    assert DrafterInfo(path="d", architecture="dspark", block_size=np.int32(4), target_layers=np.arange(3)) == \
        DrafterInfo(path="d", architecture="dspark", block_size=4, target_layers=(0, 1, 2))


# -- prometheus_text's arguments ---------------------------------------------------


def _stagers() -> list[object]:
    cfg = StagerConfig(feature_dim=32, block_size=3, window=13, max_seqs=3)
    out: list[object] = [Stager(cfg), ReferenceStager(cfg)]
    for st in out:
        for q in (0, 1):
            st.process(q, np.arange(4), np.ones((4, 32), np.float32))  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("bad", [[1.9], [True], ["1"], np.array([1.0]), "1", 1])
def test_prometheus_seqs_must_be_integers(bad: object) -> None:
    for st in _stagers():
        with pytest.raises(TypeError, match="prometheus_text: seqs must be"):
            prometheus_text(st, per_sequence=True, seqs=bad)  # type: ignore[arg-type]
    # worded as the Stager's own batch conversion words it
    core = _stagers()[0]
    if isinstance(bad, list) and not isinstance(bad[0], bool):
        with pytest.raises(TypeError) as own:
            core.accepted_many(bad)  # type: ignore[attr-defined]
        with pytest.raises(TypeError) as ours:
            prometheus_text(core, per_sequence=True, seqs=bad)  # type: ignore[arg-type]
        assert str(ours.value).replace("prometheus_text", "accepted_many") == str(own.value)


def test_prometheus_integer_seqs_and_other_arguments() -> None:
    for st in _stagers():
        text = prometheus_text(st, per_sequence=True, seqs=[1])
        assert prometheus_text(st, per_sequence=True, seqs=np.array([1], np.int32)) == text
        assert prometheus_text(st, per_sequence=True, seqs=(q for q in [1])) == text
        assert 'seq="1"' in text and 'seq="0"' not in text
        with pytest.raises(TypeError, match="per_sequence must be True or False"):
            prometheus_text(st, per_sequence="no")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="label 'model': its value .* is not encodable as UTF-8"):
            prometheus_text(st, labels={"model": "m\ud800"})
