"""Ready-made baseline compressors, built only from kvcore protocol objects (swap any part)."""

from __future__ import annotations

from kvcore import Budget, Compressor, DenseStore, Protection, TopKSelector

from kv_baselines.scorers import (
    ConstantScorer,
    H2OScorer,
    KnormScorer,
    KVzipScorer,
    RandomScorer,
    SnapKVScorer,
    StreamingLLMScorer,
)


def _evicting(name: str, scorer, ratio: float, protect: Protection = Protection(), **budget) -> Compressor:
    return Compressor(
        scorer=scorer,
        selector=TopKSelector(),
        store=DenseStore,
        budget=Budget(ratio=ratio, **budget),
        protect=protect,
        name=name,
    )


def full() -> Compressor:
    """The uncompressed cache (ratio 0, dense store): the reference every method is compared against."""
    return _evicting("full", ConstantScorer(), 0.0)


def random(ratio: float, seed: int = 0) -> Compressor:
    """Evict uniformly at random (kvpress RandomPress)."""
    return _evicting("random", RandomScorer(seed), ratio)


def knorm(ratio: float) -> Compressor:
    """Evict the keys with the largest L2 norm (Devoto et al. 2024)."""
    return _evicting("knorm", KnormScorer(), ratio)


def streaming_llm(ratio: float, n_sink: int = 4) -> Compressor:
    """Keep ``n_sink`` attention sinks and the most recent tokens (StreamingLLM)."""
    return _evicting("streaming_llm", StreamingLLMScorer(n_sink), ratio, Protection(sinks=n_sink))


def snapkv(
    ratio: float, window: int = 64, kernel_size: int = 5, granularity: str = "head", pooling: str = "avg"
) -> Compressor:
    """SnapKV: observation-window attention (W = 64, avg-pool 5, GQA mean); the window is always kept."""
    return _evicting("snapkv", SnapKVScorer(window, kernel_size, pooling), ratio, Protection(recent=window),
                     granularity=granularity)


def h2o(ratio: float, recent: int = 0) -> Compressor:
    """H2O heavy hitters by cumulative attention over every prompt query, plus an optional recent window."""
    return _evicting("h2o", H2OScorer(), ratio, Protection(recent=recent))


def kivi(bits: int = 2, group_size: int = 32, residual: int = 128) -> Compressor:
    """KIVI: keys quantized per channel, values per token, a full-precision residual (Liu et al. 2024)."""
    return _kivi_compose("kivi", ConstantScorer(), 0.0, bits, group_size, residual, Protection())


def snapkv_kivi(ratio: float, bits: int = 2, window: int = 64, group_size: int = 32, residual: int = 128) -> Compressor:
    """Eviction and quantization composed: SnapKV picks what to keep, KIVI quantizes what is kept."""
    return _kivi_compose("snapkv+kivi", SnapKVScorer(window), ratio, bits, group_size, residual, Protection(recent=window))


def _kivi_compose(name, scorer, ratio, bits, group_size, residual, protect) -> Compressor:
    from kv_baselines.quant import KIVIStore, KIVITierSelector, UniformQuantizer

    def store() -> KIVIStore:
        return KIVIStore(
            UniformQuantizer(bits, axis="channel", group_size=group_size),
            UniformQuantizer(bits, axis="token", group_size=group_size),
            residual=residual,
        )

    return Compressor(
        scorer=scorer,
        selector=KIVITierSelector(TopKSelector(), bits=bits, residual=residual),
        store=store,
        budget=Budget(ratio=ratio),
        protect=protect,
        name=f"{name}-{bits}",
    )


def kvzip(ratio: float = 0.5, granularity: str = "global", store=DenseStore) -> Compressor:
    """A ready-made KVzip compressor: :class:`KVzipScorer` + top-k without per-head floor + a dense store.

    Parameters
    ----------
    ratio : float
        Fraction of the context entries removed (kvpress convention; the original repo's ``ratio`` is kept).
    granularity : {"global", "layer", "head"}
        ``"global"`` = KVzip's default "pair" threshold over all layers and heads; ``"head"`` = ``pair_uniform``.
    store : Store or callable
        Per-layer store factory or prototype.
    """
    return Compressor(
        scorer=KVzipScorer(),
        selector=TopKSelector(head_floor=0.0),
        store=store,
        budget=Budget(ratio=ratio, granularity=granularity),
        name="kvzip",
    )
