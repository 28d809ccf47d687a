"""The plugin's switch and the vLLM releases it supports (no vLLM import)."""

from __future__ import annotations

import os

__all__ = ["ENABLE_ENV", "SUPPORTED_VLLM_VERSIONS", "enabled"]

#: Environment variable that turns the plugin on (``1``); anything else leaves vLLM as it is.
ENABLE_ENV = "DSPARK_VLLM"
#: vLLM releases whose internals the plugin was written and tested against.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def enabled() -> bool:
    """Whether ``DSPARK_VLLM=1`` is set in this process's environment."""
    return os.environ.get(ENABLE_ENV, "").strip() == "1"
