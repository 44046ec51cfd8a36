"""vLLM general plugin: registers ``KVCompressConnector`` under its short name in every vLLM process, and, when
``KVCOMPRESS_KV_BITS`` or ``KVCOMPRESS_KV_CODEC`` is set, the packed-KV attention backend
(:mod:`kv_vllm.packed_backend`).

With kv-vllm installed in vLLM's environment, ``"kv_connector": "KVCompressConnector"`` then works without
``kv_connector_module_path``. vLLM may call this more than once per process; it registers once.
"""

from __future__ import annotations

import contextlib

NAME = "KVCompressConnector"


def register() -> None:
    """Register the connector with vLLM's ``KVConnectorFactory`` (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # "already registered": an earlier call in this process
        KVConnectorFactory.register_connector(NAME, "kv_vllm.connector", NAME)
    register_packed_backend()


BACKEND = "kv_vllm.packed_backend.PackedAttentionBackend"


def register_packed_backend() -> bool:
    """With ``KVCOMPRESS_KV_BITS`` or ``KVCOMPRESS_KV_CODEC`` set: validate it and route vLLM's attention to the
    packed-KV backend.

    vLLM's CPU platform always returns the ``CPU_ATTN`` path (it ignores ``--attention-backend CUSTOM``), and
    that path honours registry overrides, so the override of ``CPU_ATTN`` is what selects the backend on CPU;
    ``CUSTOM`` is registered too, for platforms that honour ``--attention-backend CUSTOM``. Raises ValueError
    (one line) for bits it cannot pack, an unknown codec or both flags set. Returns whether the backend was registered.
    """
    from .packed import PackedKVConfig

    if PackedKVConfig.from_env() is None:
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    return True
