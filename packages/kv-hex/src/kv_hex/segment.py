"""One compressed HEX segment: packed KCVT codes, full-precision rows, and the expander overlay's values.

A segment covers ``n`` token *slots* per batch row (``slot_pos [B, n]``: the true position of each slot, ``-1``
where the row holds nothing). Its entries are ragged per (batch row, KV head) — ``seg = b·H + h`` — sorted by
``(seg, pos)``. Each entry's key (and value) is either a whole full-precision row or a row of ``bits``-wide codes;
inside a coded row the elements selected by the static mask (row = the entry's slot, columns = its head's
channels) are held as full-precision *overlay values* only: their coordinates are regenerated from the mask's
``(kind, n, d, ρ, seed)`` (:mod:`kv_hex.expander`), never stored.

Keys are quantized per channel over the segment's coded entries of one head (``scale/zero [S, D]``); values per
token, over the token's coded channels of every head (``value_scope="layer"``, ``[B, n]``) or of one head
(``"head"``, one per coded entry). Statistics skip overlay elements (``masked_stats``; HEX §3.4-3.5).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import torch

from kv_hex.config import HEXConfig
from kv_hex.expander import dense_mask, mask_table
from kv_hex.kernels import dispatch
from kvcodec.narrow import narrow
from kvcodec.packing import pack_unchecked, unpack_unchecked
from kvcodec.segments import segment_ids
from kvcore import packed_width

__all__ = [
    "Segment",
    "compact",
    "compress_segment",
    "segment_mask",
    "share_stack",
    "stack_segments",
    "uniform_length",
]


def full_flags(flags: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool "full-precision row" flags as a segment holds them: one bit per entry (uint8
    ``[ceil(N / 8)]``, kvcodec's little-endian bit packing), or nothing (``[0]``) when every entry is full."""
    if bool(flags.all()):
        return torch.zeros(0, dtype=torch.uint8, device=flags.device)
    return pack_unchecked(flags[None].to(torch.uint8), 1)[0]


@functools.lru_cache(maxsize=64)
def _dense(kind: str, n: int, C: int, rho: float, seed: int | None) -> torch.Tensor | None:
    table = mask_table(kind, n, C, rho, seed)
    return None if table is None else torch.from_numpy(dense_mask(table))


def segment_mask(cfg: HEXConfig, n: int, H: int, D: int, device) -> torch.Tensor | None:
    """``[n, H, D]`` bool element mask of an ``n``-slot segment (``None`` for ``mask_kind="none"``), expanded from
    the cached index table (a transient; the store never holds it)."""
    C = H * D if cfg.mask_scope == "layer" else D
    if n == 0:
        return None
    m = _dense(cfg.mask_kind, n, C, cfg.rho, cfg.seed)
    if m is None:
        return None
    m = m.to(device)
    return m.view(n, H, D) if cfg.mask_scope == "layer" else m[:, None, :].expand(n, H, D)


