"""Triton kernel of SEKV's token surprisal ``H_t = −log softmax(h_{t−1} Wᵀ + b)[x_t]`` (SEKV §3.1, Eq. 1).

Same signature and result as :func:`kvcore.surprisal.token_surprisal`. The ``B · (T − 1)`` predicting positions
(row ``b · (T − 1) + t`` is ``hidden[b, t]``, which predicts ``input_ids[b, t + 1]``) are cut into tiles of
``BLOCK_T`` rows and the vocabulary into splits of ``CHUNKS`` chunks of ``BLOCK_V`` entries; the grid is
``(row tiles, splits)``. A program computes its tile's logits over its split one chunk at a time (the inner
product over ``d_model`` in blocks of ``BLOCK_K`` with ``tl.dot``), keeps an online (max, sum of exp) per row and
picks up the target token's logit in the split that holds it; it writes the split's partial log-sum-exp and
partial picked logit (``0`` where the target lies elsewhere). The host combines the splits (log-sum-exp over splits
minus the summed picked logit) and applies the padding rule. The ``[T, V]`` logits are never materialised: the
partials are ``[B · (T − 1), splits]`` floats.

Accumulation is float32. Float32 (or mixed-dtype) inputs are multiplied in float32 with ``input_precision="ieee"``
(as ``torch.matmul`` does on float32 without TF32); float16/bfloat16 inputs of one dtype go to ``tl.dot`` as they
are on a GPU (their products are exact in float32) and are cast to float32 first under the interpreter, where
``tl.dot`` on bf16 is wrong. Every loop bound is a compile-time constant (``d_model`` and the chunks per split);
the chunks per split are a power of two, so a new prompt length compiles at most a few variants. Tested against
the reference under ``TRITON_INTERPRET=1``; GPU speed is unmeasured.
"""

from __future__ import annotations

import os

import torch

from kvcore.checks import check_int, check_power_of_two
from kvcore.surprisal import mask_surprisal

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "surprisal_triton"]

#: programs a launch aims for when it picks the vocabulary splits (a few waves on a 100+ multiprocessor GPU)
TARGET_PROGRAMS = 256

