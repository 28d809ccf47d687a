"""Tiny target / drafter model directories for the vLLM plugin's tests and benchmark.

Each directory holds a ``config.json`` only: vLLM loads it with
``load_format="dummy"`` (random weights drawn from a fixed seed) and
``skip_tokenizer_init=True`` (prompts as token ids), so nothing is downloaded.
The drafters state their trained range (``max_position_embeddings``) small on
purpose, so a 100-token prompt runs past it. The tests use :data:`TINY`; the
benchmark also :data:`SMALL`, a target whose step is not almost all host work.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = ["write_qwen3_dflash", "write_llama_eagle3", "ModelShape", "TINY", "SMALL", "SHAPES", "TINY_VOCAB",
           "DRAFTER_TRAINED_RANGE", "OFFLINE_CPU_ENV", "use_offline_cpu_env", "close_engine"]

#: vLLM's settings for an in-process CPU engine on these models with nothing downloaded:
#: one process (the tests read the proposer's state), a small KV cache, hubs offline.
OFFLINE_CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_OFFLINE": "1"}


def close_engine(llm: Any) -> None:
    """Shut an in-process vLLM engine down and free what it holds (so the next one in the
    same process starts clean): its core, the object, vLLM's distributed state."""
    import contextlib
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def use_offline_cpu_env() -> None:
    """Set :data:`OFFLINE_CPU_ENV` where the caller has not (before vLLM is imported)."""
    for key, value in OFFLINE_CPU_ENV.items():
        os.environ.setdefault(key, value)

#: Vocabulary of every tiny model (small: the LM head is most of a tiny model's cost).
TINY_VOCAB = 512
#: The drafters' trained range (``max_position_embeddings``).
DRAFTER_TRAINED_RANGE = 64
#: The targets' context (``max_position_embeddings``).
TARGET_CONTEXT = 512


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The size of a written target (its drafter: one layer of the same width)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    target_layers: int
    vocab: int


#: The tests' models: a step is almost all of vLLM's own host work (the plugin's share at its largest).
TINY = ModelShape(hidden=64, heads=2, kv_heads=1, head_dim=32, target_layers=4, vocab=TINY_VOCAB)
#: A small but not toy target (52M parameters: 8 layers of 512, a 32,000-token vocabulary), for the benchmark.
SMALL = ModelShape(hidden=512, heads=8, kv_heads=4, head_dim=64, target_layers=8, vocab=32000)
SHAPES = {"tiny": TINY, "small": SMALL}


def _common(shape: ModelShape, layers: int, max_pos: int) -> dict[str, Any]:
    return {
        "hidden_size": shape.hidden,
        "intermediate_size": 2 * shape.hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": shape.vocab,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _write(path: str, config: dict[str, Any]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return path


def write_qwen3_dflash(root: str, *, trained_range: int = DRAFTER_TRAINED_RANGE, shape: ModelShape = TINY,
                       target_layers: tuple[int, ...] = (1, 2)) -> tuple[str, str]:
    """``(target_dir, drafter_dir)``: a Qwen3 target and a DFlash drafter reading ``target_layers``."""
    target = _write(os.path.join(root, "qwen3-target"), {
        **_common(shape, shape.target_layers, TARGET_CONTEXT),
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False})
    drafter = _write(os.path.join(root, "qwen3-dflash"), {
        **_common(shape, 1, trained_range),
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "target_hidden_size": shape.hidden, "num_target_layers": shape.target_layers,
        "dflash_config": {"target_layer_ids": list(target_layers), "mask_token_id": shape.vocab - 1,
                          "use_aux_hidden_state": True, "causal": True},
        "block_size": 4})
    return target, drafter


def write_llama_eagle3(root: str, *, trained_range: int = DRAFTER_TRAINED_RANGE, shape: ModelShape = TINY,
                       aux_layers: tuple[int, ...] = (1, 2, 3),
                       stated_layers: tuple[int, ...] | None = None) -> tuple[str, str]:
    """``(target_dir, drafter_dir)``: a Llama target and an EAGLE-3 drafter reading ``aux_layers``
    (vLLM reads ``eagle_config``'s list); ``stated_layers`` states another top-level list (a
    config whose two lists disagree)."""
    target = _write(os.path.join(root, "llama-target"), {
        **_common(shape, shape.target_layers, TARGET_CONTEXT),
        "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    drafter = _write(os.path.join(root, "llama-eagle3"), {
        **_common(shape, 1, trained_range),
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "target_hidden_size": shape.hidden, "draft_vocab_size": shape.vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
        "eagle_aux_hidden_state_layer_ids": list(aux_layers if stated_layers is None else stated_layers)})
    return target, drafter
