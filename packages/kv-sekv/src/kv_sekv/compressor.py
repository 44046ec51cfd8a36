"""The ready-made SEKV compressor (SEKV §3), built only from protocol objects."""

from __future__ import annotations

import dataclasses
import functools
from numbers import Real

from kvcore import Budget, Compressor, Protection

from .config import SEKVConfig
from .router import RouterSource, ShippedRouter
from .scorer import SurprisalScorer
from .selector import SpanSelector
from .store import FETCH_MODES, SEKVStore

__all__ = ["sekv"]


def sekv(
    budget: float | None = None,
    router: RouterSource | None = None,
    config: SEKVConfig | None = None,
    *,
    strict: bool = False,
    fetch: str = "sync",
    reconstruct: bool = True,
    name: str = "sekv",
) -> Compressor:
    """SEKV: surprisal segmentation, accelerator-resident summaries, CPU low-rank bases, trained zoom-in.

    Parameters
    ----------
    budget : float, optional
        Accelerator budget as a fraction of the full KV cache, in (0, 1] (``config.budget``, 10 %, if omitted);
        the compressor's ``kvcore.Budget`` has ``ratio = 1 − budget`` (fraction removed).
    router : SEKVRouter or RouterSource, optional
        ``W``, ``τ`` and ``g_φ`` of the served model. ``None``: the router kv-sekv ships for a model of the cache's
        shape (SmolLM2-135M, Gemma 3 270M; :class:`~kv_sekv.ShippedRouter`), chosen and loaded at the first
        compression (an error naming ``kv-sekv train`` when none fits).
    config : SEKVConfig, optional
        Hyper-parameters (paper defaults).
    strict : bool
        Apply α and w literally (``SpanPlan.used`` reports the budget used); default: raise α per sequence until
        the always-resident part fits (see :mod:`kv_sekv.segmentation`).
    fetch : {"sync", "thread", "stream"}
        How the store fetches the selected spans' CPU factors during ``attend`` (see :class:`~kv_sekv.SEKVStore`).
    reconstruct : bool
        ``False``: Table 5's "w/o SVD reconstruction" (no CPU span bases, spans never expanded; see
        :class:`~kv_sekv.SEKVStore`).
    name : str
        Display name.

    Returns
    -------
    kvcore.Compressor
        Its scorer needs the ``"surprisal"`` extra (``kv_hf.prefill`` provides it).
    """
    config = SEKVConfig() if config is None else config
    if not isinstance(config, SEKVConfig):
        raise TypeError(f"config must be a kv_sekv.SEKVConfig, got {type(config).__name__}")
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, Real):
            raise TypeError(f"budget must be a number in (0, 1], got {type(budget).__name__}")
        config = dataclasses.replace(config, budget=float(budget))  # validated by SEKVConfig
    if fetch not in FETCH_MODES:
        raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
    source = ShippedRouter() if router is None else router
    if not isinstance(source, RouterSource):
        raise TypeError(f"router must be a kv_sekv.SEKVRouter (or RouterSource), got {type(router).__name__}")
    return Compressor(
        scorer=SurprisalScorer(),
        selector=SpanSelector(config, strict, source),
        store=functools.partial(SEKVStore, source, config, fetch, reconstruct),
        budget=Budget(ratio=max(0.0, 1.0 - config.budget)),
        protect=Protection(),
        name=name,
        strict=strict,
    )
