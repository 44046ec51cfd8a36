"""Hypothesis strategies for kvcore inputs (DESIGN.md §3).

KV data (``B`` 1..3, ``Hkv`` 1..4, GQA group 1/2/4, ``T`` 1..48, ``D`` 4/8/16) in fp32/fp16/bf16, batches with
left padding, ratios in [0, 1), token budgets, budgets below the protected count and degenerate values
(constant, plateaus with ties, huge and tiny magnitudes). Tensor values come from a drawn seed, so examples
are cheap; shrinking acts on shapes and kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from kvcore.budget import Budget
from kvcore.protection import Protection

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("normal", "constant", "plateau", "huge", "tiny")
SEEDS = st.integers(0, 2**31 - 1)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


def fill(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, kind: str = "normal", seed: int = 0) -> torch.Tensor:
    """A tensor of ``kind`` values: ``normal`` N(0, 1); ``constant``; ``plateau`` (integers, many ties);
    ``huge`` (x1e4, x30 in fp16 so that q·k stays finite); ``tiny`` (x1e-6, x1e-5 in fp16: subnormal)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if kind == "constant":
        x = torch.full(shape, float(x.flatten()[0]) if x.numel() else 1.0)
    elif kind == "plateau":
        x = torch.round(x)
    elif kind == "huge":
        x = x * (30.0 if dtype == torch.float16 else 1e4)
    elif kind == "tiny":
        x = x * (1e-5 if dtype == torch.float16 else 1e-6)
    elif kind != "normal":
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return x.to(dtype)


@st.composite
def tensors(draw, shape: tuple[int, ...], dtype: torch.dtype | None = None, kinds: tuple[str, ...] = KINDS):
    dtype = draw(dtypes()) if dtype is None else dtype
    return fill(shape, dtype, draw(st.sampled_from(kinds)), draw(SEEDS))


@st.composite
def left_padded_masks(draw, batch: int, seq_len: int, min_valid: int = 1) -> torch.Tensor:
    """``[B, T]`` bool masks, ``True`` for real tokens, padding on the left; every row has ``>= min_valid``."""
    n = torch.tensor([draw(st.integers(min(min_valid, seq_len), seq_len)) for _ in range(batch)])
    return torch.arange(seq_len)[None, :] >= (seq_len - n)[:, None]


@dataclass(frozen=True)
class KVSample:
    """One layer's drawn inputs: ``keys``/``values`` ``[B, Hkv, T, D]``, ``queries`` ``[B, Hkv*group, W, D]``,
    ``attention_mask`` ``[B, T]`` (``None`` = no padding) and the ``seed`` they came from."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    attention_mask: torch.Tensor | None
    seed: int

    def shapes(self) -> dict[str, Any]:
        B, H, T, D = self.keys.shape
        return dict(B=B, Hkv=H, Hq=self.queries.shape[1], T=T, W=self.queries.shape[2], D=D,
                    dtype=self.keys.dtype, seed=self.seed)


@st.composite
def kv_samples(draw, dtype: torch.dtype | None = None, kinds: tuple[str, ...] = KINDS, groups=(1, 2, 4),
               min_t: int = 1, max_t: int = 48, padding: bool = True) -> KVSample:
    B, H, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(min_t, max_t))
    D, group, W = draw(st.sampled_from((4, 8, 16))), draw(st.sampled_from(groups)), draw(st.integers(1, min(T, 8)))
    dtype = draw(dtypes()) if dtype is None else dtype
    kind, seed = draw(st.sampled_from(kinds)), draw(SEEDS)
    mask = draw(left_padded_masks(B, T)) if padding and draw(st.booleans()) else None
    return KVSample(fill((B, H, T, D), dtype, kind, seed), fill((B, H, T, D), dtype, kind, seed + 1),
                    fill((B, H * group, W, D), dtype, kind, seed + 2), mask, seed)


def ratios() -> st.SearchStrategy[float]:
    """Fractions removed, in [0, 1), with the usual values over-represented."""
    return st.one_of(st.sampled_from((0.0, 0.25, 0.5, 0.75, 0.9)), st.floats(0.0, 1.0, exclude_max=True))


def token_budgets(seq_len: int) -> st.SearchStrategy[int]:
    return st.integers(1, seq_len + 4)


@st.composite
def budgets(draw, seq_len: int, granularity: str = "head", tokens: bool = True) -> Budget:
    """A ratio budget, or (if ``tokens``) sometimes a token-count budget."""
    if tokens and draw(st.booleans()):
        return Budget(tokens=draw(token_budgets(seq_len)), granularity=granularity)
    return Budget(ratio=draw(ratios()), granularity=granularity)


def protections(max_each: int = 3) -> st.SearchStrategy[Protection]:
    return st.builds(Protection, sinks=st.integers(0, max_each), recent=st.integers(0, max_each))


@st.composite
def budgets_below_protected(draw, granularity: str = "head", tokens: bool = True) -> tuple[int, Protection, Budget]:
    """``(T, protection, budget)`` with ``budget.kept(T)`` one less than the protected count (all tokens real)."""
    sinks, recent = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    if sinks + recent < 2:
        sinks, recent = 1, 1
    T = draw(st.integers(sinks + recent, 48))
    kept = sinks + recent - 1
    if tokens and draw(st.booleans()):
        return T, Protection(sinks, recent), Budget(tokens=kept, granularity=granularity)
    return T, Protection(sinks, recent), Budget(ratio=(T - kept) / T, granularity=granularity)
