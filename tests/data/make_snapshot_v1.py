"""How tests/data/snapshot_v1_*.bin were made (snapshot format version 1).

Run with the version-1 code (before format v2); kept so the fixtures can be
read and audited. The blobs are restored by tests/test_snapshot_v2.py, which
parses them with its own v1 parser (zlib CRC-32) as the oracle.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dspark_core import Stager, StagerConfig

HERE = Path(__file__).parent


def activations(positions: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """N(0,1) noise with a few massive channels and a huge-norm first (BOS) row."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((len(positions), dim)).astype(np.float32)
    rows[:, [1, dim // 3, dim - 2]] *= np.float32(3e3)
    rows[:, 5] += np.float32(4e4)
    if len(positions) and positions[0] == 0:
        rows[0] *= np.float32(50.0)
    return rows


def session(storage: str) -> bytes:
    cfg = StagerConfig(feature_dim=64, block_size=4, window=24, max_seqs=1, storage=storage)
    st = Stager(cfg)
    st.begin(0)
    st.process(0, np.arange(30), activations(np.arange(30), 64, 1))  # a prompt longer than W
    n_past = 30
    for rnd in range(3):
        st.draft(0, n_past)
        st.commit(0)
        verify = np.arange(n_past, n_past + cfg.block_size + 1)
        st.process(0, verify, activations(verify, 64, 10 + rnd))
        st.accept(0, 2)
        n_past += 3
    return st.snapshot(0)


if __name__ == "__main__":
    for storage in sys.argv[1:] or ("f32", "q4_0"):
        (HERE / f"snapshot_v1_{storage}.bin").write_bytes(session(storage))
