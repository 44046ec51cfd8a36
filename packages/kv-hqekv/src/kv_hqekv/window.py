"""HqeKV's decode-time window state and the re-plan that scores from it (§3.2, §3.5, Alg. 3).

Alg. 3 keeps two things next to the compressed cache so the re-plan every ``T`` tokens needs no pass over the
values: the importance window ``A`` (the attention of the last ``m`` queries) and ``Range`` (the range of every
token's value vector). Here:

* ``Range`` comes from the value statistics the store already holds (:func:`held_value_ranges`, no code is
  dequantized and no extra state is kept): exact for the fp16 rows, the range of the held reconstruction for the
  quantized tiers (within ``scale/2`` of the full-precision range for the uniform tiers; the paper caches the
  range of the fp16 values instead, Alg. 3 l.1);
* the window's queries are the last ``m`` post-RoPE queries the adapter already keeps for the re-plan (``kv-hf``
  captures ``scorer.query_window = m`` committed queries per layer; :func:`kv_hqekv.requantize` takes them as an
  argument); their attention is computed at the re-plan over the held **keys** only (one ``m``-query pass instead
  of a probability row per decode step), on CUDA straight from the held codes
  (:func:`kv_hqekv.importance.window_importance_blocked` over the store's block layout: no key is written out);
* :func:`window_replan` is the ``replanner`` of :func:`kv_hqekv.hqekv` compressors (``kvcore.replan`` runs it): it
  builds the key scores ``A`` and the value scores ``A·Range`` from that state, selects with the decode-time
  shares, and caps every entry at its held tier (``tier := min(held, planned)``). The store is never read back
  (no dequantized values, no ``read()`` view); ``HqeKVStore.retier`` then transcodes only the demoted entries from
  their held codes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvcodec import normal_codebook
from kvcodec.kernels.dispatch import use_triton
from kvcodec.ragged import FullRows
from kvcore import Plan, Scores, replan_view


def _matrix_units(queries: torch.Tensor, store) -> bool:
    """Whether the window's products run on the matrix units (queries and cache in one half-precision dtype), where
    the kernel reads the keys from the block layout; float32 caches take the dense keys (that variant spills for
    sm_90)."""
    return queries.dtype == store._dtype and store._dtype in (torch.float16, torch.bfloat16)


def held_value_ranges(store, slots: dict | None = None) -> torch.Tensor:
    """``[B, H, T]`` float32, laid out like ``read()``: the range over channels of every held value, from what the
    store holds without dequantizing a code: fp16 rows directly; a uniform tier's per-token groups span
    ``[zero, zero + (2^b - 1)·scale]`` (the group minimum and, within float rounding, its maximum: the largest
    element always gets the top code, :mod:`kvcodec.stats`); the normalized 1-bit tier's levels are
    ``mean ± c·std``. Evicted values (and padding) are 0. ``slots``: the store's entry slots when already found
    (``HqeKVStore._all_slots``)."""
    B, H, _ = store._shape
    S = B * H
    T = store.held_max_length()
    device = store._parts["k"][0].length.device
    out = torch.zeros(S, T, dtype=torch.float32, device=device)
    c = float(normal_codebook(1)[1])
    slots = store._all_slots(kinds=("v",)) if slots is None else slots
    for part, (seg, slot, _), tier in zip(store._parts["v"], slots["v"].parts(), store._held_tiers()):
        if not seg.numel():
            continue
        if isinstance(part, FullRows):
            rows = part.rows.float()
            r = rows.amax(-1) - rows.amin(-1)
        else:
            s = part.scales[: part.nu].flatten(1).float()
            z = part.zeros[: part.nu].flatten(1).float()
            lo, hi = (z - c * s, z + c * s) if tier == 1 else (z, z + (2**tier - 1) * s)
            r = (hi.amax(-1) - lo.amin(-1))[part.row_unit()]
        out[seg, slot] = r
    return out.view(B, H, T)


def held_positions(store, slots: dict | None = None) -> torch.Tensor:
    """``[B, H, T]`` int64 true positions of the key-held entries in the order of ``read()``, padding ``-1``;
    ``slots`` as in :func:`held_value_ranges`."""
    B, H, _ = store._shape
    T = store.held_max_length()
    device = store._parts["k"][0].length.device
    pos = torch.full((B * H, T), -1, dtype=torch.long, device=device)
    at = (store._all_slots(kinds=("k",)) if slots is None else slots)["k"]
    pos[at.seg, at.slot] = at.pos
    return pos.view(B, H, T)


def held_keys(store, slots: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys [B, H, T, D], positions [B, H, T])`` of the key-held entries in the order of ``read()``: the key codes
    of each tier dequantized (no values), padding ``0`` / ``-1``; ``slots`` as in :func:`held_value_ranges`."""
    slots = store._all_slots(kinds=("k",)) if slots is None else slots
    return _dense_keys(store, slots), held_positions(store, slots)


