"""Matrix-unit products shared by the fused decode-attention kernels (kvcodec's, and the method packages').

A decode-attention tile computes ``q · kᵀ`` (query rows × entries) and ``p · v`` (probabilities × values). On the
matrix units (``tl.dot``) both run in one of two modes, picked at compile time by ``DOT``:

* ``DOT = 1`` / ``2`` -- float16 / bfloat16, the cache dtype, when the query and the cache share it: dequantized keys
  and values are exact in the cache dtype, so ``q · kᵀ`` is exact up to the float32 summation order; the
  probabilities ``p`` are split into parts of the cache dtype and multiplied once per part: two float16 parts
  (~2^-22 relative, where one cast of ``p`` would round to 2^-11), three bfloat16 parts (~2^-24, float32's
  precision, where one cast rounds to 2^-8 and two to 2^-16);
* ``DOT = 0`` -- IEEE float32 (``input_precision="ieee"``, never TF32): other dtypes, and Triton's interpreter, whose
  bfloat16 ``tl.dot`` is wrong.

Operands need at least 16 rows and columns (pad query rows and tiles to 16). :func:`dot_mode` picks the mode on the
host. The kernels also share their online-softmax tile step (:func:`online_softmax_step`;
:func:`online_softmax_step_t` accumulates the output transposed), its result (:func:`softmax_result`) and the
rounding of a dequantized entry to the cache dtype (:func:`cache_round`). This module needs ``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.kernels.triton_quant import _bf16_rtne

__all__ = [
    "DOT_CODE",
    "as_dot",
    "cache_round",
    "dot_mode",
    "load_query_group",
    "online_softmax_step",
    "online_softmax_step_t",
    "pv_dot",
    "qk_dot",
    "softmax_result",
]

DOT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""``DOT`` code of a cache dtype (0 = IEEE float32 products)."""


def dot_mode(query: torch.Tensor, cache_dtypes, tensor_cores: bool | None) -> int:
    """The kernels' ``DOT`` for a query and the cache dtypes it attends to.

    ``tensor_cores=None`` (default): the cache dtype's mode on CUDA when the query and every cache dtype share
    float16 or bfloat16, else 0. ``True`` insists (``ValueError`` when the dtypes do not allow it); ``False`` forces
    IEEE float32.
    """
    low = DOT_CODE.get(query.dtype, 0)
    can = low != 0 and all(DOT_CODE.get(dt, 0) == low for dt in cache_dtypes)
    if tensor_cores is None:
        tensor_cores = can and query.is_cuda
    elif tensor_cores and not can:
        raise ValueError(
            "tensor_cores=True needs the query and the cache in one dtype, float16 or bfloat16; got query "
            f"{query.dtype}, cache {sorted({str(dt) for dt in cache_dtypes})}"
        )
    return low if tensor_cores else 0


@triton.jit
def as_dot(x, DOT: tl.constexpr):
    """``x`` in the dtype the products run in: float32 (``DOT`` 0), float16 (1) or bfloat16 (2)."""
    if DOT == 1:
        return x.to(tl.float16)
    elif DOT == 2:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def cache_round(x, OUT: tl.constexpr):
    """float32 ``x`` rounded to the cache dtype (``OUT`` as :data:`DOT_CODE`: 0 float32, 1 float16, 2 bfloat16;
    round-to-nearest-even, also under the interpreter, whose own bfloat16 cast truncates), back as float32: a
    dequantized entry exactly as the unpack + dequantize kernels hand it to the cache dtype. Finite inputs within
    the dtype's range (callers clamp)."""
    if OUT == 1:
        x = x.to(tl.float16).to(tl.float32)
    elif OUT == 2:
        x = _bf16_rtne(x).to(tl.float32)
    return x


@triton.jit
def qk_dot(q, k, DOT: tl.constexpr):
    """``q · kᵀ`` in float32: ``q`` ``[M, D]`` already :func:`as_dot`, ``k`` ``[N, D]`` float32 holding values exact in
    the cache dtype."""
    if DOT == 0:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(as_dot(k, DOT)))


@triton.jit
def _p_parts(p, DOT: tl.constexpr):
    """float32 probabilities ``p`` as parts of the product dtype (``DOT`` 1 or 2): ``(hi, mid, lo)``, ``hi + mid``
    ~2^-22 of ``p`` in float16, ``hi + mid + lo`` float32's precision in bfloat16 (a caller that does not use ``lo``
    leaves it to the compiler to drop)."""
    p_hi = as_dot(p, DOT)
    rest = p - p_hi.to(tl.float32)
    p_mid = as_dot(rest, DOT)
    return p_hi, p_mid, as_dot(rest - p_mid.to(tl.float32), DOT)


