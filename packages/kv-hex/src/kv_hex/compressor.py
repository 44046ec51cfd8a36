"""Ready-made HEX compressors and the ablations of HEX Table 4, built only from protocol objects."""

from __future__ import annotations

import dataclasses

from kv_hex.config import HEXConfig
from kv_hex.scorer import AccumulatedAttentionScorer
from kv_hex.selector import HEXSelector
from kv_hex.store import HEXStore
from kvcore import Budget, Compressor, Protection

__all__ = ["expander_only", "h2o_only", "hex", "hex_compressor", "kcvt", "random_mask"]


def hex_compressor(config: HEXConfig, name: str) -> Compressor:
    """A :class:`kvcore.Compressor` running ``config``: HEX's scorer (global accumulated attention), selector
    (heavy hitters + recent whole in full precision) and store (KCVT codes + static overlay + residual). HEX evicts
    nothing: the budget is ``ratio=0``."""
    if not isinstance(config, HEXConfig):
        raise TypeError(f"config must be a kv_hex.HEXConfig, got {type(config).__name__}")
    cfg = config

    def store() -> HEXStore:
        return HEXStore(cfg)

    store.__qualname__ = f"HEXStore[{name}]"
    return Compressor(
        scorer=AccumulatedAttentionScorer(),
        selector=HEXSelector(cfg.bits, cfg.heavy_ratio, cfg.recent, cfg.block_size),
        store=store,
        budget=Budget(ratio=0.0),
        protect=Protection(),
        name=name,
    )


def hex(bits: int = 3, **overrides) -> Compressor:
    """HEX-``bits`` (paper §4.2): expander ρ = 3.125 %, heavy hitters 2 %, recent 8, blocks of 96, append mode.

    ``overrides`` are :class:`HEXConfig` fields (``rho=0.046875``, ``mode="full"``, ``mask_scope="head"`` ...).
    """
    cfg = HEXConfig(bits=bits, **overrides)
    return hex_compressor(cfg, f"hex-{cfg.bits}")


def kcvt(bits: int = 3, **overrides) -> Compressor:
    """Quantization only (KCVT, HEX Table 4 "Quant only"): no expander overlay, no heavy hitters, no recent window."""
    cfg = HEXConfig(bits=bits, mask_kind="none", heavy_ratio=0.0, recent=0, **overrides)
    return hex_compressor(cfg, f"kcvt-{cfg.bits}")


def expander_only(bits: int = 3, rho: float = 0.03125, **overrides) -> Compressor:
    """Expander only (Table 4): the static overlay at density ``rho`` (Table 4's "EO" row uses 0.078125), no heavy
    hitters and no recent window."""
    cfg = HEXConfig(bits=bits, rho=rho, heavy_ratio=0.0, recent=0, **overrides)
    return hex_compressor(cfg, f"hex-expander-only-{cfg.bits}")


def h2o_only(bits: int = 3, heavy_ratio: float = 0.02, recent: int = 8, **overrides) -> Compressor:
    """H2O only (Table 4): heavy hitters and the recent window in full precision, no expander overlay ("EO" row:
    ``heavy_ratio=0.05, recent=16``)."""
    cfg = HEXConfig(bits=bits, heavy_ratio=heavy_ratio, recent=recent, mask_kind="none", **overrides)
    return hex_compressor(cfg, f"hex-h2o-only-{cfg.bits}")


def random_mask(bits: int = 3, **overrides) -> Compressor:
    """The control of HEX's structural claim (§3.2 ii-iii): HEX with a random *unstructured* element mask of the
    same density instead of the expander (same kept count, no degree constraint, no spectral check)."""
    cfg = HEXConfig(bits=bits, mask_kind="random", **overrides)
    return hex_compressor(cfg, f"hex-random-mask-{cfg.bits}")


def with_config(compressor: Compressor, **changes) -> Compressor:
    """``compressor`` (one of this module's) with :class:`HEXConfig` fields changed."""
    cfg = compressor.new_store().config
    return hex_compressor(dataclasses.replace(cfg, **changes), compressor.name)
