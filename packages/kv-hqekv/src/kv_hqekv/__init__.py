"""kv_hqekv — HqeKV: hybrid quantization and eviction of the KV cache (Wang et al. 2025, "HqeKV").

Every planned block of 32 tokens gets one of five actions — fp16, 4-bit uniform, 2-bit uniform, 1-bit normalized,
evict — by the rank of a joint key/value importance, with tier shares solved from an average-bits budget (Eq. 3)
and searched with TPE (Alg. 1; the search and its ``kv-hqekv`` CLI are in kv-lab: ``kv_lab.hqekv``).
"""

from kv_hqekv.ablations import ABLATIONS, ablation
from kv_hqekv.capped_plan import CappedPlan
from kv_hqekv.compressor import hqekv
from kv_hqekv.config import BIT_WIDTHS, HqeKVConfig
from kv_hqekv.decoding import requantize
from kv_hqekv.importance import (
    window_importance,
    window_importance_blocked,
    window_importance_blocked_ref,
    window_importance_ref,
)
from kv_hqekv.normalized import NormalizedQuantizer, normal_bounds
from kv_hqekv.quantizers import tier_quantizer
from kv_hqekv.scorer import HqeKVScorer, token_range
from kv_hqekv.searched import search_settings, searched, searched_names
from kv_hqekv.selector import HqeKVSelector
from kv_hqekv.shares import PRESETS, Shares, TierCounts, feasible, load_shares, preset, solve_eq3, tier_counts
from kv_hqekv.store import HqeKVStore
from kv_hqekv.uniform_one_bit import UniformOneBitQuantizer

__all__ = [
    "ABLATIONS",
    "BIT_WIDTHS",
    "PRESETS",
    "CappedPlan",
    "HqeKVConfig",
    "HqeKVScorer",
    "HqeKVSelector",
    "HqeKVStore",
    "NormalizedQuantizer",
    "Shares",
    "TierCounts",
    "UniformOneBitQuantizer",
    "ablation",
    "feasible",
    "hqekv",
    "load_shares",
    "normal_bounds",
    "preset",
    "requantize",
    "search_settings",
    "searched",
    "searched_names",
    "solve_eq3",
    "tier_counts",
    "tier_quantizer",
    "token_range",
    "window_importance",
    "window_importance_blocked",
    "window_importance_blocked_ref",
    "window_importance_ref",
]
