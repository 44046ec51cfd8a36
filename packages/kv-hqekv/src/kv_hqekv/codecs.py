"""HqeKV's page codecs for the engine connectors: ``hqekv-2``, ``hqekv-2.8``, ``hqekv-3.2``, ``hqekv-3.25``
(entry-point group ``kvcompress.codecs``, see :mod:`kvpages.registry`).

A page ``[T, H, D]`` gets HqeKV's tiers (§3.3-§3.4): fp16, 4-bit and 2-bit uniform, 1-bit normalized, in the shares
of the paper's Table 9 for the budget, each side ranked by its own importance (keys by the key metric, values by
the key metric times the token's value range, §3.2). Three departures, documented in ``docs/methods/hqekv.md``:

* a page codec sees no queries: the window attention of §3.2 is replaced by :func:`sink_score`, a query-free
  importance;
* a connector must give back every token: the evict share is folded into the 1-bit tier (the average bits rise by
  that share, e.g. 2.016 for ``hqekv-2``);
* a page is shorter than HqeKV's planning unit (32-token blocks, two fp16 blocks per sequence): the tier unit is the
  token, the tokens of one tier are gathered in position order and quantized in HqeKV's groups (keys per channel
  over ``group_size`` of them, values per token in groups of ``group_size`` channels), and no token is fp16 unless
  ``fp16_tokens`` asks for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kv_hqekv.quantizers import ONE_BIT, tier_quantizer
from kv_hqekv.shares import PRESETS, Shares, tier_counts
from kvcodec.packing import pack_unchecked, unpack_unchecked
from kvcore import QuantizedTensor, packed_width
from kvcore.checks import check_int
from kvpages.codec import PageCodec
from kvpages.errors import CorruptEntry
from kvpages.importance import sink_score
from kvpages.pagefmt import SHAPE, check_end, pack_shape, raw_bytes, tensor_from, unpack_shape

__all__ = ["CODECS", "TIER_WIDTHS", "HqeKVPageCodec", "sink_score"]

TIER_WIDTHS: tuple[int, ...] = (16, 4, 2, 1)
"""Widths of the codec's tiers, most precise first; a token's tier is stored as its index here (2 bits)."""


@functools.lru_cache(maxsize=64)
def _stat_dtypes(bits: int, kind: str, one_bit: str, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """``(scales, zeros)`` dtypes the tier's quantizer stores for a ``dtype`` input (None: no zeros)."""
    q = tier_quantizer(bits, kind, 1, one_bit).quantize(torch.ones(1, 2, 1, dtype=dtype))
    return q.scales.dtype, None if q.zeros is None else q.zeros.dtype


