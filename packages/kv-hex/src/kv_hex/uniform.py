"""Addressing of a HEX segment by arithmetic, for the decode kernel (HEX §3.5): no per-entry index maps kept.

HEX evicts nothing and keeps whole tokens in full precision (heavy hitters chosen across heads, the recent window),
so the prompt's segment and every decode block are *uniform*: each of the ``S = B·H`` heads holds all ``n`` slots,
entry ``e = s·n + t`` is slot ``t`` of head ``s``, and keys and values are full precision at the same entries.
Everything a decode kernel needs to find an entry's bytes then follows from ``(s, t)`` and two running counts: the
full-precision entries before it (its full row is that count, its code row ``e`` minus it) and the overlay values
of the coded entries before it. :func:`uniform_part` computes those two counts in a handful of tensor operations
per call (one cumulative sum over the entries' flags and the static mask's per-(slot, head) overlay counts); the
general :class:`kv_hex.layout.PartLayout` builds and concatenates eight per-entry maps per part instead, ~100
operations per layer and decode step, which is what made HEX's decode host-bound on a GPU. The counts are not held
between calls: holding them would add 8 bytes per entry to what the store keeps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kv_hex.config import HEXConfig
from kv_hex.kernels.layouts import as_part_layout
from kv_hex.layout import head_columns
from kv_hex.segment import Segment
from kvcodec.packing import unpack_unchecked

__all__ = ["UniformCall", "UniformPart", "as_part_layout", "overlay_counts", "uniform_part"]


@dataclass(frozen=True)
class UniformPart:
    """A uniform compressed segment (see the module docstring) with the two running counts of one call.

    Attributes
    ----------
    B, H, D, n, bits : int
        Batch rows, KV heads, head dim, slots (entries per head), code width.
    flags : Tensor
        uint8 ``[ceil(N / 8)]``: the entries' "full-precision row" bits (the segment's own, shared by both sides).
    before : Tensor
        int32 ``[2, N]``: row 0, the full-precision entries before each entry (its full row; its code row is
        ``e - before[0, e]``); row 1, the overlay values held before it (its first overlay value; only with a mask).
    hcols : Tensor
        int32 ``[n, H, W]``: the static mask's channels of each (slot, head) (:func:`kv_hex.layout.head_columns`).
    k_codes, k_rows, k_scale, k_zero, k_over, v_codes, v_rows, v_scale, v_zero, v_over : Tensor
        The segment's tensors as held; ``k_scale/k_zero [S, D]`` (row ``s``); ``v_scale/v_zero`` flat, indexed by
        ``b·n + t`` when ``value_layer`` else by the entry's code row.
    value_layer : bool
        Value statistics per (batch row, slot) (``value_scope="layer"``) rather than per coded entry.
    """

    B: int
    H: int
    D: int
    n: int
    bits: int
    flags: torch.Tensor
    before: torch.Tensor
    hcols: torch.Tensor
    k_codes: torch.Tensor
    k_rows: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    k_over: torch.Tensor
    v_codes: torch.Tensor
    v_rows: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    v_over: torch.Tensor
    value_layer: bool

    @property
    def num_entries(self) -> int:
        return self.B * self.H * self.n

    @property
    def dtype(self) -> torch.dtype:
        return self.k_rows.dtype


@dataclass(frozen=True)
class UniformCall:
    """One source of entries for :func:`kv_hex.kernels.dispatch.uniform_attention`.

    Attributes
    ----------
    part : UniformPart
        A uniform segment, or a stack of ``stack`` segments of one size (:func:`kv_hex.segment.stack_segments`:
        row ``i·B + b`` is batch row ``b`` of segment ``i``), every one attended by batch row ``b``'s queries.
    res_k, res_v : Tensor, optional
        ``[B·H, T_r, D]`` full-precision residual rows attended in the same launch (each head holds ``T_r``).
    stack : int
        Segments in ``part`` (1: a segment of the query's batch rows).
    seg_logits, res_logits : bool
        Return the scaled logits of the part's entries (entry order) / of the residual's (``s·T_r + t``).
    """

    part: UniformPart
    res_k: torch.Tensor | None = None
    res_v: torch.Tensor | None = None
    stack: int = 1
    seg_logits: bool = False
    res_logits: bool = False


@functools.lru_cache(maxsize=64)
def _overlay_counts(kind: str, scope: str, rho: float, seed: int | None, n: int, H: int, D: int, device: str):
    cfg = HEXConfig(rho=rho, mask_kind=kind, mask_scope=scope, seed=seed)
    hcols = head_columns(cfg, n, H, D, device)
    return (hcols >= 0).sum(-1).T.to(torch.int32).contiguous()


def overlay_counts(cfg: HEXConfig, n: int, H: int, D: int, device) -> torch.Tensor:
    """int32 ``[H, n]``: how many overlay channels the static mask gives (head, slot) of an ``n``-slot segment
    (cached per device: it depends only on the mask's parameters)."""
    return _overlay_counts(cfg.mask_kind, cfg.mask_scope, cfg.rho, cfg.seed, n, H, D, str(torch.device(device)))


def uniform_part(cfg: HEXConfig, seg: Segment) -> UniformPart | None:
    """The :class:`UniformPart` of ``seg``, or ``None`` when the segment is not uniform (a head missing slots after
    an eviction, keys and values full at different entries, or a side holding no codes): such segments take the
    general layout. Reads nothing on the host beyond what the segment caches once (its uniform length and whether
    its sides share their flags)."""
    if not (seg.k_full.numel() and seg.v_full.numel()) or seg.uniform_length != seg.n or not seg.flags_shared:
        return None
    B, H, D, n = seg.counts.numel() // seg.H, seg.H, seg.D, seg.n
    N = B * H * n
    device = seg.pos.device
    full = unpack_unchecked(seg.k_full[None], 1, N).view(B, H, n)  # the flags' bit stream (kvcodec.packing)
    per = torch.empty(2, B, H, n, dtype=torch.int32, device=device)
    per[0] = full
    hcols = head_columns(cfg, n, H, D, device)
    if hcols.shape[-1]:
        torch.mul(overlay_counts(cfg, n, H, D, device), 1 - full, out=per[1])  # coded entries' overlay values
    else:
        per[1] = 0
    before = torch.cumsum(per.view(2, N), 1, dtype=torch.int32).sub_(per.view(2, N))
    return UniformPart(
        B, H, D, n, cfg.bits, seg.k_full, before, hcols,
        seg.k_codes, seg.k_rows, seg.k_scale, seg.k_zero, seg.k_over,
        seg.v_codes, seg.v_rows, seg.v_scale.reshape(-1), seg.v_zero.reshape(-1), seg.v_over,
        cfg.value_scope == "layer",
    )  # fmt: skip
