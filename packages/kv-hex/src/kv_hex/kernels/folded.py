"""Decode attention v2 over HEX's uniform segments: the *folded* formulation of :mod:`kvcodec.decode_v2` (issue 43),
read from :class:`kv_hex.uniform.UniformPart` (the CUDA decode layout) in place.

Does HEX's layout allow it? Yes, on both sides, with one correction term per overlay element:

* **keys** are KCVT per channel over the *whole segment* (``k_scale/k_zero [S, D]``: one parameter row per head and
  segment, a special case of KIVI's per-channel groups with ``G = n``), so ``q · k_t = Σ_d (q_d s_d) c_td + q · z``
  folds as KIVI's: the scales into the query (two float16 parts), the zeros into one bias per query row;
* **values** are KCVT per token over its channels (``value_scope="layer"``: all of the token's heads; ``"head"``:
  one head), so one scale and one zero per entry: ``Σ_t p_t v_td = Σ_t round16(p_t s_t) c_td + Σ_t p_t z_t`` (the
  zero correction is one scalar per query row, not one per channel group);
* **3-bit codes** are packed densely (kvcodec: 8 codes in 3 bytes, little-endian bit stream), so codes 2 and 5 of a
  chunk straddle a byte. No bit-plane unpack is needed: the chunk's three bytes are assembled into one 24-bit word
  (two shifts, two ORs per 8 codes), after which every lane is a fixed bit field of that word and the exponent-bias
  trick applies per lane: ``((w >> 3j) & 7) | 0x6400`` is ``1024 + code`` as a float16, one subtraction gives the code
  exactly -- one shift more per code than 4 bits, no int -> float conversion. 2 / 4 bits take the same path (8 codes
  in 2 / 4 bytes), 8 bits the byte itself;
* the **expander overlay** (a few elements of a coded entry held in full precision at channels fixed by the static
  mask) is additive: where the code tile says ``s c + z`` the entry holds ``o``, so each overlay element adds
  ``δ = o - (s c + z)``. Keys: ``q_c · δ`` to the logit, a *sparse* correction (``W`` gathers of the query per tile,
  ``W`` the largest overlay count of a (slot, head)); values: ``p_t δ`` to output channel ``c``, a scatter that is
  formed as a dense ``[T, D]`` tile of the ``δ`` (``W`` selects per element) and one more matrix product
  (``round16(p) · round16(Δ)``);
* **full-precision entries** (heavy hitters, the recent window) sit anywhere in a tile: their logits and values are
  taken from the full rows under masks, as the current kernel does; the folded terms are masked off for them.

So the folded form applies to everything but the overlay, which costs ``W`` sparse steps for keys and ``W`` dense
selects for values per tile (the current kernel pays ``W`` dense selects on both sides).

:func:`uniform_decode_v2_ref` is the PyTorch reference (float32, with the kernel's float16 roundings of the matrix
operands), same signature and results as :func:`kv_hex.kernels.reference.uniform_attention` (up to the contract);
:func:`kv_hex.kernels.triton_folded.uniform_decode_v2_triton` is the Triton kernel; :func:`uniform_decode_v2` picks
one. :func:`contract_errors` measures a result against ``docs/protocols.md``'s tolerance contract
(:data:`kvcodec.decode_v2.OUT_RTOL`, :data:`~kvcodec.decode_v2.LSE_ATOL`) over the entries as ``read()`` gives them.
"""

from __future__ import annotations

import torch

from kvcodec.decode_v2 import LSE_ATOL, OUT_RTOL, contract_summary
from kvcodec.packing import unpack_unchecked

__all__ = [
    "LSE_ATOL",
    "OUT_RTOL",
    "attention_over_dequantized",
    "contract_errors",
    "dense_part",
    "uniform_decode_v2",
    "uniform_decode_v2_ref",
]


def _split16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the sum of two float16 parts (hi + lo), as the kernel's two products take it."""
    hi = x.half().float()
    return hi + (x - hi).half().float()