@dataclass(frozen=True, repr=False)
class HqeKVPageCodec(PageCodec):
    """HqeKV's tiers over the tokens of one page (module docstring; Wang et al. 2025, "HqeKV", §3.2-§3.4, Table 9).

    Keys are ranked by :func:`sink_score` ``s_t``, values by ``s_t · Range_t`` (``Range_t``: max minus min of the
    token's value over channels, summed over heads; the joint metric of §3.2). Of the page's ``T`` tokens the
    ``fp16_tokens`` best are fp16, the others go to the 4-, 2- and 1-bit tiers by rank in the counts
    :func:`kv_hqekv.tier_counts` gives for the shares (the evict share counted as 1-bit). Each tier's tokens,
    in position order, are quantized by :func:`kv_hqekv.tier_quantizer` exactly as the method quantizes a block
    (one call per tier and side over ``[H, n_tier, D]``), so a decoded token equals that quantizer's round trip.
    Error: a uniform tier's element is within ``scale/2`` of its group; a 1-bit element decodes to
    ``mean ± 0.674·std`` of its group.

    Parameters
    ----------
    shares : str or Shares, default "llama-2"
        A Table 9 preset name (:data:`kv_hqekv.PRESETS`) or :class:`kv_hqekv.Shares`.
    group_size : int, default 32
        ``G`` (paper: 32): tokens per key group (per channel), channels per value group (per token).
    fp16_tokens : int, default 0
        The most important tokens of each side kept in fp16 (the method keeps its 2 most important 32-token
        blocks of a sequence; a page is a small slice of one).
    one_bit : {"normalized", "uniform"}, default "normalized"
        The 1-bit tier's quantizer (§3.4; "uniform" is Table 6's "w/o II").
    codec_name : str, default "hqekv-2"
        Registry name recorded in the config hash.

    Raises
    ------
    TypeError, ValueError
        An option of the wrong type or outside its range; the message names it.
    """

    shares: str | Shares = "llama-2"
    group_size: int = 32
    fp16_tokens: int = 0
    one_bit: str = "normalized"
    codec_name: str = "hqekv-2"
    _shares: Shares = field(init=False, compare=False)

    lossless: ClassVar[bool] = False
    bounded_size: ClassVar[bool] = True
    accepts_importance: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.shares, str):
            if self.shares not in PRESETS:
                raise ValueError(f"shares must be a Table 9 preset {sorted(PRESETS)} or a Shares, got {self.shares!r}")
            object.__setattr__(self, "_shares", PRESETS[self.shares])
        elif isinstance(self.shares, Shares):
            object.__setattr__(self, "_shares", self.shares)
        else:
            raise TypeError(f"shares must be a preset name or kv_hqekv.Shares, got {type(self.shares).__name__}")
        check_int("group_size", self.group_size, low=1)
        check_int("fp16_tokens", self.fp16_tokens, low=0)
        if self.one_bit not in ONE_BIT:
            raise ValueError(f"one_bit must be one of {ONE_BIT}, got {self.one_bit!r}")
        if not isinstance(self.codec_name, str) or not self.codec_name:
            raise ValueError(f"codec_name must be a non-empty str, got {self.codec_name!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.codec_name

    @property
    def avg_bits(self) -> float:
        """Code bits per token outside the fp16 ones, the evict share at 1 bit: ``4δ1 + 2δ2 + δ3 + δ4``."""
        s = self._shares
        return 4 * s.q4 + 2 * s.q2 + s.q1 + s.evict

    def config(self) -> dict[str, Any]:
        return {
            "shares": list(self._shares.as_tuple()),
            "group_size": self.group_size,
            "fp16_tokens": self.fp16_tokens,
            "one_bit": self.one_bit,
            "importance": "sink_score",
        }

    def counts(self, tokens: int) -> tuple[int, int, int, int]:
        """Tokens per tier (16, 4, 2, 1 bits) of a ``tokens``-token page; the evict count joins the 1-bit tier."""
        c = tier_counts(tokens, self._shares, self.fp16_tokens)
        return c.fp16, c.q4, c.q2, c.q1 + c.evict

    def tiers(
        self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[T]`` tier indices (into :data:`TIER_WIDTHS`) of the keys and of the values of a page.

        ``importance`` ``[T, H]`` (an engine's measured attention per token and KV head), summed over the heads,
        replaces :func:`sink_score` as the key metric ``s_t`` (§3.2's attention score); values still rank by
        ``s_t · Range_t``.
        """
        T = keys.shape[0]
        s = sink_score(keys, values) if importance is None else importance.float().sum(-1).to(keys.device)
        v = values.float()
        rng = (v.amax(-1) - v.amin(-1)).sum(-1)
        counts = torch.tensor(self.counts(T), device=keys.device)
        bounds = torch.cumsum(counts, 0)
        out = []
        for score in (s, s * rng):
            order = torch.sort(score, descending=True, stable=True).indices
            rank = torch.empty_like(order).scatter_(0, order, torch.arange(T, device=keys.device))
            out.append(torch.bucketize(rank, bounds, right=True))
        return out[0], out[1]

    def max_payload_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The payload's size, fixed by the shape (the tier counts depend only on ``tokens``)."""
        T, H, D, G = tokens, kv_heads, head_dim, self.group_size
        e = torch.empty((), dtype=dtype).element_size()
        n_bytes = SHAPE.size + 2 * packed_width(T, 2)
        for kind in ("key", "value"):
            for bits, n in zip(TIER_WIDTHS, self.counts(T), strict=True):
                if n == 0:
                    continue
                if bits == 16:
                    n_bytes += H * n * D * e
                    continue
                groups = H * n * -(-D // G) if kind == "value" else H * -(-n // G) * D
                sdt, zdt = _stat_dtypes(bits, kind, self.one_bit, dtype)
                n_bytes += H * n * packed_width(D, bits) + groups * torch.empty((), dtype=sdt).element_size()
                if zdt is not None:
                    n_bytes += groups * torch.empty((), dtype=zdt).element_size()
        return n_bytes

    def _quantizer(self, bits: int, kind: str):
        return tier_quantizer(bits, kind, self.group_size, self.one_bit)

    def encode_payload(self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None) -> bytes:
        kt, vt = self.tiers(keys, values, importance)
        parts = [pack_shape(keys)]
        for t in (kt, vt):
            parts.append(raw_bytes(pack_unchecked(t[None].to(torch.uint8), 2)[0]))
        for kind, x, t in (("key", keys, kt), ("value", values, vt)):
            for i, bits in enumerate(TIER_WIDTHS):
                sel = (t == i).nonzero().flatten()
                if sel.numel() == 0:
                    continue
                xs = x[sel].transpose(0, 1)  # [H, n, D], position order
                if bits == 16:
                    parts.append(raw_bytes(xs))
                    continue
                q = self._quantizer(bits, kind).quantize(xs)
                parts += [raw_bytes(q.codes), raw_bytes(q.scales)]
                if q.zeros is not None:
                    parts.append(raw_bytes(q.zeros))
        return b"".join(parts)

    def decode_payload(self, payload: memoryview, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, T, H, D = unpack_shape(payload)
        if T == 0 or H == 0 or D == 0:
            raise CorruptEntry(f"empty page shape {(T, H, D)} in page header")
        off, tiers = SHAPE.size, []
        for which in ("key", "value"):
            packed, off = tensor_from(payload, off, torch.uint8, (packed_width(T, 2),), f"{which} tiers")
            t = unpack_unchecked(packed[None], 2, T)[0].long()
            found = tuple(int((t == i).sum()) for i in range(len(TIER_WIDTHS)))
            if found != self.counts(T):
                raise CorruptEntry(f"{which} tier counts {found} differ from the codec's {self.counts(T)}")
            tiers.append(t)
        out = []
        G = self.group_size
        for kind, t in zip(("key", "value"), tiers):
            x = torch.empty(T, H, D, dtype=dtype)
            for i, bits in enumerate(TIER_WIDTHS):
                sel = (t == i).nonzero().flatten()
                n = sel.numel()
                if n == 0:
                    continue
                if bits == 16:
                    xs, off = tensor_from(payload, off, dtype, (H, n, D), f"{kind} fp16 rows")
                else:
                    quant = self._quantizer(bits, kind)
                    gshape = (H, n, -(-D // G)) if kind == "value" else (H, -(-n // G), D)
                    sdt, zdt = _stat_dtypes(bits, kind, self.one_bit, dtype)
                    codes, off = tensor_from(payload, off, torch.uint8, (H, n, packed_width(D, bits)), f"{kind} codes")
                    scales, off = tensor_from(payload, off, sdt, gshape, f"{kind} scales")
                    zeros = None
                    if zdt is not None:
                        zeros, off = tensor_from(payload, off, zdt, gshape, f"{kind} zeros")
                    cb = quant.codebook if bits == 1 else None  # both 1-bit quantizers decode by codebook
                    q = QuantizedTensor(
                        codes=codes,
                        scales=scales,
                        zeros=zeros,
                        bits=bits,
                        axis=quant.axis,
                        group_size=G,
                        shape=(H, n, D),
                        dtype=dtype,
                        codebook=cb,
                    )
                    xs = quant.dequantize(q)
                x[sel] = xs.transpose(0, 1)
            out.append(x if device is None else x.to(device))
        check_end(payload, off)
        return out[0], out[1]


def hqekv_codec(bits: float = 2.0, **options: Any) -> HqeKVPageCodec:
    """HqeKV's page codec at the Table 9 (Llama-3.1-8B) shares of ``bits`` average bits (2, 2.8, 3.2 or 3.25)."""
    preset = f"llama-{bits:g}"
    if "shares" not in options and preset not in PRESETS:
        raise ValueError(f"bits must name a Table 9 Llama preset (2, 2.8, 3.2, 3.25), got {bits!r}")
    defaults = {"shares": preset, "codec_name": f"hqekv-{bits:g}"}
    return HqeKVPageCodec(**{**defaults, **options})


def _at(bits: float) -> Callable[..., HqeKVPageCodec]:
    def factory(**options: Any) -> HqeKVPageCodec:
        return hqekv_codec(bits, **options)

    factory.__name__ = f"hqekv_codec_{bits:g}".replace(".", "_")
    return factory


CODECS: dict[str, Callable[..., PageCodec]] = {f"hqekv-{b:g}": _at(b) for b in (2.0, 2.8, 3.2, 3.25)}
"""The codecs kv-hqekv registers under ``kvcompress.codecs`` (name -> factory(**options))."""
