"""Fused decode attention over uniformly quantized K/V (KIVI §3.4's quantized-cache attention, fused; online softmax
as in FlashAttention, Dao et al. 2022, §3.1).

The quantized part of a cache is described by a :class:`QuantizedSegment`: for each side (keys, values) a
:class:`CodeRows` holding packed code rows (the ``kvcore.QuantizedTensor`` bit layout), one row of group parameters
(scale, zero) per quantization group, and optional full-precision rows; plus per-entry index maps ``[B, Hkv, T]``
saying where entry ``t`` of head ``(b, h)`` lives (``row >= 0``: code row ``row`` with parameter row ``group``;
``row < 0``: full-precision row ``-1 - row``) and an additive logit bias (``-inf`` for padding of ragged heads).
The index maps let a store attend to what it holds without copying codes into a dense layout: per-channel key
groups (``axis="channel"``, KIVI keys: one parameter row ``[D]`` shared by the group's code rows) and per-token
value groups (``axis="token"``, KIVI values: a parameter row ``[ceil(D/G)]`` per code row), ragged heads, entries
whose key is quantized while the value is not. :meth:`QuantizedSegment.from_dense` builds one from dense
``QuantizedTensor`` keys/values ``[B, Hkv, T, D]``.

:func:`quantized_attention` dequantizes in registers (Triton, CUDA) or with the PyTorch reference (CPU), and merges
an optional full-precision residual view with :func:`kvcore.merge_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcodec.kernels.dispatch import use_triton
from kvcodec.packing import PACK_BITS
from kvcore import KVView, QuantizedTensor, merge_attention, reference_attention
from kvcore.attention import check_query, check_scale
from kvcore.checks import check_int, check_tensor
from kvcore.quantized import AXES


@dataclass(frozen=True)
class CodeRows:
    """One side (keys or values) of a quantized segment.

    Parameters
    ----------
    codes : Tensor
        uint8 ``[N, packed_width(D, bits)]`` packed code rows.
    scales, zeros : Tensor
        ``[Ng, C]`` group parameters: ``C = D`` for ``axis="channel"`` (column = channel), ``C = ceil(D/G)`` for
        ``axis="token"`` (column = ``d // G``).
    bits : int
        Code width, 1 to 8.
    axis : {"token", "channel"}
        How a parameter row's columns map to channels (see ``scales``).
    group_size : int
        ``G``.
    full : Tensor
        ``[F, D]`` full-precision rows (may be empty), in the cache dtype (float32, float16 or bfloat16). Code rows
        dequantize to that dtype too, exactly as ``UniformQuantizer.dequantize`` does (``zero + code * scale`` in
        float32, rounded to ``full.dtype``), so attention sees the values the cache reads back.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    axis: str
    group_size: int
    full: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor("codes", self.codes, ndim=2)
        check_tensor("scales", self.scales, ndim=2)
        check_tensor("zeros", self.zeros, ndim=2)
        check_tensor("full", self.full, ndim=2)
        if self.full.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"full must be float32, float16 or bfloat16 (the cache dtype), got {self.full.dtype}")
        if self.codes.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8, got {self.codes.dtype}")
        check_int("bits", self.bits, choices=PACK_BITS)
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        check_int("group_size", self.group_size, low=1)
        D = self.full.shape[1]
        C = D if self.axis == "channel" else -(-D // self.group_size)
        if self.scales.shape != self.zeros.shape or self.scales.shape[1] != C:
            raise ValueError(f"scales and zeros must be [Ng, {C}] for D={D}, axis={self.axis!r}")
        if self.codes.shape[1] != (D * self.bits + 7) // 8:
            raise ValueError(f"codes must be [N, {(D * self.bits + 7) // 8}] for D={D}, bits={self.bits}")

    @property
    def head_dim(self) -> int:
        return self.full.shape[1]


@dataclass(frozen=True)
class QuantizedSegment:
    """Quantized K/V of ``[B, Hkv, T]`` entries addressed through index maps (module docstring).

    Parameters
    ----------
    keys, values : CodeRows
    key_row, value_row : Tensor
        int ``[B, Hkv, T]``: ``>= 0`` code row, ``< 0`` full row ``-1 - row``.
    key_group, value_group : Tensor
        int ``[B, Hkv, T]``: parameter row of quantized entries (ignored for full rows).
    bias : Tensor
        float32 ``[B, Hkv, T]`` additive logit bias; ``-inf`` marks padding.
    """

    keys: CodeRows
    values: CodeRows
    key_row: torch.Tensor
    key_group: torch.Tensor
    value_row: torch.Tensor
    value_group: torch.Tensor
    bias: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.keys, CodeRows) or not isinstance(self.values, CodeRows):
            raise TypeError("keys and values must be kvcodec.CodeRows")
        if self.keys.head_dim != self.values.head_dim:
            raise ValueError(f"keys and values head dims differ: {self.keys.head_dim} vs {self.values.head_dim}")
        check_tensor("bias", self.bias, ndim=3)
        for name in ("key_row", "key_group", "value_row", "value_group"):
            t = check_tensor(name, getattr(self, name), ndim=3)
            if t.shape != self.bias.shape or t.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be an int tensor of shape {tuple(self.bias.shape)}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Hkv, T, D)``."""
        return (*self.bias.shape, self.keys.head_dim)

    @classmethod
    def from_dense(
        cls, keys: QuantizedTensor, values: QuantizedTensor, bias: torch.Tensor | None = None
    ) -> QuantizedSegment:
        """Segment over uniform ``QuantizedTensor`` keys and values of shape ``[B, Hkv, T, D]`` (any axes).

        ``bias`` ``[B, Hkv, T]`` (default zeros) marks padding with ``-inf``. Codes and parameters are viewed, not
        copied.
        """
        sides = []
        for name, q in (("keys", keys), ("values", values)):
            if not isinstance(q, QuantizedTensor):
                raise TypeError(f"{name} must be a kvcore.QuantizedTensor, got {type(q).__name__}")
            if len(q.shape) != 4 or q.zeros is None or q.codebook is not None:
                raise ValueError(f"{name} must be a uniform (zeros, no codebook) QuantizedTensor [B, Hkv, T, D]")
            B, H, T, D = q.shape
            G = q.group_size
            nT = T if q.axis == "token" else -(-T // G)
            C = -(-D // G) if q.axis == "token" else D
            s = torch.arange(B * H, device=q.device)[:, None]
            t = torch.arange(T, device=q.device)[None, :]
            row = (s * T + t).view(B, H, T)
            group = (s * nT + (t if q.axis == "token" else t // G)).view(B, H, T)
            side = CodeRows(
                q.codes.reshape(B * H * T, -1),
                q.scales.reshape(B * H * nT, C),
                q.zeros.reshape(B * H * nT, C),
                q.bits,
                q.axis,
                G,
                torch.zeros(0, D, dtype=q.dtype, device=q.device),
            )
            sides.append((side, row, group))
        if keys.shape != values.shape:
            raise ValueError(f"keys {keys.shape} and values {values.shape} must have the same shape")
        B, H, T, _ = keys.shape
        if bias is None:
            bias = torch.zeros(B, H, T, device=keys.device)
        (ks, kr, kg), (vs, vr, vg) = sides
        return cls(ks, vs, kr, kg, vr, vg, bias.float())


def quantized_attention(
    query: torch.Tensor,
    segment: QuantizedSegment,
    scale: float | None = None,
    residual: KVView | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, Q, D]`` over a quantized segment (and a full-precision residual view).

    Equals :func:`kvcore.reference_attention` over the dequantized entries (dequantized as
    ``UniformQuantizer.dequantize`` does, in the cache dtype of :attr:`CodeRows.full`) and the residual, within
    float tolerance. GQA: ``Hq`` is a multiple of ``Hkv``; no causal mask among cached entries.

    Returns
    -------
    out : Tensor
        float32 ``[B, Hq, Q, D]``.
    lse : Tensor
        float32 ``[B, Hq, Q]``; ``-inf`` (and ``out = 0``) for a row that sees no entry.
    """
    if not isinstance(segment, QuantizedSegment):
        raise TypeError(f"segment must be a kvcodec.QuantizedSegment, got {type(segment).__name__}")
    B, H, _T, D = segment.shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    if use_triton(q):
        from kvcodec.kernels.triton_attention import quantized_attention_triton

        part = quantized_attention_triton(q, segment, scale)
    else:
        from kvcodec.kernels.reference import quantized_attention_ref

        part = quantized_attention_ref(q, segment, scale)
    if residual is None:
        return part
    if not isinstance(residual, KVView):
        raise TypeError(f"residual must be a kvcore.KVView, got {type(residual).__name__}")
    return merge_attention([part, reference_attention(residual, q, scale)])
