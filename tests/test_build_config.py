"""What the build compiles for CUDA (csrc/cuda/CMakeLists.txt), checked by configuring the project.

DSPARK_CUDA=AUTO compiles the kernels for what is asked for or found: the
visible GPUs' architectures (nvidia-smi, here a stand-in script named by
DSPARK_NVIDIA_SMI), none when no GPU is visible (one line says so and how to
force them), the release list when asked for by name. Configure only: no
compile, no GPU needed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc") or os.environ.get("CUDACXX")
RELEASE = "75-real;80-real;90-real;100-real;120-real;121-real;90-virtual"

pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake is not on PATH (the build needs it)")


def configure(tmp_path: pathlib.Path, *args: str, smi_lines: list[str] | None = None,
              env: dict[str, str] | None = None, smi: bool = True) -> tuple[int, str, str]:
    """Configure the core (no tests) in a fresh build dir; returns (exit status, output, DSPARK_HAVE_CUDA).
    ``smi=False``: no stand-in nvidia-smi (the build looks for one on PATH)."""
    smi_path = tmp_path / "nvidia-smi"
    if smi_lines is None:
        smi_path.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")  # nvidia-smi without a GPU
    else:
        smi_path.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in smi_lines))
    smi_path.chmod(0o755)
    # CMake and nvcc are tools here, not code under test: a sanitizer's LD_PRELOAD (the fuzz step
    # runs this suite against an ASan build) would fail nvcc's compiler check and turn CUDA off.
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("CUDAARCHS", "DSPARK_CUDA", "LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    full_env.update(env or {})
    build = tmp_path / "build"
    r = subprocess.run(
        [CMAKE, "-S", str(ROOT), "-B", str(build), "-DDSPARK_BUILD_TESTS=OFF",
         *([f"-DDSPARK_NVIDIA_SMI={smi_path}"] if smi else []), *args],
        capture_output=True, text=True, env=full_env, timeout=600,
    )
    have = ""
    cache = build / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text().splitlines():
            if line.startswith("DSPARK_HAVE_CUDA:"):
                have = line.split("=", 1)[1]
    return r.returncode, r.stdout + r.stderr, have


def note(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "dspark: CUDA kernels" in ln]
    assert len(lines) == 1, out
    return lines[0]


def recorded(tmp_path: pathlib.Path) -> str:
    """The note the configure wrote for the package to install (dspark_core/_ext/build_note.txt)."""
    return (tmp_path / "build" / "dspark_build_note.txt").read_text(encoding="utf-8")


def test_auto_without_gpu_builds_no_kernels_and_says_how_to_force(tmp_path):
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=AUTO")
    assert rc == 0, out
    assert have == "OFF"
    line = note(out)
    assert "CUDA kernels: none" in line
    if NVCC:
        assert "nvidia-smi lists no GPU" in line and "DSPARK_CUDA=ON" in line
        assert "CUDAARCHS=" in line


def test_auto_builds_for_the_visible_gpus(tmp_path):
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=AUTO", smi_lines=["9.0", "8.6", "9.0"])
    assert rc == 0, out
    if NVCC:
        assert have == "ON"
        assert "architectures 86-real;90-real: the visible GPU (sm_86, sm_90, from nvidia-smi)" in note(out)
    else:
        assert have == "OFF" and "no CUDA compiler found" in note(out)


def test_named_architectures_win_over_the_gpu(tmp_path):
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=AUTO", "-DDSPARK_CUDA_ARCHITECTURES=release", smi_lines=["8.6"])
    assert rc == 0, out
    if NVCC:
        assert have == "ON" and f"architectures {RELEASE}: the release list" in note(out)
    (tmp_path / "build").rename(tmp_path / "first")
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=AUTO", env={"CUDAARCHS": "89-real"})
    assert rc == 0, out
    if NVCC:
        assert have == "ON" and "architectures 89-real: CUDAARCHS" in note(out)


def test_native_and_all_are_refused(tmp_path):
    rc, out, _ = configure(tmp_path, "-DDSPARK_CUDA=AUTO", "-DDSPARK_CUDA_ARCHITECTURES=native")
    assert rc != 0
    assert "'native'/'all'/'all-major' are not allowed" in " ".join(out.split())


def test_off_builds_nothing(tmp_path):
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=OFF", smi_lines=["9.0"])
    assert rc == 0, out
    assert have == "OFF" and "CUDA kernels: none (DSPARK_CUDA=OFF)" in note(out)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (DSPARK_CUDA=ON requires a CUDA compiler)")
def test_on_without_gpu_builds_every_release_architecture(tmp_path):
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=ON")
    assert rc == 0, out
    assert have == "ON"
    assert f"architectures {RELEASE}: DSPARK_CUDA=ON and no GPU visible: every release architecture" in note(out)


def test_auto_without_nvidia_smi_says_so(tmp_path):
    """No stand-in and no nvidia-smi on PATH: the line names that cause (and nvcc when it is there)."""
    dirs = {str(pathlib.Path(p).parent) for p in (CMAKE, NVCC, shutil.which("cc"), shutil.which("c++")) if p}
    path = os.pathsep.join(sorted(dirs))
    if shutil.which("nvidia-smi", path=path):
        pytest.skip("nvidia-smi lies beside cmake / nvcc / cc here")
    rc, out, have = configure(tmp_path, "-DDSPARK_CUDA=AUTO", smi=False, env={"PATH": path})
    assert rc == 0, out
    assert have == "OFF"
    line = note(out)
    assert "CUDA kernels: none" in line and "no nvidia-smi on PATH" in line
    if NVCC:
        assert "nvcc at " in line
        assert "DSPARK_CUDA=ON for pip install, -DDSPARK_CUDA=ON for cmake" in line


# -- the note kept where it can be read back: a redirected or CI build never shows the terminal line


@pytest.mark.parametrize("mode", ["OFF", "AUTO", "EMULATE"])
def test_the_note_is_recorded_for_the_package_word_for_word(tmp_path, mode):
    rc, out, _ = configure(tmp_path, f"-DDSPARK_CUDA={mode}")
    assert rc == 0, out
    line = note(out)
    assert recorded(tmp_path) == line[line.index("dspark: ") + len("dspark: "):] + "\n"
    # A configure in another mode rewrites it (the note of the build that ran last).
    (tmp_path / "build" / "CMakeCache.txt").unlink()
    other = "EMULATE" if mode == "OFF" else "OFF"
    rc, out, _ = configure(tmp_path, f"-DDSPARK_CUDA={other}")
    assert rc == 0, out
    assert recorded(tmp_path).startswith("CUDA kernels: " + ("emulated" if other == "EMULATE" else "none"))


def test_the_installed_package_holds_its_builds_note_and_the_cli_prints_it(capsys):
    import importlib.util
    import json

    from dspark_core.cuda.build_note import build_note
    from dspark_core.cli import main as cli_main

    got = build_note()
    assert got is not None and got.startswith("CUDA kernels: ") and "\n" not in got
    # The note agrees with what the build made: the _cuda extension exists unless it says "none".
    assert (importlib.util.find_spec("dspark_core._ext._cuda") is not None) == (not got.startswith("CUDA kernels: none"))
    assert cli_main(["kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"build: {got}"
    assert cli_main(["kernels", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["build"] == got
