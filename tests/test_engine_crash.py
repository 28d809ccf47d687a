"""A crash-prone llama.cpp build: detection, the child-process first decode, the CLI's message.

A llama-cpp-python built with the host's native flags on a CPU with AMX runs
llama.cpp's AMX kernels, which segfault in the first decode of some models:
``dspark-core capture`` would die without a word. This machine need not have
AMX, so the detection is tested on given CPU flags and engine system info
(the formats Linux and llama.cpp print), and the child-process guard on a
stand-in ``llama_cpp`` package whose first decode really segfaults.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_core.cli import capture
from dspark_core.engines import llama_cpp as eng

SRC = str(Path(eng.__file__).resolve().parents[2])

# What llama.cpp's llama_print_system_info() says for a portable build and for a native
# build on an AMX host (the features ggml-cpu reports).
PORTABLE_INFO = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
NATIVE_AMX_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                   "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
                   "OPENMP = 1 | REPACK = 1 | ")
CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 {amx} arch_capabilities
"""
SAPPHIRE_RAPIDS = CPUINFO.format(amx="amx_bf16 amx_tile amx_int8")
NO_AMX = CPUINFO.format(amx="")
AMX_FLAGS = eng.cpu_flags(SAPPHIRE_RAPIDS)
NO_AMX_FLAGS = eng.cpu_flags(NO_AMX)


def test_cpu_flags_are_read_from_cpuinfo():
    assert {"amx_tile", "amx_int8", "avx512f"} <= eng.cpu_flags(SAPPHIRE_RAPIDS)
    assert "amx_tile" not in eng.cpu_flags(NO_AMX)
    assert eng.cpu_flags("processor\t: 0\n") == frozenset()
    assert isinstance(eng.cpu_flags(), frozenset)  # this machine's, whatever it has


def test_engine_features_parse_the_system_info_line():
    f = eng.engine_features(NATIVE_AMX_INFO)
    assert f["AMX_INT8"] == "1" and f["SSE3"] == "1" and f["AVX512_BF16"] == "1"
    assert "AMX_INT8" not in eng.engine_features(PORTABLE_INFO)
    assert eng.engine_features("") == {}


@pytest.mark.parametrize(("cpuinfo", "info", "prone"), [
    (SAPPHIRE_RAPIDS, NATIVE_AMX_INFO, True),   # the trap: native build on an AMX host
    (SAPPHIRE_RAPIDS, PORTABLE_INFO, False),    # built with -DGGML_NATIVE=OFF: no AMX kernels
    (NO_AMX, NATIVE_AMX_INFO, False),           # AMX code, but this CPU cannot run it anyway
    (NO_AMX, PORTABLE_INFO, False),
    (SAPPHIRE_RAPIDS, NATIVE_AMX_INFO.replace("AMX_INT8 = 1", "AMX_INT8 = 0"), False),
])
def test_crash_prone_build_needs_an_amx_cpu_and_a_native_amx_engine(cpuinfo, info, prone):
    why = eng.crash_prone_build(eng.cpu_flags(cpuinfo), info)
    assert (why is not None) == prone
    if prone:
        assert "amx_int8" in why and "AMX_INT8 = 1" in why


def test_the_installed_engine_on_this_machine():
    pytest.importorskip("llama_cpp")
    info = eng.system_info()
    assert "CPU" in info and eng.engine_features(info)
    # A build on this machine is prone only where the CPU has AMX and the build uses it.
    amx = any(f.startswith("amx") for f in eng.cpu_flags())
    assert (eng.crash_prone_build(eng.cpu_flags(), info) is not None) == (
        amx and eng.engine_features(info).get("AMX_INT8") == "1")


# -- the child-process guard ------------------------------------------------------------

