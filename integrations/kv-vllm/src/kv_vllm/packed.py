"""Packed KV pages inside vLLM's own pool: the page format, the open-block staging and the paged attention.

Pure PyTorch, no vLLM import: :mod:`kv_vllm.packed_backend` wires these into a vLLM attention backend, and the
workspace tests run them on synthetic paged tensors.

A vLLM block of ``N`` tokens holds, per KV head, KIVI's layout (Liu et al. 2024, "KIVI", §3):

- keys quantized **per channel over the block's tokens** (one min-max group of ``N`` tokens per channel),
- values quantized **per token in groups of** ``G`` **channels**,

with ``bits``-wide codes packed densely (``kvcodec.packing``) plus the scales and zeros
(``kvcodec.UniformQuantizer``). ``bits=16`` stores the raw keys and values (the same page as stock vLLM): the
identity setting that checks the wiring.

A block is packed **once, when it is complete**. Until then its tokens live at full precision in
:class:`OpenBlocks` (outside vLLM's pool, one block per layer per request being filled: KIVI's residual). A
packed block is never written again, so a prefix-cache hit on it reads exactly what its first owner packed.

Attention (:func:`paged_attention`): each request's queries attend to its packed blocks (dequantized) and, at
full precision and causally, to its staged tokens (the open block and the blocks this step wrote); the two
partial attentions are merged by log-sum-exp (:func:`kvcore.merge_attention`). A prefill therefore attends to
its own tokens at full precision; a decode attends to packed blocks + the open block.

At 2 and 4 bits the pool *is* a :class:`kvcodec.decode_v2.PagedPackedKIVI` (:func:`paged_view`: typed views of
its bytes, no copy), and a decode step can run :func:`kvcodec.decode_v2.kivi_decode_v2_paged` (the paged Triton
kernel on CUDA) over it: the page format (version :data:`FORMAT_VERSION`) stores codes and value parameters in the
kernel's token-inner order.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from kvcodec.decode_v2 import PAGED_BITS, PagedPackedKIVI, kivi_decode_v2_paged
from kvcodec.stats import scale_dtype_for
from kvcodec.uniform import UniformQuantizer
from kvcore import QuantizedTensor, merge_attention
from kvpages import PageCodec, codec_names, frame_length
from kvpages import codec as make_codec
from kvpages.framing import OVERHEAD

PACKED_BITS: tuple[int, ...] = (2, 4, 8, 16)
"""Code widths the backend packs (16: raw keys and values, the identity check)."""

ENV_BITS = "KVCOMPRESS_KV_BITS"
"""The flag that turns the backend on: ``KVCOMPRESS_KV_BITS=4`` (or 2, 8, 16) in the engine's environment."""
ENV_GROUP = "KVCOMPRESS_KV_GROUP"
"""Value group size in channels (default 32, KIVI's); must divide the head size."""
ENV_CODEC = "KVCOMPRESS_KV_CODEC"
"""The other way to turn the backend on: a registered ``kvpages`` codec holds each complete block
(``KVCOMPRESS_KV_CODEC=hqekv-2``, ``hex-3``, ...; :class:`CodecPageFormat`). Exclusive with ``KVCOMPRESS_KV_BITS``."""

MIN_BLOCK = 16
"""Smallest block size: keys are grouped per channel over a block's tokens (KIVI uses 32-token groups)."""

DTYPES = (torch.float16, torch.bfloat16, torch.float32)

FORMAT_VERSION = 2
"""The in-pool byte layout of :class:`PageFormat`. Version 1 stored codes token-major (``[N, D*bits/8]``) and the
value scales/zeros ``[N, D/G]``; version 2 stores both transposed (token-inner, the paged decode kernel's order),
same bytes. Pages live only as long as the engine (no connector stores them), so no reader of version 1 remains."""

DECODE_PATHS = ("v2", "torch")
"""How :func:`paged_attention` computes decode steps at 2/4 bits: ``"v2"`` (the default) through
:func:`kvcodec.decode_v2.kivi_decode_v2_paged` over :func:`paged_view` (the paged Triton kernel where
``kvcore.dispatch.use_triton`` takes the pool, i.e. CUDA; its PyTorch reference elsewhere, which on CPU is also
faster than the ``"torch"`` path: 100 vs 230-410 ms for 4 requests x 1k tokens of a Llama-3-8B layer, float32 and
bfloat16), ``"torch"`` by dequantizing the packed blocks (the only path at 8 and 16 bits)."""


def pool_codec_names() -> list[str]:
    """Registered codecs that can hold a block in the pool: those declaring a bounded encoded size."""
    return [n for n in codec_names() if make_codec(n).bounded_size]


def pool_codec(name: str) -> PageCodec:
    """The registered codec ``name`` (:func:`kvpages.codec`), refused in one line unless it declares a bounded size."""
    try:
        c = make_codec(name)
    except ValueError:
        c = None
    if c is None or not c.bounded_size:
        raise ValueError(
            f"kvcompress packed KV: {ENV_CODEC}={name!r} is not a registered codec with a bounded page size; "
            f"available: {', '.join(pool_codec_names())}"
        )
    return c


