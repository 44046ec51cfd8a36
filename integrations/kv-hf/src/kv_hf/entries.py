"""Cache entries of one layer as a scoring problem, and the plan written back (re-compression, merges).

A layer's entries come from two places: the Store's ``read()`` view (possibly ragged per head after per-head
eviction) and the *pending* raw K/V collected during a prefill and not compressed yet. kvcore's
``ScoringContext`` and ``Store.write`` share one token axis across heads (``positions`` is ``[B, T]``), so:

* when every head holds the same positions (an uncompressed prefill, or a head-uniform eviction) the entries
  form one context and any granularity works;
* when heads hold different tokens (after SnapKV-style per-head eviction), each KV head is scored as its own
  context (exact per-head valid masks, so softmax-style scorers see only what the head holds) and the per-head
  plans are written on the *union* token axis: an entry a head does not hold is simply evicted there.
  Only ``"head"`` granularity can be planned this way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from kvcore import Compressor, KVView, Plan, ScoringContext

_BIG = torch.iinfo(torch.int64).max


@dataclass
class Pending:
    """Raw, not yet compressed K/V of a layer: ``[B, Hkv, P, D]`` plus ``[B, P]`` positions and validity."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def extend(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> "Pending":
        return Pending(
            torch.cat([self.keys, keys], 2),
            torch.cat([self.values, values], 2),
            torch.cat([self.positions, positions], 1),
            torch.cat([self.valid, valid], 1),
        )

    def select_rows(self, index: torch.Tensor) -> "Pending":
        return Pending(
            *(t.index_select(0, index.to(t.device)) for t in (self.keys, self.values, self.positions, self.valid))
        )

    def head(self, n: int) -> "Pending":
        """The first ``n`` slots."""
        return Pending(self.keys[:, :, :n], self.values[:, :, :n], self.positions[:, :n], self.valid[:, :n])

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, self.valid]


