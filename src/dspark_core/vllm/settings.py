"""The plugin's settings for one proposer, checked at engine start.

The window ``W`` is the drafter's own trained range: ``max_position_embeddings``
of the drafter's ``config.json``, read with :meth:`DrafterInfo.from_hf_config`
from the drafter's directory, never from vLLM's draft model config (vLLM 0.32
raises an EAGLE drafter's ``max_position_embeddings`` to the target's
``max_model_len``) nor from the target. ``DSPARK_VLLM_WINDOW`` may lower it.

Every setting that cannot work raises :class:`~dspark_core.errors.ConfigError`
naming it, from the proposer's ``load_model``, so the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..errors import ConfigError
from ..gguf.drafter_info import DrafterInfo
from ..gguf.reader import DrafterMetadataError

__all__ = ["PluginSettings", "settings_for", "check_runtime", "refuse_v2_runner", "WINDOW_ENV"]

#: Optional cap on the window (an integer); the drafter's trained range bounds it anyway.
WINDOW_ENV = "DSPARK_VLLM_WINDOW"
_KIND = {"dflash": "block", "eagle3": "chain"}
#: Extra query positions a round uses beyond ``num_speculative_tokens``: DFlash
#: queries the sampled token and ``k`` masks at once; EAGLE-3's last step is at
#: the ``k - 1``-th position after the context.
_EXTRA_QUERY = {"dflash": 1, "eagle3": 0}


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    """What the RequestStaging of one proposer is built with."""

    method: str
    kind: str
    window: int
    window_source: str
    block_size: int
    feature_dim: int
    max_seqs: int


def check_runtime() -> None:
    """Refuse a vLLM release the plugin was not written for."""
    import vllm

    from .switch import SUPPORTED_VLLM_VERSIONS

    version = getattr(vllm, "__version__", "?")
    base = version.split("+", 1)[0]
    if base not in SUPPORTED_VLLM_VERSIONS:
        raise ConfigError(f"DSPARK_VLLM=1: vLLM {version} is not supported (supported: "
                          f"{', '.join(SUPPORTED_VLLM_VERSIONS)}); unset DSPARK_VLLM or install a supported vLLM")


def refuse_v2_runner(vllm_config: Any) -> None:
    """Refuse vLLM's V2 model runner for a DFlash / EAGLE-3 engine: the plugin patches the V1 runner
    only, and under V2 the drafter would run unstaged (vllm #57964: it crashes past the range)."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if method in _KIND:
        raise ConfigError(f"DSPARK_VLLM=1 with speculative method {method!r} needs vLLM's V1 model runner: "
                          "set VLLM_USE_V2_MODEL_RUNNER=0 (or unset DSPARK_VLLM)")


def _captured_width(proposer: Any) -> int | None:
    """The row width the drafter's input projection takes (tap layers x target hidden size)."""
    inner = getattr(getattr(proposer, "model", None), "model", None)
    fc = getattr(inner, "fc", None)
    width = getattr(fc, "input_size", None)
    return int(width) if width is not None else None


def settings_for(proposer: Any) -> PluginSettings:
    """Read and check the settings of a loaded DFlash / EAGLE-3 proposer.

    Raises:
        ConfigError: the window is not above ``2 * block`` (naming
            ``max_position_embeddings`` and ``num_speculative_tokens``), the
            drafter's tap layers do not give the width vLLM captures (naming
            the tap-layer key), or ``DSPARK_VLLM_WINDOW`` is not a positive integer.
    """
    cfg = proposer.vllm_config
    spec = cfg.speculative_config
    method = spec.method
    k = int(spec.num_speculative_tokens)
    block = k + _EXTRA_QUERY[method]
    draft_dir = spec.draft_model_config.model
    try:
        info = DrafterInfo.from_hf_config(draft_dir, block_size=block)
    except DrafterMetadataError as err:
        raise ConfigError(f"{err} (the block is num_speculative_tokens={k}"
                          f"{' + 1 query token' if _EXTRA_QUERY[method] else ''} for {method})") from err
    if info.n_ctx_train is None:
        raise ConfigError(f"{draft_dir}: the drafter's config.json states no trained range (max_position_embeddings)")
    window, source = int(info.n_ctx_train), f"{info.n_ctx_train_source} of {draft_dir}"
    cap = os.environ.get(WINDOW_ENV, "").strip()
    if cap:
        if not cap.isdigit() or int(cap) < 1:
            raise ConfigError(f"{WINDOW_ENV}={cap!r}: must be a positive integer")
        if int(cap) < window:
            window, source = int(cap), WINDOW_ENV
    if window <= 2 * block:
        raise ConfigError(
            f"the drafter's window {window} ({source}) must be above 2 * {block} (num_speculative_tokens={k}"
            f"{' + 1 query token' if _EXTRA_QUERY[method] else ''}): lower num_speculative_tokens")
    hidden = int(cfg.model_config.get_hidden_size())
    width = _captured_width(proposer)
    taps = len(info.target_layers)
    key = "dflash_config.target_layer_ids" if method == "dflash" else "eagle_aux_hidden_state_layer_ids"
    if width is None:
        raise ConfigError(f"{method}: the drafter has no input projection (fc) to read the captured width from")
    if taps and taps * hidden != width:
        raise ConfigError(f"{key} of {draft_dir} names {taps} tap layers ({taps} x {hidden} = {taps * hidden} "
                          f"wide) but the drafter's input takes rows {width} wide")
    return PluginSettings(method=method, kind=_KIND[method], window=window, window_source=source,
                          block_size=block, feature_dim=width, max_seqs=int(cfg.scheduler_config.max_num_seqs))
