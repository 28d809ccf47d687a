"""Every name importable from the flat layout (0.1.0) still imports from its old path.

The table below lists each public module of the flat layout and its public
names there (generated once from that tree's sources). Modules that moved
stay importable at their old path with a DeprecationWarning naming the new
one; modules that kept their path import without one. Every path in
``MOVED`` (the flat layout's, then the top level's grouped by concept) is
checked the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest

from dspark_core._old_paths import MOVED

OLD_PUBLIC_NAMES: dict[str, tuple[str, ...]] = {
    'dspark_core': ('BatchPlan', 'ConfigError', 'ContextPlan', 'DrafterInfo', 'DrafterMetadataError', 'STORAGES', 'StagePlan', 'Stager', 'StagerConfig', 'StateError', 'TRIM_CHUNK', '__version__', 'dequantize_rows', 'plan_context', 'quantize_rows', 'row_bytes'),
    'dspark_core._args': ('MAX_POSITION', 'ROW_DTYPES', 'as_count', 'as_encoded', 'as_index', 'as_positions', 'as_rows', 'row_dtype_code'),
    'dspark_core._row_format': ('active_simd_path', 'best_simd_path', 'decode', 'encode', 'find_nonfinite', 'row_bytes', 'set_simd_path', 'simd_paths', 'storage_out_dtype'),
    'dspark_core._stager': ('MAX_POSITION', 'Stager', 'TRIM_CHUNK'),
    'dspark_core.cli': ('COMMANDS', 'build_parser', 'main'),
    'dspark_core.commands': (),
    'dspark_core.commands.fuzz': ('add_parser', 'run'),
    'dspark_core.commands.inspect': ('add_parser', 'run'),
    'dspark_core.commands.simulate': ('DEFAULTS', 'add_parser', 'format_table', 'logger', 'make_stager', 'run', 'simulate'),
    'dspark_core.config': ('MAX_FEATURE_DIM', 'MAX_SEQS_LIMIT', 'MAX_WINDOW', 'NONFINITE_POLICIES', 'STAGE_DTYPES', 'STORAGES', 'StagerConfig', 'TRIM_CHUNK', 'positive_int', 'stage_dtype_name', 'storage_row_bytes', 'window_for'),
    'dspark_core.context_plan': ('ContextPlan', 'WINDOW_CAP_ENV', 'format_table', 'logger', 'plan_context', 'row_bytes'),
    'dspark_core.cuda': ('DeviceArray', 'available', 'dequantize_rows', 'device_count', 'emulated', 'quantize_rows', 'storage_dtype_name', 'unavailable_reason', 'upload_plan'),
    'dspark_core.drafter_info': ('DrafterInfo', 'DrafterMetadataError', 'PLACEHOLDER_CONTEXT_LENGTH', 'inherited_context_warning', 'logger'),
    'dspark_core.errors': ('ConfigError', 'StateError'),
    'dspark_core.formats': ('NONFINITE_POLICIES', 'STORAGES', 'active_simd_path', 'best_simd_path', 'dequantize_rows', 'find_nonfinite', 'quantize_rows', 'row_bytes', 'set_simd_path', 'simd_path', 'simd_paths', 'storage_dtype'),
    'dspark_core.fuzz': ('FLOAT_EDGE_BITS', 'TARGETS', 'build_parser', 'float_edge_dictionary', 'main', 'replay', 'run', 'target_decode', 'target_ops', 'target_snapshot'),
    'dspark_core.loop': ('Drafter', 'DrafterError', 'LoopResult', 'RecomputeMismatch', 'SequenceResult', 'SpeculativeLoop', 'Target', 'TargetOutput', 'logger'),
    'dspark_core.reference': ('FAIL_STAGES', 'ReferenceStager', 'SEMANTIC_STATS', 'logger'),
    'dspark_core.reference_formats': ('STORAGES', 'apply_nonfinite', 'decode', 'encode'),
    'dspark_core.snapshot_format': ('FLAG_ACCEPT_OPEN', 'FLAG_BITS', 'FLAG_DISABLED', 'FLAG_FIRST_ROUND', 'FLAG_OWED', 'FLAG_STARTED', 'HEADER_BYTES', 'MAGIC', 'SnapshotState', 'VERSION', 'pack', 'unpack'),
    'dspark_core.stage_plan': ('BatchPlan', 'DISABLED_WARNING', 'FAIL_STAGES', 'SKIP_REASONS', 'StagePlan'),
    'dspark_core.testing': ('ALLOWED_ERRORS', 'CONFIG_BYTES', 'Call', 'Desync', 'InvariantChecker', 'InvariantViolation', 'MAX_OPS', 'OPS', 'OP_BYTES', 'Op', 'RunReport', 'check_invariants', 'check_plan', 'decode_config', 'decode_ops', 'encode_config', 'encode_ops', 'make_rows', 'run_differential'),
    'dspark_core.toy': ('DrafterFailure', 'FlakyDrafter', 'TargetOutput', 'ToyDrafter', 'ToyTarget', 'greedy_reference', 'logger', 'rope'),
}


def _fresh_import(name: str):
    """Import ``name`` as if for the first time (an alias is served once per process)."""
    if name in MOVED:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and child in vars(sys.modules[parent]):
            delattr(sys.modules[parent], child)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(OLD_PUBLIC_NAMES))
def test_old_module_paths_import_every_old_name(old):
    module, deprecations = _fresh_import(old)
    if old in MOVED:
        assert module is importlib.import_module(MOVED[old])
        assert any(MOVED[old] in str(w.message) for w in deprecations), [str(w.message) for w in deprecations]
    else:
        assert not deprecations, [str(w.message) for w in deprecations]
    missing = [n for n in OLD_PUBLIC_NAMES[old] if not hasattr(module, n)]
    assert not missing, f"{old} lost {missing}"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_is_its_new_module_with_a_warning_naming_it(old):
    new = MOVED[old]
    if new.endswith("_cuda") and importlib.util.find_spec(new) is None:
        pytest.skip("optional extension (DSPARK_CUDA builds only)")
    module, deprecations = _fresh_import(old)
    assert module is importlib.import_module(new)
    assert any(f"{old} moved to {new}" in str(w.message) for w in deprecations), [str(w.message) for w in deprecations]


def test_a_stager_pickled_under_the_old_paths_still_loads():
    """A pickled Stager names its config's and its rebuild function's modules; one pickled before
    they moved (dspark_core.config, dspark_core.stager_copy) loads through the old paths."""
    from dspark_core import Stager, StagerConfig

    st = Stager(StagerConfig(feature_dim=32, window=64, block_size=4))
    st.process(0, list(range(5)), np.arange(5 * 32, dtype=np.float32).reshape(5, 32))
    data = pickle.dumps(st, protocol=0)  # text opcodes: module names are plain lines
    old = data.replace(b"dspark_core.stager.pickling\n", b"dspark_core.stager_copy\n")
    old = old.replace(b"dspark_core.stager.config\n", b"dspark_core.config\n")
    assert old != data and b"dspark_core.stager." not in old
    for name in ("dspark_core.config", "dspark_core.stager_copy"):
        _fresh_import(name)  # served anew, so the load below goes through the finder
        sys.modules.pop(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin = pickle.loads(old)
    messages = " ".join(str(w.message) for w in caught if issubclass(w.category, DeprecationWarning))
    assert "dspark_core.stager.pickling" in messages and "dspark_core.stager.config" in messages, messages
    restored = Stager(st.config)
    restored.restore(0, st.snapshot(0))
    assert twin.config == st.config and twin.snapshot(0) == restored.snapshot(0)  # as a new-path pickle loads


def test_from_import_of_an_old_path_warns_and_works():
    sys.modules.pop("dspark_core.toy", None)
    with pytest.warns(DeprecationWarning, match="dspark_core.sim.toy"):
        from dspark_core.toy import ToyTarget
    from dspark_core.sim.toy import ToyTarget as new

    assert ToyTarget is new


def test_every_moved_path_is_a_real_module():
    for old, new in MOVED.items():
        if new.endswith("_cuda"):
            continue  # optional extension (DSPARK_CUDA builds only)
        assert importlib.import_module(new).__name__ == new, old


def test_old_fuzz_entry_point_runs_as_main():
    """``python -m dspark_core.fuzz`` (CI scripts, docs of 0.1.0) still runs the fuzz CLI."""
    out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "dspark_core.fuzz", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--target" in out.stdout
    assert "dspark_core.testing.fuzz" in out.stderr  # the deprecation names the new path


def test_cuda_emulated_is_deprecated_test_infrastructure():
    from dspark_core import cuda

    assert "emulated" not in cuda.__all__
    with pytest.warns(DeprecationWarning, match="test infrastructure"):
        assert cuda.emulated() == cuda._emulated()
