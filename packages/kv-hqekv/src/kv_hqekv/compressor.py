"""Ready-made HqeKV compressors (scorer → block tier selector → HqeKV store)."""

from __future__ import annotations

from kv_hqekv.config import HqeKVConfig
from kv_hqekv.scorer import HqeKVScorer
from kv_hqekv.selector import HqeKVSelector
from kv_hqekv.shares import PRESETS, Shares, preset
from kv_hqekv.store import HqeKVStore
from kv_hqekv.window import window_replan
from kvcore import Budget, Compressor, Protection
from kvcore.checks import check_number

DEFAULT_PRESETS: dict[float, str] = {2.0: "llama-2", 2.8: "llama-2.8", 3.2: "llama-3.2", 3.25: "llama-3.25"}
"""The Table 9 shares a bare ``hqekv(bits)`` uses (the paper's Llama-3.1-8B-Instruct search)."""


def hqekv(
    bits: float = 2.0,
    shares: Shares | str | None = None,
    config: HqeKVConfig | None = None,
    name: str | None = None,
) -> Compressor:
    """HqeKV at ``bits`` average code bits (Wang et al. 2025, "HqeKV", §3, Alg. 2).

    Parameters
    ----------
    bits : float
        ``B_avg`` of Eq. 3: code bits per entry outside the fp16 blocks and the residual (which are extra).
    shares : Shares or str, optional
        The tier shares (4-bit, 2-bit, 1-bit, evict), a Table 9 preset name (``"qwen3-2"``), or ``None`` for the
        paper's Llama shares at 2, 2.8, 3.2 or 3.25 bits (:data:`DEFAULT_PRESETS`). Other ``bits`` need shares —
        from kv-lab's ``kv_lab.hqekv.search_shares`` (``kv-hqekv search``) or :func:`kv_hqekv.feasible`.
    config : HqeKVConfig, optional
        Block size, window, fp16 blocks, metric and eviction options (paper defaults).
    name : str, optional
        Compressor name (default ``"hqekv-<bits>"``).

    Returns
    -------
    kvcore.Compressor
        ``HqeKVScorer`` → ``HqeKVSelector`` → ``HqeKVStore``, budget ``Budget(avg_bits=bits)``, no protection (the
        fp16 residual is the unplanned tail). It declares its decode-time re-tiering (§3.5): ``replan_every = T``
        and ``replanner =`` :func:`kv_hqekv.window.window_replan`, so an adapter (``kv_hf``) re-tiers every ``T``
        decoded tokens with the decode-time shares, scoring from the store's window state.
    """
    bits = check_number("bits", bits, low=0.0, high=4.0)
    cfg = HqeKVConfig() if config is None else config
    if not isinstance(cfg, HqeKVConfig):
        raise TypeError(f"config must be a kv_hqekv.HqeKVConfig, got {type(cfg).__name__}")
    if shares is None:
        key = next((k for k in DEFAULT_PRESETS if abs(k - bits) < 1e-9), None)
        if key is None:
            raise ValueError(
                f"hqekv(bits={bits}) needs shares: the paper publishes shares for {sorted(DEFAULT_PRESETS)} bits "
                f"(presets {sorted(PRESETS)}); run `kv-hqekv search --bits {bits}` or pass kv_hqekv.feasible(...)"
            )
        shares = preset(DEFAULT_PRESETS[key])
    elif isinstance(shares, str):
        shares = preset(shares)
    if not isinstance(shares, Shares):
        raise TypeError(f"shares must be kv_hqekv.Shares, a preset name or None, got {type(shares).__name__}")
    shares.check_bits(bits)
    block, one_bit = cfg.block, cfg.one_bit
    return Compressor(
        scorer=HqeKVScorer(cfg.window, cfg.times_range, cfg.normalize_importance),
        selector=HqeKVSelector(shares, block, cfg.fp16_blocks, cfg.joint_evict),
        store=lambda: HqeKVStore(block, one_bit),
        budget=Budget(avg_bits=bits),
        protect=Protection(),
        name=name or f"hqekv-{bits:g}",
        replan_every=cfg.period,
        replanner=window_replan,
    )
