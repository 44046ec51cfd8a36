"""Decode attention v2 over KIVI-style packed codes: the *folded* formulation, agreeing with attention over the
dequantized cache within a stated tolerance instead of bit for bit (issue 43; contract in ``docs/protocols.md``).

A cache is described by :class:`PackedKIVI`, the buffers of KIVI's decode layout
(:class:`kv_baselines.quant.kivi_decode.DecodeState`, no conversion) as plain tensors: per head ``s``

* keys quantized per channel within groups of ``G`` tokens: token-inner codes ``kc uint8 [S, P, capacity]`` (byte
  ``p`` of token ``t`` holds channels ``p * L .. p * L + L - 1``, ``L = 8 // kbits`` little-endian lanes), scales
  and zeros ``ks, kz [S, D, groups]``; entries ``t < tk`` are quantized, ``tk <= t < tk + nr`` are the full-precision
  residual rows ``kr [S, rows, D]``;
* values quantized per token in channel groups of ``GV``: codes ``vc uint8 [S, P, capacity]``, scales and zeros
  ``vs, vz [S, D / GV, capacity]``; entries ``t < tv`` are quantized, the others are the FIFO ring ``ring [S, rows,
  D]`` (entry ``t`` in slot ``(t - tv + head) mod nv``).

The folded formulation (as the KIVI, QServe and Marlin kernels compute), for the quantized entries:

* **keys**: ``q · k_t = Σ_d (q_d s_dg) c_td + Σ_d q_d z_dg`` for ``t`` in group ``g``: the group's scales are folded
  into the query (``q ⊙ s_g``, as two float16 parts: the matrix-unit operands) and its zeros into one bias per group
  (``q · z_g``), so the inner product multiplies raw codes;
* **values**: ``Σ_t p_t v_td = Σ_t (p_t s_tc) c_td + Σ_t p_t z_tc`` for channel ``d`` in group ``c``: each token's
  scale is folded into its probability (``p ⊙ s_c``, rounded to float16) and the zeros into one correction per
  channel group and query row.

:func:`kivi_decode_v2_ref` computes exactly that in PyTorch (float32, with the two float16 roundings of the matrix
operands the kernel makes); :func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton` is the Triton kernel of
the same signature; :func:`kivi_decode_v2` picks one. :func:`dequantized` gives the dense entries ``read()``-style
(``zero + code * scale`` in float32 rounded to the cache dtype), the reference the tolerance is stated against
(:data:`OUT_RTOL`, :data:`LSE_ATOL`, :func:`contract_errors`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcodec.kernels.dispatch import use_triton

OUT_RTOL = 2e-3
"""Contract, output: per query row, ``‖out - out_ref‖ / ‖out_ref‖ ≤ OUT_RTOL`` against attention over the codes
dequantized in float32, and ``≤ OUT_RTOL + 2 e_out`` against attention over ``read()``'s entries, ``e_out`` the row's
error of ``read()``'s own rounding to the cache dtype (:func:`contract_errors`; ``docs/protocols.md``)."""
LSE_ATOL = 1e-3
"""Contract, log-sum-exp: per query row, ``|lse - lse_ref| ≤ LSE_ATOL`` (float32 dequantization), ``≤ LSE_ATOL +
2 e_lse`` (``read()``)."""
FLOOR = 1e-2
"""Rows whose reference output norm is below this times the RMS row norm (a near-cancelling average) are measured
against that floor instead of their own norm (:func:`row_errors`)."""


