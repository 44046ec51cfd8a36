"""Ready-made baseline compressors, built only from kvcore protocol objects (swap any part)."""

from __future__ import annotations

from kv_baselines.scorers import (
    ChunkKVScorer,
    ConstantScorer,
    ExpectedAttentionScorer,
    H2OScorer,
    KnormScorer,
    KVzipScorer,
    RandomScorer,
    SnapKVScorer,
    StreamingLLMScorer,
)
from kv_baselines.selectors import PyramidSelector
from kvcore import Budget, Compressor, DenseStore, Protection, TopKSelector
from kvcore.checks import check_int

KIVI_BITS = (1, 2, 3, 4, 8)
"""Code widths ``kivi()`` accepts (KIVI's 2 and 4 bits, and the packings kvcodec implements densely)."""


def _evicting(name: str, scorer, ratio: float, protect: Protection | None = None, **budget) -> Compressor:
    return Compressor(
        scorer=scorer,
        selector=TopKSelector(),
        store=DenseStore,
        budget=Budget(ratio=ratio, **budget),
        protect=Protection() if protect is None else protect,
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
    return _evicting(
        "snapkv", SnapKVScorer(window, kernel_size, pooling), ratio, Protection(recent=window), granularity=granularity
    )


def chunkkv(ratio: float, chunk: int = 10, window: int = 64, kernel_size: int = 5) -> Compressor:
    """ChunkKV: whole chunks of ``chunk`` tokens ranked by SnapKV's window attention summed over heads and averaged
    over the chunk, the same chunks in every head; the observation window is always kept (Liu et al. 2025, §3)."""
    scorer = ChunkKVScorer(SnapKVScorer(window, kernel_size), chunk)
    return _evicting("chunkkv", scorer, ratio, Protection(recent=window))


def expected_attention(
    ratio: float,
    n_future_positions: int = 512,
    n_sink: int = 4,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> Compressor:
    """Expected Attention (Devoto et al. 2025, §3; kvpress ``ExpectedAttentionPress`` defaults): the expected attention
    of the next ``n_future_positions`` queries times the value norm, top-k per head; the ``n_sink`` first tokens are
    always kept. See :class:`~kv_baselines.ExpectedAttentionScorer`."""
    scorer = ExpectedAttentionScorer(n_future_positions, n_sink, use_covariance, use_vnorm, epsilon)
    return _evicting("expected_attention", scorer, ratio, Protection(sinks=n_sink))


def pyramidkv(ratio: float, window: int = 64, kernel_size: int = 5, beta: float = 20.0) -> Compressor:
    """PyramidKV (Cai et al. 2024, §3; kvpress ``PyramidKVPress`` defaults): SnapKV's observation-window scores, kept
    counts shrinking linearly from the first layer to the last (``beta`` = 20), the same total as SnapKV at ``ratio``.

    The budget is ``"global"`` so that the selector sees every layer at once (:class:`~kv_baselines.PyramidSelector`);
    the observation window is always kept."""
    return Compressor(
        scorer=SnapKVScorer(window, kernel_size),
        selector=PyramidSelector(beta),
        store=DenseStore,
        budget=Budget(ratio=ratio, granularity="global"),
        protect=Protection(recent=window),
        name="pyramidkv",
    )


def sentencekv(
    ratio: float,
    window: int = 32,
    kernel_size: int = 7,
    sinks: int = 32,
    recent: int = 32,
    semantic_factor: float = 5.0,
) -> Compressor:
    """SentenceKV (Zhu et al. 2025, §3; the authors' code defaults): SnapKV prefill eviction (window 32, max-pool 7)
    at ``ratio``, the kept tokens grouped by punctuation sentences; while decoding, each step attends to the first
    ``sinks`` and last ``recent`` held entries plus the entries of the sentences whose mean key best matches the query,
    ``held / semantic_factor`` entries in all. See :class:`~kv_baselines.SentenceKVStore` for the departures."""
    from kv_baselines.sentence import SentenceKVScorer, SentenceKVStore, SentenceSelector

    scorer = SentenceKVScorer(SnapKVScorer(window, kernel_size, "max"))
    SentenceKVStore(sinks, recent, semantic_factor)  # validates now, not at the first compress
    return Compressor(
        scorer=scorer,
        selector=SentenceSelector(),
        store=lambda: SentenceKVStore(sinks, recent, semantic_factor),
        budget=Budget(ratio=ratio),
        protect=Protection(recent=window),
        name="sentencekv",
    )


def h2o(ratio: float, recent: int = 0) -> Compressor:
    """H2O heavy hitters by cumulative attention over every prompt query, plus an optional recent window."""
    return _evicting("h2o", H2OScorer(), ratio, Protection(recent=recent))


def kivi(
    bits: int = 2,
    evict: Compressor | None = None,
    group_size: int = 32,
    residual: int = 128,
    value_bits: int | None = None,
) -> Compressor:
    """KIVI: keys quantized per channel, values per token, a full-precision residual (Liu et al. 2024, §3.3-3.4).

    Parameters
    ----------
    bits : int
        Key width (and value width unless ``value_bits``): 1, 2, 3, 4 or 8.
    evict : kvcore.Compressor, optional
        Evict first with this compressor's scorer, selector, budget and protection (e.g. ``snapkv(0.5)``), then
        quantize what is kept with KIVI (``KIVITierSelector(base=evict.selector)`` + ``KIVIStore``). ``None``:
        keep everything (plain KIVI).
    group_size : int
        Quantization group ``G`` (KIVI's 32).
    residual : int
        Full-precision residual ``R`` (a multiple of ``group_size``; KIVI's 128).
    value_bits : int, optional
        Value width; ``None`` = ``bits``.
    """
    from kv_baselines.quant import KIVIStore, KIVITierSelector
    from kvcodec import UniformQuantizer

    if evict is not None and not isinstance(evict, Compressor):
        raise TypeError(
            f"evict must be a kvcore.Compressor (e.g. kv_baselines.snapkv(0.5)), got {type(evict).__name__}"
        )
    vbits = bits if value_bits is None else value_bits
    for name, width in (("bits", bits), ("value_bits", vbits)):
        check_int(name, width, choices=KIVI_BITS)

    def store() -> KIVIStore:
        return KIVIStore(
            UniformQuantizer(bits, axis="channel", group_size=group_size),
            UniformQuantizer(vbits, axis="token", group_size=group_size),
            residual=residual,
        )

    store()  # validates bits / group_size / residual now, not at the first compress
    selector = KIVITierSelector(
        TopKSelector() if evict is None else evict.selector, bits=bits, residual=residual, value_bits=value_bits
    )
    if evict is None:
        return Compressor(ConstantScorer(), selector, store, Budget(ratio=0.0), Protection(), name=f"kivi-{bits}")
    return Compressor(
        scorer=evict.scorer,
        selector=selector,
        store=store,
        budget=evict.budget,
        protect=evict.protect,
        name=f"{evict.name or 'evict'}+kivi-{bits}",
        strict=evict.strict,
    )


def snapkv_kivi(ratio: float, bits: int = 2, window: int = 64, group_size: int = 32, residual: int = 128) -> Compressor:
    """Eviction and quantization composed: SnapKV picks what to keep, KIVI quantizes what is kept.

    ``kivi(bits, evict=snapkv(ratio, window), ...)``.
    """
    return kivi(bits, evict=snapkv(ratio, window=window), group_size=group_size, residual=residual)


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


def fastkvzip(ratio: float = 0.5, granularity: str = "global", store=DenseStore, gate=None) -> Compressor:
    """A ready-made FastKVzip compressor: :class:`FastKVzipScorer` + KVzip's selection (top-k without per-head floor,
    global by default) + a dense store (Fast KVzip, Kim et al. 2026a; the HubKV paper's base scorer).

    Parameters
    ----------
    ratio : float
        Fraction of the context entries removed.
    granularity : {"global", "layer", "head"}
        As :func:`kvzip`.
    store : Store or callable
        Per-layer store factory or prototype.
    gate : FastKVzipGate or gate source, optional
        Default: the gate shipped for SmolLM2-135M.
    """
    from kv_baselines.scorers.fastkvzip import FastKVzipScorer

    return Compressor(
        scorer=FastKVzipScorer() if gate is None else FastKVzipScorer(gate),
        selector=TopKSelector(head_floor=0.0),
        store=store,
        budget=Budget(ratio=ratio, granularity=granularity),
        name="fastkvzip",
    )
