"""The plugin's fallbacks as a Prometheus counter beside vLLM's own spec-decode counters.

vLLM 0.32 counts speculative decoding in the scheduler, from the draft token
ids it scheduled (``Scheduler.update_from_output`` -> ``SpecDecodingStats``),
and its stat loggers export them (``vllm:spec_decode_num_drafts``, ...). A
request-step the plugin gives no drafts is absent from those counters (the
scheduler schedules no draft for it); this counter says how many there were
and why. ``FALLBACK_METRIC`` is registered in prometheus_client's default
registry of the process that runs the drafter, which is what
``LLM.get_metrics()`` and vLLM's ``/metrics`` read when the engine runs in that
process, and a file of the multiprocess registry when vLLM runs Prometheus in
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``). docs/vllm.md, "Faults".
"""

from __future__ import annotations

from typing import Any

from .staging import FALLBACK_REASONS

__all__ = ["FALLBACK_METRIC", "FallbackCounter"]

#: The counter's name (``vllm:`` so that ``LLM.get_metrics()``, which keeps only vLLM's names, lists it).
FALLBACK_METRIC = "vllm:dspark_fallback_request_steps"


class FallbackCounter:
    """``vllm:dspark_fallback_request_steps_total{model_name, reason}``, one per engine.

    ``reason``: one of :data:`~dspark_core.vllm.staging.FALLBACK_REASONS`.

    vLLM's Prometheus stat logger unregisters every ``vllm:`` collector when it
    starts (``unregister_vllm_metrics``), after an in-process engine core has
    loaded its drafter; the counter registers itself again on its next count.
    """

    def __init__(self, model_name: str) -> None:
        import prometheus_client

        self._registry = prometheus_client.REGISTRY
        self._drop_stale()
        self._counter: Any = prometheus_client.Counter(
            FALLBACK_METRIC, "Request-steps the dspark_core vLLM plugin gave no drafts, by reason.",
            labelnames=["model_name", "reason"], registry=None)
        self._children = {r: self._counter.labels(model_name, r) for r in FALLBACK_REASONS}
        self._registry.register(self._counter)

    def _drop_stale(self) -> None:
        """Unregister an earlier engine's counter in this process (vLLM recreates its own per engine too)."""
        # prometheus_client has no public lookup by name; vLLM reads the same private map (_collector_to_names).
        names: dict[str, Any] = getattr(self._registry, "_names_to_collectors", {})
        old = names.get(FALLBACK_METRIC)
        if old is not None:
            self._registry.unregister(old)

    def count(self, by_reason: dict[str, int]) -> None:
        """Add one step's fallbacks (``reason -> request count``)."""
        names: dict[str, Any] = getattr(self._registry, "_names_to_collectors", {})
        if names.get(FALLBACK_METRIC) is not self._counter:
            self._drop_stale()
            self._registry.register(self._counter)
        for reason, n in by_reason.items():
            if n:
                self._children[reason].inc(n)