@dataclass(frozen=True)
class PackedKVConfig:
    """The backend's settings: ``bits`` (2, 4, 8 or 16) and the value group size ``group_size`` of the KIVI pages,
    or ``codec``: the name of a registered ``kvpages`` codec holding each block (then ``bits`` is unused)."""

    bits: int = 4
    group_size: int = 32
    codec: str | None = None

    def __post_init__(self) -> None:
        if self.codec is not None:
            pool_codec(self.codec)
            return
        if isinstance(self.bits, bool) or self.bits not in PACKED_BITS:
            raise ValueError(
                f"kvcompress packed KV: cannot pack {self.bits!r}-bit codes; {ENV_BITS} must be one of {PACKED_BITS}"
            )
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(
                f"kvcompress packed KV: {ENV_GROUP} must be an int >= 1 (channels per value group), "
                f"got {self.group_size!r}"
            )

    @property
    def flag(self) -> str:
        """The environment flag this config came from (for messages)."""
        return ENV_BITS if self.codec is None else ENV_CODEC

    @classmethod
    def from_env(cls, environ: dict | None = None) -> PackedKVConfig | None:
        """The config named by ``KVCOMPRESS_KV_BITS`` / ``KVCOMPRESS_KV_GROUP`` or by ``KVCOMPRESS_KV_CODEC``;
        None when neither is set. Both set (or a group size with a codec) is refused in one line."""
        env = os.environ if environ is None else environ
        raw = env.get(ENV_BITS, "").strip()
        name = env.get(ENV_CODEC, "").strip()
        graw = env.get(ENV_GROUP, "").strip()
        if name:
            if raw or graw:
                raise ValueError(
                    f"kvcompress packed KV: set either {ENV_BITS} (one of {PACKED_BITS}, with {ENV_GROUP}) or "
                    f"{ENV_CODEC} (one of {', '.join(pool_codec_names())}), not both"
                )
            return cls(codec=name)
        if not raw:
            return None
        try:
            bits = int(raw)
        except ValueError:
            raise ValueError(
                f"kvcompress packed KV: cannot pack {raw!r}-bit codes; {ENV_BITS} must be one of {PACKED_BITS}"
            ) from None
        graw = graw or "32"
        try:
            group = int(graw)
        except ValueError:
            raise ValueError(f"kvcompress packed KV: {ENV_GROUP} must be an int >= 1, got {graw!r}") from None
        return cls(bits=bits, group_size=group)


