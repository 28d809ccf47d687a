"""vLLM plugin: windowed staging of the target's captured rows for vLLM's DFlash and EAGLE-3 drafters.

vLLM loads :func:`register` in every process (the ``vllm.general_plugins``
entry point) before any work. It does nothing unless the plugin is enabled
with ``DSPARK_VLLM=1``; then it puts a :class:`~dspark_core.Stager` behind
vLLM's DFlash and EAGLE-3 proposers (:mod:`dspark_core.vllm.patches`), so every
request drafts inside the drafter's trained range, each with its own window.
docs/vllm.md describes what it changes and its limits.

This package imports without vLLM: vLLM and torch are imported only when the
plugin is enabled.
"""

from __future__ import annotations

from .switch import ENABLE_ENV, SUPPORTED_VLLM_VERSIONS, enabled

__all__ = ["register", "enabled", "ENABLE_ENV", "SUPPORTED_VLLM_VERSIONS"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the patches when enabled.

    vLLM may call it several times per process; the patches are installed once.
    """
    if not enabled():
        return
    from .patches import install

    install()
