"""kvcore: the contract of kvcompress.

Protocols (``Scorer``, ``Selector``, ``Quantizer``, ``Store``; optional capabilities ``PlanBits``, ``TierPolicy``,
``AttendingStore``, ``TierShares``, read through ``attends`` / ``tier_shares``)
with their declared capabilities, the value types
between them, the ``Compressor`` that composes them, reference attention and its log-sum-exp merge, the method
registry (:mod:`kvcore.registry`), argument checks (:mod:`kvcore.checks`) and minimal reference implementations.
Conformance suites live in ``kvcore.testing`` (needs pytest and hypothesis: ``pip install kvcore[testing]``).
"""

from kvcore import checks, registry
from kvcore.attending import AttendingStore, attends
from kvcore.attention import merge_attention, merge_split_attention, reference_attention
from kvcore.budget import Budget
from kvcore.checks import value_checks
from kvcore.compressor import Compressor, ShortInputWarning
from kvcore.context import ScoringContext
from kvcore.memory import reachable_bytes, reachable_tensors, storage_bytes
from kvcore.plan import EVICT, FULL, Plan
from kvcore.protection import Protection
from kvcore.protocols import PlanBits, Quantizer, Scorer, Selector, Store, TierPolicy
from kvcore.quantized import QuantizedTensor, packed_width
from kvcore.registry import Method
from kvcore.replan import cap_plan, replan, replan_view, retier_store
from kvcore.retier_checks import check_retier_plan
from kvcore.scores import Scores
from kvcore.selectors import TieredSelector, TopKSelector, solve_shares, tier_counts
from kvcore.stores import DenseStore
from kvcore.tier_shares import TierShares, tier_shares
from kvcore.transfer import from_host
from kvcore.view import KVView
from kvcore.wrapping import WrappingScorer
from kvcore.write_checks import check_write_plan

__version__ = "0.2.0"

__all__ = [
    "EVICT",
    "FULL",
    "AttendingStore",
    "Budget",
    "Compressor",
    "DenseStore",
    "KVView",
    "Method",
    "Plan",
    "PlanBits",
    "Protection",
    "QuantizedTensor",
    "Quantizer",
    "Scorer",
    "Scores",
    "ScoringContext",
    "Selector",
    "ShortInputWarning",
    "Store",
    "TierPolicy",
    "TierShares",
    "TieredSelector",
    "TopKSelector",
    "WrappingScorer",
    "attends",
    "cap_plan",
    "check_retier_plan",
    "check_write_plan",
    "checks",
    "from_host",
    "merge_attention",
    "merge_split_attention",
    "packed_width",
    "reachable_bytes",
    "reachable_tensors",
    "reference_attention",
    "registry",
    "replan",
    "replan_view",
    "retier_store",
    "solve_shares",
    "storage_bytes",
    "tier_counts",
    "tier_shares",
    "value_checks",
]
