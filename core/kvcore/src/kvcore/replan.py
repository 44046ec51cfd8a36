"""Re-planning the entries a Store already holds: score and select them again, then ``Store.retier``.

Engines re-plan a layer while decoding (kvpress ``DecodingPress``, HqeKV's periodic re-tiering, decoding-stage HubKV)
and when a new prefill chunk is appended to a layer that already holds a compressed context. Reading the held
entries back and writing them again would re-quantize every quantized entry (the error-compounding pitfall of
transformers' ``QuantizedCache``, which re-quantizes its whole residual) and could not keep span summaries, so
re-planning goes the other way: the held entries are scored from their ``read()`` view, the selection yields a plan
laid out like ``read()``, and :meth:`Store.retier` applies it to the held representation (evicting, keeping
untouched, or demoting where the store can).

Layouts (the view may be ragged per head after per-head eviction, SnapKV-style):

* every head of a row holds the same positions → one :class:`~kvcore.context.ScoringContext`, any granularity;
* heads hold different tokens → one context per KV head with its exact valid mask (softmax-style scorers see only
  what the head holds); only ``"head"`` granularity can be planned this way, and extras aligned to one token axis
  cannot be given.

The plan never moves an entry up: each entry's tier is ``min(held, new)`` against :meth:`Store.tiers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcore.checks import check_int
from kvcore.compressor import Compressor
from kvcore.context import ScoringContext
from kvcore.plan import EVICT, Plan
from kvcore.protocols import Store
from kvcore.view import KVView

_BIG = torch.iinfo(torch.int64).max


HEAD_EXTRA = "kv_head"
"""``ScoringContext.extras`` key of a per-head re-plan (a ragged layout scored one KV head at a time, ``Hkv = 1``):
the index of the head being scored, for scorers with per-head parameters (FastKVzip's gate); others ignore it."""


def replan(
    store: Store,
    compressor: Compressor,
    *,
    queries: torch.Tensor | None = None,
    extras: Mapping[str, Any] | None = None,
    layer_idx: int = 0,
    protect_before: int | None = None,
) -> Plan:
    """Score and select the entries ``store`` holds again; a plan laid out like ``store.read()`` for ``retier``.

    Runs ``compressor.replanner`` when the compressor declares one (a method that scores from state its store
    keeps), otherwise :func:`replan_view`. Arguments, return value and errors as :func:`replan_view`.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a kvcore.Compressor, got {type(compressor).__name__}")
    fn = replan_view if compressor.replanner is None else compressor.replanner
    return fn(store, compressor, queries=queries, extras=extras, layer_idx=layer_idx, protect_before=protect_before)


def replan_view(
    store: Store,
    compressor: Compressor,
    *,
    queries: torch.Tensor | None = None,
    extras: Mapping[str, Any] | None = None,
    layer_idx: int = 0,
    protect_before: int | None = None,
) -> Plan:
    """Re-plan from the ``read()`` view: score and select the held entries again; a plan laid out like
    ``store.read()`` for ``retier``.

    Parameters
    ----------
    store : Store
        A non-empty store; its ``read()`` view (possibly ragged per head) is what gets scored.
    compressor : Compressor
        Scorer, selector, budget and protection of the new selection (its ``store`` is not used).
    queries : Tensor, optional
        ``[B, Hq, W, D]`` post-RoPE queries for scorers that declare ``needs_queries`` (the last decode steps).
    extras : mapping, optional
        ``ScoringContext.extras`` aligned with the held entries sorted by true position; only for head-uniform
        layouts.
    layer_idx : int
        Layer index handed to the scorer.
    protect_before : int, optional
        Entries whose true position is below this are always kept (a system prompt; KVzip's sink).

    Returns
    -------
    Plan
        ``[B, Hkv, T]`` tiers laid out like ``read()`` (padding ``EVICT``), each at most the held tier.

    Raises
    ------
    ValueError
        The store is empty; its view carries non-zero finite logit bias (span summaries cannot be re-scored as
        ordinary entries); the layout is ragged and the budget granularity is not ``"head"`` or ``extras`` were
        given; the scorer lacks an input it declared; the plan would demote an entry of a store without
        ``can_demote``.
    """
    if not isinstance(store, Store):
        raise TypeError(f"store must implement kvcore.Store, got {type(store).__name__}")
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a kvcore.Compressor, got {type(compressor).__name__}")
    check_int("protect_before", protect_before, low=0, optional="nothing protected")
    lengths = store.seq_lengths()
    if not lengths.numel() or int(lengths.max()) == 0:
        raise ValueError("store holds no entries: nothing to re-plan (write() or append() first)")
    view = store.read()
    _check_bias(view)
    order, positions = _by_position(view.positions)
    keys = _take(view.keys, order)
    values = _take(view.values, order)
    if bool((positions == positions[:, :1]).all()):
        key_bits, value_bits = _plan_uniform(
            compressor, keys, values, positions[:, 0], queries, extras, layer_idx, protect_before
        )
    else:
        if extras:
            raise ValueError(
                f"extras {sorted(extras)} are aligned to one token axis and cannot be re-planned over a ragged "
                "per-head layout (heads hold different tokens)"
            )
        if compressor.budget.granularity != "head":
            raise ValueError(
                "re-planning a ragged per-head layout needs budget granularity 'head', got "
                f"{compressor.budget.granularity!r}: a ScoringContext has one token axis for all heads"
            )
        key_bits, value_bits = _plan_per_head(compressor, keys, values, positions, queries, layer_idx, protect_before)
    inverse = torch.argsort(order, dim=-1)
    key_bits, value_bits = key_bits.gather(-1, inverse), value_bits.gather(-1, inverse)
    return cap_plan(store, key_bits, value_bits, view.valid & torch.isfinite(view.logit_bias))


def retier_store(
    store: Store,
    compressor: Compressor,
    *,
    queries: torch.Tensor | None = None,
    extras: Mapping[str, Any] | None = None,
    layer_idx: int = 0,
    protect_before: int | None = None,
) -> Plan:
    """:func:`replan` the held entries of ``store`` and apply the plan with ``store.retier``; returns the plan.

    Kept entries are untouched (bit-identical), evicted ones free their memory; nothing is read back and written
    again.
    """
    plan = replan(store, compressor, queries=queries, extras=extras, layer_idx=layer_idx, protect_before=protect_before)
    store.retier(plan)
    return plan


# -- helpers -----------------------------------------------------------------------------------------------
def _check_bias(view: KVView) -> None:
    finite = torch.isfinite(view.logit_bias)
    if bool((view.logit_bias[finite] != 0).any()):
        raise ValueError(
            "cannot re-plan a store whose read() view carries non-zero finite logit bias (span summaries): "
            "those entries stand for several tokens and cannot be re-scored as ordinary entries"
        )


def _by_position(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, head) order sorting entries by true position, padding (``< 0``) last; and sorted positions."""
    pos = positions.long()
    order = torch.sort(torch.where(pos >= 0, pos, _BIG), dim=-1, stable=True).indices
    return order, pos.gather(-1, order).clamp_min(-1)


def _take(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return x.gather(2, order[..., None].expand(*order.shape, x.shape[-1]))


def _context(
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    queries: torch.Tensor | None,
    extras: Mapping[str, Any] | None,
    layer_idx: int,
    protect_before: int | None,
) -> ScoringContext:
    valid = pos >= 0
    zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
    return ScoringContext(
        keys=torch.where(valid[:, None, :, None], keys, zero),
        values=torch.where(valid[:, None, :, None], values, zero),
        queries=queries,
        positions=pos.clamp_min(0),
        attention_mask=None if bool(valid.all()) else valid,
        layer_idx=layer_idx,
        extras=dict(extras or {}),
        protected=(valid & (pos < protect_before)) if protect_before else None,
    )


def _plan(compressor: Compressor, ctx: ScoringContext) -> Plan:
    missing = compressor.missing_inputs(ctx)
    if missing:
        raise ValueError(
            f"scorer {type(compressor.scorer).__name__} needs {missing} to re-plan held entries; pass them "
            "(queries=..., extras=...)"
        )
    return compressor.plan(ctx)


def _plan_uniform(compressor, keys, values, pos, queries, extras, layer_idx, protect_before):
    plan = _plan(compressor, _context(keys, values, pos, queries, extras, layer_idx, protect_before))
    return plan.key_bits, plan.bits_for_values


def _plan_per_head(compressor, keys, values, positions, queries, layer_idx, protect_before):
    H = keys.shape[1]
    if queries is not None and queries.shape[1] % H:
        raise ValueError(f"queries {tuple(queries.shape)} must have a multiple of Hkv={H} heads")
    group = None if queries is None else queries.shape[1] // H
    key_bits = torch.zeros(positions.shape, dtype=torch.uint8, device=keys.device)
    value_bits = torch.zeros_like(key_bits)
    for h in range(H):
        head_queries = None if queries is None else queries[:, h * group : (h + 1) * group]
        plan = _plan(
            compressor,
            _context(
                keys[:, h : h + 1],
                values[:, h : h + 1],
                positions[:, h],
                head_queries,
                {HEAD_EXTRA: h},
                layer_idx,
                protect_before,
            ),
        )
        key_bits[:, h] = plan.key_bits[:, 0]
        value_bits[:, h] = plan.bits_for_values[:, 0]
    return key_bits, value_bits


def cap_plan(
    store: Store, key_bits: torch.Tensor, value_bits: torch.Tensor, valid: torch.Tensor, held: Plan | None = None
) -> Plan:
    """``min(held, new)`` per entry against ``store.tiers()``, padding (``valid`` False) ``EVICT``; refuses demotions
    a store without ``can_demote`` rejects. For re-planners that score without the ``read()`` view; ``held``: the
    store's ``tiers()`` when the re-planner already has them (spares finding them again)."""
    if held is None:
        held = store.tiers()
    elif not isinstance(held, Plan) or tuple(held.key_bits.shape) != tuple(key_bits.shape):
        raise ValueError(f"held must be the store's tiers(), a kvcore.Plan of shape {tuple(key_bits.shape)}")
    hk = held.key_bits.to(key_bits.device)
    hv = held.bits_for_values.to(key_bits.device)
    kb = torch.where(valid, torch.minimum(hk, key_bits), EVICT).to(torch.uint8)
    vb = torch.where(valid, torch.minimum(hv, value_bits), EVICT).to(torch.uint8)
    if not store.can_demote:
        demoted = ((kb != EVICT) & (kb < hk)) | ((vb != EVICT) & (vb < hv))
        if bool(demoted.any()):
            raise ValueError(
                f"the new plan demotes {int(demoted.sum())} held entries to a lower width, but "
                f"{type(store).__name__} cannot demote (can_demote = False): it can only evict or keep entries"
            )
    return Plan(kb, None if torch.equal(kb, vb) else vb)