def dense_part(part) -> dict[str, torch.Tensor]:
    """The entries of a :class:`~kv_hex.uniform.UniformPart` as dense float32 tensors over ``[N, D]`` (entry ``e =
    s·n + t``): ``full [N]`` bool, key / value ``codes`` (0 at full entries), per-entry key parameters ``ks/kz [N, D]``
    and value parameters ``vs/vz [N]`` (0 at full entries), the overlay mask ``om [N, D]`` (coded entries only) and
    its values ``ko/vo [N, D]``, and the full rows ``kf/vf [N, D]`` (0 at coded entries)."""
    B, H, D, n, bits = part.B, part.H, part.D, part.n, part.bits
    N = B * H * n
    dev = part.before.device
    full = unpack_unchecked(part.flags[None], 1, N)[0].bool()
    quant = ~full
    e = torch.arange(N, device=dev)
    t = e % n
    sx = e // n
    h = sx % H
    r = e - part.before[0].long()  # code row (coded entries)
    out = {"full": full}
    for side in ("k", "v"):
        codes = torch.zeros(N, D, device=dev)
        codes[quant] = unpack_unchecked(getattr(part, f"{side}_codes"), bits, D).float()
        out[f"{side}c"] = codes
        rows = torch.zeros(N, D, device=dev)
        rows[full] = getattr(part, f"{side}_rows").float()
        out[f"{side}f"] = rows
    ks = part.k_scale.float().reshape(-1, D)[sx] * quant[:, None]
    kz = part.k_zero.float().reshape(-1, D)[sx] * quant[:, None]
    vidx = (sx // H) * n + t if part.value_layer else r.clamp(min=0)
    vs = torch.where(quant, part.v_scale.float()[vidx.clamp(max=max(part.v_scale.numel() - 1, 0))], 0.0)
    vz = torch.where(quant, part.v_zero.float()[vidx.clamp(max=max(part.v_zero.numel() - 1, 0))], 0.0)
    out.update(ks=ks, kz=kz, vs=vs, vz=vz)
    om = torch.zeros(N, D, dtype=torch.bool, device=dev)
    ko = torch.zeros(N, D, device=dev)
    vo = torch.zeros(N, D, device=dev)
    W = part.hcols.shape[-1]
    if W:
        cols = part.hcols.long()[t, h]  # [N, W]
        ok = (cols >= 0) & quant[:, None]
        ei, j = ok.nonzero(as_tuple=True)
        off = part.before[1].long()[ei] + j
        om[ei, cols[ei, j]] = True
        ko[ei, cols[ei, j]] = part.k_over.float()[off]
        vo[ei, cols[ei, j]] = part.v_over.float()[off]
    out.update(om=om, ko=ko, vo=vo)
    return out


def _dequantized(dp: dict, dtype: torch.dtype, rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[N, D]`` keys and values as ``read()`` gives them (``rounded``: the codes' ``c · s + z`` rounded to the
    cache dtype) or in float32."""
    k = dp["kc"] * dp["ks"] + dp["kz"]
    v = dp["vc"] * dp["vs"][:, None] + dp["vz"][:, None]
    if rounded:
        k, v = k.to(dtype).float(), v.to(dtype).float()
    k = torch.where(dp["om"], dp["ko"], k)
    v = torch.where(dp["om"], dp["vo"], v)
    full = dp["full"][:, None]
    return torch.where(full, dp["kf"], k), torch.where(full, dp["vf"], v)


def _heads(x: torch.Tensor, call, B: int) -> torch.Tensor:
    """``[N, ...]`` entries of a call's part as ``[B·H, m·n, ...]``: query head ``s = b·H + h`` sees segment
    ``i``'s head ``(i·B + b)·H + h`` (a stack of ``m``), segment after segment."""
    m, H, n = call.stack, call.part.H, call.part.n
    return x.reshape(m, B * H, n, *x.shape[1:]).transpose(0, 1).reshape(B * H, m * n, *x.shape[1:])


def _unheads(x: torch.Tensor, call, B: int) -> torch.Tensor:
    """Inverse of :func:`_heads` for ``[B·H, m·n, R]`` logits: back to entry order ``[N, R]``."""
    m, H, n = call.stack, call.part.H, call.part.n
    return x.reshape(B * H, m, n, -1).transpose(0, 1).reshape(m * B * H * n, -1)


def _logits_and_values(query, calls, scale, folded: bool, rounded: bool = True):
    """Per call: ``(segment logits [S, R, m·n] or None, residual logits [S, R, T_r] or None)`` and a function of the
    probabilities giving the call's output contribution ``[S, R, D]``."""
    B, Hq, Q, D = query.shape
    H = calls[0].part.H
    S, R = B * H, Hq // H * Q
    qf = query.float().reshape(B, H, R, D).reshape(S, R, D)
    qs = qf * scale
    res = []
    for call in calls:
        part = call.part
        dp = dense_part(part)
        if folded:
            kc, vc = _heads(dp["kc"], call, B), _heads(dp["vc"], call, B)
            ks, kz = _heads(dp["ks"], call, B), _heads(dp["kz"], call, B)
            vs, vz = _heads(dp["vs"], call, B), _heads(dp["vz"], call, B)
            om = _heads(dp["om"], call, B)
            full = _heads(dp["full"], call, B)
            kf, vf = _heads(dp["kf"], call, B), _heads(dp["vf"], call, B)
            # keys: round16-split (q ⊙ s) · code + q · z + Σ_overlay q_c (o - s c - z); full rows as they are
            qsk = _split16(qs[:, :, None, :] * ks[:, None])  # [S, R, T, D]
            lg = (qsk * kc[:, None]).sum(-1) + torch.einsum("srd,std->srt", qs, kz)
            dk = torch.where(om, _heads(dp["ko"], call, B) - ks * kc - kz, 0.0)
            lg = lg + torch.einsum("srd,std->srt", qs, dk)
            lg = torch.where(full[:, None], torch.einsum("srd,std->srt", qs, kf), lg)
            dv = torch.where(om, _heads(dp["vo"], call, B) - vs[..., None] * vc - vz[..., None], 0.0)

            def values(p, vc=vc, vs=vs, vz=vz, dv=dv, full=full, vf=vf):
                pq = torch.where(full[:, None], 0.0, p)
                o = ((pq * vs[:, None]).half().float()) @ vc + (pq * vz[:, None]).sum(-1, keepdim=True)
                o = o + pq.half().float() @ dv.half().float()
                return o + torch.where(full[:, None], p, 0.0) @ vf

        else:
            k, v = _dequantized(dp, part.dtype, rounded)
            k, v = _heads(k, call, B), _heads(v, call, B)
            lg = torch.einsum("srd,std->srt", qs, k)

            def values(p, v=v):
                return p @ v

        rlg = None
        if call.res_k is not None and call.res_k.shape[1]:
            rk, rv = call.res_k.float(), call.res_v.float()
            rlg = torch.einsum("srd,std->srt", qs, rk)

            def values_r(p, values=values, rv=rv, n=lg.shape[-1]):
                return values(p[..., :n]) + p[..., n:] @ rv

            res.append((lg, rlg, values_r))
        else:
            res.append((lg, None, values))
    return res, (B, Hq, Q, D, S, R)


def _attend(query, calls, scale, folded: bool, rounded: bool = True):
    res, (B, Hq, Q, D, _, R) = _logits_and_values(query, calls, scale, folded, rounded)
    lgs = [torch.cat([lg] + ([rlg] if rlg is not None else []), -1) for lg, rlg, _ in res]
    mx = torch.stack([x.amax(-1) for x in lgs], 0).amax(0)  # [S, R]
    mx = torch.where(torch.isfinite(mx), mx, 0.0)
    es = [torch.exp(x - mx[..., None]) for x in lgs]
    total = sum(e.sum(-1) for e in es)
    out = sum(vals(e) for e, (_, _, vals) in zip(es, res))
    safe = torch.where(total > 0, total, 1.0)
    lse = torch.where(total > 0, torch.log(safe) + mx, float("-inf"))
    out = (out / safe[..., None]).reshape(B, Hq, Q, D)
    logits = []
    for call, (lg, rlg, _) in zip(calls, res):
        slg = _unheads(lg.transpose(1, 2), call, B) if call.seg_logits else None
        r = None
        if call.res_logits:
            r = rlg.transpose(1, 2).reshape(-1, R) if rlg is not None else torch.zeros(0, R, device=query.device)
        logits.append((slg, r))
    return out, lse.reshape(B, Hq, Q), logits


def uniform_decode_v2_ref(
    query: torch.Tensor, calls: list, scale: float
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """:func:`kv_hex.kernels.reference.uniform_attention` (same arguments and results) in the folded formulation (module
    doc), in PyTorch (any device): the reference of :func:`kv_hex.kernels.triton_folded.uniform_decode_v2_triton`.
    Within the tolerance contract of attention over the dequantized entries (:func:`contract_errors`), not bit for
    bit; the logits (for the heavy-hitter accumulator) are the folded ones."""
    return _attend(query, calls, scale, folded=True)


def attention_over_dequantized(query: torch.Tensor, calls: list, scale: float, rounded: bool = True):
    """``(out [B, Hq, Q, D], lse [B, Hq, Q])`` float32: plain attention over the calls' entries dequantized as
    ``read()`` gives them (``rounded``) or in float32."""
    out, lse, _ = _attend(query, calls, scale, folded=False, rounded=rounded)
    return out, lse


def uniform_decode_v2(query: torch.Tensor, calls: list, scale: float, **kernel_options):
    """The Triton kernel (:func:`kv_hex.kernels.triton_folded.uniform_decode_v2_triton`) on CUDA for the calls it
    takes (:func:`~kv_hex.kernels.triton_folded.supported`), else :func:`uniform_decode_v2_ref`."""
    from kv_hex.kernels import dispatch

    if dispatch.use_triton(query):
        from kv_hex.kernels import triton_folded as kernel

        if kernel.supported(query, calls):
            return kernel.uniform_decode_v2_triton(query, calls, scale, **kernel_options)
    return uniform_decode_v2_ref(query, calls, scale)


def contract_errors(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, calls: list, scale: float) -> dict:
    """:func:`kvcodec.decode_v2.contract_errors` over HEX's uniform calls: the worst ratio over query rows of the error
    against attention over ``read()``'s entries to the allowance ``OUT_RTOL + 2 e_out`` / ``LSE_ATOL + 2 e_lse``
    (``e`` the row's own error of ``read()``'s rounding; ``<= 1`` meets it), and the worst errors against ``read()``
    (``out``, ``lse``) and against the float32 dequantization (``out_f32``, ``lse_f32``: within ``OUT_RTOL`` /
    ``LSE_ATOL``)."""
    D = query.shape[-1]
    out, lse = out.float().reshape(-1, 1, D), lse.float().reshape(-1, 1, 1)
    r_out, r_lse = attention_over_dequantized(query, calls, scale)
    x_out, x_lse = attention_over_dequantized(query, calls, scale, rounded=False)
    ref = (r_out.reshape(-1, 1, D), r_lse.reshape(-1, 1, 1))
    exact = (x_out.reshape(-1, 1, D), x_lse.reshape(-1, 1, 1))
    return contract_summary(out, lse, ref, exact, empty_rows=True)
