"""Triton kernel: decode attention v2 over a *paged* KIVI cache (vLLM's block pool and block table, issue 43).

Same contract and signature as :func:`kvcodec.decode_v2.paged_decode_reference` (its PyTorch reference): agreement
with attention over the dequantized cache within ``docs/protocols.md``'s tolerance. The layout is
:class:`kvcodec.decode_v2.PagedPackedKIVI`: packed blocks of ``N`` tokens in a pool, a block table per sequence and
the open block at full precision.

The arithmetic is the contiguous kernel's (:mod:`kvcodec.kernels.triton_decode_v2`), through the same
``@triton.jit`` helpers: every packed block is ``N / BLOCK_T`` tiles of the folded path (:func:`_folded_tile`:
logits from the raw key codes with the group's scales folded into the query, the values' scales folded into the
probabilities, code bytes turned into float16 operands by their bits), the open block goes through the
full-precision products (:func:`_full_key_logits`, :func:`_full_value_step`), and the store is
:func:`_store_split`. A packed block never needs a mask: it is complete (``N`` quantized keys and values), and one
tile lies inside one key group (``BLOCK_T`` divides ``G``, ``G`` divides ``N``).

Program grid ``(B * H, splits)``: program ``(b * H + h, sp)`` walks the ``BLOCKS`` (compile-time) logical blocks
``sp * BLOCKS .. sp * BLOCKS + BLOCKS - 1`` of sequence ``b`` for KV head ``h``: block ``j < n_b`` is read from pool
block ``block_table[b, j]`` (one scalar load per block), ``j == n_b`` is the open block, later ones are skipped (a
run-time branch; the loop bounds are compile-time). The splits cover the table's width plus the open block
(``max_blocks + 1``, no device sync for the sequences' lengths) and are merged by log-sum-exp
(:func:`kvcodec.kernels.triton_attention.merge_splits`); a split that saw nothing has ``lse = -inf``. This module
needs ``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.triton_attention import merge_splits, split_plan
from kvcodec.kernels.triton_decode_v2 import (
    _folded_tile,
    _full_key_logits,
    _full_value_step,
    _load_query,
    _pow2,
    _store_split,
    lane_channel,
)
from kvcodec.kernels.triton_dot import _weights, dot_mode


@triton.jit(
    do_not_specialize=["s_tab"]
)  # the pool's strides are fixed for an engine's life: specialised (vector loads)
def _paged_decode_v2_kernel(
    q_ptr, outp_ptr, lsep_ptr, table_ptr, lens_ptr, tails_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr,
    s_tab, s_kcb, s_kch, s_kcp, s_kpb, s_kph, s_kpc, s_vcb, s_vch, s_vcp, s_vpb, s_vph, s_vpc, s_tlb, s_tlh,
    H, M, scale,
    D: tl.constexpr, N: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, MB: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCKS: tl.constexpr, TAIL_TILES: tl.constexpr, KBITS: tl.constexpr,
    VBITS: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, KSPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    KP: tl.constexpr = D // (8 // KBITS)
    VP: tl.constexpr = D // (8 // VBITS)
    C: tl.constexpr = D // GV
    CR: tl.constexpr = ROWS // MB
    r = tl.arange(0, ROWS)
    mrow = r % MB  # row (c, m) = c * MB + m: query row m, value channel group c
    crow = r // MB
    qok = mrow < M
    kp = tl.arange(0, KP)
    vp = tl.arange(0, VP)
    dd = tl.arange(0, D)
    kch = lane_channel(dd, KBITS)  # the channel of each row of the key operand (code_rows order)
    vch = lane_channel(dd, VBITS)
    tt = tl.arange(0, BLOCK_T)
    qk = _load_query(q_ptr, pid.to(tl.int64) * M, M, kch, D, MB)
    acc = tl.zeros([ROWS, D], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    zs = tl.zeros([ROWS], tl.float32)
    nt = tl.load(tails_ptr + b)
    nblk = (tl.load(lens_ptr + b) - nt) // N  # packed blocks of the sequence; block nblk is the open one
    base_t = b64 * s_tlb + h64 * s_tlh
    for blk in range(BLOCKS):
        j = sp * BLOCKS + blk
        if j < nblk:  # a packed block: N / BLOCK_T tiles of the folded path, no mask
            bid = tl.load(table_ptr + b64 * s_tab + j).to(tl.int64)
            base_kc = bid * s_kcb + h64 * s_kch
            base_kp = bid * s_kpb + h64 * s_kph
            base_vc = bid * s_vcb + h64 * s_vch
            base_vp = bid * s_vpb + h64 * s_vph
            for i in tl.static_range(N // BLOCK_T):
                m_i, l_i, acc, zs = _folded_tile(
                    qk, m_i, l_i, acc, zs, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, base_kc, base_kp,
                    base_vc, base_vp, kp, kch, vp, i * BLOCK_T + tt, (i * BLOCK_T) // G, s_kcp, s_kpc, s_vcp, s_vpc,
                    scale, C, CR, MB, BLOCK_T, KBITS, VBITS, HALF, ASM, KSPLIT,
                )  # fmt: skip
        elif j == nblk:  # the open block: full-precision rows 0 .. nt - 1
            for i in tl.static_range(TAIL_TILES):
                rows = i * BLOCK_T + tt
                live = rows < nt
                logits = _full_key_logits(qk, tk_ptr, base_t, rows, live, kch, scale, D, CR, DOT)
                logits = tl.where(live[None, :], logits, float("-inf"))
                m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
                acc = _full_value_step(acc * alpha[:, None], p, tv_ptr, base_t, rows, live, vch, D, DOT)
                zs = zs * alpha
                m_i = m_new
    _store_split(outp_ptr, lsep_ptr, (pid.to(tl.int64) * tl.num_programs(1) + sp) * M, acc, zs, m_i, l_i, mrow, crow,
                 qok, vch, D, GV)  # fmt: skip


def supported(cache) -> bool:
    """Whether the kernel takes a :class:`~kvcodec.decode_v2.PagedPackedKIVI`: float16 or bfloat16 open block,
    power-of-two head dim, key group ``G >= 16`` and value group powers of two, at least 16 code bytes per token and
    side (the products' inner dimension).

    Parameters
    ----------
    cache : PagedPackedKIVI
        The paged cache.

    Returns
    -------
    bool
        ``True`` when :func:`paged_decode_v2_triton` takes it.
    """
    D = cache.D
    return (
        cache.dtype in (torch.float16, torch.bfloat16)
        and _pow2(D)
        and all(D // (8 // b) >= 16 for b in (cache.kbits, cache.vbits))
        and _pow2(cache.group)
        and cache.group >= 16
        and _pow2(cache.vgroup)
    )


def paged_decode_v2_triton(
    query: torch.Tensor,
    cache,
    scale: float,
    *,
    block_t: int | None = None,
    blocks_per_split: int | None = None,
    num_warps: int = 4,
    tensor_cores: bool | None = None,
    asm: bool | None = None,
    key_split: bool = True,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kvcodec.decode_v2.paged_decode_reference`: decode attention v2 over a paged cache.

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, D]``, ``Hq = H * M`` (query head ``h * M + m`` reads KV head ``h``).
    cache : PagedPackedKIVI
        The paged cache.
    scale : float
        The softmax scale.
    block_t : int, optional
        Entries per tile: a power of two ``>= 16`` dividing the key group (default ``min(G, 32)``).
    blocks_per_split : int, optional
        Logical blocks per program (default from :func:`~kvcodec.kernels.triton_attention.split_plan`).
    num_warps : int
        Warps per program.
    tensor_cores : bool, optional
        float16 operands on the matrix units (default: on CUDA) or their values in IEEE float32.
    asm : bool, optional
        The inline-PTX code conversion (default: on CUDA) or its plain-Triton twin.
    key_split : bool
        The folded query as two float16 parts (the contract needs it; as the contiguous kernel).
    check : bool
        Check the cache's contents first (:meth:`~kvcodec.decode_v2.PagedPackedKIVI.check_values`: a device sync);
        unchecked, a block id outside the pool or a length beyond the table reads out of bounds.

    Returns
    -------
    out : torch.Tensor
        float32 ``[B, Hq, D]``.
    lse : torch.Tensor
        float32 ``[B, Hq, 1]`` (``-inf`` for an empty sequence).

    Raises
    ------
    ValueError
        A cache the kernel does not take (:func:`supported`), a bad ``block_t``, strides it cannot read, or (with
        ``check``) contents :meth:`~kvcodec.decode_v2.PagedPackedKIVI.check_values` refuses.
    TypeError
        As :func:`~kvcodec.decode_v2.check_paged_query`.
    """
    M = cache.check_query(query, scale)
    if not supported(cache):
        raise ValueError(
            "paged_decode_v2_triton needs a float16/bfloat16 cache, a power-of-two head dim, key group >= 16 and "
            f"value group, >= 16 code bytes per token; got dtype {cache.dtype}, D={cache.D}, G={cache.group}, "
            f"GV={cache.vgroup}, bits {cache.kbits}/{cache.vbits} (kvcodec.decode_v2.paged_decode_reference takes any)"
        )
    if check:
        cache.check_values()
    B, H, D, N, G = cache.B, cache.H, cache.D, cache.block_size, cache.group
    dev = query.device
    if B * H * M == 0:
        out = torch.zeros(B, H * M, D, dtype=torch.float32, device=dev)
        return out, torch.full((B, H * M, 1), float("-inf"), dtype=torch.float32, device=dev)
    bt = min(G, block_t if block_t is not None else 32)
    if bt < 16 or not _pow2(bt):
        raise ValueError(f"block_t must be a power of two >= 16 dividing the key group {G}, got {block_t!r}")
    virtual = cache.block_table.shape[1] + 1  # the table's blocks and the open one
    if blocks_per_split is None:
        _, tiles, _ = split_plan(virtual * N, B * H, bt)
        blocks_per_split = max(1, tiles * bt // N)
    if isinstance(blocks_per_split, bool) or not isinstance(blocks_per_split, int) or blocks_per_split < 1:
        raise ValueError(f"blocks_per_split must be an int >= 1, got {blocks_per_split!r}")
    nsplit = triton.cdiv(virtual, blocks_per_split)
    half = query.is_cuda if tensor_cores is None else bool(tensor_cores)
    asm = query.is_cuda if asm is None else bool(asm)
    MB = triton.next_power_of_2(M)
    rows = max(16, (D // cache.vgroup) * MB)
    kc, ks, kz, vc, vs, vz = cache.kc, cache.ks, cache.kz, cache.vc, cache.vs, cache.vz
    for name, t in (("kc", kc), ("ks", ks), ("kz", kz), ("vc", vc), ("vs", vs), ("vz", vz)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if ks.stride() != kz.stride() or vs.stride() != vz.stride():
        raise ValueError("scales and zeros must share their strides")
    tail_k, tail_v = cache.tail_k, cache.tail_v
    for name, t in (("tail_k", tail_k), ("tail_v", tail_v)):
        if t.shape[2] > 1 and (t.stride(2) != D or t.stride(3) != 1):
            raise ValueError(f"{name} rows must be contiguous")
    if tail_k.stride()[:2] != tail_v.stride()[:2]:
        raise ValueError("tail_k and tail_v must share their strides")
    q = query.contiguous()
    table = cache.block_table.to(dev)
    lens = cache.seq_lens.to(dev)
    tails = cache.tail_lens.to(dev)
    dot = dot_mode(q, (cache.dtype,), True) if half and q.dtype == cache.dtype else 0
    outp = torch.empty(B * H, nsplit, M, D, dtype=torch.float32, device=dev)
    lsep = torch.empty(B * H, nsplit, M, dtype=torch.float32, device=dev)
    _paged_decode_v2_kernel[(B * H, nsplit)](
        q, outp, lsep, table, lens, tails, kc, ks, kz, vc, vs, vz, tail_k, tail_v,
        table.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        tail_k.stride(0), tail_k.stride(1),
        H, M, float(scale),
        D=D, N=N, G=G, GV=cache.vgroup, MB=MB, ROWS=rows, BLOCK_T=bt, BLOCKS=blocks_per_split,
        TAIL_TILES=max(1, triton.cdiv(tail_k.shape[2], bt)), KBITS=cache.kbits, VBITS=cache.vbits, DOT=dot,
        HALF=half, ASM=asm, KSPLIT=key_split, num_warps=num_warps,
    )  # fmt: skip
    out, lse = merge_splits(outp, lsep, num_warps)
    return out.view(B, H * M, D), lse.view(B, H * M, 1)