@dataclass
class Entries:
    """Entries sorted by true position per (batch, head): ``[B, H, T, D]`` keys/values, ``[B, H, T]`` positions
    (``-1`` = empty slot, always at the end of a head's row, keys/values zero there)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.positions >= 0

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    @property
    def uniform(self) -> bool:
        """Every head of a row holds the same positions (one shared token axis)."""
        return bool((self.positions == self.positions[:, :1]).all())


def gather_entries(view: KVView | None, pending: Pending | None) -> Entries:
    """All entries of a layer (``view`` then ``pending``), sorted by position per head, padding last and zeroed."""
    ks, vs, ps = [], [], []
    if view is not None and view.keys.shape[2]:
        finite = torch.isfinite(view.logit_bias)
        if bool((view.logit_bias[finite] != 0).any()):
            raise ValueError(
                "cannot re-plan a store whose view carries non-zero finite logit bias (span summaries); "
                "kvcore's Store.write has no way to write such entries back"
            )
        ks.append(view.keys)
        vs.append(view.values)
        ps.append(torch.where(view.valid & finite, view.positions.long(), -1))
    if pending is not None and pending.length:
        B, H = pending.keys.shape[:2]
        dtype = pending.keys.dtype
        ks, vs = [k.to(dtype) for k in ks], [v.to(dtype) for v in vs]
        ks.append(pending.keys)
        vs.append(pending.values)
        ps.append(torch.where(pending.valid, pending.positions.long(), -1)[:, None, :].expand(B, H, -1))
    if not ks:
        raise ValueError("the layer holds no entries")
    k, v, pos = torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(ps, 2)
    order = torch.sort(torch.where(pos >= 0, pos, _BIG), dim=-1, stable=True).indices
    pos = pos.gather(-1, order)
    idx = order[..., None].expand(*order.shape, k.shape[-1])
    valid = pos >= 0
    k = torch.where(valid[..., None], k.gather(2, idx), torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(valid[..., None], v.gather(2, idx), torch.zeros((), dtype=v.dtype, device=v.device))
    n = int(valid.sum(-1).max()) if valid.numel() else 0
    return Entries(k[:, :, :n], v[:, :, :n], pos[:, :, :n])


def missing_message(compressor: Compressor, missing: list[str], query_window: int | None) -> str:
    name = type(compressor.scorer).__name__
    hints = []
    if "queries" in missing:
        hints.append(
            "queries: kv_hf captures the last `query_window` post-RoPE query states "
            f"(query_window={query_window}); none were captured for this layer yet"
        )
    if "kvzip_scores" in missing:
        hints.append(
            "kvzip_scores: compress with kv_hf.prefill(model, cache, ids, tokenizer=...), "
            "which runs KVzip's reconstruction pass"
        )
    other = [m for m in missing if m not in ("queries", "kvzip_scores")]
    if other:
        hints.append(f"{other}: kv_hf cannot supply these")
    return f"scorer {name} needs {missing}, which the kv_hf adapter did not provide ({'; '.join(hints)})"


def _check_inputs(compressor: Compressor, ctx: ScoringContext, query_window: int | None) -> None:
    missing = compressor.missing_inputs(ctx)
    if missing:
        raise ValueError(missing_message(compressor, missing, query_window))


def uniform_context(
    entries: Entries,
    *,
    queries: torch.Tensor | None,
    layer_idx: int,
    extras: Mapping[str, Any] | None = None,
    protect_before: int | None = None,
) -> ScoringContext:
    """One ``ScoringContext`` over head-uniform entries (``entries.uniform`` must hold)."""
    pos = entries.positions[:, 0]
    valid = pos >= 0
    protected = None
    if protect_before:
        protected = valid & (pos < protect_before)
    return ScoringContext(
        keys=entries.keys,
        values=entries.values,
        queries=queries,
        positions=pos.clamp_min(0),
        attention_mask=None if bool(valid.all()) else valid,
        layer_idx=layer_idx,
        extras=dict(extras or {}),
        protected=protected,
    )


def plan_entries(
    entries: Entries,
    compressor: Compressor,
    *,
    queries: torch.Tensor | None,
    layer_idx: int,
    query_window: int | None,
    extras: Mapping[str, Any] | None = None,
    protect_before: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Plan, torch.Tensor]:
    """Score and select ``entries``; returns ``(keys, values, plan, positions)`` ready for ``Store.write``."""
    if entries.uniform:
        ctx = uniform_context(
            entries, queries=queries, layer_idx=layer_idx, extras=extras, protect_before=protect_before
        )
        _check_inputs(compressor, ctx, query_window)
        return ctx.keys, ctx.values, compressor.plan(ctx), ctx.positions
    if extras:
        raise ValueError(
            f"extras {sorted(extras)} are aligned to one token axis and cannot be re-planned over a ragged "
            "per-head layout (heads hold different tokens)"
        )
    if compressor.budget.granularity != "head":
        raise ValueError(
            f"re-planning a ragged per-head layout needs budget granularity 'head', got "
            f"{compressor.budget.granularity!r}: kvcore's ScoringContext has one token axis for all heads"
        )
    B, H, T, _ = entries.keys.shape
    group = None if queries is None else queries.shape[1] // H
    key_bits = torch.zeros(B, H, T, dtype=torch.uint8, device=entries.keys.device)
    value_bits = torch.zeros_like(key_bits)
    fp: torch.Tensor | None = None
    split_values = False
    for h in range(H):
        pos = entries.positions[:, h]
        valid = pos >= 0
        ctx = ScoringContext(
            keys=entries.keys[:, h : h + 1],
            values=entries.values[:, h : h + 1],
            queries=None if queries is None else queries[:, h * group : (h + 1) * group],
            positions=pos.clamp_min(0),
            attention_mask=None if bool(valid.all()) else valid,
            layer_idx=layer_idx,
            protected=(valid & (pos < protect_before)) if protect_before else None,
        )
        _check_inputs(compressor, ctx, query_window)
        plan = compressor.plan(ctx)
        key_bits[:, h] = plan.key_bits[:, 0]
        value_bits[:, h] = plan.bits_for_values[:, 0]
        split_values = split_values or plan.value_bits is not None
        if plan.full_precision is not None:
            if fp is None:
                fp = torch.zeros(*entries.keys.shape, dtype=torch.bool, device=entries.keys.device)
            fp[:, h] = plan.full_precision[:, 0]
    return _to_union(entries, key_bits, value_bits if split_values else None, fp)


def _to_union(
    entries: Entries, key_bits: torch.Tensor, value_bits: torch.Tensor | None, fp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, Plan, torch.Tensor]:
    """Lay per-head plans out on the union of the positions held by any head of each row."""
    B, H, T, D = entries.keys.shape
    device = entries.keys.device
    valid = entries.valid
    rows = [torch.unique(entries.positions[b][valid[b]]) for b in range(B)]
    Tu = max(1, max(int(r.numel()) for r in rows))
    upos = torch.empty(B, Tu, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        start = int(r.max()) + 1 if r.numel() else 0
        upos[b] = torch.cat([r, torch.arange(start, start + Tu - r.numel(), device=device)])
    idx = torch.searchsorted(upos, entries.positions.reshape(B, H * T)).view(B, H, T)
    idx = torch.where(valid, idx, Tu)  # empty slots land in a dump column, dropped below

    def scatter(x: torch.Tensor, fill_shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(*fill_shape, dtype=x.dtype, device=device)
        index = idx if x.ndim == 3 else idx[..., None].expand(B, H, T, x.shape[-1])
        return out.scatter_(2, index, x)[:, :, :Tu]

    keys = scatter(entries.keys, (B, H, Tu + 1, D))
    values = scatter(entries.values, (B, H, Tu + 1, D))
    kb = scatter(torch.where(valid, key_bits, 0), (B, H, Tu + 1))
    vb = None if value_bits is None else scatter(torch.where(valid, value_bits, 0), (B, H, Tu + 1))
    fpu = None if fp is None else scatter(fp & valid[..., None], (B, H, Tu + 1, D))
    return keys, values, Plan(kb, vb, fpu), upos


def with_tokens(compressor: Compressor, tokens: int) -> Compressor:
    """``compressor`` with a token-count budget (ratio cleared), same granularity and protection."""
    return dataclasses.replace(
        compressor, budget=dataclasses.replace(compressor.budget, ratio=None, tokens=int(tokens))
    )
