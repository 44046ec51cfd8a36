"""kv_hex — HEX: static expander masks and global heavy hitters kept in full precision, the rest of the KV cache
KCVT-quantized (keys per channel, values per token).

Main entry points
-----------------
hex, kcvt, expander_only, h2o_only, random_mask   ready-made compressors (HEX-3/4 and the Table 4 ablations)
HEXConfig                                         validated hyper-parameters (paper defaults)
HEXStore                                          the cache: codes + full rows + expander overlay + fp16 residual
AccumulatedAttentionScorer, HEXSelector           heavy hitters by accumulated attention over all heads
expander_mask, random_mask_table                  the static masks (Ramanujan-checked, LRU-cached)
"""

from kv_hex.compressor import expander_only, h2o_only, hex, hex_compressor, kcvt, random_mask
from kv_hex.config import HEXConfig
from kv_hex.expander import MaskTable, expander_mask, ramanujan_bound
from kv_hex.expander import random_mask as random_mask_table
from kv_hex.scorer import AccumulatedAttentionScorer
from kv_hex.selector import HEXSelector, hex_tiers
from kv_hex.store import HEXStore

__all__ = [
    "AccumulatedAttentionScorer",
    "HEXConfig",
    "HEXSelector",
    "HEXStore",
    "MaskTable",
    "expander_mask",
    "expander_only",
    "h2o_only",
    "hex",
    "hex_compressor",
    "hex_tiers",
    "kcvt",
    "ramanujan_bound",
    "random_mask",
    "random_mask_table",
]