if HAS_TRITON:
    # the row count, T − 1 and hidden's batch stride change with the prompt: not specialised
    @triton.jit(do_not_specialize=["R", "TM1", "shb"])
    def _surprisal_kernel(
        h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, pick_ptr,
        R, TM1, shb, sht, shd, swv, swd,
        V: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
        CHUNKS: tl.constexpr, K_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, CAST_F32: tl.constexpr,
    ):  # fmt: skip
        """Program (row tile, split): partial ``lse[r, split]`` and ``pick[r, split]`` of its ``BLOCK_T`` rows over
        the split's ``CHUNKS · BLOCK_V`` vocabulary entries (the last split clipped at ``V``)."""
        pt = tl.program_id(0)
        sp = tl.program_id(1)
        rows = pt.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < R
        h_row = h_ptr + (rows // TM1) * shb + (rows % TM1) * sht  # [BLOCK_T] pointers to hidden[b, t, 0]
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
        kk = tl.arange(0, BLOCK_K)
        m = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_T,), tl.float32)
        pick = tl.zeros((BLOCK_T,), tl.float32)
        for i in range(CHUNKS):
            v = (sp * CHUNKS + i).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
            vmask = v < V
            acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
            for kb in range(K_BLOCKS):
                k = kb * BLOCK_K + kk
                kmask = k < D
                h = tl.load(h_row[:, None] + k[None, :] * shd, mask=rmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptr + v[None, :] * swv + k[:, None] * swd, mask=kmask[:, None] & vmask[None, :],
                            other=0.0)  # fmt: skip  # [BLOCK_K, BLOCK_V]: W's rows v, transposed
                if CAST_F32:
                    acc = tl.dot(h.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(h, w, acc)
            if HAS_BIAS:
                acc += tl.load(b_ptr + v, mask=vmask, other=0.0).to(tl.float32)[None, :]
            s = tl.where(vmask[None, :], acc, float("-inf"))
            pick += tl.sum(tl.where(v[None, :] == tgt[:, None], s, 0.0), 1)
            m_new = tl.maximum(m, tl.max(s, 1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            total = total * tl.exp(m - safe) + tl.sum(tl.exp(s - safe[:, None]), 1)
            m = m_new
        has = total > 0
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        nsplit = tl.num_programs(1)
        tl.store(lse_ptr + rows * nsplit + sp, lse, mask=rmask)
        tl.store(pick_ptr + rows * nsplit + sp, pick, mask=rmask)


def surprisal_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 8192,
    block_t: int | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    chunks_per_split: int | None = None,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """Surprisal of every token from the hidden states that predict it, SEKV §3.1, Eq. 1, as a Triton kernel.

    Triton version of :func:`kvcore.surprisal.token_surprisal` (same arguments and result; module doc for the
    design). The input is assumed checked: :func:`kv_sekv.surprisal.surprisal_from_hidden` checks shapes, dtypes,
    the id range and the mask before it dispatches here, and a direct call with bad input has undefined results.
    The result carries no autograd graph.

    Parameters
    ----------
    hidden : Tensor
        ``[B, T, d_model]`` final hidden states (float16, bfloat16 or float32; any strides).
    weight : Tensor
        ``[V, d_model]`` output embedding (float16, bfloat16 or float32; any strides).
    input_ids : Tensor
        ``[B, T]`` integer token ids in ``[0, V)``.
    bias : Tensor, optional
        ``[V]`` LM-head bias.
    attention_mask : Tensor, optional
        ``[B, T]`` (True / 1 = real token, left padding 0).
    chunk : int
        Accepted for the reference's signature and unused: the kernel holds ``block_t × block_v`` logits per
        program, whatever the vocabulary.
    block_t, block_v, block_k : int
        Rows per program, vocabulary entries per chunk, ``d_model`` entries per ``tl.dot`` step (powers of two,
        at least 16); by default 64 x 128 x 64 on the matrix units, 32 x 64 x 64 on the IEEE float32 path.
    chunks_per_split : int, optional
        Vocabulary chunks per program; by default the smallest power of two that keeps the launch near
        :data:`TARGET_PROGRAMS` programs.
    tensor_cores : bool, optional
        Multiply float16 / bfloat16 inputs of one dtype on the matrix units as they are (float32 accumulation);
        ``False`` casts them to float32 first (IEEE products). Default: on CUDA outside the interpreter (where
        ``tl.dot`` on bfloat16 is wrong).

    Returns
    -------
    Tensor
        ``[B, T]`` float32 surprisal in nats; the first real token of a row and padding are ``0``.
    """
    if not HAS_TRITON:
        raise ImportError("surprisal_triton needs triton (pip install kv-sekv[triton])")
    if tensor_cores is None:
        tensor_cores = hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    native = tensor_cores and hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16)
    # the IEEE float32 products hold their operands in registers: smaller tiles there (sm_90 with Triton 3.6 and 3.9,
    # float32 or float16 inputs: 80-181 registers and no spill at 32 x 64 x 64; 64 x 128 x 64 spilled 240 bytes)
    block_t = (64 if native else 32) if block_t is None else block_t
    block_v = (128 if native else 64) if block_v is None else block_v
    block_k = 64 if block_k is None else block_k
    for name, blk in (("block_t", block_t), ("block_v", block_v), ("block_k", block_k)):
        check_power_of_two(name, blk, low=16)
    B, T, D = hidden.shape
    V = weight.shape[0]
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    if T < 2 or B == 0:
        return out
    R = B * (T - 1)
    tgt = input_ids[:, 1:].reshape(R).to(device=hidden.device, dtype=torch.int64).contiguous()
    b = weight if bias is None else bias.to(hidden.device).contiguous()  # weight: a pointer the kernel ignores
    n_tiles = triton.cdiv(R, block_t)
    n_chunks = triton.cdiv(V, block_v)
    if chunks_per_split is None:
        want = triton.cdiv(n_chunks, max(1, TARGET_PROGRAMS // n_tiles))
        chunks_per_split = min(triton.next_power_of_2(want), triton.next_power_of_2(n_chunks))
    check_int("chunks_per_split", chunks_per_split, low=1)
    nsplit = triton.cdiv(n_chunks, chunks_per_split)
    lse = torch.empty(R, nsplit, dtype=torch.float32, device=hidden.device)
    pick = torch.empty(R, nsplit, dtype=torch.float32, device=hidden.device)
    _surprisal_kernel[(n_tiles, nsplit)](
        hidden, weight, b, tgt, lse, pick,
        R, T - 1, hidden.stride(0), hidden.stride(1), hidden.stride(2), weight.stride(0), weight.stride(1),
        V=V, D=D, BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_K=block_k, CHUNKS=chunks_per_split,
        K_BLOCKS=triton.cdiv(D, block_k), HAS_BIAS=bias is not None, CAST_F32=not native, num_warps=8,
    )  # fmt: skip
    out[:, 1:] = (torch.logsumexp(lse, dim=1) - pick.sum(1)).view(B, T - 1)
    return mask_surprisal(out, attention_mask)
