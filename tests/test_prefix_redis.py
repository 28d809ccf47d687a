"""examples/prefix_redis.py against a real Redis server: a hit in a second process.

The test starts ``redis-server`` (Debian's package; ``.ci/run`` installs it) on a free port,
runs the example's ``publish`` in one process and its ``hit`` in another, which starts from
the rows the first one exported and restages exactly what a full prefill stages. A damaged
block in Redis is refused by the importing store and costs a replay of at most K tokens,
never a wrong row. Where redis-server cannot be found the test skips, except in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prefix_redis.py"
REDIS = shutil.which("redis-server")

if REDIS is None and not os.environ.get("CI"):
    pytest.skip("redis-server not found (Debian: apt-get install redis-server)", allow_module_level=True)


@pytest.fixture
def redis_port():
    assert REDIS is not None, "redis-server not found: .ci/run installs it (apt-get install -y redis-server)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def example(port: int, command: str) -> dict:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--port", str(port), command], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


def test_a_second_process_hits_on_rows_kept_in_redis(redis_port):
    pub = example(redis_port, "publish")
    assert pub["published_blocks"] == 19  # 300 tokens in blocks of 16, the last partial
    got = example(redis_port, "hit")
    assert got["same_as_full_prefill"] is True
    assert got["replay_from"] == got["n_tokens"] == 300
    # Only what the hit needs crossed: the blocks of the last K = 64 rows (positions 236..299).
    assert got["fetched_blocks"] == 5 and got["of_blocks"] == 19 and got["rows"] == 64


def test_a_damaged_block_costs_a_replay_not_a_wrong_row(redis_port):
    example(redis_port, "publish")
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import prefix_redis as ex
    finally:
        sys.path.pop(0)
    r = ex.Redis("127.0.0.1", redis_port)
    keys = ex.chain(ex.prompt_tokens(ex.PROMPT), ex.PROMPT)
    k = ex.redis_key(keys[16])  # positions [256, 272)
    data = bytearray(r.call("GET", k))
    data[-3] ^= 0x10
    assert r.call("SET", k, bytes(data)) == "OK"
    got = example(redis_port, "hit")
    assert got["damaged_blocks"] == 1 and got["fetched_blocks"] == 4
    assert got["replay_from"] == 256 and got["same_as_full_prefill"] is True
