"""Ragged per-(batch, head) segments: the index arithmetic shared by the parts of the quantized stores.

A *segment* is one (batch row, KV head) pair, ``seg = b * H + h``; items (cache entries or quantization
units) carry the id of the segment they belong to.
"""

from __future__ import annotations

import torch


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``[0, x0, x0 + x1, ...]`` of the same length as ``x``."""
    return torch.cumsum(x, 0) - x


def segment_ids(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``repeat_interleave(arange(S), counts)``: the segment of every item when items are sorted by segment.

    The stores call this several times per decode step; ``torch.repeat_interleave(counts)`` is the fastest way
    measured on CPU with torch 2.15 (4-8x faster than a ``searchsorted`` over the cumulative counts, which this
    replaced: ``benchmarks/bench_codec_ops.py``). ``total`` (``counts.sum()``, when the caller knows it from a
    tensor's shape) spares the host read of the output size (a host sync on a GPU).
    """
    return torch.repeat_interleave(counts.long(), output_size=total)


def offsets_in_segment(counts: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Rank of every item inside its segment, for items sorted by segment (``counts [S]``; ``total`` as in
    :func:`segment_ids`)."""
    seg = segment_ids(counts, total)
    return torch.arange(seg.numel(), device=counts.device) - exclusive_cumsum(counts.long())[seg]


def rank_in_segment(seg: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For items sorted by segment: ``(rank of each item inside its segment, items per segment)``."""
    counts = torch.bincount(seg.long(), minlength=num_segments)
    rank = torch.arange(seg.numel(), device=seg.device) - exclusive_cumsum(counts)[seg.long()]
    return rank, counts


def segment_take(item_seg: torch.Tensor, take: torch.Tensor, num_segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items of old segments ``take[i]`` in new-segment order (beam-search reorder, may repeat segments).

    Parameters
    ----------
    item_seg : Tensor
        ``[N]`` old segment id of every item.
    take : Tensor
        ``[S']`` old segment that new segment ``i`` copies.
    num_segments : int
        Number of old segments.

    Returns
    -------
    index, new_seg : Tensor
        ``[M]`` item indices (stable inside a segment) and the new segment id of each.
    """
    device = item_seg.device
    order = torch.sort(item_seg.long(), stable=True).indices
    counts = torch.bincount(item_seg.long(), minlength=num_segments)
    starts = exclusive_cumsum(counts)
    take = take.long().to(device)
    n = counts[take]
    new_seg = segment_ids(n)
    offset = torch.arange(new_seg.numel(), device=device) - exclusive_cumsum(n)[new_seg]
    return order[starts[take][new_seg] + offset], new_seg
