"""The two trained drafters: a DFlash-style block drafter and an EAGLE-3-style chain drafter (torch).

Both read the target's captured feature rows (tap layers concatenated, ``D`` wide),
share the target's token embedding (Gemma's, frozen, scaled by ``sqrt(n_embd)`` as
Gemma does) and draft over a *draft vocabulary*: the most frequent target labels of
the training captures, with a draft-to-target map as EAGLE-3's ``d2t``. The output
head is the embedding's rows of that vocabulary (tied, frozen).

:class:`BlockDrafter` (DFlash): the target rows reach it only as attention context.
Each row is projected once (``fc``) into the drafter's width; every layer's keys and
values of a context row are that layer's projections of it, so a row's entries never
change once cached. A round's block is ``[last, mask, ..., mask]`` at the ``B`` block
positions; the block attends to the context and to itself (bidirectionally), and block
row ``k`` predicts the token ``k + 1`` positions after ``last``.

:class:`ChainDrafter` (EAGLE-3): one entry per staged row, made of the row and the id
of the token after it, in a causal one-layer transformer; an entry predicts the token
after its successor. Draft step ``j > 1`` adds an entry whose feature is the drafter's
own output at the previous entry (``self_fc``) and whose token is the previous draft.

Positions: RoPE on queries and keys (``pos_kind="rope"``, relative only), or RoPE plus
a fixed sinusoidal absolute code of the position added to every input through a learned
projection (``pos_kind="rope+abs"``): a drafter whose positions are not only relative,
so that running it past its trained range breaks it even when the attention distances
stay short.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DrafterConfig", "BlockDrafter", "ChainDrafter", "POS_KINDS", "build"]

#: Position encodings a drafter can use.
POS_KINDS = ("rope", "rope+abs")
#: Width of the sinusoidal absolute code (``pos_kind="rope+abs"``).
ABS_CODE = 64


@dataclass
class DrafterConfig:
    """What a drafter is: saved beside its weights (``config.json`` of :mod:`save`)."""

    kind: str  #: "block" or "chain"
    feature_dim: int  #: D: tap layers x target width
    embed_dim: int  #: the target's embedding width (the embedding and the head are the target's, tied)
    hidden: int  #: the drafter's own width (projected from and to ``embed_dim``)
    n_layers: int
    n_heads: int
    head_dim: int
    ffn: int
    block_size: int  #: B
    n_ctx_train: int  #: T: the positions it is trained on, [0, T)
    draft_vocab: int  #: size of the draft vocabulary
    pos_kind: str = "rope"
    rope_base: float = 10000.0
    mask_token_id: int = 4  #: Gemma's <mask>: the block's filler token

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` ``(..., n, heads, hd)`` by positions ``pos`` ``(..., n)`` (half-split RoPE)."""
    hd = x.shape[-1]
    inv = base ** (-torch.arange(0, hd // 2, dtype=torch.float32, device=x.device) / (hd // 2))
    ang = pos.to(torch.float32)[..., None] * inv  # (..., n, hd/2)
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
    a, b = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def abs_code(pos: torch.Tensor) -> torch.Tensor:
    """The fixed sinusoidal code of absolute positions ``pos`` ``(..., n)`` -> ``(..., n, ABS_CODE)``."""
    inv = 10000.0 ** (-torch.arange(0, ABS_CODE // 2, dtype=torch.float32, device=pos.device) / (ABS_CODE // 2))
    ang = pos.to(torch.float32)[..., None] * inv
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class Layer(nn.Module):
    """Pre-norm attention + SwiGLU block; the caller supplies the keys and values."""

    def __init__(self, c: DrafterConfig, q_in: int) -> None:
        super().__init__()
        inner = c.n_heads * c.head_dim
        self.c = c
        self.attn_norm = RMSNorm(q_in)
        self.q = nn.Linear(q_in, inner, bias=False)
        self.k = nn.Linear(q_in, inner, bias=False)
        self.v = nn.Linear(q_in, inner, bias=False)
        self.o = nn.Linear(inner, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden)
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.c.n_heads, self.c.head_dim)

    def kv(self, x_normed: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated) and values of already-normed inputs ``(..., n, q_in)``: ``(..., n, heads, hd)``."""
        return rope(self.heads(self.k(x_normed)), pos, self.c.rope_base), self.heads(self.v(x_normed))

    def attend(self, h: torch.Tensor, q_normed: torch.Tensor, pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``h`` ``(N, n, hidden)`` updated by attention of ``q_normed`` at ``pos`` over ``k``/``v``
        ``(N, m, heads, hd)`` (``mask`` ``(N or 1, n, m)`` bool, True = visible), then the MLP."""
        q = rope(self.heads(self.q(q_normed)), pos, self.c.rope_base)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None],
        ).transpose(1, 2)
        h = h + self.o(a.reshape(*a.shape[:-2], -1))
        x = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class _Base(nn.Module):
    """What both drafters share: the frozen tied embedding rows, the row projection, positions."""

    def __init__(self, c: DrafterConfig, head: torch.Tensor, mask_embedding: torch.Tensor) -> None:
        super().__init__()
        if c.pos_kind not in POS_KINDS:
            raise ValueError(f"pos_kind must be one of {POS_KINDS}, got {c.pos_kind!r}")
        if head.shape != (c.draft_vocab, c.embed_dim):
            raise ValueError(f"head must be ({c.draft_vocab}, {c.embed_dim}), got {tuple(head.shape)}")
        self.c = c
        self.register_buffer("head", head.to(torch.float32), persistent=False)  # tied, frozen
        self.register_buffer("mask_embedding", mask_embedding.to(torch.float32), persistent=False)
        self.in_norm = RMSNorm(c.feature_dim)
        self.fc = nn.Linear(c.feature_dim, c.hidden, bias=False)
        self.emb_in = nn.Linear(c.embed_dim, c.hidden, bias=False)  # the target's embedding into the drafter
        self.out = nn.Linear(c.hidden, c.embed_dim, bias=False)  # back to the tied head's width
        self.final_norm = RMSNorm(c.embed_dim)
        self.abs_proj = nn.Linear(ABS_CODE, c.hidden, bias=False) if c.pos_kind == "rope+abs" else None
        if self.abs_proj is not None:
            nn.init.zeros_(self.abs_proj.weight)  # start as the pure-RoPE drafter

    def positional(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x`` plus the absolute code of ``pos`` (``rope+abs``), else ``x``."""
        return x if self.abs_proj is None else x + self.abs_proj(abs_code(pos))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of drafter outputs ``h``."""
        return self.final_norm(self.out(h)) @ self.head.T

    def embed(self, e: torch.Tensor) -> torch.Tensor:
        """The drafter's input of target embedding rows ``(..., embed_dim)``."""
        return self.emb_in(e)


class BlockDrafter(_Base):
    """DFlash-style block drafter (see the module docstring)."""

    def __init__(self, c: DrafterConfig, head: torch.Tensor, mask_embedding: torch.Tensor) -> None:
        super().__init__(c, head, mask_embedding)
        self.ctx_norm = RMSNorm(c.hidden)
        self.layers = nn.ModuleList(Layer(c, c.hidden) for _ in range(c.n_layers))

    def context(self, rows: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of context rows ``(..., n, D)`` at ``pos`` ``(..., n)``."""
        x = self.ctx_norm(self.positional(self.fc(self.in_norm(rows)), pos))
        return [layer.kv(x, pos) for layer in self.layers]

    def block(self, ctx: list[tuple[torch.Tensor, torch.Tensor]], emb: torch.Tensor, pos: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """Logits of block rows ``emb`` ``(N, n, hidden)`` at ``pos`` ``(N, n)`` over the context
        ``ctx`` (from :meth:`context`, ``m`` rows) and themselves (``emb``: target embedding rows); ``mask`` ``(N or 1, n, m + n)``
        bool, True = visible (None: all)."""
        h = self.positional(self.embed(emb), pos)
        for layer, (kc, vc) in zip(self.layers, ctx):
            x = layer.attn_norm(h)
            kb, vb = layer.kv(x, pos)
            h = layer.attend(h, x, pos, torch.cat([kc, kb], 1), torch.cat([vc, vb], 1), mask)
        return self.logits(h)


class ChainDrafter(_Base):
    """EAGLE-3-style chain drafter (see the module docstring); one layer."""

    def __init__(self, c: DrafterConfig, head: torch.Tensor, mask_embedding: torch.Tensor) -> None:
        super().__init__(c, head, mask_embedding)
        self.feat_norm = RMSNorm(c.hidden)
        self.emb_norm = RMSNorm(c.hidden)
        self.self_fc = nn.Linear(c.hidden, c.hidden, bias=False)  # a draft step's own feature
        self.fuse = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.layers = nn.ModuleList(Layer(c, c.hidden) for _ in range(c.n_layers))

    def row_features(self, rows: torch.Tensor) -> torch.Tensor:
        return self.fc(self.in_norm(rows))

    def entry_input(self, feat: torch.Tensor, emb: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """An entry's input from its feature (a row's ``fc``, or ``self_fc`` of a previous output)
        and its successor's embedding."""
        x = self.fuse(torch.cat([self.feat_norm(feat), self.emb_norm(self.embed(emb))], dim=-1))
        return self.positional(x, pos)

    def entries(self, u: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Outputs of entries ``u`` at ``pos`` attending over keys / values ``k``, ``v`` (which
        include their own, see :meth:`kv`)."""
        (layer,) = self.layers
        return layer.attend(u, layer.attn_norm(u), pos, k, v, mask)

    def kv(self, u: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (layer,) = self.layers
        return layer.kv(layer.attn_norm(u), pos)


def build(c: DrafterConfig, head: torch.Tensor, mask_embedding: torch.Tensor) -> BlockDrafter | ChainDrafter:
    """The drafter of ``c.kind``."""
    if c.kind == "block":
        return BlockDrafter(c, head, mask_embedding)
    if c.kind == "chain":
        if c.n_layers != 1:
            raise ValueError("the chain drafter has one layer")
        return ChainDrafter(c, head, mask_embedding)
    raise ValueError(f"kind must be 'block' or 'chain', got {c.kind!r}")


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if p.requires_grad)


def init_scale(m: nn.Module) -> None:
    """Small output projections, so a fresh drafter starts near its inputs (steadier early training)."""
    for name, p in m.named_parameters():
        if name.endswith((".o.weight", ".down.weight")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2))
