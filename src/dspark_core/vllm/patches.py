"""What the plugin changes in vLLM (0.32.0, V1 model runner), installed once per process.

* ``SpecDecodeBaseProposer.propose`` of ``EagleProposer`` (method ``eagle3``) and
  ``DFlashProposer`` (``dflash``): the captured rows go into a
  :class:`~dspark_core.vllm.staging.RequestStaging`, and vLLM's own proposer
  runs on the plans' rows, positions and window-shifted block tables.
* ``GPUModelRunner._input_fits_in_drafter``: the gate that skips the drafter
  for the whole batch once its longest request passes the drafter's range
  (``max_seq_len + k <= effective_drafter_max_model_len``) lets every batch
  through, since every request now drafts inside its own window.
* ``load_model`` of both proposers: the settings are checked at engine start
  (:mod:`dspark_core.vllm.settings`), and the CPU workaround applied
  (:mod:`dspark_core.vllm.cpu_workarounds`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .settings import check_runtime, refuse_v2_runner, settings_for
from .staging import RequestStaging, TargetRows

__all__ = ["install", "installed", "staging_of", "drafter_metadata", "STAGING_ATTR"]

logger = logging.getLogger(__name__)

#: Bytes of rows the prefix store keeps (vLLM's prefix caching on), LRU beyond it.
PREFIX_BYTES_ENV = "DSPARK_VLLM_PREFIX_BYTES"
#: Attribute of a proposer that holds its RequestStaging.
STAGING_ATTR = "_dspark_staging"
_PATCHED_METHODS = ("eagle3", "dflash")
_installed = False


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _installed


def staging_of(proposer: Any) -> RequestStaging | None:
    """The RequestStaging behind a proposer (None for one the plugin does not serve)."""
    return getattr(proposer, STAGING_ATTR, None)


def install() -> None:
    """Patch vLLM's proposers and model runner (idempotent)."""
    global _installed
    if _installed:
        return
    check_runtime()
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_propose = SpecDecodeBaseProposer.propose
    stock_fits = GPUModelRunner._input_fits_in_drafter
    stock_take = GPUModelRunner.take_draft_token_ids

    def propose(self: Any, num_speculative_tokens: int, target_token_ids: Any, target_positions: Any,
                target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                common_attn_metadata: Any, sampling_metadata: Any, mm_embed_inputs: Any = None,
                num_rejected_tokens_gpu: Any = None, slot_mappings: Any = None) -> Any:
        staging = staging_of(self)
        if staging is None:
            return stock_propose(self, num_speculative_tokens, target_token_ids, target_positions,
                                 target_hidden_states, next_token_ids, token_indices_to_sample,
                                 common_attn_metadata, sampling_metadata, mm_embed_inputs,
                                 num_rejected_tokens_gpu, slot_mappings)
        return _staged_propose(self, staging, stock_propose, num_speculative_tokens, target_token_ids,
                               target_positions, target_hidden_states, next_token_ids, common_attn_metadata,
                               sampling_metadata, num_rejected_tokens_gpu, slot_mappings)

    def input_fits_in_drafter(self: Any, common_attn_metadata: Any) -> bool:
        drafter = getattr(self, "drafter", None)
        if drafter is not None and staging_of(drafter) is not None:
            return common_attn_metadata is not None
        return bool(stock_fits(self, common_attn_metadata))

    def take_draft_token_ids(self: Any) -> Any:
        out = stock_take(self)
        staging = staging_of(getattr(self, "drafter", None))
        if out is None or staging is None or not staging.no_drafts:
            return out
        # An empty list: the scheduler schedules no draft for that request next step, so vLLM's
        # spec-decode metrics count no placeholder draft for it (Scheduler.update_draft_token_ids).
        gone, staging.no_drafts = staging.no_drafts, set()
        out.draft_token_ids = [[] if r in gone else d for r, d in zip(out.req_ids, out.draft_token_ids)]
        return out

    # Any: the patched classes are vLLM's (typed where vLLM is installed, Any where it is not).
    proposers: tuple[Any, ...] = (EagleProposer, DFlashProposer)
    for cls in proposers:
        stock_load = cls.load_model
        stock_init = cls.__init__

        def init(self: Any, vllm_config: Any, device: Any, runner: Any = None, _stock_init: Any = stock_init) -> None:
            _stock_init(self, vllm_config, device, runner)
            self._dspark_runner = runner  # the proposer keeps no reference; the staging reads its batch


        def load_model(self: Any, target_model: Any, _stock_load: Any = stock_load) -> None:
            _stock_load(self, target_model)
            _attach(self)

        cls.__init__ = init
        cls.load_model = load_model
        cls.propose = propose
    runner_cls: Any = GPUModelRunner
    runner_cls._input_fits_in_drafter = input_fits_in_drafter
    runner_cls.take_draft_token_ids = take_draft_token_ids
    _refuse_v2()
    _installed = True
    logger.info("dspark_core: vLLM plugin installed (DFlash, EAGLE-3 proposers)")


