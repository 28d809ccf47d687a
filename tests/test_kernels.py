"""The kernel dispatch registry from Python (``dspark_core.kernels``): one list
of families and paths read from the core, one switch, one environment variable
(``DSPARK_SIMD``, with the deprecated ``DSPARK_CRC32C``), the dispatch table."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from dspark_core import Stager, StagerConfig, formats, kernels
from dspark_core.stager import snapshot_format as sf
from dspark_core.cli import main as cli_main

#: The paths each architecture's build has, besides the portable one.
ARCH_PATHS = {
    "x86_64": {"row_format": ("avx2", "avx512"), "crc32c": ("sse4.2",)},
    "aarch64": {"row_format": ("neon", "neon-bf16"), "crc32c": ("armv8-crc",)},
}
MACHINE = platform.machine().lower().replace("amd64", "x86_64").replace("arm64", "aarch64")


def test_families_and_paths_come_from_the_core() -> None:
    assert kernels.FAMILIES == ("row_format", "crc32c")
    assert kernels.ENV == "DSPARK_SIMD"
    assert kernels.paths("row_format") == ("scalar", "avx2", "avx512", "neon", "neon-bf16")
    assert kernels.paths("crc32c") == ("portable", "sse4.2", "armv8-crc")
    names = [n for f in kernels.FAMILIES for n in kernels.paths(f)]
    assert len(names) == len(set(names)), "a DSPARK_SIMD name must pick one family's path"


@pytest.mark.parametrize("family", kernels.FAMILIES)
def test_supported_paths_are_this_architectures(family: str) -> None:
    sup = kernels.supported(family)
    assert sup[0] == kernels.paths(family)[0]
    assert set(sup) <= set(kernels.paths(family))
    assert kernels.best(family) == sup[-1]
    assert kernels.active(family) in sup
    own = ARCH_PATHS.get(MACHINE, {}).get(family, ())
    others = {p for arch, fams in ARCH_PATHS.items() if arch != MACHINE for p in fams[family]}
    assert not others & set(sup), f"{family}: another architecture's path is supported here: {sup}"
    assert set(sup[1:]) <= set(own)


@pytest.mark.parametrize("family", kernels.FAMILIES)
def test_set_path_and_use_switch_and_restore(family: str) -> None:
    before = kernels.active(family)
    for name in kernels.supported(family):
        with kernels.use(family, name):
            assert kernels.active(family) == name
            assert kernels.dispatch_table()[family]
        assert kernels.active(family) == before
    with kernels.use(family, "SCALAR"):  # case-insensitive; "scalar" is every family's portable path
        assert kernels.active(family) == kernels.paths(family)[0]


@pytest.mark.parametrize("storage", ["f16", "q8_0", "q4_0"])
def test_the_stager_runs_every_path_to_the_same_bytes(storage: str) -> None:
    # Through the Stager (the one registry: tests/test_one_core.py), on every row-format x CRC-32C path:
    # the stored rows are the formats module's encoding, the staged rows its decoding, and the
    # snapshot's checksums the pure-Python CRC-32C's (snapshot_format).
    rows = np.random.default_rng(3).standard_normal((40, 256), dtype=np.float32)
    rows[:, 5] *= np.float32(2e3)  # a massive channel
    want_rows = formats.quantize_rows(rows, storage).tobytes()
    for fmt in kernels.supported("row_format"):
        for crc in kernels.supported("crc32c"):
            with kernels.use("row_format", fmt), kernels.use("crc32c", crc):
                st = Stager(StagerConfig(feature_dim=256, block_size=4, window=64, storage=storage, max_seqs=1))
                st.process(0, np.arange(40), rows)
                snap = bytes(st.snapshot(0))
                plan = st.draft(0, 40)
                staged = plan.rows.copy()  # decoded on the Stager's path
            assert plan.skip is None and len(staged) > 0
            assert staged.tobytes() == formats.dequantize_rows(plan.encoded_rows, storage, 256).tobytes(), (fmt, crc)
            body = snap[sf.HEADER_BYTES:]
            assert body == want_rows, (fmt, crc)
            assert int.from_bytes(snap[sf.ROWS_CRC_AT:sf.ROWS_CRC_AT + 4], "little") == sf.crc32c(body), (fmt, crc)
            assert int.from_bytes(snap[sf.HEADER_CRC_AT:sf.HEADER_CRC_AT + 4], "little") == \
                sf.crc32c(snap[:sf.HEADER_CRC_AT]), (fmt, crc)


def test_rejected_switches_change_nothing() -> None:
    before = {f: kernels.active(f) for f in kernels.FAMILIES}
    with pytest.raises(ValueError, match="unknown row_format path 'sve'"):
        kernels.set_path("row_format", "sve")
    with pytest.raises(ValueError, match="unknown kernel family 'gemm'"):
        kernels.set_path("gemm", "scalar")
    with pytest.raises(ValueError, match="unknown crc32c path 'avx2'"):
        kernels.set_path("crc32c", "avx2")  # another family's path
    for family in kernels.FAMILIES:
        for name in set(kernels.paths(family)) - set(kernels.supported(family)):
            with pytest.raises(ValueError, match="not supported on this CPU"):
                kernels.set_path(family, name)
    with pytest.raises(TypeError, match="name"):
        kernels.set_path("row_format", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="family"):
        kernels.active(3)  # type: ignore[arg-type]
    assert {f: kernels.active(f) for f in kernels.FAMILIES} == before


def test_formats_switch_is_the_row_format_family() -> None:
    assert formats.simd_paths() == kernels.supported("row_format")
    assert formats.best_simd_path() == kernels.best("row_format")
    with formats.simd_path("scalar"):
        assert kernels.active("row_format") == "scalar"
        assert set(kernels.dispatch_table()["row_format"].values()) == {"scalar"}
    assert formats.active_simd_path() == kernels.active("row_format")


def test_dispatch_table_names_every_kernel_and_a_supported_path() -> None:
    table = kernels.dispatch_table()
    assert list(table) == list(kernels.FAMILIES)
    assert list(table["row_format"]) == [
        "f32->f16", "f32->bf16", "f16->f32", "bf16->f32", "q8_0 encode", "q4_0 encode",
        "q8_0 decode", "q4_0 decode", "unencodable scan", "f32 copy+scan", "stream copy",
    ]
    assert list(table["crc32c"]) == ["crc32c", "crc32c copy"]
    for family, row in table.items():
        for path in row.values():
            assert path in kernels.supported(family)
    if "avx512" in kernels.supported("row_format"):
        with kernels.use("row_format", "avx512"):
            row = kernels.dispatch_table()["row_format"]
        # The AVX-512 table decodes with the AVX2 kernels (unaligned 64-byte stores cost more).
        assert row["q8_0 decode"] == row["f16->f32"] == "avx2"
        assert row["stream copy"] == "avx2"  # 256-bit streaming stores, aligned by a peel
        assert row["q8_0 encode"] == "avx512"


def test_cli_prints_the_dispatch_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["kernels", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["families"]["crc32c"]["active"] == kernels.active("crc32c")
    assert out["families"]["row_format"]["kernels"] == kernels.dispatch_table()["row_format"]
    assert cli_main(["kernels"]) == 0
    text = capsys.readouterr().out
    assert f"row_format: supported {', '.join(kernels.supported('row_format'))}" in text


# -- DSPARK_SIMD / DSPARK_CRC32C, read when a process starts ---------------------


def _start(env: dict[str, str]) -> subprocess.CompletedProcess:
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import numpy as np\n"
        "from dspark_core import formats, kernels\n"
        "x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)\n"
        "print(kernels.active('row_format'), kernels.active('crc32c'), formats.quantize_rows(x, 'q4_0').tobytes().hex())\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("DSPARK_SIMD", "DSPARK_CRC32C")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)


def _q4_bytes() -> str:
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    return formats.quantize_rows(x, "q4_0").tobytes().hex()


@pytest.mark.parametrize("family", kernels.FAMILIES)
def test_env_forces_each_supported_path(family: str) -> None:
    other = [f for f in kernels.FAMILIES if f != family][0]
    for name in kernels.supported(family):
        r = _start({"DSPARK_SIMD": name})
        assert r.returncode == 0, r.stderr
        assert "Warning" not in r.stderr, r.stderr
        got = dict(zip(kernels.FAMILIES, r.stdout.split()[:2]))
        assert got[family] == name
        if name != "scalar":  # "scalar" names every family's portable path
            assert got[other] == kernels.best(other)
        assert r.stdout.split()[2] == _q4_bytes()


def test_env_list_sets_several_families() -> None:
    row, crc = kernels.supported("row_format")[-1], kernels.paths("crc32c")[0]
    r = _start({"DSPARK_SIMD": f" {row.upper()} ,{crc}"})
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr
    assert r.stdout.split()[:2] == [row, crc]


@pytest.mark.parametrize("value, why", [("sve2", "names no kernel path"), ("scalar,bogus", "names no kernel path")])
def test_env_unknown_names_warn_and_the_rest_apply(value: str, why: str) -> None:
    r = _start({"DSPARK_SIMD": value})
    assert r.returncode == 0, r.stderr
    assert f"RuntimeWarning: DSPARK_SIMD={value!r} {why}" in r.stderr
    assert "valid values: scalar, avx2, avx512, neon, neon-bf16, portable, sse4.2, armv8-crc" in r.stderr
    want = "scalar" if "scalar" in value else kernels.best("row_format")
    assert r.stdout.split()[0] == want


def test_env_other_architectures_path_warns_as_unsupported() -> None:
    other = "neon" if MACHINE != "aarch64" else "avx2"
    r = _start({"DSPARK_SIMD": other})
    assert r.returncode == 0, r.stderr
    assert f"DSPARK_SIMD={other!r} names a path this CPU / build does not support" in r.stderr
    assert r.stdout.split()[:2] == [kernels.best("row_format"), kernels.best("crc32c")]


def test_deprecated_crc_variable_still_works_with_a_future_warning() -> None:
    r = _start({"DSPARK_CRC32C": "portable"})
    assert r.returncode == 0, r.stderr
    assert "FutureWarning: DSPARK_CRC32C is deprecated" in r.stderr
    assert r.stdout.split()[:2] == [kernels.best("row_format"), "portable"]
