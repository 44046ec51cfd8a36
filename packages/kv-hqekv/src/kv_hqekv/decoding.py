"""Decode-time re-tiering of HqeKV (§3.5, Alg. 3): every ``T`` tokens re-plan and move blocks only down."""

from __future__ import annotations

import torch

from kv_hqekv.selector import HqeKVSelector
from kv_hqekv.window import window_replan
from kvcore import Compressor, Plan, Store


def requantize(store: Store, compressor: Compressor, queries: torch.Tensor, layer_idx: int = 0) -> Plan:
    """Re-plan what ``store`` holds and apply it in place: the flush every ``T`` decode tokens (Alg. 3).

    The held entries are scored from the store's window state (:func:`kv_hqekv.window.window_replan`: the attention
    of the last ``m`` decode ``queries [B, Hq, m, D]`` over the held keys, and the cached value ranges), ranked by
    block with the decode-time shares (:meth:`HqeKVSelector.decode_shares`), and every entry gets
    ``tier := min(held, planned)``: the residual's block gets its planned tier, older blocks only move down (§3.5;
    App. A.5 Table 7 finds only 3.3% / 3.4% of K / V blocks would move up), a demotion transcodes from the held
    tier (:meth:`~kv_hqekv.HqeKVStore.retier`), and evicted tokens never come back. Returns the applied plan.
    The kv-hf adapter does the same every ``compressor.replan_every`` tokens on its own.
    """
    if not isinstance(compressor, Compressor) or not isinstance(compressor.selector, HqeKVSelector):
        raise TypeError("compressor must be a kvcore.Compressor with a kv_hqekv.HqeKVSelector (kv_hqekv.hqekv(...))")
    plan = window_replan(store, compressor, queries=queries, layer_idx=layer_idx)
    store.retier(plan)
    return plan