def uniform_length(counts: torch.Tensor, N: int) -> int | None:
    """Entries per head when each of the heads (``counts [S]``, ``N`` entries in all) holds the same number, at
    least one (HEX evicts nothing), else ``None``."""
    S = counts.numel()
    if S == 0 or N == 0 or N % S or not bool((counts == N // S).all()):
        return None
    return N // S


@dataclass
class Segment:
    """See the module docstring. Tensors only (``nbytes`` counts them); ``n``/``H``/``D`` are ints."""

    n: int
    H: int
    D: int
    slot_pos: torch.Tensor  # [B, n] int16 while every position fits (kvcodec.narrow), else int32; -1: empty slot
    counts: torch.Tensor  # [S] int64
    pos: torch.Tensor  # [N] int16 while every position fits (kvcodec.narrow), else int32
    k_full: torch.Tensor  # [ceil(N / 8)] uint8 bit-packed flags (full_flags), or [0] when every entry is full
    v_full: torch.Tensor  # [ceil(N / 8)] uint8 bit-packed flags (full_flags), or [0] when every entry is full
    k_rows: torch.Tensor  # [Nkf, D]
    v_rows: torch.Tensor  # [Nvf, D]
    k_codes: torch.Tensor  # [Nkq, PW] uint8
    v_codes: torch.Tensor  # [Nvq, PW] uint8
    k_scale: torch.Tensor  # [S, D] (or [0, D])
    k_zero: torch.Tensor
    v_scale: torch.Tensor  # [B, n] (layer) or [Nvq] (head) (or empty)
    v_zero: torch.Tensor
    k_over: torch.Tensor  # [Nko] overlay values of coded keys
    v_over: torch.Tensor
    acc: torch.Tensor | None  # [N] float32 accumulated attention (full mode only)

    def copy(self) -> Segment:
        new = copy.copy(self)
        new.__dict__.pop("longest_head", None)  # derived from counts, which a copy is made to change
        new.__dict__.pop("uniform_length", None)
        new.__dict__.pop("flags_shared", None)
        return new

    @property
    def num_entries(self) -> int:
        return int(self.pos.numel())

    @functools.cached_property
    def longest_head(self) -> int:
        """Entries of the longest head, read once per segment (a segment's entries never change in place: crop and
        eviction build new segments), so a decode step's layout reads nothing for it."""
        return int(self.counts.max()) if self.counts.numel() else 0

    @functools.cached_property
    def uniform_length(self) -> int | None:
        """:func:`uniform_length` of the segment's heads, read once per segment, like :attr:`longest_head`."""
        return uniform_length(self.counts, self.num_entries)

    @functools.cached_property
    def flags_shared(self) -> bool:
        """Keys and values are full precision at the same entries (HEX keeps whole tokens: heavy hitters and the
        recent window), so one set of entry maps addresses both sides; read once per segment, like
        :attr:`longest_head`."""
        return self.k_full.numel() == self.v_full.numel() and bool(torch.equal(self.k_full, self.v_full))

    def full(self, kind: str) -> torch.Tensor:
        """``[N]`` bool: the entry's key (``"k"``) or value (``"v"``) is a full-precision row."""
        f = getattr(self, f"{kind}_full")
        if f.numel() == 0:
            return torch.ones_like(self.pos, dtype=torch.bool)
        return unpack_unchecked(f[None], 1, self.pos.numel())[0].bool()

    @property
    def coded(self) -> bool:
        """Some entry is coded (its flags are stored); otherwise every entry is a full-precision row."""
        return bool(self.k_full.numel() or self.v_full.numel())

    def seg(self) -> torch.Tensor:
        return segment_ids(self.counts, self.pos.numel())  # the total from a shape: no host read

    def slots(self, seg: torch.Tensor | None = None) -> torch.Tensor:
        """Slot of every entry (its position's index in its row's ``slot_pos``)."""
        seg = self.seg() if seg is None else seg
        sp = self.slot_pos.long()
        filled = torch.cummax(sp, dim=-1).values  # -1 slots take the running max: non-decreasing rows
        # every row shifted by row * 2^32 (positions are below 2^31): one sorted vector, one search, no host read
        B, n = filled.shape
        shift = torch.arange(B, device=sp.device)[:, None] << 32
        row = seg.long() // self.H
        return torch.searchsorted((filled + shift).flatten(), self.pos.long() + (row << 32)) - row * n

    def element_mask(self, cfg: HEXConfig, seg: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` bool overlay mask of every entry (whether coded or not)."""
        m = segment_mask(cfg, self.n, self.H, self.D, self.pos.device)
        if m is None:
            return torch.zeros(seg.numel(), self.D, dtype=torch.bool, device=self.pos.device)
        return m[slot.long(), seg % self.H]

    def take(
        self, cfg: HEXConfig, idx: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor | None = None
    ) -> Segment:
        """A new segment of entries ``idx`` (old entry indices, sorted by new ``(seg, pos)``) with new per-segment
        ``counts``; ``rows`` (old batch rows of the new rows) for a reorder. Kept bytes are copied as they are."""
        seg = self.seg()
        coded = self.coded
        emask = self.element_mask(cfg, seg, self.slots(seg)) if coded else None
        new = self.copy()
        H = self.H
        if rows is not None:
            take_seg = (rows[:, None] * H + torch.arange(H, device=rows.device)).flatten()
            new.slot_pos = self.slot_pos[rows].clone()
        else:
            take_seg = None
        for kind in ("k", "v"):
            full = self.full(kind)
            if not coded:
                setattr(new, f"{kind}_rows", getattr(self, f"{kind}_rows")[idx].clone())
                continue
            rank_full = torch.cumsum(full, 0) - 1
            rank_code = torch.cumsum(~full, 0) - 1
            sel_full = idx[full[idx]]
            sel_code = idx[~full[idx]]
            flags = full[idx]
            setattr(new, f"{kind}_full", full_flags(flags))
            setattr(new, f"{kind}_rows", getattr(self, f"{kind}_rows")[rank_full[sel_full]].clone())
            setattr(new, f"{kind}_codes", getattr(self, f"{kind}_codes")[rank_code[sel_code]].clone())
            # overlay values of coded entries: per-entry counts -> offsets -> gather
            n_over = emask[~full].sum(-1)
            start = torch.cumsum(n_over, 0) - n_over
            take_n = n_over[rank_code[sel_code]]
            base = start[rank_code[sel_code]]
            off = torch.repeat_interleave(base - (torch.cumsum(take_n, 0) - take_n), take_n)
            gather = torch.arange(int(take_n.sum()), device=idx.device) + off
            setattr(new, f"{kind}_over", getattr(self, f"{kind}_over")[gather].clone())
            if kind == "v" and cfg.value_scope == "head" and self.v_scale.numel():
                new.v_scale = self.v_scale[rank_code[sel_code]].clone()
                new.v_zero = self.v_zero[rank_code[sel_code]].clone()
        if take_seg is not None and self.k_scale.numel():
            new.k_scale, new.k_zero = self.k_scale[take_seg].clone(), self.k_zero[take_seg].clone()
        if rows is not None and cfg.value_scope == "layer" and self.v_scale.numel():
            new.v_scale, new.v_zero = self.v_scale[rows].clone(), self.v_zero[rows].clone()
        if not coded and rows is not None:
            new.slot_pos = self.slot_pos[:, :0][rows].clone()
        new.pos = self.pos[idx].clone()
        new.counts = counts.clone()
        new.acc = None if self.acc is None else self.acc[idx].clone()
        return new


def compress_segment(
    cfg: HEXConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_tier: torch.Tensor,
    value_tier: torch.Tensor,
    slot_pos: torch.Tensor,
    acc: torch.Tensor | None = None,
) -> Segment:
    """Compress a dense staging of one segment.

    Parameters
    ----------
    cfg : HEXConfig
    keys, values : Tensor
        ``[B, H, n, D]`` (slot order).
    key_tier, value_tier : Tensor
        ``[B, H, n]`` uint8: ``EVICT`` (not held), ``FULL`` or ``cfg.bits``.
    slot_pos : Tensor
        ``[B, n]`` true positions of the slots (``-1``: empty slot).
    acc : Tensor, optional
        ``[B, H, n]`` accumulated attention to keep per entry (full mode).
    """
    from kvcore import EVICT, FULL

    B, H, n, D = keys.shape
    bits = cfg.bits
    held = key_tier != EVICT
    emask = segment_mask(cfg, n, H, D, keys.device)
    emask = torch.zeros(n, H, D, dtype=torch.bool, device=keys.device) if emask is None else emask
    emask = emask.permute(1, 0, 2)[None].expand(B, H, n, D)
    parts = {}
    for kind, x, tier in (("k", keys, key_tier), ("v", values, value_tier)):
        coded = held & (tier != FULL)
        if not bool(coded.any()):  # no codes and no statistics held for a tensor with no coded entry
            empty = torch.zeros(0, dtype=x.dtype, device=x.device)
            parts[kind] = dict(
                full=torch.zeros(0, dtype=torch.uint8, device=x.device),
                rows=x[held].clone(),
                codes=torch.zeros(0, packed_width(D, bits), dtype=torch.uint8, device=x.device),
                over=empty.clone(),
                scale=empty.clone(),
                zero=empty.clone(),
            )
            continue
        use = coded[..., None] & (~emask if cfg.masked_stats else torch.ones_like(emask))
        if kind == "k":
            codes, scale, zero = dispatch.kcvt_codes(x.reshape(B * H, n, D), use.reshape(B * H, n, D), bits, "channel")
            scale, zero = scale.reshape(B * H, D), zero.reshape(B * H, D)
        elif cfg.value_scope == "layer":
            xt = x.permute(0, 2, 1, 3).reshape(B, n, H * D)
            ut = use.permute(0, 2, 1, 3).reshape(B, n, H * D)
            codes, scale, zero = dispatch.kcvt_codes(xt, ut, bits, "token")
            codes = codes.reshape(B, n, H, D).permute(0, 2, 1, 3)
            scale, zero = scale.reshape(B, n), zero.reshape(B, n)
        else:
            codes, scale, zero = dispatch.kcvt_codes(x.reshape(B * H, n, D), use.reshape(B * H, n, D), bits, "token")
            scale, zero = scale.reshape(B, H, n)[coded], zero.reshape(B, H, n)[coded]
        codes = codes.reshape(B, H, n, D)
        parts[kind] = dict(
            full=full_flags(tier[held] == FULL),
            rows=x[held & (tier == FULL)].clone(),
            codes=pack_unchecked(codes[coded], bits),
            over=x[coded][emask[coded]].clone(),
            scale=scale.clone(),
            zero=zero.clone(),
        )
    pos = narrow(slot_pos[:, None, :].expand(B, H, n)[held])
    coded_any = bool((held & ((key_tier != FULL) | (value_tier != FULL))).any())
    return Segment(
        n=n,
        H=H,
        D=D,
        slot_pos=narrow(slot_pos.clone() if coded_any else slot_pos[:, :0].clone()),
        counts=held.reshape(B * H, n).sum(-1),
        pos=pos,
        k_full=parts["k"]["full"],
        v_full=parts["v"]["full"],
        k_rows=parts["k"]["rows"],
        v_rows=parts["v"]["rows"],
        k_codes=parts["k"]["codes"],
        v_codes=parts["v"]["codes"],
        k_scale=parts["k"]["scale"],
        k_zero=parts["k"]["zero"],
        v_scale=parts["v"]["scale"],
        v_zero=parts["v"]["zero"],
        k_over=parts["k"]["over"],
        v_over=parts["v"]["over"],
        acc=None if acc is None else acc[held].float().clone(),
    )


def stack_segments(segs: list[Segment]) -> Segment:
    """Segments of one size as one segment whose batch rows are theirs, segment after segment: row ``i·B + b`` is
    row ``b`` of ``segs[i]`` (``B·m`` rows). Nothing is re-quantized: codes, statistics, full rows and overlay
    values are concatenated as held (each segment keeps its own key and value statistics, which are per batch row and
    head or per entry), and the static mask is the same for every segment of one size. Attending to the stack with
    the query repeated per segment and merging the ``m`` results by log-sum-exp is attending to all of them, in a
    number of operations that does not grow with ``m`` (a decode in append mode writes one segment per block).

    Every segment must have the same ``n``, ``H`` and ``D`` and hold codes for both keys and values; raises
    ``ValueError`` else. The bit-packed flags are concatenated as bytes when every segment's entries fill whole
    bytes, else unpacked and packed again.
    """
    first = segs[0]
    if any((s.n, s.H, s.D) != (first.n, first.H, first.D) for s in segs):
        raise ValueError("stack_segments needs segments of one size (n, H, D)")
    if not all(s.k_full.numel() and s.v_full.numel() for s in segs):
        raise ValueError("stack_segments needs segments holding codes for both keys and values")
    if len(segs) == 1:
        return first

    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(s, name) for s in segs])

    def flags(kind: str) -> torch.Tensor:
        if all(s.num_entries % 8 == 0 for s in segs):  # whole bytes: the bit streams concatenate
            return cat(f"{kind}_full")
        return full_flags(torch.cat([s.full(kind) for s in segs]))

    acc = None if any(s.acc is None for s in segs) else cat("acc")
    stack = Segment(
        n=first.n,
        H=first.H,
        D=first.D,
        slot_pos=cat("slot_pos"),
        counts=cat("counts"),
        pos=cat("pos"),
        k_full=flags("k"),
        v_full=flags("v"),
        k_rows=cat("k_rows"),
        v_rows=cat("v_rows"),
        k_codes=cat("k_codes"),
        v_codes=cat("v_codes"),
        k_scale=cat("k_scale"),
        k_zero=cat("k_zero"),
        v_scale=cat("v_scale"),
        v_zero=cat("v_zero"),
        k_over=cat("k_over"),
        v_over=cat("v_over"),
        acc=acc,
    )
    # what the members know on the host, so that attending to the stack reads nothing
    stack.__dict__["longest_head"] = max(s.longest_head for s in segs)
    lengths = {s.uniform_length for s in segs}
    stack.__dict__["uniform_length"] = lengths.pop() if len(lengths) == 1 else None
    stack.__dict__["flags_shared"] = all(s.flags_shared for s in segs)
    return stack


#: the tensors of a segment that :func:`stack_segments` concatenates along their first dimension
_STACKED = (
    "slot_pos", "counts", "pos", "k_full", "v_full", "k_rows", "v_rows", "k_codes", "v_codes",
    "k_scale", "k_zero", "v_scale", "v_zero", "k_over", "v_over",
)  # fmt: skip


def share_stack(segs: list[Segment], stack: Segment) -> bool:
    """Make every segment of ``segs`` hold views of ``stack``'s tensors (``stack = stack_segments(segs)``): their
    own storages are freed, so the stack can be kept and attended again without a copy per use and without holding
    the segments' bytes twice. Possible when the flags concatenated as whole bytes and no accumulator is held;
    returns whether it was done (else nothing changes). Values are unchanged (a view of the same bytes)."""
    if len(segs) < 2 or stack.acc is not None or any(s.num_entries % 8 for s in segs):
        return False
    for name in _STACKED:
        whole = getattr(stack, name)
        start = 0
        for seg in segs:
            n = getattr(seg, name).shape[0]
            setattr(seg, name, whole[start : start + n])
            start += n
    return True


def compact(seg: Segment) -> None:
    """Give ``seg`` storages of its own again (after :func:`share_stack`, when its stack is dropped while it stays
    held): views of a larger storage would keep the whole storage alive and counted."""
    for name in _STACKED:
        t = getattr(seg, name)
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            setattr(seg, name, t.clone())
