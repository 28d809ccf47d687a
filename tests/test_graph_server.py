"""A CUDA-graph server's one loop on the device step against the host path
(examples/graph_server.py; docs/protocol.md 2.10).

The same workload (requests joining and leaving a fixed capacity of 8 slots, padding
entries for the free ones, prefix hits and publishes, drafting switched off and on, drafter
failures, a request disabled by them, aborts mid-round and tree rounds) runs three ways:
the device step's CPU twin over fixed-capacity arrays, the CUDA step captured once into a
graph and replayed every step (where the kernels are built: the emulated device in CI), and
the host path (the per-step batch calls). Every request's tokens are the target's greedy
decoding and equal across the three; after every step the Stager's metrics are equal, but
for ``commits``: a round a step opened on the device counts at the next step (or at
``to_host``), so the device's commits plus its open rounds are the host path's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dspark_core import cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import graph_server


def _metrics(srv: graph_server.GraphServer) -> dict:
    """The Stager's metrics after a step: totals, and each active request's own counters
    (by request id), with the rounds its last step left open on the device."""
    t = srv.st.totals()
    own = {s.req.rid: srv.st.stats(q) for q, s in srv.slots.items()}
    return {"totals": dict(t.stats), "accepted": t.accepted.tolist(), "own": own,
            "open": sorted(srv.slots[q].req.rid for q in srv.open_slots)}


def _run(step: str, storage: str, seed: int, layout: str = "padded") -> tuple[graph_server.GraphServer, list[dict]]:
    seen: list[dict] = []
    srv, ok = graph_server.serve(storage, step, n_requests=20, fail_every=7, seed=seed,
                                 on_step=lambda s: seen.append(_metrics(s)), layout=layout)
    assert ok, f"{step}: a request's output differs from the target's greedy decoding"
    return srv, seen


def _as_host(m: dict) -> dict:
    """A device-path step's metrics as the host path counts them: its open rounds committed."""
    out = {"totals": dict(m["totals"]), "accepted": m["accepted"], "open": [],
           "own": {rid: dict(s) for rid, s in m["own"].items()}}
    out["totals"]["commits"] += len(m["open"])
    for rid in m["open"]:
        out["own"][rid]["commits"] += 1
    return out


def _exercised(srv: graph_server.GraphServer) -> None:
    c = srv.c
    assert c.failures and c.tree_rounds and c.switched and c.aborted and c.hits and c.published_blocks, c
    assert c.max_batch == graph_server.CAPACITY  # full, and padded on other steps
    assert c.finished == c.lossless
    t = srv.st.totals().stats
    assert t["skips_disabled"] and t["skips_drafting_off"]  # a disabled request and the switch, on the device too


@pytest.mark.parametrize("storage,seed,layout", [("f32", 3, "padded"), ("q8_0", 5, "csr"), ("bf16", 8, "padded"),
                                                 ("f32", 9, "csr")])
def test_the_cpu_twins_graph_loop_equals_the_host_path_token_for_token_and_metric_for_metric(storage, seed, layout):
    """``layout``: the drafter's rows from the padded layout or from the CSR rows (step_rows)."""
    twin, seen_twin = _run("twin", storage, seed, layout)
    host, seen_host = _run("host", storage, seed)
    _exercised(twin)
    assert twin.outputs == host.outputs
    assert len(seen_twin) == len(seen_host)
    for k, (d, h) in enumerate(zip(seen_twin, seen_host)):
        assert _as_host(d) == h, f"step {k}"
    assert any(m["open"] for m in seen_twin)  # the commits rule was exercised
    assert twin.c.host_waits == twin.c.failures + twin.c.tree_rounds and host.c.host_waits == 0
    if storage == "f32":
        assert twin.c.max_rel_err == 0 and host.c.max_rel_err == 0


@pytest.mark.skipif(not cuda.available(), reason=f"no CUDA device: {cuda.unavailable_reason()}")
@pytest.mark.parametrize("storage,seed,layout", [("f32", 3, "padded"), ("q8_0", 5, "csr")])
def test_one_captured_cuda_graph_serves_the_loop_as_the_cpu_twin(storage, seed, layout):
    graph, seen_graph = _run("graph", storage, seed, layout)
    twin, seen_twin = _run("twin", storage, seed, layout)
    _exercised(graph)
    assert graph.outputs == twin.outputs
    assert seen_graph == seen_twin


def test_the_example_checks_itself_and_says_so(capsys):
    assert graph_server.main(["--requests", "12"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "lossless: yes"
    with pytest.raises(SystemExit):
        graph_server.main(["--help"])
    assert "--step" in capsys.readouterr().out


def test_padding_entries_keep_every_free_slot_unchanged():
    """The loop's step over all CAPACITY entries: a free slot's entry is PADDING_ID with count
    -1, answered STEP_NOT_IN_STEP with nothing written."""
    from dspark_core.stager.device_step import NOT_STEPPED, PADDING_ID, STEP_NOT_IN_STEP

    seen = []

    def look(srv):
        out, ids = srv.steps.out, srv.steps.ids
        free = [i for i in range(graph_server.CAPACITY) if ids[i] < 0]  # the step's own batch: the rest
        if free:
            seen.append(len(free))
            assert (ids[free] == PADDING_ID).all() and (srv.steps.counts[free] == -1).all()
            assert (out.status[free] == STEP_NOT_IN_STEP).all() and (out.skip[free] == NOT_STEPPED).all()
            assert (out.row_slots[free] == -1).all() and (out.verify_slots[free] == -1).all()

    graph_server.serve("f32", "twin", n_requests=10, on_step=look)
    assert seen and max(seen) > 1