@dataclass(frozen=True)
class PackedKIVI:
    """One layer's KIVI cache in the decode layout (module docstring). Tensors are the layout's own buffers (their
    capacity may exceed the counts); ``kbits``/``vbits`` are 1, 2, 4 or 8, ``group`` the keys' token group ``G``,
    ``vgroup`` the values' channel group ``GV`` (dividing ``D``)."""

    kc: torch.Tensor
    ks: torch.Tensor
    kz: torch.Tensor
    kr: torch.Tensor
    vc: torch.Tensor
    vs: torch.Tensor
    vz: torch.Tensor
    ring: torch.Tensor
    tk: int
    nr: int
    tv: int
    nv: int
    head: int
    kbits: int
    vbits: int
    group: int
    vgroup: int

    @property
    def S(self) -> int:
        return self.kc.shape[0]

    @property
    def D(self) -> int:
        return self.kr.shape[-1]

    @property
    def length(self) -> int:
        """Entries per head."""
        return self.tk + self.nr

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype (of the full-precision rows)."""
        return self.kr.dtype

    @classmethod
    def of_state(cls, state) -> PackedKIVI:
        """The buffers of a :class:`kv_baselines.quant.kivi_decode.DecodeState` (duck-typed; views, no copy)."""
        return cls(
            kc=state.kc, ks=state.ks, kz=state.kz, kr=state.kr, vc=state.vc, vs=state.vs, vz=state.vz,
            ring=state.ring, tk=state.tk, nr=state.nr, tv=state.tv, nv=state.nv, head=state.head,
            kbits=state.kinfo[0].bits, vbits=state.vinfo[0].bits, group=state.kinfo[1],
            vgroup=state.vinfo[0].group_size,
        )  # fmt: skip


def unpack_token_inner(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """float32 ``[S, P * L, n]`` codes (channel ``p * L + lane``) of the first ``n`` tokens of token-inner bytes."""
    S, P, _ = packed.shape
    L = 8 // bits
    shifts = torch.arange(L, device=packed.device, dtype=torch.int32) * bits
    b = packed[:, :, None, :n].to(torch.int32)
    return ((b >> shifts.view(1, 1, L, 1)) & ((1 << bits) - 1)).reshape(S, P * L, n).float()


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        return x
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype).float()


def dequantized(cache: PackedKIVI, rounded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(keys, values) [S, T, D]`` of every entry in entry order, the quantized ones as ``read()`` gives them
    (``zero + code * scale`` in float32, rounded to the cache dtype; left in float32 where not ``rounded``)."""
    S, D, T = cache.S, cache.D, cache.length
    G = cache.group
    dtype = cache.dtype if rounded else torch.float32
    keys = torch.empty(S, T, D, device=cache.kc.device)
    vals = torch.empty(S, T, D, device=cache.kc.device)
    if cache.tk:
        c = unpack_token_inner(cache.kc, cache.tk, cache.kbits)  # [S, D, tk]
        nG = cache.tk // G
        s = cache.ks[:, :, :nG].float().repeat_interleave(G, -1)
        z = cache.kz[:, :, :nG].float().repeat_interleave(G, -1)
        keys[:, : cache.tk] = _round(z + c * s, dtype).transpose(1, 2)
    keys[:, cache.tk :] = cache.kr[:, : cache.nr].float()
    if cache.tv:
        c = unpack_token_inner(cache.vc, cache.tv, cache.vbits)  # [S, D, tv]
        s = cache.vs[:, :, : cache.tv].float().repeat_interleave(cache.vgroup, 1)
        z = cache.vz[:, :, : cache.tv].float().repeat_interleave(cache.vgroup, 1)
        vals[:, : cache.tv] = _round(z + c * s, dtype).transpose(1, 2)
    if cache.nv:
        vals[:, cache.tv :] = cache.ring[:, : cache.nv].float().roll(-cache.head, 1)
    return keys, vals


def attention_over_dequantized(query: torch.Tensor, cache: PackedKIVI, scale: float, rounded: bool = True):
    """``(out float32 [S, M, D], lse float32 [S, M, 1])``: plain float32 attention over :func:`dequantized` entries
    (``rounded``: as ``read()`` hands them out, the contract's reference)."""
    k, v = dequantized(cache, rounded)
    logits = torch.bmm(query.float() * scale, k.transpose(1, 2))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    return torch.bmm(torch.exp(logits - lse), v), lse


def row_errors(out, lse, ref_out, ref_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row ``[S, M]``: the output's relative error (L2 over the head dim; the reference's norm floored at
    :data:`FLOOR` times its RMS norm over all rows, as a near-cancelling average makes a relative error
    ill-conditioned) and the lse's absolute error."""
    out, ref_out = out.float(), ref_out.float()
    norm = ref_out.norm(dim=-1)
    floor = FLOOR * float(norm.pow(2).mean().sqrt()) if norm.numel() else 0.0
    rel = (out - ref_out).norm(dim=-1) / norm.clamp_min(max(floor, 1e-30))
    return rel, (lse.float() - ref_lse.float()).abs().view(rel.shape)