STAND_IN = '''"""A stand-in llama_cpp whose first decode does what the AMX kernels do: {what}."""
import ctypes


def llama_print_system_info():
    return {info!r}


class Llama:
    def __init__(self, model_path, **kwargs):
        self.model_path = model_path

    def tokenize(self, text, add_bos=True):
        return [2, 651, 1370]

    def eval(self, tokens):
        {body}
'''
BODIES = {
    "segfault": ("segfault", "ctypes.string_at(0)  # reads address 0: SIGSEGV"),
    "fine": ("nothing wrong", "return None"),
    "raises": ("raise a Python error", "raise RuntimeError('llama_decode returned -1')"),
}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """``make(kind)``: a stand-in llama_cpp package first on the children's PYTHONPATH, and a model file."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")

    def make(kind: str, info: str = NATIVE_AMX_INFO) -> Path:
        what, body = BODIES[kind]
        pkg = tmp_path / kind / "llama_cpp"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(STAND_IN.format(what=what, info=info.encode(), body=body))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg.parent), SRC]))
        # The child is the stand-in engine, not code under test: no sanitizer runtime preloaded
        # into it (ASan would turn its SIGSEGV into an abort).
        monkeypatch.delenv("LD_PRELOAD", raising=False)
        return model

    return make


def test_a_first_decode_that_segfaults_is_seen_from_the_parent(stand_in):
    model = stand_in("segfault")
    r = eng.probe_first_decode(model, n_threads=1)
    assert r.crashed and r.returncode == -11 and r.signal_name == "SIGSEGV"
    msg = eng.crash_message(model, r, None)
    assert "killed by SIGSEGV" in msg and "model.gguf" in msg and "AMX" in msg
    assert '-DGGML_NATIVE=OFF' in msg and "--no-binary llama-cpp-python" in msg
    assert eng.portable_build_command("0.3.36").endswith(" llama-cpp-python==0.3.36")


def test_a_first_decode_that_survives_or_fails_is_not_a_crash(stand_in):
    ok = eng.probe_first_decode(stand_in("fine"), n_threads=1)
    assert ok.returncode == 0 and not ok.crashed
    bad = eng.probe_first_decode(stand_in("raises"), n_threads=1)
    assert bad.returncode == 1 and not bad.crashed and "llama_decode returned -1" in bad.stderr


def test_check_engine_probes_a_prone_build_and_names_the_fix(stand_in, monkeypatch):
    model = stand_in("segfault")
    monkeypatch.setattr(eng, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(eng, "system_info", lambda: NATIVE_AMX_INFO)
    said: list[str] = []
    with pytest.raises(eng.EngineCrash, match=r"SIGSEGV.*this CPU has AMX.*AMX_INT8 = 1.*GGML_NATIVE=OFF"):
        capture.check_engine(str(model), "auto", threads=1, say=said.append)
    assert said and "known to crash on this CPU" in said[0]


def test_check_engine_starts_no_child_unless_asked_or_prone(stand_in, monkeypatch):
    model = stand_in("segfault")

    def no_child(*a, **k):
        raise AssertionError("no first decode should be probed")

    monkeypatch.setattr(eng, "probe_first_decode", no_child)
    monkeypatch.setattr(eng, "system_info", lambda: NATIVE_AMX_INFO)
    monkeypatch.setattr(eng, "cpu_flags", lambda: NO_AMX_FLAGS)
    assert capture.check_engine(str(model), "auto") is None
    monkeypatch.setattr(eng, "cpu_flags", lambda: AMX_FLAGS)
    assert capture.check_engine(str(model), "never") is None
    with pytest.raises(ValueError, match="engine check must be one of"):
        capture.check_engine(str(model), "sometimes")


def test_check_engine_lets_a_surviving_prone_build_go_on(stand_in, monkeypatch, caplog):
    model = stand_in("fine")
    monkeypatch.setattr(eng, "cpu_flags", lambda: AMX_FLAGS)
    monkeypatch.setattr(eng, "system_info", lambda: NATIVE_AMX_INFO)
    with caplog.at_level("WARNING", logger="dspark_core"):
        assert "AMX" in capture.check_engine(str(model), "auto", threads=1)
    assert "survived in a child process" in caplog.text


def test_capture_command_reports_a_crashing_engine_instead_of_dying(stand_in):
    """The whole command, as a user runs it, with the stand-in engine: exit status 2 and the fix."""
    preload = os.environ.get("LD_PRELOAD")  # a sanitized build of the extension needs its runtime first
    model = stand_in("segfault")
    env = dict(os.environ, **({"LD_PRELOAD": preload} if preload else {}))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from dspark_core.cli import main; sys.exit(main())", "capture",
         "--target", str(model), "--engine-check", "always", "-q"], capture_output=True, text=True, timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    # (Under a preloaded sanitizer runtime the child's segfault becomes its abort.)
    assert re.search(r"killed by SIG(SEGV|ABRT) in its first decode of model\.gguf", proc.stderr), proc.stderr
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in proc.stderr
