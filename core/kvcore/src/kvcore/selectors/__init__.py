"""Reference selectors."""

from kvcore.selectors.tiered import TieredSelector, solve_shares, tier_counts
from kvcore.selectors.topk import TopKSelector

__all__ = ["TieredSelector", "TopKSelector", "solve_shares", "tier_counts"]
