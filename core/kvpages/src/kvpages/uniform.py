"""Uniform min-max page codecs: ``"kivi-4"``, ``"kivi-2"`` and ``"int8"`` on kvcodec's ``UniformQuantizer``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvcodec import UniformQuantizer, scale_dtype_for
from kvcodec.stats import QUANT_BITS
from kvcore import QuantizedTensor, packed_width
from kvcore.checks import check_int
from kvcore.quantized import AXES
from kvpages.codec import PageCodec
from kvpages.pagefmt import SHAPE, check_end, pack_shape, raw_bytes, tensor_from, unpack_shape


def _check_group(name: str, value: object) -> int | None:
    return check_int(name, value, low=1, optional="the whole axis")


@dataclass(frozen=True, repr=False)
class UniformPageCodec(PageCodec):
    """Min-max quantization of a page with KIVI's grouping (Liu et al. 2024, "KIVI", §3.2).

    A page ``[T, H, D]`` is quantized per KV head. Keys group along tokens for each channel
    (``key_axis="channel"``; KIVI's per-channel key quantization, here over the page's ``T`` tokens when
    ``key_group_size`` is None); values group along channels of one token (``value_axis="token"``, groups of
    ``value_group_size = 32`` channels, KIVI's per-token value quantization). Codes are bit-packed; scales and
    zeros are stored in the page dtype (fp32 scales for bf16 at 8 bits, see ``kvcodec.scale_dtype_for``).

    Error bound: for every element, ``|x - decode(encode(x))| <= scale/2`` of its group (plus the rounding of the
    page dtype), where ``scale ~ (max - min) / (2**bits - 1)`` of the group (``kvcodec.stats``).

    Parameters
    ----------
    bits : int
        Code width, one of 1, 2, 3, 4, 8.
    key_axis, value_axis : {"channel", "token"}
        Grouping of keys and of values (see above).
    key_group_size, value_group_size : int or None
        Group length along the grouped axis; None is the whole axis (all ``T`` tokens, or all ``D`` channels).
    name : str
        Registry name recorded in the config hash.
    """

    bits: int = 4
    key_axis: str = "channel"
    key_group_size: int | None = None
    value_axis: str = "token"
    value_group_size: int | None = 32
    codec_name: str = "kivi-4"

    lossless: ClassVar[bool] = False
    bounded_size: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("bits", self.bits, choices=QUANT_BITS)
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                raise ValueError(f"{name} must be one of {AXES}, got {getattr(self, name)!r}")
        _check_group("key_group_size", self.key_group_size)
        _check_group("value_group_size", self.value_group_size)
        if not isinstance(self.codec_name, str) or not self.codec_name:
            raise ValueError(f"codec_name must be a non-empty str, got {self.codec_name!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.codec_name

    def config(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "key_axis": self.key_axis,
            "key_group_size": self.key_group_size,
            "value_axis": self.value_axis,
            "value_group_size": self.value_group_size,
        }

    def _groupings(self) -> tuple[tuple[str, int | None], tuple[str, int | None]]:
        return (self.key_axis, self.key_group_size), (self.value_axis, self.value_group_size)

    def _quantizer(self, axis: str, group: int | None, T: int, D: int) -> UniformQuantizer:
        whole = T if axis == "channel" else D
        return UniformQuantizer(self.bits, axis, min(group, whole) if group is not None else whole)

    def _shapes(self, axis: str, G: int, dtype: torch.dtype, T: int, H: int, D: int):
        gshape = (H, T, -(-D // G)) if axis == "token" else (H, -(-T // G), D)
        return (
            ("codes", torch.uint8, (H, T, packed_width(D, self.bits))),
            ("scales", scale_dtype_for(dtype, self.bits), gshape),
            ("zeros", dtype, gshape),
        )

    def max_payload_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """The payload's size, fixed by the shape: header, then codes, scales and zeros of keys and values."""
        n = SHAPE.size
        for axis, group in self._groupings():
            G = self._quantizer(axis, group, tokens, head_dim).group_size
            for _field, fdtype, shape in self._shapes(axis, G, dtype, tokens, kv_heads, head_dim):
                n += math.prod(shape) * torch.empty((), dtype=fdtype).element_size()
        return n

    def encode_payload(self, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        T, _H, D = keys.shape
        parts = [pack_shape(keys)]
        for x, axis, group in (
            (keys, self.key_axis, self.key_group_size),
            (values, self.value_axis, self.value_group_size),
        ):
            q = self._quantizer(axis, group, T, D).quantize(x.transpose(0, 1))  # [H, T, D]: per KV head
            parts += [raw_bytes(q.codes), raw_bytes(q.scales), raw_bytes(q.zeros)]
        return b"".join(parts)

    def decode_payload(self, payload: memoryview, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, T, H, D = unpack_shape(payload)
        off, out = SHAPE.size, []
        for which, axis, group in (
            ("keys", self.key_axis, self.key_group_size),
            ("values", self.value_axis, self.value_group_size),
        ):
            quant = self._quantizer(axis, group, T, D)
            fields = {}
            for field, fdtype, shape in self._shapes(axis, quant.group_size, dtype, T, H, D):
                t, off = tensor_from(payload, off, fdtype, shape, f"{which} {field}")
                fields[field] = t if device is None else t.to(device)
            q = QuantizedTensor(
                bits=self.bits, axis=axis, group_size=quant.group_size, shape=(H, T, D), dtype=dtype, **fields
            )
            out.append(quant.dequantize(q).transpose(0, 1).contiguous())
        check_end(payload, off)
        return out[0], out[1]


def kivi(bits: int = 4, **options: Any) -> UniformPageCodec:
    """KIVI's page codec at ``bits`` (keys per channel over the page, values per token in groups of 32)."""
    return UniformPageCodec(bits=bits, codec_name=options.pop("codec_name", f"kivi-{bits}"), **options)


def int8(**options: Any) -> UniformPageCodec:
    """8-bit min-max for keys and values, both per token in groups of 32 channels."""
    defaults = {"key_axis": "token", "key_group_size": 32, "value_axis": "token", "value_group_size": 32}
    return UniformPageCodec(bits=8, codec_name="int8", **{**defaults, **options})
