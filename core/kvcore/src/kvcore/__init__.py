"""kvcore: the contract of kvcompress.

Protocols (``Scorer``, ``Selector``, ``Quantizer``, ``Store``), the value types between them, the
``Compressor`` that composes them and minimal reference implementations. Conformance suites live in
``kvcore.testing`` (needs pytest and hypothesis: ``pip install kvcore[testing]``).
"""

from kvcore.budget import Budget
from kvcore.compressor import Compressor
from kvcore.context import ScoringContext
from kvcore.memory import storage_bytes
from kvcore.plan import EVICT, FULL, Plan
from kvcore.protection import Protection
from kvcore.protocols import Quantizer, Scorer, Selector, Store
from kvcore.quantized import QuantizedTensor, packed_width
from kvcore.scores import Scores
from kvcore.selectors import TieredSelector, TopKSelector, solve_shares, tier_counts
from kvcore.stores import DenseStore
from kvcore.view import KVView

__version__ = "0.1.0"

__all__ = [
    "Budget", "Compressor", "DenseStore", "EVICT", "FULL", "KVView", "Plan", "Protection", "QuantizedTensor",
    "Quantizer", "Scorer", "Scores", "ScoringContext", "Selector", "Store", "TieredSelector", "TopKSelector",
    "packed_width", "solve_shares", "storage_bytes", "tier_counts",
]
