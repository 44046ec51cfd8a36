"""The methods kv-hqekv registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

``hqekv-2``, ``hqekv-2.8``, ``hqekv-3.2`` and ``hqekv-3.25`` use the paper's Table 9 shares (Llama-3.1-8B-Instruct);
``hqekv-qwen3-2`` ... the Qwen3-8B ones; ``hqekv-smollm2-2`` and ``hqekv-smollm2-3.2`` the shares searched for
SmolLM2-135M-Instruct (:mod:`kv_hqekv.searched`); ``hqekv-3.2-no-range``, ``hqekv-3.2-random-ratio``,
``hqekv-3.2-no-evict`` and ``hqekv-3.2-uniform`` are the Table 6 ablations (:mod:`kv_hqekv.ablations`), and
``hqekv-2-random-ratio`` the random-shares one at 2 bits (the search's null at both budgets). The shares
fix the average bits, so each entry takes only its default budget (``Budget(avg_bits=bits)``); other budgets need
shares of their own: ``kv_hqekv.hqekv(bits, shares=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

from kv_hqekv.ablations import ABLATIONS, ablation
from kv_hqekv.compressor import hqekv
from kv_hqekv.searched import search_settings, searched, searched_names
from kv_hqekv.shares import PRESETS, Shares
from kvcore import Budget, Compressor
from kvcore.registry import Method

__all__ = ["METHODS"]


def _make(bits: float, shares: str | Shares, name: str) -> Callable[[Budget], Compressor]:
    def make(budget: Budget) -> Compressor:  # the registry passes only the default, Budget(avg_bits=bits)
        return hqekv(bits, shares=shares, name=name)

    make.__name__ = name.replace("-", "_").replace(".", "_")
    return make


def _entry(name: str, preset_name: str) -> Method:
    bits = float(preset_name.split("-")[-1])
    return Method(
        name,
        _make(bits, preset_name, name),
        f"HqeKV {bits:g} bits: fp16/4/2/1-bit tiers + eviction with the paper's {preset_name} shares (Table 9)",
        budgets=frozenset(),
        default=Budget(avg_bits=bits),
    )


METHODS: tuple[Method, ...] = tuple(
    _entry(f"hqekv-{p.split('-', 1)[1]}" if p.startswith("llama-") else f"hqekv-{p}", p) for p in PRESETS
)


def _ablation_entry(kind: str, bits: float = 3.2) -> Method:
    def make(budget: Budget) -> Compressor:
        return ablation(kind, bits)

    make.__name__ = f"hqekv_ablation_{kind.replace('-', '_')}"
    what = {
        "no-range": "value metric without the token range (w/o I)",
        "random-ratio": "seeded random feasible shares instead of the searched ones (w/o III)",
        "no-evict": "evict share 0, Eq. 3 re-solved (w/o eviction)",
        "uniform": "uniform min-max 1-bit tier instead of the normalized one (w/o II)",
    }[kind]
    return Method(
        f"hqekv-{bits:g}-{kind}",
        make,
        f"HqeKV {bits:g} bits ablation (Table 6): {what}",
        budgets=frozenset(),
        default=Budget(avg_bits=bits),
    )


def _searched_entry(name: str) -> Method:
    settings = search_settings(name)
    bits = float(settings["bits"])
    return Method(
        f"hqekv-{name}",
        _make(bits, searched(name), f"hqekv-{name}"),
        f"HqeKV {bits:g} bits with shares searched for {settings['model']} ({settings['trials']} TPE trials, "
        "kv-hqekv search)",
        budgets=frozenset(),
        default=Budget(avg_bits=bits),
    )


METHODS += tuple(_searched_entry(n) for n in searched_names())
METHODS += tuple(_ablation_entry(k) for k in ABLATIONS)
METHODS += (_ablation_entry("random-ratio", 2.0),)
