"""``kv_hubkv.hubkv``: a ready-made HubKV compressor from any base ``kvcore.Compressor``."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvcore import Compressor

from .config import HubKVConfig
from .scorer import HubKV

__all__ = ["hubkv"]


def hubkv(
    base: Compressor,
    ratio: float | None = None,
    *,
    config: HubKVConfig | None = None,
    nonnegative: Literal["error", "shift"] = "error",
) -> Compressor:
    """Wrap ``base``'s scorer in :class:`HubKV`, keeping everything else (paper §3.3, App. A.1).

    HubKV "only refines the layer-head token scores before the same budgeted eviction step is
    applied" (Appendix A): the selector, store, protection (sinks / recent window) and budget
    granularity of ``base`` are kept as they are.

    Parameters
    ----------
    base : kvcore.Compressor
        The base method, e.g. ``kv_baselines.snapkv(0.9)``.
    ratio : float, optional
        New compression ratio (fraction removed, ``[0, 1)``); ``None`` keeps ``base.budget``.
    config : HubKVConfig, optional
        Refinement hyper-parameters (paper defaults if omitted).
    nonnegative : {"error", "shift"}
        See :class:`HubKV`.

    Returns
    -------
    kvcore.Compressor
        Named ``"hubkv+<base name>"``.
    """
    if not isinstance(base, Compressor):
        raise TypeError(f"base must be a kvcore.Compressor, got {type(base).__name__}")
    budget = base.budget
    if ratio is not None:
        budget = dataclasses.replace(budget, ratio=ratio, tokens=None)
    scorer = HubKV(base.scorer, HubKVConfig() if config is None else config, nonnegative=nonnegative)
    return Compressor(
        scorer=scorer,
        selector=base.selector,
        store=base.store,
        budget=budget,
        protect=base.protect,
        name=f"hubkv+{base.name}" if base.name else "hubkv",
    )
