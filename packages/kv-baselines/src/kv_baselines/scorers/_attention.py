"""Attention of a query window over a layer's keys, at KV-head granularity (shared by SnapKV and H2O)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from kvcore import ScoringContext


def window_attention(ctx: ScoringContext, chunk: int = 512) -> Iterator[torch.Tensor]:
    """Yield softmax attention probabilities ``[B, Hkv, G, w, T]`` (float32) of the query window, in chunks.

    The window's queries are the last ``W`` tokens of the sequence; each attends causally (to keys at or
    before its own index) and never to padding. ``G`` = query heads per KV head (no ``repeat_kv``: the
    keys stay ``[B, Hkv, T, D]`` and queries are grouped instead).
    """
    q = ctx.queries
    B, Hq, W, D = q.shape
    H, T = ctx.num_kv_heads, ctx.seq_len
    if W > T:
        raise ValueError(f"queries window W={W} is longer than the sequence T={T}")
    G = Hq // H
    k = ctx.keys.float()
    qg = q.float().view(B, H, G, W, D)
    pad = ~ctx.valid[:, None, None, None, :]  # [B,1,1,1,T]
    key_idx = torch.arange(T, device=k.device)
    for s in range(0, W, chunk):
        e = min(W, s + chunk)
        logits = torch.einsum("bhgwd,bhtd->bhgwt", qg[:, :, :, s:e], k) / math.sqrt(D)
        query_idx = torch.arange(T - W + s, T - W + e, device=k.device)
        future = key_idx[None, :] > query_idx[:, None]  # [w, T]
        logits = logits.masked_fill(future | pad, float("-inf"))
        yield torch.softmax(logits, dim=-1).nan_to_num(0.0)