def check_layer(kind: str, sliding_window: int | None, kv_quant: str, head_size: int, head_size_v: int) -> None:
    """Refuse (ValueError, one line) a layer the packed pages cannot hold: ``kind`` is vLLM's spec class name
    (only ``FullAttentionSpec``), ``kv_quant`` its ``kv_quant_mode`` name (only ``NONE``)."""
    prefix = f"kvcompress packed KV ({ENV_BITS}):"
    if "MLA" in kind:
        raise ValueError(f"{prefix} MLA layers ({kind}) are not supported; only full-attention MHA/GQA decoder layers")
    if sliding_window is not None or "SlidingWindow" in kind or "Chunked" in kind:
        raise ValueError(
            f"{prefix} sliding-window / chunked-local layers ({kind}) are not supported; only full attention"
        )
    if kind != "FullAttentionSpec":
        raise ValueError(f"{prefix} {kind} layers are not supported; only FullAttentionSpec decoder layers")
    if kv_quant != "NONE":
        raise ValueError(
            f"{prefix} a quantized KV cache ({kv_quant}) cannot be packed again; use --kv-cache-dtype auto"
        )
    if head_size_v != head_size:
        raise ValueError(f"{prefix} different key/value head sizes ({head_size}/{head_size_v}) are not supported")


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _BlockGeometry:
    """What both page formats derive from their block shape and ``token_bytes``: the page size, the stock block's
    size and the capacity ratio between them, and the check of a block handed to ``pack``."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def token_bytes(self) -> int:  # pragma: no cover - each format defines it
        raise NotImplementedError

    @property
    def page_bytes(self) -> int:
        """Bytes of a whole block (all heads): content (codes and metadata, or the codec's largest blob) and padding."""
        return self.num_kv_heads * self.block_size * self.token_bytes

    @property
    def dense_page_bytes(self) -> int:
        """Bytes of the same block in stock vLLM (keys and values in ``dtype``)."""
        return self.num_kv_heads * self.block_size * 2 * self.head_size * _nbytes(self.dtype)

    @property
    def capacity_ratio(self) -> float:
        """Blocks per byte relative to stock vLLM: ``dense_page_bytes / page_bytes``."""
        return self.dense_page_bytes / self.page_bytes

    def _check_block(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int]:
        """``keys.shape`` when ``keys`` and ``values`` are ``[B, num_kv_heads, block_size, head_size]`` blocks."""
        B, H, N, D = keys.shape
        if (self.num_kv_heads, self.block_size, self.head_size) != (H, N, D) or values.shape != keys.shape:
            raise ValueError(
                f"pack: expected [B, {self.num_kv_heads}, {self.block_size}, {self.head_size}] keys and values, "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        return B, H, N, D


@dataclass(frozen=True)
class PageFormat(_BlockGeometry):
    """The byte layout of one packed block: ``N`` tokens × ``H`` KV heads × head size ``D`` in ``dtype``.

    Per head, a region of ``N * token_bytes`` bytes (format version :data:`FORMAT_VERSION`), in this order: key
    scales and zeros (``[D]`` each: one group of ``N`` tokens per channel), value scales and zeros (``[D/G, N]``
    each), key codes and value codes (``[D*bits/8, N]`` each, **token-inner**: byte ``p`` of token ``t`` at
    ``p * N + t`` holds channels ``p * L .. p * L + L - 1`` in ``L = 8 / bits`` little-endian lanes), then padding.
    That is :class:`kvcodec.decode_v2.PagedPackedKIVI`'s order, so :meth:`fields` views a pool as its tensors
    without a copy. At 16 bits the region holds the raw keys then values (``[N, D]`` each). ``token_bytes`` is what
    vLLM's spec calls ``state_content_bytes``: the page's bytes per (head, token), a whole number of ``dtype``
    elements. Construction validates the shapes and raises ValueError with one line.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    bits: int = 4
    group_size: int = 32
    _sizes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        PackedKVConfig(self.bits, self.group_size)
        if self.dtype not in DTYPES:
            raise ValueError(f"kvcompress packed KV: KV dtype {self.dtype} is not one of float16, bfloat16, float32")
        if self.block_size < MIN_BLOCK or self.block_size % MIN_BLOCK:
            raise ValueError(
                f"kvcompress packed KV: block size {self.block_size} breaks the per-channel key groups; "
                f"use a multiple of {MIN_BLOCK} (--block-size 32 on CPU)"
            )
        if self.bits != 16 and (self.head_size % self.group_size or (self.head_size * self.bits) % 8):
            raise ValueError(
                f"kvcompress packed KV: head size {self.head_size} is not a multiple of the value group size "
                f"{self.group_size}; set {ENV_GROUP} to a divisor of it"
            )
        N, D = self.block_size, self.head_size
        e = _nbytes(self.dtype)
        if self.bits == 16:
            sizes = {"k": N * D * e, "v": N * D * e}
        else:
            s = _nbytes(scale_dtype_for(self.dtype, self.bits))
            codes = N * D * self.bits // 8
            groups = D // self.group_size
            sizes = {"ks": D * s, "kz": D * e, "vs": N * groups * s, "vz": N * groups * e, "kc": codes, "vc": codes}
        object.__setattr__(self, "_sizes", sizes)

    @property
    def content_bytes(self) -> int:
        """Bytes of one head's region that carry data (codes, scales, zeros)."""
        return sum(self._sizes.values())

    @property
    def token_bytes(self) -> int:
        """Bytes per (head, token) of the page: vLLM's ``state_content_bytes`` (whole ``dtype`` elements)."""
        e = _nbytes(self.dtype)
        return math.ceil(self.content_bytes / self.block_size / e) * e

    def _quantizers(self) -> tuple[UniformQuantizer, UniformQuantizer]:
        return (
            UniformQuantizer(self.bits, "channel", self.block_size),
            UniformQuantizer(self.bits, "token", self.group_size),
        )

    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``keys``/``values`` ``[B, H, N, D]`` -> uint8 pages ``[B, H, N * token_bytes]``."""
        B, H, N, _ = self._check_block(keys, values)
        keys, values = keys.to(self.dtype), values.to(self.dtype)
        if self.bits == 16:
            parts = [keys, values]
        else:
            qk, qv = self._quantizers()
            k, v = qk.quantize(keys), qv.quantize(values)
            # _sizes' order; codes and value parameters token-inner ([.., X, N]), key parameters [.., 1, D] as they are
            t = lambda x: x.transpose(-1, -2)  # noqa: E731
            parts = [k.scales, k.zeros, t(v.scales), t(v.zeros), t(k.codes), t(v.codes)]
        blob = torch.cat([p.contiguous().reshape(B, H, -1).view(torch.uint8) for p in parts], dim=-1)
        out = torch.zeros(B, H, N * self.token_bytes, dtype=torch.uint8, device=keys.device)
        out[..., : blob.shape[-1]] = blob
        return out

    def fields(self, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views (no copy) of the packed fields of uint8 pages ``[nb, H, N * token_bytes]``.

        Parameters
        ----------
        pages : torch.Tensor
            uint8 ``[nb, H, N * token_bytes]``, each head's region contiguous (:func:`page_bytes_view` of vLLM's
            layer cache, or :meth:`pack`'s output); the blocks may lie strided apart.

        Returns
        -------
        dict of torch.Tensor
            Views sharing ``pages``' storage: at 2/4/8 bits ``kc, vc`` uint8 ``[nb, H, D*bits/8, N]``, ``ks, kz``
            ``[nb, H, D, 1]`` and ``vs, vz`` ``[nb, H, D/G, N]`` (scales in ``scale_dtype_for(dtype, bits)``, zeros in
            ``dtype``); at 16 bits ``k, v`` ``[nb, H, N, D]`` in ``dtype``.

        Raises
        ------
        ValueError
            ``pages`` of another shape or dtype, or a head region that is not contiguous.
        """
        N, D = self.block_size, self.head_size
        if (
            not isinstance(pages, torch.Tensor)
            or pages.dtype != torch.uint8
            or pages.dim() != 3
            or tuple(pages.shape[1:]) != (self.num_kv_heads, N * self.token_bytes)
        ):
            raise ValueError(
                f"kvcompress packed KV: pages must be uint8 [num_blocks, {self.num_kv_heads}, {N * self.token_bytes}], "
                f"got {getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}"
            )
        if pages.shape[-1] > 1 and pages.stride(-1) != 1:
            raise ValueError("kvcompress packed KV: each head's page region must be contiguous")
        sdt = scale_dtype_for(self.dtype, self.bits) if self.bits != 16 else self.dtype
        P = D * self.bits // 8
        C = D // self.group_size
        shapes = {"k": (N, D), "v": (N, D)} if self.bits == 16 else {
            "ks": (D, 1), "kz": (D, 1), "vs": (C, N), "vz": (C, N), "kc": (P, N), "vc": (P, N)}  # fmt: skip
        out, at = {}, 0
        for name, size in self._sizes.items():
            dt = torch.uint8 if name in ("kc", "vc") else sdt if name in ("ks", "vs") else self.dtype
            e = _nbytes(dt)
            if at % e:
                raise ValueError(f"kvcompress packed KV: field {name} starts at byte {at}, not a whole {dt} element")
            if pages.shape[0] == 0:
                typed = torch.empty(0, self.num_kv_heads, pages.shape[-1] // e, dtype=dt, device=pages.device)
            else:
                typed = pages.view(dt)  # [nb, H, region / e]: every field starts at a multiple of its element size
            out[name] = typed[..., at // e : (at + size) // e].unflatten(-1, shapes[name])
            at += size
        return out

    def unpack(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 pages ``[B, H, N * token_bytes]`` -> ``(keys, values)`` ``[B, H, N, D]`` in ``dtype``."""
        B, H, _ = pages.shape
        N, D = self.block_size, self.head_size
        f = self.fields(pages)
        if self.bits == 16:
            return f["k"].contiguous(), f["v"].contiguous()
        G = self.group_size
        qk, qv = self._quantizers()
        kq = QuantizedTensor(
            codes=f["kc"].transpose(-1, -2).contiguous(),
            scales=f["ks"].transpose(-1, -2).contiguous(),
            zeros=f["kz"].transpose(-1, -2).contiguous(),
            bits=self.bits,
            axis="channel",
            group_size=N,
            shape=(B, H, N, D),
            dtype=self.dtype,
        )
        vq = QuantizedTensor(
            codes=f["vc"].transpose(-1, -2).contiguous(),
            scales=f["vs"].transpose(-1, -2).contiguous(),
            zeros=f["vz"].transpose(-1, -2).contiguous(),
            bits=self.bits,
            axis="token",
            group_size=G,
            shape=(B, H, N, D),
            dtype=self.dtype,
        )
        return qk.dequantize(kq), qv.dequantize(vq)


@dataclass(frozen=True)
class CodecPageFormat(_BlockGeometry):
    """A block held in a registered ``kvpages`` codec's format (``KVCOMPRESS_KV_CODEC``): HEX's or HqeKV's
    per-token precision tiers in vLLM's pool, looked up by name (:func:`kvpages.codec`; kv-vllm imports no method).

    The block's bytes (all its heads, ``H * N * token_bytes``, contiguous in vLLM's per-block layout) hold the
    codec's framed blob of the block ``[N, H, D]`` (:meth:`kvpages.PageCodec.encode`: header, payload, checksum),
    then zeros. ``token_bytes`` comes from the codec's declared :meth:`~kvpages.PageCodec.max_encoded_bytes`
    (exact for HEX and HqeKV, whose tier counts are fixed by the block length), rounded up to whole ``dtype``
    elements per (head, token). A block is decoded by :meth:`kvpages.PageCodec.decode` (checksum verified);
    blocks are encoded with the queries' importance where the codec declares ``accepts_importance``.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    codec_name: str
    codec: PageCodec = field(init=False, repr=False, compare=False)
    blob_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = pool_codec(self.codec_name)
        if self.dtype not in DTYPES:
            raise ValueError(f"kvcompress packed KV: KV dtype {self.dtype} is not one of float16, bfloat16, float32")
        if self.block_size < MIN_BLOCK or self.block_size % MIN_BLOCK:
            raise ValueError(
                f"kvcompress packed KV: block size {self.block_size} does not fit codec {self.codec_name!r}; "
                f"use a multiple of {MIN_BLOCK} (--block-size 32 on CPU)"
            )
        try:
            n = c.max_encoded_bytes(self.block_size, self.num_kv_heads, self.head_size, self.dtype)
        except ValueError as exc:
            raise ValueError(
                f"kvcompress packed KV: codec {self.codec_name!r} cannot hold a block of {self.block_size} tokens x "
                f"{self.num_kv_heads} heads x {self.head_size}: {exc}"
            ) from None
        object.__setattr__(self, "codec", c)
        object.__setattr__(self, "blob_bytes", n)

    @property
    def wants_importance(self) -> bool:
        """Whether blocks are encoded with the queries' importance (the codec declares ``accepts_importance``)."""
        return self.codec.accepts_importance

    @property
    def token_bytes(self) -> int:
        """Bytes per (head, token) of the page: vLLM's ``state_content_bytes`` (whole ``dtype`` elements)."""
        e = _nbytes(self.dtype)
        return math.ceil(self.blob_bytes / (self.num_kv_heads * self.block_size) / e) * e

    def _check_pages(self, pages: torch.Tensor) -> None:
        want = (self.num_kv_heads, self.block_size * self.token_bytes)
        if not isinstance(pages, torch.Tensor) or pages.dtype != torch.uint8 or tuple(pages.shape[1:]) != want:
            raise ValueError(
                f"kvcompress packed KV: pages must be uint8 [num_blocks, {want[0]}, {want[1]}], "
                f"got {getattr(pages, 'dtype', type(pages).__name__)} {tuple(getattr(pages, 'shape', ()))}"
            )

    def pack(self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
        """``keys``/``values`` ``[B, H, N, D]`` (and ``importance`` ``[B, N, H]`` when the codec accepts one) ->
        uint8 pages ``[B, H, N * token_bytes]``: each block one :meth:`kvpages.PageCodec.encode` blob, then zeros."""
        B, H, N, _ = self._check_block(keys, values)
        if importance is not None and not self.wants_importance:
            raise ValueError(f"pack: codec {self.codec_name!r} does not accept an importance")
        out = torch.zeros(B, H * N * self.token_bytes, dtype=torch.uint8)
        for b in range(B):
            k = keys[b].to(self.dtype).transpose(0, 1)  # [N, H, D]: the codec's page layout
            v = values[b].to(self.dtype).transpose(0, 1)
            imp = None if importance is None else importance[b]
            blob = self.codec.encode(k, v, importance=imp) if imp is not None else self.codec.encode(k, v)
            if len(blob) > self.blob_bytes:  # the codec broke its declared bound: never write past the page
                raise RuntimeError(
                    f"kvcompress packed KV: codec {self.codec_name!r} wrote {len(blob)} bytes, more than its "
                    f"declared max_encoded_bytes {self.blob_bytes}"
                )
            out[b, : len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return out.view(B, H, N * self.token_bytes).to(keys.device)

    def unpack(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 pages ``[B, H, N * token_bytes]`` -> ``(keys, values)`` ``[B, H, N, D]`` in ``dtype``, each block
        through :meth:`kvpages.PageCodec.decode` (checksum and codec hash verified)."""
        self._check_pages(pages)
        flat = pages.to("cpu").reshape(pages.shape[0], -1)
        ks, vs = [], []
        for b in range(flat.shape[0]):
            raw = flat[b]
            n = frame_length(raw[:OVERHEAD].numpy().tobytes())
            k, v = self.codec.decode(raw[:n].numpy().tobytes())
            ks.append(k.transpose(0, 1))
            vs.append(v.transpose(0, 1))
        if not ks:
            empty = torch.empty(0, self.num_kv_heads, self.block_size, self.head_size, dtype=self.dtype)
            return empty.to(pages.device), empty.clone().to(pages.device)
        return torch.stack(ks).to(pages.device), torch.stack(vs).to(pages.device)


def page_format_for(
    config: PackedKVConfig, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> PageFormat | CodecPageFormat:
    """The pool's block format for ``config``: KIVI pages at ``config.bits``, or ``config.codec``'s blobs."""
    if config.codec is not None:
        return CodecPageFormat(block_size, num_kv_heads, head_size, dtype, config.codec)
    return PageFormat(block_size, num_kv_heads, head_size, dtype, config.bits, config.group_size)


def paged_view(
    fmt: PageFormat,
    pages: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tail_lens: torch.Tensor,
) -> PagedPackedKIVI:
    """The pool as :class:`kvcodec.decode_v2.PagedPackedKIVI`: its code and parameter tensors are views of
    ``pages`` (:meth:`PageFormat.fields`, no copy), the open blocks ``tail_k``/``tail_v`` ``[B, H, R, D]`` given.

    Parameters
    ----------
    fmt : PageFormat
        The pool's format, at 2 or 4 bits (:data:`kvcodec.decode_v2.PAGED_BITS`).
    pages : torch.Tensor
        uint8 ``[num_blocks, H, N * token_bytes]`` (:func:`page_bytes_view`).
    tail_k, tail_v : torch.Tensor
        ``[B, H, R, D]`` in ``fmt.dtype``: each sequence's open block at full precision, rows ``0 .. tail_lens[b]``.
    block_table : torch.Tensor
        int32/int64 ``[B, max_blocks]``: sequence ``b``'s logical block ``i`` at pool block ``block_table[b, i]``.
    seq_lens, tail_lens : torch.Tensor
        int32/int64 ``[B]``: entries per sequence, and how many of them are the open block.

    Returns
    -------
    PagedPackedKIVI
        Keys grouped per channel over the whole block (``group = N``), values in groups of ``fmt.group_size``.

    Raises
    ------
    ValueError
        A format at 8 or 16 bits (the paged layout takes 2 and 4), or pages that do not fit the format.
    """
    if fmt.bits not in PAGED_BITS:
        raise ValueError(
            f"kvcompress packed KV: the paged decode layout takes {PAGED_BITS}-bit pages, not {fmt.bits}-bit ones"
        )
    f = fmt.fields(pages)
    return PagedPackedKIVI(
        kc=f["kc"], ks=f["ks"], kz=f["kz"], vc=f["vc"], vs=f["vs"], vz=f["vz"], tail_k=tail_k, tail_v=tail_v,
        block_table=block_table, seq_lens=seq_lens, tail_lens=tail_lens, kbits=fmt.bits, vbits=fmt.bits,
        group=fmt.block_size, vgroup=fmt.group_size,
    )  # fmt: skip


def page_bytes_view(layer_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's layer view ``[num_blocks, H, N, C]`` (any dtype, head-major blocks) as uint8 ``[num_blocks, H, N*C']``."""
    nb, H, _, _ = layer_cache.shape
    if not layer_cache[0].is_contiguous():
        raise ValueError("kvcompress packed KV: the layer's KV cache view must store each block contiguously (LBHNC)")
    if layer_cache.is_contiguous():
        return layer_cache.view(torch.uint8).reshape(nb, H, -1)
    # blocks are contiguous but strided apart (several layers share one tensor): view each block's bytes
    u8 = layer_cache.view(torch.uint8)
    return u8.as_strided((nb, H, u8.shape[2] * u8.shape[3]), (u8.stride(0), u8.stride(1), 1))


class OpenBlocks:
    """The full-precision tokens of the blocks not packed yet, keyed by vLLM block id (one layer).

    ``write`` stores a step's keys and values by slot (``block * N + offset``); writing offset 0 starts a fresh
    block (a freed block id reused by another request). ``complete()`` lists blocks whose last slot was written:
    the caller packs them after the step's attention and calls ``drop``.

    vLLM does not tell the attention backend when it frees a block, so the partial last block of a finished (or
    preempted) request stays staged until its id is written again. ``trim(keep)`` bounds that: it keeps the
    ``keep`` most recently used entries (between steps each running request has at most one open block, so
    ``keep = 2 * max_num_seqs`` never drops a live one while every running request is scheduled each step).
    A request that needs a dropped block gets a KeyError, never wrong tokens.

    With ``track_importance``, each entry also accumulates a float32 importance ``[N, H]`` (:meth:`add_importance`,
    :func:`paged_attention` adds the attention its tokens draw from the queries of the same block), reset with the
    block; :func:`pack_complete` hands it to a codec that declares ``accepts_importance``.
    """

    def __init__(
        self, num_kv_heads: int, block_size: int, head_size: int, dtype: torch.dtype, track_importance: bool = False
    ) -> None:
        self.shape = (num_kv_heads, block_size, head_size)
        self.dtype = dtype
        self.track_importance = track_importance
        # block id -> [keys [H, N, D], values [H, N, D], written offsets mask, importance [N, H] float32]
        self.blocks: dict[int, list] = {}
        self.used: dict[int, int] = {}  # block id -> tick of its last write or read
        self.tick = 0

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """``keys``/``values`` ``[T, H, D]`` at ``slots`` ``[T]`` (negative slots are padding and skipped)."""
        N = self.shape[1]
        slots = slots.to("cpu", torch.int64)
        T = min(slots.shape[0], keys.shape[0])
        valid = torch.nonzero(slots[:T] >= 0).flatten()
        if valid.numel() == 0:
            return
        s = slots[valid]
        blocks, offsets = s // N, s % N
        for b in torch.unique(blocks).tolist():
            sel = blocks == b
            offs = offsets[sel]
            rows = valid[sel]
            entry = self.blocks.get(b)
            if entry is None or bool((offs == 0).any()):
                entry = [
                    torch.zeros(self.shape, dtype=self.dtype, device=keys.device),
                    torch.zeros(self.shape, dtype=self.dtype, device=keys.device),
                    torch.zeros(N, dtype=torch.bool),
                    torch.zeros(N, self.shape[0], dtype=torch.float32),
                ]
                self.blocks[b] = entry
            entry[0][:, offs] = keys[rows].to(self.dtype).transpose(0, 1)
            entry[1][:, offs] = values[rows].to(self.dtype).transpose(0, 1)
            entry[2][offs] = True
            self._touch(b)

    def _touch(self, block: int) -> None:
        self.tick += 1
        self.used[block] = self.tick

    def complete(self) -> list[int]:
        """Block ids whose every slot has been written."""
        return [b for b, e in self.blocks.items() if bool(e[2].all())]

    def get(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.blocks.get(block)
        if e is None:
            raise KeyError(
                f"kvcompress packed KV: block {block} is open but its full-precision tokens were dropped "
                "(raise max_num_seqs or schedule every running request each step)"
            )
        self._touch(block)
        return e[0], e[1]

    def add_importance(self, block: int, mass: torch.Tensor) -> None:
        """Add ``mass`` ``[n, H]`` (float) to the importance of the block's first ``n`` tokens."""
        e = self.blocks.get(block)
        if e is None:
            raise KeyError(f"kvcompress packed KV: block {block} is not staged")
        e[3][: mass.shape[0]] += mass.to("cpu", torch.float32)

    def importance(self, block: int) -> torch.Tensor:
        """The accumulated importance ``[N, H]`` (float32, CPU) of a staged block."""
        e = self.blocks.get(block)
        if e is None:
            raise KeyError(f"kvcompress packed KV: block {block} is not staged")
        return e[3]

    def drop(self, blocks: list[int]) -> None:
        for b in blocks:
            self.blocks.pop(b, None)
            self.used.pop(b, None)

    def trim(self, keep: int) -> list[int]:
        """Drop all but the ``keep`` most recently used entries; returns the dropped block ids."""
        if len(self.blocks) <= keep:
            return []
        old = sorted(self.blocks, key=lambda b: self.used.get(b, 0))[: len(self.blocks) - keep]
        self.drop(old)
        return old

    @property
    def nbytes(self) -> int:
        n = math.prod(self.shape) * _nbytes(self.dtype) * 2
        return n * len(self.blocks)


def pack_complete(fmt: PageFormat | CodecPageFormat, staged: OpenBlocks, pages: torch.Tensor) -> list[int]:
    """Pack every complete staged block into ``pages`` (uint8 ``[num_blocks, H, N*C]``) once; returns their ids.

    A :class:`CodecPageFormat` whose codec accepts an importance gets each block's accumulated importance (staged
    with ``track_importance``); otherwise the codec ranks the tokens by its own query-free importance."""
    done = staged.complete()
    if done:
        ks = torch.stack([staged.get(b)[0] for b in done])
        vs = torch.stack([staged.get(b)[1] for b in done])
        if isinstance(fmt, CodecPageFormat) and fmt.wants_importance and staged.track_importance:
            packed = fmt.pack(ks, vs, torch.stack([staged.importance(b) for b in done]))
        else:
            packed = fmt.pack(ks, vs)
        ids = torch.tensor(done, dtype=torch.long, device=pages.device)
        pages.index_copy_(0, ids, packed.to(pages.device))
        staged.drop(done)
    return done


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [Hq, Q, D]`` over ``k``/``v`` ``[H, T, D]`` (GQA), optional bool ``mask [Q, T]`` (True: visible).

    Returns ``(out [Hq, Q, D], lse [Hq, Q])`` in float32.
    """
    group = q.shape[0] // k.shape[0]
    kf = k.float().repeat_interleave(group, dim=0)
    vf = v.float().repeat_interleave(group, dim=0)
    logits = (q.float() @ kf.transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    return torch.exp(logits - safe[..., None]) @ vf, lse


def _decode_v2(query, pages, staged, fmt, qsl, lens, table, block_table, rows, scale, output, stats) -> None:
    """The decode requests ``rows`` (one query each) of :func:`paged_attention` through
    :func:`kvcodec.decode_v2.kivi_decode_v2_paged` over :func:`paged_view`: packed blocks read in place, the open
    blocks (one per request: it holds the step's token) stacked from the staging, the only copy a step makes."""
    N = fmt.block_size
    n_packed = [(lens[r] - 1) // N for r in rows]
    opens = [staged.get(int(table[r, n])) for r, n in zip(rows, n_packed, strict=True)]
    dev = pages.device
    tail_k = torch.stack([k for k, _ in opens]).to(dev)
    tail_v = torch.stack([v for _, v in opens]).to(dev)
    seq = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
    tails = seq - N * torch.tensor(n_packed, dtype=torch.int32)
    sel = torch.tensor(rows, dtype=torch.long, device=block_table.device)
    cache = paged_view(fmt, pages, tail_k, tail_v, block_table.index_select(0, sel), seq.to(dev), tails.to(dev))
    starts = torch.tensor([qsl[r] for r in rows], dtype=torch.long, device=query.device)
    q = query.index_select(0, starts)  # [B, Hq, D]
    # check=False: the kernel skips check_values' host sync; vLLM's table and lengths are in range by construction
    out, _ = kivi_decode_v2_paged(q, cache, scale, check=False)
    output.index_copy_(0, starts.to(output.device), out.reshape(len(rows), *output.shape[1:]).to(output.dtype))
    if stats is not None:
        stats["packed_reads"] = stats.get("packed_reads", 0) + sum(n_packed)


def _own_block_mass(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float, ctx: int, start: int, N: int
) -> list[tuple[int, torch.Tensor]]:
    """The attention each staged token draws from the queries of its own block (causal), per KV head.

    ``q`` ``[Hq, Q, D]`` at positions ``ctx .. ctx + Q - 1``, ``k`` ``[H, L - start, D]`` the staged keys from
    position ``start`` (a block boundary), ``lse`` ``[Hq, Q]`` the queries' log-sum-exp over their whole context.
    Returns ``(j, mass [n, H])`` per staged block ``j`` (0-based from ``start``) with a query in it: the
    probability ``exp(q·k·scale - lse)`` summed over those queries and over each KV head's GQA query heads.
    """
    Hq, Q, _ = q.shape
    H = k.shape[0]
    group = Hq // H
    L = ctx + Q
    out = []
    for b0 in range((max(ctx, start) - start) // N * N + start, L, N):
        qa, qb = max(ctx, b0), min(b0 + N, L)
        n = qb - b0  # keys of the block up to the last query in it
        kb = k[:, b0 - start : b0 - start + n].float().repeat_interleave(group, dim=0)  # [Hq, n, D]
        logits = (q[:, qa - ctx : qb - ctx].float() @ kb.transpose(-1, -2)) * scale  # [Hq, nq, n]
        qpos = torch.arange(qa, qb, device=q.device)[:, None]
        kpos = torch.arange(b0, b0 + n, device=q.device)[None, :]
        p = torch.exp(logits - lse[:, qa - ctx : qb - ctx, None].float()).masked_fill(~(kpos <= qpos), 0.0)
        mass = p.sum(1).view(H, group, n).sum(1)  # [H, n]
        out.append(((b0 - start) // N, mass.transpose(0, 1)))
    return out


def paged_attention(
    query: torch.Tensor,
    pages: torch.Tensor,
    staged: OpenBlocks,
    fmt: PageFormat | CodecPageFormat,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    stats: dict | None = None,
    decode: str = "v2",
) -> torch.Tensor:
    """Causal attention of a batch of requests over packed pages + staged full-precision tokens.

    ``query`` ``[T, Hq, D]`` (the step's tokens, requests back to back as ``query_start_loc`` says);
    ``seq_lens`` ``[R]`` each request's length after this step; ``block_table`` ``[R, max_blocks]``. A request
    with ``L`` tokens of which ``Q`` are this step's has its first ``(L - Q) // N`` blocks packed (computed in
    earlier steps or hit in the prefix cache); the rest are staged. Writes ``output[:T]`` (``[T, Hq, D]`` or
    ``[T, Hq*D]``) and returns it. ``stats``, if given, gains ``packed_reads`` (packed blocks read) and
    ``prefill_packed_reads`` (packed blocks read by a request computing more than one token: prefix-cache hits
    and earlier chunks of a chunked prefill).

    ``decode`` (:data:`DECODE_PATHS`) picks how requests computing one token read their packed blocks at 2 and 4
    bits: ``"v2"`` batches them into one :func:`kvcodec.decode_v2.kivi_decode_v2_paged` call over
    :func:`paged_view` of ``pages`` (the paged Triton kernel on CUDA, its PyTorch reference elsewhere; within the
    tolerance contract of ``docs/protocols.md`` of the ``"torch"`` path, not bit-equal), ``"torch"`` dequantizes
    them per request as every other request does. 8- and 16-bit pages and :class:`CodecPageFormat` pools (blocks
    decoded by their codec) always take ``"torch"``.

    With ``staged.track_importance``, each staged token also accumulates the attention probability (normalized
    over the query's whole context) that the queries of its own block put on it, summed over each KV head's query
    heads (:func:`_own_block_mass`): the query-aware importance :func:`pack_complete` gives the codec.
    """
    if decode not in DECODE_PATHS:
        raise ValueError(f"kvcompress packed KV: decode must be one of {DECODE_PATHS}, got {decode!r}")
    N = fmt.block_size
    qsl = query_start_loc.to("cpu").tolist()
    lens = seq_lens.to("cpu").tolist()
    table = block_table.to("cpu")
    done: set[int] = set()
    if isinstance(fmt, PageFormat) and fmt.bits in PAGED_BITS and decode == "v2":
        rows = [r for r in range(len(lens)) if qsl[r + 1] - qsl[r] == 1]
        if rows:
            _decode_v2(query, pages, staged, fmt, qsl, lens, table, block_table, rows, scale, output, stats)
            done = set(rows)
    for r, L in enumerate(lens):
        s, e = qsl[r], qsl[r + 1]
        Q = e - s
        if Q == 0 or r in done:
            continue
        ctx = L - Q
        n_packed = ctx // N
        q = query[s:e].transpose(0, 1)  # [Hq, Q, D]
        parts = []
        if n_packed:
            ids = table[r, :n_packed].to(pages.device, torch.long)
            k, v = fmt.unpack(pages.index_select(0, ids))  # [n, H, N, D]
            k = k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])
            v = v.transpose(0, 1).reshape(v.shape[1], -1, v.shape[-1])
            parts.append(_attend(q, k, v, scale, None))
            if stats is not None:
                stats["packed_reads"] = stats.get("packed_reads", 0) + n_packed
                if Q > 1:
                    stats["prefill_packed_reads"] = stats.get("prefill_packed_reads", 0) + n_packed
        n_blocks = -(-L // N)
        open_ids = [int(b) for b in table[r, n_packed:n_blocks].tolist()]
        ks, vs = zip(*(staged.get(b) for b in open_ids), strict=True)
        start = n_packed * N
        k = torch.cat(ks, dim=1)[:, : L - start]
        v = torch.cat(vs, dim=1)[:, : L - start]
        qpos = torch.arange(ctx, L)[:, None]
        kpos = torch.arange(start, L)[None, :]
        parts.append(_attend(q, k, v, scale, (kpos <= qpos).to(q.device)))
        out, lse = merge_attention(parts) if len(parts) > 1 else parts[0]
        if staged.track_importance:
            for j, mass in _own_block_mass(q, k, lse, scale, ctx, start, N):
                staged.add_importance(open_ids[j], mass)
        dst = output[s:e]
        dst.copy_(out.transpose(0, 1).reshape(dst.shape).to(dst.dtype))
    return output
