"""Hypothesis strategies for kvcore inputs: KV data (``B`` 1..3, ``Hkv`` 1..4, GQA group 1/2/4,
``T`` 1..48, ``D`` 4/8/16 by default; ``kv_samples`` takes other ranges) in fp32/fp16/bf16, left-padded batches,
ratios in [0, 1), token budgets, budgets below the protected count and degenerate values (constant, plateaus with
ties, huge and tiny magnitudes). Tensor values come from a drawn seed, so examples are cheap; shrinking acts on shapes
and kinds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from kvcore.budget import Budget
from kvcore.protection import Protection

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("normal", "constant", "plateau", "huge", "tiny")
SEEDS = st.integers(0, 2**31 - 2)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


def fill(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, kind: str = "normal", seed: int = 0):
    """Values of ``kind``: ``normal`` N(0, 1); ``constant``; ``plateau`` (integers: ties); ``huge`` (x1e4; x30 in
    fp16 so that q·k stays finite); ``tiny`` (x1e-6; x1e-5 in fp16, subnormal)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    scale = {"huge": 30.0 if dtype == torch.float16 else 1e4, "tiny": 1e-5 if dtype == torch.float16 else 1e-6}
    if kind == "constant":
        x = torch.full(shape, float(x.flatten()[0]) if x.numel() else 1.0)
    elif kind == "plateau":
        x = x.round()
    elif kind in scale:
        x = x * scale[kind]
    elif kind != "normal":
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return x.to(dtype)


@st.composite
def left_padded_masks(draw, batch: int, seq_len: int, min_valid: int = 1) -> torch.Tensor:
    """``[B, T]`` bool, ``True`` for real tokens, padding on the left; at least ``min_valid`` real per row."""
    n = torch.tensor([draw(st.integers(min(min_valid, seq_len), seq_len)) for _ in range(batch)])
    return torch.arange(seq_len)[None, :] >= (seq_len - n)[:, None]


@dataclass(frozen=True)
class KVSample:
    """Drawn inputs of one layer: ``keys``/``values`` ``[B, Hkv, T, D]``, ``queries`` ``[B, Hkv*group, W, D]``,
    ``attention_mask`` ``[B, T]`` (``None``: no padding) and the ``seed`` they came from."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    attention_mask: torch.Tensor | None
    seed: int

    def shapes(self) -> dict[str, Any]:
        (B, H, T, D), (_, Hq, W, _) = self.keys.shape, self.queries.shape
        return dict(B=B, Hkv=H, Hq=Hq, T=T, W=W, D=D, dtype=self.keys.dtype, seed=self.seed)


@st.composite
def kv_samples(
    draw,
    dtype=None,
    kinds=KINDS,
    groups=(1, 2, 4),
    min_t=1,
    max_t=48,
    padding=True,
    kv_heads=(1, 4),
    head_dims=(4, 8, 16),
) -> KVSample:
    """One layer's drawn inputs (:class:`KVSample`).

    Parameters
    ----------
    dtype : torch.dtype, optional
        Data type of every tensor; drawn from fp32/fp16/bf16 if ``None``.
    kinds : tuple of str
        Value kinds drawn from (see :func:`fill`).
    groups : tuple of int
        GQA groups drawn from (``Hq = Hkv * group``).
    min_t, max_t : int
        Range of the sequence length ``T``.
    padding : bool
        Whether a left-padded ``attention_mask`` may be drawn.
    kv_heads : tuple of int
        ``(low, high)``: range of ``Hkv`` (a method bound to a model's shapes fixes it: ``(3, 3)``).
    head_dims : tuple of int
        Head dims ``D`` drawn from.
    """
    B, H, T, D = (
        draw(st.integers(1, 3)),
        draw(st.integers(*kv_heads)),
        draw(st.integers(min_t, max_t)),
        draw(st.sampled_from(head_dims)),
    )
    group, W = draw(st.sampled_from(groups)), draw(st.integers(1, min(T, 8)))
    kind, seed = draw(st.sampled_from(kinds)), draw(SEEDS)
    dtype = draw(dtypes()) if dtype is None else dtype
    mask = draw(left_padded_masks(B, T)) if padding and draw(st.booleans()) else None
    return KVSample(
        fill((B, H, T, D), dtype, kind, seed),
        fill((B, H, T, D), dtype, kind, seed + 1),
        fill((B, H * group, W, D), dtype, kind, seed + 2),
        mask,
        seed,
    )


def ratios() -> st.SearchStrategy[float]:
    """Fractions removed, in [0, 1), the usual values over-represented."""
    return st.sampled_from((0.0, 0.25, 0.5, 0.75, 0.9)) | st.floats(0.0, 1.0, exclude_max=True)


def budgets(seq_len: int, granularity: str = "head", tokens: bool = True) -> st.SearchStrategy[Budget]:
    """A ratio budget or (if ``tokens``) a token budget in ``1 .. seq_len + 4``."""
    by_ratio = ratios().map(lambda r: Budget(ratio=r, granularity=granularity))
    by_tokens = st.integers(1, seq_len + 4).map(lambda n: Budget(tokens=n, granularity=granularity))
    return by_ratio | by_tokens if tokens else by_ratio


def protections(max_each: int = 3) -> st.SearchStrategy[Protection]:
    return st.builds(Protection, sinks=st.integers(0, max_each), recent=st.integers(0, max_each))


@st.composite
def budgets_below_protected(draw, granularity="head", tokens=True) -> tuple[int, Protection, Budget]:
    """``(T, protection, budget)``: ``budget.kept(T)`` is one less than the protected count (no padding)."""
    sinks, recent = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    sinks, recent = (1, 1) if sinks + recent < 2 else (sinks, recent)
    T, kept = draw(st.integers(sinks + recent, 48)), sinks + recent - 1
    if tokens and draw(st.booleans()):
        return T, Protection(sinks, recent), Budget(tokens=kept, granularity=granularity)
    return T, Protection(sinks, recent), Budget(ratio=(T - kept) / T, granularity=granularity)
