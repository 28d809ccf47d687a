"""Run tiny vLLM engines in this process and record what the drafter receives (tests and bench).

Two recorders wrap vLLM's proposer code:

* ``captured``: the plugin's entry (``EagleProposer.propose`` / ``DFlashProposer.propose``
  after the plugin patched them, else vLLM's own): the rows vLLM captured, their
  positions and how many of each request's rows the target kept;
* ``drafter``: vLLM's ``SpecDecodeBaseProposer.propose``, which runs the drafter: the
  positions and rows it was given (with the plugin, the staging's plan for the step).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the recorders
see every step.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dspark_core.vllm import tiny_models  # imports no vLLM

tiny_models.use_offline_cpu_env()

SPEC_TOKENS = 3
MAX_MODEL_LEN = 256
KV_BLOCK = 32


@dataclass
class Recorder:
    """What one engine's proposer saw, step by step."""

    captured: list[dict[str, Any]] = field(default_factory=list)
    drafter: list[dict[str, Any]] = field(default_factory=list)
    poison: set[str] = field(default_factory=set)     # requests whose drafter batches raise
    on_captured: Any = None                           # called with each captured step
    override_drafts: Any = None                       # (call, drafts) -> drafts the target verifies
    raised: int = 0


_current: Recorder | None = None
_installed = False


def _install_recorders() -> None:
    """Wrap vLLM's proposer entry points once; they record into the current Recorder."""
    global _installed
    if _installed:
        return
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from dspark_core.vllm import patches

    stock = SpecDecodeBaseProposer.propose

    def drafter(self: Any, num_speculative_tokens: int, target_token_ids: Any, target_positions: Any,
                target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                common_attn_metadata: Any, *args: Any, **kw: Any) -> Any:
        positions, hidden, cad = target_positions, target_hidden_states, common_attn_metadata
        rec = _current
        staging = patches.staging_of(self)
        runner = getattr(self, "_dspark_runner", None)
        inp = staging.last if staging is not None else None
        n = int(cad.num_reqs)
        batch = list(runner.input_batch.req_ids[:n]) if runner is not None else []
        if rec is not None:
            subset = inp is not None and len(inp.drafting) != n
            rec.drafter.append(dict(
                positions=positions[: int(cad.query_start_loc_cpu[n])].cpu().clone(),
                rows=hidden[: int(cad.query_start_loc_cpu[n])].cpu().clone(),
                qsl=cad.query_start_loc_cpu[: n + 1].clone().long(),
                seq_lens=cad.seq_lens[:n].cpu().clone().long(),
                n=n, subset=subset,
                req_ids=batch if not subset else None,
                pos_base=None if inp is None or subset else inp.pos_base.copy(),
                drafting=None if inp is None or subset else inp.drafting.copy(),
                rebase=None if inp is None or subset else inp.rebase.copy()))
            serving = staging.current_req_ids if staging is not None else batch
            if any(r in rec.poison for r in serving):
                rec.raised += 1
                raise RuntimeError("injected drafter failure")
        drafts = stock(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                       next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kw)
        if rec is not None:
            rec.drafter[-1]["drafts"] = drafts.cpu().clone()
            if rec.override_drafts is not None:
                drafts = rec.override_drafts(rec.drafter[-1], drafts)
        return drafts

    SpecDecodeBaseProposer.propose = drafter  # type: ignore[method-assign]
    patches.install()  # the plugin wraps the recorder: its "stock" propose is the recorder

    for cls in (EagleProposer, DFlashProposer):
        plugin_propose = cls.propose

        def captured(self: Any, num_speculative_tokens: int, target_token_ids: Any, target_positions: Any,
                     target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                     common_attn_metadata: Any, sampling_metadata: Any, mm_embed_inputs: Any = None,
                     num_rejected_tokens_gpu: Any = None, slot_mappings: Any = None,
                     _inner: Any = plugin_propose) -> Any:
            positions, hidden, cad = target_positions, target_hidden_states, common_attn_metadata
            num_rejected = num_rejected_tokens_gpu
            rec = _current
            n = int(cad.num_reqs)
            total = int(cad.query_start_loc_cpu[n])
            if rec is not None:
                runner = self._dspark_runner
                rec.captured.append(dict(
                    req_ids=list(runner.input_batch.req_ids[:n]),
                    qsl=cad.query_start_loc_cpu[: n + 1].clone().long(),
                    positions=positions[:total].cpu().clone(),
                    rows=hidden[:total].cpu().clone(),
                    rejected=None if num_rejected is None else num_rejected[:n].cpu().clone().long()))
                if rec.on_captured is not None:
                    rec.on_captured(rec.captured[-1])
            return _inner(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                          next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                          mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings)

        cls.propose = captured  # type: ignore[method-assign]
    _installed = True


@contextlib.contextmanager
def engine(method: str, *, plugin: bool, speculative: bool = True, prefix_caching: bool = False,
           max_num_seqs: int = 8, trained_range: int | None = None,
           cpu_workarounds: bool = True, model_kw: dict[str, Any] | None = None,
           kv_blocks: int | None = None) -> Iterator[tuple[Any, Recorder]]:
    """A tiny in-process vLLM engine (``method``: "eagle3" or "dflash") and the recorder of its steps.

    A stock engine (``plugin=False``) gets the plugin's CPU workarounds too (``cpu_workarounds``),
    so stock DFlash can draft on the CPU at all (dspark_core.vllm.cpu_workarounds)."""
    global _current
    if plugin:
        os.environ["DSPARK_VLLM"] = "1"
    else:
        os.environ.pop("DSPARK_VLLM", None)
    _install_recorders()
    from vllm import LLM

    root = tempfile.mkdtemp(prefix="dspark-vllm-")
    kw: dict[str, Any] = dict(model_kw or {})
    if trained_range is not None:
        kw["trained_range"] = trained_range
    target, drafter = (tiny_models.write_llama_eagle3(root, **kw) if method == "eagle3"
                       else tiny_models.write_qwen3_dflash(root, **kw))
    spec = {"method": method, "model": drafter, "num_speculative_tokens": SPEC_TOKENS} if speculative else None
    rec = Recorder()
    llm = LLM(model=target, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=MAX_MODEL_LEN, speculative_config=spec, seed=0, dtype="float32",
              max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching, disable_log_stats=False,
              block_size=KV_BLOCK, num_gpu_blocks_override=kv_blocks)
    if speculative and not plugin and cpu_workarounds:
        from dspark_core.vllm.cpu_workarounds import apply

        apply(proposer_of(llm))
    _current = rec
    try:
        yield llm, rec
    finally:
        _current = None
        os.environ.pop("DSPARK_VLLM", None)
        tiny_models.close_engine(llm)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generation of ``max_tokens`` tokens for each prompt (token ids in, token ids out)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def proposer_of(llm: Any) -> Any:
    """The engine's drafter (in-process engine only)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner.drafter
