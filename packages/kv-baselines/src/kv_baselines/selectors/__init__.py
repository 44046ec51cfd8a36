"""Baseline selectors."""

from kv_baselines.selectors.pyramid import PyramidSelector, layer_counts

__all__ = ["PyramidSelector", "layer_counts"]
