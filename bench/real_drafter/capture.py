"""Stage 1: the target's feature rows and greedy labels of each document, through dspark_core's capture adapter.

Every document is evaluated from BOS in chunks of ``n_batch`` tokens with every
token's logits (``LlamaCppCapture.evaluate(logits="all")``), so each position gets
its row (tap layers concatenated) and the target's greedy label: llama.cpp's argmax
after that position. Cached under a key of the model file's digest, the tap layers,
the text's digest, the token count, the batch size and llama-cpp-python's version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from cache import Cache, file_digest, key_of
from corpus import Document

__all__ = ["Captured", "capture", "open_target"]

log = logging.getLogger("real_drafter")

#: Tokens per llama_decode while capturing (also the live loop's prefill chunk).
N_BATCH = 256


@dataclass
class Captured:
    """One document's capture.

    Attributes:
        name: the document.
        tokens: int64 ``(n,)``: the tokens, BOS first.
        labels: int64 ``(n,)``: the target's greedy (argmax) token after each position.
        rows: float32 ``(n, D)``: the feature rows (memory-mapped from the cache).
        key: the capture's cache key.
    """

    name: str
    tokens: np.ndarray
    labels: np.ndarray
    rows: np.ndarray
    key: str


def open_target(model: Any, layers: Sequence[int], n_ctx: int, threads: int, verify_max: int,
                n_ubatch: int | None = None) -> Any:
    """A :class:`~dspark_core.engines.llama_cpp.LlamaCppCapture` on ``model`` (a GGUF path, or a
    loaded ``llama_cpp.Llama`` whose weights it shares); ``n_ubatch`` as llama.cpp's (default
    ``N_BATCH``)."""
    from dspark_core.engines.llama_cpp import LlamaCppCapture, load_llama

    llm = load_llama(model, n_threads=threads) if isinstance(model, str) else model
    return LlamaCppCapture(llm, tuple(layers), n_ctx=n_ctx, n_batch=N_BATCH, n_ubatch=n_ubatch, n_threads=threads,
                           verify_max=verify_max)


def _key(model_path: str, layers: Sequence[int], doc: Document, n: int) -> tuple[str, dict[str, Any]]:
    inputs = {
        "model": file_digest(model_path), "layers": list(layers), "text": doc.digest, "doc": doc.name,
        "n_tokens": n, "n_batch": N_BATCH, "llama_cpp_python": metadata.version("llama-cpp-python"),
    }
    return key_of(inputs), inputs


def capture(cache: Cache, model_path: str, layers: Sequence[int], docs: Sequence[Document], n_tokens: int,
            threads: int) -> list[Captured]:
    """The capture of each document's first ``n_tokens`` tokens (from the cache where present)."""
    out: list[Captured] = []
    target = None
    try:
        for doc in docs:
            key, inputs = _key(model_path, layers, doc, n_tokens)
            d = cache.dir("capture", key)
            if not cache.done("capture", key):
                if target is None:
                    target = open_target(model_path, layers, n_tokens + 8, threads, verify_max=1)
                _capture_one(cache, key, inputs, target, doc, n_tokens)
            else:
                log.info("capture %s: cached (%s)", doc.name, d.name)
            out.append(Captured(doc.name, np.load(d / "tokens.npy"), np.load(d / "labels.npy"),
                                np.load(d / "rows.npy", mmap_mode="r"), key))
    finally:
        if target is not None:
            target.close()
    return out


def _capture_one(cache: Cache, key: str, inputs: dict[str, Any], target: Any, doc: Document, n: int) -> None:
    toks = target.tokenize(doc.text, add_bos=True)
    if len(toks) < n:
        raise ValueError(f"{doc.name} has {len(toks)} tokens, fewer than the {n} asked for")
    toks = np.asarray(toks[:n], np.int64)
    d = cache.fresh("capture", key, inputs)
    rows = np.lib.format.open_memmap(Path(d) / "rows.npy", mode="w+", dtype=np.float32, shape=(n, target.feature_dim))
    labels = np.empty(n, np.int64)
    target.reset()
    t0 = time.perf_counter()
    buf = np.empty((N_BATCH, target.feature_dim), np.float32)
    for lo in range(0, n, N_BATCH):
        hi = min(n, lo + N_BATCH)
        r = target.evaluate(toks[lo:hi], logits="all", out=buf[: hi - lo])
        rows[lo:hi] = r.rows
        labels[lo:hi] = r.next_tokens
    rows.flush()
    del rows
    np.save(Path(d) / "tokens.npy", toks)
    np.save(Path(d) / "labels.npy", labels)
    dt = time.perf_counter() - t0
    cache.finish("capture", key)
    log.info("capture %s: %d positions in %.1f s (%.0f tok/s)", doc.name, n, dt, n / dt)