@triton.jit
def pv_dot(p, v, DOT: tl.constexpr):
    """``p · v`` in float32: ``p`` ``[M, N]`` float32 probabilities (split in two float16 or three bfloat16 parts on
    the matrix units), ``v`` ``[N, D]`` float32 holding values exact in the cache dtype."""
    if DOT == 0:
        return tl.dot(p, v, input_precision="ieee")
    vd = as_dot(v, DOT)
    p_hi, p_mid, p_lo = _p_parts(p, DOT)
    out = tl.dot(p_hi, vd) + tl.dot(p_mid, vd)
    if DOT == 2:  # bfloat16 keeps 8 bits per part: a third part brings p to float32's 24
        out += tl.dot(p_lo, vd)
    return out


@triton.jit
def _vp_dot(v_t, p, DOT: tl.constexpr):
    """``vᵀ · pᵀ`` in float32 (:func:`pv_dot` transposed): ``v_t`` ``[D, N]``, ``p`` ``[M, N]``."""
    if DOT == 0:
        return tl.dot(v_t.to(tl.float32), tl.trans(p), input_precision="ieee")
    vd = as_dot(v_t, DOT)
    p_hi, p_mid, p_lo = _p_parts(p, DOT)
    out = tl.dot(vd, tl.trans(p_hi)) + tl.dot(vd, tl.trans(p_mid))
    if DOT == 2:
        out += tl.dot(vd, tl.trans(p_lo))
    return out


@triton.jit
def _weights(m_i, l_i, logits):
    """A tile's step of the running max and sum: ``(m_new, l_i, alpha, p)``, ``alpha`` the factor that rescales what
    was accumulated, ``p`` the tile's unnormalised probabilities."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def online_softmax_step(m_i, l_i, acc, logits, v, DOT: tl.constexpr):
    """One tile of an online softmax (FlashAttention, Dao et al. 2022, §3.1), shared by the fused decode-attention
    kernels: the running max ``m_i [M]``, sum ``l_i [M]`` and unnormalised output ``acc [M, D]`` updated with the
    tile's scaled ``logits [M, N]`` (``-inf`` where masked: a row that has seen nothing keeps ``m_i = -inf`` and
    ``l_i = 0``) and its values ``v [N, D]`` (float32 holding values exact in the cache dtype, :func:`pv_dot`).
    Returns ``(m_i, l_i, acc)``."""
    m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
    return m_new, l_i, acc * alpha[:, None] + pv_dot(p, v, DOT)


@triton.jit
def online_softmax_step_t(m_i, l_i, acc_t, logits, v_t, DOT: tl.constexpr):
    """:func:`online_softmax_step` with the output accumulated transposed: ``acc_t [D, M]`` updated with ``v_t [D, N]``
    (the values' transpose, in the product dtype or float32 holding values exact in the cache dtype). ``vᵀ · pᵀ`` puts
    the head dim on the product's long side (on sm_90 a warp-group matrix instruction; the ``p · v`` form has the
    padded query rows there), and a tile of values read channel-major needs no transpose. Returns
    ``(m_i, l_i, acc_t)``; :func:`softmax_result` takes ``tl.trans(acc_t)``."""
    m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
    return m_new, l_i, acc_t * alpha[None, :] + _vp_dot(v_t, p, DOT)


@triton.jit
def softmax_result(m_i, l_i, acc):
    """``(out [M, D], lse [M])`` of an online softmax's state: the normalised output and the log-sum-exp (``out = 0``
    and ``lse = -inf`` for a row that has seen no entry)."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def load_query_group(q_ptr, b, h, sqb, sqh, sqq, sqd, Q, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
    """The query rows of KV head ``h`` of sequence ``b``: its ``GROUP`` query heads × ``Q`` positions as the ``M``
    rows of one tile (row ``m`` = query head ``h * GROUP + m // Q``, position ``m % Q``), padded to ``BLOCK_M`` rows
    and ``BLOCK_D`` channels with zeros.

    Returns ``(q [BLOCK_M, BLOCK_D], m, row mask, query head per row, position per row, channels, channel mask)``.
    """
    m = tl.arange(0, BLOCK_M)
    mmask = m < GROUP * Q
    hq = h * GROUP + m // Q
    qi = m % Q
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    off = b.to(tl.int64) * sqb + hq.to(tl.int64) * sqh + qi.to(tl.int64) * sqq
    qv = tl.load(q_ptr + off[:, None] + d[None, :].to(tl.int64) * sqd, mask=mmask[:, None] & dmask[None, :], other=0.0)
    return qv, m, mmask, hq, qi, d, dmask
