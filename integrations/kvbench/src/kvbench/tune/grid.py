"""The search grid of ``kvbench tune``: which methods, at which byte levels, and what it will cost.

Every registered method is a candidate (``--methods`` restricts them) except the full cache, which is the reference
of every row, and the ablations and controls the method packages register for their papers' tables (their
description says so). A method that takes budgets is matched to each byte level (:mod:`kvbench.match`, on held
bytes); one with a fixed budget (HqeKV-2, HEX-3, KCVT-3 ...) runs once at it and lands where its bytes are. The
eviction + quantization compositions (``kivi-2`` / ``kivi-4`` above ratio 0: SnapKV eviction, then KIVI on what is
kept) and HubKV over each base (``hubkv-snapkv``, ``hubkv-h2o``, ``hubkv-kvzip``) are registered methods, so they are
in the grid like the others.

The cost of the grid is estimated from timings measured on the first window (:func:`measure_costs`) before the search
starts, so ``--budget-minutes`` can drop the most expensive cells first (:func:`trim`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from kvbench.budgets import BudgetSpec
from kvbench.methods import GridItem, MethodSpec, plan_grid
from kvcore import EVICT, FULL, Budget
from kvcore.registry import Method

__all__ = ["Costs", "candidates", "estimate", "floor_fraction", "grid", "measure_costs", "trim", "window_fraction"]

SKIPPED_WORDS = ("ablation", "control")
"""Words of a registered method's description that keep it out of the default candidates (paper-table variants)."""

MATCH_PROBES = 8
"""Compressions a bytes target's budget search typically makes (:func:`kvbench.match.match_budget`: the grid walked
until it brackets the target, then interpolation; 5 to 8 on SnapKV between 50% and 25% of fp16)."""

DECODE_STEPS = 16
"""Decode steps :func:`kvbench.run.decode_rate` times per cell."""


def candidates(registry: dict[str, Method], methods: str | None) -> list[str]:
    """The methods to search, in registry order (``full`` never: it is the reference).

    Parameters
    ----------
    registry : dict of str to Method
        :func:`kvcore.registry.discover`.
    methods : str or None
        ``--methods``: comma-separated registered names; ``None``: every registered method but the ablations and
        controls (:data:`SKIPPED_WORDS` in the description).

    Raises
    ------
    ValueError
        Naming ``--methods``: an unknown name (listing the registered ones) or an empty list.
    """
    if methods is None:
        return [
            n
            for n, m in sorted(registry.items())
            if n != "full" and not any(w in m.description.lower() for w in SKIPPED_WORDS)
        ]
    names = list(dict.fromkeys(x.strip() for x in methods.split(",") if x.strip()))
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"--methods: unknown method(s) {unknown}; registered: {', '.join(sorted(registry))}")
    names = [n for n in names if n != "full"]
    if not names:
        raise ValueError("--methods must name at least one method besides the full cache (the reference)")
    return names


def grid(registry: dict[str, Method], names: Sequence[str], levels: Sequence[float]) -> list[GridItem]:
    """Every (method, byte level) to evaluate: ``levels`` are bytes per context token, matched per method.

    A method with a fixed budget is one item at its default whatever the levels (:func:`kvbench.methods.plan_grid`).
    """
    specs = [MethodSpec(n) for n in names]
    return plan_grid(registry, specs, [BudgetSpec("bytes_per_token", float(v)) for v in levels])


def floor_fraction(method: Method, context_tokens: int, bytes_per_entry: float = 2.0) -> float:
    """A lower bound on the fraction of an fp16 cache ``method`` can hold on ``context_tokens``-token windows,
    without a model.

    The tokens its protection always keeps (sinks + recent window, at least one) are held at the narrowest width its
    store declares (``Store.supported_bits``): the model dtype's ``bytes_per_entry`` when the store quantizes nothing
    (an evicting method keeps SnapKV's 64-token window at full precision), else its narrowest quantized width. A
    method with a fixed budget: its average bits over 16.

    Parameters
    ----------
    method : kvcore.registry.Method
    context_tokens : int
    bytes_per_entry : float
        Bytes of one cache entry in the model's dtype (2 for bf16/fp16, 4 for float32).
    """
    if not method.budgets:
        bits = method.default.avg_bits
        return (bits if bits is not None else 1.0) / 16.0
    try:
        comp = method.build(Budget(tokens=1) if "tokens" in method.budgets else Budget(ratio=0.99))
        kept = comp.protect.sinks + comp.protect.recent
    except (ValueError, LookupError, TypeError):
        return 1.0 / context_tokens / 16.0
    try:
        quantized = frozenset(comp.new_store().supported_bits) - {EVICT, FULL}
    except (ValueError, LookupError, TypeError):
        quantized = frozenset({1})
    entry_bits = min(quantized) if quantized else 8.0 * bytes_per_entry
    return max(1, min(kept, context_tokens)) / context_tokens * entry_bits / 16.0


def window_fraction(config, context_tokens: int, bytes_per_entry: float = 2.0) -> float:
    """The fraction of an fp16 cache a model's sliding-window layers hold whatever the method (kv_hf keeps them as
    transformers does: their last ``sliding_window - 1`` tokens), on ``context_tokens``-token windows, with
    ``bytes_per_entry`` the model dtype's size (4 for float32: twice the fp16 bytes). 0 for a model without them.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The (text) config.
    context_tokens : int
    bytes_per_entry : float
    """
    from kv_hf.support import layer_kinds

    kinds = layer_kinds(config)
    windows = kinds.count("window")
    if not windows:
        return 0.0
    held = min(max(1, int(config.sliding_window) - 1), context_tokens) / context_tokens
    return windows / len(kinds) * held * bytes_per_entry / 2.0


