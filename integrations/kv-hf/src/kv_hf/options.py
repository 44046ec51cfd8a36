"""Options of a compressed cache."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore import Compressor
from kvcore.checks import check_int


@dataclass(frozen=True)
class CacheOptions:
    """How a :class:`~kv_hf.cache.CompressedCache` captures queries and re-compresses while decoding.

    Parameters
    ----------
    query_window : int, optional
        Number of most recent post-RoPE query states kept per layer (``[B, Hq, W, D]``) and handed to scorers
        as ``ScoringContext.queries``: the last ``W`` prompt queries at prefill (SnapKV's observation window),
        the last ``W`` decode queries at re-compression; ``0`` disables capture. Unset (``None``): what the
        scorer asks for through its ``query_window`` attribute — an int, or ``None`` for every prompt query
        (H2O; after the prefill is compressed only the last 64 are kept) — else 64 (kvpress ``window_size``).
        Decode queries (after compression) are captured only when the compressor's or the re-compressor's scorer
        declares ``needs_queries``.
        See :func:`kv_hf.support.resolve_query_window`.
    recompress_every : int, optional
        Re-score the stored entries every ``N`` committed tokens per layer and prune them to ``target_length`` /
        ``target_ratio`` (kvpress ``DecodingPress(compression_interval=N)``; HqeKV re-tiers every 32 tokens).
    target_length : int, optional
        Entries kept per KV head after a re-compression (kvpress ``target_size``).
    target_ratio : float, optional
        Fraction removed, relative to the tokens seen by the longest row: a re-compression keeps
        ``floor(seen * (1 - target_ratio))`` entries per head.
    recompressor : kvcore.Compressor, optional
        Scorer/selector/protection used for re-compression (default: the cache's compressor). Its store is not
        used: entries are rewritten into each layer's existing Store.
    replan : bool
        Honour a compressor that declares ``replan_every`` (``kvcore.Compressor``: a method that re-plans its held
        entries while decoding under its own budget, such as HqeKV's re-tiering every ``T = 32`` tokens): with no
        ``recompress_every``, the cache re-plans every ``replan_every`` committed tokens with the (re-)compressor
        as it is, no target needed. Default True; False decodes without it (an ablation).
    """

    query_window: int | None = None
    recompress_every: int | None = None
    target_length: int | None = None
    target_ratio: float | None = None
    recompressor: Compressor | None = None
    replan: bool = True

    def __post_init__(self) -> None:
        for name in ("query_window", "recompress_every", "target_length"):
            check_int(name, getattr(self, name), low=0 if name == "query_window" else 1, optional="not set")
        if self.target_ratio is not None:
            if isinstance(self.target_ratio, bool) or not isinstance(self.target_ratio, (int, float)):
                raise TypeError(f"target_ratio must be a float in [0, 1), got {type(self.target_ratio).__name__}")
            if not 0.0 <= float(self.target_ratio) < 1.0:
                raise ValueError(f"target_ratio must be in [0, 1) (fraction removed), got {self.target_ratio}")
        if self.target_length is not None and self.target_ratio is not None:
            raise ValueError("give either target_length or target_ratio, not both")
        if self.recompress_every is not None and self.target_length is None and self.target_ratio is None:
            raise ValueError("recompress_every needs a target: target_length=... or target_ratio=...")
        if not isinstance(self.replan, bool):
            raise TypeError(f"replan must be a bool, got {type(self.replan).__name__}")
        if self.recompressor is not None and not isinstance(self.recompressor, Compressor):
            raise TypeError(f"recompressor must be a kvcore.Compressor, got {type(self.recompressor).__name__}")
