"""Triton kernel of SEKV's coarse entries (§3.2, Eq. 2–3): the segmented weighted reduction ``Σ_{t∈S} w_t x_t``.

Same signature and result as :func:`kv_sekv.summaries.coarse_entries_torch` (the PyTorch reference, ``index_add``):
``x [Hkv, n, D]`` keys or values (float32, float16 or bfloat16), ``span_id [n]`` (``−1`` for a resident token),
``weights [n]`` (Eq. 2, :func:`~kv_sekv.summaries.span_weights`) -> float32 ``[Hkv, n_spans, D]``.

Span layout. The segmentation (:func:`~kv_sekv.segmentation.runs_to_spans`, :func:`~kv_sekv.segmentation.split_spans`)
numbers spans in token order and makes each a run of consecutive tokens, but the tokens a caller hands over need not
be: :class:`~kv_sekv.selector.SpanSelector` writes a row's span ids at the positions of its *valid* tokens, so in
padded coordinates (what :class:`~kv_sekv.SEKVStore` passes) a span may enclose padding (``−1``), and a hand-built
``span_id`` may be in any order. So the launcher does not assume runs: on the device it sorts the token indices by
span (a stable ``argsort``: within a span, token order), and counts each span's length and start in that order
(``bincount``, ``cumsum``). For the usual contiguous layout the sort is the identity on the span tokens.

Kernel. One program per (span, KV head, block of ``BLOCK_D`` channels) walks its span's tokens in chunks of
``BLOCK_T`` (gathered through the sorted indices), accumulating ``w_t x_t`` in float32 and storing its slice of the
output once: every output element is written by exactly one program, in a fixed order (no atomics), so the result is
deterministic (bitwise the same run to run; equal to the reference up to float32 summation order). The chunk count
is a compile-time constant (no run-time loop bounds): the chunks covering the longest span, rounded up to a power of
two so few variants compile; a chunk beyond the program's span is skipped by a run-time branch. Masks cover ragged
span lengths and ``D`` not a power of two. The launcher reads the host once per call (the longest span, which fixes
that constant, and the largest span id, checked against ``n_spans``). Tested against the reference under
``TRITON_INTERPRET=1``; GPU speed is unmeasured.
"""

from __future__ import annotations

import torch

from kvcodec.kernels.alignment import rows_aligned
from kvcore.checks import check_power_of_two

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "coarse_entries_triton", "span_layout"]

