"""Stage 2: train a drafter on crops of ``T`` positions of the training captures (CPU, torch, one thread).

Every example is a crop of ``T`` consecutive captured positions, rebased to drafter
positions ``[0, T)``: the drafter never sees a position outside its trained range
``[0, T)`` (``max_position_embeddings = T`` in its config).

* Block drafter: ``ANCHORS`` anchors ``a`` per crop; anchor ``a`` has the rows
  ``[0, a)`` as context, the block ``[x_a, mask, ..., mask]`` at ``[a, a + B)``, and
  block row ``k``'s label is the target's greedy token after position ``a + k``. All
  anchors of a crop share one attention call (each anchor's queries see the context
  rows before it and its own block).
* Chain drafter: entry ``p`` (row ``p``, token ``p + 1``) predicts the target's greedy
  token after ``p + 1``; a second, unrolled draft step (EAGLE-3's training-time test)
  adds at ``p + 1`` an entry made of the first step's output and the target's greedy
  token, which predicts the token after that.

Labels outside the draft vocabulary are ignored by the loss (the drafter cannot
propose them). Cached under a key of the captures' keys, the drafter's configuration,
the seed and the optimiser's settings.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.nn import functional as F

import drafters as dr
from cache import Cache, key_of
from capture import Captured
from vocab import Embedding, draft_vocabulary

__all__ = ["TrainSettings", "Trained", "train", "load", "hf_config"]

log = logging.getLogger("real_drafter")

#: The drafters' own width (their inputs and outputs are projected from and to the target's 640).
HIDDEN = 256
#: Block anchors per crop.
ANCHORS = 32
#: Loss weight of the chain drafter's unrolled second step.
STEP2_WEIGHT = 0.5
#: Linear warm-up steps of the learning rate (then cosine to LR_FLOOR of it).
WARMUP = 30
LR_FLOOR = 0.1


@dataclass(frozen=True)
class TrainSettings:
    """How a drafter is trained."""

    kind: str  #: "block" or "chain"
    pos_kind: str = "rope"
    T: int = 256  #: crop length = the trained range
    block_size: int = 4
    steps: int = 600
    crops: int = 4  #: crops per step
    lr: float = 2e-3
    draft_vocab: int = 4096
    n_layers: int = 2
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Trained:
    """A trained drafter: the module, its configuration, the draft-to-target map, where it is saved."""

    model: dr.BlockDrafter | dr.ChainDrafter
    config: dr.DrafterConfig
    d2t: np.ndarray
    path: Path
    train_s: float
    settings: TrainSettings


def _config(s: TrainSettings, feature_dim: int, width: int, vocab: int) -> dr.DrafterConfig:
    return dr.DrafterConfig(
        kind=s.kind, feature_dim=feature_dim, embed_dim=width, hidden=HIDDEN, n_layers=1 if s.kind == "chain" else s.n_layers,
        n_heads=4, head_dim=HIDDEN // 4, ffn=2 * HIDDEN, block_size=s.block_size, n_ctx_train=s.T, draft_vocab=vocab,
        pos_kind=s.pos_kind,
    )


def hf_config(c: dr.DrafterConfig, layers: Sequence[int], target_name: str) -> dict[str, Any]:
    """The drafter's Hugging Face style ``config.json`` (what ``DrafterInfo.from_hf_config`` reads):
    a DFlash config for the block drafter, an EAGLE-3 one for the chain drafter, tap layers as
    ``l_out`` indices, the trained range as ``max_position_embeddings``."""
    base: dict[str, Any] = {
        "max_position_embeddings": c.n_ctx_train, "hidden_size": c.hidden, "target_hidden_size": c.embed_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads, "head_dim": c.head_dim,
        "intermediate_size": c.ffn, "rope_theta": c.rope_base, "draft_vocab_size": c.draft_vocab,
        "target_model": target_name, "real_drafter": c.to_dict(),
    }
    if c.kind == "block":
        return {"architectures": ["DFlashDraftModel"], "model_type": "dflash",
                "dflash_config": {"block_size": c.block_size, "target_layer_ids": list(layers),
                                  "mask_token_id": c.mask_token_id}, **base}
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "eagle_aux_hidden_state_layer_ids": list(layers), **base}


def _build(c: dr.DrafterConfig, emb: Embedding, d2t: np.ndarray) -> dr.BlockDrafter | dr.ChainDrafter:
    head = torch.from_numpy(emb.rows(d2t) / emb.scale)  # Gemma's tied head: the unscaled embedding
    mask = torch.from_numpy(emb.rows([c.mask_token_id])[0])
    return dr.build(c, head, mask)


def train(cache: Cache, caps: Sequence[Captured], emb: Embedding, s: TrainSettings, layers: Sequence[int],
          target_name: str) -> Trained:
    """The drafter of ``s`` trained on ``caps`` (from the cache where present)."""
    inputs = {"captures": [c.key for c in caps], "settings": s.as_dict(), "anchors": ANCHORS,
              "step2_weight": STEP2_WEIGHT, "warmup": WARMUP, "torch": torch.__version__, "version": 1}
    key = key_of(inputs)
    d = cache.dir("drafter", key)
    if cache.done("drafter", key):
        log.info("train %s/%s seed %d: cached (%s)", s.kind, s.pos_kind, s.seed, d.name)
        return load(d, emb)
    d = cache.fresh("drafter", key, inputs)
    d2t, coverage = draft_vocabulary([c.labels for c in caps], s.draft_vocab)
    c = _config(s, caps[0].rows.shape[1], emb.width, len(d2t))
    torch.manual_seed(s.seed)
    model = _build(c, emb, d2t)
    dr.init_scale(model)
    t2d = np.full(emb.n_vocab, -100, np.int64)
    t2d[d2t] = np.arange(len(d2t))
    rng = np.random.default_rng(s.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / WARMUP) * (
        LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, i / max(1, s.steps))))))
    step_fn = _block_step if s.kind == "block" else _chain_step
    log.info("train %s/%s seed %d: %s params, draft vocabulary %d (covers %.1f%% of labels), %d steps",
             s.kind, s.pos_kind, s.seed, f"{dr.param_count(model):,}", len(d2t), 100 * coverage, s.steps)
    t0 = time.perf_counter()
    history = []
    for i in range(s.steps):
        loss, acc = step_fn(model, caps, emb, t2d, s, rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history.append((float(loss.detach()), acc))
        if (i + 1) % max(1, s.steps // 6) == 0 or i + 1 == s.steps:
            recent = history[-max(1, s.steps // 6):]
            log.info("  step %d/%d: loss %.3f, top-1 %.1f%% (%.0f s)", i + 1, s.steps,
                     np.mean([h[0] for h in recent]), 100 * np.mean([h[1] for h in recent]), time.perf_counter() - t0)
    train_s = time.perf_counter() - t0
    torch.save(model.state_dict(), d / "weights.pt")
    np.save(d / "d2t.npy", d2t)
    (d / "config.json").write_text(json.dumps(hf_config(c, layers, target_name), indent=1))
    (d / "train.json").write_text(json.dumps({"train_s": train_s, "coverage": coverage, "history": history,
                                              "settings": s.as_dict()}, indent=1))
    cache.finish("drafter", key)
    log.info("train %s/%s seed %d: %.0f s", s.kind, s.pos_kind, s.seed, train_s)
    return Trained(model.eval(), c, d2t, d, train_s, s)


def load(d: Path, emb: Embedding) -> Trained:
    """A saved drafter (its ``config.json``'s ``real_drafter`` object, weights and map)."""
    cfg = json.loads((d / "config.json").read_text())
    c = dr.DrafterConfig(**cfg["real_drafter"])
    d2t = np.load(d / "d2t.npy")
    model = _build(c, emb, d2t)
    model.load_state_dict(torch.load(d / "weights.pt"))
    meta = json.loads((d / "train.json").read_text())
    return Trained(model.eval(), c, d2t, d, float(meta["train_s"]), TrainSettings(**meta["settings"]))


def _crops(caps: Sequence[Captured], s: TrainSettings, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``s.crops`` random crops of ``T`` positions: rows ``(N, T, D)``, tokens and labels ``(N, T)``."""
    rows, toks, labs = [], [], []
    for _ in range(s.crops):
        c = caps[int(rng.integers(len(caps)))]
        lo = int(rng.integers(0, len(c.tokens) - s.T + 1))
        rows.append(np.asarray(c.rows[lo : lo + s.T], np.float32))
        toks.append(c.tokens[lo : lo + s.T])
        labs.append(c.labels[lo : lo + s.T])
    return np.stack(rows), np.stack(toks), np.stack(labs)


def _block_step(model: Any, caps: Sequence[Captured], emb: Embedding, t2d: np.ndarray, s: TrainSettings,
                rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    rows, toks, labs = _crops(caps, s, rng)
    N, T, B = rows.shape[0], s.T, s.block_size
    m = ANCHORS
    anchors = np.stack([np.sort(rng.choice(np.arange(1, T - B + 1), m, replace=False)) for _ in range(N)])
    pos = (anchors[:, :, None] + np.arange(B)).reshape(N, m * B)
    lab = t2d[np.take_along_axis(labs, pos, axis=1)]
    first = emb.rows(np.take_along_axis(toks, anchors, axis=1).reshape(-1)).reshape(N, m, 1, -1)
    blk = np.concatenate([first, np.broadcast_to(model.mask_embedding.numpy(), (N, m, B - 1, first.shape[-1]))], 2)
    ctx_mask = np.arange(T)[None, None, :] < np.repeat(anchors, B, axis=1)[:, :, None]  # (N, mB, T)
    grp = np.repeat(np.arange(m), B)
    blk_mask = np.broadcast_to(grp[:, None] == grp[None, :], (N, m * B, m * B))
    mask = torch.from_numpy(np.concatenate([ctx_mask, blk_mask], axis=2))
    ctx = model.context(torch.from_numpy(rows), torch.arange(T).expand(N, T))
    logits = model.block(ctx, torch.from_numpy(np.ascontiguousarray(blk.reshape(N, m * B, -1))),
                         torch.from_numpy(pos), mask)
    target = torch.from_numpy(lab)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    ok = target >= 0
    acc = float(((logits.argmax(-1) == target) & ok).sum() / max(1, int(ok.sum())))
    return loss, acc


def _chain_step(model: Any, caps: Sequence[Captured], emb: Embedding, t2d: np.ndarray, s: TrainSettings,
                rng: np.random.Generator) -> tuple[torch.Tensor, float]:
    rows, toks, labs = _crops(caps, s, rng)
    N, T = rows.shape[0], s.T
    n = T - 1  # entries 0..T-2: (row p, token p + 1)
    pos1 = torch.arange(n).expand(N, n)
    feat = model.row_features(torch.from_numpy(rows[:, :n]))
    succ = torch.from_numpy(emb.rows(toks[:, 1:].reshape(-1)).reshape(N, n, -1))
    u1 = model.entry_input(feat, succ, pos1)
    k1, v1 = model.kv(u1, pos1)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]
    h1 = model.entries(u1, pos1, k1, v1, causal)
    lab1 = torch.from_numpy(t2d[labs[:, 1:]])  # entry p: the greedy token after p + 1
    # step 2: at p + 1 (p = 0..T-3), the first step's output at p and the greedy token after p + 1
    n2 = n - 1
    pos2 = torch.arange(1, n2 + 1).expand(N, n2)
    succ2 = torch.from_numpy(emb.rows(labs[:, 1:n2 + 1].reshape(-1)).reshape(N, n2, -1))
    u2 = model.entry_input(model.self_fc(h1[:, :n2]), succ2, pos2)
    k2, v2 = model.kv(u2, pos2)
    see_real = torch.arange(n)[None, :] <= torch.arange(n2)[:, None]  # step-2 entry at p+1 sees real entries <= p
    mask2 = torch.cat([see_real, torch.eye(n2, dtype=torch.bool)], dim=1)[None]
    h2 = model.entries(u2, pos2, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1), mask2)
    lab2 = torch.from_numpy(t2d[labs[:, 2:n2 + 2]])
    lg1, lg2 = model.logits(h1), model.logits(h2)
    V = lg1.shape[-1]
    loss = F.cross_entropy(lg1.reshape(-1, V), lab1.reshape(-1), ignore_index=-100) + STEP2_WEIGHT * F.cross_entropy(
        lg2.reshape(-1, V), lab2.reshape(-1), ignore_index=-100)
    ok = lab1 >= 0
    acc = float(((lg1.argmax(-1) == lab1) & ok).sum() / max(1, int(ok.sum())))
    return loss, acc