def _refuse_v2() -> None:
    """Make vLLM's V2 model runner refuse to start a DFlash / EAGLE-3 engine while the plugin is on."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception:  # noqa: BLE001 - the V2 runner needs Triton; where it cannot import it cannot run
        return
    v2: Any = V2Runner
    stock_init = v2.__init__

    def init(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        from .switch import enabled

        if enabled():
            refuse_v2_runner(vllm_config)
        stock_init(self, vllm_config, *args, **kwargs)

    v2.__init__ = init


def _attach(proposer: Any) -> None:
    """Check the settings (raising at engine start) and give the proposer its RequestStaging."""
    from .cpu_workarounds import apply as apply_cpu_workarounds

    from .switch import enabled

    method = proposer.vllm_config.speculative_config.method
    if method not in _PATCHED_METHODS or not enabled():
        return  # an engine started without DSPARK_VLLM=1 in this process stays stock
    s = settings_for(proposer)
    apply_cpu_workarounds(proposer)
    staging = RequestStaging(kind=s.kind, feature_dim=s.feature_dim, block_size=s.block_size, window=s.window,
                             max_seqs=s.max_seqs, kv_block_size=proposer.block_size if proposer.block_size > 0
                             else proposer.vllm_config.cache_config.block_size,
                             dtype=proposer.dtype, device=proposer.device)
    cache = proposer.vllm_config.cache_config
    if cache.enable_prefix_caching:
        from .prefix_rows import DEFAULT_BUDGET_BYTES, PrefixRows

        budget = int(os.environ.get(PREFIX_BYTES_ENV, DEFAULT_BUDGET_BYTES))
        staging.prefix = PrefixRows(staging, block_tokens=int(cache.block_size),
                                    hash_name=str(cache.prefix_caching_hash_algo), budget_bytes=budget)
    from .metrics import FallbackCounter

    served = proposer.vllm_config.model_config.served_model_name
    staging.counter = FallbackCounter(str(served[0] if isinstance(served, (list, tuple)) else served))
    setattr(proposer, STAGING_ATTR, staging)
    logger.info("dspark_core: %s drafter staged in a window of %d positions (%s), block %d, rows %d wide",
                method, s.window, s.window_source, s.block_size, s.feature_dim)


class _Prompts(Mapping[str, Any]):
    """The prompt token ids of the runner's requests, read when asked (most steps ask for none)."""

    def __init__(self, requests: dict[str, Any]) -> None:
        self._requests = requests

    def __getitem__(self, req_id: str) -> Any:
        return self._requests[req_id].prompt_token_ids

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)


def _target_rows(proposer: Any, target_token_ids: Any, target_positions: Any, target_hidden_states: Any,
                 next_token_ids: Any, cad: Any, num_rejected: Any) -> TargetRows:
    """The step's rows as the Stager takes them (one host copy of the bookkeeping for the batch)."""
    import torch

    runner = proposer._dspark_runner
    n = int(cad.num_reqs)
    qsl = cad.query_start_loc_cpu.numpy()[: n + 1].astype(np.int64)   # a numpy slice costs less than torch's
    total = int(qsl[-1])
    parts = [target_positions[:total], target_token_ids[:total], next_token_ids[:n]]
    if num_rejected is not None:
        parts.append(num_rejected[:n])
    # One copy to the host for the batch's bookkeeping (one synchronisation on a GPU, not four).
    host = torch.cat(parts).cpu().numpy().astype(np.int64, copy=False)
    rejected = host[2 * total + n:] if num_rejected is not None else 0
    req_ids = runner.input_batch.req_ids[:n]
    return TargetRows(
        req_ids=req_ids,
        query_start_loc=qsl,
        positions=host[:total],
        n_valid=np.maximum(qsl[1:] - qsl[:-1] - rejected, 1),
        rows=target_hidden_states[:total],
        token_ids=host[total:2 * total],
        next_token_ids=host[2 * total:2 * total + n],
        block_table=cad.block_table_tensor[:n],
        live=runner.requests,
        prompts=_Prompts(runner.requests) if proposer._dspark_staging.prefix is not None else {},
    )