if HAS_TRITON:
    # a head's stride (n · D) and the span count change with every sequence: not specialised
    @triton.jit(do_not_specialize=["sxh", "M"])
    def _coarse_entries_kernel(
        x_ptr,
        w_ptr,
        order_ptr,
        start_ptr,
        len_ptr,
        o_ptr,
        sxh,
        sxt,
        sxd,
        M,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        CHUNKS: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        """Program (span s, head h, channel block j): ``out[h, s, j·BLOCK_D : (j+1)·BLOCK_D]`` = the sum over the
        span's ``len[s]`` tokens ``order[start[s] : start[s] + len[s]]`` of ``w_t · x[h, t, ·]`` in float32."""
        if ALIGNED:  # the host checked the head stride is a multiple of 16: rows then load as vectors
            sxh = sxh // 16 * 16
        s = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        dmask = d < D
        start = tl.load(start_ptr + s)
        length = tl.load(len_ptr + s)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for i in range(CHUNKS):
            if i * BLOCK_T < length:  # chunks past this span's end do no work
                t = i * BLOCK_T + tl.arange(0, BLOCK_T)
                tmask = t < length
                tok = tl.load(order_ptr + start + t, mask=tmask, other=0)  # int64 token indices
                w = tl.load(w_ptr + tok, mask=tmask, other=0.0)
                rows = tl.load(
                    x_ptr + h * sxh + tok[:, None] * sxt + d[None, :] * sxd,
                    mask=tmask[:, None] & dmask[None, :],
                    other=0.0,
                )
                acc += tl.sum(rows.to(tl.float32) * w[:, None], 0)
        tl.store(o_ptr + (h * M + s) * D + d, acc, mask=dmask)


def span_layout(span_id: torch.Tensor, n_spans: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, start, length)`` of the spans, computed on ``span_id``'s device without a host read.

    Parameters
    ----------
    span_id : Tensor
        ``[n]`` integer span of each token (``< 0``: resident).
    n_spans : int
        Number of spans; ids ``>= n_spans`` are sorted after every span and belong to none.

    Returns
    -------
    (order, start, length)
        ``order`` ``[n]`` int64 token indices sorted by span (stable: token order within a span, resident tokens
        last); ``start`` and ``length`` ``[n_spans]`` int64: span ``s`` is ``order[start[s] : start[s] + length[s]]``.
    """
    sid = span_id.long()
    key = torch.where(sid >= 0, sid, n_spans).clamp_max(n_spans)
    order = torch.argsort(key, stable=True)
    length = torch.bincount(key, minlength=n_spans + 1)[:n_spans]
    start = torch.cumsum(length, 0) - length
    return order, start, length


def coarse_entries_triton(
    x: torch.Tensor,
    span_id: torch.Tensor,
    weights: torch.Tensor,
    n_spans: int,
    block_t: int = 64,
    block_d: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`~kv_sekv.summaries.coarse_entries_torch` (SEKV §3.2, Eq. 2–3; module doc).

    Parameters
    ----------
    x : Tensor
        ``[Hkv, n, D]`` keys or values, float32, float16 or bfloat16, any strides.
    span_id : Tensor
        ``[n]`` integer span of each token, ``0 .. n_spans − 1``, or negative for a resident token; a span's tokens
        need not be consecutive.
    weights : Tensor
        ``[n]`` float Eq. 2 weights (:func:`~kv_sekv.summaries.span_weights`); those of resident tokens are unused.
    n_spans : int
        Number of spans (output rows per head).
    block_t : int
        Tokens per chunk (a power of two >= 16).
    block_d : int, optional
        Channels per program (a power of two >= 16); default ``next_power_of_2(D)`` up to 128.

    Returns
    -------
    Tensor
        ``[Hkv, n_spans, D]`` float32 coarse entries ``Σ_{t∈S} w_t x_t`` (0 for a span without tokens).

    Raises
    ------
    ValueError
        When a span id is ``>= n_spans`` or a block size is not a power of two >= 16.
    """
    if not HAS_TRITON:
        raise ImportError("coarse_entries_triton needs triton (pip install kv-sekv[triton])")
    H, n, D = x.shape
    for name, blk in (("block_t", block_t), ("block_d", block_d)):
        check_power_of_two(name, blk, low=16, optional="chosen from the shape")
    if n_spans == 0 or n == 0 or H == 0 or D == 0:
        return torch.zeros(H, n_spans, D, dtype=torch.float32, device=x.device)
    order, start, length = span_layout(span_id, n_spans)
    longest, top = torch.stack([length.max(), span_id.max().long()]).tolist()  # the one host read
    if top >= n_spans:
        raise ValueError(f"span_id holds span {top}, but n_spans is {n_spans}")
    BD = block_d if block_d is not None else min(128, max(16, triton.next_power_of_2(D)))
    BT = min(block_t, max(16, triton.next_power_of_2(max(longest, 1))))
    chunks = triton.next_power_of_2(max(1, triton.cdiv(longest, BT)))
    w = weights.float().contiguous()
    out = torch.empty(H, n_spans, D, dtype=torch.float32, device=x.device)  # every element written once
    _coarse_entries_kernel[(n_spans, H, triton.cdiv(D, BD))](
        x, w, order, start, length, out,
        x.stride(0), x.stride(1), x.stride(2), n_spans,
        D=D, BLOCK_D=BD, BLOCK_T=BT, CHUNKS=chunks, ALIGNED=rows_aligned((x,), dims=(0,)),
    )  # fmt: skip
    return out
