"""Data flows one way: no module of the package imports a layer above its own (tests/layering.py)."""

from __future__ import annotations

import layering


def test_no_module_imports_a_higher_layer():
    assert layering.violations() == []


def test_the_graph_sees_every_module_and_real_edges():
    g = layering.graph()
    # Every source file is in the graph, under the layer its path says.
    for expected in ("_ext._stager", "_ext._row_format", "core_tables", "reference.stager", "testing.fuzz",
                     "sim.loop", "cli.simulate", ""):
        assert expected in g
    # Known edges are found (top-level, lazy and Cython imports), so an empty violation list means something.
    assert "_ext._row_format" in g["core_tables"]
    assert "config" in g["_ext._stager"] and "stage_plan" in g["_ext._stager"]  # .pyx imports
    assert "testing" in g["testing.fuzz"]  # lazy, function-level imports
    assert "reference" in g["cli.simulate"]


def test_an_upward_import_is_reported():
    fake = {"_ext._stager": {"formats"}, "formats": {"_ext._row_format"}}
    assert layering.violations(fake) == ["_ext._stager (layer 3) imports formats (layer 4)"]


def test_every_extension_has_a_stub():
    """py.typed is shipped: each Cython module has a .pyi (checked against the build by stubtest in CI)."""
    ext = layering.ROOT / "_ext"
    sources = sorted(p.stem for p in ext.glob("*.pyx"))
    assert sources == ["_cuda", "_row_format", "_stager"]
    assert all((ext / f"{name}.pyi").is_file() for name in sources)
