"""The reference twin's configuration rules (reference/config.py) against ``StagerConfig``'s.

The twin must not borrow the core's option checks to be their oracle, so it
has its own; here every configuration of a seeded random grid of ordinary,
boundary and wrong values is refused by both with the same message, or
accepted by both. A ReferenceStager checks its configuration with its own
rules.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dspark_core import ConfigError, StagerConfig
from dspark_core.reference import ReferenceStager
from dspark_core.reference.config import MAX_FEATURE_DIM, MAX_SEQS, MAX_WINDOW, check_config

DEFAULTS = dict(feature_dim=64, block_size=4, window=32, max_seqs=2, storage="q8_0", max_failures=3,
                stage_dtype="float32", nonfinite="error", strict=False, rows="held", kind="block")
BIG = [2**62, 2**63 - 1, 2**63, 2**70, -(2**63), -(2**70)]
CHOICES = {
    "feature_dim": [64, 32, 48, 1, 0, -1, 33, MAX_FEATURE_DIM, MAX_FEATURE_DIM + 32, True, 64.0, "64", None, *BIG],
    "block_size": [4, 1, 0, -3, 16, 17, 2**29, np.int64(4), *BIG],
    "window": [32, 8, 9, 33, 34, 0, -1, MAX_WINDOW, MAX_WINDOW + 1, np.int32(40), 32.5, *BIG],
    "max_seqs": [2, 1, 0, MAX_SEQS, MAX_SEQS + 1, -5, "2", *BIG],
    "storage": ["q8_0", "q4_0", "f32", "f16", "bf16", "q5_0", "F32", None],
    "max_failures": [3, 1, 0, -1, 2**40, None, *BIG],
    "stage_dtype": ["float32", "float16", "bfloat16", np.float16, np.float32, "int8", np.int32, object(), 3],
    "nonfinite": ["error", "zero", "clamp", "clamp_f16", "raise", None],
    "strict": [False, True, 1, None],
    "rows": ["held", "external", "device", None],
    "kind": ["block", "chain", "tree", "Chain", None],
}


def outcome(make, kw):
    try:
        make(kw)
    except ConfigError as exc:
        return str(exc)
    return None


def configs(n: int, seed: int):
    """Configurations that change a few fields at a time from usable defaults (each rule is reached
    with the earlier ones passing) and some that change many."""
    rng = np.random.default_rng(seed)
    names = list(CHOICES)
    for i in range(n):
        kw = dict(DEFAULTS)
        for name in rng.choice(names, size=int(rng.integers(1, 4 if i % 4 else len(names))), replace=False):
            options = CHOICES[str(name)]
            kw[str(name)] = options[int(rng.integers(len(options)))]
        yield kw


def test_every_configuration_is_refused_or_taken_alike():
    refused = 0
    for kw in configs(3000, 7):
        core = outcome(lambda k: StagerConfig(**k), kw)
        twin = outcome(lambda k: check_config(SimpleNamespace(**k)), kw)
        assert twin == core, kw
        refused += core is not None
    assert 1000 < refused < 2900  # the grid reaches both outcomes, often


@pytest.mark.parametrize("field, value, fragment", [
    ("window", 8, "window (8) must be greater than 2 * block_size (2 * 4 = 8)"),
    ("window", MAX_WINDOW + 1, "must be <= 2**30"),
    ("feature_dim", MAX_FEATURE_DIM + 32, "must be <= 2**28"),
    ("max_seqs", MAX_SEQS + 1, f"exceeds the limit {MAX_SEQS}"),
    ("feature_dim", 48, "needs feature_dim % 32 == 0"),
    ("max_failures", 0, "max_failures must be >= 1, got 0"),
    # 2 * block_size beyond int64: the core once computed it in int64 and let any window pass.
    ("block_size", 2**62, f"window (32) must be greater than 2 * block_size (2 * {2**62} = {2**63})"),
    ("block_size", 2**70, f"(2 * {2**63 - 1} = {2**64 - 2})"),
])
def test_each_value_rule_is_the_twins_own(field, value, fragment):
    kw = dict(DEFAULTS, **{field: value})
    with pytest.raises(ConfigError) as core:
        StagerConfig(**kw)
    with pytest.raises(ConfigError) as twin:
        check_config(SimpleNamespace(**kw))
    assert fragment in str(twin.value)
    assert str(twin.value) == str(core.value)


def test_a_reference_stager_runs_its_own_checks(monkeypatch):
    import dspark_core.reference.stager as ref

    seen = []
    monkeypatch.setattr(ref, "check_config", lambda c: seen.append(c))
    cfg = StagerConfig(**DEFAULTS)
    ReferenceStager(cfg)
    assert seen == [cfg]
