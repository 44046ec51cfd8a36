"""A vLLM attention backend whose KV pool holds packed 2/4/8-bit KIVI blocks (see :mod:`kv_vllm.packed`), or
blocks in a registered ``kvpages`` codec's format (HEX's / HqeKV's precision tiers,
:class:`kv_vllm.packed.CodecPageFormat`).

Turned on by ``KVCOMPRESS_KV_BITS`` (2, 4, 8 or 16) or ``KVCOMPRESS_KV_CODEC`` (a codec name, e.g. ``hqekv-2``,
``hex-3``; the two are exclusive) in the engine's environment with kv-vllm installed: the
``vllm.general_plugins`` entry point (:func:`kv_vllm.plugin.register`) then overrides vLLM's ``CPU_ATTN`` backend
path with :class:`PackedAttentionBackend` (``register_backend``). vLLM's CPU platform ignores
``--attention-backend CUSTOM`` (``CpuPlatform.get_attn_backend_cls`` logs "Cannot use CUSTOM backend on CPU" and
returns ``AttentionBackendEnum.CPU_ATTN.get_path()``), but ``get_path`` honours registry overrides, so overriding
``CPU_ATTN`` is how an out-of-tree backend runs on CPU without a platform plugin.

``customize_spec`` sets the layer's ``state_content_bytes`` to the packed page's bytes per (head, token) before
vLLM sizes the pool, so the same KV memory holds more blocks. Start-up refuses, with one line: MLA, sliding-window
layers, quantized (fp8) KV caches, non-decoder attention, ALiBi / soft-capping / sinks, a KV connector on the same
engine, bits it cannot pack and a block size or group size that breaks KIVI's grouping.

Decode steps at 2 and 4 bits (requests computing one token) run batched through
:func:`kvcodec.decode_v2.kivi_decode_v2_paged` over the pool viewed in place as a
:class:`kvcodec.decode_v2.PagedPackedKIVI` (:func:`kv_vllm.packed.paged_view`; the page format stores the kernel's
token-inner order, so no packed byte is copied): the paged Triton kernel on CUDA, its PyTorch reference on CPU
(faster there than dequantizing). At 8 and 16 bits (the paged layout takes 2 and 4), and for every prefill or
chunk, attention runs in PyTorch (dequantize + matmul), one request at a time. The open blocks are stacked from the
staging each decode step (a copy of at most one full-precision block per request and layer), and the step still
reads lengths and the block table on the host (no CUDA graphs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .packed import (
    ENV_BITS,
    ENV_CODEC,
    MIN_BLOCK,
    CodecPageFormat,
    OpenBlocks,
    PackedKVConfig,
    PageFormat,
    check_layer,
    pack_complete,
    page_bytes_view,
    page_format_for,
    paged_attention,
)

logger = logging.getLogger(__name__)
NAME = "CUSTOM"  # vLLM maps get_name() back to an AttentionBackendEnum member: out-of-tree backends are CUSTOM


def active_config() -> PackedKVConfig:
    """The config from ``KVCOMPRESS_KV_BITS`` / ``KVCOMPRESS_KV_GROUP`` or ``KVCOMPRESS_KV_CODEC`` (4-bit KIVI,
    groups of 32 if unset)."""
    return PackedKVConfig.from_env() or PackedKVConfig()


def refuse(message: str) -> None:
    raise ValueError(f"kvcompress packed KV ({ENV_BITS} / {ENV_CODEC}): {message}")


def _check_spec(spec: AttentionSpec) -> None:
    mode = getattr(spec, "kv_quant_mode", None)
    check_layer(
        type(spec).__name__,
        getattr(spec, "sliding_window", None),
        getattr(mode, "name", "NONE") if mode is not None else "NONE",
        spec.head_size,
        spec.head_size_v,
    )


def page_format(spec: AttentionSpec, config: PackedKVConfig | None = None) -> PageFormat | CodecPageFormat:
    return page_format_for(config or active_config(), spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)


class PackedAttentionBackend(AttentionBackend):
    """KIVI-packed KV blocks in vLLM's pool; attention over packed blocks + the open block (module docstring)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(MIN_BLOCK)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Validate the layer and shrink its page to the packed size (vLLM sizes the pool from this)."""
        if spec.state_content_bytes is not None:
            refuse(f"the layer's page was already customized ({spec.state_content_bytes} bytes per token)")
        _check_spec(spec)
        return replace(spec, state_content_bytes=page_format(spec).token_bytes)

    @staticmethod
    def get_impl_cls() -> type[PackedAttentionImpl]:
        return PackedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PackedMetadataBuilder]:
        return PackedMetadataBuilder


@dataclass
class PackedMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [R + 1], CPU
    seq_lens: torch.Tensor  # [R], CPU
    block_table: torch.Tensor  # [R, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    block_size: int


class PackedMetadataBuilder(AttentionMetadataBuilder[PackedMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        if vllm_config.kv_transfer_config is not None:
            refuse("a KV connector cannot run on packed pages yet; drop --kv-transfer-config or unset the flag")

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PackedMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            refuse("non-causal attention is not supported")
        return PackedMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs].cpu(),
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping,
            block_size=self.block_size,
        )


class PackedAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **_: object,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            refuse(f"{attn_type} attention is not supported; only decoder self-attention")
        if sliding_window is not None:
            refuse(f"sliding-window layers (window {sliding_window}) are not supported; only full attention")
        if kv_cache_dtype != "auto":
            refuse(f"--kv-cache-dtype {kv_cache_dtype} cannot be packed again; use auto")
        if alibi_slopes is not None or logits_soft_cap or sinks is not None:
            refuse("ALiBi, logit soft-capping and attention sinks are not supported")
        if kv_sharing_target_layer_name is not None:
            refuse("cross-layer KV sharing is not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.config = active_config()
        from vllm.config import get_current_vllm_config

        seqs = getattr(get_current_vllm_config().scheduler_config, "max_num_seqs", None) or 256
        self.keep_open = 2 * int(seqs)  # staged open blocks kept between steps (see OpenBlocks.trim)
        self.stats: dict[str, int] = {"packed_blocks": 0, "packed_reads": 0, "prefill_packed_reads": 0}
        self.fmt: PageFormat | CodecPageFormat | None = None
        self.staged: OpenBlocks | None = None

    def _setup(self, block_size: int, dtype: torch.dtype) -> None:
        if self.fmt is None or self.fmt.block_size != block_size:
            self.fmt = page_format_for(self.config, block_size, self.num_kv_heads, self.head_size, dtype)
            track = isinstance(self.fmt, CodecPageFormat) and self.fmt.wants_importance
            self.staged = OpenBlocks(self.num_kv_heads, block_size, self.head_size, dtype, track_importance=track)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """Stage the step's keys and values at full precision; pages are written when a block completes."""
        self._setup(kv_cache.shape[2], kv_cache.dtype)
        self.staged.write(key, value, slot_mapping)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PackedMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the packed KV backend")
        if attn_metadata is None:  # profiling / warm-up
            return output
        self._setup(kv_cache.shape[2], kv_cache.dtype)
        pages = page_bytes_view(kv_cache)
        n = attn_metadata.num_actual_tokens
        paged_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            pages,
            self.staged,
            self.fmt,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            self.scale,
            output[:n],
            self.stats,
        )
        self.stats["packed_blocks"] += len(pack_complete(self.fmt, self.staged, pages))
        self.staged.trim(self.keep_open)
        return output
