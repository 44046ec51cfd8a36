"""PyTorch references of HEX's kernels (the CPU path; the definition the Triton kernels are tested against)."""

from __future__ import annotations

import torch

from kv_hex.kernels.layouts import as_part_layout
from kvcodec.packing import unpack_unchecked
from kvcodec.stats import minmax_scale, minmax_stats, scale_dtype_for

__all__ = [
    "attention_column_sums",
    "decode_attention",
    "dequantize_part",
    "kcvt_codes",
    "part_attention",
    "uniform_attention",
]


def kcvt_codes(
    x: torch.Tensor, use: torch.Tensor, bits: int, axis: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked KCVT statistics and codes over whole-axis groups (HEX §3.4; GEAR's ``KCVT``).

    Parameters
    ----------
    x : Tensor
        Floating ``[G, T, C]``.
    use : Tensor
        Bool ``[G, T, C]``: entries that enter the statistics (the quantized ones, not kept in full precision).
    bits : int
        Code width.
    axis : {"channel", "token"}
        ``"channel"``: one group per (g, channel) over the ``T`` tokens (keys); ``"token"``: one group per (g, token)
        over the ``C`` channels (values).

    Returns
    -------
    codes : Tensor
        uint8 ``[G, T, C]`` in ``[0, 2**bits - 1]`` (unpacked).
    scale, zero : Tensor
        ``[G, 1, C]`` (channel) or ``[G, T, 1]`` (token); scale in :func:`kvcodec.stats.scale_dtype_for`, zero in
        ``x.dtype`` (an exact group minimum). Groups with no entry in ``use`` get zero 0 and the smallest scale.
    """
    stats = minmax_stats(x, axis, None, ~use)
    sdt = scale_dtype_for(x.dtype, bits)
    scale = minmax_scale(stats.span, bits, sdt)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"a KCVT group range is too large for {sdt} scales at bits={bits}; use float32 K/V")
    zero = stats.lo.to(x.dtype)
    codes = torch.round((x.float() - zero.float()) / scale).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale.to(sdt), zero


def attention_column_sums(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, chunk: int = 256
) -> torch.Tensor:
    """Accumulated attention each key receives from causal prompt queries (HEX §3.3, H2O's score), per KV head.

    ``queries [B, Hq, W, D]`` are the last ``W`` of the ``T`` tokens of ``keys [B, Hkv, T, D]``; query ``i`` attends
    keys ``0 .. T-W+i`` that are ``valid [B, T]``. Returns float32 ``[B, Hkv, T]``: softmax probabilities summed
    over the queries and over the query heads of each KV head's GQA group. Queries are processed ``chunk`` rows at
    a time against the keys the chunk can see (a chunk's last query sees ``T-W+e`` of them: the causal future is
    never computed), so memory is ``O(chunk · T)``, never the ``T × T`` matrix.
    """
    B, Hq, W, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    G = Hq // H
    k = keys.float()
    qg = queries.float().reshape(B, H, G, W, D)
    padded = not bool(valid.all())  # without padding every query sees itself: no fully masked row, no NaN
    pad = ~valid[:, None, None, None, :]
    idx = torch.arange(T, device=keys.device)
    total = torch.zeros(B, H, T, device=keys.device)
    for s in range(0, W, chunk):
        e = min(W, s + chunk)
        end = T - W + e  # keys visible to the chunk's last query
        logits = torch.einsum("bhgwd,bhtd->bhgwt", qg[:, :, :, s:e], k[:, :, :end]).mul_(scale)
        mask = idx[None, :end] > torch.arange(T - W + s, end, device=keys.device)[:, None]
        if padded:
            mask = mask | pad[..., :end]
        p = torch.softmax(logits.masked_fill_(mask, float("-inf")), dim=-1)
        if padded:
            p = p.nan_to_num_(0.0)
        total[:, :, :end] += p.sum(dim=(2, 3))
    return total


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, Q, D]`` over ``keys/values [B, Hkv, T, D]`` with additive ``bias [B, Hkv, T]``.

    Returns ``(out fp32 [B, Hq, Q, D], lse fp32 [B, Hq, Q], column sums fp32 [B, Hkv, T])``: the last is the
    attention probability each entry received, summed over the queries and the query heads of its GQA group
    (what HEX's heavy-hitter accumulator adds at every decode step, §3.3). A head with no entry gives ``out = 0``,
    ``lse = -inf`` and zero sums. The dense definition over a whole view (``HEXStore.read()``); the store attends
    part by part with :func:`part_attention` and is tested against this.
    """
    B, Hq, Q, D = query.shape
    H, _T = keys.shape[1], keys.shape[2]
    G = Hq // H
    q = query.float().reshape(B, H, G, Q, D)
    logits = torch.einsum("bhgqd,bhtd->bhgqt", q, keys.float()) * scale + bias.float()[:, :, None, None, :]
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhgqt,bhtd->bhgqd", p, values.float())
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q), p.sum(dim=(2, 3))


def dequantize_part(part) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every entry of one part of a HEX layer (:class:`kv_hex.layout.PartLayout`), in entry
    order and the cache dtype: full-precision rows bit-exact; code rows dequantized as ``code · scale + zero`` in
    float32 (no fused multiply-add) rounded to the cache dtype, then the static mask's overlay elements replaced by
    their full-precision values (HEX §3.5: ``K̂ = M⊙K + (1−M)⊙deq(Q(K))``).

    Returns
    -------
    keys, values : Tensor
        ``[N, D]`` in ``part.dtype``.
    """
    D = part.D
    out = []
    for side in (part.k, part.v):
        N = side.idx.numel()
        full = side.idx < 0
        if bool(full.all()):
            out.append(side.rows[(-1 - side.idx).long()])
            continue
        dev = side.idx.device
        fi = torch.nonzero(full).flatten()
        ci = torch.nonzero(~full).flatten()
        crow = side.idx[ci].long()
        # codes laid out in entry order (a full row's slot stays 0 and is overwritten below): a uint8 scatter of
        # packed rows instead of a float scatter of dequantized ones
        packed = torch.zeros(N, side.codes.shape[1], dtype=torch.uint8, device=dev)
        packed[ci] = side.codes[crow]
        codes = unpack_unchecked(packed, part.bits, D).float()
        grp = side.grp.long()  # in range for every entry (a full row's statistics row is read, then overwritten)
        S, T = part.B * part.H, part.T
        if side.per_channel and N == S * T and side.scale.shape[0] == S and bool((part.count == T).all()):
            # keys: one statistics row per head (grp = head) and every head holds T entries: broadcast, no gather
            s, z = side.scale.float()[:, None, :], side.zero.float()[:, None, :]
            codes = codes.view(S, T, D)
        elif side.per_channel:
            s, z = side.scale.float()[grp], side.zero.float()[grp]
        else:
            s, z = side.scale.float()[grp][:, None], side.zero.float()[grp][:, None]
        rows = codes.mul_(s).add_(z).view(N, D).to(side.rows.dtype)  # code · scale + zero in float32, no FMA
        if part.hcols.shape[-1]:
            # each coded entry's overlay values start at its ooff, channels ascending (the mask's columns of its slot
            # and head, -1 padded at the end): flat positions (entry, channel) and the values' positions in `over`
            cols = part.hcols[part.slot[ci].long(), part.seg()[ci] % part.H].long()  # [Nc, W]
            held = cols >= 0
            flat = (ci[:, None] * D + cols)[held]
            src = (side.ooff[ci].long()[:, None] + torch.arange(cols.shape[1], device=dev))[held]
            rows.view(-1)[flat] = side.over[src]
        rows[fi] = side.rows[(-1 - side.idx[fi]).long()]
        out.append(rows)
    return out[0], out[1]


def part_attention(
    query: torch.Tensor, part, scale: float, logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [B, Hq, Q, D]`` over one part of a HEX layer (a segment or the residual; HEX §3.5).

    The part is dequantized on its own (:func:`dequantize_part`), laid out per head and attended; a store merges
    its parts by log-sum-exp (:func:`kvcore.merge_attention`), so the whole dequantized cache never exists at once.

    Returns
    -------
    out : Tensor
        float32 ``[B, Hq, Q, D]`` (0 for a head with no entry in the part).
    lse : Tensor
        float32 ``[B, Hq, Q]`` (``-inf`` for a head with no entry).
    logits : Tensor or None
        With ``logits=True``: float32 ``[N, G·Q]``, entry ``i``'s scaled logit for each query row of its head's
        GQA group (row ``g·Q + q`` is query head ``h·G + g``, query ``q``), from which the store derives the
        attention probability each entry receives once every part's log-sum-exp is known.
    """
    B, Hq, Q, D = query.shape
    H, S, T = part.H, part.B * part.H, part.T
    G = Hq // H
    R = G * Q
    k, v = dequantize_part(part)
    q = query.float().reshape(B, H, G, Q, D).reshape(S, R, D)
    if bool((part.count == T).all()):  # every head holds T entries (HEX evicts nothing): a plain view
        K, V = k.float().view(S, T, D), v.float().view(S, T, D)
        lg = torch.einsum("srd,std->srt", q, K) * scale
    else:  # ragged heads: pad with -inf logits
        seg = part.seg()
        t = torch.arange(seg.numel(), device=seg.device) - part.start.long()[seg]
        K = torch.zeros(S, T, D, device=k.device)
        V = torch.zeros(S, T, D, device=k.device)
        K[seg, t], V[seg, t] = k.float(), v.float()
        bias = torch.full((S, T), float("-inf"), device=k.device)
        bias[seg, t] = 0.0
        lg = torch.einsum("srd,std->srt", q, K) * scale + bias[:, None, :]
    lse = torch.logsumexp(lg, dim=-1)
    p = torch.exp(lg - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("srt,std->srd", p, V)
    if not logits:
        lg_entries = None
    elif bool((part.count == T).all()):
        lg_entries = lg.transpose(1, 2).reshape(S * T, R)
    else:
        lg_entries = lg[seg, :, t]
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q), lg_entries


def uniform_attention(
    query: torch.Tensor, calls: list, scale: float
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Attention of ``query [B, Hq, Q, D]`` over uniform segments and the residual
    (:class:`kv_hex.uniform.UniformCall` s), one softmax over all of them.

    Each call's segment (or stack of segments, attended with the query repeated per segment) goes through its
    general layout (:func:`kv_hex.kernels.layouts.as_part_layout`, :func:`part_attention`), its residual rows
    densely; everything is merged by log-sum-exp. Returns ``(out, lse, logits)``: float32 ``[B, Hq, Q, D]`` and
    ``[B, Hq, Q]``, and per call ``(segment logits, residual logits)``: the scaled logits ``[N, G·Q]`` of the
    segment's entries (entry order) and ``[B·H·T_r, G·Q]`` of the residual's (``s·T_r + t``) where the call asks for
    them, else ``None``.
    """
    from kvcore import merge_attention, merge_split_attention

    B, Hq, Q, D = query.shape
    parts, logits = [], []
    for call in calls:
        m = call.stack
        q = query if m == 1 else query.repeat(m, 1, 1, 1)  # row i·B + b: segment i, batch row b
        out, lse, slg = part_attention(q, as_part_layout(call.part), scale, call.seg_logits)
        if m > 1:
            out, lse = merge_split_attention(out.reshape(m, B, Hq, Q, D), lse.reshape(m, B, Hq, Q), 0)
        parts.append((out, lse))
        rlg = None
        if call.res_k is not None and call.res_k.shape[1]:
            S, TR, _ = call.res_k.shape
            qr = query.float().reshape(S, Hq * Q * B // S, D)
            lg = torch.einsum("srd,std->srt", qr, call.res_k.float()) * scale
            rlse = torch.logsumexp(lg, dim=-1)
            rout = torch.einsum("srt,std->srd", torch.exp(lg - rlse[..., None]), call.res_v.float())
            parts.append((rout.reshape(B, Hq, Q, D), rlse.reshape(B, Hq, Q)))
            if call.res_logits:
                rlg = lg.transpose(1, 2).reshape(S * TR, -1)
        elif call.res_logits:
            rlg = torch.zeros(0, Hq // call.part.H * Q, device=query.device)
        logits.append((slg, rlg))
    out, lse = merge_attention(parts)
    return out, lse, logits


def accumulate_attention(acc: torch.Tensor | None, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The heavy-hitter accumulator after one decode step (HEX §3.3): ``acc + Σ_r exp(logits[s, t, r] - lse[s, r])``.

    Parameters
    ----------
    acc : Tensor or None
        float32 ``[S·T]`` accumulator of the part's entries (entry ``s·T + t``); ``None``: zeros.
    logits : Tensor
        float32 ``[S, T, R]`` scaled logits of every entry of each head ``s`` for its ``R`` query rows (the GQA
        group's heads times the queries); ``-inf`` where an entry is not seen.
    lse : Tensor
        float32 ``[S, R]`` log-sum-exp of each row over the whole cache (a row that saw nothing is ``-inf``).

    Returns
    -------
    Tensor
        float32 ``[S·T]``: the attention probabilities summed over the rows, added to ``acc``.
    """
    p = torch.exp(logits - lse[:, None, :]).nan_to_num_(0.0).sum(-1).reshape(-1)
    return p if acc is None else acc + p
