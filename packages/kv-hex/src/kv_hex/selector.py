"""HEX's token tiers: heavy hitters and the recent window whole in full precision, the rest KCVT codes (§3.3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kv_hex.config import BITS
from kvcore import EVICT, FULL, Budget, Plan, Scores, Selector, TopKSelector
from kvcore.checks import check_int

__all__ = ["HEXSelector", "hex_tiers"]


def hex_tiers(
    scores: torch.Tensor,
    keep: torch.Tensor,
    protected: torch.Tensor,
    bits: int,
    heavy_ratio: float,
    recent: int,
    block_size: int,
) -> torch.Tensor:
    """Tiers ``[..., T]`` uint8 of HEX's prefill layout over the kept entries ``keep`` of each head.

    The slots ``[0, T - T mod block_size)`` form the segment compressed now; the trailing ``T mod block_size``
    slots wait in the store's fp16 residual (``FULL``). Inside the segment: the ``int(heavy_ratio · n)`` kept
    entries of highest ``scores`` (``n`` = kept entries of the segment; ties to the lower index), the last
    ``recent`` kept entries and the ``protected`` ones are ``FULL``; every other kept entry is ``bits``.
    Evicted entries are ``EVICT``.
    """
    T = keep.shape[-1]
    seg_end = T - T % block_size
    idx = torch.arange(T, device=keep.device)
    in_seg = keep & (idx < seg_end)
    n = in_seg.sum(-1, keepdim=True)
    # heavy hitters: stable descending sort over segment entries (others pushed to the end)
    s = torch.where(in_seg & ~protected, scores.float(), float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand_as(order).contiguous())
    free = (in_seg & ~protected).sum(-1, keepdim=True)
    k_hh = torch.minimum((heavy_ratio * n.double()).floor().long(), free)
    heavy = in_seg & ~protected & (rank < k_hh)
    from_end = in_seg.flip(-1).cumsum(-1).flip(-1)  # segment entries at or after t
    recent_mask = in_seg & (from_end <= recent)
    full = heavy | recent_mask | (protected & keep) | (keep & (idx >= seg_end))
    return torch.where(keep, torch.where(full, FULL, bits), EVICT).to(torch.uint8)


@dataclass(frozen=True)
class HEXSelector:
    """Evict with ``base`` (HEX itself evicts nothing: ratio 0), then lay the kept entries out as HEX does.

    Heavy hitters (top ``heavy_ratio`` by score) and the last ``recent`` tokens of the compressed segment are kept
    whole in full precision, keys and values (HEX §3.3, H2O mask ``Mask_hh ∨ Mask_local``); the rest is quantized
    at ``bits`` (KCVT, §3.4) with the store's static expander overlay (§3.2). With HEX's scorer
    (:class:`~kv_hex.AccumulatedAttentionScorer`, one score for all heads) the heavy hitters are the same tokens in
    every head. The trailing ``T mod block_size`` slots are ``FULL``: they are the streaming residual (§4.1).
    Protected entries are ``FULL`` too.

    Parameters
    ----------
    bits : int, default 3
    heavy_ratio : float, default 0.02
    recent : int, default 8
    block_size : int, default 96
    base : kvcore.Selector, default TopKSelector()
        Decides which entries are kept (only kept vs evicted is used).
    """

    bits: int = 3
    heavy_ratio: float = 0.02
    recent: int = 8
    block_size: int = 96
    base: Selector = field(default_factory=TopKSelector)

    def __post_init__(self) -> None:
        from kv_hex.config import HEXConfig

        check_int("bits", self.bits, choices=BITS)
        HEXConfig(heavy_ratio=self.heavy_ratio, recent=self.recent, block_size=self.block_size)  # validates them
        if not isinstance(self.base, Selector):
            raise TypeError(f"base must implement kvcore.Selector, got {type(self.base).__name__}")

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        """Plan ``[B, H, T]``: ``EVICT`` where ``base`` evicts, ``FULL`` / ``bits`` as in :func:`hex_tiers`."""
        plan = self.base.select(scores, budget, protected, valid)
        prot = torch.zeros_like(plan.keep_keys) if protected is None else protected
        if prot.ndim == plan.keep_keys.ndim - 1:
            prot = prot.unsqueeze(-2)
        prot = prot.to(plan.keep_keys.device).expand_as(plan.keep_keys)
        args = (self.bits, self.heavy_ratio, self.recent, self.block_size)
        kb = hex_tiers(scores.keys, plan.keep_keys, prot, *args)
        if scores.values is None:
            return Plan(kb)
        return Plan(kb, hex_tiers(scores.for_values, plan.keep_values, prot, *args))