@dataclass
class Costs:
    """Seconds measured on one window: the shared forward pass, a teacher-forced continuation, one decode step,
    and each method's compression (``None``: it refused the middle budget tried)."""

    forward_s: float
    continuation_s: float
    step_s: float
    compress_s: dict[str, float | None] = field(default_factory=dict)


def _middle(method: Method, context_tokens: int) -> Budget:
    if not method.budgets:
        return method.default
    if "ratio" in method.budgets:
        return Budget(ratio=0.75)
    if "tokens" in method.budgets:
        return Budget(tokens=max(1, context_tokens // 4))
    return Budget(avg_bits=4.0)


@torch.no_grad()
def measure_costs(
    model, tokenizer, registry: dict[str, Method], names: Sequence[str], window, *, progress: bool = True
) -> Costs:
    """Time one window: the forward pass, the full cache's continuation and one decode step, and each method's
    compression at a middle budget (ratio 0.75, a quarter of the tokens, 4 bits or its fixed budget).

    Parameters
    ----------
    model, tokenizer
        The loaded model.
    registry : dict of str to Method
    names : sequence of str
        The candidate methods.
    window : tuple of (list of int, list of int)
        A (context, continuation) pair of the workload.
    progress : bool
        A progress bar over the methods.
    """
    from kv_hf.shared import collect_prefill
    from kvbench.run import _continuation, decode_rate

    device = next(model.parameters()).device
    ctx, cont = window
    collected = collect_prefill(model, torch.tensor([ctx], device=device), tokenizer=tokenizer)
    full = collected.compress(registry["full"].build())
    t0 = time.perf_counter()
    _continuation(model, full, collected.logits, torch.tensor([cont], device=device))
    continuation_s = time.perf_counter() - t0
    full = collected.compress(registry["full"].build())
    step_s = 1.0 / decode_rate(model, full, collected.logits.argmax(-1), steps=2)
    costs = Costs(collected.forward_seconds, continuation_s, step_s)
    bar = tqdm(names, desc="timing one window", unit="method", disable=not progress, leave=False)
    for name in bar:
        bar.set_postfix_str(name, refresh=False)
        method = registry[name]
        try:
            comp = method.build(_middle(method, len(ctx)))
            t0 = time.perf_counter()
            collected.compress(comp)
            costs.compress_s[name] = time.perf_counter() - t0
        except (ValueError, LookupError):
            costs.compress_s[name] = None
    return costs


Left = dict[int, tuple[float, bool]]
"""Per grid item (by ``id``): the share of its units still to compute and whether its budget search is still to
do (:meth:`kvbench.run.Cells.left`); an item missing from it is all to do."""


def item_seconds(
    item: GridItem, costs: Costs, windows: int, samples: int, left: Left | None = None, answer_tokens: int = 8
) -> float:
    """Estimated seconds of one grid item: its budget search (a bytes target), one compression and continuation
    per window, the decode-rate steps, and per task sample a compression and a short answer; only what ``left``
    says is still to do."""
    share, search = (left or {}).get(id(item), (1.0, item.budget is None))
    c = costs.compress_s.get(item.name) or 0.0
    per_window = c + costs.continuation_s
    per_sample = c + (answer_tokens + 1) * costs.step_s
    run = windows * per_window + DECODE_STEPS * costs.step_s + samples * per_sample
    return (MATCH_PROBES * c if search else 0.0) + share * run


def estimate(items: Sequence[GridItem], costs: Costs, windows: int, samples: int, left: Left | None = None) -> float:
    """Estimated seconds of a search over ``items``: the shared forward passes (the windows and the task prompts
    once each, and the full cache's reference) while any unit is left, plus :func:`item_seconds` of each item."""
    per_item = [item_seconds(i, costs, windows, samples, left) for i in items]
    if not any(per_item):
        return 0.0
    shared = (windows + samples) * costs.forward_s + windows * costs.continuation_s
    shared += samples * 9 * costs.step_s + DECODE_STEPS * costs.step_s
    return shared + sum(per_item)


def trim(
    items: Sequence[GridItem], costs: Costs, windows: int, samples: int, seconds: float, left: Left | None = None
) -> tuple[list[GridItem], list[GridItem]]:
    """Drop the most expensive items still to compute until the estimate fits ``seconds``; returns
    ``(kept, dropped)``, each in grid order. Finished items cost nothing and are kept."""
    kept = list(items)
    dropped: list[GridItem] = []
    by_cost = sorted(kept, key=lambda i: item_seconds(i, costs, windows, samples, left))
    while kept and estimate(kept, costs, windows, samples, left) > seconds:
        worst = by_cost.pop()
        if not item_seconds(worst, costs, windows, samples, left):
            break
        kept.remove(worst)
        dropped.append(worst)
    if estimate(kept, costs, windows, samples, left) > seconds:
        kept = []
    order = {id(i): n for n, i in enumerate(items)}
    return kept, sorted(dropped, key=lambda i: order[id(i)])