def _dense_keys(store, slots: dict) -> torch.Tensor:
    """The keys of :func:`held_keys` alone (float32 ``[B, H, T, D]``, padding 0)."""
    B, H, D = store._shape
    S = B * H
    T = store.held_max_length()
    device = store._parts["k"][0].length.device
    k = torch.zeros(S, T, D, dtype=torch.float32, device=device)
    for part, (seg, slot, _) in zip(store._parts["k"], slots["k"].parts()):
        if seg.numel():
            k[seg, slot] = (part.rows if isinstance(part, FullRows) else part.dequantized()).float()
    return k.view(B, H, T, D)


def window_replan(
    store,
    compressor,
    *,
    queries: torch.Tensor | None = None,
    extras: Any = None,
    layer_idx: int = 0,
    protect_before: int | None = None,
) -> Plan:
    """The decode-time re-plan of HqeKV (module doc): scores from the window state, the decode-time shares
    (:meth:`~kv_hqekv.HqeKVSelector.decode_shares`), ``tier := min(held, planned)``.

    Hands over to :func:`kvcore.replan_view` (the ``read()``-based re-plan) where the state does not apply: a store
    other than :class:`~kv_hqekv.HqeKVStore`, a scorer other than :class:`~kv_hqekv.HqeKVScorer`, extras, a
    ``protect_before``, or heads of a row holding different positions.
    """
    from kv_hqekv.importance import window_importance, window_importance_blocked
    from kv_hqekv.scorer import HqeKVScorer
    from kv_hqekv.selector import HqeKVSelector
    from kv_hqekv.store import HqeKVStore

    selector = compressor.selector
    if isinstance(selector, HqeKVSelector) and not selector.decoding:
        compressor = dataclasses.replace(compressor, selector=selector.for_decoding())
    scorer = compressor.scorer
    generic = (
        not isinstance(store, HqeKVStore)
        or not isinstance(scorer, HqeKVScorer)
        or bool(extras)
        or protect_before is not None
        or queries is None
        or store._shape is None
    )
    if not generic:
        slots = store._all_slots()  # one sort of the held entries for the keys and the value ranges
        pos = held_positions(store, slots)
        generic = not bool((pos == pos[:, :1]).all())
    if generic:
        return replan_view(
            store, compressor, queries=queries, extras=extras, layer_idx=layer_idx, protect_before=protect_before
        )
    B, H, T = pos.shape
    if T == 0:
        raise ValueError("store holds no entries: nothing to re-plan (write() or append() first)")
    row_pos = pos[:, 0]  # [B, T], every head of a row holds these
    valid = row_pos >= 0
    device = pos.device
    q = queries[:, :, -min(scorer.window, T) :].to(device)
    mask = None if bool(valid.all()) else valid
    blocked = store.decode_layout() if use_triton(q) and _matrix_units(q, store) else None  # kept since the last edit
    if blocked is not None:  # each key dequantized in registers from its tier: the keys are never written out
        layout, key_side, _ = blocked
        a = window_importance_blocked(q, layout, key_side, mask, scorer.normalize)  # [B, T]
    else:
        a = window_importance(q, _dense_keys(store, slots), mask, scorer.normalize)  # positions found above
    rng = held_value_ranges(store, slots).sum(1)  # [B, T], summed over the KV heads (Eq. 2)
    if scorer.share_batch:
        a = a.sum(0, keepdim=True).expand(B, T)
        rng = rng.sum(0, keepdim=True).expand(B, T)
    a = a * valid
    key_scores = a[:, None, :].expand(B, H, T).contiguous()
    value_scores = (a * rng)[:, None, :].expand(B, H, T).contiguous() if scorer.times_range else None
    protected = compressor.protect.mask(valid)
    plan = compressor.select(Scores(key_scores, value_scores), protected, valid)
    return store.cap(plan.key_bits, plan.bits_for_values, valid[:, None, :].expand(B, H, T), slots)
