"""A mixed-tier cache addressed by blocks: the decode layout of HqeKV held between re-plans.

HqeKV tiers whole blocks of ``G`` position-aligned tokens (§3.3) and appends decode tokens to a full-precision
residual until the next re-plan (§3.5). So in the order of ``read()`` every head holds ``nb`` whole blocks, each in
one tier per side with its entries on consecutive rows of that tier (one key quantization unit; ``G`` value units),
followed by a *tail* of full-precision rows (the residual). A :class:`BlockLayout` with one :class:`BlockedSide`
per side says that in ``[B, Hkv, NB]`` maps, one entry per block instead of one per token (a map of ``9`` bytes per
block and side instead of ``9`` per token), and slot ``t`` of head ``s`` is found by arithmetic: block ``t // G``,
row ``row[s, t // G] + t % G``, or the tail's row ``tail[s] + t - nb[s]·G``.

The full-precision rows of a side are the rows of a :class:`kvcodec.ragged.Residual` (sorted by head, oldest first);
appending ``n`` entries to every head moves every earlier row of head ``s`` down by ``s·n`` and adds the new
entries after the head's last row. A layout therefore stays valid through appends: :attr:`BlockLayout.appended`
counts the entries appended to every head since the layout was taken, and a full row ``r`` of head ``s`` (a block
of tier ``16`` or the tail) is row ``r + s·appended`` of the current rows. Any other edit of the store (a re-plan,
a crop, a reorder) takes a new layout (:func:`blocked_layout`, which returns ``None`` where the held entries are not
laid out in whole blocks: ragged blocks after a crop, for instance; the per-entry maps of
:class:`~kv_hqekv.kernels.TieredSide` then apply).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kv_hqekv.kernels.tiered import FULL_TIER, NO_ENTRY, TierCodes, TieredSide
from kvcore.checks import check_int, check_tensor


@dataclass(frozen=True)
class BlockedSide:
    """Keys or values of a mixed-tier cache addressed by blocks (module doc).

    Parameters
    ----------
    full : Tensor
        ``[F, D]`` the side's current full-precision rows (cache dtype), laid out as a ``Residual``'s.
    tiers : dict[int, TierCodes]
        The code table of each quantized tier present (as in :class:`~kv_hqekv.kernels.TieredSide`).
    tier, row : Tensor
        ``[B, Hkv, NB]`` per block: uint8 tier (``0`` no entry -- a value evicted under its kept keys --, ``16``
        full rows, or a key of ``tiers``) and int32 first row (a full block's row is counted when the layout was
        taken: :attr:`BlockLayout.appended` shifts it).
    group : Tensor or None
        ``[B, Hkv, NB]`` int32 group parameter row of the block (``axis="channel"``: one group per block); ``None``
        for ``axis="token"``, where every entry has its own parameter row, equal to its code row.
    tail : Tensor
        ``[B, Hkv]`` int32 full row of the first tail entry of each head when the layout was taken.
    axis : {"channel", "token"}
    group_size : int
        ``G`` channels per value group (``axis="token"``), as in :class:`~kv_hqekv.kernels.TieredSide`.
    """

    full: torch.Tensor
    tiers: dict[int, TierCodes]
    tier: torch.Tensor
    row: torch.Tensor
    group: torch.Tensor | None
    tail: torch.Tensor
    axis: str
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.full.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    def with_full(self, full: torch.Tensor) -> BlockedSide:
        """The same side over the current full-precision rows (the maps are kept, not copied)."""
        return dataclasses.replace(self, full=full)


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks and the tail of every head lie (module doc), shared by the keys and the values.

    Parameters
    ----------
    blocks : Tensor
        ``[B, Hkv]`` int32 whole blocks held by each head (``nb``; slots ``[0, nb·G)``).
    held : Tensor
        ``[B, Hkv]`` int32 entries held by each head when the layout was taken (blocks and tail).
    block : int
        ``G``, entries per block.
    width : int
        ``T``: entries held by the longest head now (the maps' width of ``read()``).
    appended : int
        Entries appended to every head since the layout was taken.
    """

    blocks: torch.Tensor
    held: torch.Tensor
    block: int
    width: int
    appended: int = 0

    def __post_init__(self) -> None:
        check_tensor("blocks", self.blocks, ndim=2)
        check_tensor("held", self.held, ndim=2)
        check_int("block", self.block, low=1)
        check_int("width", self.width, low=0)
        check_int("appended", self.appended, low=0)

    def after_append(self, n: int) -> BlockLayout:
        """The layout after ``n`` entries were appended to every head."""
        return dataclasses.replace(self, width=self.width + n, appended=self.appended + n)