def drafter_metadata(cad: Any, inp: Any) -> Any:
    """vLLM's attention metadata ``cad`` for the drafter's rows ``inp`` (a :class:`DrafterInputs`).

    A shallow copy (as ``dataclasses.replace``, at a fraction of its cost) with the drafter's query
    starts, lengths, block tables and KV slots, and without the values ``cad`` caches from the
    target's query starts and lengths (``compute_num_computed_tokens``, ``token_to_req_indices``).
    """
    import torch

    new = object.__new__(type(cad))
    new.__dict__.update(cad.__dict__)
    new._num_computed_tokens_cache = None
    new._token_to_req_indices_cache = None
    new.query_start_loc = inp.query_start_loc
    new.query_start_loc_cpu = torch.from_numpy(inp.query_start_loc_cpu.astype(np.int32))
    new.seq_lens = inp.seq_lens
    new.seq_lens_cpu_upper_bound = torch.from_numpy(inp.seq_lens_cpu.copy())
    new.num_reqs = len(inp.drafting)
    new.num_actual_tokens = int(inp.query_start_loc_cpu[-1])
    new.max_query_len = inp.max_query_len
    new.max_seq_len = inp.max_seq_len
    new.block_table_tensor = inp.block_table
    new.slot_mapping = inp.slot_mapping
    new.positions = None
    return new


def _staged_propose(proposer: Any, staging: RequestStaging, stock_propose: Any, num_speculative_tokens: int,
                    target_token_ids: Any, target_positions: Any, target_hidden_states: Any, next_token_ids: Any,
                    cad: Any, sampling_metadata: Any, num_rejected: Any, slot_mappings: Any) -> Any:
    import torch

    rows = _target_rows(proposer, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                        cad, num_rejected)
    n = len(rows.req_ids)
    next_token_ids = next_token_ids[:n]
    try:
        inp = staging.stage(rows)
    except Exception as err:  # the engine keeps running: no drafts this step
        logger.exception("dspark_core: staging failed; this step decodes without drafts")
        staging.note_failure(err)
        staging.step_failed(rows.req_ids)
        return torch.zeros((n, num_speculative_tokens), dtype=torch.int64, device=next_token_ids.device)

    def run(sel: np.ndarray) -> Any:
        sub = staging.select(inp, sel)
        whole = len(sel) == n
        staging.current_req_ids = rows.req_ids if whole else [rows.req_ids[i] for i in sel]
        new_cad = drafter_metadata(cad, sub)
        next_ids = (next_token_ids if whole
                    else next_token_ids.index_select(0, torch.from_numpy(sel).to(next_token_ids.device)))
        return stock_propose(proposer, num_speculative_tokens, sub.token_ids, sub.positions, sub.rows,
                             next_ids, None, new_cad, sampling_metadata, None, None, slot_mappings)

    ok: np.ndarray | None = None   # None: the drafter ran for every request
    try:
        drafts = run(np.arange(n, dtype=np.int64))
    except Exception as err:  # noqa: BLE001 - find the request that fails; the others keep drafting
        staging.note_failure(err)
        ok = np.ones(n, dtype=bool)
        drafts = torch.zeros((n, num_speculative_tokens), dtype=torch.int64, device=next_token_ids.device)
        for i in range(n):
            if not inp.drafting[i]:
                continue
            try:
                drafts[i] = run(np.array([i], dtype=np.int64))[0]
            except Exception as one_err:  # noqa: BLE001
                ok[i] = False
                staging.note_request_failure(rows.req_ids[i], one_err)
    staging.finish(rows, ok)
    if ok is None and staging.all_drafting:
        return drafts
    keep_np = inp.drafting if ok is None else inp.drafting & ok
    keep = torch.from_numpy(keep_np).to(drafts.device).unsqueeze(1)
    return torch.where(keep, drafts, torch.zeros_like(drafts))