def contract_errors(out, lse, query: torch.Tensor, cache: PackedKIVI, scale: float) -> dict[str, float]:
    """How far ``(out, lse)`` of ``query`` over ``cache`` is from the contract (``docs/protocols.md``): the largest
    ratio, over query rows, of the error against attention over ``read()``'s entries to the allowance
    ``OUT_RTOL + 2 e_out`` / ``LSE_ATOL + 2 e_lse``, where ``e`` is the row's own error of ``read()``'s rounding
    (attention over ``read()`` against attention over the same codes dequantized in float32); ``<= 1`` meets it. The
    worst errors against ``read()`` (``out``, ``lse``) and against the float32 dequantization (``out_f32``,
    ``lse_f32``, to be within ``OUT_RTOL`` / ``LSE_ATOL``)."""
    ref = attention_over_dequantized(query, cache, scale)
    exact = attention_over_dequantized(query, cache, scale, rounded=False)
    rel, dl = row_errors(out, lse, *ref)
    frel, fdl = row_errors(*exact, *ref)
    xrel, xdl = row_errors(out, lse, *exact)

    def worst(t):
        return float(t.max()) if t.numel() else 0.0

    return {
        "out_ratio": worst(rel / (OUT_RTOL + 2 * frel)),
        "lse_ratio": worst(dl / (LSE_ATOL + 2 * fdl)),
        "out": worst(rel),
        "lse": worst(dl),
        "out_f32": worst(xrel),
        "lse_f32": worst(xdl),
    }


def within_tolerance(out, lse, ref_out, ref_lse) -> tuple[float, float]:
    """``(worst output relative error, worst lse absolute error)`` over query rows (:func:`row_errors`)."""
    rel, dl = row_errors(out, lse, ref_out, ref_lse)
    return (float(rel.max()), float(dl.max())) if rel.numel() else (0.0, 0.0)


def kivi_decode_v2_ref(query: torch.Tensor, cache: PackedKIVI, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [S, M, D], lse float32 [S, M, 1])`` of ``query [S, M, D]`` (the ``M`` query rows of each KV
    head) over ``cache`` in the folded formulation (module docstring): PyTorch, any device, the reference of the
    Triton kernel. The folded operands are rounded as the kernel's matrix units take them: ``q ⊙ s_g`` to two float16
    parts (hi + lo), ``p ⊙ s_c`` to one; the full-precision rows enter in float32."""
    qs = query.float() * scale
    S, M, D = qs.shape
    tk, nr, tv, G = cache.tk, cache.nr, cache.tv, cache.group
    parts = []
    if tk:
        nG = tk // G
        c = unpack_token_inner(cache.kc, tk, cache.kbits).view(S, D, nG, G)
        s, z = cache.ks[:, :, :nG].float(), cache.kz[:, :, :nG].float()  # [S, D, nG]
        qf = qs[:, :, None, :] * s.transpose(1, 2)[:, None]  # [S, M, nG, D]
        qh = qf.half().float()
        qh += (qf - qh).half().float()  # two float16 parts, as the kernel's two products take them
        lk = torch.einsum("smgd,sdgt->smgt", qh, c) + torch.bmm(qs, z)[..., None]
        parts.append(lk.reshape(S, M, tk))
    if nr:
        parts.append(torch.bmm(qs, cache.kr[:, :nr].float().transpose(1, 2)))
    logits = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    mx = logits.amax(-1, keepdim=True)
    e = torch.exp(logits - mx)
    total = e.sum(-1, keepdim=True)
    out = torch.zeros(S, M, D, device=qs.device)
    if tv:
        GV = cache.vgroup
        C = D // GV
        c = unpack_token_inner(cache.vc, tv, cache.vbits).view(S, C, GV, tv)
        s, z = cache.vs[:, :, :tv].float(), cache.vz[:, :, :tv].float()  # [S, C, tv]
        eq = e[..., :tv]
        ph = (eq[:, None] * s[:, :, None]).half().float()  # [S, C, M, tv]
        oc = torch.einsum("scmt,scgt->smcg", ph, c).reshape(S, M, D)
        oz = torch.bmm(eq, z.transpose(1, 2))  # [S, M, C]
        out += oc + oz.repeat_interleave(GV, -1)
    if cache.nv:
        ring = cache.ring[:, : cache.nv].float().roll(-cache.head, 1)
        out += torch.bmm(e[..., tv:], ring)
    return out / total, torch.log(total) + mx


def kivi_decode_v2(query: torch.Tensor, cache: PackedKIVI, scale: float, **kernel_options):
    """The Triton kernel (:func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton`) for CUDA caches of the
    shapes it takes (:func:`~kvcodec.kernels.triton_decode_v2.supported`), else :func:`kivi_decode_v2_ref`."""
    if use_triton(cache.kc):
        from kvcodec.kernels import triton_decode_v2 as kernel

        if kernel.supported(cache):
            return kernel.kivi_decode_v2_triton(query, cache, scale, **kernel_options)
    return kivi_decode_v2_ref(query, cache, scale)