def _slot_maps(layout: BlockLayout, side: BlockedSide) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-entry ``(tier uint8, row int32, group int32)`` maps ``[B, Hkv, T]`` of a blocked side (the arithmetic the
    kernel does, in torch)."""
    B, H = layout.blocks.shape
    T, G, a = layout.width, layout.block, layout.appended
    device = side.tier.device
    t = torch.arange(T, device=device)
    nb = layout.blocks.long()[..., None]
    seg = torch.arange(B * H, device=device).view(B, H, 1)
    shift = seg * a
    in_block = t < nb * G
    blk = (t // G).clamp_max(max(side.tier.shape[-1] - 1, 0)).expand(B, H, T)
    if side.tier.shape[-1]:
        btier = torch.gather(side.tier, 2, blk).long()
        brow = torch.gather(side.row, 2, blk).long() + t % G + torch.where(btier == FULL_TIER, shift, 0)
        bgroup = torch.gather(side.group, 2, blk).long() if side.group is not None else brow
    else:
        btier = brow = bgroup = torch.zeros(B, H, T, dtype=torch.long, device=device)
    tail_row = side.tail.long()[..., None] + shift + (t - nb * G)
    in_tail = ~in_block & (t < layout.held.long()[..., None] + a)
    tier = torch.where(in_block, btier, torch.where(in_tail, FULL_TIER, NO_ENTRY))
    row = torch.where(in_block, brow, torch.where(in_tail, tail_row, 0))
    group = torch.where(in_block & (tier != FULL_TIER), bgroup, 0)
    return tier.to(torch.uint8), row.int(), group.int()


def expand_side(layout: BlockLayout, side: BlockedSide) -> TieredSide:
    """The per-entry :class:`~kv_hqekv.kernels.TieredSide` of a blocked side (what the reference kernels read)."""
    tier, row, group = _slot_maps(layout, side)
    return TieredSide(side.full, side.tiers, tier, row, group, side.axis, side.group_size)


def blocked_layout(
    keys: TieredSide, values: TieredSide, key_rows: torch.Tensor, value_rows: torch.Tensor, block: int
) -> tuple[BlockLayout, BlockedSide, BlockedSide] | None:
    """The block layout of a mixed-tier cache given by its per-entry maps, or ``None`` where it has none.

    Parameters
    ----------
    keys, values : TieredSide
        The per-entry maps ``[B, Hkv, T]`` of the held cache (:func:`kv_hqekv.attention.tiered_sides`).
    key_rows, value_rows : Tensor
        ``[B·Hkv]`` full-precision rows each head holds on each side (the ``Residual`` counts): the tail must end
        at its head's last row, where appended entries go.
    block : int
        ``G``.

    Returns ``None`` unless every head holds whole blocks of ``G`` slots, each in one tier per side with its rows
    (and, for keys, its one parameter row) consecutive, followed by a tail of full rows ending at the head's last
    full row. One value is read on the host (the verdict).
    """
    B, H, T = keys.tier.shape
    G = block
    device = keys.tier.device
    held = (keys.tier != NO_ENTRY).sum(-1)  # [B, H]: key-held entries (read() packs them first)
    nb = held // G
    NB = T // G
    t = torch.arange(T, device=device)
    in_block = t < (nb * G)[..., None]
    in_tail = ~in_block & (t < held[..., None])
    ok = torch.ones((), dtype=torch.bool, device=device)
    sides = []
    for side, rows in ((keys, key_rows), (values, value_rows)):
        tier, row, group = side.tier, side.row.long(), side.group.long()
        head = tier[..., : NB * G].view(B, H, NB, G)
        first = row[..., : NB * G].view(B, H, NB, G)[..., :1]
        step = torch.arange(G, device=device)
        valid_block = (torch.arange(NB, device=device) < nb[..., None])[..., None]
        held_entry = head != NO_ENTRY
        same = (head == head[..., :1]) & (~held_entry | (first + step == row[..., : NB * G].view(B, H, NB, G)))
        if side.axis == "channel":
            grp = group[..., : NB * G].view(B, H, NB, G)
            same &= ~held_entry | (head == FULL_TIER) | (grp == grp[..., :1])
        else:  # every entry is its own parameter row
            same &= ~held_entry | (head == FULL_TIER) | (group[..., : NB * G].view(B, H, NB, G) == first + step)
        ok &= (same | ~valid_block).all()
        end = torch.cumsum(rows.long().to(device), 0).view(B, H)  # the row after each head's last full row
        count = (held - nb * G).long()
        tail = end - count
        tail_ok = ~in_tail | ((tier == FULL_TIER) & (row == tail[..., None] + (t - (nb * G)[..., None])))
        ok &= tail_ok.all()
        btier = head[..., 0].masked_fill(~valid_block[..., 0], NO_ENTRY).contiguous()
        brow = first[..., 0].masked_fill(~valid_block[..., 0], 0).int().contiguous()
        bgroup = (
            group[..., : NB * G].view(B, H, NB, G)[..., 0].masked_fill(~valid_block[..., 0], 0).int().contiguous()
            if side.axis == "channel"
            else None
        )
        sides.append(BlockedSide(side.full, side.tiers, btier, brow, bgroup, tail.int(), side.axis, side.group_size))
    if not bool(ok):
        return None
    layout = BlockLayout(nb.int().contiguous(), held.int().contiguous(), G, T)
    return layout, sides[0], sides[1]
