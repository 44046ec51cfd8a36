"""PyTorch references of HEX's kernels (the CPU path; the definition the Triton kernels are tested against)."""

from __future__ import annotations

import torch

from kvcodec.stats import minmax_scale, minmax_stats, scale_dtype_for

__all__ = ["attention_column_sums", "decode_attention", "kcvt_codes"]


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
    a time, so memory is ``O(chunk · T)``, never the ``T × T`` matrix.
    """
    B, Hq, W, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    G = Hq // H
    k = keys.float()
    qg = queries.float().reshape(B, H, G, W, D)
    pad = ~valid[:, None, None, None, :]
    idx = torch.arange(T, device=keys.device)
    total = torch.zeros(B, H, T, device=keys.device)
    for s in range(0, W, chunk):
        e = min(W, s + chunk)
        logits = torch.einsum("bhgwd,bhtd->bhgwt", qg[:, :, :, s:e], k) * scale
        future = idx[None, :] > torch.arange(T - W + s, T - W + e, device=keys.device)[:, None]
        logits = logits.masked_fill(future | pad, float("-inf"))
        total += torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(2, 3))
    return total


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, Q, D]`` over ``keys/values [B, Hkv, T, D]`` with additive ``bias [B, Hkv, T]``.

    Returns ``(out fp32 [B, Hq, Q, D], lse fp32 [B, Hq, Q], column sums fp32 [B, Hkv, T])``: the last is the
    attention probability each entry received, summed over the queries and the query heads of its GQA group
    (what HEX's heavy-hitter accumulator adds at every decode step, §3.3). A head with no entry gives ``out = 0``,
    ``lse = -inf`` and zero sums.
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
