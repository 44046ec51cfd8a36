"""HEX's page codecs for the engine connectors: ``hex-3``, ``hex-4``, ``kcvt-3``, ``kcvt-4`` (entry-point group
``kvcompress.codecs``, see :mod:`kvpages.registry`).

A page ``[T, H, D]`` is compressed as one HEX segment of ``T`` slots (HEX §3.1-§3.5, built by the store's own
:func:`kv_hex.segment.compress_segment`) and read back with the store's own reconstruction
(:func:`kv_hex.layout.decode_segment`), so a page decodes to exactly what :class:`kv_hex.HEXStore` reads for the same
tokens and tiers. A codec sees no queries, so HEX's heavy hitters (the tokens of highest accumulated attention, §3.3)
are chosen by :func:`sink_score`, a query-free importance; the recent window is 0 (a page of a prefix cache is not
the end of the sequence). Both are departures from the paper, documented in ``docs/methods/hex.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kv_hex.config import HEXConfig
from kv_hex.layout import decode_segment
from kv_hex.segment import Segment, compress_segment, full_flags, segment_mask
from kv_hex.selector import hex_tiers
from kvcodec.narrow import narrow
from kvcodec.packing import pack_unchecked, unpack_unchecked
from kvcodec.stats import scale_dtype_for
from kvcore import FULL, packed_width
from kvpages.codec import PageCodec
from kvpages.errors import CorruptEntry
from kvpages.importance import sink_score
from kvpages.pagefmt import SHAPE, check_end, pack_shape, raw_bytes, tensor_from, unpack_shape

__all__ = ["CODECS", "HEXPageCodec", "sink_score"]


@functools.lru_cache(maxsize=256)
def _overlay_count(cfg: HEXConfig, T: int, H: int, D: int, heavy: tuple[bool, ...]) -> int:
    """Overlay values of one side of a page: the static mask's elements at the coded tokens (every head)."""
    m = segment_mask(cfg, T, H, D, "cpu")
    if m is None:
        return 0
    coded = ~torch.tensor(heavy, dtype=torch.bool)
    return int(m[coded].sum())


@functools.lru_cache(maxsize=256)
def _max_overlay_count(cfg: HEXConfig, T: int, H: int, D: int, n_heavy: int) -> int:
    """The largest :func:`_overlay_count` over every choice of ``n_heavy`` heavy tokens."""
    m = segment_mask(cfg, T, H, D, "cpu")
    if m is None:
        return 0
    per_token = m.reshape(T, -1).sum(1)
    return int(per_token.sum() - torch.sort(per_token).values[:n_heavy].sum())


