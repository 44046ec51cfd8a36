"""The ``"lossless"`` codec: the page's raw bytes, bit-exact."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvpages.codec import PageCodec
from kvpages.pagefmt import SHAPE, check_end, pack_shape, raw_bytes, tensor_from, unpack_shape


class LosslessCodec(PageCodec):
    """Stores keys and values as their raw bytes (any float dtype, including bf16 and NaN payloads): bit-exact.

    Stored size: ``2 * tokens * kv_heads * head_dim * itemsize`` plus a 13-byte header and the 48-byte frame.
    """

    name: ClassVar[str] = "lossless"
    lossless: ClassVar[bool] = True
    bounded_size: ClassVar[bool] = True

    def max_payload_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return SHAPE.size + 2 * tokens * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def config(self) -> dict[str, Any]:
        return {}

    def encode_payload(self, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        return pack_shape(keys) + raw_bytes(keys) + raw_bytes(values)

    def decode_payload(self, payload: memoryview, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype, T, H, D = unpack_shape(payload)
        k, off = tensor_from(payload, SHAPE.size, dtype, (T, H, D), "keys")
        v, off = tensor_from(payload, off, dtype, (T, H, D), "values")
        check_end(payload, off)
        return (k, v) if device is None else (k.to(device), v.to(device))
