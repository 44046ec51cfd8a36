"""HqeKV's ratio search (§3.3, Alg. 1, App. A.3) and its ``kv-hqekv search`` CLI (:mod:`kv_lab.hqekv.cli`).

The search writes a shares file; the runtime method reads it with ``kv_hqekv.load_shares(path)`` and
``kv_hqekv.hqekv(bits, shares=...)`` (the Table 9 presets ship with kv-hqekv itself).
"""

from .search import SearchResult, full_cache_labels, prefill_cross_entropy, search_shares

__all__ = ["SearchResult", "full_cache_labels", "prefill_cross_entropy", "search_shares"]
