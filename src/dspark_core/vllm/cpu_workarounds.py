"""Workarounds of vLLM CPU-platform bugs that the plugin's path meets, applied only on that platform.

``dflash_packed_qkv`` (vLLM 0.32.0, CPU): after loading, vLLM's CPU linear
method repacks each ``qkv_proj`` weight for its own GEMM kernel and leaves
``qkv_proj.weight`` empty, while DFlash's fused context-KV projection
(``DFlashQwen3Model._build_context_kv_buffers``) slices that weight. The
workaround makes the fused projection go through each layer's own
``qkv_proj`` (the path DFlash already has for quantized weights), which the
CPU kernel serves from its packed copy.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["apply", "needs_dflash_packed_qkv"]

logger = logging.getLogger(__name__)


def needs_dflash_packed_qkv(proposer: Any) -> bool:
    """Whether this proposer is a DFlash one on vLLM's CPU platform whose qkv weights were emptied."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or proposer.vllm_config.speculative_config.method != "dflash":
        return False
    layers = getattr(getattr(proposer.model, "model", None), "layers", None) or []
    return any(getattr(layer.self_attn.qkv_proj, "weight", None) is not None
               and layer.self_attn.qkv_proj.weight.numel() == 0 for layer in layers)


def apply(proposer: Any) -> None:
    """Apply the workarounds this proposer needs (none off the CPU platform)."""
    if needs_dflash_packed_qkv(proposer):
        inner = proposer.model.model
        if not hasattr(inner, "_num_attn_layers"):
            inner._build_fused_kv_buffers()
        # None: _project_context_kv runs each layer's qkv_proj instead of slicing the emptied weight.
        inner._fused_kv_weight = None
        inner._fused_kv_bias = None
        logger.info("dspark_core: CPU workaround dflash_packed_qkv applied (qkv_proj weights were repacked)")
