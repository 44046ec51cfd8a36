"""``HubKV``: the refinement as a kvcore ``Scorer`` wrapper around any base scorer (paper §3.3).

``HubKV(base=SnapKVScorer())`` asks the base for its scores, then refines them with
:func:`kv_hubkv.refine_config` using the context's budget ratio and protected mask. It is a Scorer
too, so it drops into any ``kvcore.Compressor`` in place of its base (docs/architecture.md: wrappers are
Scorers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from kvcore import Scorer, Scores, ScoringContext, WrappingScorer

from .checks import check_ratio
from .config import HubKVConfig
from .refine import refine_config

__all__ = ["HubKV"]


@dataclass(frozen=True)
class HubKV(WrappingScorer):
    """HubKV score refinement on top of ``base`` (a kvcore ``Scorer``).

    Parameters
    ----------
    base : kvcore.Scorer
        The importance scorer to refine (SnapKV, H2O, KVzip ...). Its declared ``needs_queries``,
        ``query_window``, ``needs_values`` and ``needs_extras`` are forwarded.
    config : HubKVConfig, optional
        Hyper-parameters; the paper's defaults (§4.1) if omitted.
    default_ratio : float, optional
        Compression ratio ``r`` used for the gate ``λ = r^p`` when the context carries no budget
        (``ctx.budget is None``, or an ``avg_bits``-only budget). Without it such a context raises.
    nonnegative : {"error", "shift"}, default "error"
        HubKV's discount assumes scores ``>= 0`` (paper §3.1). ``"error"`` raises on negative
        content scores; ``"shift"`` subtracts, per (batch row, head), the minimum content score
        first (rank-preserving within the head; use it for scorers such as ``-‖k‖``).

    Notes
    -----
    * Ratio (paper Eq. 10): ``ctx.budget.ratio`` for ratio budgets. For token budgets the
      cache's true compression ``1 - kept / n`` of each batch row, where ``n`` is the number of tokens
      the row has seen (its last true position + 1; at prefill, its real tokens): this is how the
      decoding-stage mode (target KV length, Appendix A.1) maps onto the gate. Taking ``n`` as the
      entries held instead (target + update interval while decoding) would give ``r = 128 / (1024 +
      128)`` at a 1,024 target, ``λ = r² ≈ 0.012``: a gate that barely moves the scores.
    * Protection (Appendix A.1): ``ctx.protected`` (sinks, recent window; ``kvcore.Compressor``
      fills it from its ``Protection``) is excluded from hub competition and head statistics and
      receives the maximum retention score. Padding (``ctx.attention_mask == False``) is excluded
      the same way and then scored 0.
    * Separate value scores from the base (``Scores.values``) are refined the same way.
    """

    base: Scorer
    config: HubKVConfig = dataclasses.field(default_factory=HubKVConfig)
    default_ratio: float | None = None
    nonnegative: Literal["error", "shift"] = "error"

    def __post_init__(self) -> None:
        self.check_base()
        if not isinstance(self.config, HubKVConfig):
            raise TypeError(f"config must be a HubKVConfig, got {type(self.config).__name__}")
        if self.default_ratio is not None:
            object.__setattr__(self, "default_ratio", check_ratio(self.default_ratio))
        if self.nonnegative not in ("error", "shift"):
            raise ValueError(f"nonnegative must be 'error' or 'shift', got {self.nonnegative!r}")

    @property
    def chunkable(self) -> bool:
        """``False``: the refine step reads the whole prompt's budget and hub structure at once."""
        return False

    # -- scoring ----------------------------------------------------------------------------------
    def _ratios(self, ctx: ScoringContext) -> list[float]:
        B = ctx.batch_size
        budget = ctx.budget
        if budget is not None and budget.ratio is not None:
            return [budget.ratio] * B
        if budget is not None and budget.tokens is not None:
            # the cache's true compression: kept over the tokens the sequence has seen (its last true position + 1),
            # not over the entries held now -- in the decoding mode the cache holds target + interval entries of a
            # much longer sequence, and 1 - kept / held would leave the gate almost closed (λ = r^p near 0)
            valid = ctx.valid
            last = ctx.positions.masked_fill(~valid, -1).amax(-1) + 1
            seen = torch.maximum(last, valid.sum(-1)).tolist()
            return [max(0.0, 1.0 - budget.kept(int(n)) / max(int(n), 1)) for n in seen]
        if self.default_ratio is not None:
            return [self.default_ratio] * B
        raise ValueError(
            "HubKV needs a compression ratio: pass a context with budget=Budget(ratio=...) or "
            "Budget(tokens=...) (kvcore.Compressor does), or construct HubKV(..., default_ratio=r)"
        )

    def _refine(
        self, s: torch.Tensor, excluded: torch.Tensor, valid: torch.Tensor, ratios: list[float]
    ) -> torch.Tensor:
        if self.nonnegative == "shift":
            content = ~excluded
            lo = s.float().masked_fill(~content, float("inf")).amin(-1, keepdim=True)
            lo = torch.where(torch.isfinite(lo), lo, 0.0)
            s = torch.where(content, s.float() - lo, s.float())
        if all(r == ratios[0] for r in ratios):
            z = refine_config(s, ratios[0], excluded, self.config)
        else:  # token budgets over padded rows: one gate per row
            z = torch.stack([refine_config(s[b], r, excluded[b], self.config) for b, r in enumerate(ratios)])
        return z.masked_fill(~valid[:, None, :], 0.0)

    def score(self, ctx: ScoringContext) -> Scores:
        """Base scores refined by HubKV: float32 ``[B, Hkv, T]``, higher = keep."""
        if not isinstance(ctx, ScoringContext):
            raise TypeError(f"ctx must be a kvcore.ScoringContext, got {type(ctx).__name__}")
        if ctx.batch_size == 0:
            raise ValueError(
                f"ctx.keys {tuple(ctx.keys.shape)} has batch size 0; HubKV refines the scores of at least one row"
            )
        base = self.base.score(ctx)
        if not isinstance(base, Scores):
            raise TypeError(f"base scorer {type(self.base).__name__} returned {type(base).__name__}, not kvcore.Scores")
        expect = (ctx.batch_size, ctx.num_kv_heads, ctx.seq_len)
        if tuple(base.keys.shape) != expect:
            raise ValueError(
                f"base scorer {type(self.base).__name__} returned scores {tuple(base.shape)}, expected {expect}"
            )
        ratios = self._ratios(ctx)
        valid = ctx.valid
        excluded = ~valid
        if ctx.protected is not None:
            excluded = excluded | ctx.protected.expand(ctx.batch_size, ctx.seq_len)
        excluded = excluded[:, None, :]
        keys = self._refine(base.keys, excluded, valid, ratios)
        values = None if base.values is None else self._refine(base.values, excluded, valid, ratios)
        return Scores(keys.contiguous(), None if values is None else values.contiguous())