@dataclass(frozen=True, repr=False)
class HEXPageCodec(PageCodec):
    """One page as one HEX segment (HEX §3.2-§3.5, §4.2): whole heavy tokens and the static expander overlay in
    full precision, every other element a KCVT code (keys per channel over the page's coded tokens of one head,
    values per token across the page's heads), statistics over the quantized entries only.

    The heavy tokens are the ``int(heavy_ratio · T)`` tokens of highest :func:`sink_score` (ties to the lower
    index), the same tokens for every head as HEX's global selection; they are stored as a per-token bit mask, the
    overlay's coordinates are regenerated from the mask's parameters. The decoded page equals what
    :class:`kv_hex.HEXStore` reads after writing the same tokens with the same tiers (full rows and overlay values
    bit-exact). A coded element's error is at most half its group's KCVT step (``scale/2``, kvcodec's min-max rule)
    plus one rounding of the page dtype.

    Parameters
    ----------
    bits : int, default 3
        KCVT code width, in {2, 3, 4, 8} (HEX-3 / HEX-4, §4.2).
    rho : float, default 0.03125
        Expander density ρ (§4.2), in (0, 1).
    heavy_ratio : float, default 0.02
        Fraction of the page's tokens kept whole in full precision (§3.3, §4.2), in [0, 1). A page shorter than
        ``1 / heavy_ratio`` tokens (50 at the default) has none.
    mask_kind : {"expander", "random", "none"}, default "expander"
        The element-level overlay (``"none"``: KCVT only, Table 4's "Quant only").
    mask_scope, value_scope : {"layer", "head"}, default "layer"
        Channels of the mask and of a value group: all of the page's ``H·D`` channels, or one head's ``D``. An
        SGLang page holds every layer's heads (``H = layers · kv_heads``): ``value_scope="head"`` keeps value
        groups within one layer's head there.
    masked_stats : bool, default True
        KCVT statistics over the quantized entries only (§3.5).
    seed : int or None, default None
        Mask seed (None: derived from the mask's shape and density).
    codec_name : str, default "hex-3"
        Registry name recorded in the config hash.

    Raises
    ------
    TypeError, ValueError
        An option of the wrong type or outside its range (:class:`kv_hex.HEXConfig`'s messages name it).
    """

    bits: int = 3
    rho: float = 0.03125
    heavy_ratio: float = 0.02
    mask_kind: str = "expander"
    mask_scope: str = "layer"
    value_scope: str = "layer"
    masked_stats: bool = True
    seed: int | None = None
    codec_name: str = "hex-3"

    lossless: ClassVar[bool] = False
    bounded_size: ClassVar[bool] = True
    accepts_importance: ClassVar[bool] = True

    def __post_init__(self) -> None:
        cfg = HEXConfig(
            bits=self.bits,
            rho=self.rho,
            heavy_ratio=self.heavy_ratio,
            recent=0,
            mask_kind=self.mask_kind,
            mask_scope=self.mask_scope,
            value_scope=self.value_scope,
            masked_stats=self.masked_stats,
            seed=self.seed,
        )
        for name in ("bits", "rho", "heavy_ratio", "seed"):
            object.__setattr__(self, name, getattr(cfg, name))
        if not isinstance(self.codec_name, str) or not self.codec_name:
            raise ValueError(f"codec_name must be a non-empty str, got {self.codec_name!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.codec_name

    def hex_config(self, tokens: int) -> HEXConfig:
        """The :class:`HEXConfig` of a page of ``tokens`` tokens (one block: the whole page is one segment)."""
        return HEXConfig(
            bits=self.bits,
            rho=self.rho,
            heavy_ratio=self.heavy_ratio,
            recent=0,
            block_size=tokens,
            mask_kind=self.mask_kind,
            mask_scope=self.mask_scope,
            value_scope=self.value_scope,
            masked_stats=self.masked_stats,
            seed=self.seed,
        )

    def config(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "rho": self.rho,
            "heavy_ratio": self.heavy_ratio,
            "importance": "sink_score",
            "mask_kind": self.mask_kind,
            "mask_scope": self.mask_scope,
            "value_scope": self.value_scope,
            "masked_stats": self.masked_stats,
            "seed": self.seed,
        }

    def tiers(self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 ``[1, H, T]``: ``FULL`` for the heavy tokens (every head), ``bits`` elsewhere (:func:`hex_tiers`).

        The heavy tokens rank by ``importance`` ``[T, H]`` summed over the heads (an engine's measured attention:
        §3.3's accumulated attention, one global selection) when given, else by :func:`sink_score`.
        """
        T, H, _ = keys.shape
        s = sink_score(keys, values) if importance is None else importance.float().sum(-1).to(keys.device)
        score = s[None, None].expand(1, H, T)
        keep = torch.ones(1, H, T, dtype=torch.bool, device=keys.device)
        return hex_tiers(score, keep, torch.zeros_like(keep), self.bits, self.heavy_ratio, 0, T)

    def max_payload_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The largest payload of a page of that shape. Everything but the overlay is fixed by the shape (the heavy
        count is ``int(heavy_ratio · T)``); the overlay holds the mask's elements at the coded tokens, so its
        largest size is the mask's total less the ``n_heavy`` tokens with the fewest mask elements."""
        T, H, D = tokens, kv_heads, head_dim
        e = torch.empty((), dtype=dtype).element_size()
        se = torch.empty((), dtype=scale_dtype_for(dtype, self.bits)).element_size()
        n_heavy = int(self.heavy_ratio * T)
        Nq = H * (T - n_heavy)
        n_over = _max_overlay_count(self.hex_config(T), T, H, D, n_heavy)
        v_stats = T if self.value_scope == "layer" else Nq
        side = (H * n_heavy * D) * e + Nq * packed_width(D, self.bits) + n_over * e
        return SHAPE.size + math.ceil(T / 8) + 2 * side + (H * D + v_stats) * (se + e)

    def encode_payload(self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None) -> bytes:
        T = keys.shape[0]
        cfg = self.hex_config(T)
        tiers = self.tiers(keys, values, importance)
        slot_pos = torch.arange(T, device=keys.device)[None]
        k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, H, T, D]
        seg = compress_segment(cfg, k, v, tiers, tiers, slot_pos)
        heavy = pack_unchecked((tiers[0, 0] == FULL)[None].to(torch.uint8), 1)[0]
        parts = [pack_shape(keys), raw_bytes(heavy)]
        for side in ("k", "v"):
            for field in ("rows", "codes", "scale", "zero", "over"):
                parts.append(raw_bytes(getattr(seg, f"{side}_{field}")))
        return b"".join(parts)

    def decode_payload(self, payload: memoryview, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, T, H, D = unpack_shape(payload)
        if T == 0 or H == 0 or D == 0:
            raise CorruptEntry(f"empty page shape {(T, H, D)} in page header")
        off = SHAPE.size
        packed, off = tensor_from(payload, off, torch.uint8, (math.ceil(T / 8),), "heavy-token mask")
        heavy = unpack_unchecked(packed[None], 1, T)[0].bool()
        n_heavy = int(heavy.sum())
        if n_heavy != int(self.heavy_ratio * T):
            raise CorruptEntry(f"page marks {n_heavy} heavy tokens, the codec keeps {int(self.heavy_ratio * T)}")
        cfg = self.hex_config(T)
        Nq, sdt = H * (T - n_heavy), scale_dtype_for(dtype, self.bits)
        n_over = _overlay_count(cfg, T, H, D, tuple(heavy.tolist()))
        v_stats = (1, T) if self.value_scope == "layer" else (Nq,)
        shapes = {
            "rows": (dtype, (H * n_heavy, D)),
            "codes": (torch.uint8, (Nq, packed_width(D, self.bits))),
            "scale": (sdt, None),
            "zero": (dtype, None),
            "over": (dtype, (n_over,)),
        }
        fields: dict[str, torch.Tensor] = {}
        for side, stats in (("k", (H, D)), ("v", v_stats)):
            for field, (fdtype, shape) in shapes.items():
                t, off = tensor_from(payload, off, fdtype, stats if shape is None else shape, f"{side} {field}")
                fields[f"{side}_{field}"] = t
        check_end(payload, off)
        tiers = torch.where(heavy, FULL, self.bits).to(torch.uint8)[None].expand(H, T)
        flags = full_flags(tiers.reshape(-1) == FULL)
        seg = Segment(
            n=T,
            H=H,
            D=D,
            slot_pos=narrow(torch.arange(T)[None]),
            counts=torch.full((H,), T, dtype=torch.int64),
            pos=narrow(torch.arange(T).repeat(H)),
            k_full=flags,
            v_full=flags.clone(),
            acc=None,
            **fields,
        )
        k, v, _, _ = decode_segment(cfg, seg, self.bits)
        k, v = k.view(H, T, D).transpose(0, 1).contiguous(), v.view(H, T, D).transpose(0, 1).contiguous()
        return (k, v) if device is None else (k.to(device), v.to(device))


def hex_codec(bits: int = 3, **options: Any) -> HEXPageCodec:
    """HEX-``bits``'s page codec: expander ρ = 3.125 %, heavy tokens 2 % by :func:`sink_score`, KCVT ``bits``."""
    return HEXPageCodec(bits=bits, codec_name=options.pop("codec_name", f"hex-{bits}"), **options)


def kcvt_codec(bits: int = 3, **options: Any) -> HEXPageCodec:
    """KCVT only (HEX Table 4 "Quant only"): no overlay, no heavy tokens; keys per channel, values per token."""
    defaults = {"mask_kind": "none", "heavy_ratio": 0.0, "codec_name": f"kcvt-{bits}"}
    return HEXPageCodec(bits=bits, **{**defaults, **options})


def _at(make: Callable[..., HEXPageCodec], bits: int) -> Callable[..., HEXPageCodec]:
    def factory(**options: Any) -> HEXPageCodec:
        return make(bits, **options)

    factory.__name__ = f"{make.__name__}_{bits}"
    return factory


CODECS: dict[str, Callable[..., PageCodec]] = {
    "hex-3": _at(hex_codec, 3),
    "hex-4": _at(hex_codec, 4),
    "kcvt-3": _at(kcvt_codec, 3),
    "kcvt-4": _at(kcvt_codec, 4),
}
"""The codecs kv-hex registers under ``kvcompress.codecs`` (name -> factory(**options))."""
