"""Shared helpers for the kv_hf tests: tiny random models built in code, small scorers, naive references."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kv_hf.testing import FAMILIES, TINY, tiny_model  # noqa: F401 (re-exported for the tests)
from kvcore import Budget, Compressor, DenseStore, Protection, Scorer, Scores, ScoringContext, TopKSelector


def prompt(T: int, B: int = 1, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (B, T), generator=g)


# -- scorers -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroScorer(Scorer):
    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(torch.zeros(ctx.keys.shape[:3], dtype=torch.float32, device=ctx.keys.device))


@dataclass(frozen=True)
class KnormScorer(Scorer):
    """kvpress Knorm: keep low-norm keys (score = -||k||)."""

    def score(self, ctx: ScoringContext) -> Scores:
        return Scores(-ctx.keys.float().norm(dim=-1))


@dataclass(frozen=True)
class WindowScorer(Scorer):
    """SnapKV-like: mean softmax attention of whatever query window it is given (GQA mean); it declares no window
    of its own (``query_window = None``), so the cache's ``query_window`` option decides."""

    needs_queries: ClassVar[bool] = True

    def score(self, ctx: ScoringContext) -> Scores:
        B, H, _T, D = ctx.keys.shape
        q = ctx.queries.float()
        g = q.shape[1] // H
        logits = q.view(B, H, g, -1, D) @ ctx.keys.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)
        logits = logits.masked_fill(~ctx.valid[:, None, None, None, :], float("-inf"))
        return Scores(torch.softmax(logits, -1).mean(dim=(2, 3)).nan_to_num(0.0))


@dataclass
class Recording:
    """Wraps a scorer and records every context it was given."""

    inner: Any
    contexts: list = field(default_factory=list)

    @property
    def needs_queries(self) -> bool:
        return self.inner.needs_queries

    @property
    def needs_values(self) -> bool:
        return self.inner.needs_values

    @property
    def needs_extras(self) -> frozenset:
        return self.inner.needs_extras

    @property
    def query_window(self) -> int | None:
        return self.inner.query_window

    @property
    def chunkable(self) -> bool:
        return self.inner.chunkable

    def score(self, ctx: ScoringContext) -> Scores:
        self.contexts.append(ctx)
        return self.inner.score(ctx)


def full_compressor() -> Compressor:
    """Keep everything through the compressed path (kv_baselines.full() when it exists)."""
    try:
        from kv_baselines import full  # type: ignore[attr-defined]

        return full()
    except ImportError:
        return Compressor(ZeroScorer(), TopKSelector(), DenseStore, Budget(ratio=0.0), name="full")


def make(
    scorer, ratio: float = 0.5, granularity: str = "head", protect: Protection | None = None, tokens: int | None = None
) -> Compressor:
    budget = Budget(tokens=tokens, granularity=granularity) if tokens else Budget(ratio=ratio, granularity=granularity)
    return Compressor(scorer, TopKSelector(), DenseStore, budget, protect or Protection())


# -- references --------------------------------------------------------------------------------------------
@torch.no_grad()
def naive_qk(model, input_ids: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE queries ``[B, Hq, T, D]`` and keys ``[B, Hkv, T, D]`` of one layer, from a plain full forward."""
    out = model(input_ids, output_hidden_states=True, use_cache=False)
    h = out.hidden_states[layer_idx]
    layer = model.model.layers[layer_idx]
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    B, T, _ = x.shape
    D = attn.head_dim
    q = attn.q_proj(x).view(B, T, -1, D)
    k = attn.k_proj(x).view(B, T, -1, D)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    pos = torch.arange(T)[None].expand(B, T)
    cos, sin = model.model.rotary_emb(x, pos)
    return apply_rotary_pos_emb(q, k, cos, sin)


class CharTokenizer:
    """A stub tokenizer (one id per character) with the encode/decode interface kv_hf uses."""

    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [3 + (ord(c) % 250) for c in text]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (1, 2)))
